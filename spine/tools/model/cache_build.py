"""`spine cache build --prompts FILE --out PATH`: the pre-generated answer table.

Each line of FILE is one JSON object: `model` (an id or alias of the config's router),
`prompt`, `max_tokens` and optionally `system`. Every prompt runs through the config's
model in-process, in deterministic mode and greedy (temperature 0), as the inference
component would answer it; the answers go to one table file (`services.cache.pregenerated`),
written atomically, that `cache.pregenerated: PATH` maps. A table holds one model's answers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.config.file import SpineConfig, load_config
from services.cache.pregenerated import PregeneratedTable, describe, served_digests, table_key, write_table
from services.common import ConfigError
from services.common.json_object import json_object
from services.router.config import RouterConfig
from wire.v1 import generation_pb2


@dataclass(frozen=True)
class PromptLine:
    """One line of the prompts file, its model resolved to an id."""

    model: str
    system: str
    prompt: str
    max_tokens: int


def read_prompts(path: Path, router: RouterConfig) -> list[PromptLine]:
    """Every line of `path` (blank lines skipped); ConfigError names the line and the field."""
    names = {model.id: model.id for model in router.models}
    names.update({alias: model.id for model in router.models for alias in model.aliases})
    lines: list[PromptLine] = []
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(f"--prompts: cannot read {path}: {error.strerror or error}") from None
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        item = json_object(raw, where, ConfigError)
        unknown = sorted(set(item) - {"model", "system", "prompt", "max_tokens"})
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {unknown}; fields: model, system, prompt, max_tokens")
        model, system, prompt, max_tokens = (item.get("model"), item.get("system", ""), item.get("prompt"),
                                             item.get("max_tokens"))
        if not isinstance(model, str) or model not in names:
            raise ConfigError(f"{where}: model: {model!r} is not a model id or alias; known: {', '.join(names)}")
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError(f"{where}: prompt: expected a non-empty string")
        if not isinstance(system, str):
            raise ConfigError(f"{where}: system: expected a string")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ConfigError(f"{where}: max_tokens: expected an integer >= 1, got {max_tokens!r}")
        lines.append(PromptLine(names[model], system, prompt, max_tokens))
    if not lines:
        raise ConfigError(f"--prompts: {path} holds no prompt")
    models = sorted({line.model for line in lines})
    if len(models) > 1:
        raise ConfigError(f"--prompts: a table holds one model's answers; {path} names {', '.join(models)} "
                          f"(build one table per model)")
    return lines


def answer_prompts(servicer: Any, model: str,
                   lines: list[PromptLine]) -> list[tuple[bytes, generation_pb2.GenerateResponse]]:
    """Each line's greedy answer from `servicer` (an inference servicer), under its table key."""
    from services.pipeline.local_context import LocalContext

    answers = []
    for line in lines:
        request = generation_pb2.GenerateRequest(model=model, system=line.system, prompt=line.prompt,
                                                 max_tokens=line.max_tokens, temperature=0.0)
        answer = servicer.Generate(request, LocalContext())
        answer.cached = False
        answers.append((table_key(model, line.system, line.prompt, line.max_tokens), answer))
    return answers


def build_table(config: SpineConfig, prompts: Path, out: Path) -> dict[str, Any]:
    """Answer every prompt with the model (deterministic, greedy) and write the table."""
    from monolith.device_on_use import DeviceOnFirstUse
    from services.registry import DEFAULT

    config = config.with_overrides({"inference": {"deterministic": True}})
    lines = read_prompts(prompts, config.router)
    model = lines[0].model
    digests = served_digests(config.inference)
    if model not in digests:
        raise ConfigError(f"--prompts: model {model!r} is routed but not served by inference "
                          f"(served: {', '.join(digests)})")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="spine-cache-build-") as run_dir:
        servicer = DEFAULT["inference"].build(config, DeviceOnFirstUse(config.device), Path(run_dir))
        try:
            answers = answer_prompts(servicer, model, lines)
        finally:
            servicer.close()
    entries = write_table(out, model, digests[model], answers)
    table = PregeneratedTable(out, digests)  # read back: what was written is what a server maps
    try:
        return {**describe(table), "entries": entries, "seconds": round(time.perf_counter() - started, 3)}
    finally:
        table.close()


def cmd_cache(args: argparse.Namespace) -> int:
    summary = build_table(load_config(args.config), Path(args.prompts), Path(args.out))
    print(json.dumps(summary))
    print(f"wrote {summary['entries']} answers of {summary['model']} to {args.out}; serve them with "
          f"`cache.pregenerated: {args.out}`", file=sys.stderr)
    return 0


def add_cache_parser(sub: Any) -> None:
    """`spine cache build` on the CLI's subparsers."""
    cache = sub.add_parser("cache", help="the response cache: `build` writes a table of pre-generated answers")
    actions = cache.add_subparsers(dest="action", required=True)
    build = actions.add_parser("build", help="answer prompts with the model (greedy, deterministic) into a table "
                                             "file for cache.pregenerated")
    build.add_argument("--prompts", required=True, metavar="FILE",
                       help="one JSON object a line: model, system (optional), prompt, max_tokens")
    build.add_argument("--out", required=True, metavar="PATH", help="the table file (replaced atomically)")
    build.set_defaults(handler=cmd_cache)
