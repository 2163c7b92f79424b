"""The ADS server (state of the world, v3): streams, nonces, ACK/NACK tracking.

It serves whatever the SnapshotCache holds for a stream's node and knows nothing about
migrations. Per stream and per type URL it remembers what it last sent (version, nonce, names)
and what the data plane last accepted, which is how the controller learns that a stage has
reached every data plane (`acked`) and what an operator sees in `spine migrate status`.

Protocol rules followed (xDS REST/gRPC protocol, SotW):
- a request carrying the nonce of the last response is an ACK, or a NACK when it has
  `error_detail`; the data plane keeps using its last accepted version, and so does our
  record of it (`acked_version`), while `nack_error` shows why;
- a request with an older nonce is stale and ignored;
- LDS and CDS with no names (or "*") are wildcard; RDS and EDS are by name;
- names that the snapshot lacks get an answer without them and one log line per change.

Nodes come in two kinds, told apart by a `role` string in the Node's metadata: data planes
(no role: Envoy, proxyless gRPC clients), served their own snapshot or else the default one;
and followers of the controller (a role such as "spine"), served only the snapshot set for
their own node id — never the data planes' default. `acked` is asked per role. The
application hears of every node that connects (before its first answer is made, so it can
set that node's snapshot first) and of every one that leaves, through `StreamCallbacks`
(go-control-plane's server callbacks, reduced to the two spine needs).

Each stream uses two threads (a grpc worker yielding responses and a reader feeding it), so the
server's thread pool bounds the number of data planes; see `XdsControlPlane(max_streams=...)`.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from migration.xds.cache import ANY_NODE, SnapshotCache
from migration.xds.snapshot import CLUSTER, LISTENER, STAGE, TYPE_NAMES, TYPE_URLS, Snapshot

log = logging.getLogger("spine.xds")

WILDCARD_TYPES = frozenset({LISTENER, CLUSTER, STAGE})
_CLOSED = object()
_STAND_BY = object()  # this server stopped serving (a controller replica that no longer leads)
_CHANGED = object()


@dataclass
class TypeState:
    """One stream's view of one resource type."""

    names: frozenset[str] = frozenset()
    subscribed: bool = False
    sent_version: str | None = None
    sent_nonce: str | None = None
    sent_names: frozenset[str] | None = None
    acked_version: str | None = None
    nack_error: str | None = None
    nacked_version: str | None = None
    missing: frozenset[str] = frozenset()
    last_seen: float = 0.0


@dataclass
class StreamState:
    """One connected data plane (one ADS stream)."""

    stream_id: int
    peer: str
    events: queue.Queue[Any] = field(default_factory=queue.Queue)
    node_id: str | None = None
    role: str = ""  # the Node metadata's `role`; empty for a data plane
    types: dict[str, TypeState] = field(default_factory=dict)


class StreamCallbacks(Protocol):
    """What the application hears about nodes (called outside the server's lock)."""

    def node_connected(self, stream_id: int, node_id: str, role: str) -> None:
        """A stream named its node: called before its first request is answered."""

    def node_disconnected(self, stream_id: int, node_id: str, role: str) -> None:
        """That stream ended."""


