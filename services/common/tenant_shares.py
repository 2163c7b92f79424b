"""Each tenant's weight in the model's queue: `ratelimit.tenants.<tenant>.share_weight`.

A tenant's tier is its block in the `ratelimit:` section (`ratelimit.default` for every
tenant without one); the block's `share_weight` (default 1) is its share of the admissions
of a priority class while other tenants wait in it too (`services.inference.fair_share`).
The rate limiter's section model checks the key; the component table hands the weights to
the inference component as these (`services.registry`), because the middlewares never
import each other. The gateway names the tenant to
the model in the call's metadata (`TENANT_METADATA`), which only the gateway sets: it never
forwards a client's metadata to the model. The name travels as binary metadata because a
tenant is whatever a token's issuer wrote (any Unicode), and gRPC refuses an ASCII metadata
value outside printable ASCII: the call would fail INTERNAL before it left the gateway.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

TENANT_METADATA = "x-spine-tenant-bin"  # the gateway's model call: whose request it is (UTF-8)
DEFAULT_WEIGHT = 1.0


def tenant_metadata(tenant: str) -> tuple[str, bytes]:
    """The metadata entry naming `tenant` to the model (`surrogatepass`: a JSON claim may
    hold a lone surrogate, and it must still name one queue, not fail the call)."""
    return TENANT_METADATA, tenant.encode("utf-8", "surrogatepass")


def tenant_from(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The tenant a model call names ("" when none: a caller other than the gateway)."""
    for key, value in metadata or ():
        if key == TENANT_METADATA:
            return value.decode("utf-8", "surrogatepass") if isinstance(value, bytes) else value
    return ""


@dataclass(frozen=True)
class TenantShares:
    """Weights by tenant; every other tenant has `default`."""

    default: float = DEFAULT_WEIGHT
    weights: Mapping[str, float] = field(default_factory=dict)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default)
