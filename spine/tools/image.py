"""`python -m spine.tools.image build [--variant cpu|cuda]` (`make image`): spine's container image.

buildah builds `deploy/image/Containerfile` — the one description of the image — from a context
this module prepares (`spine.tools.image_inputs`), with its layer cache on (`--layers`), no
daemon and no registry: `--pull-never` and a context holding everything the build reads. It
tags `spine:<version>` and `spine:<version>-<git sha>` (`-cuda` after the version for the CUDA
variant), prints the image's size and the build's time, and records both, with how much of the
time went to each input, in `bench/image.json` (`build.<variant>`; `bench.image` adds the
runtime figures beside them).

`python -m spine.tools.image tag [--variant V]` prints the version tag alone: what deploy/k8s
names, and what the tests and `make rehearse RUNTIME=podman` run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from spine.tools.image_inputs import (
    CONTEXTS,
    ROOT,
    SHARED,
    SOURCE_DATE_EPOCH,
    VARIANTS,
    InputError,
    Variant,
    fill_wheelhouse,
    link_into,
    pip_wheel,
    project_wheel,
    python_in,
    rootfs,
    sha256_text,
    variant_lock,
    wheel_digest,
)

CONTAINERFILE = ROOT / "deploy" / "image" / "Containerfile"
FIGURES = ROOT / "bench" / "image.json"
REPOSITORY = "spine"


def version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def git_revision() -> tuple[str, bool]:
    """HEAD's sha (`unknown` outside a git checkout) and whether the work tree differs from it."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                    capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False
    return sha, dirty


def tags(variant: Variant, revision: str | None = None) -> tuple[str, str]:
    """The version tag (what deploy/k8s names) and the version-and-commit tag."""
    sha = (revision or git_revision()[0])[:12]
    base = f"{REPOSITORY}:{version()}{variant.tag_suffix}"
    return base, f"{base}-{sha}"


def image_tag(variant: str = "cpu") -> str:
    """`localhost/spine:<version>[-cuda]`: the name podman resolves the version tag to."""
    return f"localhost/{tags(VARIANTS[variant])[0]}"


@dataclass
class BuildRecord:
    """One `make image`: what it built and where its seconds went."""

    variant: str
    tags: list[str]
    revision: str
    size_bytes: int
    seconds: float
    rootfs_seconds: float  # 0: the tarball was already made
    inputs_seconds: float  # the lock, the wheelhouse, the project's wheel
    buildah_seconds: float
    layers_cached: int  # buildah steps answered from its layer cache
    steps: int
    python: str
    dependencies: int
    when: float = field(default_factory=time.time)

    def line(self) -> str:
        return (f"image {self.tags[0]} ({self.tags[1]}): {self.size_bytes / 2**20:.0f} MiB, built in "
                f"{self.seconds:.1f}s (root filesystem {self.rootfs_seconds:.1f}s, wheels {self.inputs_seconds:.1f}s, "
                f"buildah {self.buildah_seconds:.1f}s, {self.layers_cached}/{self.steps} steps from the layer cache)")


