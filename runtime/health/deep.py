"""Deep health: SERVING only while the model can run a tiny forward on its device in time.

Liveness (the process answers) is not readiness: a process whose GPU has failed still
answers health checks. `DeepHealth` runs the servicer's `health_probe()` (one tiny forward,
see `InferenceService.health_probe`) every `interval_s` in a worker thread and waits at
most `timeout_s` for it; the gRPC health status of the process follows:

* the probe returns in time            → SERVING
* the probe raises, or is still running → NOT_SERVING (a hung probe is not restarted
  until it returns, so a stuck device costs one thread, not one per interval)

A servicer without `health_probe` is healthy while its process is: liveness is all it has.
In a gateway's process the model's deep health publishes nothing itself (`services=()`):
`GatewayHealth` (runtime/health/gateway.py) reads `serving` and is told of each change
(`on_change`), and reports the gateway from every component's health.
The status starts NOT_SERVING and turns SERVING after the first good probe, so a supervisor
that waits for SERVING (spine/supervisor.py) waits for a model that can run.

Wiring (one call after `start_server`):

    deep = start_deep_health(running, servicer, interval_s=1.0, timeout_s=2.0,
                             services=["", "spine.v1.Inference"])
    ...
    deep.stop()
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from runtime.health.watch import Rounds
from runtime.server import ServerHandle

log = logging.getLogger("spine.health")

Probe = Callable[[], None]


class DeepHealth:
    """Probes every `interval_s`; sets `services` SERVING or NOT_SERVING on the running server."""

    def __init__(self, running: ServerHandle, probe: Probe | None, *, interval_s: float = 1.0,
                 timeout_s: float = 2.0, services: Sequence[str] = ("",),
                 on_change: Callable[[], None] | None = None) -> None:
        self.running = running
        self.on_change = on_change
        self.probe = probe
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.services = tuple(services)
        self.serving: bool | None = None
        self.reason = "not probed yet"
        self._inflight: threading.Thread | None = None
        self._rounds = Rounds(self.check_once, interval_s, "deep-health", join_s=interval_s + timeout_s + 1.0)

    def check_once(self) -> bool:
        """Run one probe within the time bound, publish the result and return it."""
        healthy, reason = self._probe()
        self._publish(healthy, reason)
        return healthy

    def start(self) -> DeepHealth:
        self._publish(False, "not probed yet")
        self.check_once()
        self._rounds.start()
        return self

    def stop(self) -> None:
        self._rounds.stop()

    def _probe(self) -> tuple[bool, str]:
        if self.probe is None:
            return True, "no model: liveness only"
        if self._inflight is not None and self._inflight.is_alive():
            return False, f"the previous health forward has not finished after more than {self.timeout_s}s"
        outcome: list[BaseException | None] = []
        probe = self.probe

        def run() -> None:
            try:
                probe()
                outcome.append(None)
            except BaseException as error:  # any failure of the forward means "cannot serve"
                outcome.append(error)

        self._inflight = threading.Thread(target=run, name="deep-health-probe", daemon=True)
        self._inflight.start()
        self._inflight.join(self.timeout_s)
        if self._inflight.is_alive():
            return False, f"health forward did not finish within {self.timeout_s}s"
        error = outcome[0] if outcome else RuntimeError("probe ended without a result")
        if error is not None:
            return False, f"health forward failed: {type(error).__name__}: {error}"
        return True, "model forward ok"

    def _publish(self, healthy: bool, reason: str) -> None:
        changed = healthy != self.serving
        if changed and self.services:  # without services, whoever reads `serving` tells the flip
            level = logging.INFO if healthy else logging.WARNING
            log.log(level, "%s: %s (%s)", self.running.address, "SERVING" if healthy else "NOT_SERVING", reason)
        self.serving, self.reason = healthy, reason
        for service in self.services:
            self.running.set_serving(healthy, service)
        if changed and self.on_change is not None:
            self.on_change()


def start_deep_health(running: ServerHandle, servicer: Any, interval_s: float = 1.0, timeout_s: float = 2.0,
                      services: Sequence[str] = ("",), on_change: Callable[[], None] | None = None) -> DeepHealth:
    """Deep health for `servicer` on `running` (first probe done before it returns)."""
    probe = getattr(servicer, "health_probe", None)
    return DeepHealth(running, probe if callable(probe) else None, interval_s=interval_s,
                      timeout_s=timeout_s, services=services, on_change=on_change).start()


def check_serving(channel: grpc.Channel, timeout: float = 0.5, service: str = "") -> bool | None:
    """True/False for SERVING/other, None when the process does not answer at all."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=timeout)
    except grpc.RpcError:
        return None
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
