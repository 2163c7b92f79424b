"""Serving controls in numbers: priority classes under a mixed load, the KV pool, shared system prompts.

One inference service in this process, a fixed pool of 4 KV slots so requests queue and
the scheduler's admission order matters. Single-class and mixed-class rounds alternate, so
machine noise falls on both. Reported: p50 per class, tokens/s of each kind of round and
the change, and the KV pool's sizing figures.

`measure_system_prompt`: 100 requests sent at once, sharing one system prompt, to a
service with the prefix cache and to one without (16 KV slots each; rounds alternate, each
round with a system prompt of its own, so every round starts cold). Reported: the peak of
KV bytes held (blocks in use × bytes per block) and the p50 time to the first streamed
chunk, with and without reuse.

`measure_system_prompt_hf`: the same experiment on the transformers backend, a tiny llama
made here (`spine model make-tiny`), whose KV is one region per slot: a shared prefix is
stored once and copied into each slot that reuses it (`services.inference.model.kv_prefix`). There
the KV bytes are what the process holds for the KV (the slot pool, whole slots whatever
the prompt, plus the stored prefixes at their peak): reuse saves the prefill (counted in
positions the model forwarded), not memory.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from monolith.device import DeviceContext
from services.inference.service import InferenceConfig, InferenceService
from services.pipeline.local_context import LocalContext
from wire.v1 import generation_pb2


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
    config = InferenceConfig.parse({"kv_cache_max_entries": 4, "max_batch": 4, "aging_ms": 10_000})
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


SYSTEM_PROMPT = ("You are the support assistant of a small bookshop. Answer the customer's question in one or two "
                 "short sentences, politely, in plain English. If you do not know the answer, say so and suggest "
                 "asking at the counter. Never invent prices, opening hours or stock levels. Do not use lists, "
                 "markdown or emoji. Keep a friendly tone. Here are the shop's rules: books can be returned within "
                 "thirty days with a receipt; orders arrive within a week; gift cards never expire; members get "
                 "ten percent off every book and an invitation to the readings on the first Friday of the month.")


def _first_chunks(service: InferenceService, system: str, requests: int, max_tokens: int,
                  model: str = "tiny-lm") -> list[float]:
    """`requests` streams at once, all with `system`; milliseconds to each one's first chunk."""
    ttft: list[float] = [0.0] * requests

    def one(i: int) -> None:
        request = generation_pb2.GenerateRequest(model=model, prompt=f"Customer {i}: do you have book {i}?",
                                                 max_tokens=max_tokens, system=system)
        started = time.perf_counter()
        stream = service.GenerateStream(request, LocalContext())
        next(stream)
        ttft[i] = (time.perf_counter() - started) * 1000.0
        for _ in stream:
            pass

    threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return ttft


def measure_system_prompt(requests: int = 100, max_tokens: int = 8, rounds: int = 2, slots: int = 16) -> dict[str, Any]:
    config = {"kv_cache_max_entries": slots, "max_batch": slots, "max_queue": requests}
    services = {reuse: InferenceService(InferenceConfig.parse({**config, "prefix_cache": reuse}), DeviceContext())
                for reuse in (True, False)}
    ttft: dict[bool, list[float]] = {True: [], False: []}
    peak: dict[bool, int] = {True: 0, False: 0}
    try:
        for service in services.values():
            _first_chunks(service, "warm up " * 40, slots, 2)
        for r in range(rounds):
            order = [True, False] if r % 2 == 0 else [False, True]
            for reuse in order:  # a new system prompt each round: every round starts cold
                service = services[reuse]
                kv = service.engine.kv
                assert kv is not None, "the embedded model's KV cache is paged"
                kv.peak_used = kv.used_blocks
                ttft[reuse] += _first_chunks(service, f"[{r}] {SYSTEM_PROMPT}", requests, max_tokens)
                peak[reuse] = max(peak[reuse], kv.peak_used * kv.cache.block_bytes)
        system_tokens = len(services[True].backend.encode(SYSTEM_PROMPT)) + 6
        return {
            "requests": requests, "rounds": rounds, "kv_slots": slots, "max_tokens": max_tokens,
            "system_prompt_tokens": system_tokens,
            "kv_bytes_with_reuse": peak[True], "kv_bytes_without_reuse": peak[False],
            "kv_ratio": round(peak[True] / peak[False], 3),
            "ttft_p50_ms_with_reuse": round(statistics.median(ttft[True]), 1),
            "ttft_p50_ms_without_reuse": round(statistics.median(ttft[False]), 1),
        }
    finally:
        for service in services.values():
            service.close()


