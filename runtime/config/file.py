"""One YAML configuration file, validated once into the typed config (`SpineConfig`).

`load_config` reads the file through the strict loader (`runtime.config.yamlsource`: duplicate keys
are refused, every key keeps its line), merges the overrides given in code over it and
validates the result against the root model (`runtime.config.model.SpineConfig`, whose
fields hold the defaults) before anything starts. Every problem is reported, one line each,
as `FILE:LINE: PATH: WHAT`. What it returns is passed down as it is: each part reads its
own section (`config.inference`, `config.tls`), never the file again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from runtime.config.model import SECTIONS as SECTIONS
from runtime.config.model import SpineConfig, merge, root_model
from runtime.config.yamlsource import LocatedData, YamlSourceError, load_located, parent_path
from services.common import ConfigError
from services.common.config_section import ConfigProblems, Problem, describe
from services.registry import COMPONENTS, DEFAULT, MIDDLEWARES, Registry

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parents[1] / "default_config.yaml"
LAYOUTS = ("layered", "collapsed", "mixed")


@dataclass(frozen=True)
class _Source:
    """One YAML file that went into a config, with the line of every key in it."""

    name: str  # "" for the overrides given in code, which have no lines
    located: LocatedData


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None,
                registry: Registry = DEFAULT) -> SpineConfig:
    """The config of the file at `path` (none: every default) with `overrides` merged over it.

    Raises ConfigProblems (a ConfigError) listing every problem: YAML errors, duplicate keys,
    unknown sections and keys, bad values. `registry`: a component table with more components
    than the default one (their sections are checked like every other)."""
    sources = [] if path is None else [_read(Path(path))]
    found = [(index, line, f"{source.name}:{line}: {key}: duplicate key")
             for index, source in enumerate(sources) for key, line in source.located.duplicates]
    data: dict[str, Any] = {}
    for source in sources:
        data = merge(data, source.located.data or {})
    if overrides:
        data = merge(data, overrides)
        sources.append(_Source("", LocatedData(overrides, dict.fromkeys(_paths(overrides), 0))))
    model = root_model(registry)
    try:
        config = model.model_validate(data, context={"written": data})
    except ValidationError as error:
        found += [_locate(problem, sources) for problem in describe(error, model)]
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


def placements_for(layout: str, config: SpineConfig) -> dict[str, str]:
    """Every component's placement for a layout name (`mixed`: the config's `placements:`)."""
    if layout == "layered":
        return dict.fromkeys(config.placements.names(), "remote")
    if layout == "collapsed":
        return dict.fromkeys(config.placements.names(), "local")
    if layout != "mixed":
        raise ConfigError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    return config.placements.names()


def check_placements(placements: Mapping[str, Any] | None) -> dict[str, str]:
    """A placement map checked as `placements:` is; components left out are where the
    component table puts them. A foreign endpoint (`{remote: HOST:PORT, protocol: ...}`,
    see `runtime.placement.foreign`) is `remote`."""
    return type(SpineConfig().placements).parse(placements, "placements").names()


def remote_addresses(config: SpineConfig) -> dict[str, str]:
    """Where remote components already run (e.g. Kubernetes Services), instead of spawning them.

    `remote_addresses: {auth: "dns:///spine-auth.spine.svc.cluster.local:50061", ...}`
    """
    return config.remote_addresses.given()


def layout_name(placements: Mapping[str, str]) -> str:
    """'layered', 'collapsed' or 'mixed' for a placement map (the x-spine-layout label)."""
    values = set(placements.values())
    if values == {"remote"}:
        return "layered"
    if values == {"local"}:
        return "collapsed"
    return "mixed"


def internal_key(config: SpineConfig, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The deployment's internal secret (`internal:`), or None when there is none."""
    import os

    try:
        return config.internal.key(os.environ if environ is None else environ)
    except ValueError as error:
        raise ConfigError(f"internal.secret_env: {error}") from None


def dev_api_key(config: SpineConfig) -> str | None:
    """The plain dev key from the config (dev configs only; production ones hold hashes)."""
    for entry in config.auth.api_keys:
        if entry.key is not None:
            return entry.key.get_secret_value()
    return None


__all__ = ["COMPONENTS", "MIDDLEWARES", "SECTIONS", "ConfigError", "SpineConfig", "load_config", "merge",
           "placements_for", "check_placements", "layout_name"]
