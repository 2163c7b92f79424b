"""The image under test, built once per test session, and containers of it started and removed.

The image is built exactly as `make image` builds it (`spine.tools.image.build`), once per
pytest process however many modules ask (`built_image`): its inputs and buildah's layer cache
are kept between sessions, so only what changed is rebuilt. Tests then run it by image ID, so
another build retagging `spine:<version>` meanwhile changes nothing under them.
"""

from __future__ import annotations

import functools
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc
import pytest

from runtime.health.deep import check_serving
from runtime.processes.launch import Launched, launch
from spine.tools.containers import Mount, Podman, podman_missing
from spine.tools.image import BuildRecord, build


def skip_without_podman() -> pytest.MarkDecorator:
    reason = podman_missing()
    return pytest.mark.skipif(reason is not None, reason=f"the image tests run containers: {reason}")


@functools.cache
def built_image() -> tuple[str, BuildRecord]:
    """(image ID, its build record): `make image`'s build, done once per test process."""
    record = build("cpu", echo=False)
    image_id = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", record.tags[0]],
                              capture_output=True, text=True, check=True).stdout.strip()
    return image_id, record


def start_foreground(podman: Podman, role: str, args: list[str], logs: Path, *, mounts: Iterable[Mount] = (),
                     env: dict[str, str] | None = None, entrypoint: list[str] | None = None,
                     remove: bool = True) -> Launched:
    """`podman run` in the foreground (its stdout is the container's: the ready line is read
    there), as one of this caller's containers."""
    argv = podman.run_argv(role, args, mounts=mounts, env=env, entrypoint=entrypoint, remove=remove)
    return launch(role, argv, log_path=logs / f"{role}.log", env={**podman.env, **(env or {})})


def start_detached(podman: Podman, role: str, command: list[str], *, mounts: Iterable[Mount] = (),
                   env: dict[str, str] | None = None) -> None:
    """`podman run --detach` of a manifest's command (its first word replaces the ENTRYPOINT)."""
    argv = podman.run_argv(role, command[1:], entrypoint=command[:1], mounts=mounts, env=env, detach=True,
                           remove=False)
    result = subprocess.run(argv, capture_output=True, text=True, env={**podman.env, **(env or {})}, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"podman run {role}: {result.stderr.strip()}")


def wait_serving_at(addresses: dict[str, str], podman: Podman, timeout_s: float) -> None:
    """Each role's grpc.health.v1 answers SERVING at its address (or its logs say why not)."""
    deadline = time.monotonic() + timeout_s
    waiting = dict(addresses)
    while waiting:
        for role, address in list(waiting.items()):
            with grpc.insecure_channel(address) as channel:
                if check_serving(channel, timeout=0.5):
                    del waiting[role]
        if not waiting:
            return
        for role in waiting:
            if podman.inspect(role, "{{.State.Running}}") != "true":
                raise RuntimeError(f"container {role} exited: {logs_of(podman, role)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not serving within {timeout_s:g}s: {sorted(waiting)}; "
                               + "; ".join(f"{r}: {logs_of(podman, r)}" for r in waiting))
        time.sleep(0.2)


def logs_of(podman: Podman, role: str, chars: int = 1500) -> str:
    result = podman.command("logs", podman.name(role), check=False)
    return (result.stdout + result.stderr)[-chars:]


def image_config(image_id: str) -> dict[str, Any]:
    import json

    (inspected,) = json.loads(subprocess.run(["podman", "image", "inspect", image_id], capture_output=True,
                                             text=True, check=True).stdout)
    return dict(inspected)