class AdsServer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """AggregatedDiscoveryService over a SnapshotCache; one instance serves many streams."""

    def __init__(self, cache: SnapshotCache, *, wall_clock: Callable[[], float] = time.time,
                 callbacks: StreamCallbacks | None = None) -> None:
        self._cache = cache
        self._wall_clock = wall_clock
        self._callbacks = callbacks
        self._lock = threading.RLock()  # re-entrant: wait_for predicates may call acked()
        self._changed = threading.Condition(self._lock)
        self._streams: dict[int, StreamState] = {}
        self._ids = itertools.count(1)
        self._nonces = itertools.count(1)
        self._cancel_watch = cache.watch(self._on_snapshot)
        self._standing_by = ""  # why it refuses streams now (empty: it serves)

    def close(self) -> None:
        """Stop following the cache (the grpc server ends the streams)."""
        self._cancel_watch()

    def stand_by(self, reason: str) -> None:
        """Refuse streams (UNAVAILABLE, `reason`) and end the open ones the same way, so that
        data planes and followers reconnect — through the Service, to whoever serves now —
        instead of keeping what this server last sent them."""
        with self._lock:
            self._standing_by = reason
            streams = list(self._streams.values())
        for stream in streams:
            stream.events.put(_STAND_BY)

    def serve(self) -> None:
        """Accept streams again (after `stand_by`)."""
        with self._lock:
            self._standing_by = ""

    # -- the RPC -------------------------------------------------------------------------------

    def StreamAggregatedResources(
        self,
        request_iterator: Iterator[discovery_pb2.DiscoveryRequest],
        context: grpc.ServicerContext,
    ) -> Iterator[discovery_pb2.DiscoveryResponse]:
        refused = self._standing_by
        if refused:
            context.abort(grpc.StatusCode.UNAVAILABLE, refused)
        stream = StreamState(stream_id=next(self._ids), peer=context.peer())
        events = stream.events
        context.add_callback(lambda: events.put(_CLOSED))
        with self._changed:
            self._streams[stream.stream_id] = stream
            self._changed.notify_all()
        reader = threading.Thread(
            target=_read_requests, args=(request_iterator, events), daemon=True,
            name=f"ads-read-{stream.stream_id}",
        )
        reader.start()
        try:
            while True:
                event = events.get()
                if event is _CLOSED:
                    return
                if event is _STAND_BY:
                    context.abort(grpc.StatusCode.UNAVAILABLE, self._standing_by or "this server stopped serving")
                if event is not _CHANGED and stream.node_id is None:
                    self._identify(stream, event)
                responses = self._on_change(stream) if event is _CHANGED else self._on_request(stream, event)
                yield from responses
        finally:
            self._drop(stream)

    # -- what the controller reads ------------------------------------------------------------

    def connected(self, role: str | None = None) -> list[str]:
        """Node ids of the open streams that have identified themselves (of `role`, if given)."""
        with self._lock:
            return sorted(s.node_id for s in self._streams.values()
                          if s.node_id is not None and (role is None or s.role == role))

    def acked(self, version: str, min_nodes: int = 0, role: str = "") -> bool:
        """True when every connected node of `role` (default: the data planes) has ACKed
        `version` for every type it subscribes to.

        With no such node connected this is vacuously true unless `min_nodes` says how many
        must be there. A stream that has not subscribed to anything yet counts as not acked.
        """
        with self._lock:
            return self._acked_locked(version, min_nodes, role)

    def wait_acked(self, version: str, timeout: float, min_nodes: int = 0, role: str = "") -> bool:
        """Block until `acked(version, min_nodes, role)` or `timeout` seconds; returns the outcome."""
        with self._changed:
            return self._changed.wait_for(lambda: self._acked_locked(version, min_nodes, role), timeout)

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block until `predicate()` (called after each request handled) or `timeout`."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout)

    def status(self) -> list[dict[str, Any]]:
        """One row per connected node and type: what it accepted, what it refused, when seen."""
        rows: list[dict[str, Any]] = []
        with self._lock:
            for stream in sorted(self._streams.values(), key=lambda s: s.stream_id):
                if stream.node_id is None:
                    continue
                for type_url, ts in sorted(stream.types.items(), key=lambda kv: _type_order(kv[0])):
                    rows.append({
                        "node_id": stream.node_id,
                        "role": stream.role,
                        "peer": stream.peer,
                        "type_url": type_url,
                        "type": TYPE_NAMES.get(type_url, type_url),
                        "acked_version": ts.acked_version,
                        "sent_version": ts.sent_version,
                        "nack_error": ts.nack_error,
                        "nacked_version": ts.nacked_version,
                        "last_seen": ts.last_seen,
                    })
        return rows

    # -- internals ----------------------------------------------------------------------------

    def _acked_locked(self, version: str, min_nodes: int, role: str = "") -> bool:
        streams = [s for s in self._streams.values() if s.node_id is not None and s.role == role]
        if len(streams) < min_nodes:
            return False
        for stream in streams:
            subscribed = [ts for t, ts in stream.types.items() if ts.subscribed and t in TYPE_URLS]
            if not subscribed or any(ts.acked_version != version for ts in subscribed):
                return False
        return True

    def _on_snapshot(self, node_id: str) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            if node_id == ANY_NODE or stream.node_id == node_id:
                stream.events.put(_CHANGED)

    def _identify(self, stream: StreamState, request: discovery_pb2.DiscoveryRequest) -> None:
        """Note the node of a stream's first request, then tell the application (outside the
        lock, before the request is answered: it may set this node's snapshot first)."""
        role = request.node.metadata.fields.get("role")
        with self._changed:
            stream.node_id = request.node.id
            stream.role = role.string_value if role is not None else ""
            if not stream.node_id:
                log.warning("xds: stream %d from %s sent no node id; serving it the default snapshot",
                            stream.stream_id, stream.peer)
            log.info("xds: node %r%s connected from %s", stream.node_id,
                     f" (role {stream.role})" if stream.role else "", stream.peer)
        if self._callbacks is not None:
            try:
                self._callbacks.node_connected(stream.stream_id, stream.node_id, stream.role)
            except Exception:  # the stream is served whatever the application made of it
                log.exception("xds: node_connected(%r) failed", stream.node_id)

    def _on_request(
        self, stream: StreamState, request: discovery_pb2.DiscoveryRequest
    ) -> list[discovery_pb2.DiscoveryResponse]:
        with self._changed:
            try:
                return self._handle_request_locked(stream, request)
            finally:
                self._changed.notify_all()

    def _handle_request_locked(
        self, stream: StreamState, request: discovery_pb2.DiscoveryRequest
    ) -> list[discovery_pb2.DiscoveryResponse]:
        type_url = request.type_url
        if type_url not in TYPE_URLS and type_url not in stream.types:
            log.warning("xds: node %r asked for unknown type %r; it will get empty answers",
                        stream.node_id, type_url)
        ts = stream.types.setdefault(type_url, TypeState())
        ts.last_seen = self._wall_clock()
        if request.response_nonce:
            if request.response_nonce != ts.sent_nonce:
                return []  # stale: answers a response that a newer one has replaced
            if request.HasField("error_detail"):
                ts.nack_error = request.error_detail.message or f"code {request.error_detail.code}"
                ts.nacked_version = ts.sent_version
                log.warning(
                    "xds: node %r rejected %s version %s (keeps %s): %s",
                    stream.node_id, TYPE_NAMES.get(type_url, type_url), ts.sent_version,
                    request.version_info or "nothing", ts.nack_error,
                )
            else:
                ts.acked_version = request.version_info
                ts.nack_error = None
                ts.nacked_version = None
        ts.names = frozenset(request.resource_names)
        ts.subscribed = bool(ts.names) or type_url in WILDCARD_TYPES or type_url not in TYPE_URLS
        response = self._response_locked(stream, type_url, ts)
        return [response] if response is not None else []

    def _on_change(self, stream: StreamState) -> list[discovery_pb2.DiscoveryResponse]:
        responses = []
        with self._lock:
            for type_url in sorted(stream.types, key=_type_order):
                response = self._response_locked(stream, type_url, stream.types[type_url])
                if response is not None:
                    responses.append(response)
        return responses

    def _response_locked(
        self, stream: StreamState, type_url: str, ts: TypeState
    ) -> discovery_pb2.DiscoveryResponse | None:
        """The response this stream needs for `type_url`, or None when it is up to date."""
        if not ts.subscribed or stream.node_id is None:
            return None
        # A follower is served only what is set for it: the data planes' default would answer
        # it with an empty assignment under a stage's version, which it could ACK unapplied.
        snapshot = self._cache.get(stream.node_id, default=not stream.role)
        if snapshot is None:
            return None
        if ts.sent_version == snapshot.version and ts.sent_names == ts.names:
            return None
        resources = _select(snapshot, type_url, ts, stream.node_id)
        nonce = str(next(self._nonces))
        ts.sent_version, ts.sent_nonce, ts.sent_names = snapshot.version, nonce, ts.names
        return discovery_pb2.DiscoveryResponse(
            version_info=snapshot.version, type_url=type_url, nonce=nonce, resources=resources
        )

    def _drop(self, stream: StreamState) -> None:
        with self._changed:
            self._streams.pop(stream.stream_id, None)
            self._changed.notify_all()
        log.info("xds: node %r (%s) disconnected", stream.node_id, stream.peer)
        if self._callbacks is not None and stream.node_id is not None:
            try:
                self._callbacks.node_disconnected(stream.stream_id, stream.node_id, stream.role)
            except Exception:
                log.exception("xds: node_disconnected(%r) failed", stream.node_id)


