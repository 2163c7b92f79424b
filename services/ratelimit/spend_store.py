"""Where spend accumulates: Redis (the replicas' shared store) or a sqlite file (one process).

Spend is kept per *bucket*: a window (`daily`, `monthly`), its period (`2025-06-01`,
`2025-06`, UTC), a scope (`key`, `team`, `tenant`) and a name. A new period is a new bucket,
so a window resets by itself, and old buckets expire (Redis) or are dropped (sqlite) once
past. Each bucket holds dollars and token counts, added to atomically (HINCRBYFLOAT /
HINCRBY; one UPDATE), so replicas charging at once never lose a charge.

`exchange` is one round trip: this replica's charges added, then the totals of the buckets
it watches read back, after its own charges (Redis runs a connection's commands in order).
A batch of charges is added once whatever happens: it carries an id the store remembers for an
hour, so a batch sent again after a timeout (the store may have added it before the answer was
lost) is not added twice.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from services.common.redis_link import RedisLink, connect
from services.common.sqlite_file import SqliteFile

if TYPE_CHECKING:
    from services.ratelimit.config import RateLimitConfig

SQLITE_FILE = "spend.sqlite"

# How long a bucket outlives its period's start: a day's for two days more, a month's for 62 days.
KEEP_S = {"daily": 3 * 86400, "monthly": 93 * 86400}


@dataclass(slots=True)
class Usage:
    """What a bucket holds."""

    usd: float = 0.0
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    requests: int = 0

    def add(self, other: Usage) -> None:
        self.usd += other.usd
        self.input_tokens += other.input_tokens
        self.cached_input_tokens += other.cached_input_tokens
        self.output_tokens += other.output_tokens
        self.requests += other.requests

    def plus(self, other: Usage | None) -> Usage:
        out = Usage(self.usd, self.input_tokens, self.cached_input_tokens, self.output_tokens, self.requests)
        if other is not None:
            out.add(other)
        return out


_FIELDS = tuple(f.name for f in fields(Usage))


@dataclass(frozen=True, slots=True, order=True)
class Bucket:
    window: str
    period: str
    scope: str
    name: str

    def text(self) -> str:
        return f"{self.window}:{self.period}:{self.scope}:{self.name}"

    @classmethod
    def parse(cls, text: str) -> Bucket:
        window, period, scope, name = text.split(":", 3)
        return cls(window, period, scope, name)


class SpendStore(Protocol):
    where: str

    def exchange(self, charges: Mapping[Bucket, Usage], reads: Iterable[Bucket], batch: str = "") -> dict[Bucket, Usage]:
        """Add `charges` (once per `batch` id), then read `reads` (and the charged buckets): their totals now."""
        ...

    def buckets(self, window: str, period: str) -> list[Bucket]:
        """Every bucket of a period that was charged."""
        ...

    def close(self) -> None: ...


def _usage(raw: Mapping[Any, Any]) -> Usage:
    values = {(k.decode() if isinstance(k, bytes) else k): v for k, v in raw.items()}
    return Usage(float(values.get("usd", 0.0)), *(int(float(values.get(name, 0))) for name in _FIELDS[1:]))


# KEYS: the batch's id, then per bucket its hash and its period's index. ARGV: how long ids are
# remembered (s), then per bucket: usd, input, cached input, output, requests, keep (s), its name.
_ADD = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', tonumber(ARGV[1])) then return 0 end
for i = 2, #KEYS, 2 do
  local a = 2 + (i - 2) / 2 * 7
  local h = KEYS[i]
  redis.call('HINCRBYFLOAT', h, 'usd', ARGV[a])
  redis.call('HINCRBY', h, 'input_tokens', ARGV[a + 1])
  redis.call('HINCRBY', h, 'cached_input_tokens', ARGV[a + 2])
  redis.call('HINCRBY', h, 'output_tokens', ARGV[a + 3])
  redis.call('HINCRBY', h, 'requests', ARGV[a + 4])
  redis.call('EXPIRE', h, ARGV[a + 5])
  redis.call('SADD', KEYS[i + 1], ARGV[a + 6])
  redis.call('EXPIRE', KEYS[i + 1], ARGV[a + 5])
end
return 1
"""
BATCH_MEMORY_S = 3600


