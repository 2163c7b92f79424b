"""The built-in front: splits Gateway traffic between the layered stack and the spine.

Each request goes to the spine with the stage's weight, sticky on a request key (the
`x-session-id` header when present, else the credential) so one conversation stays on
one layout while the weight holds or grows. `x-spine-route: layered|spine` forces a side
(for testing). The side is chosen once, when a request arrives: a weight change or a
rollback never moves a request already in flight.

The front also keeps what the controller's gates read: per side, when each request
ended, whether the layout failed it, and how long it took. For the demo's like-for-like
comparison it also notes whether the model served the answer (OK and not `cached`: a
cache hit says nothing about the model's speed) and how many requests were in flight on
that side when it started, itself included (`SideWindow.p50_model_ms` and on). In shadow mode
(`runtime.shadow.traffic`) it mirrors a share of answered requests to the other side and
counts the comparisons in its mirror's counters (`runtime.shadow.metrics`), which
the local migration serves on the front's own /metrics for the parity gate
(`migration.traffic.cutover`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import grpc

from migration.traffic.outcomes import SIDES, Outcome, OutcomeLog, SideWindow
from migration.traffic.split import ROUTE_HEADER, SESSION_HEADER, checked_weight, sticky_side
from runtime.config.sections import ShadowConfig, TlsConfig
from runtime.shadow.decisions import LAYOUT_ERRORS as LAYOUT_ERROR_NAMES
from runtime.shadow.decisions import Decision, decide
from runtime.shadow.traffic import Metadata, ShadowMirror, forward_metadata, gateway_call
from runtime.tls import link_channel
from wire.v1 import gateway_pb2_grpc, generation_pb2

SIDE_HEADER = "x-spine-side"

# Codes that say the layout failed, as opposed to the client asking for something refused.
LAYOUT_ERRORS = frozenset(grpc.StatusCode[name] for name in LAYOUT_ERROR_NAMES)


class Front(gateway_pb2_grpc.GatewayServicer):
    """Serves the Gateway API by forwarding each call to one of two Gateway addresses."""

    def __init__(self, addresses: dict[str, str], spine_weight: float = 0.0, history: int = 100_000,
                 shadow: ShadowConfig | None = None, rng: random.Random | None = None,
                 internal_key: bytes | None = None, route_header: bool = True,
                 tls: TlsConfig | None = None) -> None:
        # With `tls` (the deployment's), each side's gateway is dialed over mTLS on TCP.
        self.channels = {side: link_channel(addresses[side], tls) for side in SIDES}
        self.stubs: dict[str, gateway_pb2_grpc.GatewayStub] = {side: gateway_pb2_grpc.GatewayStub(self.channels[side]) for side in SIDES}
        self.spine_weight = checked_weight(spine_weight)
        # Each side's gateway health (kept by migration.traffic.endpoint_health.EndpointHealth;
        # a gateway is SERVING only while its fail-closed components are): a request meant for
        # a side that is not SERVING goes to the other one, and counts as a failure of the
        # side it was meant for — so the gates see it and roll back, and no client does.
        self.healthy: dict[str, bool] = dict.fromkeys(SIDES, True)
        self.log = OutcomeLog(history)
        self.outcomes = self.log.outcomes  # what the gates read (`window`)
        # `x-spine-route` forces a side: an operator's tool, off where clients are not trusted.
        self.route_header = route_header
        if shadow is not None and internal_key is None:
            raise ValueError("shadow traffic needs the deployment's internal secret (internal.secret): "
                             "without it a shadow copy cannot be told from a client's request")
        self.shadow = (ShadowMirror(shadow, gateway_call(self.stubs), SIDES, key=internal_key, rng=rng)
                       if shadow is not None and internal_key is not None else None)

    def set_healthy(self, healthy: dict[str, bool]) -> None:
        """Each side's gateway health as last seen (`EndpointHealth`): a request meant for an
        unhealthy side goes to the other while that one is healthy."""
        self.healthy = healthy

    def honour_route_header(self, honoured: bool) -> None:
        """Whether a client's `x-spine-route` may force a side (the plan's `route_header`)."""
        self.route_header = honoured

    def set_weight(self, spine_weight: float) -> None:
        self.spine_weight = checked_weight(spine_weight)

    def choose(self, metadata: dict[str, str]) -> str:
        forced = metadata.get(ROUTE_HEADER, "") if self.route_header else ""
        if forced in SIDES:
            return forced
        key = metadata.get(SESSION_HEADER) or metadata.get("authorization", "")
        return sticky_side(key, self.spine_weight)

    def route(self, metadata: dict[str, str]) -> str:
        """`choose`, then fail over from a side that is not SERVING (unless the side is forced)."""
        side = self.choose(metadata)
        other = "layered" if side == "spine" else "spine"
        forced = self.route_header and metadata.get(ROUTE_HEADER) == side
        if self.healthy.get(side, True) or not self.healthy.get(other, True) or forced:
            return side
        self.log.add(Outcome(time.time(), side, True, 0.0))
        return other

    # -- the Gateway API -------------------------------------------------------------
    def Generate(self, request: generation_pb2.GenerateRequest, context: Any) -> generation_pb2.GenerateResponse:
        metadata = tuple(context.invocation_metadata())
        side = self.route(dict(metadata))
        started = time.perf_counter()
        in_flight = self._enter(side)
        response: generation_pb2.GenerateResponse
        try:
            try:
                response, call = self.stubs[side].Generate.with_call(
                    request, timeout=_remaining(context), metadata=forward_metadata(metadata))
            except grpc.RpcError as error:
                self._record(side, started, error.code(), in_flight)
                trailing = tuple(error.trailing_metadata() or ())
                context.set_trailing_metadata(trailing + ((SIDE_HEADER, side),))
                self._offer_shadow(side, request, metadata, trailing,
                                   decide(request, error.code(), error.details() or ""))
                context.abort(error.code(), error.details())
            self._record(side, started, grpc.StatusCode.OK, in_flight, cached=response.cached)
        finally:
            self._leave(side)
        trailing = tuple(call.trailing_metadata() or ())
        context.set_trailing_metadata(trailing + ((SIDE_HEADER, side),))
        self._offer_shadow(side, request, metadata, trailing, decide(request, grpc.StatusCode.OK, response=response))
        return response

    def GenerateStream(self, request: generation_pb2.GenerateRequest,
                       context: Any) -> Iterator[generation_pb2.GenerateChunk]:
        metadata = tuple(context.invocation_metadata())
        side = self.route(dict(metadata))
        started = time.perf_counter()
        in_flight = self._enter(side)
        try:
            call = self.stubs[side].GenerateStream(request, timeout=_remaining(context),
                                                   metadata=forward_metadata(metadata))
            context.add_callback(call.cancel)
            chunks: list[generation_pb2.GenerateChunk] = []
            cached: bool | None = None  # the first chunk says
            try:
                for chunk in call:
                    if cached is None:
                        cached = chunk.cached
                    if self.shadow is not None:
                        chunks.append(chunk)
                    yield chunk
            except grpc.RpcError as error:
                self._record(side, started, error.code(), in_flight)
                trailing = tuple(call.trailing_metadata() or ())
                context.set_trailing_metadata(trailing + ((SIDE_HEADER, side),))
                self._offer_shadow(side, request, metadata, trailing,
                                   decide(request, error.code(), error.details() or ""), stream=True)
                context.abort(error.code(), error.details())
            self._record(side, started, grpc.StatusCode.OK, in_flight, cached=bool(cached))
        finally:
            self._leave(side)
        trailing = tuple(call.trailing_metadata() or ())
        context.set_trailing_metadata(trailing + ((SIDE_HEADER, side),))
        self._offer_shadow(side, request, metadata, trailing, decide(request, grpc.StatusCode.OK, chunks=chunks),
                           stream=True)

    # -- shadow mode -------------------------------------------------------------------
    def _offer_shadow(self, side: str, request: generation_pb2.GenerateRequest, metadata: Metadata,
                      trailing: Any, decision: Decision, stream: bool = False) -> None:
        """Hand an answered request to the mirror (cheap: a coin flip and a pool submit)."""
        if self.shadow is None:
            return
        request_id = dict(trailing).get("x-request-id", "")
        forwarded = forward_metadata(metadata)
        if request_id and "x-request-id" not in dict(forwarded):
            forwarded += (("x-request-id", request_id),)  # the shadow's log line joins the primary's
        self.shadow.offer(side, request, forwarded, decision, stream=stream, request_id=request_id)

    def set_shadow_share(self, share: float) -> None:
        """Change the mirrored share at run time (a ramp, as in Scientist)."""
        if self.shadow is None:
            raise ValueError("shadow mode is off: construct the front with a ShadowConfig")
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"shadow share: must be between 0 and 1, got {share}")
        self.shadow.set_share(share)

    # -- what the gates read -----------------------------------------------------------
    def _enter(self, side: str) -> int:
        """Count a request in flight on `side`; how many are, itself included."""
        return self.log.enter(side)

    def _leave(self, side: str) -> None:
        self.log.leave(side)

    def _record(self, side: str, started: float, code: grpc.StatusCode, in_flight: int = 0,
                cached: bool = False) -> None:
        ok = code == grpc.StatusCode.OK
        self.log.add(Outcome(time.time(), side, code in LAYOUT_ERRORS, (time.perf_counter() - started) * 1000.0,
                             ok, model=ok and not cached, in_flight=in_flight))

    def window(self, since: float) -> dict[str, SideWindow]:
        """Per side, what the gates and the demo read (`OutcomeLog.window`)."""
        return self.log.window(since)

    def close(self) -> None:
        if self.shadow is not None:
            self.shadow.close()
        for channel in self.channels.values():
            channel.close()


def _remaining(context: Any) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e6 else max(remaining, 0.001)


__all__ = ["SIDES", "Front", "Outcome", "SideWindow"]
