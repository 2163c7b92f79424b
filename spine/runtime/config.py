"""One YAML configuration file, laid over the documented default (`default_config.yaml`).

Each component reads its own section; this module only merges, checks the top-level
shape and turns a layout name into placements.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from services.common import ConfigError
from services.registry import COMPONENTS, MIDDLEWARES, PLACEMENTS

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parents[1] / "default_config.yaml"
SECTIONS = frozenset(
    {"listen", "placements", "limits", "auth", "ratelimit", "router", "cache", "metrics", "logs",
     "inference", "batching", "tracing", "shadow", "split", "remote_addresses"}
)
LAYOUTS = ("layered", "collapsed", "mixed")


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The default config, with the file at `path` and then `overrides` merged over it."""
    config = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as error:
            raise ConfigError(f"cannot read config file {path}: {error.strerror}") from error
        except yaml.YAMLError as error:
            raise ConfigError(f"config file {path} is not valid YAML: {error}") from error
        if not isinstance(loaded, Mapping):
            raise ConfigError(f"config file {path}: the top level must be a mapping")
        config = merge(config, loaded)
    if overrides:
        config = merge(config, overrides)
    unknown = sorted(set(config) - SECTIONS)
    if unknown:
        raise ConfigError(f"unknown config section(s) {unknown}; known: {sorted(SECTIONS)}")
    return config


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
    return check_placements(config.get("placements") or {})


def check_placements(placements: Mapping[str, Any]) -> dict[str, str]:
    """Validate a placement map; components left out default to remote (inference: local)."""
    unknown = sorted(set(placements) - set(COMPONENTS))
    if unknown:
        raise ConfigError(f"placements: unknown component(s) {unknown}; known: {', '.join(COMPONENTS)}")
    result: dict[str, str] = {}
    for name in COMPONENTS:
        value = placements.get(name, "local" if name == "inference" else "remote")
        if value not in PLACEMENTS:
            raise ConfigError(f"placements.{name}: must be 'local' or 'remote', got {value!r}")
        result[name] = value
    return result


def remote_addresses(config: Mapping[str, Any]) -> dict[str, str]:
    """Where remote components already run (e.g. Kubernetes Services), instead of spawning them.

    `remote_addresses: {auth: "dns:///spine-auth.spine.svc.cluster.local:50061", ...}`
    """
    value = config.get("remote_addresses") or {}
    if not isinstance(value, Mapping):
        raise ConfigError("remote_addresses: expected a mapping of component to gRPC target")
    unknown = sorted(set(value) - set(COMPONENTS))
    if unknown:
        raise ConfigError(f"remote_addresses: unknown component(s) {unknown}; known: {', '.join(COMPONENTS)}")
    for name, target in value.items():
        if not isinstance(target, str) or not target:
            raise ConfigError(f"remote_addresses.{name}: expected a gRPC target string, got {target!r}")
    return dict(value)


def layout_name(placements: Mapping[str, str]) -> str:
    """'layered', 'collapsed' or 'mixed' for a placement map (the x-spine-layout label)."""
    values = set(placements.values())
    if values == {"remote"}:
        return "layered"
    if values == {"local"}:
        return "collapsed"
    return "mixed"


def dev_api_key(config: Mapping[str, Any]) -> str | None:
    """The plain dev key from the config (dev configs only; production ones hold hashes)."""
    for entry in (config.get("auth") or {}).get("api_keys") or []:
        if isinstance(entry, Mapping) and entry.get("key"):
            return str(entry["key"])
    return None


__all__ = ["MIDDLEWARES", "load_config", "merge", "placements_for", "check_placements", "layout_name"]
