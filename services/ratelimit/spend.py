"""Spend per key, team and tenant, and the budgets it is held to, the same on every replica.

Each answer's cost comes from its real usage (`SpendConfig.prices`) and is charged to the
buckets of its key, team and tenant for the current day and month (`spend_store.Bucket`).
A charge counts here at once; a thread of its own sends this replica's charges to the
shared store every `refresh_s` and reads back everyone's totals for the buckets that have a
budget, in one round trip. A budget is decided on what this replica knows: the totals last
read plus its own charges since.

Why this shape, and the bound it gives. A replica never refuses on spend that did not
happen (what it knows is at most the true spend), so there is no false refusal below the
budget: a request is refused only when the known spend plus its prompt's cost would pass
it. The overshoot is what was spent but not yet known when the budget was reached: the
cost of the requests then in flight anywhere (admitted, not yet answered) plus what other
replicas answered in the at most `2 x refresh_s` their charges take to be seen here (one
send, one read). `tests/test_spend_replicas.py` measures it.

While the store cannot be reached, a replica keeps deciding on the last totals plus its own
charges (which it keeps and sends when the store answers again: no charge is lost); the
outage is logged once and counted (`spine_spend_store_*`).
"""

from __future__ import annotations

import calendar
import logging
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common import Clock
from services.common.thread_names import name_os_thread
from services.ratelimit.spend_config import Budget, SpendConfig
from services.ratelimit.spend_store import Bucket, SpendStore, Usage

log = logging.getLogger("spine.ratelimit")

WINDOWS = ("daily", "monthly")
WATCH_S = 30.0  # a budgeted bucket is read back while it was checked this recently


def period(window: str, now: float) -> tuple[str, float]:
    """The period `now` falls in (UTC) and the seconds until the next one starts."""
    t = time.gmtime(now)
    if window == "daily":
        start = calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0))
        return f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}", start + 86400 - now
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return f"{t.tm_year:04d}-{t.tm_mon:02d}", calendar.timegm((year, month, 1, 0, 0, 0)) - now


@dataclass(frozen=True, slots=True)
class Rule:
    """A budget that applies to a request."""

    scope: str  # "key" | "team" | "tenant"
    name: str
    budget_usd: float
    window: str


@dataclass(slots=True)
class BudgetVerdict:
    admitted: bool = True
    remaining_usd: float = -1.0  # the least remaining of the budgets that apply; -1: none applies
    refused: str = ""  # the budget it would pass, for the refusal's message
    resets_in_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Payer:
    """Who a request's spend is charged to, and the key's own budget (0: none)."""

    tenant: str
    team: str = ""
    key: str = ""
    key_budget_usd: float = 0.0
    key_window: str = "monthly"


