"""The lease thread's books: what one replica holds of each bucket's tokens between renewals.

A bucket's level on the table is its granted tokens plus its reserve
(`Held.level`); whatever it reads instead was spent since (or given back by a settle), and
`account` takes that in before anything else moves the level: at each renewal, and on its
answer, before a grant or a payment, because the store is asked without the limiter's lock
and requests go on being admitted meanwhile. Every change this module makes to a level
changes one of the two counts by as much, so a replica never admits a token the store did
not grant it beyond its reserve, and never charges the store for one twice.

`services.ratelimit.leases.StoreLeases` runs the renewals and the faults; these functions keep
the books it renews from, under the limiter's lock.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from services.ratelimit.token_buckets import TokenBucketTable

# Below this, a level and its counts differ by float rounding alone (fractional grants, whole
# costs), not by anything spent: a cost or a settle is a whole number of tokens. Counted as a
# spend, it would refresh `last_used` at every renewal, and an idle lease would never go back.
_ROUNDING = 1e-6


@dataclass
class Held:
    """What this replica knows of one bucket's tokens between renewals.

    The bucket's level on the table should read `backed + unbacked` (`level`); whatever it
    reads instead was spent (below) or given back by a settle (above) since `account` last
    looked, and nothing else moves it. Keeping that one invariant, rather than a remembered
    level beside the two counts, is what stops a replica from admitting tokens nobody granted:
    every change to the table's level here changes one of the two counts by as much."""

    unbacked: float  # tokens no grant paid for (the reserve): owed to the store once spent
    last_used: float
    backed: float = 0.0  # tokens the store granted, not spent yet
    demand: float = 0.0  # tokens a second spent, smoothed
    owed_back: float = 0.0  # granted tokens that did not fit or were drained: given back at the next renewal
    debt: float = 0.0  # reserve spent, and settles past zero, not charged to the store yet
    spent: float = 0.0  # tokens spent since the last renewal (its demand)
    in_debt: bool = False  # the store's bucket was below zero at the last renewal: no reserve

    @property
    def level(self) -> float:
        """The level the table's bucket reads when nothing was spent or settled since `account`."""
        return self.backed + self.unbacked


def account(table: TokenBucketTable, key: Hashable, held: Held, level: float) -> None:
    """Bring `held` up to the bucket's `level` on the table now (its caller holds the limiter's lock).

    Below `held.level`: spent, from the granted tokens first, then from the reserve (owed
    to the store as debt); past zero (a settle charged a long answer beyond the tokens
    held): owed as debt too, and the level comes back to zero, so the store's bucket, not
    this one, carries it and every replica refuses next. Above: a settle gave back tokens
    a request was charged and did not use; they were paid for, so they count as granted
    (spent again or given back, never charged twice). Run before anything else moves the
    level: at each renewal, and on its answer, before a grant or a drain, since requests
    went on being admitted while the store was asked."""
    gained = level - held.level
    if abs(gained) < _ROUNDING:
        return
    if gained > 0:
        held.backed += gained
        return
    used = -gained
    from_backed = min(used, held.backed)
    held.backed -= from_backed
    from_reserve = min(used - from_backed, held.unbacked)
    held.unbacked -= from_reserve
    below = max(0.0, -level)
    if below > 0:
        table.credit(key, below)
    held.debt += from_reserve + below
    held.spent += used


def take_out(table: TokenBucketTable, key: Hashable, tokens: float) -> float:
    """Take `tokens` out of a bucket that holds at least that many (it was just accounted);
    returns what came out."""
    return tokens + table.credit(key, -tokens)


def pay(table: TokenBucketTable, key: Hashable, held: Held, debt: float) -> None:
    """The store's bucket is `debt` below zero: pay it from the granted tokens held here
    (given back at the next renewal) and drop the reserve, which would only add to it
    (caller holds the lock, and has just accounted the bucket).

    Paying the debt, not giving back everything held: tokens move, none is made or lost,
    so what the replicas hold and the store together stays what one bucket would hold.
    A debt of spent reserves (a few tokens, the bound's own term) costs a replica that
    was just granted a lease those few tokens, not its lease; a debt larger than what a
    replica holds (a long answer settled past the limit) empties it, and the tenant is
    refused there until the store's bucket refills above zero. Every replica that reads
    the debt pays it, so the store may be paid more than once: the rest goes back out as
    grants."""
    paid = min(held.backed, debt)
    held.owed_back += take_out(table, key, paid)
    held.backed -= paid
    take_out(table, key, held.unbacked)
    held.unbacked = 0.0


def store_key(key: Hashable) -> str:
    """A bucket's key in the store: `tenant=dev,model=m,resource=requests` for descriptor
    entries (the limit's name, the same on every replica)."""
    if isinstance(key, tuple) and all(isinstance(e, tuple) and len(e) == 2 for e in key):
        return ",".join(f"{k}={v}" for k, v in key)
    return repr(key)


def resource_of(key: Hashable) -> str:
    """The `resource=` entry of a bucket's descriptor entries ("" for another key)."""
    if isinstance(key, tuple):
        for entry in key:
            if isinstance(entry, tuple) and len(entry) == 2 and entry[0] == "resource":
                return str(entry[1])
    return ""
