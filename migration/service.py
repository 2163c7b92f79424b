"""MigrationControl: the operator API over gRPC, a thin skin on the Controller.

The service only authenticates, translates messages and maps errors to status codes:
InvalidTransition → FAILED_PRECONDITION (and so a write sent to a controller replica that
does not lead, or that the lease's fence refused: the message names the leader),
a state store that does not answer → UNAVAILABLE, PlanError → INVALID_ARGUMENT (with field and line;
also a parity gate where the data path has no shadow traffic, `Controller.check_plan`),
a missing or wrong admin token → UNAUTHENTICATED. The token is compared in constant time
and never logged or echoed.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from migration.admin_token import bearer, token_matches
from migration.controller import Controller, InvalidTransition, StatusView
from migration.leadership import NotLeader
from migration.lease import Fenced
from migration.legacy_endpoint import from_side
from migration.plan import Plan, PlanError, load_plan
from migration.status import AuditEntry
from migration.store_backends import StoreUnavailable
from wire.v1 import migration_pb2 as pb
from wire.v1 import migration_pb2_grpc as pb_grpc

SERVICE_NAME = "spine.v1.MigrationControl"
_Response = TypeVar("_Response")


def _command(method: Callable[..., _Response]) -> Callable[..., _Response]:
    """Authenticate, then run `method`, mapping controller errors to status codes."""

    @functools.wraps(method)
    def wrapper(self: MigrationService, request: Any, context: grpc.ServicerContext) -> _Response:
        self.authorize(context)
        try:
            return method(self, request, context)
        except InvalidTransition as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except PlanError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (NotLeader, Fenced) as exc:  # another replica leads: the message names it
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except StoreUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the state store did not answer ({exc}); retry")
        raise AssertionError("context.abort returned")  # pragma: no cover

    return wrapper


class MigrationService(pb_grpc.MigrationControlServicer):
    def __init__(self, controller: Controller, admin_token: str, *, heartbeat_s: float = 1.0,
                 dashboard_url: str = "", leader_check: Callable[[], None] | None = None) -> None:
        if not admin_token:
            raise ValueError("admin_token: must be non-empty")
        self._controller = controller
        # With several replicas: raises NotLeader (naming the leader) where this one does not lead.
        self._leader_check = leader_check
        self._token = admin_token.encode()
        self._heartbeat_s = heartbeat_s
        self._closing = threading.Event()
        self.dashboard_url = dashboard_url  # the dashboard served beside this API ("" if none)

    def close(self) -> None:
        """End open WatchEvents streams (at their next heartbeat)."""
        self._closing.set()

    def authorize(self, context: grpc.ServicerContext) -> None:
        presented = ""
        for key, value in context.invocation_metadata():
            if key == "authorization":
                presented = bearer(value.decode() if isinstance(value, bytes) else value) or presented
        if not presented:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing admin token: send `authorization: Bearer <token>` metadata")
        if not token_matches(presented, self._token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "admin token not accepted")

    @_command
    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.RolloutStatus:
        return status_message(self._controller.view(audit_rows=request.audit_rows or 10), self.dashboard_url)

    @_command
    def Plan(self, request: pb.PlanRequest, context: grpc.ServicerContext) -> pb.PlanResponse:
        plan = load_plan(request.plan_yaml)
        if request.validate_only:
            self._controller.check_plan(plan)
        else:
            self._writing()
            self._controller.load(plan, _actor(request, context))
        return plan_message(plan, loaded=not request.validate_only)

    @_command
    def Start(self, request: pb.StartRequest, context: grpc.ServicerContext) -> pb.RolloutStatus:
        plan = load_plan(request.plan_yaml) if request.plan_yaml else None
        self._writing()
        self._controller.start(plan, _actor(request, context), request.reason)
        return self._status()

    @_command
    def Advance(self, request: pb.AdvanceRequest, context: grpc.ServicerContext) -> pb.RolloutStatus:
        return self._run("advance", request, context, request.stage)

    @_command
    def Pause(self, request: pb.CommandRequest, context: grpc.ServicerContext) -> pb.RolloutStatus:
        return self._run("pause", request, context)

    @_command
    def Resume(self, request: pb.CommandRequest, context: grpc.ServicerContext) -> pb.RolloutStatus:
        return self._run("resume", request, context)

    @_command
    def Approve(self, request: pb.ApproveRequest, context: grpc.ServicerContext) -> pb.RolloutStatus:
        return self._run("approve", request, context, request.stage)

    @_command
    def Rollback(self, request: pb.CommandRequest, context: grpc.ServicerContext) -> pb.RolloutStatus:
        return self._run("rollback", request, context)

    @_command
    def Abort(self, request: pb.CommandRequest, context: grpc.ServicerContext) -> pb.RolloutStatus:
        return self._run("abort", request, context)

    def _writing(self) -> None:
        """Refuse a write here unless this replica leads (the store's fence refuses it anyway;
        this says where to send it instead)."""
        if self._leader_check is not None:
            self._leader_check()

    def _run(self, command: str, request: Any, context: grpc.ServicerContext, stage: str = "") -> pb.RolloutStatus:
        self._writing()
        run_command(self._controller, command, _actor(request, context), request.reason, stage)
        return self._status()

    def WatchEvents(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.MigrationEvent]:
        self.authorize(context)
        view = self._controller.view()
        after = request.after_id or (view.recent_audit[-1].id if view.recent_audit else 0)
        yield pb.MigrationEvent(status=status_message(view, self.dashboard_url))
        while context.is_active() and not self._closing.is_set():
            rows = self._controller.wait_for_audit(after, timeout=self._heartbeat_s)
            status = self._status()
            if not rows:
                yield pb.MigrationEvent(status=status)
            for row in rows:
                after = row.id
                yield pb.MigrationEvent(status=status, audit=audit_message(row))

    def _status(self) -> pb.RolloutStatus:
        return status_message(self._controller.view(), self.dashboard_url)


# The operator commands every front end runs the same way (this gRPC API, the dashboard's
# buttons): name -> what it does to the controller, given (stage or None, actor, reason).
COMMANDS: dict[str, Callable[[Controller, str | None, str, str], object]] = {
    "advance": lambda c, stage, actor, reason: c.advance(stage, actor, reason),
    "approve": lambda c, stage, actor, reason: c.approve(stage, actor, reason),
    "pause": lambda c, _, actor, reason: c.pause(actor, reason),
    "resume": lambda c, _, actor, reason: c.resume(actor, reason),
    "rollback": lambda c, _, actor, reason: c.rollback(actor, reason),
    "abort": lambda c, _, actor, reason: c.abort(actor, reason),
}


def run_command(controller: Controller, command: str, actor: str, reason: str, stage: str = "") -> None:
    """Run operator `command` (a key of COMMANDS); InvalidTransition when the state refuses it."""
    COMMANDS[command](controller, stage or None, actor, reason)


def _actor(request: Any, context: grpc.ServicerContext) -> str:
    """The actor the caller names (the admin token is shared, so this is self-declared)."""
    return request.actor or f"unnamed@{context.peer()}"


def audit_message(row: AuditEntry) -> pb.AuditEvent:
    return pb.AuditEvent(id=row.id, ts=row.ts, actor=row.actor, action=row.action, from_state=row.from_state,
                         to_state=row.to_state, stage=row.stage, reason=row.reason)


def status_message(view: StatusView, dashboard_url: str = "") -> pb.RolloutStatus:
    s, plan, stage = view.status, view.plan, view.stage
    message = pb.RolloutStatus(
        from_side=from_side(plan.legacy if plan else None), dashboard_url=dashboard_url,
        plan_name=s.plan_name, state=str(s.state), stage_index=s.stage_index,
        stage_count=len(plan.stages) if plan else 0, stage_name=stage.name if stage else "",
        spine_weight=s.spine_weight, layered_weight=s.layered_weight, placements=s.placements,
        consecutive_failures=s.consecutive_failures, failure_limit=stage.failure_limit if stage else 0,
        version=s.version, applied=s.acked, stage_elapsed_s=view.stage_elapsed_s,
        stage_requests=s.stage_requests, last_verdict=s.last_verdict, awaiting_stage=view.awaiting_stage,
        updated_at=s.updated_at, stage_names=[st.name for st in plan.stages] if plan else [],
        recent_audit=[audit_message(row) for row in view.recent_audit],
        data_planes=[pb.DataPlane(node_id=row["node_id"], type=row["type"], acked_version=row["acked_version"] or "",
                                  sent_version=row["sent_version"] or "", nacked_version=row["nacked_version"] or "",
                                  nack_error=row["nack_error"] or "", last_seen=row["last_seen"] or 0.0)
                     for row in view.data_planes],
        min_data_planes=view.min_data_planes,
        followers=[pb.Follower(node_id=row["node_id"], role=row["role"], acked_version=row["acked_version"] or "",
                               sent_version=row["sent_version"] or "", nacked_version=row["nacked_version"] or "",
                               nack_error=row["nack_error"] or "", last_seen=row["last_seen"] or 0.0,
                               ratelimit_share=row["ratelimit_share"] or 0.0, replicas=row["replicas"],
                               placements=row["placements"])
                   for row in view.followers],
        min_spine_replicas=view.min_spine_replicas,
    )
    if view.leadership is not None:
        lead = view.leadership
        message.leadership.CopyFrom(pb.Leadership(
            leader=lead.leader, leader_address=lead.leader_address, epoch=lead.epoch, controller=lead.controller,
            leading=lead.leading, fenced_writes=lead.fenced_writes))
    if stage is not None and stage.hold_s is not None:
        message.hold_s = stage.hold_s
    if stage is not None and stage.min_requests is not None:
        message.min_requests = stage.min_requests
    for record in view.last_gates:
        gate = message.last_gates.add(gate=record.gate, verdict=record.verdict, threshold=record.threshold,
                                      dry_run=record.dry_run, message=record.message, stage=record.stage,
                                      window_start=record.window_start, window_end=record.window_end)
        if record.value is not None:
            gate.value = record.value
    return message


def plan_message(plan: Plan, *, loaded: bool) -> pb.PlanResponse:
    response = pb.PlanResponse(name=plan.name, description=plan.description, window_s=plan.window_s,
                               min_window_requests=plan.min_window_requests, loaded=loaded,
                               from_side=from_side(plan.legacy))
    for stage in plan.stages:
        summary = response.stages.add(name=stage.name, spine_weight=stage.spine_weight,
                                      placements=stage.placements, gates=[g.describe() for g in stage.gates]
                                      + ([stage.judge.describe()] if stage.judge else []),
                                      failure_limit=stage.failure_limit, manual_approval=stage.manual_approval)
        if stage.hold_s is not None:
            summary.hold_s = stage.hold_s
        if stage.min_requests is not None:
            summary.min_requests = stage.min_requests
    return response
