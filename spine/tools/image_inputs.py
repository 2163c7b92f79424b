"""What the image's build context holds, prepared on the host: `deploy/image/Containerfile`'s inputs.

Why prepared here and not inside the build: the build then reads nothing but its context (no
network in any RUN, no registry), its layers are keyed on what changed (the lock, the project's
wheel), and the same wheels pip already has on this machine are reused, never fetched twice.

- `rootfs.tar`: Debian's packages for this machine's release (mmdebstrap, `--variant=essential`
  plus python3; no apt, no compilers, no docs or locales), made reproducible with a fixed
  SOURCE_DATE_EPOCH, so an unchanged package set gives the same tarball and a cached layer.
- `requirements.lock`: the runtime dependencies of the installed `spine` distribution, walked
  through the installed metadata and pinned to the versions in this virtualenv — the versions
  `make test` ran — so the image never resolves anything on its own.
- `wheels/`: one wheel per pin (`pip wheel --no-deps`, only for those missing), `pip/`: pip's own
  wheel, run from the zip in the build and never installed; `dist/`: the project's wheel, built
  from a copy of its packages with the generated gRPC stubs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]
CONTEXTS = ROOT / ".cache" / "image"  # one build context per variant (hard links into SHARED)
# What every checkout on this machine can share, as pip shares its wheel cache: the root file
# system's tarball (keyed on its recipe) and the wheelhouse (one file per pinned version).
SHARED = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spine-image"
PACKAGES = ("spine", "runtime", "wire", "services", "monolith", "migration")
# Debian's packages in the image beyond the essential set: the interpreter (its whole standard
# library: sqlite3 for the controller's state, venv for the virtualenv), the C++ runtime grpcio and
# torch link against, and the CA bundle.
DEBIAN_PACKAGES = ("python3", "libstdc++6", "ca-certificates")
SOURCE_DATE_EPOCH = "1735689600"  # 2025-01-01: fixed, so the same packages give the same tarball
TORCH = "torch"


class InputError(RuntimeError):
    """A build input could not be made (the message says what to do)."""


@dataclass(frozen=True)
class Variant:
    """One image variant: its tag suffix, the extras it adds, and how torch is chosen."""

    name: str
    tag_suffix: str
    extras: tuple[str, ...]
    torch_from_venv: bool  # cpu: the venv's CPU build; cuda: PyPI's build of the same version


VARIANTS = {"cpu": Variant("cpu", "", (), True), "cuda": Variant("cuda", "-cuda", ("gpu",), False)}


def run(argv: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    """`argv`, failing with its own output as the message."""
    result: subprocess.CompletedProcess[str] = subprocess.run(  # type: ignore[call-overload]
        list(argv), capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise InputError(f"{' '.join(argv[:4])} ... exited {result.returncode}:\n{(result.stderr or result.stdout)[-3000:]}")
    return result


# -- the lock ----------------------------------------------------------------------------------


@dataclass
class Lock:
    """The variant's dependencies: `pins` (name -> version, from this virtualenv) and `unpinned`
    (requirements this virtualenv does not hold: pip resolves them, within the pins)."""

    pins: dict[str, str]
    unpinned: list[str]

    def lines(self) -> list[str]:
        return [f"{name}=={version}" for name, version in sorted(self.pins.items())]


def installed_closure(extras: Iterable[str], python_full_version: str) -> Lock:
    """Every distribution `spine` (with `extras`) needs at run time in the image, pinned to the
    version installed here, walked through the installed metadata with each marker evaluated
    for the image's Python (`python_full_version`: a dependency of an older patch release, e.g.
    redis' async-timeout before 3.11.3, is kept even where this interpreter needs none)."""
    environment = {str(key): str(value) for key, value in default_environment().items()}
    environment |= {"python_full_version": python_full_version,
                    "python_version": ".".join(python_full_version.split(".")[:2])}
    lock = Lock({}, [])
    todo: list[tuple[Requirement, frozenset[str]]] = [(Requirement("spine"), frozenset(extras))]
    done: set[tuple[str, frozenset[str]]] = set()
    while todo:
        requirement, wanted = todo.pop()
        name = canonicalize_name(requirement.name)
        if (name, wanted) in done:
            continue
        done.add((name, wanted))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            lock.unpinned.append(str(requirement))
            continue
        if name != "spine":
            lock.pins[name] = dist.version
        for text in dist.requires or []:
            needed = Requirement(text)
            if needed.marker is not None and not any(
                    needed.marker.evaluate({**environment, "extra": extra}) for extra in ("", *wanted)):
                continue
            needed.marker = None
            todo.append((needed, frozenset(needed.extras)))
    return lock


