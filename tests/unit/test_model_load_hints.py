"""The gateway's view of a model's load (`ModelLoads`): the latest hint text always, the
busy figure read from it at most every `FIGURE_EVERY_S` (it moves in 100 ms slots)."""

from __future__ import annotations

from services.gateway.model_load import FIGURE_EVERY_S, ModelLoads


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_hint_is_always_the_latest_and_the_busy_figure_follows_within_its_period() -> None:
    clock = Clock()
    loads = ModelLoads(None, clock=clock)
    loads.note("tiny-lm", "queue=0;busy=0.2")
    assert loads.busy() == 0.2
    clock.now += FIGURE_EVERY_S / 4
    loads.note("tiny-lm", "queue=3;busy=0.9")
    assert loads.hint("tiny-lm") == "queue=3;busy=0.9"  # what a client is told: the newest
    assert loads.busy() == 0.2  # the figure is read again only after its period
    clock.now += FIGURE_EVERY_S
    loads.note("tiny-lm", "queue=4;busy=0.95")
    assert loads.busy() == 0.95
    loads.note("other", "busy=0.5")  # a model seen for the first time: its figure at once
    assert loads.busy() == 0.95 and loads.hint("other") == "busy=0.5"
    clock.now += 5.0  # every hint stale: no figure at all
    assert loads.busy() == 0.0
