"""What builds each component's servicer from the config: one function per component, each
importing its servicer's module (torch, crypto) only when it is called, so a process imports
only what it serves. The table that names them is `services.registry`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from services.auth.api import AUTH, Auth
from services.common import DeviceState
from services.common.tenant_shares import TenantShares
from services.component import ComponentConfig
from services.pipeline.interface import Placed
from services.ratelimit.api import RATELIMIT, RateLimit
from services.ratelimit.config import RateLimitConfig

if TYPE_CHECKING:  # the servicers' modules import torch or crypto: each factory imports its own when called
    from services.auth.envoy_authz import EnvoyAuthorization
    from services.auth.service import AuthService
    from services.cache.service import CacheService
    from services.inference.models import ModelRouter
    from services.logs.service import LogsService
    from services.metrics.service import MetricsService
    from services.ratelimit.envoy_ratelimit import EnvoyRateLimit
    from services.ratelimit.service import RateLimitService
    from services.router.service import RouterService


def auth(config: ComponentConfig, device: DeviceState, run_dir: Path) -> AuthService:
    from services.auth.service import AuthService

    store = config.auth.store
    if not store.enabled:
        return AuthService(config.auth, device)
    from services.auth.key_store import open_key_store
    from services.auth.live_keys import LiveKeys

    keys, hasher = open_key_store(store, run_dir)
    return AuthService(config.auth, device, live_keys=LiveKeys(keys, hasher, store.poll_s).start())


def ratelimit(config: ComponentConfig, device: DeviceState, run_dir: Path) -> RateLimitService:
    from services.ratelimit.service import RateLimitService

    limits = config.ratelimit
    if not limits.spend.tracked:
        return RateLimitService(limits, device)
    from services.ratelimit.spend import SpendLedger
    from services.ratelimit.spend_store import open_spend_store

    spend = SpendLedger(limits.spend, open_spend_store(limits, run_dir)).start()  # `ratelimit.spend` prices or budgets
    return RateLimitService(limits, device, spend=spend)


def router(config: ComponentConfig, device: DeviceState, run_dir: Path) -> RouterService:
    from services.router.service import RouterService

    return RouterService(config.router, device)


def cache(config: ComponentConfig, device: DeviceState, run_dir: Path) -> CacheService:
    from services.cache.service import build

    return build(config.cache, config.inference, device)


def metrics(config: ComponentConfig, device: DeviceState, run_dir: Path) -> MetricsService:
    from services.metrics.service import MetricsService

    return MetricsService(config.metrics, device)


def logs(config: ComponentConfig, device: DeviceState, run_dir: Path) -> LogsService:
    from services.logs.service import LogsService

    return LogsService(config.logs, device, run_dir=run_dir)


def inference(config: ComponentConfig, device: DeviceState, run_dir: Path) -> ModelRouter:
    from services.common.upstream_config import upstream_routes
    from services.inference.models import ModelRouter

    return ModelRouter(config.inference, device, upstreams=upstream_routes(config.router.models),
                       shares=tenant_shares(config.ratelimit))


def tenant_shares(limits: RateLimitConfig) -> TenantShares:
    """Each tenant's weight in the model's queue: its rate limit tier's `share_weight` (the
    middlewares never import each other, so the table hands it over)."""
    return TenantShares(limits.default.share_weight, {name: tier.share_weight for name, tier in limits.tenants.items()})


def envoy_authz(config: ComponentConfig, placed: Placed, budget_s: float) -> EnvoyAuthorization:
    from services.auth.envoy_authz import EnvoyAuthorization

    return EnvoyAuthorization(lambda: placed.get(AUTH), budget_s)


def envoy_rls(config: ComponentConfig, placed: Placed, budget_s: float) -> EnvoyRateLimit:
    from services.ratelimit.envoy_ratelimit import EnvoyRateLimit, ModelNames

    return EnvoyRateLimit(lambda: placed.get(RATELIMIT), budget_s, config.ratelimit.domain, ModelNames(config.router))


def envoy_authz_client(channel: grpc.Channel, options: Mapping[str, Any], config: ComponentConfig) -> Auth:
    from services.auth.envoy_authz import TENANT_HEADER, EnvoyAuthzClient

    return EnvoyAuthzClient(channel, str(options.get("tenant_header") or TENANT_HEADER))


def envoy_rls_client(channel: grpc.Channel, options: Mapping[str, Any], config: ComponentConfig) -> RateLimit:
    from services.ratelimit.envoy_ratelimit import EnvoyRlsClient

    return EnvoyRlsClient(channel, str(options.get("domain") or config.ratelimit.domain))
