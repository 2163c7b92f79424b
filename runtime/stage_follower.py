"""Follow the migration controller's stage: placements and rate-limit shares over ADS.

In production the controller cannot reach into a spine replica to move its middlewares, or
into a layered rate limiter to set its share of the limits; they come to it instead. Each
one opens an ADS stream to the controller's xDS server (the one Envoy and proxyless gRPC
clients read their weights from), names its role in the xDS `Node` metadata and subscribes
to one resource of our own type, `spine.v1.StageAssignment` (protos/wire/v1/stage.proto).
For every version it receives it applies the assignment first and then ACKs that version;
an assignment it cannot apply (a placement it has no address for, a share out of range) it
NACKs with the reason and keeps what it had, as an Envoy keeps its last good config. The
controller counts a stage as applied only once every follower has ACKed it.

The protocol loop (`StageFollower`) knows nothing about what is applied; an applier (a
callable that raises to refuse) does: `spine_applier` for a spine `RunningStack`,
`ratelimit_applier` for a layered rate limiter's servicer.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from runtime.config.sections import TlsConfig
from runtime.tls import link_channel
from services.common.thread_names import name_os_thread
from wire.v1 import stage_pb2

if TYPE_CHECKING:
    from runtime.running_stack import RunningStack

log = logging.getLogger("runtime.stage_follower")

STAGE_ASSIGNMENT = "type.googleapis.com/" + stage_pb2.StageAssignment.DESCRIPTOR.full_name
ROLE_SPINE = "spine"
ROLE_LAYERED_RATELIMIT = "layered-ratelimit"
SIDES = {ROLE_SPINE: "spine", ROLE_LAYERED_RATELIMIT: "layered"}  # the side each role serves
_END = object()

Applier = Callable[[stage_pb2.StageAssignment], None]


def default_node_id() -> str:
    """The host name (a pod's name in Kubernetes) and the pid: unique on one machine too."""
    return f"{socket.gethostname()}-{os.getpid()}"


class StageFollower:
    """One ADS stream to the controller, reconnected with backoff, applying then ACKing.

    `apply` is called on the follower's own thread, one assignment at a time; it raises to
    refuse (the message becomes the NACK's error_detail).
    """

    def __init__(self, controller: str, node_id: str, role: str, apply: Applier, *,
                 retry_max_s: float = 5.0, tls: TlsConfig | None = None) -> None:
        if role not in SIDES:
            raise ValueError(f"role: expected one of {', '.join(SIDES)}, got {role!r}")
        if not node_id:
            raise ValueError("node_id: must not be empty")
        self.controller = controller
        self.node_id = node_id
        self.role = role
        self._apply = apply
        self._retry_max_s = retry_max_s
        self._tls = tls  # this process's `tls:`: the controller's xDS is dialed with its certificate
        self._stop = threading.Event()
        self._applied = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None
        self._thread: threading.Thread | None = None
        self.applied_version: str | None = None
        self.assignment: stage_pb2.StageAssignment | None = None
        self.nacked_version: str | None = None
        self.error: str | None = None
        self.connected = False

    def start(self) -> StageFollower:
        self._thread = threading.Thread(target=self._run, name=f"stage-follower-{self.role}", daemon=True)
        self._thread.start()
        return self

    def wait_applied(self, timeout: float) -> bool:
        """Block until the first assignment is applied (or `timeout` s); True if it was."""
        return self._applied.wait(timeout)

    def state(self) -> dict[str, Any]:
        """What `spine up`'s ready line and a person read: where it follows, what it applied."""
        with self._lock:
            assignment = self.assignment
            return {
                "controller": self.controller, "node_id": self.node_id, "role": self.role,
                "connected": self.connected, "applied_version": self.applied_version,
                "ratelimit_share": assignment.ratelimit_share if assignment is not None else None,
                "nacked_version": self.nacked_version, "error": self.error,
            }

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    # -- the protocol loop ----------------------------------------------------------------

    def _run(self) -> None:
        name_os_thread()
        backoff = 0.1
        while not self._stop.is_set():
            if self._follow_once():
                backoff = 0.1  # the stream had worked: start the backoff over
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, self._retry_max_s)

    def _follow_once(self) -> bool:
        """One stream, until it ends; True if it got at least one response."""
        requests: queue.Queue[Any] = queue.Queue()
        first = discovery_pb2.DiscoveryRequest(type_url=STAGE_ASSIGNMENT, version_info=self.applied_version or "")
        first.node.CopyFrom(self._node())
        requests.put(first)
        answered = False
        channel = link_channel(self.controller, self._tls, options=[
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)])
        try:
            call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(_drain(requests))
            with self._lock:
                self._call = call
            if self._stop.is_set():
                call.cancel()
            for response in call:
                if not answered:
                    answered = True
                    with self._lock:
                        self.connected = True
                    log.info("following the migration controller at %s as %s (%s)", self.controller,
                             self.node_id, self.role)
                requests.put(self._answer(response))
        except grpc.RpcError as error:
            if not self._stop.is_set():
                log.warning("stage follower: stream to %s ended: %s", self.controller,
                            error.details() if hasattr(error, "details") else error)
        finally:
            requests.put(_END)
            with self._lock:
                self._call = None
                self.connected = False
            channel.close()
        return answered

    def _answer(self, response: discovery_pb2.DiscoveryResponse) -> discovery_pb2.DiscoveryRequest:
        """Apply `response` and ACK it, or NACK it with the reason (keeping what was applied)."""
        try:
            assignment = unpack(response)
            if assignment.side != SIDES[self.role]:
                raise ValueError(f"side: this {self.role} follower serves the {SIDES[self.role]} side, "
                                 f"got an assignment for {assignment.side!r}")
            self._apply(assignment)
        except Exception as error:  # anything the applier refuses is a NACK, never a crash
            message = str(error) or type(error).__name__
            log.warning("stage follower: refused version %s: %s", response.version_info, message)
            with self._lock:
                self.nacked_version, self.error = response.version_info, message
            return discovery_pb2.DiscoveryRequest(
                type_url=STAGE_ASSIGNMENT, version_info=self.applied_version or "", response_nonce=response.nonce,
                error_detail=status_pb2.Status(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message=message))
        with self._lock:
            self.applied_version, self.assignment = response.version_info, assignment
            self.nacked_version = self.error = None
        self._applied.set()
        log.info("stage follower: applied version %s (share %g, placements %s)", response.version_info,
                 assignment.ratelimit_share, dict(assignment.placements) or "kept")
        return discovery_pb2.DiscoveryRequest(type_url=STAGE_ASSIGNMENT, version_info=response.version_info,
                                              response_nonce=response.nonce)

    def _node(self) -> base_pb2.Node:
        node = base_pb2.Node(id=self.node_id, cluster=f"spine-{self.role}")
        node.metadata.update({"role": self.role})
        return node


