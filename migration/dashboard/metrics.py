"""The controller's own /metrics: where it stands, read at scrape time, for alert rules.

Everything is read from the controller when Prometheus scrapes (no counter is kept in
memory that a restart would reset): the transition counts come from the durable audit
trail, so `increase(spine_migration_transitions_total{to_state="rolled_back"}[15m])` sees a
rollback even across a controller restart. Every state's series is exported from the
start (0 until one happens), so `increase()` never misses the first rollback of a series
born with it. `deploy/prometheus/spine-rules.yml` alerts on these families.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from migration.controller import Controller
from migration.status import State

# Trailing inconclusive windows of one gate in the current stage: counted back this far at most.
INCONCLUSIVE_LOOKBACK = 200


def inconclusive_streaks(records: list[tuple[str, str]]) -> dict[str, int]:
    """Per gate, how many of its latest windows in a row were inconclusive, from
    (gate, verdict) pairs oldest first."""
    streaks: dict[str, int] = {}
    for gate, verdict in records:
        streaks[gate] = streaks.get(gate, 0) + 1 if verdict == "inconclusive" else 0
    return streaks


class ControllerCollector(Collector):
    """spine_migration_* families; `deliveries` adds the webhooks' counts (endpoint -> result -> n)."""

    def __init__(self, controller: Controller,
                 deliveries: Callable[[], Mapping[str, Mapping[str, int]]] | None = None) -> None:
        self._controller = controller
        self._deliveries = deliveries

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        view = self._controller.view(audit_rows=1)
        s = view.status
        plan = s.plan_name
        state = GaugeMetricFamily("spine_migration_state", "1 for the rollout's current state, 0 for the others.",
                                  labels=["plan", "state"])
        for candidate in State:
            state.add_metric([plan, str(candidate)], 1.0 if s.state is candidate else 0.0)
        yield state
        yield _gauge("spine_migration_stage_index", "The current stage, counted from 0.", plan, s.stage_index)
        yield _gauge("spine_migration_spine_weight_percent", "Traffic share sent to the spine.", plan, s.spine_weight)
        yield _gauge("spine_migration_applied", "1 once the data path ACKed the version published last.",
                     plan, 1.0 if s.acked else 0.0)
        yield _gauge("spine_migration_consecutive_failed_windows", "Failing gate windows in a row in this stage.",
                     plan, s.consecutive_failures)
        counts = self._controller.store.transition_counts()
        transitions = CounterMetricFamily("spine_migration_transitions", "Transitions into each state (audit trail).",
                                          labels=["to_state"])
        for candidate in State:
            transitions.add_metric([str(candidate)], float(counts.get(str(candidate), 0)))
        yield transitions
        yield from self._gates(view.stage.name if view.stage else "")
        yield from self._data_planes(s.version, view.data_planes, view.followers)
        if view.leadership is not None:  # several replicas on one store (migration.leadership)
            lead = view.leadership
            leading = GaugeMetricFamily("spine_migration_leader",
                                        "1 while this controller replica leads under the lease, else 0.",
                                        labels=["controller"])
            leading.add_metric([lead.controller], 1.0 if lead.leading else 0.0)
            yield leading
            yield GaugeMetricFamily("spine_migration_lease_epoch", "The leader lease's current epoch (the fencing "
                                    "token: one more at every change of hands).", value=float(lead.epoch))
            yield CounterMetricFamily("spine_migration_fenced_writes", "State writes this replica attempted that "
                                      "the lease's fence refused (it no longer led).", value=float(lead.fenced_writes))
        if self._deliveries is not None:
            deliveries = CounterMetricFamily("spine_migration_webhook_deliveries",
                                             "Webhook deliveries by result (delivered, retried, failed, dropped).",
                                             labels=["endpoint", "result"])
            for endpoint, results in self._deliveries().items():
                for result, count in results.items():
                    deliveries.add_metric([endpoint, result], float(count))
            yield deliveries

    def _gates(self, stage: str) -> Iterator[GaugeMetricFamily]:
        value = GaugeMetricFamily("spine_migration_gate_value", "A gate's measured value in its latest window.",
                                  labels=["stage", "gate"])
        threshold = GaugeMetricFamily("spine_migration_gate_threshold", "A gate's threshold.",
                                      labels=["stage", "gate"])
        streak = GaugeMetricFamily("spine_migration_gate_inconclusive_windows",
                                   "A gate's latest windows in a row that were inconclusive, in the current stage.",
                                   labels=["stage", "gate"])
        records = [r for r in self._controller.store.gate_history(INCONCLUSIVE_LOOKBACK) if r.stage == stage]
        latest = {r.gate: r for r in records}
        for gate, count in inconclusive_streaks([(r.gate, r.verdict) for r in records]).items():
            streak.add_metric([stage, gate], float(count))
            threshold.add_metric([stage, gate], latest[gate].threshold)
            if latest[gate].value is not None:
                value.add_metric([stage, gate], float(latest[gate].value))  # type: ignore[arg-type]
        yield from (value, threshold, streak)

    @staticmethod
    def _data_planes(version: str, planes: tuple[dict[str, object], ...],
                     followers: tuple[dict[str, object], ...]) -> Iterator[GaugeMetricFamily]:
        acked = GaugeMetricFamily("spine_migration_data_plane_acked",
                                  "1 when the data plane (Envoy, proxyless client) ACKed the version published last.",
                                  labels=["node_id", "type"])
        for plane in planes:
            acked.add_metric([str(plane["node_id"]), str(plane["type"])],
                             1.0 if plane.get("acked_version") == version else 0.0)
        following = GaugeMetricFamily("spine_migration_follower_acked",
                                      "1 when the follower (spine replica, rate limiter) applied the stage published last.",
                                      labels=["node_id", "role"])
        for follower in followers:
            mine = str(follower.get("acked_version") or "")
            following.add_metric([str(follower["node_id"]), str(follower["role"])],
                                 1.0 if mine == version or mine.startswith(f"{version}+m") else 0.0)
        yield from (acked, following)


def _gauge(name: str, help_text: str, plan: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=["plan"])
    family.add_metric([plan], float(value))
    return family
