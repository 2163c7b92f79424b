"""The request path's modules, compiled (Cython) where a build of them matches the source.

Why: the spine's own work per request is ~540 Python calls (cProfile, warm) spread evenly over
the gateway, the pipeline's runner and the middlewares' decisions (no single piece above a
tenth of it: `make profile`); on one core that CPU is what the spine costs next to the bare
model. The same modules compiled by Cython, unchanged, run that work without the bytecode
loop: the warm request path (`python -m bench.warm_path`, eight runs each way, taking turns)
143 → 98 µs at best, 198 → 166 µs in the median, on a noisy host. The .py
files stay the source and the reference: a module runs compiled only when the build
holds a binary made from exactly its current text, and otherwise as Python.

How: `python -m spine.tools.build_compiled` (run by `make install`) compiles `MODULES` into
`build/compiled/<interpreter>/` and writes a manifest of each binary with the sha256 of the
source it was made from. `install()` — called by the `services`, `monolith` and `spine`
packages' `__init__`, so before any of their modules is imported — puts a finder first on
`sys.meta_path` that loads a listed module from its binary when the source's hash matches,
and leaves every other import (and a module whose source changed since the build: an edit
is never shadowed by a stale binary) to Python's own finders. `SPINE_COMPILED=0` turns it
off (py-spy sees no Python frames inside compiled code: `make profile` runs the source).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ENV = "SPINE_COMPILED"
ROOT = Path(__file__).resolve().parents[1]  # the checkout: services/, monolith/, spine/ live here
BUILD_DIR = ROOT / "build" / "compiled" / sys.implementation.cache_tag
MANIFEST = BUILD_DIR / "manifest.json"

# What runs on every request of the spine (and of the layered stack's components), none of
# which defines a pydantic model (pydantic cannot read the methods of a class Cython compiled:
# such models live in modules of their own, e.g. `services.auth_config`) and none of which
# the bare model service runs: the ratios to bare compare the same model code on both sides.
MODULES: tuple[str, ...] = (
    "monolith.batched",
    "monolith.batcher",
    "services.auth",
    "services.cache",
    "services.cache_index",
    "services.cache_stages",
    "services.concurrency",
    "services.histograms",
    "services.log_ring",
    "services.logs",
    "services.metrics",
    "services.metrics_stage",
    "services.pipeline.batch_rpc",
    "services.pipeline.gateway",
    "services.pipeline.internal_marks",
    "services.pipeline.model_load",
    "services.pipeline.runner",
    "services.pipeline.stage",
    "services.pipeline.state",
    "services.pipeline.validation",
    "services.pipeline.verdicts",
    "services.ratelimit",
    "services.ratelimit_admission",
    "services.ratelimit_stages",
    "services.redact",
    "services.router",
    "services.token_buckets",
    "spine.runtime.bindings",
    "spine.runtime.local_context",
)


def source_path(module: str) -> Path:
    """Where a listed module's source is in the checkout."""
    return ROOT.joinpath(*module.split(".")).with_suffix(".py")


def source_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(path: Path = MANIFEST) -> dict[str, dict[str, str]]:
    """module -> {"source_sha256", "binary"} of the current build ({} without one)."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(entries, dict) or entries.get("ext_suffix") != sysconfig.get_config_var("EXT_SUFFIX"):
        return {}
    modules = entries.get("modules")
    return modules if isinstance(modules, dict) else {}


class CompiledFinder(importlib.abc.MetaPathFinder):
    """Finds a listed module's binary when it was built from the module's current source."""

    def __init__(self, manifest: dict[str, dict[str, str]], build_dir: Path = BUILD_DIR) -> None:
        self._manifest = manifest
        self._build_dir = build_dir
        self.loaded: list[str] = []  # the modules it loaded compiled, in import order
        self.stale: list[str] = []  # listed and built, but the source changed since: Python's

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        entry = self._manifest.get(fullname)
        if entry is None:
            return None
        source = source_path(fullname)
        binary = self._build_dir / entry.get("binary", "")
        try:
            current = source_digest(source)
        except OSError:
            return None
        if current != entry.get("source_sha256") or not binary.is_file():
            self.stale.append(fullname)
            return None
        loader = importlib.machinery.ExtensionFileLoader(fullname, str(binary))
        spec = importlib.util.spec_from_file_location(fullname, binary, loader=loader)
        if spec is not None:
            self.loaded.append(fullname)
        return spec


def installed() -> CompiledFinder | None:
    """The finder on `sys.meta_path`, if `install` put one there."""
    return next((finder for finder in sys.meta_path if isinstance(finder, CompiledFinder)), None)


def install(env: Any = os.environ) -> CompiledFinder | None:
    """Put the finder first on `sys.meta_path` (once; nothing without a build or with
    SPINE_COMPILED=0). Returns it."""
    finder = installed()
    if finder is not None or env.get(ENV, "1").strip() == "0":
        return finder
    manifest = read_manifest()
    if not manifest:
        return None
    finder = CompiledFinder(manifest)
    sys.meta_path.insert(0, finder)
    return finder
