"""The calling thread's name, given to the operating system too.

Why: on Python before 3.14 every thread of a process carries the process's own name in the
kernel ("python"), so `top -H`, `ps -L`, py-spy's thread list and /proc/PID/task/*/comm
cannot tell the model's decode loop from a gRPC handler or the completions writer, and
the bench cannot say which thread spends a layout's extra CPU per request. A thread that
calls `name_os_thread()` first is listed under its Python name (the first 15 bytes: the
kernel's limit). Only our own threads do it (a library user's are left alone); elsewhere
than on Linux it does nothing.
"""

from __future__ import annotations

import ctypes
import threading

from services.common.prctl import PR_SET_NAME, prctl

MAX_NAME_BYTES = 15  # the kernel's TASK_COMM_LEN (16) less the terminating NUL


def name_os_thread(name: str | None = None) -> None:
    """Name the calling thread in the kernel: `name`, or its Python thread name.

    Takes no arguments beyond the name, so it can be a `ThreadPoolExecutor` initializer
    (whose threads are then listed as `grpc_0`, `grpc_1`, ...)."""
    raw = (name or threading.current_thread().name).encode("ascii", "replace")[:MAX_NAME_BYTES]
    prctl(PR_SET_NAME, ctypes.c_char_p(raw))  # failure leaves the old name: harmless
