"""The shared lease store behind the rate limiter: Redis, and the two Lua scripts that grant.

Each replica calls `RedisLeaseStore.exchange` every renewal interval (one round trip: both
scripts pipelined), never per request. The store keeps, per bucket, the *global* token
bucket (the configured rate and burst, refilled on Redis's own clock) and, per tenant, who
holds how many concurrency slots until when. A grant is atomic (a script runs alone), so
replicas asking at once never get the same tokens or slots twice.

Why a script and not WATCH/MULTI: a grant reads, refills and writes several keys, and a
script does that in one round trip with no retries under contention.

Keys (all under `key_prefix`): `epoch` (a random id written when the store was found
empty: a replica that knew another one learns the store was restarted, and buckets made
within the replica ttl after that, while `epoch:fresh` lives, start empty, not full), `replicas` (replica id -> expiry, the live replicas the
fallback share divides by), `b:<bucket>` (level, last refill), `s:<tenant>` (replica id ->
"slots:expiry"). Every key expires once it would read the same as a missing one.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from services.ratelimit.config import RedisStore

# KEYS: epoch, replicas, then one per bucket. ARGV: known epoch, candidate epoch, replica id,
# replica ttl (s), then per bucket: rate (/s), burst, want, debt, give back.
# Returns: epoch, restarted (0/1), live replicas, then per bucket the tokens granted and the
# bucket's level after the grant (below 0: in debt, a settle charged more than it held; never
# below minus one burst, as a replica's own bucket is kept) (text: a Lua number returned as a
# number would be cut to an integer).
_TOKENS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local epoch = redis.call('GET', KEYS[1])
local restarted = 0
if not epoch then
  epoch = ARGV[2]
  redis.call('SET', KEYS[1], epoch)
  if ARGV[1] ~= '' then restarted = 1 end
elseif ARGV[1] ~= '' and ARGV[1] ~= epoch then
  restarted = 1
end
if restarted == 1 then
  redis.call('SET', KEYS[1] .. ':fresh', '1', 'PX', math.ceil(tonumber(ARGV[4]) * 1000))
end
local fresh = restarted == 1 or redis.call('EXISTS', KEYS[1] .. ':fresh') == 1
redis.call('HSET', KEYS[2], ARGV[3], tostring(now + tonumber(ARGV[4])))
local live = 0
local members = redis.call('HGETALL', KEYS[2])
for j = 1, #members, 2 do
  if tonumber(members[j + 1]) <= now then redis.call('HDEL', KEYS[2], members[j]) else live = live + 1 end
end
redis.call('EXPIRE', KEYS[2], math.ceil(tonumber(ARGV[4])) + 1)
local out = {epoch, restarted, live}
for i = 3, #KEYS do
  local a = 5 + (i - 3) * 5
  local rate, burst = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  local want, debt, back = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  local v = redis.call('HMGET', KEYS[i], 'level', 'last')
  local level, last = tonumber(v[1]), tonumber(v[2])
  if level == nil then
    if fresh then level = 0 else level = burst end
    last = now
  end
  level = math.min(burst, level + rate * math.max(0, now - last))
  level = math.max(-burst, math.min(burst, level + back) - debt)
  local grant = math.max(0, math.min(want, level))
  level = level - grant
  redis.call('HSET', KEYS[i], 'level', tostring(level), 'last', tostring(now))
  redis.call('PEXPIRE', KEYS[i], math.ceil((burst - level) / rate * 1000) + 1000)
  out[#out + 1] = tostring(grant)
  out[#out + 1] = tostring(level)
end
return out
"""

