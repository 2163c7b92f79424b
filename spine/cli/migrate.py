"""`spine migrate …`: drive the migration controller over its gRPC API.

    spine migrate plan FILE [--validate-only | --offline]
    spine migrate run [FILE] [--no-follow]
    spine migrate status [--watch]
    spine migrate advance [--to STAGE] | pause | resume | approve [--stage S] | rollback | abort

Every command takes --controller ADDR (default $SPINE_CONTROLLER, else the local socket)
and the admin token from --admin-token-file or $SPINE_ADMIN_TOKEN (never from argv: a
command line is visible to every user of the machine); `--ca FILE [--cert FILE --key FILE]`
for a controller that serves TLS (mTLS). Every command takes --json.
Exit codes: 0 ok, 1 refused in this state / rollout failed, 2 bad plan or usage,
3 token not accepted, 4 controller unreachable.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console

from migration.admin_token import dashboard_link, read_admin_token
from migration.plan import PlanError, load_plan
from migration.render import RunProgress, audit_line, plan_table, status_renderable, to_json
from migration.service import plan_message
from migration.watch import follow, print_json, watch
from runtime.tls import add_tls_client_arguments, client_credentials, open_channel, refusal_hint
from services.common import ConfigError
from spine.cli.output import add_output_arguments, as_json, table_console
from wire.v1 import migration_pb2 as pb
from wire.v1 import migration_pb2_grpc as pb_grpc

ENV_CONTROLLER = "SPINE_CONTROLLER"
DEFAULT_CONTROLLER = "unix:/tmp/spine-migration.sock"
_EXIT_CODES = {
    grpc.StatusCode.FAILED_PRECONDITION: 1,
    grpc.StatusCode.INVALID_ARGUMENT: 2,
    grpc.StatusCode.UNAUTHENTICATED: 3,
    grpc.StatusCode.UNAVAILABLE: 4,
    grpc.StatusCode.DEADLINE_EXCEEDED: 4,
}


class ControlClient:
    """A MigrationControl stub that sends the admin token with every call."""

    def __init__(self, address: str, token: str, timeout: float = 10.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self._channel = open_channel(address, credentials)
        self.stub = pb_grpc.MigrationControlStub(self._channel)
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.timeout = timeout

    def call(self, method: str, request: Any) -> Any:
        return getattr(self.stub, method)(request, metadata=self.metadata, timeout=self.timeout)

    def watch(self, after_id: int = 0) -> Iterator[pb.MigrationEvent]:
        events: Iterator[pb.MigrationEvent] = self.stub.WatchEvents(pb.WatchRequest(after_id=after_id),
                                                                    metadata=self.metadata)
        return events

    def close(self) -> None:
        self._channel.close()


def add_migrate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `migrate` and its subcommands to an argparse subparsers object (handler=...)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--controller", default=os.environ.get(ENV_CONTROLLER, DEFAULT_CONTROLLER),
                        help=f"controller address, unix:PATH or HOST:PORT (default ${ENV_CONTROLLER} "
                             f"or {DEFAULT_CONTROLLER})")
    common.add_argument("--admin-token-file", help="file holding the admin token (else $SPINE_ADMIN_TOKEN)")
    add_output_arguments(common)
    common.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    add_tls_client_arguments(common)
    command = argparse.ArgumentParser(add_help=False, parents=[common])
    command.add_argument("--reason", default="", help="why, for the audit trail")

    migrate: argparse.ArgumentParser = subparsers.add_parser("migrate", help="drive the layered → spine migration controller")
    sub = migrate.add_subparsers(dest="migrate_command", required=True)

    plan = sub.add_parser("plan", parents=[common], help="validate a plan and load it as the pending plan")
    plan.add_argument("file")
    plan.add_argument("--validate-only", action="store_true", help="validate on the controller, load nothing")
    plan.add_argument("--offline", action="store_true", help="validate locally, without a controller")
    plan.set_defaults(handler=cmd_plan)

    run = sub.add_parser("run", parents=[command], help="start a plan (or the loaded one) and follow it")
    run.add_argument("file", nargs="?", help="plan YAML (default: the plan loaded with `migrate plan`)")
    run.add_argument("--no-follow", action="store_true", help="start and return at once")
    run.set_defaults(handler=cmd_run)

    status = sub.add_parser("status", parents=[common], help="state, stage, weights, gates and audit")
    status.add_argument("--audit-rows", type=int, default=10)
    status.add_argument("--watch", action="store_true",
                        help="redraw as the controller moves; exit when the rollout finishes (0 promoted, 1 rolled "
                             "back or aborted)")
    status.set_defaults(handler=cmd_status)

    advance = sub.add_parser("advance", parents=[command], help="skip to the next stage (or --to STAGE) now")
    advance.add_argument("--to", dest="stage", help="target stage name (default: the next one)")
    advance.set_defaults(handler=cmd_advance)

    approve = sub.add_parser("approve", parents=[command], help="enter the stage awaiting manual approval")
    approve.add_argument("--stage", help="the stage you approve (default: whichever awaits)")
    approve.set_defaults(handler=cmd_approve)

    for name, help_text in (("pause", "stop judging and advancing (no gates, no auto rollback); weights stay"),
                            ("resume", "continue; after a rollback, retry the stage"),
                            ("rollback", "all traffic to layered, placements to the previous stage's"),
                            ("abort", "roll back and stop for good")):
        simple = sub.add_parser(name, parents=[command], help=help_text)
        simple.set_defaults(handler=_simple_command(name.capitalize()))
    return migrate


def main(argv: list[str] | None = None) -> int:
    """`python -m spine.cli.migrate migrate …` (the same commands as `spine migrate …`)."""
    parser = argparse.ArgumentParser(prog="spine")
    add_migrate_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


@contextmanager
def _client(args: argparse.Namespace) -> Iterator[ControlClient]:
    client = ControlClient(args.controller, read_admin_token(args.admin_token_file), args.timeout,
                           credentials=client_credentials(args))
    try:
        yield client
    finally:
        client.close()


def _rpc(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn a failed call into one readable line and a distinct exit code."""

    def wrapper(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            hint = refusal_hint(code, details, getattr(args, "ca", None) is not None)
            if code is grpc.StatusCode.UNAVAILABLE:
                details = f"cannot reach the controller at {args.controller}: {details}"
            print(f"error ({code.name.lower()}): {details}", file=sys.stderr)
            if hint:
                print(f"hint: {hint}", file=sys.stderr)
            return _EXIT_CODES.get(code, 1)

    return wrapper


def _actor() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _show_status(args: argparse.Namespace, status: pb.RolloutStatus) -> None:
    if as_json(args):
        print(json.dumps(to_json(status), indent=2))
    else:
        table_console().print(status_renderable(status, _dashboard_link(args, status)))


def _dashboard_link(args: argparse.Namespace, status: pb.RolloutStatus) -> str:
    """The controller's dashboard with our admin token in the URL's fragment: one click opens it
    unlocked, and the token never reaches a server (a browser does not send a fragment)."""
    if not status.dashboard_url:
        return ""
    return dashboard_link(status.dashboard_url, read_admin_token(args.admin_token_file))


@_rpc
def cmd_plan(args: argparse.Namespace) -> int:
    text = Path(args.file).read_text(encoding="utf-8")
    if args.offline:
        try:
            response = plan_message(load_plan(text), loaded=False)
        except PlanError as exc:
            print(f"error (invalid_argument): {args.file}:\n{exc}", file=sys.stderr)
            return 2
    else:
        with _client(args) as client:
            request = pb.PlanRequest(plan_yaml=text, validate_only=args.validate_only, actor=_actor())
            response = client.call("Plan", request)
    if as_json(args):
        print(json.dumps(to_json(response), indent=2))
    else:
        console = table_console()
        console.print(plan_table(response))
        console.print("loaded as the pending plan: start it with `spine migrate run`" if response.loaded
                      else "valid (nothing loaded)")
    return 0


@_rpc
def cmd_status(args: argparse.Namespace) -> int:
    if args.watch:
        with _client(args) as client:
            return watch(client.watch(), table_console(), args.controller, as_json=as_json(args))
    with _client(args) as client:
        _show_status(args, client.call("Status", pb.StatusRequest(audit_rows=args.audit_rows)))
    return 0


@_rpc
def cmd_run(args: argparse.Namespace) -> int:
    text = Path(args.file).read_text(encoding="utf-8") if args.file else ""
    with _client(args) as client:
        status = client.call("Start", pb.StartRequest(plan_yaml=text, actor=_actor(), reason=args.reason))
        if args.no_follow:
            _show_status(args, status)
            return 0
        # Replay from the row Start wrote, so the follow shows the whole rollout.
        after = status.recent_audit[-1].id - 1 if status.recent_audit else 0
        return _follow(args, client, after)


def _follow(args: argparse.Namespace, client: ControlClient, after_id: int) -> int:
    """Follow WatchEvents until the rollout finishes; Ctrl-C detaches, the rollout goes on."""
    stream = client.watch(after_id)
    if as_json(args):
        return follow(stream, print_json, args.controller)
    with RunProgress(Console()) as progress:
        shown = False

        def show(event: pb.MigrationEvent) -> None:
            nonlocal shown
            if not shown and event.status.dashboard_url:
                progress.print(f"dashboard: {_dashboard_link(args, event.status)}")
            shown = True
            if event.HasField("audit"):
                progress.print(audit_line(event.audit))
            progress.update(event.status)

        return follow(stream, show, args.controller)


@_rpc
def cmd_advance(args: argparse.Namespace) -> int:
    with _client(args) as client:
        stage = args.stage
        if stage is None:
            # Name the next stage explicitly, so a retried call cannot skip two stages.
            current = client.call("Status", pb.StatusRequest())
            names = list(current.stage_names)
            if current.state in ("progressing", "paused", "awaiting_approval") and \
                    current.stage_index + 1 < len(names):
                stage = names[current.stage_index + 1]
        request = pb.AdvanceRequest(stage=stage or "", actor=_actor(), reason=args.reason)
        _show_status(args, client.call("Advance", request))
    return 0


@_rpc
def cmd_approve(args: argparse.Namespace) -> int:
    with _client(args) as client:
        stage = args.stage
        if stage is None:
            stage = client.call("Status", pb.StatusRequest()).awaiting_stage or None
        request = pb.ApproveRequest(stage=stage or "", actor=_actor(), reason=args.reason)
        _show_status(args, client.call("Approve", request))
    return 0


def _simple_command(method: str) -> Callable[[argparse.Namespace], int]:
    @_rpc
    def handler(args: argparse.Namespace) -> int:
        with _client(args) as client:
            _show_status(args, client.call(method, pb.CommandRequest(actor=_actor(), reason=args.reason)))
        return 0

    handler.__name__ = f"cmd_{method.lower()}"
    return handler


if __name__ == "__main__":
    sys.exit(main())