class RedisSpendStore:
    """A hash per bucket (`<prefix>spend:<bucket>`) and a set of a period's buckets."""

    def __init__(self, link: RedisLink) -> None:
        self._redis = connect(link)
        self._prefix = f"{link.key_prefix}spend:"
        self._add = self._redis.register_script(_ADD)
        self.where = f"redis {link.address}"

    def _key(self, bucket: Bucket) -> str:
        return self._prefix + bucket.text()

    def _index(self, window: str, period: str) -> str:
        return f"{self._prefix}index:{window}:{period}"

    def exchange(self, charges: Mapping[Bucket, Usage], reads: Iterable[Bucket], batch: str = "") -> dict[Bucket, Usage]:
        pipe = self._redis.pipeline(transaction=False)
        if charges:
            keys = [f"{self._prefix}batch:{batch or secrets.token_hex(12)}"]
            args: list[int | str] = [BATCH_MEMORY_S]
            for bucket, u in charges.items():
                keys += [self._key(bucket), self._index(bucket.window, bucket.period)]
                args += [repr(u.usd), u.input_tokens, u.cached_input_tokens, u.output_tokens, u.requests,
                         KEEP_S[bucket.window], bucket.text()]
            self._add(keys=keys, args=args, client=pipe)
        wanted = sorted({*charges, *reads})
        for bucket in wanted:
            pipe.hgetall(self._key(bucket))
        answers = pipe.execute()
        return {bucket: _usage(raw) for bucket, raw in zip(wanted, answers[len(answers) - len(wanted):], strict=True)}

    def buckets(self, window: str, period: str) -> list[Bucket]:
        return sorted(Bucket.parse(raw.decode()) for raw in self._redis.smembers(self._index(window, period)))

    def close(self) -> None:
        self._redis.close()


class SqliteSpendStore:
    """A row per bucket in a sqlite file. A file removed or replaced while the process runs
    (`services.common.sqlite_file`) fails each exchange: the ledger keeps the charges and
    reports the store down (`spine_spend_store_up` 0) rather than adding them to a deleted file."""

    def __init__(self, path: Path, timeout_s: float = 2.0) -> None:
        self._file = SqliteFile(path, "spend store", timeout_s)
        self._db = self._file.db
        self._lock = threading.Lock()
        self.where = f"sqlite {path}"
        with self._lock:
            self._db.execute("CREATE TABLE IF NOT EXISTS spend (bucket TEXT PRIMARY KEY, window TEXT, period TEXT, "
                             "usd REAL, input_tokens INTEGER, cached_input_tokens INTEGER, output_tokens INTEGER, "
                             "requests INTEGER, expires REAL)")
            self._db.execute("DELETE FROM spend WHERE expires < ?", (time.time(),))

    def exchange(self, charges: Mapping[Bucket, Usage], reads: Iterable[Bucket], batch: str = "") -> dict[Bucket, Usage]:
        # One transaction: a batch is in or not (no answer lost after the commit), so no id is kept.
        wanted = sorted({*charges, *reads})
        now = time.time()
        with self._lock:
            self._file.check()  # charges into a deleted file would be lost: kept and sent again instead
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for bucket, u in charges.items():
                    self._db.execute(
                        "INSERT INTO spend VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(bucket) DO UPDATE SET "
                        "usd = usd + excluded.usd, input_tokens = input_tokens + excluded.input_tokens, "
                        "cached_input_tokens = cached_input_tokens + excluded.cached_input_tokens, "
                        "output_tokens = output_tokens + excluded.output_tokens, "
                        "requests = requests + excluded.requests",
                        (bucket.text(), bucket.window, bucket.period, u.usd, u.input_tokens, u.cached_input_tokens,
                         u.output_tokens, u.requests, now + KEEP_S[bucket.window]))
                out = {}
                for bucket in wanted:
                    row = self._db.execute(f"SELECT {', '.join(_FIELDS)} FROM spend WHERE bucket = ?",
                                           (bucket.text(),)).fetchone()
                    out[bucket] = Usage() if row is None else Usage(float(row[0]), *(int(v) for v in row[1:]))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        return out

    def buckets(self, window: str, period: str) -> list[Bucket]:
        with self._lock:
            rows = self._db.execute("SELECT bucket FROM spend WHERE window = ? AND period = ?",
                                    (window, period)).fetchall()
        return sorted(Bucket.parse(row[0]) for row in rows)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def open_spend_store(config: RateLimitConfig, run_dir: Path) -> SpendStore:
    """The rate limiter's shared store when it has one (`ratelimit.store.redis`), else the sqlite
    file `ratelimit.spend.sqlite` (default: in the run directory)."""
    if config.store is not None:
        return RedisSpendStore(config.store.redis)
    return SqliteSpendStore(config.spend.sqlite or run_dir / SQLITE_FILE)
