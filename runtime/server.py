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
(measured with `python -m bench.overload priority`). A layered middleware's process, whose
handlers never wait, is served from one event loop instead (`runtime.loop_server`), with the
same health, reflection, TLS and limits (`server_options`).

With a `tls:` section (`runtime.tls`) a TCP listener speaks TLS, mTLS with
`client_ca_file`; a unix socket stays plaintext. Kubernetes' `grpc:` probes cannot speak TLS,
so such a server can also answer its health alone in plaintext on a second address
(`probe_listen`): the same health servicer, nothing else on it.
"""

from __future__ import annotations

import ipaddress
import random
import socket
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from runtime.config.sections import TlsConfig
from runtime.tls import add_port, link_channel
from services.common.thread_names import name_os_thread
from services.component import ComponentSpec
from services.inference.config import InferenceConfig

# Handler threads beyond what the model holds: cache hits, refusals, health and admission
# in progress never wait for a slot, and must not wait behind those who do.
HEADROOM_THREADS = 32

# Metadata (all headers of a call) a server accepts. gRPC's default refuses what lies
# between its soft limit (8 KiB) and its hard one (16 KiB) at random, more often the longer it
# is: the same call would pass or fail by chance. One limit for both makes it decided by the
# call alone: up to here always accepted, past it always RESOURCE_EXHAUSTED (from gRPC itself).
MAX_METADATA_BYTES = 16 << 10

# A server interceptor of any request and response (generic in grpc's stubs only).
if TYPE_CHECKING:
    Interceptor = grpc.ServerInterceptor[Any, Any]
else:
    Interceptor = grpc.ServerInterceptor

# Interceptors every server in this process gets unless it is given its own list: tracing
# installs its trace-context interceptor here once per process (see runtime.observability.tracing.install),
# so servers started by code that knows nothing of tracing still continue traces.
_default_interceptors: tuple[Interceptor, ...] = ()


def set_default_interceptors(interceptors: Sequence[Interceptor]) -> None:
    """Interceptors for servers started from now on without an explicit list."""
    global _default_interceptors
    _default_interceptors = tuple(interceptors)


def default_interceptors() -> tuple[Interceptor, ...]:
    return _default_interceptors


class AddressError(ValueError):
    """A listen address that cannot be used: said in one line, before anything starts (exit 2)."""


class UnsafeAddress(AddressError):
    """A listen address off loopback, refused unless explicitly allowed."""


class MalformedAddress(AddressError):
    """A listen address that is neither HOST:PORT nor unix:PATH."""


class AddressInUse(AddressError):
    """A listen address another process (or another listener here) already holds."""


def split_listen(address: str, flag: str = "listen address") -> tuple[str, int]:
    """(host, port) of a HOST:PORT or [V6]:PORT address; MalformedAddress names what is wrong,
    so `8099` is called malformed rather than "not loopback"."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        example = port if port.isdigit() and int(port) <= 65535 else "8000"
        raise MalformedAddress(f"{flag} {address!r}: expected HOST:PORT (e.g. 127.0.0.1:{example}, a port up to "
                               "65535) or unix:PATH")
    return host, int(port)


def check_listen(address: str, allow_external: bool = False, flag: str = "listen address") -> None:
    """Refuse addresses that are malformed, or that would expose an internal link beyond this machine."""
    if address.startswith("unix:"):
        if not address[len("unix:"):]:
            raise MalformedAddress(f"{flag} {address!r}: unix: needs a socket path, e.g. unix:/tmp/spine.sock")
        return
    host, _ = split_listen(address, flag)
    if allow_external or host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise UnsafeAddress(
        f"{flag} {address!r} is not loopback or a unix socket; "
        "pass --allow-external to expose it beyond this machine"
    )


