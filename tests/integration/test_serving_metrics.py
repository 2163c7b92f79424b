"""The model server's metrics: KV slots, queue depth, batch size, TTFT and ITL at /metrics,
in the servicer's own registry and through the one /metrics address of each layout."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from runtime.observability.serving_metrics_export import ADDRESS_FILE
from runtime.running_stack import RunningStack
from runtime.stack import Stack
from services.inference.gpu_metrics import GpuGoldenMetrics
from services.pipeline.system_prompt import system_digest
from tests.conftest import DEV_KEY, start_stack
from tests.unit.test_serving_support import Call, make_service, request
from tests.waiting import eventually
from wire.v1 import gateway_pb2_grpc, generation_pb2

pytestmark = pytest.mark.usefixtures("torch_one_thread")

FAMILIES = ("spine_kv_slots", "spine_queue_depth", "spine_batch_size", "spine_ttft_seconds")


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, tuple(sorted(labels.items())))]


def test_the_servicers_registry_counts_steps_first_tokens_and_waiting_requests() -> None:
    service, model = make_service(kv_cache_max_entries=2, max_batch=2)
    try:
        model.hold()
        # The two slots first, then one waiting request per class, so which requests wait is a
        # fact. A request arriving while a (held) step runs waits for that step to end before
        # it gets a slot: let steps through one at a time until both run.
        calls = [Call(service, request(f"request {i}", 4)) for i in range(2)]

        def both_running() -> bool:
            if service.scheduler.queue_depth:
                model.release(1)
            return service.engine.active_count == 2

        eventually(both_running, 20, "both requests in a slot", interval=0.02,
                   seen=lambda: service.engine.active_count)
        calls += [Call(service, request(f"request {i}", 4, priority=p)) for i, p in ((2, 1), (3, -1))]
        eventually(lambda: service.scheduler.queue_depth == 2)
        waiting = generate_latest(service.metrics_registry).decode()
        assert value(waiting, "spine_kv_slots", model="tiny-lm", state="used") == 2
        assert value(waiting, "spine_kv_slots", model="tiny-lm", state="free") == 0
        assert value(waiting, "spine_queue_depth", model="tiny-lm", priority="latency") == 1
        assert value(waiting, "spine_queue_depth", model="tiny-lm", priority="throughput") == 1
        assert value(waiting, "spine_queue_depth", model="tiny-lm", priority="default") == 0
        model.open()
        outputs = sum(len(call.wait().tokens) for call in calls)
        text = generate_latest(service.metrics_registry).decode()
    finally:
        service.close()
    assert value(text, "spine_kv_slots", model="tiny-lm", state="free") == 2
    assert value(text, "spine_ttft_seconds_count", model="tiny-lm") == 4
    assert value(text, "spine_itl_seconds_count", model="tiny-lm") == outputs - 4  # every 4-token answer ran out
    steps = value(text, "spine_batch_size_count", model="tiny-lm")
    assert value(text, "spine_batch_size_sum", model="tiny-lm") == outputs and outputs / 2 <= steps < outputs
    assert value(text, "spine_batch_size_bucket", model="tiny-lm", le="2.0") == steps  # never more than 2 slots
    assert value(text, "spine_ttft_seconds_sum", model="tiny-lm") > 0
    assert value(text, "spine_device_bytes", owner="inference.kv_cache") > 0


def test_the_prefix_cache_shows_its_blocks_and_lookups() -> None:
    service, _ = make_service()
    try:
        for i in range(3):
            Call(service, request(f"q{i}", 3, system="A system prompt long enough for two blocks.")).wait()
        text = generate_latest(service.metrics_registry).decode()
    finally:
        service.close()
    assert value(text, "spine_prefix_cache_lookups_total", model="tiny-lm", result="hit") == 2
    assert value(text, "spine_prefix_cache_lookups_total", model="tiny-lm", result="miss") == 1
    assert value(text, "spine_kv_blocks", model="tiny-lm", state="cached") == 2
    assert value(text, "spine_kv_blocks", model="tiny-lm", state="used") == 0


class FakeNvml:
    """pynvml's calls the collector makes, answering like an H100 at work."""

    NVML_CLOCK_SM = 1

    def __init__(self, power_supported: bool = True) -> None:
        self.power_supported = power_supported

    def nvmlInit(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: return 1
    def nvmlDeviceGetHandleByIndex(self, index: int) -> str: return f"h{index}"
    def nvmlDeviceGetUUID(self, handle: str) -> str: return "GPU-1234"
    def nvmlDeviceGetMinorNumber(self, handle: str) -> int: return 3
    def nvmlDeviceGetName(self, handle: str) -> bytes: return b"NVIDIA H100"
    def nvmlDeviceGetUtilizationRates(self, handle: str) -> Any: return SimpleNamespace(gpu=71, memory=22)
    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any: return SimpleNamespace(used=3 << 30)
    def nvmlDeviceGetClockInfo(self, handle: str, clock: int) -> int: return 1980

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        if not self.power_supported:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 350_500


def _gpu_text(collector: GpuGoldenMetrics) -> str:
    from prometheus_client.registry import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def test_on_cuda_the_five_golden_metrics_carry_dcgm_exporters_names_units_and_labels() -> None:
    text = _gpu_text(GpuGoldenMetrics(torch.device("cuda", 0), nvml=FakeNvml))
    who = {"gpu": "0", "UUID": "GPU-1234", "device": "nvidia3", "modelName": "NVIDIA H100"}
    assert value(text, "DCGM_FI_DEV_GPU_UTIL", **who) == 71
    assert value(text, "DCGM_FI_DEV_MEM_COPY_UTIL", **who) == 22
    assert value(text, "DCGM_FI_DEV_FB_USED", **who) == 3072  # MiB
    assert value(text, "DCGM_FI_DEV_SM_CLOCK", **who) == 1980  # MHz
    assert value(text, "DCGM_FI_DEV_POWER_USAGE", **who) == 350.5  # W


def test_a_field_the_gpu_does_not_support_is_left_out_and_the_others_stay() -> None:
    text = _gpu_text(GpuGoldenMetrics(torch.device("cuda", 0), nvml=lambda: FakeNvml(power_supported=False)))
    assert "DCGM_FI_DEV_POWER_USAGE" not in text and "DCGM_FI_DEV_GPU_UTIL" in text


def test_without_cuda_or_without_nvidia_ml_py_the_gpu_metrics_are_absent() -> None:
    def missing() -> Any:
        raise ImportError("No module named 'pynvml'")

    assert _gpu_text(GpuGoldenMetrics(torch.device("cpu"), nvml=FakeNvml)) == ""
    cuda_without_package = GpuGoldenMetrics(torch.device("cuda", 0), nvml=missing)
    assert _gpu_text(cuda_without_package) == "" and not cuda_without_package.available


# -- both layouts: the one /metrics address ------------------------------------------------------
@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningStack]]:
    tmp = tmp_path_factory.mktemp("serving-metrics")
    running: dict[str, RunningStack] = {}
    try:
        for layout in ("collapsed", "layered"):
            running[layout] = start_stack(layout, tmp)
        yield running
    finally:
        for stack in running.values():
            stack.stop()


