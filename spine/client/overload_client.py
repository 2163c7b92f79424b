"""A client that honours overload: backoff with jitter, and a fallback to a cheaper model.

Overload signals are the statuses a busy server answers with — RESOURCE_EXHAUSTED (queue
full, rate limited, too many requests in flight) and UNAVAILABLE. On one, the helper waits
and retries: exponential backoff with full jitter (a uniform draw in [0, min(max_s, base_s
× factor^retry)]), never less than a `retry-after` trailer asks for, so that many clients
do not retry in step.

The fallback policy (the seed's `AutoFallbackPolicy`) sends requests to a cheaper model —
its own KV pool and scheduler, so it has room when the requested one has none — while the
requested one is overloaded, and comes back once it has calmed down:

- **fall back** after `timeouts` timeouts (DEADLINE_EXCEEDED) in a row while the model's
  load hint says the device is busier than `busy_above` (95%: the GPU's utilisation where
  the hint has one, else the decode loop's busy fraction), or after `after` overload
  refusals in a row;
- **come back** after `recover_after` answers in a row whose hint of the *requested*
  model is calm: busy below `calm_below` (80%), at most `calm_queue` waiting, a free KV
  slot. A fallback's answers carry that hint (`x-spine-primary-load`); an answer without
  it is not calm. After `blind_s` on the fallback without a word of the requested model's
  load, the helper tries it again (the entry rules send it back if it is still busy).

Entering takes several bad answers and leaving several calm ones, at thresholds apart —
hysteresis, so one lucky or unlucky answer does not flip the route back and forth. The
fallback is the configured model, or the one the server names for the requested model
(`x-spine-fallback`, from the router's `fallback:`).

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
from services.common.log_limit import RateLimitedLog
from services.inference.load_hints import FALLBACK_HEADER, PRIMARY_LOAD_HEADER, busy_figure, parse_load
from spine.client.gateway_client import CallResult, GatewayClient
from wire.v1 import generation_pb2

log = logging.getLogger("spine.load_hints")
# Said again on every overloaded answer while no fallback is known: one line a second.
_no_fallback = RateLimitedLog(log, "overloaded answers with no fallback known")

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
    """Where to go while the requested model is overloaded (None: where the server says), and when."""

    model: str | None = None
    after: int = 3  # overload refusals in a row
    timeouts: int = 3  # timeouts in a row ...
    busy_above: float = 0.95  # ... while the hint says the device is busier than this
    recover_after: int = 5  # calm hints of the requested model in a row
    calm_below: float = 0.8
    calm_queue: int = 0
    blind_s: float = 30.0

    def __post_init__(self) -> None:
        if self.model is not None and not self.model:
            raise ConfigError("fallback.model: must name a model alias (or be left out: the server's fallback)")
        if self.after < 1 or self.timeouts < 1 or self.recover_after < 1 or self.calm_queue < 0:
            raise ConfigError(f"fallback: need after >= 1, timeouts >= 1, recover_after >= 1, calm_queue >= 0, "
                              f"got {self}")
        if not 0.0 <= self.calm_below < self.busy_above <= 1.0:
            raise ConfigError(f"fallback: need 0 <= calm_below < busy_above <= 1 (hysteresis), got {self}")

    def validate(self, known_models: Iterable[str]) -> None:
        """Refuse an alias the router does not know, at config load rather than under overload."""
        known = sorted(set(known_models))
        if self.model is not None and self.model not in known:
            raise ConfigError(f"fallback.model: {self.model!r} is not a model or alias the router knows; "
                              f"known: {known}")

    def calm(self, load: Mapping[str, float] | None) -> bool:
        """A hint that says the model has room again (no hint: not calm)."""
        if not load:
            return False
        busy = busy_figure(dict(load))
        return ((busy is None or busy < self.calm_below) and load.get("queue", 0.0) <= self.calm_queue
                and load.get("kv_free", 1.0) >= 1)


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
                 *, sleep: Callable[[float], None] = time.sleep, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.backoff = backoff or Backoff()
        self.fallback = fallback
        self.sleep = sleep
        self.rng = rng or random.Random()
        self.clock = clock
        self.using_fallback = False
        self.why = ""  # why the helper is on the fallback (for `spine call`)
        self.overload_streak = 0  # consecutive overload signals on the requested model
        self.timeout_streak = 0  # consecutive timeouts on the requested model
        self.calm_streak = 0  # consecutive calm hints of the requested model while on the fallback
        self.server_fallback: str | None = None  # x-spine-fallback of the requested model's answers
        self.primary_id: str | None = None  # the id the requested name routes to (from its answers)
        self.primary_load: dict[str, float] = {}  # its latest hint
        self._primary_seen = 0.0

    @property
    def fallback_model(self) -> str | None:
        """The model requests go to while falling back: the configured one, else the server's."""
        if self.fallback is None:
            return None
        return self.fallback.model or self.server_fallback

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
            target = self.fallback_model if self.using_fallback else None
            if target is not None:
                routed.model = target
            result = method(routed, **kwargs)
            result.attempts, result.model = attempt + 1, routed.model
            if target is not None and result.code == grpc.StatusCode.NOT_FOUND:
                result.details = (f"fallback model {routed.model!r} does not exist on this server ({result.details}); "
                                  "fix the fallback alias")
                return result
            overloaded = result.code in OVERLOAD_CODES
            self._observe(result, on_fallback=target is not None)
            if not overloaded or result.chunks or attempt + 1 == self.backoff.attempts:
                return result
            retry_after = _float(result.trailing.get("retry-after"))
            self.sleep(self.backoff.delay(attempt, self.rng, retry_after))
        assert result is not None
        return result

    def _observe(self, result: CallResult, *, on_fallback: bool) -> None:
        """Move the fallback state machine by one answer."""
        if self.fallback is None:
            return
        if on_fallback:
            self._on_fallback(result)
        else:
            self._on_requested(result)

    def _on_requested(self, result: CallResult) -> None:
        assert self.fallback is not None
        self.server_fallback = result.trailing.get(FALLBACK_HEADER) or self.server_fallback
        answered = result.response.model if result.response is not None else \
            next((chunk.model for chunk in result.chunks if chunk.model), "")
        self.primary_id = answered or self.primary_id
        if result.load:  # a timeout the client itself called has no trailers: the last hint stands
            self._primary(result.load)
        overloaded = result.code in OVERLOAD_CODES
        self.overload_streak = self.overload_streak + 1 if overloaded else 0
        self.timeout_streak = self.timeout_streak + 1 if result.code == grpc.StatusCode.DEADLINE_EXCEEDED else 0
        busy = busy_figure(self.primary_load)
        if self.overload_streak >= self.fallback.after:
            why = f"{self.overload_streak} overload answers in a row"
        elif self.timeout_streak >= self.fallback.timeouts and busy is not None and busy > self.fallback.busy_above:
            why = f"{self.timeout_streak} timeouts in a row, the model {busy:.0%} busy"
        else:
            return
        if self.fallback_model is None:
            _no_fallback(None, "%s, but no fallback is known (none configured, and the server names none)", why)
            return
        self.using_fallback, self.calm_streak, self.why = True, 0, why
        self._primary_seen = self.clock()
        log.warning("%s: routing to fallback model %r", why, self.fallback_model)

    def _on_fallback(self, result: CallResult) -> None:
        assert self.fallback is not None
        load = self._primary_hint(result.trailing.get(PRIMARY_LOAD_HEADER))
        if load:
            self._primary(load)
        self.calm_streak = self.calm_streak + 1 if self.fallback.calm(load) else 0
        if self.calm_streak >= self.fallback.recover_after:
            self._back(f"{self.calm_streak} calm answers in a row")
        elif self.clock() - self._primary_seen > self.fallback.blind_s:
            self._back(f"no word of the requested model's load for {self.fallback.blind_s:g}s: trying it again")

    def _back(self, why: str) -> None:
        self.using_fallback, self.overload_streak, self.timeout_streak, self.why = False, 0, 0, ""
        log.info("%s: back to the requested model", why)

    def _primary(self, load: dict[str, float]) -> None:
        self.primary_load = load
        self._primary_seen = self.clock()

    def _primary_hint(self, text: str | None) -> dict[str, float] | None:
        """The requested model's hint among a fallback answer's `x-spine-primary-load` entries."""
        entries = primary_loads(text)
        if self.primary_id in entries:
            return entries[self.primary_id]
        return next(iter(entries.values())) if len(entries) == 1 else None


def primary_loads(text: str | None) -> dict[str, dict[str, float]]:
    """`x-spine-primary-load` (`model:hint[,model:hint...]`) by model id."""
    loads: dict[str, dict[str, float]] = {}
    for entry in (text or "").split(","):
        model, sep, hint = entry.partition(":")
        if sep and model.strip():
            loads[model.strip()] = parse_load(hint)
    return loads


def _float(text: str | None) -> float:
    try:
        return max(0.0, float(text)) if text else 0.0
    except ValueError:
        return 0.0
