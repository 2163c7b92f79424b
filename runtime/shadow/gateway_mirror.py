"""Scientist inside the spine: it mirrors a share of its own answers to the layered side.

Behind Envoy (or proxyless gRPC clients) no built-in front sees both sides' answers, so the
spine compares them itself. With `shadow.layered_address` (and `share` > 0) in its config,
its gateway hands every finished request to a `ShadowMirror` (its `AnswerTaps`); a share
of them is sent again, after the client has its answer and on the mirror's own pool, to the
layered gateway — marked with the deployment's internal secret, so the layered side only
dry-runs it (no rate-limit budget spent, nothing cached, counted apart) — and the two
answers are compared. `calibration_share` of the copies go back to the spine's own address
instead, to learn what a layout disagrees with itself on.

The comparisons are counted in the spine's own metrics registry, so its /metrics serves
`spine_shadow_compared_total` and `spine_shadow_mismatched_total` beside its request
metrics, where Prometheus (or the controller's direct scrape) already reads them. That
needs the metrics component placed local, as in the collapsed layout.

A streamed answer is mirrored as one `Generate` call: the decision compared is the same
(status, route, tokens). A request the client cancelled, or a copy itself, is never mirrored.
"""

from __future__ import annotations

from typing import Any

import grpc

from runtime.config.file import internal_key
from runtime.config.model import SpineConfig
from runtime.config.sections import ShadowConfig, TlsConfig
from runtime.shadow.decisions import Decision, decide
from runtime.shadow.metrics import ShadowCounters
from runtime.shadow.traffic import ShadowMirror, forward_metadata, gateway_call
from runtime.tls import link_channel, self_channel
from services.common import ConfigError
from services.gateway.steps import AnswerTaps
from services.pipeline.state import RequestState
from wire.v1 import gateway_pb2_grpc

SIDES = ("layered", "spine")


class GatewayMirror:
    """The spine's mirror: offered every answered request, compares with the layered side."""

    def __init__(self, config: ShadowConfig, key: bytes, own_address: str, layered_address: str,
                 registry: Any | None = None, tls: TlsConfig | None = None) -> None:
        self.channels: dict[str, grpc.Channel] = {"spine": self_channel(own_address, tls),
                                                  "layered": link_channel(layered_address, tls)}
        stubs = {side: gateway_pb2_grpc.GatewayStub(channel) for side, channel in self.channels.items()}
        self.mirror = ShadowMirror(config, gateway_call(stubs), SIDES, key=key, primaries=("spine",))
        self.layered_address = layered_address
        self._registry = registry
        if registry is not None:  # the spine's /metrics serves the comparisons
            registry.register(self.mirror.counters)

    @property
    def counters(self) -> ShadowCounters:
        return self.mirror.counters

    def offer(self, state: RequestState) -> None:
        """The gateway's `answered` hook: a coin flip, and for the chosen few a pool submit."""
        if state.shadow or state.status == "CANCELLED":
            return
        try:
            self.mirror.offer("spine", state.request, forward_metadata(state.metadata), lambda: _decision(state),
                              request_id=state.request_id)
        except Exception:  # the mirror must never cost a client its answer
            return

    def close(self) -> None:
        self.mirror.close()
        if self._registry is not None:
            self._registry.unregister(self.mirror.counters)
            self._registry = None
        for channel in self.channels.values():
            channel.close()


def _decision(state: RequestState) -> Decision:
    answer = state.hit if state.hit is not None else state.response
    if state.status == "OK" and answer is not None:
        return decide(state.request, state.status, response=answer)
    return decide(state.request, state.status, state.details)


def start_gateway_mirror(config: SpineConfig, answered: AnswerTaps, own_address: str,
                         metrics: Any | None) -> GatewayMirror | None:
    """The spine's mirror, offered the gateway's answers (`answered`), when its config asks for one (else None).

    `metrics`: the local metrics servicer, whose registry /metrics serves. Refused
    (ConfigError, naming the fix) without the internal secret, or with metrics remote."""
    shadow = config.shadow
    if shadow.layered_address is None or shadow.share <= 0:
        return None
    key = internal_key(config)
    if key is None:
        raise ConfigError("shadow.layered_address: mirroring to the layered side needs the deployment's internal "
                          "secret (internal.secret or internal.secret_env), shared with the layered gateway; "
                          "without it the copies would spend rate-limit budget and fill the cache there")
    if metrics is None:
        raise ConfigError("shadow.layered_address: the spine exports its shadow comparisons on its own /metrics, "
                          "which needs the metrics component placed local (placements.metrics: local)")
    mirror = GatewayMirror(shadow, key, own_address, shadow.layered_address, metrics.registry,
                           tls=config.tls)
    answered.add(mirror.offer)
    return mirror
