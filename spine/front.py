"""The built-in front: splits Gateway traffic between the layered stack and the spine.

Each request goes to the spine with the stage's weight, sticky on a request key (the
`x-session-id` header when present, else the credential) so one conversation stays on
one layout while the weight holds or grows. `x-spine-route: layered|spine` forces a side
(for testing). The side is chosen once, when a request arrives: a weight change or a
rollback never moves a request already in flight.

The front also keeps what the controller's gates read: per side, when each request
ended, whether the layout failed it, and how long it took.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from spine.stats import percentile
from spine.v1 import gateway_pb2_grpc, generation_pb2

SIDES = ("layered", "spine")
ROUTE_HEADER = "x-spine-route"
SESSION_HEADER = "x-session-id"
SIDE_HEADER = "x-spine-side"

# Codes that say the layout failed, as opposed to the client asking for something refused.
LAYOUT_ERRORS = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                           grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.DATA_LOSS})


@dataclass(frozen=True)
class Outcome:
    ended_at: float  # time.time()
    side: str
    failed: bool
    latency_ms: float


@dataclass(frozen=True)
class SideWindow:
    requests: int
    errors: int
    p99_ms: float


class Front(gateway_pb2_grpc.GatewayServicer):
    """Serves the Gateway API by forwarding each call to one of two Gateway addresses."""

    def __init__(self, addresses: dict[str, str], spine_weight: float = 0.0, history: int = 100_000) -> None:
        self.channels = {side: grpc.insecure_channel(addresses[side]) for side in SIDES}
        self.stubs = {side: gateway_pb2_grpc.GatewayStub(self.channels[side]) for side in SIDES}
        self.spine_weight = spine_weight
        self.outcomes: deque[Outcome] = deque(maxlen=history)
        self._lock = threading.Lock()

    def set_weight(self, spine_weight: float) -> None:
        if not 0.0 <= spine_weight <= 100.0:
            raise ValueError(f"spine_weight: must be between 0 and 100, got {spine_weight}")
        self.spine_weight = spine_weight

    def choose(self, metadata: dict[str, str]) -> str:
        forced = metadata.get(ROUTE_HEADER, "")
        if forced in SIDES:
            return forced
        key = metadata.get(SESSION_HEADER) or metadata.get("authorization", "")
        bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % 10_000
        return "spine" if bucket < self.spine_weight * 100 else "layered"

    # -- the Gateway API -------------------------------------------------------------
    def Generate(self, request: generation_pb2.GenerateRequest, context: Any) -> generation_pb2.GenerateResponse:
        metadata = tuple(context.invocation_metadata())
        side = self.choose(dict(metadata))
        started = time.perf_counter()
        try:
            response, call = self.stubs[side].Generate.with_call(
                request, timeout=_remaining(context), metadata=_forward(metadata))
        except grpc.RpcError as error:
            self._record(side, started, error.code())
            context.set_trailing_metadata(tuple(error.trailing_metadata() or ()) + ((SIDE_HEADER, side),))  # type: ignore[attr-defined]
            context.abort(error.code(), error.details())
        self._record(side, started, grpc.StatusCode.OK)
        context.set_trailing_metadata(tuple(call.trailing_metadata() or ()) + ((SIDE_HEADER, side),))
        return response

    def GenerateStream(self, request: generation_pb2.GenerateRequest,
                       context: Any) -> Iterator[generation_pb2.GenerateChunk]:
        metadata = tuple(context.invocation_metadata())
        side = self.choose(dict(metadata))
        started = time.perf_counter()
        call = self.stubs[side].GenerateStream(request, timeout=_remaining(context), metadata=_forward(metadata))
        context.add_callback(call.cancel)
        try:
            yield from call
        except grpc.RpcError as error:
            self._record(side, started, error.code())
            context.set_trailing_metadata(tuple(call.trailing_metadata() or ()) + ((SIDE_HEADER, side),))
            context.abort(error.code(), error.details())
        self._record(side, started, grpc.StatusCode.OK)
        context.set_trailing_metadata(tuple(call.trailing_metadata() or ()) + ((SIDE_HEADER, side),))

    # -- what the gates read -----------------------------------------------------------
    def _record(self, side: str, started: float, code: grpc.StatusCode) -> None:
        outcome = Outcome(time.time(), side, code in LAYOUT_ERRORS, (time.perf_counter() - started) * 1000.0)
        with self._lock:
            self.outcomes.append(outcome)

    def window(self, since: float) -> dict[str, SideWindow]:
        """Requests, layout errors and p99 latency per side for requests ended since `since`."""
        with self._lock:
            recent = [o for o in self.outcomes if o.ended_at >= since]
        result = {}
        for side in SIDES:
            mine = [o for o in recent if o.side == side]
            latencies = [o.latency_ms for o in mine]
            result[side] = SideWindow(len(mine), sum(o.failed for o in mine),
                                      percentile(latencies, 99) if latencies else 0.0)
        return result

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()


def _forward(metadata: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """Pass the caller's metadata on, less what the front itself consumes."""
    return tuple((k, v) for k, v in metadata if k not in (ROUTE_HEADER,) and not k.startswith("grpc-"))


def _remaining(context: Any) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None or remaining > 1e6 else max(remaining, 0.001)
