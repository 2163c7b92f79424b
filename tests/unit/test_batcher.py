"""The micro-batcher: callers are decided together, each gets its own answer, nobody waits alone."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from monolith.batcher import BatcherClosed, MicroBatcher
from tests.waiting import eventually


class Recorder:
    """A decide function that remembers its batches and can hold the first one back."""

    def __init__(self, result: Callable[[int], object] = lambda x: x * 10) -> None:
        self.batches: list[list[int]] = []
        self.hold = threading.Event()
        self.hold.set()
        self.entered = threading.Event()
        self.result = result

    def __call__(self, items: list[int]) -> list[object]:
        self.batches.append(list(items))
        self.entered.set()
        self.hold.wait(timeout=10)
        return [self.result(x) for x in items]


def submit_all(batcher: MicroBatcher, items: list[int]) -> tuple[list[threading.Thread], dict[int, object]]:
    results: dict[int, object] = {}

    def one(item: int) -> None:
        try:
            results[item] = batcher.submit(item)
        except Exception as error:
            results[item] = error

    threads = [threading.Thread(target=one, args=(item,)) for item in items]
    for thread in threads:
        thread.start()
    return threads, results


def test_a_lone_item_is_decided_at_once_in_a_batch_of_one() -> None:
    decide = Recorder()
    batcher = MicroBatcher(decide, max_batch=8, max_wait_s=5.0, expected=lambda: 1)
    assert batcher.submit(3) == 30
    assert decide.batches == [[3]]
    assert batcher.stats.waited == 0


def test_items_that_arrive_during_a_batch_are_decided_together_next() -> None:
    decide = Recorder()
    decide.hold.clear()
    batcher = MicroBatcher(decide, max_batch=32)
    first, first_results = submit_all(batcher, [0])
    assert decide.entered.wait(5)
    threads, results = submit_all(batcher, list(range(1, 9)))
    eventually(lambda: batcher.queued == 8)
    decide.hold.set()
    for thread in [*first, *threads]:
        thread.join(10)
    assert decide.batches[0] == [0]
    assert sorted(decide.batches[1]) == list(range(1, 9))
    assert {**first_results, **results} == {i: i * 10 for i in range(9)}


def test_a_batch_never_exceeds_max_batch_and_keeps_arrival_order() -> None:
    decide = Recorder()
    decide.hold.clear()
    batcher = MicroBatcher(decide, max_batch=3)
    first, _ = submit_all(batcher, [100])
    assert decide.entered.wait(5)
    threads = []
    for item in range(7):  # one at a time, so the queue order is known
        threads += submit_all(batcher, [item])[0]
        eventually(lambda n=item + 1: batcher.queued == n)
    decide.hold.set()
    for thread in [*first, *threads]:
        thread.join(10)
    assert decide.batches[1:] == [[0, 1, 2], [3, 4, 5], [6]]
    assert batcher.stats.largest == 3


def test_an_exception_result_fails_only_its_own_caller() -> None:
    decide = Recorder(result=lambda x: ValueError(f"bad {x}") if x == 2 else x)
    decide.hold.clear()
    batcher = MicroBatcher(decide, max_batch=8)
    first, _ = submit_all(batcher, [0])
    assert decide.entered.wait(5)
    threads, results = submit_all(batcher, [1, 2, 3])
    eventually(lambda: batcher.queued == 3)
    decide.hold.set()
    for thread in [*first, *threads]:
        thread.join(10)
    assert results[1] == 1 and results[3] == 3
    assert isinstance(results[2], ValueError) and str(results[2]) == "bad 2"


def test_a_failing_decide_fails_every_caller_of_that_batch_and_the_batcher_goes_on() -> None:
    calls = []

    def decide(items: list[int]) -> list[int]:
        calls.append(items)
        if len(calls) == 1:
            raise RuntimeError("broken batch")
        return items

    batcher = MicroBatcher(decide, max_batch=4)
    with pytest.raises(RuntimeError, match="broken batch"):
        batcher.submit(1)
    assert batcher.submit(2) == 2


def test_a_leader_that_fails_before_deciding_its_own_item_leaves_the_batcher_usable() -> None:
    """`expected()` raising inside the leader's wait: that caller gets the error, and the
    next caller leads (it is not handed to the departed one, which would hang everyone)."""
    failures = [1]

    def expected() -> int:
        if failures and failures.pop():
            raise RuntimeError("in-flight count unavailable")
        return 0

    batcher = MicroBatcher(Recorder(), max_batch=4, max_wait_s=1.0, expected=expected)
    with pytest.raises(RuntimeError, match="in-flight count unavailable"):
        batcher.submit(1)
    assert batcher.queued == 0
    threads, results = submit_all(batcher, [2])
    threads[0].join(5)
    assert results == {2: 20}


def test_the_leader_waits_for_more_while_more_are_in_flight() -> None:
    decide = Recorder()
    in_flight = [2]
    batcher = MicroBatcher(decide, max_batch=8, max_wait_s=30.0, expected=lambda: in_flight[0])
    threads, results = submit_all(batcher, [1])
    eventually(lambda: batcher.queued == 1)
    threads += submit_all(batcher, [2])[0]
    for thread in threads:
        thread.join(10)
    assert decide.batches == [[1, 2]]
    assert batcher.stats.waited == 1


class CountingCondition(threading.Condition):
    """A condition that counts its notifications (how often a waiting leader is woken)."""

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__(lock)
        self.notified = 0

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        super().notify(n)


def test_a_waiting_leader_is_woken_only_when_its_batch_can_close() -> None:
    decide = Recorder()
    batcher = MicroBatcher(decide, max_batch=4, max_wait_s=30.0, expected=lambda: 100)
    arrival = CountingCondition(batcher._lock)
    batcher._arrival = arrival
    threads, _ = submit_all(batcher, [1])
    eventually(lambda: batcher.queued == 1)
    for item in (2, 3):
        threads += submit_all(batcher, [item])[0]
        eventually(lambda item=item: batcher.queued == item)
    assert arrival.notified == 0  # more are expected and the batch is not full: the leader sleeps on
    threads += submit_all(batcher, [4])[0]
    for thread in threads:
        thread.join(10)
    assert decide.batches == [[1, 2, 3, 4]]  # the fourth filled the batch: decided long before max_wait
    assert arrival.notified == 1


def test_a_closed_batcher_refuses_new_items() -> None:
    batcher = MicroBatcher(Recorder(), max_batch=2)
    batcher.close()
    with pytest.raises(BatcherClosed):
        batcher.submit(1)


@pytest.mark.parametrize("kwargs", [{"max_batch": 0}, {"max_wait_s": -1.0}])
def test_bad_settings_are_refused_with_their_name(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        MicroBatcher(Recorder(), **kwargs)


def test_many_threads_each_get_their_own_answer() -> None:
    batcher = MicroBatcher(lambda items: [x * x for x in items], max_batch=16, max_wait_s=0.0005,
                           expected=lambda: 64)
    threads, results = submit_all(batcher, list(range(200)))
    for thread in threads:
        thread.join(20)
    assert results == {i: i * i for i in range(200)}
    assert batcher.stats.items == 200


def test_the_leader_waits_only_while_patient_says_the_wait_is_free() -> None:
    decide = Recorder()
    free = [False]
    batcher = MicroBatcher(decide, max_batch=8, max_wait_s=30.0, expected=lambda: 2,
                           patient=lambda items: free[0])
    assert batcher.submit(1) == 10  # more are in flight, but a wait is not free: decided at once
    assert batcher.stats.waited == 0
    free[0] = True
    threads, results = submit_all(batcher, [2])
    eventually(lambda: batcher.queued == 1)  # the leader waits for the second one in flight
    threads += submit_all(batcher, [3])[0]
    for thread in threads:
        thread.join(10)
    assert decide.batches == [[1], [2, 3]]
    assert batcher.stats.waited == 1


def test_an_item_that_may_not_wait_ends_the_leaders_wait() -> None:
    decide = Recorder()
    batcher = MicroBatcher(decide, max_batch=8, max_wait_s=30.0, expected=lambda: 100,
                           patient=lambda items: all(item < 10 for item in items))
    started = time.monotonic()
    threads, results = submit_all(batcher, [1])
    eventually(lambda: batcher.queued == 1)
    threads += submit_all(batcher, [99])[0]  # say, of the latency class
    for thread in threads:
        thread.join(10)
    assert decide.batches == [[1, 99]]
    assert time.monotonic() - started < 10  # long before max_wait
    assert batcher.submit(98) == 980  # alone, it does not wait for the 100 in flight either
    assert decide.batches[-1] == [98]
