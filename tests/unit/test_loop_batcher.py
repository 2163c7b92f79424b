"""The loop's micro-batcher: what one pass of the loop queued is decided as one batch, a
lone request at once and inline, a wait for more only while it is free, and a caller that
left is skipped. A loop of the test's; no server."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from monolith.batcher import BatcherClosed, BatchStats
from monolith.loop_batcher import LoopBatcher


class Decisions:
    """`decide` that records each batch and answers each item doubled (or its error)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __call__(self, items: list[int]) -> Sequence[int | BaseException]:
        self.batches.append(list(items))
        return [ValueError(f"refused {item}") if item < 0 else item * 2 for item in items]


def test_what_one_pass_of_the_loop_queues_is_decided_together() -> None:
    decisions = Decisions()

    async def burst() -> list[int]:
        batcher = LoopBatcher(asyncio.get_running_loop(), decisions, max_batch=32, expected=lambda: 10)
        return list(await asyncio.gather(*(batcher.submit(i) for i in range(10))))

    assert asyncio.run(burst()) == [i * 2 for i in range(10)]
    assert decisions.batches == [list(range(10))]


def test_a_lone_request_is_decided_inline_without_a_future() -> None:
    decisions = Decisions()

    async def lone() -> tuple[int, int]:
        batcher = LoopBatcher(asyncio.get_running_loop(), decisions, expected=lambda: 1)
        result = await batcher.submit(4)
        return result, batcher.queued

    assert asyncio.run(lone()) == (8, 0)
    assert decisions.batches == [[4]]


def test_a_full_batch_is_decided_and_the_rest_form_the_next() -> None:
    decisions = Decisions()

    async def burst() -> None:
        batcher = LoopBatcher(asyncio.get_running_loop(), decisions, max_batch=4, expected=lambda: 10)
        await asyncio.gather(*(batcher.submit(i) for i in range(10)))

    asyncio.run(burst())
    assert [len(batch) for batch in decisions.batches] == [4, 4, 2]


def test_an_items_error_is_its_callers_alone() -> None:
    decisions = Decisions()

    async def mixed() -> list[int | BaseException]:
        batcher = LoopBatcher(asyncio.get_running_loop(), decisions, expected=lambda: 3)
        return list(await asyncio.gather(batcher.submit(1), batcher.submit(-1), batcher.submit(2),
                                         return_exceptions=True))

    first, refused, last = asyncio.run(mixed())
    assert (first, last) == (2, 4) and isinstance(refused, ValueError)


def test_the_batch_waits_for_more_only_while_patient_and_a_latency_item_ends_the_wait() -> None:
    decisions = Decisions()

    async def waits() -> None:
        loop = asyncio.get_running_loop()
        batcher = LoopBatcher(loop, decisions, max_batch=32, max_wait_s=30.0, expected=lambda: 8,
                              patient=lambda items: all(item < 100 for item in items))
        early = [asyncio.ensure_future(batcher.submit(i)) for i in range(3)]
        await asyncio.wait(early, timeout=0.05)  # the wait (30 s) holds them
        assert decisions.batches == [] and batcher.queued == 3
        await batcher.submit(100)  # may not wait: decided with the ones waiting
        await asyncio.gather(*early)

    asyncio.run(waits())
    assert decisions.batches == [[0, 1, 2, 100]]


def test_a_caller_that_left_is_skipped_and_a_closed_batcher_refuses() -> None:
    decisions = Decisions()

    async def left() -> None:
        batcher = LoopBatcher(asyncio.get_running_loop(), decisions, max_wait_s=30.0, expected=lambda: 5,
                              patient=lambda items: 99 not in items)
        gone = asyncio.ensure_future(batcher.submit(1))
        stays = asyncio.ensure_future(batcher.submit(2))
        await asyncio.wait([gone, stays], timeout=0.05)  # both queued, waiting for more
        gone.cancel()  # its client left
        assert await batcher.submit(99) == 198 and await stays == 4
        batcher.close()
        with pytest.raises(BatcherClosed):
            await batcher.submit(3)

    asyncio.run(left())
    assert decisions.batches == [[2, 99]]


@pytest.mark.parametrize("settings", [{"max_batch": 0}, {"max_wait_s": -0.001}], ids=["max_batch", "max_wait_s"])
def test_both_batchers_refuse_the_same_settings(settings: dict[str, float]) -> None:
    from monolith.batcher import MicroBatcher

    loop = asyncio.new_event_loop()
    try:
        for make in (lambda: MicroBatcher(Decisions(), **settings),  # type: ignore[arg-type]
                     lambda: LoopBatcher(loop, Decisions(), **settings)):  # type: ignore[arg-type]
            with pytest.raises(ValueError, match=next(iter(settings))):
                make()
    finally:
        loop.close()


def test_a_decide_that_miscounts_fails_its_callers_on_the_loop_too() -> None:
    async def miscounted() -> None:
        batcher: LoopBatcher[int, int] = LoopBatcher(asyncio.get_running_loop(), lambda items: [], max_batch=4)
        with pytest.raises(RuntimeError, match="decide returned 0 results for 1 item"):
            await batcher.submit(1)

    asyncio.run(miscounted())


def test_batch_counts_add_up_across_batchers() -> None:
    total = BatchStats(batches=2, items=7, largest=5, waited=1).plus(BatchStats(batches=3, items=4, largest=2))
    assert (total.batches, total.items, total.largest, total.waited) == (5, 11, 5, 1)
    assert total.mean_size == 11 / 5
