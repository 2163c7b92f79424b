"""A backend for tests whose requests take a while: TinyLM with a pause in every decode step.

Loaded by dotted path from a config (`inference.backend: {class: "tests.paced_backend:paced",
options: {step_ms: 30}}`), so the layered inference process builds it too: a request of
`max_tokens` tokens then runs for about `max_tokens × step_ms` in every layout. `SlowedModel`
is a model that turns slow after it started (a host that becomes busy). No tests here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from services.inference.model.backend import TINY_LM_ID, TokenizedBackend
from services.inference.model.interface import Segment
from services.inference.model.tiny_lm import TinyLM
from services.inference.model.tokenizer import ByteTokenizer
from tests.unit.test_serving_support import GatedModel


class PacedModel(GatedModel):
    """TinyLM whose every step takes at least `step_s` (the gate stays open)."""

    def __init__(self, inner: TinyLM, step_s: float) -> None:
        super().__init__(inner)
        self.step_s = step_s

    def step(self, segments: Sequence[Segment], cache: Any) -> Any:
        time.sleep(self.step_s)
        return super().step(segments, cache)


class SlowedModel(GatedModel):
    """TinyLM that turns slow (a busy host): every step while `slow_s` is set, or the next
    `slow_steps` steps. The pause is the slowness under test: the compute budget is measured
    on the wall clock the model's steps take."""

    slow_s = 0.0
    slow_steps = 0

    def step(self, segments: Sequence[Segment], cache: Any) -> Any:
        if self.slow_steps:
            self.slow_steps -= 1
            time.sleep(0.01)
        elif self.slow_s:
            time.sleep(self.slow_s)
        return super().step(segments, cache)


def paced(step_ms: float = 30.0, model_id: str = TINY_LM_ID, seed: int = 1234, max_context: int = 256) -> TokenizedBackend:
    return TokenizedBackend(model_id, PacedModel(TinyLM.from_seed(seed, max_context=max_context), step_ms / 1000.0),
                            ByteTokenizer())  # type: ignore[arg-type]
