"""One YAML configuration file, laid over the documented default (`default_config.yaml`).

`load_config` reads both through the strict loader (`runtime.yamlsource`: duplicate
keys are refused, every key keeps its line), merges them and validates the result against
the root model (`runtime.config_model.SpineConfig`) before anything starts. Every
problem is reported, one line each, as `FILE:LINE: PATH: WHAT`. It returns the merged
mapping, which components read through their own section models.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.config_model import SECTIONS as SECTIONS
from runtime.config_model import config_problems
from runtime.sections import InternalConfig, placement_name, placements_model, remote_addresses_model
from runtime.yamlsource import LocatedData, YamlSourceError, load_located, parent_path
from services.common import ConfigError
from services.common.config_section import ConfigProblems, Problem
from services.registry import COMPONENTS, DEFAULT, MIDDLEWARES

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent / "default_config.yaml"
LAYOUTS = ("layered", "collapsed", "mixed")


@dataclass(frozen=True)
class _Source:
    """One YAML file that went into a config, with the line of every key in it."""

    name: str  # "" for the overrides given in code, which have no lines
    located: LocatedData


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The default config, with the file at `path` and then `overrides` merged over it, validated.

    Raises ConfigProblems (a ConfigError) listing every problem: YAML errors, duplicate keys,
    unknown sections and keys, bad values."""
    sources = [_read(DEFAULT_CONFIG_PATH)]
    if path is not None:
        sources.append(_read(Path(path)))
    found = [(index, line, f"{source.name}:{line}: {key}: duplicate key")
             for index, source in enumerate(sources) for key, line in source.located.duplicates]
    config: dict[str, Any] = {}
    for source in sources:
        config = merge(config, source.located.data or {})
    if overrides:
        config = merge(config, overrides)
        sources.append(_Source("", LocatedData(overrides, dict.fromkeys(_paths(overrides), 0))))
    found += [_locate(problem, sources) for problem in config_problems(config)]
    if found:
        raise ConfigProblems([text for _, _, text in sorted(found)])  # file by file, top to bottom
    return config


def _read(path: Path) -> _Source:
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigProblems([f"{path}: cannot read the config file: {error.strerror}"]) from error
    try:
        located = load_located(text, strict=False)
    except YamlSourceError as error:
        raise ConfigProblems([f"{path}:{error.line}: {error}"]) from None
    if located.data is not None and not isinstance(located.data, Mapping):
        raise ConfigProblems([f"{path}:{located.line('')}: the top level must be a mapping of sections, "
                              f"got {type(located.data).__name__}"])
    return _Source(str(path), located)


def _locate(problem: Problem, sources: Sequence[_Source]) -> tuple[int, int, str]:
    """(source index, line, `FILE:LINE: problem`) at the deepest key of the problem's path that a
    file spells out (the user's file over the default on a tie); unlocated (overrides) sort last."""
    best: tuple[int, int, int] | None = None  # (levels above the problem's path, source index, line)
    for index in reversed(range(len(sources))):
        lines = sources[index].located.lines
        path, up = problem.path, 0
        while path and path not in lines:
            path, up = parent_path(path), up + 1
        if path and (best is None or up < best[0]):
            best = (up, index, lines[path])
    if best is None or not sources[best[1]].name:
        return len(sources), 0, str(problem)
    _, index, line = best
    return index, line, f"{sources[index].name}:{line}: {problem}"


def _paths(data: Any, prefix: str = "") -> list[str]:
    """Every key path in plain data, in the yamlsource format (`a.b[0].c`)."""
    if isinstance(data, Mapping):
        items = [(f"{prefix}.{key}" if prefix else str(key), value) for key, value in data.items()]
    elif isinstance(data, list | tuple):
        items = [(f"{prefix}[{index}]", value) for index, value in enumerate(data)]
    else:
        return []
    return [path for child, value in items for path in (child, *_paths(value, child))]


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge mappings; lists and scalars in `over` replace those in `base`."""
    result = copy.deepcopy(dict(base))
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def placements_for(layout: str, config: Mapping[str, Any]) -> dict[str, str]:
    """Every component's placement for a layout name."""
    if layout == "layered":
        return dict.fromkeys(COMPONENTS, "remote")
    if layout == "collapsed":
        return dict.fromkeys(COMPONENTS, "local")
    if layout != "mixed":
        raise ConfigError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    return check_placements(config.get("placements"))


def check_placements(placements: Mapping[str, Any] | None) -> dict[str, str]:
    """Validate a placement map; components left out default to remote (inference: local).
    A foreign endpoint (`{remote: HOST:PORT, protocol: ...}`, see `runtime.foreign`) is `remote`."""
    model = placements_model(COMPONENTS, DEFAULT.models, DEFAULT.foreign_protocols)
    return {name: placement_name(placement) for name, placement in model.parse(placements, "placements")}


def remote_addresses(config: Mapping[str, Any]) -> dict[str, str]:
    """Where remote components already run (e.g. Kubernetes Services), instead of spawning them.

    `remote_addresses: {auth: "dns:///spine-auth.spine.svc.cluster.local:50061", ...}`
    """
    model = remote_addresses_model(COMPONENTS)
    return model.parse(config.get("remote_addresses"), "remote_addresses").given()  # type: ignore[attr-defined]


def layout_name(placements: Mapping[str, str]) -> str:
    """'layered', 'collapsed' or 'mixed' for a placement map (the x-spine-layout label)."""
    values = set(placements.values())
    if values == {"remote"}:
        return "layered"
    if values == {"local"}:
        return "collapsed"
    return "mixed"


def internal_key(config: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> bytes | None:
    """The deployment's internal secret (`internal:`), or None when there is none."""
    import os

    section = InternalConfig.parse(config.get("internal"), "internal")
    try:
        return section.key(os.environ if environ is None else environ)
    except ValueError as error:
        raise ConfigError(f"internal.secret_env: {error}") from None


def dev_api_key(config: Mapping[str, Any]) -> str | None:
    """The plain dev key from the config (dev configs only; production ones hold hashes)."""
    for entry in (config.get("auth") or {}).get("api_keys") or []:
        if isinstance(entry, Mapping) and entry.get("key"):
            return str(entry["key"])
    return None


__all__ = ["COMPONENTS", "MIDDLEWARES", "SECTIONS", "ConfigError", "load_config", "merge", "placements_for",
           "check_placements", "layout_name"]
