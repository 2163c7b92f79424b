"""`spine up --model DIR`: serve a transformers model directory as the default model
(`--model sim`: the device-time simulator, `services.inference.model.sim_backend`).

`model_overrides` is the config that says so — the inference backend (`class: hf`), its
model id, and the router's one route to it, under the alias `default` — so that every
layout, and every child process of the layered one (which read the run's merged config),
serves the same model under the same names. `preflight` checks the directory in the
parent process before any child starts, so a directory that cannot be served is one line
and exit 2 in every layout, not a child's crash loop.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime.config.model import SpineConfig
from services.common import ConfigError
from services.inference.config import HF_CLASS, SIM_CLASS

DEFAULT_ALIAS = "default"


def model_id_for(path: str | Path) -> str:
    """The id a directory is served under when none is given: its name (`/models/tiny-llama/` → `tiny-llama`);
    `sim` (the device-time simulator) is served as `sim`."""
    if str(path) == SIM_CLASS:
        return SIM_CLASS
    name = Path(path).expanduser().resolve().name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"


def model_overrides(path: str | Path, model_id: str | None = None, *,
                    aliases: tuple[str, ...] = (DEFAULT_ALIAS,),
                    sim_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Config overrides that serve `path` as `model_id` (default: the directory's name), alias `default`.

    `path` "sim" serves the device-time simulator (`services.inference.model.sim_backend`) with its
    default profile and `sim_options` over it (a directory named sim: `./sim`)."""
    served = model_id or model_id_for(path)
    if served in aliases:
        raise ConfigError(f"--model-id: {served!r} is an alias of the served model; choose another id")
    backend: dict[str, Any] = {"class": HF_CLASS, "options": {"path": str(Path(path).expanduser().resolve())}}
    if str(path) == SIM_CLASS:
        backend = {"class": SIM_CLASS, "options": dict(sim_options or {})}
    return {
        "inference": {"model_id": served,
                      "backend": backend,
                      "models": []},  # the directory alone: the default config's other models are not routed
        "router": {"models": [{"id": served, "backend": "inference", "aliases": list(aliases)}]},
    }


def preflight(config: SpineConfig) -> None:
    """For an `hf` backend: the directory, its architecture, the context asked for and the
    weights against the device budget, checked without loading anything (ConfigError)."""
    backend = config.inference.backend
    if backend.class_ != HF_CLASS:
        return
    from monolith.device import budget_bytes, pick_device
    from services.inference.model.hf_check import check_context, check_weights_fit, inspect_model_dir

    options = backend.options
    where = "inference.backend.options"
    if not options.get("path"):
        raise ConfigError(f"{where}.path: the model directory is required (class: hf)")
    dtype = options.get("dtype")
    info = inspect_model_dir(options["path"], f"{where}.path", dtype if isinstance(dtype, str) else None)
    check_context(info, options.get("max_context", backend.max_context), f"{where}.max_context")
    budget = budget_bytes(pick_device(), config.device)
    check_weights_fit(info, budget, budget)
