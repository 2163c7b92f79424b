"""Synthetic workloads: bounded in count and time, reproducible from a seed.

Used by the demo, the benchmark and the A/B runner, so every number in this project
comes from the same kind of traffic.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from spine.client.gateway_client import CallResult, GatewayClient
from wire.v1 import generation_pb2

W = TypeVar("W")
WORDS = ("spine", "gateway", "token", "bucket", "cache", "route", "model", "latency", "batch", "tensor",
         "layer", "collapse", "canary", "stage", "rollback", "parity")


@dataclass(frozen=True)
class Item:
    """One request of a workload, with the credential it is sent with."""

    request: generation_pb2.GenerateRequest
    token: str | None
    stream: bool = False
    headers: tuple[tuple[str, str], ...] = ()


def mixed_workload(count: int, api_key: str, *, seed: int = 7, model: str = "tiny-lm",
                   max_tokens: tuple[int, int] = (4, 16), cacheable_share: float = 0.5,
                   invalid_share: float = 0.05, unauthenticated_share: float = 0.05,
                   stream_share: float = 0.0, repeat_share: float = 0.3) -> list[Item]:
    """A mix of greedy (cacheable), seeded and unseeded sampled, invalid and unauthenticated requests."""
    rng = random.Random(seed)
    items: list[Item] = []
    for index in range(count):
        if items and rng.random() < repeat_share:
            previous = items[rng.randrange(len(items))]
            items.append(previous)  # repeats make cache hits
            continue
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
        request = generation_pb2.GenerateRequest(model=model, prompt=prompt,
                                                 max_tokens=rng.randint(*max_tokens))
        if rng.random() >= cacheable_share:
            request.temperature = 0.8
            request.seed = index
        roll = rng.random()
        token: str | None = api_key
        if roll < invalid_share:
            request.max_tokens = 0
        elif roll < invalid_share + unauthenticated_share:
            token = "not-a-valid-key"
        items.append(Item(request, token, stream=rng.random() < stream_share))
    return items


def closed_loop(count: int, workers: Sequence[W], send: Callable[[W, int], None], time_limit_s: float) -> None:
    """Request indexes 0..count-1 handed out in order to one thread per worker, each sending
    its next one as soon as its last answer is back; no index starts after `time_limit_s`."""
    deadline = time.monotonic() + time_limit_s
    next_index = 0
    lock = threading.Lock()

    def loop(worker: W) -> None:
        nonlocal next_index
        while time.monotonic() < deadline:
            with lock:
                index = next_index
                next_index += 1
            if index >= count:
                return
            send(worker, index)

    threads = [threading.Thread(target=loop, args=(worker,), name=f"load-{i}") for i, worker in enumerate(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def run_workload(address: str, items: Sequence[Item], *, concurrency: int = 1, time_limit_s: float = 60.0,
                 on_result: Callable[[int, CallResult], None] | None = None,
                 credentials: grpc.ChannelCredentials | None = None) -> list[CallResult | None]:
    """Send `items` with `concurrency` workers (over TLS with `credentials`); stops by itself
    after `time_limit_s`.

    Results keep the workload's order; a request not sent before the time limit is None.
    """
    results: list[CallResult | None] = [None] * len(items)
    clients = [GatewayClient(address, credentials=credentials) for _ in range(concurrency)]

    def send(client: GatewayClient, index: int) -> None:
        item = items[index]
        headers = dict(item.headers)
        if item.stream:
            result = client.stream(item.request, token=item.token or "", headers=headers)
        else:
            result = client.generate(item.request, token=item.token or "", headers=headers)
        results[index] = result
        if on_result is not None:
            on_result(index, result)

    try:
        closed_loop(len(items), clients, send, time_limit_s)
    finally:
        for client in clients:
            client.close()
    return results
