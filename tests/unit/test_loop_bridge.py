"""The loop bridge: sync code run in a greenlet on an event loop, awaiting where it would block."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

from services.pipeline.loop_bridge import NotOnLoop, on_loop_now, run_on_loop, wait_for

REQUEST = contextvars.ContextVar("request", default="none")


async def _answer(value: int) -> int:
    await asyncio.sleep(0)
    return value * 2


async def _fail() -> None:
    await asyncio.sleep(0)
    raise ValueError("the awaited call failed")


def test_sync_code_awaits_each_call_and_gets_its_answer() -> None:
    def steps() -> list[int]:
        return [wait_for(_answer(n)) for n in range(3)]

    assert asyncio.run(run_on_loop(steps)) == [0, 2, 4]


def test_the_loop_serves_other_work_while_the_bridged_code_waits() -> None:
    """What the bridge is for: a call awaited inside it parks only its own request."""
    order: list[str] = []

    async def main() -> None:
        gate = asyncio.Event()

        def waits() -> None:
            order.append("bridged waits")
            wait_for(gate.wait())
            order.append("bridged resumes")

        async def other() -> None:
            await asyncio.sleep(0)
            order.append("other runs")
            gate.set()

        await asyncio.gather(run_on_loop(waits), other())

    asyncio.run(main())
    assert order == ["bridged waits", "other runs", "bridged resumes"]


def test_a_failed_call_raises_where_it_was_awaited_and_the_code_can_handle_it() -> None:
    def steps() -> str:
        try:
            wait_for(_fail())
        except ValueError as error:
            return f"handled: {error}"
        return "not raised"

    assert asyncio.run(run_on_loop(steps)) == "handled: the awaited call failed"


def test_an_unhandled_failure_reaches_the_awaiting_task() -> None:
    with pytest.raises(ValueError, match="the awaited call failed"):
        asyncio.run(run_on_loop(lambda: wait_for(_fail())))


def test_it_runs_on_the_loops_thread_with_the_tasks_context() -> None:
    async def main() -> tuple[int, str, bool]:
        REQUEST.set("req-1")
        return await run_on_loop(lambda: (threading.get_ident(), REQUEST.get(), on_loop_now()))

    here = threading.get_ident()
    thread, request, bridged = asyncio.run(main())
    assert (thread, request, bridged) == (here, "req-1", True)
    assert on_loop_now() is False


def test_waiting_outside_the_bridge_is_refused() -> None:
    awaitable = _answer(1)
    with pytest.raises(NotOnLoop):
        wait_for(awaitable)
    awaitable.close()
