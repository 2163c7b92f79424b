"""A layered middleware's process serves from one event loop (`runtime.loop_server`).

Every call is answered on the loop's own thread, however many arrive together; a call its
servicer says may block (a log flush) runs on a thread while the loop keeps answering;
aborts, errors, health and a graceful stop behave as on the thread-pool server.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from monolith.device import DeviceContext
from runtime.config.sections import TlsConfig
from runtime.loop_server import LoopServer, start_loop_server
from runtime.processes.launch import launch, serving_on
from runtime.server import free_ports
from services.registry import DEFAULT
from spine.tools.dev_certs import issue, make_authority
from tests.conftest import DEV_KEY, config_for_tests
from tests.tls_helpers import channel, health, make_certs
from tests.waiting import eventually
from wire.v1 import auth_pb2, logs_pb2, ratelimit_pb2, router_pb2


class Recorded:
    """A servicer as it is, but each rpc named in `rpcs` records the thread it ran on; with
    `hold`, those calls also wait for it (a call still in flight)."""

    def __init__(self, servicer: Any, *rpcs: str, blocking: bool = False, hold: threading.Event | None = None) -> None:
        self._servicer = servicer
        self.threads: list[int] = []
        self.entered = threading.Event()
        for rpc in rpcs:
            setattr(self, rpc, self._recording(getattr(servicer, rpc), hold))
        if blocking:
            self.may_block = lambda rpc, request: True

    def _recording(self, handler: Any, hold: threading.Event | None) -> Any:
        def handle(request: Any, context: Any) -> Any:
            self.threads.append(threading.get_ident())
            self.entered.set()
            if hold is not None:
                hold.wait(30)
            return handler(request, context)
        return handle

    def __getattr__(self, name: str) -> Any:
        return getattr(self._servicer, name)


@pytest.fixture
def router(tmp_path: Path) -> Any:
    return DEFAULT["router"].build(config_for_tests(), DeviceContext(), tmp_path)


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    started: list[LoopServer] = []

    def start(component: str, servicer: Any) -> tuple[LoopServer, Any]:
        running = start_loop_server([(DEFAULT[component], servicer)], f"unix:{tmp_path}/{component}.sock")
        started.append(running)
        channel = grpc.insecure_channel(running.address)
        return running, DEFAULT[component].stub_class()(channel)

    yield start
    for running in started:
        running.stop(0)


def _resolve(model: str = "tiny") -> router_pb2.ResolveBatchRequest:
    return router_pb2.ResolveBatchRequest(items=[router_pb2.ResolveRequest(model=model)])


def test_concurrent_calls_are_all_answered_on_the_event_loops_thread(serve: Any, router: Any) -> None:
    recorded = Recorded(router, "ResolveBatch")
    running, stub = serve("router", recorded)
    with ThreadPoolExecutor(16) as clients:
        answers = list(clients.map(lambda _: stub.ResolveBatch(_resolve(), timeout=10), range(64)))
    assert all(answer.results[0].response.model_id == "tiny-lm" for answer in answers)
    assert len(recorded.threads) == 64
    assert set(recorded.threads) == {running.thread.ident}  # a thread-pool server spreads them over its pool


def test_a_call_that_may_block_runs_off_the_loop_while_the_loop_keeps_answering(serve: Any, tmp_path: Path) -> None:
    logs = DEFAULT["logs"].build(config_for_tests(), DeviceContext(), tmp_path)
    hold = threading.Event()
    recorded = Recorded(logs, "Flush", hold=hold)
    running, stub = serve("logs", recorded)
    try:
        flushed = stub.Flush.future(logs_pb2.FlushRequest(), timeout=30)
        eventually(recorded.entered.is_set, what="the flush running")
        # the flush waits on its thread; an append (room in the ring: inline) is answered meanwhile
        appended = stub.AppendBatch(logs_pb2.AppendBatchRequest(records=[logs_pb2.LogRecord(
            request_id="r1", tenant="t", model="m", status="OK", latency_ms=1.0, layout="layered")]), timeout=10)
        assert not appended.results[0].code and not flushed.done()
    finally:
        hold.set()
    assert flushed.result().lines_written == 1
    assert recorded.threads and running.thread.ident not in recorded.threads
    logs.close()


def test_an_abort_reaches_the_caller_with_its_code_and_the_loop_keeps_serving(serve: Any, tmp_path: Path) -> None:
    ratelimit = DEFAULT["ratelimit"].build(config_for_tests(), DeviceContext(), tmp_path)
    _, stub = serve("ratelimit", ratelimit)
    with pytest.raises(grpc.RpcError) as refused:
        stub.SetShare(ratelimit_pb2.SetShareRequest(fraction=2.0), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("fraction:")
    assert stub.SetShare(ratelimit_pb2.SetShareRequest(fraction=0.5), timeout=10).fraction == 0.5


def test_a_handlers_exception_is_unknown_and_the_loop_keeps_serving(serve: Any, router: Any) -> None:
    class Broken(Recorded):
        def ListModels(self, request: Any, context: Any) -> Any:
            raise RuntimeError("broken on purpose")

    _, stub = serve("router", Broken(router))
    with pytest.raises(grpc.RpcError) as failed:
        stub.ListModels(router_pb2.ListModelsRequest(), timeout=10)
    assert failed.value.code() == grpc.StatusCode.UNKNOWN
    assert stub.ResolveBatch(_resolve(), timeout=10).results[0].response.model_id == "tiny-lm"


def test_health_follows_set_serving_and_a_graceful_stop_lets_the_call_in_flight_finish(serve: Any,
                                                                                     router: Any) -> None:
    hold = threading.Event()
    recorded = Recorded(router, "ResolveBatch", blocking=True, hold=hold)
    running, stub = serve("router", recorded)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(running.address))
    service = DEFAULT["router"].full_name

    def status() -> int:
        return int(health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status)

    assert status() == health_pb2.HealthCheckResponse.SERVING
    running.set_serving(False, service)
    assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
    running.set_serving(True, service)
    in_flight = stub.ResolveBatch.future(_resolve(), timeout=30)
    eventually(recorded.entered.is_set, what="the call running")
    stopping = threading.Thread(target=running.stop, args=(20.0,))
    stopping.start()
    try:
        eventually(lambda: not holds_calls(running), what="the server refusing new calls")
    finally:
        hold.set()
        stopping.join(30)
    assert in_flight.result().results[0].response.model_id == "tiny-lm"  # finished, not cut


def holds_calls(running: LoopServer) -> bool:
    """Whether a new call to `running` is still taken."""
    channel = grpc.insecure_channel(running.address)
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return True
    except grpc.RpcError:
        return False
    finally:
        channel.close()


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_a_layered_middleware_process_answers_a_burst_without_adding_threads(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(config_for_tests().to_yaml())
    address = f"unix:{tmp_path}/router.sock"
    process = launch("router", [sys.executable, "-m", "runtime.process", "router", "--listen", address,
                                "--config", str(config), "--run-dir", str(tmp_path)], log_path=tmp_path / "router.log")
    try:
        process.wait_ready(60, serving_on)
        stub = DEFAULT["router"].stub_class()(grpc.insecure_channel(address))
        assert stub.ResolveBatch(_resolve(), timeout=10).results[0].response.model_id == "tiny-lm"
        before = _threads(process.pid)
        with ThreadPoolExecutor(32) as clients:
            for _ in range(3):
                list(clients.map(lambda _: stub.ResolveBatch(_resolve(), timeout=10), range(128)))
        # a thread-pool server grows a handler thread for each call it found the others busy with
        assert _threads(process.pid) == before
    finally:
        code = process.stop(30)
    assert code == 0


def test_a_middleware_process_over_mtls_answers_its_peers_and_its_probe_listener_in_plaintext(
        tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    config = tmp_path / "config.yaml"
    config.write_text(config_for_tests(tls=certs.tls_config()).to_yaml())
    listen, probe = (f"127.0.0.1:{port}" for port in free_ports(2))
    process = launch("auth", [sys.executable, "-m", "runtime.process", "auth", "--listen", listen, "--probe-listen",
                              probe, "--config", str(config), "--run-dir", str(tmp_path)], log_path=tmp_path / "auth.log")
    try:
        process.wait_ready(60, serving_on)
        assert health(listen, certs.credentials()) == "SERVING"
        assert health(listen, certs.credentials("other"), timeout=3) == "UNAVAILABLE"  # another CA's client
        assert health(listen, None, timeout=3) == "UNAVAILABLE"  # plaintext refused on the real listener
        assert health(probe, None) == "SERVING"
        with channel(listen, certs.credentials()) as secure:
            answer = DEFAULT["auth"].stub_class()(secure).CheckBatch(
                auth_pb2.CheckBatchRequest(items=[auth_pb2.CheckRequest(credential=f"Bearer {DEV_KEY}")]), timeout=10)
            assert answer.results[0].response.principal.tenant == "dev"
        with channel(probe, None) as plain, pytest.raises(grpc.RpcError) as watch:  # health alone, no streams
            next(health_pb2_grpc.HealthStub(plain).Watch(health_pb2.HealthCheckRequest(), timeout=5))
        assert watch.value.code() == grpc.StatusCode.UNIMPLEMENTED  # type: ignore[attr-defined]
    finally:
        code = process.stop(30)
    assert code == 0


def test_swapped_certificate_files_serve_the_loops_next_handshakes_without_a_restart(tmp_path: Path,
                                                                                   router: Any) -> None:
    certs = make_certs(tmp_path / "certs")
    live = tmp_path / "live"
    live.mkdir()
    for name in ("server.pem", "server-key.pem", "ca.pem"):
        shutil.copy(certs.dir / name, live / name)
    tls = TlsConfig(cert_file=str(live / "server.pem"), key_file=str(live / "server-key.pem"),
                    client_ca_file=str(live / "ca.pem"))
    authority = make_authority("rotated CA")
    server = issue(authority, "rotated-server", names=("localhost", "127.0.0.1"), server=True)
    client = issue(authority, "rotated-client")
    rotated = grpc.ssl_channel_credentials(authority.pem, client.key_pem, client.certificate_pem)
    running = start_loop_server([(DEFAULT["router"], router)], "127.0.0.1:0", tls=tls)
    try:
        assert health(running.address, certs.credentials()) == "SERVING"
        assert health(running.address, rotated, timeout=3) == "UNAVAILABLE"
        (live / "server.pem").write_bytes(server.certificate_pem)
        (live / "server-key.pem").write_bytes(server.key_pem)
        (live / "ca.pem").write_bytes(authority.pem)
        assert health(running.address, rotated) == "SERVING"  # the new set, read at the next handshake
        assert health(running.address, certs.credentials(), timeout=3) == "UNAVAILABLE"  # the old CA's client
    finally:
        running.stop(0)
