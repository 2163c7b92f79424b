"""Serving controls in numbers: priority classes under a mixed load, and the KV pool.

One inference service in this process, a fixed pool of 4 KV slots so requests queue and
the scheduler's admission order matters. Single-class and mixed-class rounds alternate, so
machine noise falls on both. Reported: p50 per class, tokens/s of each kind of round and
the change, and the KV pool's sizing figures.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from monolith.device import DeviceContext
from services.inference import InferenceConfig, InferenceService
from spine.runtime.bindings import LocalContext
from spine.v1 import generation_pb2


def _round(service: InferenceService, priorities: list[int], max_tokens: int, tag: str) -> tuple[dict[int, list[float]], float]:
    latencies: dict[int, list[float]] = {p: [] for p in set(priorities)}
    tokens = [0]
    lock = threading.Lock()

    def one(i: int, priority: int) -> None:
        request = generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"{tag} request {i}",
                                                 max_tokens=max_tokens, priority=priority)
        started = time.perf_counter()
        response = service.Generate(request, LocalContext())
        with lock:
            latencies[priority].append((time.perf_counter() - started) * 1000.0)
            tokens[0] += response.completion_tokens

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(priorities)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies, tokens[0] / (time.perf_counter() - started)


def measure_serving(requests: int = 48, max_tokens: int = 24, rounds: int = 2) -> dict[str, Any]:
    config = InferenceConfig.from_dict({"kv_cache_max_entries": 4, "max_batch": 4, "aging_ms": 10_000})
    service = InferenceService(config, DeviceContext())
    single: dict[int, list[float]] = {0: []}
    mixed: dict[int, list[float]] = {1: [], -1: []}
    single_rates: list[float] = []
    mixed_rates: list[float] = []
    try:
        _round(service, [0] * 8, max_tokens, "warm")
        for r in range(rounds):
            lat, rate = _round(service, [0] * requests, max_tokens, f"single{r}")
            single[0] += lat[0]
            single_rates.append(rate)
            lat, rate = _round(service, [1 if i % 2 else -1 for i in range(requests)], max_tokens, f"mixed{r}")
            mixed[1] += lat[1]
            mixed[-1] += lat[-1]
            mixed_rates.append(rate)
        plan = service.kv_plan
        single_rate, mixed_rate = statistics.mean(single_rates), statistics.mean(mixed_rates)
        return {
            "requests_per_round": requests, "max_tokens": max_tokens, "rounds": rounds, "kv_slots": plan.slots,
            "single_class_p50_ms": round(statistics.median(single[0]), 1),
            "latency_class_p50_ms": round(statistics.median(mixed[1]), 1),
            "throughput_class_p50_ms": round(statistics.median(mixed[-1]), 1),
            "single_class_tokens_per_s": round(single_rate, 1),
            "mixed_tokens_per_s": round(mixed_rate, 1),
            "throughput_change_pct": round(100.0 * (mixed_rate / single_rate - 1.0), 1),
            "kv": {"per_slot_bytes": plan.per_slot_bytes, "weight_bytes": plan.weight_bytes,
                   "free_bytes": plan.free_bytes, "memory_bound_slots": plan.memory_bound,
                   "formula": plan.describe()},
            "ms_per_token": round(service.ms_per_token, 3),
        }
    finally:
        service.close()
