"""The compiled request path (`services.compiled`): used where built, never in place of an
edited source, off with SPINE_COMPILED=0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from services.compiled import BUILD_DIR, MODULES, CompiledFinder, read_manifest, source_digest, source_path
from spine.tools.build_compiled import _missing_tools

REPO = Path(__file__).resolve().parents[1]
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")

# A fresh interpreter imports every listed module and says where each came from.
WHERE = ("import importlib, json, sys\n"
         "from services.compiled import MODULES\n"
         "print(json.dumps({m: importlib.import_module(m).__file__ for m in MODULES}))\n")


def _origins(**env: str) -> dict[str, str]:
    out = subprocess.run([sys.executable, "-c", WHERE], cwd=REPO, env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.mark.skipif(_missing_tools() is not None, reason=f"nothing can be compiled here: {_missing_tools()}")
def test_every_module_of_the_request_path_runs_compiled_where_it_can_be_built() -> None:
    """`make install` builds them all here (Cython and a C compiler are present): a module
    that failed to build, or a build that fell behind its sources, would run as Python
    unnoticed, and this test is what notices."""
    manifest = read_manifest()
    assert sorted(manifest) == sorted(MODULES), "run `make install` (python -m spine.tools.build_compiled)"
    origins = _origins(SPINE_COMPILED="1")
    running_as_python = {m: path for m, path in origins.items() if not path.endswith(SUFFIX)}
    assert running_as_python == {}, "edited since the last build? `make install` rebuilds what changed"
    assert all(Path(path).is_relative_to(BUILD_DIR) for path in origins.values())


def test_spine_compiled_0_runs_the_source() -> None:
    origins = _origins(SPINE_COMPILED="0")
    assert origins == {module: str(source_path(module)) for module in MODULES}


def test_a_binary_built_from_other_source_text_is_never_loaded(tmp_path: Path) -> None:
    """An edit after the build: the finder declines (Python's own finder then loads the
    source), and says which module it left to Python."""
    module = "services.redact"
    binary = tmp_path / f"redact{SUFFIX}"
    binary.write_bytes(b"not loaded")
    stale = CompiledFinder({module: {"source_sha256": "0" * 64, "binary": binary.name}}, build_dir=tmp_path)
    assert stale.find_spec(module) is None
    assert stale.stale == [module] and stale.loaded == []
    current = CompiledFinder({module: {"source_sha256": source_digest(source_path(module)), "binary": binary.name}},
                             build_dir=tmp_path)
    spec = current.find_spec(module)
    assert spec is not None and spec.origin == str(binary) and current.loaded == [module]
    assert CompiledFinder({}, build_dir=tmp_path).find_spec(module) is None  # not listed: not its business
    missing = CompiledFinder({module: {"source_sha256": source_digest(source_path(module)), "binary": "gone.so"}},
                             build_dir=tmp_path)
    assert missing.find_spec(module) is None


def test_a_manifest_for_another_interpreter_is_ignored(tmp_path: Path) -> None:
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"ext_suffix": ".cpython-27-other.so", "modules": {"services.redact": {}}}))
    assert read_manifest(manifest) == {}
    manifest.write_text("{not json")
    assert read_manifest(manifest) == {}
    assert read_manifest(tmp_path / "absent.json") == {}
