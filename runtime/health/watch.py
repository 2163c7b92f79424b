"""Asking many gRPC health services at once, each within a deadline, and watching them.

A process that is stopped (SIGSTOP), wedged or overloaded keeps its socket open and never
answers: only a deadline tells it apart from a slow one. `check_many` sends every check at
once and waits at most `timeout` for all of them (and as long again for those that missed
it), so one hung peer costs two deadlines per round, not two per peer. `HealthWatch` does that every `interval_s` for a set of named
addresses and reports each flip once: the migration front, the xDS endpoints and the A/B
tool use it on the gateways they send to; the gateway uses `check_many` on its components.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from runtime.config.sections import TlsConfig
from runtime.tls import link_channel
from services.common.thread_names import name_os_thread

log = logging.getLogger("spine.health")

SERVING = health_pb2.HealthCheckResponse.SERVING


def health_channel(address: str, tls: TlsConfig | None = None) -> grpc.Channel:
    """A channel for health checks: a peer that comes back is seen within a second (the
    default reconnect backoff grows to minutes). Over TLS with this process's certificate
    when it has `tls` and `address` is TCP (`runtime.tls.link_channel`)."""
    return link_channel(address, tls, options=[
        ("grpc.enable_retries", 0),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ])


def check_many(targets: Mapping[str, tuple[grpc.Channel, str]], timeout: float) -> dict[str, tuple[bool, str]]:
    """Ask each (channel, service) at once; per name, (serving, why).

    A peer that does not answer within `timeout` is asked once more at once, and counts as
    not serving only when it misses that deadline too: one answer late on a loaded machine
    does not flip anything, a stopped process is found within two deadlines. A NOT_SERVING
    answer or a refused connection counts at once.
    """
    answers = _ask(targets, timeout)
    late = {name: targets[name] for name, (_, why, answered) in answers.items() if not answered}
    if late:
        answers.update(_ask(late, timeout))
    return {name: (serving, why) for name, (serving, why, _) in answers.items()}


def _ask(targets: Mapping[str, tuple[grpc.Channel, str]], timeout: float) -> dict[str, tuple[bool, str, bool]]:
    """(serving, why, answered in time) per name, all asked at once."""
    pending = {}
    for name, (channel, service) in targets.items():
        stub = health_pb2_grpc.HealthStub(channel)
        pending[name] = stub.Check.future(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    answers: dict[str, tuple[bool, str, bool]] = {}
    for name, future in pending.items():
        try:
            reply = future.result()
        except grpc.RpcError as error:
            code = error.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                answers[name] = (False, f"no health answer within {timeout:g}s, twice", False)
            else:
                answers[name] = (False, f"health check failed: {code.name}", True)
            continue
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        answers[name] = (reply.status == SERVING, status, True)
    return answers


class Rounds:
    """Runs `one_round` every `interval_s` in a daemon thread until stopped; a round that
    raises is logged (one line) and the next one runs."""

    def __init__(self, one_round: Callable[[], object], interval_s: float, name: str, join_s: float) -> None:
        self.one_round = one_round
        self.interval_s = interval_s
        self.join_s = join_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.join_s)

    def _run(self) -> None:
        name_os_thread()
        while not self._stop.wait(self.interval_s):
            try:
                self.one_round()
            except Exception as error:  # keep watching; the next round asks again
                log.warning("%s round failed: %s: %s", self._thread.name, type(error).__name__, error)


class HealthWatch:
    """Watches the health (`service`, "" = the whole server) of named addresses.

    `serving[name]` is the last answer (True until the first round says otherwise);
    `on_change(serving)` runs after a round that changed any of them.
    """

    def __init__(self, addresses: Mapping[str, str], *, interval_s: float = 0.5, timeout_s: float = 0.5,
                 service: str = "", on_change: Callable[[dict[str, bool]], None] | None = None,
                 what: str = "endpoint", tls: TlsConfig | None = None) -> None:
        self.addresses = dict(addresses)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.service = service
        self.on_change = on_change
        self.what = what
        self.serving: dict[str, bool] = dict.fromkeys(self.addresses, True)
        self._channels = {name: health_channel(address, tls) for name, address in self.addresses.items()}
        self._lock = threading.Lock()
        self._rounds = Rounds(self.check_once, interval_s, f"{what}-health", join_s=interval_s + 2 * timeout_s + 2.0)

    def start(self) -> HealthWatch:
        self._rounds.start()
        return self

    def check_once(self) -> dict[str, bool]:
        """One round: ask every address, log each flip, tell `on_change`; the new state."""
        answers = check_many({name: (channel, self.service) for name, channel in self._channels.items()},
                             self.timeout_s)
        with self._lock:
            changed = False
            for name, (serving, why) in answers.items():
                if serving == self.serving.get(name):
                    continue
                changed = True
                if serving:
                    log.info("%s %s (%s) is SERVING again", self.what, name, self.addresses[name])
                else:
                    log.warning("%s %s (%s) is not serving: %s", self.what, name, self.addresses[name], why)
                self.serving[name] = serving
            now = dict(self.serving)
        if changed and self.on_change is not None:
            self.on_change(now)
        return now

    def stop(self) -> None:
        self._rounds.stop()
        for channel in self._channels.values():
            channel.close()
