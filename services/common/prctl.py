"""prctl(2) through the C library the interpreter already has, for the few Linux process and
thread controls the runtime uses (a thread's name, a child's death signal).

Why one module: each use used to load the C library itself; this loads it once, and a
platform without it (or without prctl) makes every control a no-op that says so.
"""

from __future__ import annotations

import ctypes
import sys
from functools import cache
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PR_SET_NAME = 15


@cache
def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def prctl(option: int, *args: Any) -> bool:
    """Call prctl(option, *args); False where it is not available or fails."""
    libc = _libc()
    if libc is None:
        return False
    extra = (0,) * (4 - len(args))
    return int(libc.prctl(option, *args, *extra)) == 0
