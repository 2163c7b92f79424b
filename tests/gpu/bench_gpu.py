"""A short GPU benchmark for tests/gpu/run.sh: counters and admission, CUDA against the CPU."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from monolith import cupy_kernels
from monolith.device import DeviceContext
from services.ratelimit.asks import descriptors_for
from services.ratelimit.service import RateLimitConfig, RateLimitService
from wire.v1 import ratelimit_pb2


def per_call_us(fn: Callable[[], object], repeat: int, sync: bool) -> float:
    fn()
    if sync:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    if sync:
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeat * 1e6


def main() -> None:
    print(f"device: {torch.cuda.get_device_name(0)}  cupy path: {cupy_kernels.available()}")
    for n in (64, 4096, 1_000_000):
        rows = torch.randint(0, 1024, (n,))
        amounts = torch.ones(n, dtype=torch.int64)
        for device in ("cpu", "cuda"):
            table = torch.zeros(1024, dtype=torch.int64, device=device)
            r, a = rows.to(device), amounts.to(device)
            us = per_call_us(lambda t=table, r=r, a=a: cupy_kernels.scatter_add(t, r, a), 50, device == "cuda")
            print(f"scatter_add n={n:>8} {device:4}: {us:10.1f} us/call")
    config = RateLimitConfig.parse({})
    for batch in (1, 32, 256):
        requests = [ratelimit_pb2.RateLimitRequest(domain="spine", descriptors=descriptors_for(
            f"t{i % 8}", "tiny-lm", 20)) for i in range(batch)]
        for device in ("cpu", "cuda"):
            service = RateLimitService(config, DeviceContext(torch.device(device)))
            us = per_call_us(lambda s=service, q=requests: s.admit_batch(q), 50, device == "cuda")
            print(f"admit_batch batch={batch:>4} {device:4}: {us:10.1f} us/batch  {us / batch:8.2f} us/request")
    print(f"peak CUDA memory: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
