"""The spine's admin API: API keys managed at run time and spend, behind the admin token.

Served by the process that serves the Gateway (the spine, the layered gateway) when it has an
admin token (`spine up --admin-token-file`, or $SPINE_ADMIN_TOKEN): the gRPC services
`KeyAdmin` and `SpendAdmin` on its gRPC listener, and the same operations as JSON under
`/admin/` on its HTTP listener (`runtime.http.admin_http`). It writes to the stores the
components read — the key store (`auth.store`) and the spend store (`ratelimit.store`, else
`ratelimit.spend.sqlite`) — so it works wherever auth and the rate limiter are placed, and
every replica sharing those stores sees a change within its poll interval.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from services.auth.config import AuthConfig
from services.auth.key_admin import KeyAdmin
from services.auth.key_admin_service import KeyAdminService
from services.auth.key_store import open_key_store
from services.component import ComponentSpec, no_factory
from services.ratelimit.config import RateLimitConfig
from services.ratelimit.spend_admin import SpendAdminService
from services.ratelimit.spend_report import KeyBudgets
from services.ratelimit.spend_store import open_spend_store

log = logging.getLogger("runtime")

KEY_ADMIN = ComponentSpec("key-admin", "wire.v1.keys_pb2", "KeyAdmin", no_factory, None, ())
SPEND_ADMIN = ComponentSpec("spend-admin", "wire.v1.spend_pb2", "SpendAdmin", no_factory, None, ())


class AdminApi:
    """Both admin services over this config's stores; `keys` is None when `auth.store` is off."""

    def __init__(self, auth: AuthConfig, ratelimit: RateLimitConfig, run_dir: Path, admin_token: str) -> None:
        self.token = admin_token
        self.keys: KeyAdmin | None = None
        self.key_service: KeyAdminService | None = None
        if auth.store.enabled:
            store, hasher = open_key_store(auth.store, run_dir)
            self.keys = KeyAdmin(store, hasher, auth.api_keys)
            self.key_service = KeyAdminService(self.keys, admin_token)
        self.spend = SpendAdminService(open_spend_store(ratelimit, run_dir), ratelimit.spend, self._key_budgets,
                                       admin_token)

    def _key_budgets(self) -> KeyBudgets:
        if self.keys is None:
            return {}
        _, keys = self.keys.store.load()
        return {key.id: (key.budget_usd, key.budget_window) for key in keys if key.budget_usd}

    def grpc_services(self) -> list[tuple[ComponentSpec[Any], Any]]:
        services: list[tuple[ComponentSpec[Any], Any]] = [(SPEND_ADMIN, self.spend)]
        if self.key_service is not None:
            services.insert(0, (KEY_ADMIN, self.key_service))
        return services

    def close(self) -> None:
        if self.keys is not None:
            self.keys.store.close()
        self.spend.close()
