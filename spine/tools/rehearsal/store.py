"""The shared lease store as the rehearsal sees it (`python -m spine.tools.rehearsal.run`).

Every rate limiter of the rehearsal leases from one Redis (`ratelimit.store`). A look at it
reads both ends: the store itself (the replicas it counts live, the buckets it holds) and each
limiter's store families on its /metrics (`spine_ratelimit_store_*`: leasing or falling back,
round trips, fallback transitions, the tokens and slots it holds leases on). The tokens
leased out and not yet spent are the bound's "leases outstanding": what the limiters may admit
beyond what the store still holds.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

SCRAPE_TIMEOUT_S = 5.0


@dataclass
class LimiterStore:
    """One rate limiter's view of the store, from its /metrics (`error`: it did not answer)."""

    name: str
    leasing: bool = False
    replicas: int = 0  # live replicas, as the store last counted them for it
    calls_ok: float = 0.0
    calls_error: float = 0.0
    calls_per_s: float | None = None  # since the previous look (None: the first)
    fallbacks: float = 0.0  # transitions to its fail mode
    recoveries: float = 0.0  # and back to leasing
    restarts: float = 0.0  # times it found the store empty again
    leased_requests: float = 0.0  # of the requests-per-second buckets
    leased_tokens: float = 0.0  # of the tokens-per-minute buckets
    leased_slots: float = 0.0
    error: str = ""

    def text(self) -> str:
        if self.error:
            return f"{self.name}: /metrics not read ({self.error})"
        rate = "" if self.calls_per_s is None else f", {self.calls_per_s:.1f} calls/s"
        return (f"{self.name}: {'leasing' if self.leasing else 'FALLING BACK'}, {self.calls_ok:.0f} store calls "
                f"({self.calls_error:.0f} failed){rate}, fallback transitions {self.fallbacks:.0f} "
                f"(recovered {self.recoveries:.0f}), leased {self.leased_requests:.1f} requests, "
                f"{self.leased_tokens:.0f} tokens, {self.leased_slots:.0f} slots")


@dataclass
class StoreLook:
    """The store and every limiter, at one moment of the rehearsal."""

    when: str
    address: str
    at: float  # time.monotonic()
    live_replicas: int | None = None  # the store's own count (None: not reached)
    buckets: int | None = None  # a full bucket's key expires: these are the ones below their burst
    limiters: list[LimiterStore] = field(default_factory=list)

    def leases_outstanding(self) -> tuple[float, float]:
        """Requests and tokens leased out and not spent, over every limiter."""
        return (sum(limiter.leased_requests for limiter in self.limiters),
                sum(limiter.leased_tokens for limiter in self.limiters))

    @property
    def fallbacks(self) -> float:
        return sum(limiter.fallbacks for limiter in self.limiters)

    def lines(self) -> list[str]:
        store = ("not reached" if self.live_replicas is None else
                 f"{self.live_replicas} live replicas, {self.buckets} buckets below their burst")
        requests, tokens = self.leases_outstanding()
        return [f"store {self.when}: redis {self.address}: {store}; leases outstanding {requests:.1f} requests, "
                f"{tokens:.0f} tokens; fallback transitions {self.fallbacks:.0f}",
                *(f"  {limiter.text()}" for limiter in self.limiters)]


def look(when: str, address: str, prefix: str, metrics: Mapping[str, str],
         previous: StoreLook | None = None) -> StoreLook:
    """Read the store at `address` (keys under `prefix`) and each limiter's /metrics (name ->
    HOST:PORT); calls a second are counted since `previous`."""
    seen = StoreLook(when, address, time.monotonic())
    seen.live_replicas, seen.buckets = _store_counts(address, prefix)
    before = {limiter.name: limiter for limiter in previous.limiters} if previous else {}
    for name, endpoint in metrics.items():
        limiter = _limiter(name, endpoint)
        earlier = before.get(name)
        if previous is not None and earlier is not None and not earlier.error and not limiter.error:
            calls = limiter.calls_ok + limiter.calls_error - earlier.calls_ok - earlier.calls_error
            limiter.calls_per_s = calls / max(seen.at - previous.at, 1e-3)
        seen.limiters.append(limiter)
    return seen


def _store_counts(address: str, prefix: str) -> tuple[int | None, int | None]:
    import redis

    host, _, port = address.rpartition(":")
    client = redis.Redis(host=host, port=int(port), socket_timeout=SCRAPE_TIMEOUT_S,
                         socket_connect_timeout=SCRAPE_TIMEOUT_S)
    try:
        now = float(client.time()[0])
        expiries = client.hgetall(f"{prefix}replicas").values()
        live = sum(float(expiry) > now for expiry in expiries)
        return live, sum(1 for _ in client.scan_iter(match=f"{prefix}b:*", count=1000))
    except (redis.RedisError, OSError):
        return None, None
    finally:
        client.close()


def _limiter(name: str, endpoint: str) -> LimiterStore:
    try:
        with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=SCRAPE_TIMEOUT_S) as answer:
            text = answer.read().decode()
    except OSError as error:
        return LimiterStore(name, error=str(error))
    values: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("spine_ratelimit_store_"):
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    label = sample.labels.get("result", sample.labels.get("resource", ""))
                    values[(family.name, label)] = sample.value
    if not values:
        return LimiterStore(name, error="no spine_ratelimit_store_* families: no store configured?")

    def value(family: str, label: str = "") -> float:
        return values.get((f"spine_ratelimit_store_{family}", label), 0.0)

    return LimiterStore(name, leasing=value("leasing") == 1.0, replicas=int(value("replicas")),
                        calls_ok=value("calls", "ok"), calls_error=value("calls", "error"),
                        fallbacks=value("fallbacks"), recoveries=value("recoveries"), restarts=value("restarts"),
                        leased_requests=value("leased_tokens", "requests"),
                        leased_tokens=value("leased_tokens", "tokens"), leased_slots=value("leased_slots"))
