"""A gRPC server the way every spine process runs one.

Health checking and server reflection are registered on every server, so stock tools
(grpc_health_probe, grpcurl) work against any process of either layout. Internal links
bind to unix sockets or loopback; a public address elsewhere must be asked for.

A server whose requests wait for the model (the Gateway, the inference process) gets a
handler thread for every request the model can hold — `request_threads`: the inference
priority queue (`max_queue`), every KV slot, and headroom for requests that never reach
the model. Requests then wait in the priority queue, where a latency-class request
overtakes the throughput class, and not in the thread pool's FIFO in front of it, where
it could not; a full queue answers RESOURCE_EXHAUSTED with `retry-after` at once. A
sync server's thread is a waiting request's whole cost: it blocks on its job's queue
and wakes only for its own answer, and the pool makes threads only as load needs them
(measured with `python -m bench.overload priority`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any, TypedDict

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import section
from services.inference_config import InferenceConfig
from services.registry import ComponentSpec

# Handler threads beyond what the model holds: cache hits, refusals, health and admission
# in progress never wait for a slot, and must not wait behind those who do.
HEADROOM_THREADS = 32

# Metadata (all headers of a call) a server accepts. gRPC's default refuses what lies
# between its soft limit (8 KiB) and its hard one (16 KiB) at random, more often the longer it
# is: the same call would pass or fail by chance. One limit for both makes it decided by the
# call alone: up to here always accepted, past it always RESOURCE_EXHAUSTED (from gRPC itself).
MAX_METADATA_BYTES = 16 << 10

# Interceptors every server in this process gets unless it is given its own list: tracing
# installs its trace-context interceptor here once per process (see spine.runtime.tracing.install),
# so servers started by code that knows nothing of tracing still continue traces.
_default_interceptors: tuple[grpc.ServerInterceptor, ...] = ()


def set_default_interceptors(interceptors: Sequence[grpc.ServerInterceptor]) -> None:
    """Interceptors for servers started from now on without an explicit list."""
    global _default_interceptors
    _default_interceptors = tuple(interceptors)


def default_interceptors() -> tuple[grpc.ServerInterceptor, ...]:
    return _default_interceptors


class UnsafeAddress(ValueError):
    """A listen address off loopback, refused unless explicitly allowed."""


def check_listen(address: str, allow_external: bool = False) -> None:
    """Refuse addresses that would expose an internal link beyond this machine."""
    if address.startswith("unix:") or allow_external:
        return
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise UnsafeAddress(
        f"listen address {address!r} is not loopback or a unix socket; "
        "pass --allow-external to expose it beyond this machine"
    )


@dataclass
class RunningServer:
    server: grpc.Server
    address: str  # what a client dials: "unix:/path" or "127.0.0.1:PORT"
    health: health.HealthServicer

    def set_serving(self, serving: bool, service: str = "") -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set(service, status)

    def stop(self, grace: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()


def request_threads(config: Any) -> int:
    """Handler threads for a server whose requests may wait for the model: the inference
    queue (`inference.max_queue`) + every KV slot (at most `inference.max_batch`) + headroom."""
    inference = InferenceConfig.from_dict(section(config, "inference"))
    return inference.max_queue + inference.max_batch + HEADROOM_THREADS


class PoolSize(TypedDict, total=False):
    """`start_server` keywords that size its thread pool."""

    max_workers: int
    max_concurrent_rpcs: int | None


def request_pool(config: Any) -> PoolSize:
    """`start_server` keywords for a server whose requests may wait for the model.

    Calls past the threads wait in gRPC's FIFO only while a thread answers a quick
    refusal (the queue is full), so twice the threads bounds that FIFO's memory; past it
    gRPC itself refuses with RESOURCE_EXHAUSTED."""
    threads = request_threads(config)
    return PoolSize(max_workers=threads, max_concurrent_rpcs=2 * threads)


def start_server(
    services: Sequence[tuple[ComponentSpec, Any]],
    listen: str,
    *,
    max_message_bytes: int = 1 << 20,
    max_workers: int = 32,
    max_concurrent_rpcs: int | None = None,
    allow_external: bool = False,
    interceptors: Sequence[grpc.ServerInterceptor] | None = None,
) -> RunningServer:
    """Start a server hosting `services` on `listen` (port 0 picks a free port).

    `max_concurrent_rpcs` bounds the calls accepted (running or waiting for a thread);
    past it gRPC refuses at once with RESOURCE_EXHAUSTED. `interceptors` default to the
    process's (`set_default_interceptors`): none unless tracing is installed.
    """
    check_listen(listen, allow_external)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=list(_default_interceptors if interceptors is None else interceptors),
        maximum_concurrent_rpcs=max_concurrent_rpcs,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
            ("grpc.max_metadata_size", MAX_METADATA_BYTES),
            ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
        ],
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    for spec, servicer in services:
        spec.add_to_server(servicer, server)
        names.append(spec.full_name)
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(listen)
    if port == 0 and not listen.startswith("unix:"):
        raise OSError(f"could not bind {listen}")
    server.start()
    address = listen if listen.startswith("unix:") else f"{listen.rsplit(':', 1)[0]}:{port}"
    running = RunningServer(server, address, health_servicer)
    running.set_serving(True)
    for spec, _ in services:
        running.set_serving(True, spec.full_name)
    return running


def wait_serving(address: str, timeout: float, service: str = "") -> bool:
    """True once the health service at `address` says SERVING, False after `timeout`."""
    import time

    deadline = time.monotonic() + timeout
    # A fresh subchannel with a short backoff: while a child restarts, a shared subchannel's
    # growing reconnect backoff would hide it for seconds after it is back.
    with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1),
                                                 ("grpc.initial_reconnect_backoff_ms", 100),
                                                 ("grpc.max_reconnect_backoff_ms", 500)]) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=0.5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    return False
