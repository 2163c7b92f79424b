"""Shadow comparisons as Prometheus counters, exported by whoever mirrors.

The built-in front and the spine's own gateway (`runtime.shadow.gateway_mirror`) both
mirror through a `ShadowMirror`, which counts every comparison here. The migration's
parity gate reads these families through its metrics source (PromQL or a direct scrape,
`migration.metrics`), never the mirror's memory, so a gate reads the same numbers in the
local demo and behind Envoy:

- `spine_shadow_compared_total{primary, shadow, calibration}`: pairs of answers compared.
  `primary` is the side that answered the client, `shadow` the side the copy went to;
  `calibration="true"` when the copy went back to the primary's own side (a layout
  compared with itself: what differs there is noise, not a verdict on the spine).
- `spine_shadow_mismatched_total{field, primary, shadow, calibration}`: compared pairs that
  differed, one count per field that differed as a cause (`decisions.root_differences`:
  a pair one side rate limited counts under `ratelimit` only, not under the status,
  route and tokens that differ because of it), so a pair that differs in two unrelated
  fields counts once under each.
- `spine_shadow_skipped_total{primary, shadow, calibration, reason}`: copies that were not
  compared: `saturated` (the mirror's pool was full: dropped, never queued),
  `call_failed` (the shadow call raised), `layout_error` (one of the two answers was a
  layout failure such as UNAVAILABLE: the error-rate gate judges those, and a copy that
  timed out says nothing about what the other side would have answered).

The collector keeps plain counts under a lock (one dict update per comparison) and builds
the families at scrape time, like `services.metrics.service.TableCollector`. It can be registered
on any registry: the spine's own metrics registry (its `/metrics`), or `registry`, its own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

COMPARED = "spine_shadow_compared_total"
MISMATCHED = "spine_shadow_mismatched_total"
SKIPPED = "spine_shadow_skipped_total"
SKIP_REASONS = ("saturated", "call_failed", "layout_error")

_FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    COMPARED: ("Mirrored answers compared with the primary's.", ("primary", "shadow", "calibration")),
    MISMATCHED: ("Compared answers that differed, one count per field that differed as a cause.",
                 ("field", "primary", "shadow", "calibration")),
    SKIPPED: ("Mirrored requests not compared, by reason.", ("primary", "shadow", "calibration", "reason")),
}


def _flag(calibration: bool) -> str:
    return "true" if calibration else "false"


class ShadowCounters(Collector):
    """The shadow families of one mirror; `collect()` is what a scrape reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, tuple[str, ...]], float] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self)

    def expect(self, pairs: Iterable[tuple[str, str]]) -> None:
        """Export `compared` at 0 for each (primary, shadow) pair the mirror may produce, so
        a scrape shows the mirror is on before its first comparison."""
        with self._lock:
            for primary, shadow in pairs:
                self._counts.setdefault((COMPARED, (primary, shadow, _flag(primary == shadow))), 0.0)

    def compared(self, primary: str, shadow: str, calibration: bool, fields: Iterable[str]) -> None:
        flag = _flag(calibration)
        keys: list[tuple[str, tuple[str, ...]]] = [(COMPARED, (primary, shadow, flag))]
        keys += [(MISMATCHED, (field, primary, shadow, flag)) for field in fields]
        with self._lock:
            for key in keys:
                self._counts[key] = self._counts.get(key, 0.0) + 1

    def skipped(self, primary: str, shadow: str, calibration: bool, reason: str) -> None:
        if reason not in SKIP_REASONS:
            raise ValueError(f"reason: expected one of {', '.join(SKIP_REASONS)}, got {reason!r}")
        key = (SKIPPED, (primary, shadow, _flag(calibration), reason))
        with self._lock:
            self._counts[key] = self._counts.get(key, 0.0) + 1

    def value(self, family: str, **labels: str) -> float:
        """The sum of `family`'s series whose labels match `labels` (tests, reports)."""
        names = _FAMILIES[family][1]
        with self._lock:
            items = [(values, count) for (name, values), count in self._counts.items() if name == family]
        return sum(count for values, count in items
                   if all(dict(zip(names, values, strict=True)).get(k) == v for k, v in labels.items()))

    def describe(self) -> Iterator[Metric]:
        yield from self._families().values()

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        with self._lock:
            items = sorted(self._counts.items())
        for (name, values), count in items:
            family = families[name]
            assert isinstance(family, CounterMetricFamily)
            family.add_metric(values, count)
        yield from families.values()

    @staticmethod
    def _families() -> dict[str, Metric]:
        return {name: CounterMetricFamily(name, text, labels=labels) for name, (text, labels) in _FAMILIES.items()}
