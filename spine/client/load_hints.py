"""A client that honours overload: backoff with jitter, and an optional smaller-model fallback.

Overload signals are the statuses a busy server answers with — RESOURCE_EXHAUSTED (queue
full, rate limited) and UNAVAILABLE. On one, the helper waits and retries: exponential
backoff with full jitter (a uniform draw in [0, min(max_s, base_s × factor^retry)]), never
less than a `retry-after` trailer asks for, so that many clients do not retry in step.

The fallback policy routes to a configured smaller model alias after `after` consecutive
overload signals, and returns to the requested model once the load has fallen: after
`recover_after` consecutive calm answers, where calm means the answer's `x-spine-load`
hints show at most `calm_queue` requests waiting and a free KV slot (an answer without
hints counts as calm). Entering takes several refusals and leaving takes several calm
answers — hysteresis, so one lucky or unlucky answer does not flip the route back and forth.

A stream is retried only when it failed before its first chunk: tokens already shown
cannot be taken back.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from services.common import ConfigError
from spine.client.gateway_client import CallResult, GatewayClient
from spine.v1 import generation_pb2

log = logging.getLogger("spine.load_hints")

OVERLOAD_CODES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True)
class Backoff:
    """Up to `attempts` calls in all; waits grow by `factor` from `base_s`, at most `max_s`."""

    attempts: int = 4
    base_s: float = 0.05
    factor: float = 2.0
    max_s: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigError(f"backoff.attempts: must be >= 1, got {self.attempts}")
        if self.base_s < 0 or self.max_s < 0 or self.factor < 1:
            raise ConfigError(f"backoff: need base_s >= 0, max_s >= 0 and factor >= 1, got {self}")

    def delay(self, retry: int, rng: random.Random, retry_after_s: float = 0.0) -> float:
        """Seconds to wait before retry number `retry` (0-based): full jitter, at least retry-after."""
        ceiling = min(self.max_s, self.base_s * self.factor**retry)
        return max(retry_after_s, rng.uniform(0.0, ceiling))


@dataclass(frozen=True)
class Fallback:
    """Route to `model` after `after` overloads in a row; come back after `recover_after` calm answers."""

    model: str
    after: int = 3
    recover_after: int = 5
    calm_queue: int = 0

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("fallback.model: must name a model alias")
        if self.after < 1 or self.recover_after < 1 or self.calm_queue < 0:
            raise ConfigError(f"fallback: need after >= 1, recover_after >= 1, calm_queue >= 0, got {self}")

    def validate(self, known_models: Iterable[str]) -> None:
        """Refuse an alias the router does not know, at config load rather than under overload."""
        known = sorted(set(known_models))
        if self.model not in known:
            raise ConfigError(f"fallback.model: {self.model!r} is not a model or alias the router knows; "
                              f"known: {known}")


def router_models(config: Mapping[str, Any]) -> list[str]:
    """Every model id and alias in a config's `router.models`."""
    names: list[str] = []
    for entry in (config.get("router") or {}).get("models") or []:
        if isinstance(entry, Mapping):
            names.append(str(entry.get("id", "")))
            names.extend(str(alias) for alias in entry.get("aliases") or [])
    return [n for n in names if n]


class LoadAwareClient:
    """Wraps a `GatewayClient`: `generate` and `stream` retry on overload and may fall back."""

    def __init__(self, client: GatewayClient, backoff: Backoff | None = None, fallback: Fallback | None = None,
                 *, sleep: Callable[[float], None] = time.sleep, rng: random.Random | None = None) -> None:
        self.client = client
        self.backoff = backoff or Backoff()
        self.fallback = fallback
        self.sleep = sleep
        self.rng = rng or random.Random()
        self.using_fallback = False
        self.overload_streak = 0  # consecutive overload signals on the requested model
        self.calm_streak = 0  # consecutive calm answers while on the fallback

    def generate(self, request: generation_pb2.GenerateRequest, **kwargs: Any) -> CallResult:
        return self._call(self.client.generate, request, kwargs)

    def stream(self, request: generation_pb2.GenerateRequest, **kwargs: Any) -> CallResult:
        return self._call(self.client.stream, request, kwargs)

    def _call(self, method: Callable[..., CallResult], request: generation_pb2.GenerateRequest,
              kwargs: dict[str, Any]) -> CallResult:
        result: CallResult | None = None
        for attempt in range(self.backoff.attempts):
            routed = generation_pb2.GenerateRequest()
            routed.CopyFrom(request)
            on_fallback = self.using_fallback and self.fallback is not None
            if on_fallback:
                assert self.fallback is not None
                routed.model = self.fallback.model
            result = method(routed, **kwargs)
            result.attempts, result.model = attempt + 1, routed.model
            if on_fallback and result.code == grpc.StatusCode.NOT_FOUND:
                result.details = (f"fallback model {routed.model!r} does not exist on this server ({result.details}); "
                                  "fix the fallback alias")
                return result
            overloaded = result.code in OVERLOAD_CODES
            self._observe(overloaded, result)
            if not overloaded or result.chunks or attempt + 1 == self.backoff.attempts:
                return result
            retry_after = _float(result.trailing.get("retry-after"))
            self.sleep(self.backoff.delay(attempt, self.rng, retry_after))
        assert result is not None
        return result

    def _observe(self, overloaded: bool, result: CallResult) -> None:
        """Move the fallback state machine by one answer."""
        if self.fallback is None:
            return
        if not self.using_fallback:
            self.overload_streak = self.overload_streak + 1 if overloaded else 0
            if self.overload_streak >= self.fallback.after:
                self.using_fallback, self.calm_streak = True, 0
                log.warning("%d overload signals in a row: routing to fallback model %r",
                            self.overload_streak, self.fallback.model)
            return
        self.calm_streak = self.calm_streak + 1 if not overloaded and self._calm(result) else 0
        if self.calm_streak >= self.fallback.recover_after:
            self.using_fallback, self.overload_streak = False, 0
            log.info("load has fallen (%d calm answers): back to the requested model", self.calm_streak)

    def _calm(self, result: CallResult) -> bool:
        assert self.fallback is not None
        load = result.load
        if not load:
            return True
        return load.get("queue", 0.0) <= self.fallback.calm_queue and load.get("kv_free", 1.0) >= 1


def _float(text: str | None) -> float:
    try:
        return max(0.0, float(text)) if text else 0.0
    except ValueError:
        return 0.0
