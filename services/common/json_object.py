"""Reading one JSON object out of a line or a file, with errors that name where.

The prompt files (`spine cache build --prompts`), the A/B traces (`spine.tools.workload.recorded`) and a
model directory's config.json (`services.inference.model.hf_check`) each hold JSON objects a
person wrote or recorded; each error says the file and line, what is wrong, and is raised as
the caller's own error class (a ConfigError, a TraceError).
"""

from __future__ import annotations

import json
from typing import Any


def json_object(text: str, where: str, error: type[Exception]) -> dict[str, Any]:
    """`text` parsed as one JSON object; `error(f"{where}: …")` when it is not JSON or not an object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as failure:
        raise error(f"{where}: not valid JSON ({failure.msg} at line {failure.lineno} column {failure.colno})") from None
    if not isinstance(value, dict):
        raise error(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value
