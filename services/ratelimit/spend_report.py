"""What keys, teams and tenants spent in the current periods, beside their budgets: the
admin API's answer (`SpendAdmin`, HTTP /admin/spend), read from the shared store itself.

It reads the store, not a replica's copy, so any process that reaches the store answers the
same: the spine's, the layered gateway's. A replica's charges reach the store within
`ratelimit.spend.refresh_s`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.ratelimit.spend import WINDOWS, period
from services.ratelimit.spend_config import SpendConfig
from services.ratelimit.spend_store import Bucket, SpendStore, Usage

KeyBudgets = Mapping[str, tuple[float, str]]  # key id -> (budget in USD, window)


def spend_report(store: SpendStore, config: SpendConfig, key_budgets: KeyBudgets, now: float, *,
                 key: str = "", team: str = "", tenant: str = "") -> list[dict[str, Any]]:
    """One line per (scope, name, window) asked for (all filters empty: every bucket charged
    in the current periods), with its budget where one is set."""
    wanted = [(scope, name) for scope, name in (("key", key), ("team", team), ("tenant", tenant)) if name]
    buckets: list[Bucket] = []
    for window in WINDOWS:
        current, _ = period(window, now)
        if wanted:
            buckets += [Bucket(window, current, scope, name) for scope, name in wanted]
        else:
            buckets += store.buckets(window, current)
    totals = store.exchange({}, buckets)
    lines = []
    for bucket in buckets:
        usage = totals.get(bucket, Usage())
        budget = _budget(bucket, config, key_budgets)
        lines.append({"scope": bucket.scope, "name": bucket.name, "window": bucket.window, "period": bucket.period,
                      "usd": usage.usd, "input_tokens": usage.input_tokens,
                      "cached_input_tokens": usage.cached_input_tokens, "output_tokens": usage.output_tokens,
                      "requests": usage.requests, "budget_usd": budget,
                      "remaining_usd": max(0.0, budget - usage.usd) if budget else 0.0,
                      "resets_in_s": period(bucket.window, now)[1]})
    return lines


def _budget(bucket: Bucket, config: SpendConfig, key_budgets: KeyBudgets) -> float:
    if bucket.scope == "key":
        usd, window = key_budgets.get(bucket.name, (0.0, ""))
        return usd if window == bucket.window else 0.0
    table = config.teams if bucket.scope == "team" else config.tenants
    budget = table.get(bucket.name)
    return budget.budget_usd if budget is not None and budget.window == bucket.window else 0.0