def check_free(address: str, flag: str = "listen address") -> None:
    """Refuse a TCP address some process already listens on, before anything starts: a server
    that found out while starting would leave children and threads half started. Bound with
    SO_REUSEADDR, as the servers bind, so a port in TIME_WAIT is not called busy. Racy by
    nature (the port can be taken after this): the servers' own bind errors say the same."""
    if address.startswith("unix:"):
        return
    host, port = split_listen(address, flag)
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise MalformedAddress(f"{flag} {address!r}: {error.strerror}") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as error:
            raise AddressInUse(f"{flag} {address}: cannot listen there ({error.strerror}); another process "
                               "holds it, or pick another port") from None


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """The channel arguments of every spine server, thread-pool or event-loop alike."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
    ]


def bound_address(listen: str, port: int, flag: str = "listen address") -> str:
    """What a client dials once `listen` is bound on `port` (0: it could not be): AddressInUse
    in the same sentence as `check_free`."""
    if port == 0 and not listen.startswith("unix:"):
        raise AddressInUse(f"{flag} {listen}: cannot listen there (in use, or not an address of this machine)")
    return listen if listen.startswith("unix:") else f"{listen.rsplit(':', 1)[0]}:{port}"


def served_names(services: Sequence[tuple[ComponentSpec[Any], Any]]) -> list[str]:
    """The services a server's reflection lists: health, reflection itself and `services`."""
    return [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME,
            *(spec.full_name for spec, _ in services)]


class ServerHandle(Protocol):
    """A running server of either kind, as a process holds it: where it listens, its health
    statuses (set by deep health from its own thread) and its graceful stop. The thread-pool
    server (`RunningServer`) or the event-loop one (`runtime.loop_server.LoopServer`)."""

    @property
    def address(self) -> str: ...

    def set_serving(self, serving: bool, service: str = "") -> None: ...

    def stop(self, grace: float = 2.0) -> None: ...


@dataclass
class RunningServer:
    server: grpc.Server
    address: str  # what a client dials: "unix:/path" or "127.0.0.1:PORT"
    health: health.HealthServicer
    probe: ProbeServer | None = None  # the health service alone, in plaintext (`probe_listen`)

    def set_serving(self, serving: bool, service: str = "") -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set(service, status)

    def stop(self, grace: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        if self.probe is not None:
            self.probe.stop()


class _CheckOnly(health_pb2_grpc.HealthServicer):
    """`Health/Check` from another server's health servicer; `Watch` stays UNIMPLEMENTED, so
    nobody can hold the probe listener's few threads with streams that never end."""

    def __init__(self, health_servicer: health.HealthServicer) -> None:
        self._health = health_servicer

    def Check(self, request: Any, context: Any) -> Any:
        return self._health.Check(request, context)


@dataclass
class ProbeServer:
    """A plaintext listener serving only `grpc.health.v1/Check` from another server's health
    servicer: for Kubernetes' `grpc:` probes, which cannot speak TLS. It tells no more than
    whether the server (or one of its services) is SERVING, so it needs no credentials."""

    server: grpc.Server
    address: str

    def stop(self) -> None:
        self.server.stop(0).wait()


def start_probe_server(health_servicer: health.HealthServicer, listen: str,
                       allow_external: bool = False) -> ProbeServer:
    """Serve `health_servicer` alone, in plaintext, on `listen` (loopback unless `allow_external`)."""
    check_listen(listen, allow_external)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="probe", initializer=name_os_thread),
                         options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(_CheckOnly(health_servicer), server)
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError:  # grpc's "Failed to bind to address"
        port = 0
    address = bound_address(listen, port, "--probe-listen")
    server.start()
    return ProbeServer(server, address)


def request_threads(inference: InferenceConfig) -> int:
    """Handler threads for a server whose requests may wait for the model: the inference
    queue (`inference.max_queue`) + every KV slot (at most `inference.max_batch`), for every
    model served (`inference.models`), + headroom."""
    return sum(model.max_queue + model.max_batch for model in inference.served()) + HEADROOM_THREADS


class PoolSize(TypedDict, total=False):
    """`start_server` keywords that size its thread pool."""

    max_workers: int
    max_concurrent_rpcs: int | None


