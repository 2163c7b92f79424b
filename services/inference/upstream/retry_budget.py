"""A retry budget per upstream: retries stay a fraction of the requests, so a failing upstream
never gets a storm of them.

Finagle's and Envoy's rule: over the last `window_s` seconds, retries may be at most
`ratio` of the requests sent plus `min_per_s` per second (so a quiet upstream can still be
retried). When an upstream fails every request, the traffic it sees is at most
(1 + ratio) of the offered load instead of (1 + retries) times it. Counted in one-second
buckets, so the cost is a few integer operations per call whatever the rate.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class RetryBudget:
    def __init__(self, ratio: float, min_per_s: float, window_s: int = 10,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ratio = ratio
        self.min_per_s = min_per_s
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seconds = [-1] * window_s  # which second each bucket holds
        self._requests = [0] * window_s
        self._retries = [0] * window_s
        self.refused = 0  # retries the budget did not allow

    def _bucket(self, now: float) -> int:
        second = int(now)
        at = second % self.window_s
        if self._seconds[at] != second:
            self._seconds[at], self._requests[at], self._retries[at] = second, 0, 0
        return at

    def _totals(self, now: float) -> tuple[int, int]:
        oldest = int(now) - self.window_s
        live = [i for i, second in enumerate(self._seconds) if second > oldest]
        return sum(self._requests[i] for i in live), sum(self._retries[i] for i in live)

    def request(self) -> None:
        """A first attempt was sent (deposits `ratio` of a retry)."""
        with self._lock:
            self._requests[self._bucket(self._clock())] += 1

    def try_retry(self) -> bool:
        """Whether one more retry fits the budget now (and, if so, it is counted)."""
        with self._lock:
            now = self._clock()
            at = self._bucket(now)
            requests, retries = self._totals(now)
            if retries + 1 > requests * self.ratio + self.min_per_s * self.window_s:
                self.refused += 1
                return False
            self._retries[at] += 1
            return True
