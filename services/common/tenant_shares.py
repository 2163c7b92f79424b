"""Each tenant's weight in the model's queue: `ratelimit.tenants.<tenant>.share_weight`.

A tenant's tier is its block in the `ratelimit:` section (`ratelimit.default` for every
tenant without one); the block's `share_weight` (default 1) is its share of the admissions
of a priority class while other tenants wait in it too (`services.inference.fair_share`).
The rate limiter's section model checks the key; the component table hands the weights to
the inference component as these (`services.registry`), because the middlewares never
import each other. The gateway names the tenant to
the model in the call's metadata (`TENANT_HEADER`), which only the gateway sets: it never
forwards a client's metadata to the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

TENANT_HEADER = "x-spine-tenant"  # the gateway's model call: whose request it is
DEFAULT_WEIGHT = 1.0


@dataclass(frozen=True)
class TenantShares:
    """Weights by tenant; every other tenant has `default`."""

    default: float = DEFAULT_WEIGHT
    weights: Mapping[str, float] = field(default_factory=dict)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default)