def variant_lock(variant: Variant, python_full_version: str) -> Lock:
    """The variant's lock before its wheels are fetched (`fill_wheelhouse` pins the unpinned)."""
    lock = installed_closure(variant.extras, python_full_version)
    if TORCH not in lock.pins:
        raise InputError("torch is not installed in this virtualenv: run `make install` first")
    if not variant.torch_from_venv:  # the same release, PyPI's (CUDA) build, resolved with its NVIDIA libraries
        lock.unpinned.append(f"{TORCH}=={lock.pins.pop(TORCH).split('+', 1)[0]}")
    return lock


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# -- the wheelhouse ----------------------------------------------------------------------------


def wheel_key(path: Path) -> tuple[str, str]:
    name, version, _, _ = parse_wheel_filename(path.name)
    return str(name), str(version)


def missing_pins(pins: dict[str, str], wheelhouse: Path) -> list[str]:
    have = {wheel_key(path) for path in wheelhouse.glob("*.whl")}
    return [f"{name}=={version}" for name, version in sorted(pins.items()) if (name, version) not in have]


def pip_env(variant: Variant) -> dict[str, str]:
    env = dict(os.environ)
    if not variant.torch_from_venv:  # PyPI's CUDA build: no local CPU-only wheels in the way
        env.pop("PIP_FIND_LINKS", None)
        env["PIP_CONFIG_FILE"] = os.devnull
    return env


def fill_wheelhouse(lock: Lock, wheelhouse: Path, variant: Variant) -> list[Path]:
    """A wheel for every pin in `wheelhouse` (pip asked only for those missing; the unpinned
    resolved within the pins, then pinned), and the lock's wheels, one per pin."""
    wheelhouse.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "wheel", "--quiet", "--find-links", str(wheelhouse)]
    with tempfile.TemporaryDirectory(prefix="spine-wheels-") as tmp:
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text("\n".join(lock.lines()) + "\n")
        missing = missing_pins(lock.pins, wheelhouse)
        if missing:
            run([*argv, "--no-deps", "--wheel-dir", str(wheelhouse), *missing], env=pip_env(variant))
        if lock.unpinned:
            fetched = Path(tmp) / "fetched"
            run([*argv, "--wheel-dir", str(fetched), "--constraint", str(constraints), *lock.unpinned],
                env=pip_env(variant))
            for path in fetched.glob("*.whl"):
                name, version = wheel_key(path)
                lock.pins.setdefault(name, version)
                if not (wheelhouse / path.name).exists():
                    shutil.move(str(path), wheelhouse / path.name)
            lock.unpinned = []
    still = missing_pins(lock.pins, wheelhouse)
    if still:
        raise InputError(f"no wheel for {', '.join(still)} after pip wheel (an sdist that does not build?)")
    wanted = set(lock.pins.items())
    return [path for path in sorted(wheelhouse.glob("*.whl")) if wheel_key(path) in wanted]


def pip_wheel(into: Path) -> Path:
    """pip's own wheel (the venv's version), run from the zip inside the build."""
    into.mkdir(parents=True, exist_ok=True)
    version = metadata.version("pip")
    found = [path for path in into.glob("pip-*.whl") if wheel_key(path)[1] == version]
    if not found:
        run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
             "--dest", str(into), f"pip=={version}"])
        found = [path for path in into.glob("pip-*.whl") if wheel_key(path)[1] == version]
    return found[0]


# -- the project's wheel -----------------------------------------------------------------------


def project_wheel(into: Path) -> Path:
    """The project's wheel, built from a copy of its packages (the generated stubs included)
    so nothing is written into the work tree."""
    if not (ROOT / "wire" / "v1" / "gateway_pb2.py").exists():
        raise InputError("wire/v1 has no generated stubs: run `make protos` first")
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".generated")
    with tempfile.TemporaryDirectory(prefix="spine-wheel-") as tmp:
        source = Path(tmp) / "src"
        source.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(ROOT / name, source / name)
        for package in PACKAGES:
            shutil.copytree(ROOT / package, source / package, ignore=ignore)
        env = {**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH}
        run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
             "--wheel-dir", str(into), str(source)], env=env)
    (wheel,) = into.glob("spine-*.whl")
    return wheel


