"""The batched spine end to end: same answers as one call per request, batches really form.

Real stacks (gRPC front, in-process services, the tiny model); the unbatched collapsed
layout is the reference, and test_layouts.py holds the batched spine to the layered one.
"""

from __future__ import annotations

import json
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from runtime.config.file import placements_for
from runtime.running_stack import RunningStack
from runtime.stack import Stack
from spine.client.gateway_client import CallResult, GatewayClient
from tests.conftest import DEV_KEY, TIGHT_KEY, config_for_tests
from tests.integration.test_faults_and_cli import spine_up
from tests.integration.test_layouts import parity_sequence
from tests.waiting import eventually
from wire.v1 import generation_pb2


class AuthGate:
    """A pipeline hook that holds the first auth step until released, so a queue builds up."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.held = threading.Event()
        self._first = True
        self._lock = threading.Lock()

    def begin(self, component: str, method: str, metadata: list[tuple[str, str]]) -> Any:
        if component == "auth":
            with self._lock:
                first, self._first = self._first, False
            if first:
                self.held.set()
                self.release.wait(timeout=30)
        return None

    def end(self, token: Any, code: grpc.StatusCode) -> None:
        return None


@pytest.fixture(scope="module")
def spines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningStack]]:
    tmp = tmp_path_factory.mktemp("spines")
    stacks: dict[str, RunningStack] = {}
    try:
        for name, enabled in (("batched", True), ("unbatched", False)):
            config = config_for_tests(batching={"enabled": enabled})
            stacks[name] = Stack(config, placements_for("collapsed", config), run_dir=tmp / name).start()
        yield stacks
    finally:
        for stack in stacks.values():
            stack.stop()


def full_answer(result: CallResult) -> tuple[Any, ...]:
    # The request id is fresh per call, the load hint a live reading and the overhead a timing: they vary.
    trailers = {k: v for k, v in result.trailing.items()
                if k not in ("x-request-id", "x-spine-load", "x-spine-overhead-duration-ms")}
    if "retry-after" in trailers:
        trailers["retry-after"] = "<t>"
    return (*result.decision(), tuple(sorted(trailers.items())), bool(result.trailing.get("x-request-id")),
            "x-spine-load" in result.trailing, "x-spine-overhead-duration-ms" in result.trailing)


def test_only_the_batched_spine_has_batched_stages(spines: dict[str, RunningStack]) -> None:
    assert spines["batched"].admission is not None and spines["batched"].completions is not None
    assert spines["unbatched"].admission is None and spines["unbatched"].completions is None


def test_batched_and_unbatched_spines_give_the_same_answers_codes_messages_and_trailers(
        spines: dict[str, RunningStack]) -> None:
    answers = {}
    for name, stack in spines.items():
        with GatewayClient(stack.address) as client:
            answers[name] = [full_answer(client.generate(request, token=token or ""))
                             for request, token in parity_sequence()]
    assert answers["batched"] == answers["unbatched"]
    assert {a[0] for a in answers["batched"]} >= {"OK", "UNAUTHENTICATED", "NOT_FOUND", "INVALID_ARGUMENT",
                                                 "PERMISSION_DENIED", "RESOURCE_EXHAUSTED"}
    assert spines["batched"].admission is not None
    assert spines["batched"].admission.stats.items >= len(parity_sequence())


def test_concurrent_requests_are_admitted_as_one_batch_each_with_its_own_answer(tmp_path: Path) -> None:
    gate = AuthGate()
    config = config_for_tests()
    stack = Stack(config, placements_for("collapsed", config), run_dir=tmp_path / "run", hooks=[gate]).start()
    try:
        assert stack.admission is not None
        batcher = stack.admission.batcher
        requests: list[tuple[generation_pb2.GenerateRequest, str]] = [
            (generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"tight {i}", max_tokens=2), TIGHT_KEY)
            for i in range(8)]
        requests += [(generation_pb2.GenerateRequest(model="gpt-9", prompt="unknown", max_tokens=2), DEV_KEY),
                     (generation_pb2.GenerateRequest(model="tiny-lm", prompt="", max_tokens=2), DEV_KEY),
                     (generation_pb2.GenerateRequest(model="tiny-lm", prompt="no key", max_tokens=2), "wrong")]
        results: dict[int, CallResult] = {}
        with GatewayClient(stack.address) as client:
            first = threading.Thread(target=lambda: results.__setitem__(
                -1, client.generate(generation_pb2.GenerateRequest(model="tiny-lm", prompt="first", max_tokens=2),
                                    token=DEV_KEY)))
            first.start()
            assert gate.held.wait(30)
            threads = [threading.Thread(target=lambda i=i, r=r, t=t: results.__setitem__(
                i, client.generate(r, token=t))) for i, (r, t) in enumerate(requests)]
            for thread in threads:
                thread.start()
            eventually(lambda: batcher.queued >= len(requests), 30, "every request queued", interval=0.005,
                       seen=lambda: batcher.queued)
            gate.release.set()
            for thread in [first, *threads]:
                thread.join(60)
    finally:
        stack.stop()
    assert batcher.stats.largest == len(requests)  # all queued requests decided as one batch
    codes = [results[i].code.name for i in range(len(requests))]
    assert codes[:8].count("OK") == 4 and codes[:8].count("RESOURCE_EXHAUSTED") == 4  # the tight burst
    assert all("retry-after" in results[i].trailing for i in range(8) if codes[i] != "OK")
    assert codes[8:] == ["NOT_FOUND", "INVALID_ARGUMENT", "UNAUTHENTICATED"]
    assert results[-1].ok
    assert all(r.trailing.get("x-spine-layout") == "collapsed" for r in results.values())


def test_a_stream_is_admitted_by_the_batch_and_streams_the_same_tokens(spines: dict[str, RunningStack]) -> None:
    request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="stream me through the batch", max_tokens=6,
                                             temperature=0.8, seed=5)
    stack = spines["batched"]
    assert stack.admission is not None
    before = stack.admission.stats.items
    with GatewayClient(stack.address, DEV_KEY) as client:
        streamed = client.stream(request)
    with GatewayClient(spines["unbatched"].address, DEV_KEY) as client:
        unary = client.generate(request)
    assert streamed.ok and unary.ok
    assert len(streamed.chunks) > 1  # token by token, not one answer at the end
    assert streamed.token_ids == unary.token_ids
    assert stack.admission.stats.items == before + 1
    with GatewayClient(stack.address) as client:
        denied = client.stream(request, token="wrong")
    assert denied.code == grpc.StatusCode.UNAUTHENTICATED and denied.layout == "collapsed"


def test_sigterm_under_load_loses_no_accepted_request_from_the_log_or_the_metrics(tmp_path: Path) -> None:
    """Metrics are read from the final flush file, run_dir/metrics.prom, written at shutdown."""
    run_dir = tmp_path / "run"
    process, ready = spine_up("collapsed", run_dir)
    accepted: list[str] = []
    answered = threading.Event()
    stop = threading.Event()
    lock = threading.Lock()

    def client_loop(worker: int) -> None:
        with GatewayClient(str(ready["address"]), DEV_KEY) as client:
            for i in range(10_000):
                if stop.is_set():
                    return
                result = client.generate(generation_pb2.GenerateRequest(
                    model="tiny-lm", prompt=f"load {worker} {i}", max_tokens=3), timeout=10)
                if result.ok:
                    with lock:
                        accepted.append(result.trailing["x-request-id"])
                    if len(accepted) >= 20:
                        answered.set()
                elif result.code == grpc.StatusCode.UNAVAILABLE:
                    return  # the server has gone away

    workers = [threading.Thread(target=client_loop, args=(w,)) for w in range(8)]
    try:
        for worker in workers:
            worker.start()
        assert answered.wait(60), "no load got through"
        process.send_signal(signal.SIGTERM)  # while the workers keep sending
        process.wait(timeout=60)
    finally:
        stop.set()
        for worker in workers:
            worker.join(30)
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0
    logged = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    logged_ids = {entry["request_id"] for entry in logged}
    missing = set(accepted) - logged_ids
    assert not missing, f"{len(missing)} of {len(accepted)} accepted requests have no log line"
    text = (run_dir / "metrics.prom").read_text()
    counted = {status: sum(int(float(n)) for n in re.findall(
        rf'^spine_requests_total{{[^}}]*status="{status}"[^}}]*}} (\S+)$', text, re.M)) for status in ("OK",)}
    total = sum(int(float(n)) for n in re.findall(r"^spine_requests_total{[^}]*} (\S+)$", text, re.M))
    assert counted["OK"] >= len(accepted)
    assert total == len(logged)  # every request counted is logged, and the other way round
