"""How a configured rate limit is split while a stage splits traffic: per side, then per replica.

Every rate limiter sizes its token buckets to its share of each configured limit. The shares
of all the limiters a tenant's requests can reach add up to the limit (at most a sliver over
it, `MIN_SHARE`), so a tenant never gets more than its limit in total, wherever its requests
land:

- while the spine still calls the layered rate limiter (ratelimit placed `remote` in the
  stage), the layered limiters decide for both sides and together hold the whole limit;
- once the spine has its own (ratelimit `local`), each side holds its weight's share;
- a side's share is divided evenly over that side's replicas (traffic is spread over them).

The built-in front (`migration.traffic.cutover`) and the xDS followers
(`migration.xds.followers`) both split by these rules. A limiter applies its share to every
limit it holds: the token buckets' rates and bursts, and each tenant's
`max_concurrent_requests`, rounded down but never below one request in flight
(`services.ratelimit.concurrency`), so a small concurrency limit may be a request over in total at
extreme splits rather than shut a side out.
"""

from __future__ import annotations

# A side that gets no traffic still keeps a sliver of budget: a share must be > 0, and
# requests forced to that side (x-spine-route) or still in flight are few.
MIN_SHARE = 0.01


def side_shares(spine_weight: float, spine_limits_locally: bool) -> tuple[float, float]:
    """(spine, layered): each side's share of every limit at `spine_weight` percent.

    The spine's is 0 while its own limiter is not on the request path (it calls the layered
    one, which then holds the whole limit)."""
    if not spine_limits_locally:
        return 0.0, 1.0
    spine = spine_weight / 100.0
    return max(spine, MIN_SHARE), max(1.0 - spine, MIN_SHARE)


def replica_share(side_share: float, replicas: int) -> float:
    """One replica's share: its side's, divided evenly over the side's replicas."""
    return side_share / max(replicas, 1)