def measure_system_prompt_hf(requests: int = 100, max_tokens: int = 8, rounds: int = 2,
                             slots: int = 16) -> dict[str, Any]:
    """`measure_system_prompt` on a tiny llama served by the transformers backend (default,
    batched steps): KV bytes held (pool + stored prefixes at their peak), TTFT p50 and the
    positions the model forwarded, with and without reuse."""
    import tempfile
    from pathlib import Path

    from services.inference.model.interface import KV_CACHE_OWNER
    from spine.tools.model.make_tiny import TinySpec, make_tiny

    with tempfile.TemporaryDirectory(prefix="spine-bench-hf-") as root:
        path = make_tiny(Path(root) / "tiny-llama", TinySpec(arch="llama"))
        model = "tiny-llama"
        config = {"model_id": model, "kv_cache_max_entries": slots, "max_batch": slots, "max_queue": requests,
                  "backend": {"class": "hf", "options": {"path": str(path)}}}
        devices = {reuse: DeviceContext() for reuse in (True, False)}
        services = {reuse: InferenceService(InferenceConfig.parse({**config, "prefix_cache": reuse}),
                                            devices[reuse]) for reuse in (True, False)}
        forwarded = {True: [0], False: [0]}
        hooks = []
        for reuse, service in services.items():
            def count(_module: Any, _args: Any, kwargs: dict[str, Any], tally: list[int] = forwarded[reuse]) -> None:
                tally[0] += int(kwargs["input_ids"].numel())

            hooks.append(service.backend.model.module.register_forward_pre_hook(count, with_kwargs=True))  # type: ignore[attr-defined]
        ttft: dict[bool, list[float]] = {True: [], False: []}
        peak: dict[bool, int] = {True: 0, False: 0}
        try:
            for service in services.values():
                _first_chunks(service, "warm up " * 40, slots, 2, model)
            for tally in forwarded.values():
                tally[0] = 0
            for r in range(rounds):
                order = [True, False] if r % 2 == 0 else [False, True]
                for reuse in order:  # a new system prompt each round: every round starts cold
                    service = services[reuse]
                    store = service.engine.prefixes
                    if store is not None:
                        store.clear()  # the warm-up's prefix goes: the peak is this round's
                        store.peak_bytes = 0
                    ttft[reuse] += _first_chunks(service, f"[{r}] {SYSTEM_PROMPT}", requests, max_tokens, model)
                    pool = devices[reuse].usage().get(KV_CACHE_OWNER, 0) - (store.bytes if store is not None else 0)
                    peak[reuse] = max(peak[reuse], pool + (store.peak_bytes if store is not None else 0))
            reused = services[True]
            prefix, _ = reused.backend.encode_chat_parts("?", f"[0] {SYSTEM_PROMPT}")  # type: ignore[attr-defined]
            store = reused.engine.prefixes
            return {
                "model": "tiny llama (spine model make-tiny --arch llama), transformers backend, batched steps",
                "requests": requests, "rounds": rounds, "kv_slots": slots, "max_tokens": max_tokens,
                "system_prompt_tokens": 1 + len(prefix),  # BOS and the template's system part
                "kv_bytes_with_reuse": peak[True], "kv_bytes_without_reuse": peak[False],
                "kv_ratio": round(peak[True] / peak[False], 3),
                "ttft_p50_ms_with_reuse": round(statistics.median(ttft[True]), 1),
                "ttft_p50_ms_without_reuse": round(statistics.median(ttft[False]), 1),
                "forwarded_tokens_with_reuse": forwarded[True][0], "forwarded_tokens_without_reuse": forwarded[False][0],
                "prefix_hits": store.hits if store is not None else 0,
                "prefix_misses": store.misses if store is not None else 0,
                "kv_note": "a slot pool holds whole slots (max_context) whatever the prompt; reuse copies the stored "
                           "prefix into each slot, so it saves prefill, not KV memory (+ the stored copy)",
            }
        finally:
            for hook in hooks:
                hook.remove()
            for service in services.values():
                service.close()
