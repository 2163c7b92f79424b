"""The weighted sticky split both fronts make (`migration.traffic.front` for the Gateway API,
`migration.traffic.http_front` for the HTTP APIs): a request key goes to the spine with the
stage's weight, and the same key always to the same side while the weight holds, so one
conversation stays on one layout; as the weight grows, keys only move from layered to spine.

The key is hashed (sha256, the first four bytes) into one of 10,000 buckets: a bucket below
weight x 100 goes to the spine, so the weight counts in hundredths of a percent and the buckets
a weight sends to the spine include every bucket a smaller weight did.
"""

from __future__ import annotations

import hashlib

ROUTE_HEADER = "x-spine-route"  # forces a side, where the plan allows it (an operator's tool)
SESSION_HEADER = "x-session-id"  # the first choice of sticky key: a conversation's id
_BUCKETS = 10_000


def checked_weight(spine_weight: float) -> float:
    """`spine_weight` (percent of requests to the spine), or ValueError saying the range."""
    if not 0.0 <= spine_weight <= 100.0:
        raise ValueError(f"spine_weight: must be between 0 and 100, got {spine_weight}")
    return spine_weight


def sticky_side(key: str, spine_weight: float) -> str:
    """`spine` or `layered` for a request key at `spine_weight` percent."""
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % _BUCKETS
    return "spine" if bucket < spine_weight * (_BUCKETS // 100) else "layered"