# KEYS: one per tenant. ARGV: replica id, ttl (s), then per tenant: limit, want, held here.
# Returns per tenant the slots granted (at most limit - what the other live replicas hold) and
# how many were free before the grant.
_SLOTS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local me, ttl = ARGV[1], tonumber(ARGV[2])
local out = {}
for i = 1, #KEYS do
  local a = 3 + (i - 1) * 3
  local limit, want, held = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local others = 0
  local entries = redis.call('HGETALL', KEYS[i])
  for j = 1, #entries, 2 do
    local count, expires = string.match(entries[j + 1], '^(%d+):(.+)$')
    if tonumber(expires) <= now then
      redis.call('HDEL', KEYS[i], entries[j])
    elseif entries[j] ~= me then
      others = others + tonumber(count)
    end
  end
  local grant = math.max(0, math.min(want, limit - others))
  local keep = math.max(grant, held)
  if keep > 0 then
    redis.call('HSET', KEYS[i], me, keep .. ':' .. tostring(now + ttl))
  else
    redis.call('HDEL', KEYS[i], me)
  end
  redis.call('PEXPIRE', KEYS[i], math.ceil(ttl * 1000) + 1000)
  out[#out + 1] = grant
  out[#out + 1] = math.max(0, limit - others)
end
return out
"""


@dataclass(frozen=True, slots=True)
class TokenAsk:
    """One bucket's exchange: tokens wanted, unbacked tokens spent (debt), tokens given back."""

    key: str
    rate: float
    burst: float
    want: float
    debt: float = 0.0
    give_back: float = 0.0


@dataclass(frozen=True, slots=True)
class SlotAsk:
    """One tenant's slots: its (whole) limit, how many this replica wants, how many it holds."""

    tenant: str
    limit: int
    want: int
    held: int


@dataclass(frozen=True, slots=True)
class StoreAnswer:
    epoch: str
    restarted: bool  # the store lost its keys since this replica's last exchange
    replicas: int  # live replicas, this one included
    tokens: list[float]
    slots: list[tuple[int, int]]  # per tenant asked: (granted, free before the grant)
    levels: list[float] = field(default_factory=list)  # per bucket asked: the store's level after the grant


class RedisLeaseStore:
    """One Redis connection pool and the grant scripts; every call may raise `redis.RedisError`
    (or OSError), which the caller counts as the store being unreachable."""

    def __init__(self, config: RedisStore, replica_ttl_s: float) -> None:
        import redis  # lazily: a limiter without a store never needs it
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        password = config.password_file.read_text().strip() if config.password_file else None
        common: dict[str, Any] = {"socket_timeout": config.timeout_s, "socket_connect_timeout": config.timeout_s,
                                  "password": password, "retry": Retry(NoBackoff(), 0)}  # the next renewal retries
        if config.address.startswith("unix:"):
            self._redis = redis.Redis(unix_socket_path=config.address[len("unix:"):], **common)
        else:
            host, _, port = config.address.rpartition(":")
            self._redis = redis.Redis(host=host.strip("[]") or "127.0.0.1", port=int(port), **common)
        self._prefix = config.key_prefix
        self._tokens = self._redis.register_script(_TOKENS)
        self._slots = self._redis.register_script(_SLOTS)
        self._replica_ttl_s = replica_ttl_s
        self.replica = secrets.token_hex(8)  # never reused: a restarted replica is a new holder
        self.calls = 0  # round trips made (for the bench and /metrics)

    def exchange(self, epoch: str, tokens: list[TokenAsk], slots: list[SlotAsk], slot_ttl_s: float) -> StoreAnswer:
        """Grant tokens and slots in one round trip."""
        p = self._prefix
        token_args: list[Any] = [epoch, secrets.token_hex(8), self.replica, self._replica_ttl_s]
        for ask in tokens:
            token_args += [ask.rate, ask.burst, ask.want, ask.debt, ask.give_back]
        pipe = self._redis.pipeline(transaction=False)
        self._tokens(keys=[f"{p}epoch", f"{p}replicas", *[f"{p}b:{ask.key}" for ask in tokens]],
                     args=[_num(a) for a in token_args], client=pipe)
        if slots:
            slot_args: list[Any] = [self.replica, slot_ttl_s]
            for s in slots:
                slot_args += [s.limit, s.want, s.held]
            self._slots(keys=[f"{p}s:{s.tenant}" for s in slots], args=[_num(a) for a in slot_args], client=pipe)
        self.calls += 1
        answers = pipe.execute()
        head = answers[0]
        values = [float(_text(v)) for v in head[3:]]
        return StoreAnswer(epoch=_text(head[0]), restarted=int(head[1]) == 1, replicas=int(head[2]),
                           tokens=values[0::2], slots=_pairs(answers[1]) if slots else [], levels=values[1::2])

    def leave(self, tenants: list[str]) -> None:
        """This replica is gone: its slots of `tenants` and its place among the live replicas."""
        pipe = self._redis.pipeline(transaction=False)
        for tenant in tenants:
            pipe.hdel(f"{self._prefix}s:{tenant}", self.replica)
        pipe.hdel(f"{self._prefix}replicas", self.replica)
        pipe.execute()
        self.calls += 1

    def close(self) -> None:
        self._redis.close()


def _num(value: Any) -> Any:
    """Floats as exact text (repr round-trips a float64; Lua's tonumber reads it back)."""
    return repr(float(value)) if isinstance(value, float) else value


def _pairs(values: list[Any]) -> list[tuple[int, int]]:
    return [(int(values[i]), int(values[i + 1])) for i in range(0, len(values), 2)]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
