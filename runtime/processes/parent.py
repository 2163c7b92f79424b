"""A child process that dies with the process that started it, set up without a fork hook.

Linux sends a child a signal when its parent dies once the child has asked for it
(`prctl(PR_SET_PDEATHSIG)`). The obvious place to ask is `subprocess.Popen(preexec_fn=...)`,
between fork and exec — and that is what broke: a `preexec_fn` makes Python fork() instead
of vfork(), and a fork runs gRPC's fork handlers, which restart gRPC's poller thread in the
child; the child then closes the descriptors it does not pass on (`close_fds`), the poller's
epoll descriptor among them, and gRPC aborts the child before it reaches exec
("epoll_wait error: Bad file descriptor"; grpc/grpc#43055, open for grpcio 1.80 and later).
Measured here with grpcio 1.85.3: 7 of 300 children of a process with calls in flight died
that way with `preexec_fn`, none of 300 without it; a clean clone's `make test` lost the demo's
spine process to it once.

So the parent names itself in the child's environment (`spawn`), and the child asks for the
signal first thing (`follow_parent`) — then checks that its parent is still the one that
started it, since a parent that died in between would have sent nothing. The supervisor's
children did this already with a `--parent-pid` flag of their own; they now use this too.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

from services.common.prctl import PR_SET_PDEATHSIG, prctl

PARENT_PID_ENV = "SPINE_PARENT_PID"


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies: no orphans, ever."""
    prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


def spawn(argv: Sequence[str], *, env: Mapping[str, str] | None = None, **popen: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen(argv, ...)` for a child that follows this process out (the child
    calls `follow_parent`: the `spine`, `runtime.process` and `migration.runner` entry
    points do)."""
    if "preexec_fn" in popen:
        raise TypeError("spawn: no preexec_fn (a fork hook is what this module avoids; see its docstring)")
    child_env = dict(os.environ if env is None else env)
    child_env[PARENT_PID_ENV] = str(os.getpid())
    return subprocess.Popen(argv, env=child_env, **popen)


def follow_parent() -> bool:
    """In a child `spawn` started, first thing: die with the parent. False when the parent
    is already gone (the caller exits at once). True, and nothing done, in a process not
    started by `spawn`. The setting is not passed on to this process's own children."""
    value = os.environ.pop(PARENT_PID_ENV, "")
    if not value.isdigit():
        return True
    die_with_parent()
    return os.getppid() == int(value)
