"""`python -m spine.tools.build_compiled`: compile the request path's modules (see
`services.compiled`) with Cython, those whose source changed since the last build only.

Run by `make install`. Without Cython or a C compiler it says so in one line and builds
nothing: the modules then run as Python, as they always can. Cython reads the sources
as plain Python (`annotation_typing=False`: a `float` annotation must not turn an argument
into a C double, nor `str` refuse a `str` subclass), so compiled and interpreted modules
behave the same; the test suite runs against whichever the build left.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from services.compiled import BUILD_DIR, MANIFEST, MODULES, read_manifest, source_digest, source_path

STAGE = BUILD_DIR / "src"  # the sources as built, in their packages (Cython names modules by them)
LOG = BUILD_DIR / "build.log"
DIRECTIVES = "language_level=3,annotation_typing=False,binding=True"


def _missing_tools() -> str | None:
    """Why nothing can be built here, or None."""
    try:
        import Cython  # noqa: F401
    except ImportError:
        return "Cython is not installed"
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        return f"no C compiler ({compiler})"
    if not Path(sysconfig.get_paths()["include"], "Python.h").is_file():
        return "no Python headers (Python.h)"
    return None


def _stage(module: str) -> Path:
    """Copy a module's source into the staging tree, its packages marked as such."""
    parts = module.split(".")
    target = STAGE.joinpath(*parts).with_suffix(".py")
    target.parent.mkdir(parents=True, exist_ok=True)
    for depth in range(1, len(parts)):
        marker = STAGE.joinpath(*parts[:depth], "__init__.py")
        if not marker.exists():
            marker.write_text("")
    shutil.copyfile(source_path(module), target)
    return target


def build(modules: tuple[str, ...] = MODULES, *, jobs: int | None = None, force: bool = False) -> int:
    """Compile what changed; returns how many modules are built now (0: none could be)."""
    why = _missing_tools()
    if why is not None:
        print(f"compiled modules: not built ({why}); the request path runs as Python")
        return 0
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    manifest = {} if force else read_manifest()
    digests = {module: source_digest(source_path(module)) for module in modules}
    current = {m: e for m, e in manifest.items()
               if m in digests and e.get("source_sha256") == digests[m] and (BUILD_DIR / e["binary"]).is_file()}
    changed = [module for module in modules if module not in current]
    if changed:
        BUILD_DIR.mkdir(parents=True, exist_ok=True)
        staged = [str(_stage(module)) for module in changed]
        print(f"compiled modules: building {len(changed)} of {len(modules)} with Cython (log: {LOG})", flush=True)
        with open(LOG, "w") as log:
            subprocess.run([sys.executable, "-m", "Cython.Build.Cythonize", "-i", "-q", "-k", "-f",
                            "-j", str(jobs or os.cpu_count() or 1), "-X", DIRECTIVES, *staged],
                           cwd=STAGE, stdout=log, stderr=subprocess.STDOUT, check=False)
        for module in changed:
            binary = STAGE.joinpath(*module.split(".")).with_suffix(suffix)
            if binary.is_file():
                current[module] = {"source_sha256": digests[module], "binary": str(binary.relative_to(BUILD_DIR))}
        failed = [module for module in changed if module not in current]
        if failed:
            print(f"compiled modules: {len(failed)} failed to build and run as Python: {', '.join(failed)} "
                  f"(see {LOG})")
    tmp = MANIFEST.with_suffix(".tmp")
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps({"ext_suffix": suffix, "modules": current}, indent=1, sort_keys=True))
    tmp.replace(MANIFEST)
    return len(current)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spine.tools.build_compiled", description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild every module")
    parser.add_argument("--jobs", type=int, help="parallel compiler jobs (default: one per CPU)")
    args = parser.parse_args(argv)
    build(jobs=args.jobs, force=args.force)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