def _traffic(stack: RunningStack, count: int) -> list[generation_pb2.GenerateResponse]:
    """`count` distinct requests at once (no cache hits), sharing a system prompt; one streams."""
    answers: list[Any] = [None] * count
    with grpc.insecure_channel(stack.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        metadata = (("authorization", f"Bearer {DEV_KEY}"),)

        def one(i: int) -> None:
            req = generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"{stack.layout} question {i}",
                                                 max_tokens=6, system="You answer questions about metrics.")
            if i == 0:
                answers[i] = list(stub.GenerateStream(req, metadata=metadata, timeout=60))
            else:
                answers[i] = stub.Generate(req, metadata=metadata, timeout=60)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return answers


@pytest.mark.parametrize("layout", ["collapsed", "layered"])
def test_metrics_show_the_serving_families_after_traffic(stacks: dict[str, RunningStack], layout: str) -> None:
    stack = stacks[layout]
    answers = _traffic(stack, 6)
    assert all(chunk.system_digest == system_digest("You answer questions about metrics.") for chunk in answers[0])
    assert all(a.system_digest == answers[0][0].system_digest for a in answers[1:])
    address = stack.metrics_address()
    assert address is not None
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    names = {family.name for family in text_string_to_metric_families(text)}
    assert set(FAMILIES) <= names, sorted(names)
    slots = stack.config.inference.kv_cache_max_entries
    used = value(text, "spine_kv_slots", model="tiny-lm", state="used")
    free = value(text, "spine_kv_slots", model="tiny-lm", state="free")
    assert used == 0 and free >= 1 and (slots == "auto" or used + free == slots)
    # every served model has its own series (the second model has its own pool and queue)
    assert value(text, "spine_kv_slots", model="tiny-lm-mini", state="free") >= 1
    assert value(text, "spine_queue_depth", model="tiny-lm-mini", priority="default") == 0
    assert {value(text, "spine_queue_depth", model="tiny-lm", priority=p)
            for p in ("latency", "default", "throughput")} == {0}
    assert value(text, "spine_ttft_seconds_count", model="tiny-lm") >= 6
    assert 0 < value(text, "spine_ttft_seconds_sum", model="tiny-lm") < 6 * 60
    steps = value(text, "spine_batch_size_count", model="tiny-lm")
    assert steps >= 6 and value(text, "spine_batch_size_sum", model="tiny-lm") >= steps
    assert value(text, "spine_itl_seconds_count", model="tiny-lm") > 0
    assert value(text, "spine_device_bytes", owner="inference.kv_cache") > 0
    assert "spine_requests_total" in {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_the_layered_inference_process_serves_its_own_metrics(stacks: dict[str, RunningStack]) -> None:
    stack = stacks["layered"]
    assert stack.run_dir is not None
    own = (Path(stack.run_dir) / ADDRESS_FILE).read_text().strip()
    text = urllib.request.urlopen(f"http://{own}/metrics", timeout=10).read().decode()
    names = {family.name for family in text_string_to_metric_families(text)}
    assert set(FAMILIES) <= names and "spine_requests" not in names  # only the model's own families
    assert not (Path(stacks["collapsed"].run_dir or "") / ADDRESS_FILE).exists()  # one /metrics there


def test_a_stage_with_the_model_in_the_spine_and_metrics_still_remote_forwards_the_spines_model(
        tmp_path: Path) -> None:
    from tests.conftest import config_for_tests

    config = config_for_tests()
    placements = {name: "local" for name in ("auth", "ratelimit", "router", "cache", "logs", "inference")}
    stack = Stack(config, {**placements, "metrics": "remote"}, run_dir=tmp_path / "stage").start()
    try:
        _traffic(stack, 3)
        assert stack.inference_metrics is not None  # the spine serves its model's own /metrics ...
        address = stack.metrics_address()  # ... and the metrics process's /metrics forwards it
        assert address is not None
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    finally:
        stack.stop()
    assert value(text, "spine_ttft_seconds_count", model="tiny-lm") >= 3
    assert set(FAMILIES) <= {family.name for family in text_string_to_metric_families(text)}