def _select(snapshot: Snapshot, type_url: str, ts: TypeState, node_id: str) -> list[Any]:
    packed = snapshot.packed(type_url)
    wildcard = "*" in ts.names or (not ts.names and type_url in WILDCARD_TYPES)
    if wildcard:
        ts.missing = frozenset()
        return [packed[name] for name in sorted(packed)]
    missing = frozenset(name for name in ts.names if name not in packed)
    if missing and missing != ts.missing:
        log.warning(
            "xds: node %r asked for %s %s, which snapshot %s lacks; answering without them",
            node_id, TYPE_NAMES.get(type_url, type_url), sorted(missing), snapshot.version,
        )
    ts.missing = missing
    return [packed[name] for name in sorted(ts.names) if name in packed]


def _read_requests(requests: Iterable[discovery_pb2.DiscoveryRequest], events: queue.Queue[Any]) -> None:
    """Feed a stream's requests to its worker; the end of requests (or an error) closes it."""
    try:
        for request in requests:
            events.put(request)
    except Exception:  # grpc raises on cancellation; the stream is over either way
        pass
    finally:
        events.put(_CLOSED)


def _type_order(type_url: str) -> int:
    return TYPE_URLS.index(type_url) if type_url in TYPE_URLS else len(TYPE_URLS)

