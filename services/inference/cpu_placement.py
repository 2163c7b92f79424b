"""Where a model-serving process runs: on a CPU of its own, all its threads together.

Why: such a process is bound by one interpreter lock. The model's decode step is a few
hundred small torch calls, each of which lets go of the lock; on a machine where the
process's threads float over several cores, a thread on another core takes the lock in
every one of those gaps, so the step is handed back and forth across cores hundreds of
times (and each side finds its caches emptied by the other). On one core a waiting thread
cannot run while the model's thread holds the core, so the gaps cost nothing and the
threads take turns at the points where one of them waits. Side by side on a 2-core host
(whole process on one core vs floating, the load generator on the other core) the pinned
spine kept closer to the bare model service at every concurrency, with fewer context
switches per request (`python -m bench.variants` can repeat it). Both layouts get the same.

The setting is per process, in the environment like `SPINE_TORCH_THREADS`:
`SPINE_CPU=auto` (default) takes the CPUs (one per torch thread) that the fewest other
spine model processes of this user have taken — claims are files in a private directory
under the system temp dir, so replicas, the layered stack's model and the bench's layouts
spread over the cores; `SPINE_CPU=<n>[,<m>]` names them; `off` leaves placement to the OS.
A process allowed no more CPUs than it would take is left alone. Only server processes turn
it on (`monolith.runtime_env.configure_threads`), and only when a model starts serving in
them (the middlewares' processes float); a library user's threads are never moved.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("spine.placement")

ENV = "SPINE_CPU"


class PlacementError(ValueError):
    """A `SPINE_CPU` setting that cannot be followed (its message names the variable)."""


def requested(env: Mapping[str, str], allowed: set[int], count: int = 1) -> set[int] | str | None:
    """What `env` asks for on a process allowed `allowed` CPUs: named CPUs, "auto", or None
    (leave it to the OS)."""
    setting = env.get(ENV, "auto").strip().lower()
    cpus = ",".join(map(str, sorted(allowed)))
    if setting == "off" or len(allowed) <= count:
        return None  # nothing to gain: the process may use only what it would take
    if setting == "auto":
        return "auto"
    try:
        chosen = {int(part) for part in setting.split(",")}
    except ValueError:
        raise PlacementError(f"{ENV}={setting!r}: expected auto, off, or CPU numbers such as 3 or 2,3") from None
    if not chosen <= allowed:
        raise PlacementError(f"{ENV}={setting!r}: names a CPU this process may not use (it may use {cpus})")
    return chosen


def least_claimed(allowed: set[int], count: int, claims: Path, pid: int) -> set[int]:
    """The `count` CPUs of `allowed` with the fewest live claims in `claims` (ties: the
    highest numbers, leaving CPU 0 to the system), claimed for `pid`."""
    claims.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(claims / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        taken = dict.fromkeys(allowed, 0)
        for claim in claims.glob("*.claim"):
            try:
                cpu, owner = (int(part) for part in claim.stem.split("-"))
                os.kill(owner, 0)
            except (ValueError, ProcessLookupError):
                claim.unlink(missing_ok=True)  # its process is gone (or it is not ours)
                continue
            except PermissionError:
                pass  # alive, another user's pid reused: count it all the same
            if cpu in taken:
                taken[cpu] += 1
        chosen = set(sorted(allowed, key=lambda cpu: (taken[cpu], -cpu))[:count])
        for cpu in chosen:
            (claims / f"{cpu}-{pid}.claim").touch()
    return chosen


def release_claims(cpus: set[int], claims: Path, pid: int) -> None:
    """Remove `pid`'s claims at its exit, so a listing of the claims shows the live ones
    (a killed process leaves its own: the next claimer drops those of dead owners)."""
    if os.getpid() != pid:
        return  # a forked child exiting: the claims are its parent's
    for cpu in cpus:
        (claims / f"{cpu}-{pid}.claim").unlink(missing_ok=True)


def claims_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"spine-cpu-claims-{os.getuid()}"


_lock = threading.Lock()
_wanted: set[int] | str | None = None
_count = 1
_placed: set[int] | None = None


def enable_from_env(count: int = 1) -> None:
    """Read `SPINE_CPU` now (a bad value fails the start, naming it); the process moves when
    its first model starts (`place_process`). Linux only; elsewhere nothing happens."""
    global _wanted, _count
    if not hasattr(os, "sched_getaffinity"):
        return
    with _lock:
        _wanted = requested(os.environ, os.sched_getaffinity(0), count)
        _count = count


def enabled() -> bool:
    """Whether this process moves to its CPUs when a model starts (or has moved)."""
    return _wanted is not None


def disable() -> None:
    """Never move this process, and forget a move already made (its threads stay where they
    are: `move_threads` puts them back)."""
    global _wanted, _placed
    with _lock:
        _wanted = None
        _placed = None


def move_threads(cpus: set[int]) -> None:
    """Every thread of this process onto `cpus` (threads it makes later inherit them)."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except OSError:  # the thread ended meanwhile
            pass


def place_process() -> set[int] | None:
    """Called by a model's step loop as it starts: every thread of the process (and those it
    makes later, which inherit their maker's CPUs) moves to the chosen CPUs, once. Does
    nothing unless `enable_from_env` found something to do."""
    global _placed
    with _lock:
        if _wanted is None or _placed is not None:
            return _placed
        allowed = os.sched_getaffinity(0)
        if isinstance(_wanted, str):  # "auto"
            cpus = least_claimed(allowed, _count, claims_dir(), os.getpid())
            atexit.register(release_claims, cpus, claims_dir(), os.getpid())
        else:
            cpus = set(_wanted)
        move_threads(cpus)
        _placed = cpus
    log.info("this process runs on CPU %s (%s=%s)", ",".join(map(str, sorted(cpus))), ENV,
             _wanted if isinstance(_wanted, str) else "named")
    return cpus
