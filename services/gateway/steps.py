"""Where the gateway's admission and completion steps run, and what it counts for whoever
schedules them.

The gateway asks its `Steps` for each request, because they change as components move:
`DirectSteps` runs every step with a batch of one in the request's own thread (the layered
gateway); the spine's micro-batcher (`runtime.gateway_batching`, `monolith.batched_pipeline`)
decides many requests with the same steps. `InFlight` is the count a batcher reads to know
how many more requests a batch may expect; `AnswerTaps` is who is offered each finished
request (the spine's shadow mirror). They live apart from the gateway so the runtime can build
them before it, and swap them without rewiring it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from services.pipeline.loop_bridge import run_on_loop
from services.pipeline.pipeline import Pipeline
from services.pipeline.state import RequestState


class Admission(Protocol):
    """Runs the admission steps for a request; raises its `Stop` when one stops it."""

    def admit(self, state: RequestState) -> None: ...

    async def admit_on_loop(self, state: RequestState) -> None:
        """`admit` for a request served on an event loop (only where `Steps.in_process`)."""
        ...


class Completions(Protocol):
    """Runs (or takes, to run soon) the completion steps for a finished request."""

    def complete(self, state: RequestState) -> None: ...


class Steps(Protocol):
    """Where the gateway's admission and completions run now: they change as components move
    (batched while local, `runtime.gateway_batching`), so the gateway asks for each request.
    `in_process`: every admission and completion step is a call into this process and the
    completion writes are handed to a writer thread, so an event loop may run them inline."""

    @property
    def admission(self) -> Admission: ...

    @property
    def completions(self) -> Completions: ...

    @property
    def in_process(self) -> bool: ...

    @property
    def on_loop(self) -> bool:
        """Whether an event loop may run this request's admission and completions at all:
        inline where `in_process`, else through the loop bridge
        (`services.pipeline.loop_bridge`), every component in another process awaited on its
        grpc.aio stub there and every one in this process CPU work or handed to a writer."""
        ...


class InFlight:
    """Requests begun and not finished, counted by the gateway and read by whoever batches
    for it (how many more a batch may expect). Made before both, so neither is rewired."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            self.count += 1

    def leave(self) -> None:
        with self._lock:
            self.count -= 1


class AnswerTaps:
    """Who is offered every finished request after its completions (the spine's shadow mirror,
    `runtime.shadow.gateway_mirror`): each must be cheap and never raise. Given to the gateway
    when it is made; a tap joins through `add` once it exists."""

    def __init__(self) -> None:
        self._taps: tuple[Callable[[RequestState], None], ...] = ()

    def add(self, tap: Callable[[RequestState], None]) -> None:
        self._taps = (*self._taps, tap)

    def __call__(self, state: RequestState) -> None:
        for tap in self._taps:
            tap(state)


class DirectAdmission:
    """The pipeline with a batch of one, in the request's thread."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    def admit(self, state: RequestState) -> None:
        self.pipeline.admit([state])
        if state.outcome is not None:
            raise state.outcome

    async def admit_on_loop(self, state: RequestState) -> None:
        """On the loop through the bridge: a component in another process is awaited there."""
        await run_on_loop(self.admit, state)


class DirectCompletions:
    """Every completion step with a batch of one, before the answer leaves."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    def complete(self, state: RequestState) -> None:
        self.pipeline.complete([state])


class DirectSteps:
    """Every step per request (no batching), in the request's thread: never on a loop."""

    in_process = False
    on_loop = False

    def __init__(self, pipeline: Pipeline) -> None:
        self.admission: Admission = DirectAdmission(pipeline)
        self.completions: Completions = DirectCompletions(pipeline)
