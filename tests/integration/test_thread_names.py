"""The spine's threads carry their names in the kernel (`services.common.thread_names`), so `top -H`,
py-spy and the bench's CPU split by thread can tell the decode loop, the gRPC handlers and
the completions writer apart (before, every thread was `python`)."""

from __future__ import annotations

import threading
from pathlib import Path

import grpc

from services.common.thread_names import MAX_NAME_BYTES, name_os_thread
from tests.conftest import DEV_KEY, start_stack
from wire.v1 import gateway_pb2_grpc, generation_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]


def kernel_name(thread: threading.Thread) -> str:
    """The name the kernel has for `thread` ("" if it ended meanwhile: other tests' threads do)."""
    try:
        with open(f"/proc/self/task/{thread.native_id}/comm") as comm:
            return comm.read().strip()
    except FileNotFoundError:
        return ""


def test_a_thread_takes_its_python_name_cut_to_the_kernels_limit() -> None:
    seen: dict[str, str] = {}

    def run() -> None:
        name_os_thread()
        seen["default"] = kernel_name(threading.current_thread())
        name_os_thread("spine-explicit")
        seen["explicit"] = kernel_name(threading.current_thread())

    thread = threading.Thread(target=run, name="a-rather-long-thread-name")
    thread.start()
    thread.join()
    assert seen == {"default": "a-rather-long-thread-name"[:MAX_NAME_BYTES], "explicit": "spine-explicit"}
    assert kernel_name(threading.current_thread()) != "spine-explicit"  # only the calling thread


def test_a_running_spine_names_its_decode_loop_handlers_and_writers(tmp_path: Path) -> None:
    stack = start_stack("collapsed", tmp_path)
    try:
        with grpc.insecure_channel(stack.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            stub.Generate(generation_pb2.GenerateRequest(model="tiny-lm", prompt="names", max_tokens=2),
                          metadata=(("authorization", f"Bearer {DEV_KEY}"),), timeout=30)
        names = {thread.name: kernel for thread in threading.enumerate()
                 if thread.native_id and (kernel := kernel_name(thread))}
        for python_name in ("inference-scheduler", "spine-completions"):
            assert names.get(python_name) == python_name[:MAX_NAME_BYTES], names
        handlers = {name: kernel for name, kernel in names.items() if name.startswith("grpc_")}
        assert handlers and all(kernel == name for name, kernel in handlers.items()), names
        flushers = [kernel for name, kernel in names.items() if name.startswith("log-flusher:")]
        assert flushers and all(kernel.startswith("log-flusher:") for kernel in flushers), names
    finally:
        stack.stop()
