"""Blocking-shaped code run on an event loop, awaiting where it would block: the bridge between
the pipeline's sync steps and grpc.aio stubs.

Every step of the request path is written once, as sync code (`Step.decide` calls its
component and reads the answer), because the same step runs on a gRPC handler thread, under
the spine's micro-batcher and on the HTTP API's event loop. When a step's component is in
another process its call is a network round trip: on a thread it waits on a sync stub; on the
loop it must not wait, or every request on the loop waits with it. `run_on_loop(function)`
runs `function` in a greenlet on the loop's own thread; inside it, `wait_for(awaitable)`
hands the awaitable to the loop's task, which awaits it while the loop serves everything
else, and resumes the greenlet with its result (or its exception). A remote component asks
`on_loop_now()` and awaits its grpc.aio stub that way; everything else in the step runs
inline, as it would on a thread. This is SQLAlchemy's asyncio bridge (`greenlet_spawn`,
`await_only`), reduced to what the pipeline needs.

Only code whose every wait is a `wait_for` may run here: a lock held across I/O, a
`queue.get` or a sleep would stop the loop. The gateway decides per request whether a
request's steps qualify (`Gateway.serves_on_loop`).
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from greenlet import getcurrent, greenlet

T = TypeVar("T")


class _OnLoop(greenlet):  # type: ignore[misc]  # greenlet ships no stubs for subclassing
    """A greenlet run by `run_on_loop`: `driver` is the loop task's greenlet it hands awaitables to."""

    def __init__(self, function: Callable[..., Any], driver: greenlet) -> None:
        super().__init__(function, driver)
        self.driver = driver
        # The same contextvars as the task (the request's trace context, its span): a new
        # greenlet would otherwise start with an empty context.
        self.gr_context = driver.gr_context


class NotOnLoop(RuntimeError):
    """`wait_for` outside `run_on_loop`: a caller asked to await where nothing awaits."""


def on_loop_now() -> bool:
    """Whether the calling code runs inside `run_on_loop` (so it may `wait_for`)."""
    return isinstance(getcurrent(), _OnLoop)


def wait_for(awaitable: Awaitable[T]) -> T:
    """The result of `awaitable`, awaited by the loop's task while this greenlet is parked;
    its exception is raised here. Only inside `run_on_loop`."""
    current = getcurrent()
    if not isinstance(current, _OnLoop):
        raise NotOnLoop("wait_for called outside run_on_loop")
    result: T = current.driver.switch(awaitable)
    return result


async def run_on_loop(function: Callable[..., T], *args: Any) -> T:
    """`function(*args)` on this loop's thread, each `wait_for` inside it awaited here."""
    runner = _OnLoop(function, getcurrent())
    result = runner.switch(*args)
    while not runner.dead:
        try:
            value = await result
        except BaseException:  # the awaitable's failure (a cancel too) is raised where it waited
            result = runner.throw(*sys.exc_info())
        else:
            result = runner.switch(value)
    return result  # type: ignore[no-any-return]
