"""`ratelimit.spend`: per-model prices, the teams' and tenants' budgets, how spend is shared.

A light module (pydantic only). Prices are US dollars per million tokens, as providers
publish them: `input` (prompt tokens), `cached_input` (prompt tokens the model reused from a
cache; `input` when not given) and `output` (completion tokens). A model with no price costs
nothing, but its tokens are still counted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from services.common.config_section import Float, Section, Table

Usd = Annotated[Float, Field(ge=0)]
Window = Literal["daily", "monthly"]
PER_MILLION = 1_000_000.0


class Price(Section):
    """One model's prices, USD per million tokens."""

    input: Usd
    output: Usd
    cached_input: Usd | None = None

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        """What an answer with this usage costs, in USD."""
        cached = min(max(cached_tokens, 0), max(prompt_tokens, 0))
        cached_price = self.input if self.cached_input is None else self.cached_input
        return ((prompt_tokens - cached) * self.input + cached * cached_price
                + completion_tokens * self.output) / PER_MILLION


class Budget(Section):
    """What a team or a tenant may spend per window (UTC days or calendar months)."""

    budget_usd: Annotated[Float, Field(gt=0)]
    window: Window = "monthly"


class SpendConfig(Section):
    """The `ratelimit.spend` section."""

    prices: Table[Price] = Field(default_factory=dict)  # by routed model id
    teams: Table[Budget] = Field(default_factory=dict)
    tenants: Table[Budget] = Field(default_factory=dict)
    # How often a replica sends its charges to the shared store and reads everyone's totals:
    # the longest another replica's spend goes unseen here (the budgets' overshoot bound).
    refresh_s: Annotated[Float, Field(gt=0, le=5)] = 0.1
    # Without `ratelimit.store` (one process): the sqlite file spend is kept in (default
    # `spend.sqlite` in the run directory).
    sqlite: Path | None = None

    def price(self, model: str) -> Price | None:
        return self.prices.get(model)

    @property
    def tracked(self) -> bool:
        """Spend is tracked once a price or a budget is set (a key's budget needs prices too)."""
        return bool(self.prices or self.teams or self.tenants)