def prepare_context(variant: Variant, echo: bool) -> tuple[Path, dict[str, str], float, float, str, int]:
    """The build context of `variant` under .cache/image/<variant>, and the build arguments."""
    rootfs_tar, rootfs_s = rootfs(SHARED)
    python = python_in(rootfs_tar)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if not python.startswith(here + "."):
        raise InputError(f"the image's Python (Debian's, {python}) is not this virtualenv's ({here}): the locked "
                         f"wheels would not fit; build from a virtualenv of Python {python.rsplit('.', 1)[0]}")
    if echo and rootfs_s:
        print(f"image: root filesystem made from Debian's packages in {rootfs_s:.1f}s ({rootfs_tar.name})", flush=True)
    started = time.monotonic()
    context = CONTEXTS / variant.name
    context.mkdir(parents=True, exist_ok=True)
    lock = variant_lock(variant, python)
    wheels = fill_wheelhouse(lock, SHARED / "wheels", variant)
    lock_text = ("# spine's runtime dependencies in the image: the versions `make install` put in .venv, for "
                 f"Python {python} (python -m spine.tools.image)\n" + "\n".join(lock.lines()) + "\n")
    lock_file = context / "requirements.lock"
    lock_file.write_text(lock_text)
    # buildah's layer cache keys a COPY on the file's metadata too: a fixed mtime keeps an
    # unchanged lock's layer (and the dependencies' above it) cached.
    os.utime(lock_file, (int(SOURCE_DATE_EPOCH), int(SOURCE_DATE_EPOCH)))
    link_into(wheels, context / "wheels")
    link_into([], context / "pip")
    shutil.copy2(pip_wheel(SHARED / "pip"), context / "pip" / "pip.whl")
    wheel = project_wheel(context / "dist")
    target = context / "rootfs.tar"
    target.unlink(missing_ok=True)
    try:
        target.hardlink_to(rootfs_tar)
    except OSError:
        shutil.copy2(rootfs_tar, target)
    revision, dirty = git_revision()
    args = {"VERSION": version(), "REVISION": revision + ("-modified" if dirty else ""), "VARIANT": variant.name,
            "LOCK_SHA256": sha256_text(lock_text), "WHEEL_SHA256": wheel_digest(wheel)}
    return context, args, rootfs_s, time.monotonic() - started, python, len(lock.pins)


def buildah_argv(context: Path, args: dict[str, str], image_tags: Sequence[str]) -> list[str]:
    return ["buildah", "bud", "--layers", "--pull-never", "--format", "docker",  # docker: keeps HEALTHCHECK
            "--file", str(CONTAINERFILE), *(a for k, v in args.items() for a in ("--build-arg", f"{k}={v}")),
            *(a for tag in image_tags for a in ("--tag", tag)), str(context)]


def build(variant_name: str = "cpu", echo: bool = True) -> BuildRecord:
    """Build the image of `variant_name` and record it (InputError / RuntimeError: why not)."""
    if shutil.which("buildah") is None:
        raise InputError("buildah is not installed (make image installs it: Debian's package)")
    variant = VARIANTS[variant_name]
    began = time.monotonic()
    context, args, rootfs_s, inputs_s, minor, dependencies = prepare_context(variant, echo)
    image_tags = list(tags(variant, args["REVISION"]))
    argv = buildah_argv(context, args, image_tags)
    started = time.monotonic()
    result = subprocess.run(argv, capture_output=True, text=True)
    buildah_s = time.monotonic() - started
    if result.returncode != 0:
        raise InputError(f"buildah bud exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    steps = sum(1 for line in result.stdout.splitlines() if line.startswith("STEP "))
    cached = result.stdout.count("--> Using cache")
    size = int(subprocess.run(["podman", "image", "inspect", "--format", "{{.Size}}", image_tags[0]],
                              capture_output=True, text=True, check=True).stdout.strip())
    record = BuildRecord(variant.name, image_tags, args["REVISION"], size, time.monotonic() - began, rootfs_s,
                         inputs_s, buildah_s, cached, steps, minor, dependencies)
    save(record)
    if echo:
        print(record.line(), flush=True)
    return record


def save(record: BuildRecord) -> None:
    """Into bench/image.json: the last build of its variant, and the last cold one (no cached step)."""
    figures = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    builds = figures.setdefault("build", {}).setdefault(record.variant, {})
    kind = "cold" if record.layers_cached == 0 else "warm" if record.layers_cached >= record.steps - 1 else "partial"
    builds[kind] = asdict(record)
    builds["last"] = kind
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    FIGURES.write_text(json.dumps(figures, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spine.tools.image", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("build", "tag"):
        command = sub.add_parser(name)
        command.add_argument("--variant", choices=sorted(VARIANTS), default="cpu")
    args = parser.parse_args(argv)
    if args.command == "tag":
        print(tags(VARIANTS[args.variant])[0])
        return 0
    try:
        build(args.variant)
    except InputError as error:
        print(f"make image: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