def _drain(requests: queue.Queue[Any]) -> Iterator[discovery_pb2.DiscoveryRequest]:
    while True:
        item = requests.get()
        if item is _END:
            return
        yield item


def unpack(response: discovery_pb2.DiscoveryResponse) -> stage_pb2.StageAssignment:
    """The one StageAssignment a response carries (ValueError naming what is wrong)."""
    if response.type_url != STAGE_ASSIGNMENT:
        raise ValueError(f"type_url: expected {STAGE_ASSIGNMENT}, got {response.type_url!r}")
    if len(response.resources) != 1:
        raise ValueError(f"resources: expected one StageAssignment, got {len(response.resources)}")
    assignment = stage_pb2.StageAssignment()
    if not response.resources[0].Unpack(assignment):
        raise ValueError(f"resources[0]: expected {STAGE_ASSIGNMENT}, got {response.resources[0].type_url!r}")
    if not 0.0 <= assignment.ratelimit_share <= 1.0:
        raise ValueError(f"ratelimit_share: must be in [0, 1], got {assignment.ratelimit_share:g}")
    return assignment


# -- what `spine up` and the rate-limit process share ------------------------------------------

def add_follow_arguments(parser: argparse.ArgumentParser, follows: str) -> None:
    """--follow-controller, --node-id and --initial-fetch-timeout-s; `follows`: what it takes."""
    parser.add_argument("--follow-controller", metavar="HOST:PORT",
                        help=f"take {follows} from the migration controller's xDS address, stage by stage "
                             "(each ACKed once applied)")
    parser.add_argument("--node-id", help="with --follow-controller: this replica's name (default: host name and pid)")
    parser.add_argument("--initial-fetch-timeout-s", type=float, default=10.0,
                        help="with --follow-controller: how long to wait for the first stage before serving anyway")


def follow(args: argparse.Namespace, role: str, apply: Applier, meanwhile: str,
           tls: TlsConfig | None = None) -> StageFollower | None:
    """Start following when --follow-controller is given, and wait up to
    --initial-fetch-timeout-s for the first assignment (as Envoy's initial_fetch_timeout);
    after that, go on with `meanwhile` (what this process does until one comes). With `tls`
    (this process's section) the controller's xDS is dialed over mTLS."""
    if not args.follow_controller:
        return None
    follower = StageFollower(args.follow_controller, args.node_id or default_node_id(), role, apply,
                             tls=tls).start()
    if not follower.wait_applied(args.initial_fetch_timeout_s):
        print(f"warning: nothing from the controller at {args.follow_controller} within "
              f"{args.initial_fetch_timeout_s:g}s; {meanwhile} until it answers", file=sys.stderr)
    return follower


# -- appliers: what a follower does with an assignment ---------------------------------------

def spine_applier(stack: RunningStack) -> Applier:
    """A spine replica: the stage's placements (moved live, `RunningStack.set_placements`) and, when
    its rate limiter is local in the stage, that limiter's share of every limit.

    The share is set on the local rate limiter BEFORE the move, so a limiter moved in by
    this stage never decides a request at the full limit. Anything the stack cannot place
    (an unknown component, a remote one with no address) is refused before anything moves.
    """

    def apply(assignment: stage_pb2.StageAssignment) -> None:
        placements = dict(assignment.placements)
        after = stack.check_placements(placements)
        if assignment.ratelimit_share > 0 and after.get("ratelimit") == "local":
            stack.local_servicer("ratelimit").set_share(assignment.ratelimit_share)
        stack.set_placements(placements)

    return apply


def ratelimit_applier(servicer: Any) -> Applier:
    """A layered rate limiter: its share of every limit (`RateLimitService.set_share`)."""

    def apply(assignment: stage_pb2.StageAssignment) -> None:
        if assignment.placements:
            raise ValueError(f"placements: a rate limiter places nothing, got {dict(assignment.placements)}")
        if assignment.ratelimit_share <= 0:
            raise ValueError(f"ratelimit_share: a layered rate limiter needs a share in (0, 1], "
                             f"got {assignment.ratelimit_share:g}")
        servicer.set_share(assignment.ratelimit_share)

    return apply


__all__ = ["ROLE_LAYERED_RATELIMIT", "ROLE_SPINE", "SIDES", "STAGE_ASSIGNMENT", "StageFollower",
           "add_follow_arguments", "default_node_id", "follow", "ratelimit_applier", "spine_applier", "unpack"]
