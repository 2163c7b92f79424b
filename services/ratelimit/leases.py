"""Limits that hold across replicas: the rate limiter's buckets lease tokens from a shared store.

Every replica keeps deciding each request in-process, on its own device buckets, exactly as
without a store (`TokenBucketTable.decide`: the hot path does not know). What changes is
where a bucket's tokens come from: in lease mode (`TokenBucketTable.lease`) a bucket does
not refill by itself; a thread of its own renews it every `renew_interval_s` from the store
(`services.ratelimit.lease_store`), which holds the one *global* bucket per limit (the configured
rate and burst). Each renewal asks, per bucket, for `lease_s` of the replica's recent
consumption (all the store holds while the bucket ran dry, or when it is new or busy again
after an idle spell: its demand is not known), gives back the tokens of a bucket unused for
`lease_s`, and pays for the reserve it spent (below). One round trip per renewal, whatever
the traffic: a few calls a second per replica, none per request (the first request on a
bucket idle at the last renewal, and a settle that takes one below zero, bring the next
renewal forward: once per transition, not per request).

The accounting of each bucket's tokens between renewals is `services.ratelimit.lease_accounting`.

The bound. Tokens leave the global bucket only as grants, so over any window of T seconds
the replicas together admit at most burst + rate x T (the limit) plus what they admitted
unbacked: each bucket's `reserve` (a fraction of its burst a replica may spend before its
next renewal, so a lone request is not refused for want of a lease), charged to the store
at that renewal; plus the leases outstanding when the window opens (granted before it,
unspent: none once every replica has been idle for `lease_s`). Over-admission at any moment
is at most replicas x reserve x burst, and is paid back (the global bucket goes below zero)
within the next renewal. Under it: tokens refilled during a renewal interval are granted at
its end and spent in the next, so a tenant that asks for more than its limit gets at least
the limit less one renewal's refill (rate x renew_interval_s). A tenant whose traffic all
lands on one replica gets the whole refill of its limit from the next renewal on; the
tokens other replicas hold come back within `lease_s` of their last use.

Tokens settled after the fact. A request's tokens bucket is charged its prompt at admission
and settled at its end with what it generated (`RateLimitService._settle`), which may take a
bucket below zero. What a settle takes below zero is charged to the store's bucket as debt
at once (the settle wakes the renewal), so the store's bucket goes below zero (never below
minus one burst, as a replica's own bucket); every replica learns that from its next
renewal's answer (the level after the grant), pays the debt from the granted tokens it
holds (given back at its next renewal) and drops its reserve (`_pay`). A debt larger than
what a replica holds (a long answer) empties it: the tenant is refused on every replica from
then until the debt is refilled. A debt of a few spent reserves costs a replica those few
tokens, not its lease. A replica that had never seen the tenant may still admit its reserve
before its first renewal.

Faults (`fail_mode`):
- the store unreachable or slower than `redis.timeout_s` -> `shares`: the buckets refill at
  the last shares again (the controller's share, at most 1/live replicas last seen);
  `closed`: only what is leased; `open`: the whole limit per replica. Logged once per
  transition and counted (`spine_ratelimit_store_*` on /metrics); the renewals go on, and the
  first that answers puts the buckets back on leases, what they hold then charged as spent
  reserve (so a fallback's tokens are paid for too);
- the store restarted empty -> the first renewal after it sees a new epoch, and buckets made
  within `slot_ttl_s` of that start empty, not full, so the over-admission is the leases
  outstanding (<= one lease) plus what a fallback meanwhile admitted (charged as it is spent);
- a replica SIGKILLed -> its tokens are spent or lost (the global bucket refills anyway), its
  concurrency slots expire `slot_ttl_s` after its last renewal;
- one replica cut off -> it falls back to its share: at most share x (burst + rate x time
  cut off) over the limit.

Concurrency slots: per tenant the store holds which replica holds how many, until when. A
replica asks for the slots it holds plus its refusals since the last renewal (at most the
limit less what the other live replicas hold); a tenant it holds none for may take one
slot until its next renewal where the store had room for one at the last, or where it has not
asked for that tenant yet (the configured tenants are asked for from the start; one known
only through `default` at its first request): at most one slot per replica over the limit,
for one renewal.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from services.common.collectors import by_label, counter, gauge, read_at_scrape
from services.common.thread_names import name_os_thread
from services.ratelimit.concurrency import ConcurrencyLeases
from services.ratelimit.config import RateLimitStore
from services.ratelimit.lease_accounting import Held, account, pay, resource_of, store_key, take_out
from services.ratelimit.lease_store import RedisLeaseStore, SlotAsk, StoreAnswer, TokenAsk
from services.ratelimit.token_buckets import TokenBucketTable

log = logging.getLogger("spine.ratelimit")

LimitsOf = Callable[[Hashable], tuple[float, float]]  # a bucket's configured (rate, burst)
ConcurrencyOf = Callable[[str], int | None]  # a tenant's configured max_concurrent_requests


class StoreLeases:
    """The lease thread of one rate limiter; its table and slots are only touched under `lock`."""

    def __init__(self, config: RateLimitStore, table: TokenBucketTable, slots: ConcurrencyLeases,
                 lock: threading.Lock, limits_of: LimitsOf, concurrency_of: ConcurrencyOf,
                 tenants: tuple[str, ...] = (), clock: Callable[[], float] = time.monotonic,
                 store: RedisLeaseStore | None = None) -> None:
        self.config = config
        self.store = store or RedisLeaseStore(config.redis, replica_ttl_s=config.slot_ttl_s)
        self._table, self._slots, self._lock = table, slots, lock
        self._limits_of, self._concurrency_of, self._clock = limits_of, concurrency_of, clock
        self._tenants = tenants  # renewed from the start: what the others hold is known before a request
        self.leasing = True  # False while the store cannot be reached (the fail mode applies)
        self.controller_share = table.share
        self.replicas = 1  # live replicas the store last counted
        self._epoch = ""
        self._held: dict[Hashable, Held] = {}
        # Buckets idle at the last renewal (holding their reserve at most): the first request on
        # one wakes the renewal (`first_use`), so a tenant's traffic that starts on a replica
        # is leased the store's tokens at once rather than at the next interval, while the
        # store's bucket sits full and its refill is lost. Read by the service under the lock.
        self.idle: set[Hashable] = set()
        self._keys: dict[str, Hashable] = {}  # a bucket's key in the store -> in the table
        self._last_renewal = clock()
        self.calls = {"ok": 0, "error": 0}
        self.fallbacks = 0  # transitions to the fail mode
        self.recoveries = 0  # and back to leasing
        self.restarts = 0
        table.lease(config.reserve)
        slots.lease_from_store()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ratelimit-lease", daemon=True)

    def start(self) -> StoreLeases:
        self._thread.start()
        return self

    # -- the controller's share ---------------------------------------------------------------
    def set_share(self, fraction: float) -> None:
        """The controller's share: what the fallback decides on (caller holds the lock)."""
        self.controller_share = fraction
        self._table.set_share(self._fallback_share())
        if not self.leasing and self.config.fail_mode == "shares":
            self._slots.set_share(self._fallback_share())

    def _fallback_share(self) -> float:
        if self.config.fail_mode == "open":
            return 1.0
        return min(self.controller_share, 1.0 / max(self.replicas, 1))

    # -- the renewal loop ---------------------------------------------------------------------
    def _run(self) -> None:
        name_os_thread()
        while not self._stop.is_set():
            self._wake.wait(self.config.renew_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.renew()
            except Exception:  # never let the thread die: the limiter would stop refilling
                log.exception("ratelimit store: renewal failed")

    def wake(self) -> None:
        """Renew now, not at the next interval: a bucket was just made (its first lease should
        not wait, nor the global bucket sit full, its refill lost, until then)."""
        self._wake.set()

    def first_use(self, keys: tuple[Hashable, ...] | list[Hashable]) -> None:
        """A request was just decided on `keys` (caller holds the lock): renew now if one of
        them was idle at the last renewal. Once per bucket going from idle to busy, never
        per request: a bucket in use is renewed at the interval."""
        if not self.idle.isdisjoint(keys):
            self.idle.difference_update(keys)
            self._wake.set()

    def renew(self) -> None:
        """One exchange with the store: leases renewed, tokens given back, reserve paid for."""
        with self._lock:
            now = self._clock()
            # While falling back, an exchange that takes nothing: to learn that the store is back.
            tokens = self._token_asks(now) if self.leasing else []
            slots = self._slot_asks(now)
        try:
            answer = self.store.exchange(self._epoch, tokens, slots, self.config.slot_ttl_s)
        except Exception as error:  # redis.RedisError, OSError: the store cannot be had
            self._failed(error)
            return
        self.calls["ok"] += 1
        with self._lock:
            self._answered(answer, tokens, slots)

    def _token_asks(self, now: float) -> list[TokenAsk]:
        dt = max(now - self._last_renewal, 1e-3)
        self._last_renewal = now
        asks = []
        for key, state in self._table.snapshot().items():
            rate, burst = self._limits_of(key)
            reserve = self.config.reserve * burst
            held = self._held.get(key)
            fresh = held is None
            if held is None:  # made since the last renewal, with the reserve (`TokenBucketTable.lease`)
                held = self._held[key] = Held(unbacked=reserve, last_used=now)
            account(self._table, key, held, state.level)
            used, held.spent = held.spent, 0.0
            held.demand += 0.5 * (used / dt - held.demand)
            if used > 0:
                # Used again after an idle spell: its demand is not known, as a new bucket's.
                fresh = fresh or now - held.last_used >= self.config.lease_s
                held.last_used = now
            debt, held.debt = held.debt, 0.0
            give_back, held.owed_back = held.owed_back, 0.0
            want = 0.0
            if now - held.last_used >= self.config.lease_s:  # idle: its leased tokens go back
                self.idle.add(key)
                give_back += take_out(self._table, key, held.backed)
                held.backed = 0.0
                top_up = 0.0 if held.in_debt else max(0.0, reserve - held.unbacked)
                held.unbacked += top_up - self._table.credit(key, top_up)
            else:
                self.idle.discard(key)
                target = max(held.demand * self.config.lease_s, reserve)
                if fresh or held.level < target / 4:  # new, busy again, or ran (nearly) dry: its demand is
                    target = burst  # not known or more than it was given, so it asks for all the store holds
                want = max(0.0, min(target, burst) - held.level)
            # An idle bucket with nothing to settle is not sent, unless it holds a reserve (or the
            # store's bucket was in debt): the answer says whether it may go on holding one.
            if want or debt or give_back or held.unbacked > 0 or held.in_debt:
                self._keys[store_key(key)] = key
                asks.append(TokenAsk(store_key(key), rate, burst, want, debt, give_back))
        return asks

    def _slot_asks(self, now: float) -> list[SlotAsk]:
        granted = self._slots.granted if self._slots.granted is not None else {}
        tenants = {*self._tenants, *self._slots.in_flight(), *self._slots.refused, *granted}
        asks = []
        for tenant in sorted(tenants):
            configured = self._concurrency_of(tenant)
            if configured is None:
                continue
            held = self._slots.held(tenant, now)
            refused = self._slots.refused.pop(tenant, 0)
            limit = self._slots.limit(configured)  # the whole limit (share 1 while leasing), halved when busy
            asks.append(SlotAsk(tenant, limit, min(limit, held + refused), held))
        self._slots.refused.clear()
        return asks

    def _answered(self, answer: StoreAnswer, tokens: list[TokenAsk], slots: list[SlotAsk]) -> None:
        if answer.restarted:
            self.restarts += 1
            log.warning("ratelimit store: found empty (restarted?); buckets made now start empty")
        self._epoch, self.replicas = answer.epoch, answer.replicas
        if not self.leasing:
            self._recover()
            return
        levels = self._table.snapshot() if tokens else {}
        for ask, grant, level in zip(tokens, answer.tokens, answer.levels or [0.0] * len(tokens), strict=True):
            key = self._keys[ask.key]
            held = self._held[key]
            # What was admitted while the store was asked is counted first: a drain or a grant
            # then starts from what the bucket really holds.
            account(self._table, key, held, levels[key].level)
            held.in_debt = level < 0
            if held.in_debt:  # the tenant used more than its limit: what is held here pays for it
                pay(self._table, key, held, -level)
                continue
            if grant <= 0:
                continue
            unfit = self._table.credit(key, grant)
            held.owed_back += unfit
            held.backed += grant - unfit
        if self._slots.granted is not None:
            for slot_ask, (granted, free) in zip(slots, answer.slots, strict=True):
                # holding none, wanting none, with room: one slot until the next renewal (None)
                self._slots.grant(slot_ask.tenant, granted if slot_ask.want > 0 or free == 0 else None)

    # -- faults -------------------------------------------------------------------------------
    def _failed(self, error: BaseException) -> None:
        self.calls["error"] += 1
        if not self.leasing:
            return
        with self._lock:
            self.leasing = False
            self.fallbacks += 1
            mode = self.config.fail_mode
            if mode != "closed":
                share = self._fallback_share()
                self._table.set_share(share)
                self._table.lease(None)
                self._slots.decide_alone(share)
        log.warning("ratelimit store: unreachable (%s: %s); deciding on fail_mode %s until it answers",
                    type(error).__name__, error, mode)

    def _recover(self) -> None:
        """The store answers again: back on leases. What the buckets hold now was not granted
        (a fallback refilled it): it is charged to the store as it is spent, like the reserve."""
        self.leasing = True
        self.recoveries += 1
        self._table.lease(self.config.reserve)
        self._slots.lease_from_store()
        now = self._clock()
        self._held = {key: Held(unbacked=max(0.0, state.level), last_used=now)
                      for key, state in self._table.snapshot().items()}
        self._last_renewal = now
        log.warning("ratelimit store: reachable again; buckets back on leases")

    # -- shutdown -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop renewing; give every leased token and slot back (a replica that cannot, because
        it was killed, loses its tokens and has its slots expire)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.config.renew_interval_s + 2 * self.config.redis.timeout_s + 1)
        try:
            if self.leasing:
                with self._lock:
                    levels = self._table.snapshot()
                    asks = []
                    for key, held in self._held.items():
                        account(self._table, key, held, levels[key].level)  # the last requests' reserve is owed too
                        back = take_out(self._table, key, held.backed) + held.owed_back
                        if back > 0 or held.debt > 0:
                            asks.append(TokenAsk(store_key(key), *self._limits_of(key), want=0.0, debt=held.debt,
                                                 give_back=back))
                    self._held.clear()
                if asks:
                    self.store.exchange(self._epoch, asks, [], self.config.slot_ttl_s)
            self.store.leave(sorted({*self._slots.in_flight(), *(self._slots.granted or {})}))
        except Exception as error:
            log.info("ratelimit store: leases not given back on shutdown (%s); they lapse", error)
        self.store.close()

    def outstanding(self) -> tuple[dict[str, float], int]:
        """What this replica holds of the store now: per resource (`requests`, `tokens`), the
        tokens granted and not spent yet (its part of the bound's leases outstanding: what it
        may admit beyond what the store still holds), and the concurrency slots the store
        granted it, over every tenant."""
        with self._lock:
            levels = self._table.snapshot()
            tokens: dict[str, float] = {}
            for key, held in self._held.items():
                state = levels.get(key)
                spent = 0.0 if state is None else max(0.0, held.level - state.level)
                resource = resource_of(key)  # spent from the grant first, as a renewal counts it
                tokens[resource] = tokens.get(resource, 0.0) + max(0.0, held.backed - spent)
            slots = sum((self._slots.granted or {}).values())
        return tokens, slots

    def health(self) -> tuple[bool, str]:
        """The gateway's view of this limiter: serving either way (a fallback still decides,
        within its share), and the reason says which."""
        if self.leasing:
            return True, f"local: leasing from the shared store ({self.replicas} replicas)"
        return True, f"local: shared store unreachable, deciding on fail_mode {self.config.fail_mode}"

    def collector(self) -> Collector:
        return read_at_scrape(self._families)

    def _families(self) -> Iterator[Metric]:
        tokens, slots = self.outstanding()
        yield gauge("spine_ratelimit_store_leasing", "1 while the rate limiter leases from its shared store, 0 while "
                    "it falls back", 1.0 if self.leasing else 0.0)
        yield by_label(CounterMetricFamily, "spine_ratelimit_store_calls", "Round trips to the shared store",
                       "result", self.calls)
        yield counter("spine_ratelimit_store_fallbacks", "Times the store became unreachable", self.fallbacks)
        yield counter("spine_ratelimit_store_recoveries", "Times the store answered again after a fallback",
                      self.recoveries)
        yield counter("spine_ratelimit_store_restarts", "Times the store was found empty again", self.restarts)
        yield gauge("spine_ratelimit_store_replicas", "Live replicas the store last counted", self.replicas)
        yield by_label(GaugeMetricFamily, "spine_ratelimit_store_leased_tokens", "Tokens the store granted this "
                       "replica that it has not spent yet, by the resource of their buckets (requests, tokens)",
                       "resource", {resource: tokens.get(resource, 0.0) for resource in ("requests", "tokens")})
        yield gauge("spine_ratelimit_store_leased_slots", "Concurrency slots the store granted this replica, over "
                    "every tenant", slots)
