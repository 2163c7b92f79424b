"""The rehearsal's processes as containers of spine's image (`make rehearse RUNTIME=podman`).

Each process the rehearsal would start as `python -m MODULE ARGS` runs instead as
`podman run ... --entrypoint python IMAGE -m MODULE ARGS`: the same command line, in the image
`make image` built, under the production securityContext (`spine.tools.containers`: the image's
non-root user, a read-only root, no capabilities). The rehearsal's work directory is mounted at
the same path, read-write and handed to the image's user, so every config, unix socket, state
file and run directory keeps the name it has outside; containers share the host's network, so
every loopback address does too. Redis and Prometheus stay Debian's, on the host.

`podman run` stays in the foreground: its stdout and stderr are the container's (the rehearsal
reads ready lines and logs as it does from a process), a SIGTERM to it reaches the container's
process, and its exit is the container's. Every container is removed by name at the end.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from spine.tools.containers import (
    IMAGE_UID,
    Mount,
    Podman,
    owned_by_image_user,
    podman_missing,
    unique_prefix,
)


class Containers:
    """Wraps the rehearsal's command lines in `podman run` of `image`."""

    def __init__(self, image: str, workdir: Path) -> None:
        missing = podman_missing()
        if missing:
            raise RuntimeError(f"RUNTIME=podman: {missing}")
        self.podman = Podman(image, unique_prefix("rehearsal"))
        self.workdir = workdir
        owned_by_image_user(workdir)

    def hand_over(self, *paths: Path) -> None:
        """Files the containers read that the host wrote private (the admin token)."""
        for path in paths:
            os.chown(path, IMAGE_UID, IMAGE_UID)

    def wrap(self, name: str, argv: Sequence[str], env_keys: Iterable[str] = (), stdin: bool = False) -> list[str]:
        """`python -m MODULE ARGS` (this interpreter's) as `podman run` of the image, container `name`."""
        if list(argv[:2]) != [sys.executable, "-m"]:
            raise ValueError(f"not a `python -m` command line: {argv[:3]}")
        return self.podman.run_argv(name, list(argv[1:]), entrypoint=["python"],
                                    mounts=[Mount(self.workdir, str(self.workdir), read_only=False)],
                                    env=dict.fromkeys(env_keys, ""), interactive=stdin)

    @property
    def env(self) -> dict[str, str]:
        return self.podman.env

    def remove_all(self) -> None:
        self.podman.remove_all()