def request_pool(inference: InferenceConfig) -> PoolSize:
    """`start_server` keywords for a server whose requests may wait for the model.

    Calls past the threads wait in gRPC's FIFO only while a thread answers a quick
    refusal (the queue is full), so twice the threads bounds that FIFO's memory; past it
    gRPC itself refuses with RESOURCE_EXHAUSTED."""
    threads = request_threads(inference)
    return PoolSize(max_workers=threads, max_concurrent_rpcs=2 * threads)


def start_server(
    services: Sequence[tuple[ComponentSpec[Any], Any]],
    listen: str,
    *,
    max_message_bytes: int = 1 << 20,
    max_workers: int = 32,
    max_concurrent_rpcs: int | None = None,
    allow_external: bool = False,
    interceptors: Sequence[Interceptor] | None = None,
    tls: TlsConfig | None = None,
    probe_listen: str | None = None,
) -> RunningServer:
    """Start a server hosting `services` on `listen` (port 0 picks a free port).

    With `tls`, a TCP `listen` speaks TLS (mTLS with `tls.client_ca_file`), its certificate
    files re-read when they change; ConfigError names a file that cannot be used.
    `probe_listen`: also answer health alone, in plaintext, there (`start_probe_server`).

    `max_concurrent_rpcs` bounds the calls accepted (running or waiting for a thread);
    past it gRPC refuses at once with RESOURCE_EXHAUSTED. `interceptors` default to the
    process's (`set_default_interceptors`): none unless tracing is installed.
    """
    check_listen(listen, allow_external)
    if probe_listen is not None:
        check_listen(probe_listen, allow_external)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc", initializer=name_os_thread),
        interceptors=list(_default_interceptors if interceptors is None else interceptors),
        maximum_concurrent_rpcs=max_concurrent_rpcs,
        options=server_options(max_message_bytes),
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for spec, servicer in services:
        spec.add_to_server(servicer, server)
    reflection.enable_server_reflection(served_names(services), server)
    try:
        port = add_port(server, listen, tls)
    except RuntimeError:  # grpc's "Failed to bind to address": the same sentence as `check_free`
        port = 0
    address = bound_address(listen, port)
    server.start()
    running = RunningServer(server, address, health_servicer)
    if probe_listen is not None:
        try:
            running.probe = start_probe_server(health_servicer, probe_listen, allow_external)
        except BaseException:
            server.stop(0)
            raise
    running.set_serving(True)
    for spec, _ in services:
        running.set_serving(True, spec.full_name)
    return running


def wait_serving(address: str, timeout: float, service: str = "", tls: TlsConfig | None = None) -> bool:
    """True once the health service at `address` says SERVING, False after `timeout` (over TLS
    with this process's certificate when it has `tls` and `address` is TCP)."""
    import time

    deadline = time.monotonic() + timeout
    # A fresh subchannel with a short backoff: while a child restarts, a shared subchannel's
    # growing reconnect backoff would hide it for seconds after it is back.
    with link_channel(address, tls, options=[("grpc.use_local_subchannel_pool", 1),
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


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports free now, for processes that bind them later (a child
    told its address before it starts).

    Drawn below the kernel's ephemeral range (`ip_local_port_range`), where nothing takes a
    port by itself: a port from that range (what binding port 0 gives) is also what every
    outgoing connection and every other port-0 bind on the machine is handed next, so one
    picked there could be taken by the time its child binds it. Only a process that names
    the same port could take one of these; whoever binds it then fails loudly, it never
    shares it."""
    span = _ports_to_draw()
    ports: set[int] = set()
    tries = 0
    while len(ports) < count:
        tries += 1
        # No room below the range, or crowded there: the kernel's pick, from the range itself.
        candidate = random.randint(*span) if span is not None and tries <= 64 * count else 0
        if candidate in ports:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", candidate))
            except OSError:
                continue
            ports.add(int(probe.getsockname()[1]))
    return sorted(ports)


def _ports_to_draw() -> tuple[int, int] | None:
    """The ports `free_ports` draws from: from 10000 up to just below the ephemeral range
    (None: a machine that made nearly every port ephemeral)."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    return (10000, ephemeral_low - 1) if ephemeral_low > 11000 else None


def free_port() -> int:
    """One loopback port free now (`free_ports`)."""
    return free_ports(1)[0]