def wheel_digest(path: Path) -> str:
    """The sha256 of a wheel's contents (names and bytes, not its zip timestamps): the project
    layer's cache key, unchanged when the code is."""
    digest = hashlib.sha256()
    with zipfile.ZipFile(path) as wheel:
        for info in sorted(wheel.infolist(), key=lambda i: i.filename):
            digest.update(info.filename.encode() + b"\0" + wheel.read(info) + b"\0")
    return digest.hexdigest()


# -- the Debian root filesystem ----------------------------------------------------------------


def debian_release() -> str:
    """This machine's Debian release (VERSION_CODENAME in /etc/os-release)."""
    fields = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line)
    codename = fields.get("VERSION_CODENAME", "").strip('"')
    if fields.get("ID") != "debian" or not codename:
        raise InputError("the image's root filesystem is made from this machine's Debian release; this is not Debian")
    return codename


def mirrors(release: str) -> list[str]:
    base = "http://deb.debian.org/debian"
    return [f"deb {base} {release} main", f"deb {base} {release}-updates main",
            f"deb http://deb.debian.org/debian-security {release}-security main"]


def rootfs_argv(release: str, out: Path) -> list[str]:
    excluded = ["/usr/share/man/*", "/usr/share/locale/*", "/usr/share/info/*", "/usr/share/doc/*",
                "/usr/share/lintian/*"]
    return ["mmdebstrap", "--quiet", "--mode=root", "--variant=essential", "--format=tar",
            f"--include={','.join(DEBIAN_PACKAGES)}",
            "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",  # no usrmerge (and no perl) in the image
            *(f"--dpkgopt=path-exclude={path}" for path in excluded),
            "--dpkgopt=path-include=/usr/share/doc/*/copyright",  # the licences stay
            # no apt in the image, so none of its state; no caches, no logs of the build
            "--customize-hook=rm -rf \"$1\"/var/lib/apt \"$1\"/var/cache/* \"$1\"/var/log/*",
            "--skip=cleanup/apt",  # its cleanup would make /var/lib/apt/lists anew
            release, str(out), *mirrors(release)]


def rootfs(cache: Path) -> tuple[Path, float]:
    """The root filesystem's tarball (made once per release and recipe; seconds it took, 0 if cached)."""
    if shutil.which("mmdebstrap") is None:
        raise InputError("mmdebstrap is not installed (make image installs it: Debian's package)")
    release = debian_release()
    cache.mkdir(parents=True, exist_ok=True)
    argv = rootfs_argv(release, cache / "rootfs.tmp.tar")
    out = cache / f"rootfs-{release}-{sha256_text(' '.join(argv))[:12]}.tar"
    if out.exists():
        return out, 0.0
    import time

    began = time.monotonic()
    tmp = cache / "rootfs.tmp.tar"
    tmp.unlink(missing_ok=True)
    run(argv, env={**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH})
    tmp.rename(out)
    for stale in cache.glob(f"rootfs-{release}-*.tar"):
        if stale != out:
            stale.unlink()
    return out, time.monotonic() - began


def python_in(rootfs_tar: Path) -> str:
    """The full version of Debian's Python in the root filesystem (python3.N's package version,
    from its dpkg status: `3.11.2-6+deb12u9` -> `3.11.2`)."""
    import tarfile

    with tarfile.open(rootfs_tar) as tar:
        for member in tar:
            if member.name.lstrip("./") == "var/lib/dpkg/status":
                stream = tar.extractfile(member)
                assert stream is not None
                for block in stream.read().decode().split("\n\n"):
                    fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
                    if fields.get("Package", "").startswith("python3.") and "minimal" not in fields["Package"] \
                            and fields["Package"][len("python3."):].isdigit():
                        return fields["Version"].split("-", 1)[0]
    raise InputError(f"{rootfs_tar} holds no python3.N package")


def link_into(paths: Iterable[Path], directory: Path) -> None:
    """Hard links (copies across file systems) of `paths` in a fresh `directory`."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    for path in paths:
        try:
            os.link(path, directory / path.name)
        except OSError:
            shutil.copy2(path, directory / path.name)
