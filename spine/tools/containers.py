"""Running spine's image with podman, as this project runs it: the tests, `bench.image` and
`make rehearse RUNTIME=podman` (docs/deploy.md, "Running the image with podman").

Every container is started the same way, and each choice has a reason:

- `--runtime runc`: Debian's runc, the runtime `make image` and `make test` install (Debian's libpod.conf
  names crun, which it does not);
- `--network host`: each container binds 127.0.0.1 like the processes it replaces — nothing is
  exposed beyond loopback, no bridge or NAT rules are added to a machine other sessions share,
  and no container gets a route out; containers reach each other over loopback and unix sockets;
- `--ulimit host` and a containers.conf of our own with `default_ulimits = []`: rootful podman
  otherwise raises RLIMIT_NOFILE/NPROC to 1048576 in every container, above this machine's
  hard limits, and root here has no CAP_SYS_RESOURCE to go past them: runc fails with
  "error setting rlimits ... operation not permitted";
- the production securityContext: a read-only root file system (`--read-only`, /tmp a tmpfs),
  the image's non-root user, every capability dropped, no privilege escalation;
- `--health-interval disable`: podman schedules healthchecks with systemd timers, and there is
  no systemd here; `podman healthcheck run` still runs the image's own HEALTHCHECK on demand.

Names start with a prefix unique to the caller (`unique_prefix`), and `Podman.remove_all`
removes exactly the containers this object started, by name: never another session's.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

CONTAINERS_CONF = "[containers]\n# rootful podman's own default (nofile/nproc 1048576) is above this host's hard limits\n" \
                  "default_ulimits = []\n"
IMAGE_UID = 10001  # the image's user (deploy/image/Containerfile), the manifests' runAsUser


class ContainerError(RuntimeError):
    pass


def podman_missing() -> str | None:
    """Why podman cannot run containers here, or None when it can."""
    for tool in ("podman", "buildah", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make image and make test install Debian's podman, buildah and runc)"
    return None


def unique_prefix(purpose: str) -> str:
    """`spine-<purpose>-<pid>-<random>`: container names no other session can hold."""
    return f"spine-{purpose}-{os.getpid()}-{secrets.token_hex(3)}"


def owned_by_image_user(*paths: Path) -> None:
    """Directories the container's user writes to (run dirs, state): made and handed to it."""
    for path in paths:
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, IMAGE_UID, IMAGE_UID)


@dataclass
class Mount:
    source: Path
    target: str
    read_only: bool = True

    def arg(self) -> str:
        return f"--volume={self.source}:{self.target}:{'ro' if self.read_only else 'rw'}"


@dataclass
class Podman:
    """podman, configured for this machine, and the containers one caller started."""

    image: str
    prefix: str
    conf_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="spine-podman-")))
    started: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        (self.conf_dir / "containers.conf").write_text(CONTAINERS_CONF)

    @property
    def env(self) -> dict[str, str]:
        """The environment every podman command runs with (our containers.conf)."""
        return {**os.environ, "CONTAINERS_CONF": str(self.conf_dir / "containers.conf")}

    def name(self, role: str) -> str:
        return f"{self.prefix}-{role}"

    def run_argv(self, role: str, args: Sequence[str], *, entrypoint: Sequence[str] | None = None,
                 mounts: Iterable[Mount] = (), env: Mapping[str, str] | None = None, detach: bool = False,
                 interactive: bool = False, remove: bool = True, extra: Sequence[str] = ()) -> list[str]:
        """`podman run` of this image as `role`: the argv, and the name recorded as ours."""
        name = self.name(role)
        if name not in self.started:
            self.started.append(name)
        argv = ["podman", "run", f"--name={name}", "--runtime=runc", "--network=host", "--ulimit=host",
                "--read-only", "--tmpfs=/tmp:rw,nosuid,nodev,size=256m", "--cap-drop=ALL",
                "--security-opt=no-new-privileges", "--health-interval=disable", "--pull=never",
                "--log-driver=k8s-file", "--stop-timeout=30"]
        argv += ["--detach"] if detach else []
        argv += ["--interactive"] if interactive else []
        argv += ["--rm"] if remove else []
        argv += [mount.arg() for mount in mounts]
        for key in sorted(env or {}):
            argv.append(f"--env={key}")  # the value from podman's own environment: never on a command line
        if entrypoint:
            argv += [f"--entrypoint={entrypoint[0]}"]
        argv += [*extra, self.image]
        argv += [*entrypoint[1:]] if entrypoint else []
        return argv + list(args)

    def command(self, *args: str, timeout_s: float = 60.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout_s, env=self.env)
        if check and result.returncode != 0:
            raise ContainerError(f"podman {' '.join(args[:3])} exited {result.returncode}: {result.stderr.strip()[-2000:]}")
        return result

    def inspect(self, role: str, template: str) -> str:
        return self.command("inspect", "--format", template, self.name(role)).stdout.strip()

    def remove(self, role: str) -> None:
        """Remove this caller's container `role` (stopped first, if it still runs)."""
        self.command("rm", "--force", "--ignore", "--time", "5", self.name(role), check=False)

    def remove_all(self) -> None:
        """Remove every container this object started (by its own names), then its config."""
        if self.started:
            self.command("rm", "--force", "--ignore", "--time", "5", *self.started, check=False, timeout_s=120)
        self.started.clear()
        shutil.rmtree(self.conf_dir, ignore_errors=True)
