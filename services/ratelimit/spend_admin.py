"""The `SpendAdmin` gRPC service: `spend_report` behind the admin token."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc

from services.common import Clock
from services.common.admin_token import run_admin
from services.ratelimit.spend_config import SpendConfig
from services.ratelimit.spend_report import KeyBudgets, spend_report
from services.ratelimit.spend_store import SpendStore
from wire.v1 import spend_pb2, spend_pb2_grpc


class SpendAdminService(spend_pb2_grpc.SpendAdminServicer):
    """Spend as the shared store holds it; `key_budgets` gives each managed key's budget."""

    def __init__(self, store: SpendStore, config: SpendConfig, key_budgets: Callable[[], KeyBudgets],
                 admin_token: str, clock: Clock = time.time) -> None:
        if not admin_token:
            raise ValueError("admin_token: must be non-empty")
        self.store = store
        self.config = config
        self._key_budgets = key_budgets
        self._token = admin_token.encode()
        self._clock = clock

    def report(self, key: str = "", team: str = "", tenant: str = "") -> list[dict[str, Any]]:
        return spend_report(self.store, self.config, self._key_budgets(), self._clock(), key=key, team=team,
                            tenant=tenant)

    def GetSpend(self, request: spend_pb2.SpendRequest, context: grpc.ServicerContext) -> spend_pb2.SpendResponse:
        return run_admin(context, self._token, lambda: spend_pb2.SpendResponse(lines=[
            spend_pb2.SpendLine(**line) for line in self.report(request.key, request.team, request.tenant)]))

    def close(self) -> None:
        self.store.close()
