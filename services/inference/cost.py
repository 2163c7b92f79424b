"""What a token costs right now: milliseconds per decode step, measured on every step.

A sequence in the running batch gets one token per scheduler step, so the time of a step
is what each of its tokens costs. That time depends on the batch size (a bigger batch is
a bigger forward) and on the host (a busy machine runs every step slower), so a figure
measured once at start goes stale the moment load changes: on a heavily loaded host it
was several times too low, and long requests died of their "compute budget" just short of
their last token.

`StepCost` keeps an exponentially weighted moving average per batch size, fed by the
scheduler with the wall time of each whole step (admission, the forward, sampling and the
hand-off to consumers — everything a waiting token pays, time lost to other processes
included). A batch size not seen yet borrows from the nearest size that has been: the
next larger one first (an over-estimate is the safe side for a budget), else the next
smaller one. The start-up warm-up seeds batch size 1, so the first request has a figure.

Writes come from the scheduler thread only; readers (request threads, load hints) read a
float from a list, which needs no lock in CPython.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from services.inference.load_hints import BusyMeter

# Weight of the newest step: ~10 steps of memory, so a change of load shows within a few
# tens of milliseconds of decoding, and one slow step (a GC pause) moves it by a fifth.
ALPHA = 0.2


class StepCost:
    """Milliseconds per decode step (= per token of each running sequence), per batch size."""

    def __init__(self, max_batch: int, seed_ms: float, alpha: float = ALPHA) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.max_batch = max_batch
        self.alpha = alpha
        self._ms: list[float | None] = [None] * (max_batch + 1)  # index = batch size
        self._ms[1] = max(float(seed_ms), 1e-6)
        self.steps = 0
        self.busy = BusyMeter()  # the loop's busy fraction, from the same step times (load hints)

    def observe(self, batch: int, seconds: float) -> None:
        """One step of `batch` sequences took `seconds` of wall time."""
        if batch < 1 or seconds < 0:
            return
        size = min(batch, self.max_batch)
        ms = seconds * 1000.0
        previous = self._ms[size]
        self._ms[size] = ms if previous is None else previous + self.alpha * (ms - previous)
        self.steps += 1
        self.busy.add(seconds)

    def ms_per_token(self, batch: int = 1) -> float:
        """The current estimate for a batch of `batch` sequences."""
        size = max(1, min(batch, self.max_batch))
        own = self._ms[size]
        if own is not None:
            return own
        for larger in self._ms[size + 1:]:
            if larger is not None:
                return larger
        for smaller in reversed(self._ms[1:size]):
            if smaller is not None:
                return smaller
        raise AssertionError("batch size 1 is always seeded")

    def measured(self) -> dict[int, float]:
        """Every batch size with an estimate, for logs and the bench."""
        return {size: round(ms, 3) for size, ms in enumerate(self._ms) if ms is not None}


@dataclass(frozen=True)
class BudgetRule:
    """The default compute budget: max_tokens × ms per token × `slowdown` + `margin_ms`, at
    most `cap_ms` (`inference.timeout_slowdown`, `timeout_margin_ms`, `max_timeout_ms`)."""

    slowdown: float
    margin_ms: float
    cap_ms: int

    def default_ms(self, max_tokens: int, ms_per_token: float) -> int:
        return self.for_cost(ms_per_token)(max_tokens)

    def for_cost(self, ms_per_token: float) -> Callable[[int], int]:
        """The rule at one cost per token, for many jobs (the scheduler's check per step)."""
        per_token = ms_per_token * self.slowdown
        margin, cap = self.margin_ms, self.cap_ms
        return lambda max_tokens: min(cap, math.ceil(max_tokens * per_token + margin))
