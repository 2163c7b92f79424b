"""Budgets in the rate limiter's admission, and spend at its release (`services.ratelimit.spend`).

Why apart from the servicer: the budgets are decided before, and independently of, the token
buckets and concurrency slots (an item refused for a budget touches no bucket), and the
charge at the release is priced outside the limiter's lock; the servicer only calls these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.pipeline.batch_rpc import ItemError
from services.ratelimit.admission import AdmitItem, AdmitVerdict
from services.ratelimit.api import ReleaseItem
from services.ratelimit.spend import BudgetVerdict, Payer, SpendLedger

AdmitLimits = Callable[[Sequence[AdmitItem]], list[AdmitVerdict | ItemError]]


def budget_of(spend: SpendLedger, item: AdmitItem) -> BudgetVerdict:
    """Whether `item` stays within every budget that applies (its prompt priced at its model's input rate)."""
    price = spend.config.price(item.model)
    estimate = 0.0 if price is None else price.cost(item.tokens, 0, 0)
    payer = Payer(item.tenant, item.team, item.key, item.key_budget_usd, item.key_budget_window or "monthly")
    return spend.check(payer, estimate, count=not item.dry_run)


def admit_within_budgets(spend: SpendLedger, items: Sequence[AdmitItem],
                         admit_limits: AdmitLimits) -> list[AdmitVerdict | ItemError]:
    """Budgets first: an item that would pass one is refused (when its window starts again as
    its retry-after) and the rest go to `admit_limits`; every verdict says the least budget left."""
    budgets = [budget_of(spend, item) for item in items]
    passing = [index for index, budget in enumerate(budgets) if budget.admitted]
    limits = admit_limits(items if len(passing) == len(items) else [items[index] for index in passing])
    decided: list[AdmitVerdict | ItemError] = [
        AdmitVerdict(admitted=False, retry_after_s=budget.resets_in_s, budget=budget.refused,
                     budget_remaining_usd=budget.remaining_usd, budget_resets_in_s=budget.resets_in_s)
        for budget in budgets]
    for index, verdict in zip(passing, limits, strict=True):
        if isinstance(verdict, AdmitVerdict):
            verdict.budget_remaining_usd = budgets[index].remaining_usd
        decided[index] = verdict
    return decided


def charge(spend: SpendLedger, items: Sequence[ReleaseItem]) -> None:
    """Each released request's usage, priced and charged to its key, team and tenant."""
    for item in items:
        if item.tenant and item.model and (item.prompt_tokens or item.completion_tokens):
            spend.charge(Payer(item.tenant, item.team, item.key), item.model, item.prompt_tokens,
                         item.cached_prompt_tokens, item.completion_tokens)
