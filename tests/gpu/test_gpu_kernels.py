"""GPU checks (run by tests/gpu/run.sh; deselected in CI, which has no GPU)."""

from __future__ import annotations

import pytest
import torch

from monolith import cupy_kernels
from monolith.device import DeviceContext
from services.ratelimit.asks import descriptors_for
from services.ratelimit.service import RateLimitConfig, RateLimitService
from wire.v1 import ratelimit_pb2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_device_context_is_cuda_with_a_high_priority_stream() -> None:
    context = DeviceContext()
    assert context.device.type == "cuda"
    assert context.stream(priority=1) is not None


def test_scatter_add_on_cuda_equals_the_cpu_result_with_repeated_rows() -> None:
    generator = torch.Generator().manual_seed(7)
    rows = torch.randint(0, 97, (100_000,), generator=generator)
    amounts = torch.randint(1, 1000, (100_000,), generator=generator)
    expected = cupy_kernels.scatter_add(torch.zeros(97, dtype=torch.int64), rows, amounts)
    got = cupy_kernels.scatter_add(torch.zeros(97, dtype=torch.int64, device="cuda"), rows.cuda(), amounts.cuda())
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), expected)


def test_the_cupy_path_runs_when_cupy_is_installed() -> None:
    pytest.importorskip("cupy")
    assert cupy_kernels.available()


def test_rate_limit_admission_on_cuda_equals_the_cpu_decisions() -> None:
    config = RateLimitConfig.parse({"default": {"requests_per_second": 1, "burst": 50,
                                                    "tokens_per_minute": 600, "token_burst": 5000}})
    requests = [ratelimit_pb2.RateLimitRequest(domain="spine", descriptors=descriptors_for(
        f"t{i % 3}", "tiny-lm", 10 + i)) for i in range(300)]
    answers = []
    for device in ("cpu", "cuda"):
        service = RateLimitService(config, DeviceContext(torch.device(device)), clock=lambda: 100.0)
        answers.append([r.SerializeToString(deterministic=True) for r in service.admit_batch(requests)])
    assert answers[0] == answers[1]


def test_metric_tables_on_cuda_count_like_the_cpu_tables() -> None:
    """The counters and histogram counts go through `DeviceContext.scatter_add` (CuPy's
    atomicAdd when installed); the exposition must equal the CPU service's."""
    from services.metrics.service import MetricsConfig, MetricsService
    from wire.v1 import metrics_pb2

    records = [metrics_pb2.RequestRecord(layout="collapsed", model="tiny-lm", tenant=f"t{i % 5}",
                                         status="OK" if i % 7 else "RESOURCE_EXHAUSTED", latency_s=0.001 * (i % 40),
                                         middleware_s={"auth": 1e-4 * (i % 3)}, cached=i % 4 == 0,
                                         completion_tokens=i % 9)
               for i in range(2_000)]
    rendered = []
    for device in ("cpu", "cuda"):
        service = MetricsService(MetricsConfig(), DeviceContext(device=torch.device(device)))
        for start in range(0, len(records), 64):
            service.record_batch(records[start:start + 64])
        rendered.append(service.render().splitlines())
    cpu, cuda = rendered
    assert len(cpu) == len(cuda)
    for want, got in zip(cpu, cuda, strict=True):
        if "_sum{" in want:  # float sums: atomic adds on the GPU may add in another order
            assert want.rsplit(" ", 1)[0] == got.rsplit(" ", 1)[0]
            assert float(got.rsplit(" ", 1)[1]) == pytest.approx(float(want.rsplit(" ", 1)[1]), rel=1e-9)
        else:  # counts are integers: exactly equal
            assert want == got
