"""The `logs:` config section: where request logs go and how they are flushed.

A light module (pydantic, no torch): loading or checking a config, or printing its schema,
imports only this; defaults are documented in `runtime/default_config.yaml`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
)

from services.common.config_section import Float, Section, problem


class LogsConfig(Section):
    """The `logs` section. A relative `path` is in the run directory (`path_in`)."""

    where = "logs"

    path: Path = Path("requests.jsonl")
    batch_lines: Annotated[StrictInt, Field(ge=1)] = 64
    flush_interval_s: Annotated[Float, Field(gt=0)] = 0.5
    ring_capacity: Annotated[StrictInt, Field(ge=1)] = 4096
    full_wait_s: Annotated[Float, Field(ge=0)] = 0.05
    max_line_bytes: Annotated[StrictInt, Field(ge=256)] = 65536
    fsync: StrictBool = True

    @field_validator("path", mode="before")
    @classmethod
    def _path_is_text(cls, value: Any) -> Any:
        if not isinstance(value, str | Path) or not str(value).strip():
            raise problem("expected a file path", show_input=True)
        return value

    @field_validator("ring_capacity")
    @classmethod
    def _ring_holds_a_batch(cls, capacity: int, info: ValidationInfo) -> int:
        batch = info.data.get("batch_lines")
        if batch is not None and capacity < batch:
            raise problem(f"must be >= logs.batch_lines ({batch})", show_input=True)
        return capacity

    def path_in(self, run_dir: str | Path) -> Path:
        """Where the log is written by a process whose run directory is `run_dir`."""
        return Path(run_dir) / self.path.expanduser()