class SpendLedger:
    """One rate limiter's view of spend; thread-safe."""

    def __init__(self, config: SpendConfig, store: SpendStore, clock: Clock = time.time) -> None:
        self.config = config
        self.store = store
        self._clock = clock
        self._lock = threading.Lock()
        self._totals: dict[Bucket, Usage] = {}  # everyone's, as last read
        self._pending: dict[Bucket, Usage] = {}  # charged here, not sent yet
        # The batch being sent, with its id: kept until the store answers, and sent again as it
        # is (the store adds a batch once, whatever its answers' fate).
        self._sending: dict[Bucket, Usage] = {}
        self._batch = ""
        self._watch: dict[Bucket, float] = {}  # budgeted buckets -> when last checked
        self.reachable = True
        self.calls = {"ok": 0, "error": 0}
        self.outages = 0
        self.refusals: dict[str, int] = {"key": 0, "team": 0, "tenant": 0}
        self.charged: dict[tuple[str, str], Usage] = {}  # (tenant, model) -> what this replica charged
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spend-ledger", daemon=True)

    def start(self) -> SpendLedger:
        self._thread.start()
        return self

    # -- the request path -----------------------------------------------------------------
    def rules(self, payer: Payer) -> list[Rule]:
        rules = []
        if payer.key and payer.key_budget_usd > 0:
            rules.append(Rule("key", payer.key, payer.key_budget_usd, payer.key_window or "monthly"))
        for scope, name, table in (("team", payer.team, self.config.teams), ("tenant", payer.tenant, self.config.tenants)):
            budget: Budget | None = table.get(name) if name else None
            if budget is not None:
                rules.append(Rule(scope, name, budget.budget_usd, budget.window))
        return rules

    def check(self, payer: Payer, estimate_usd: float = 0.0, count: bool = True) -> BudgetVerdict:
        """Whether a request of `payer` whose prompt costs `estimate_usd` stays within every
        budget that applies; the least remaining either way (`count`: a refusal is counted)."""
        rules = self.rules(payer)
        if not rules:
            return BudgetVerdict()
        now = self._clock()
        verdict = BudgetVerdict(remaining_usd=float("inf"))
        with self._lock:
            for rule in rules:
                name, resets_in = period(rule.window, now)
                bucket = Bucket(rule.window, name, rule.scope, rule.name)
                self._watch[bucket] = now
                remaining = rule.budget_usd - self._spent(bucket)
                if remaining < verdict.remaining_usd:
                    verdict.remaining_usd = remaining
                if verdict.admitted and (remaining <= 0 or estimate_usd > remaining):
                    verdict.admitted = False
                    verdict.resets_in_s = resets_in
                    verdict.refused = (f"the {rule.window} budget of {rule.scope} {rule.name} is ${rule.budget_usd:g} "
                                       f"and ${rule.budget_usd - remaining:.6g} is spent")
                    self.refusals[rule.scope] += count
        verdict.remaining_usd = max(0.0, verdict.remaining_usd)
        return verdict

    def charge(self, payer: Payer, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        """Charge an answer's usage at `model`'s price to its key, team and tenant; its cost."""
        price = self.config.price(model)
        usd = 0.0 if price is None else price.cost(prompt_tokens, cached_tokens, completion_tokens)
        usage = Usage(usd, prompt_tokens, min(cached_tokens, prompt_tokens), completion_tokens, 1)
        now = self._clock()
        scopes = [("tenant", payer.tenant)] + [(s, n) for s, n in (("team", payer.team), ("key", payer.key)) if n]
        with self._lock:
            for window in WINDOWS:
                name, _ = period(window, now)
                for scope, who in scopes:
                    self._pending.setdefault(Bucket(window, name, scope, who), Usage()).add(usage)
            self.charged.setdefault((payer.tenant, model), Usage()).add(usage)
        return usd

    def _spent(self, bucket: Bucket) -> float:
        """What is known spent in `bucket` (caller holds the lock)."""
        total = 0.0
        for table in (self._totals, self._sending, self._pending):
            usage = table.get(bucket)
            if usage is not None:
                total += usage.usd
        return total

    # -- sharing --------------------------------------------------------------------------
    def _run(self) -> None:
        name_os_thread()
        while not self._stop.is_set():
            self._wake.wait(self.config.refresh_s)
            self._wake.clear()
            self.exchange()

    def exchange(self) -> None:
        """Send this replica's charges; read the budgeted buckets back. Never raises."""
        now = self._clock()
        current = {window: period(window, now)[0] for window in WINDOWS}
        with self._lock:
            if not self._sending and self._pending:  # else the batch in doubt goes first, as it was
                self._sending, self._pending, self._batch = self._pending, {}, secrets.token_hex(12)
            charges, batch = dict(self._sending), self._batch
            for bucket, seen in list(self._watch.items()):
                if now - seen > WATCH_S or current[bucket.window] != bucket.period:
                    del self._watch[bucket]
            reads = list(self._watch)
        if not charges and not reads:
            return
        try:
            totals = self.store.exchange(charges, reads, batch)
        except Exception as error:  # redis.RedisError, sqlite3.Error, OSError: the batch is sent again
            self.calls["error"] += 1
            if self.reachable:
                self.outages += 1
                log.warning("spend store %s unreachable (%s: %s); deciding budgets on the last totals and this "
                            "replica's own charges, which are kept until it answers", self.store.where,
                            type(error).__name__, error)
            self.reachable = False
            return
        self.calls["ok"] += 1
        with self._lock:
            self._sending = {}
            if not self.reachable and self._pending:  # what was charged during the outage: sent now
                self._wake.set()
            for bucket in [b for b in self._totals if current[b.window] != b.period]:
                del self._totals[bucket]
            self._totals.update({b: u for b, u in totals.items() if current[b.window] == b.period})
        if not self.reachable:
            log.warning("spend store %s reachable again; charges kept meanwhile were sent", self.store.where)
        self.reachable = True

    def wake(self) -> None:
        self._wake.set()

    def close(self) -> None:
        """Stop; send what is left (a replica that cannot loses only its last charges)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.config.refresh_s + 2.0)
        self.exchange()
        self.store.close()

    # -- reading ----------------------------------------------------------------------------
    def known(self) -> list[tuple[Bucket, Usage]]:
        """Every bucket of the current periods this replica knows, with what it knows spent."""
        with self._lock:
            buckets = {*self._totals, *self._sending, *self._pending}
            return [(b, Usage().plus(self._totals.get(b)).plus(self._sending.get(b)).plus(self._pending.get(b)))
                    for b in sorted(buckets)]

    def collector(self) -> Collector:
        return _SpendCollector(self)


class _SpendCollector(Collector):
    def __init__(self, ledger: SpendLedger) -> None:
        self._ledger = ledger

    def collect(self) -> Iterator[Any]:
        ledger = self._ledger
        spend = GaugeMetricFamily("spine_spend_usd", "Spend in the current period (UTC day or month) as this "
                                  "replica knows it: the shared store's total plus its own charges since",
                                  labels=["scope", "name", "window"])
        tokens = GaugeMetricFamily("spine_spend_tokens", "Tokens in the current period as this replica knows it",
                                   labels=["scope", "name", "window", "kind"])
        for bucket, usage in ledger.known():
            spend.add_metric([bucket.scope, bucket.name, bucket.window], usage.usd)
            for kind, value in (("input", usage.input_tokens), ("cached_input", usage.cached_input_tokens),
                                ("output", usage.output_tokens)):
                tokens.add_metric([bucket.scope, bucket.name, bucket.window, kind], float(value))
        yield spend
        yield tokens
        charged = CounterMetricFamily("spine_spend_charged_usd", "What this replica charged, by tenant and model",
                                      labels=["tenant", "model"])
        with ledger._lock:
            rows = [(k, u.usd) for k, u in ledger.charged.items()]
        for (tenant, model), usd in rows:
            charged.add_metric([tenant, model], usd)
        yield charged
        refusals = CounterMetricFamily("spine_budget_refusals", "Requests refused for a budget, by its scope",
                                       labels=["scope"])
        for scope, count in ledger.refusals.items():
            refusals.add_metric([scope], float(count))
        yield refusals
        up = GaugeMetricFamily("spine_spend_store_up", "1 while the spend store answers, 0 while budgets are "
                               "decided on the last totals and this replica's own charges")
        up.add_metric([], 1.0 if ledger.reachable else 0.0)
        yield up
        calls = CounterMetricFamily("spine_spend_store_calls", "Round trips to the spend store", labels=["result"])
        for result, count in ledger.calls.items():
            calls.add_metric([result], float(count))
        yield calls
        yield CounterMetricFamily("spine_spend_store_outages", "Times the spend store became unreachable",
                                  value=float(ledger.outages))
