"""`spine keys …`: API keys managed at run time, and spend, through a spine's admin API.

    spine keys create --tenant T [--id ID] [--team T] [--model M]... [--rpm N] [--tpm N]
                      [--budget USD [--window daily|monthly]] [--expires-in S | --expires-at UNIX]
    spine keys list [--tenant T] [--team T] [--all]
    spine keys update ID [the create options]
    spine keys rotate ID [--overlap S]
    spine keys revoke ID
    spine keys spend [--key-id ID] [--team T] [--tenant T]
    spine keys import FILE [--from lines|litellm]   (spine.tools.key_import: no spine needed)

Every command takes --address (the spine's gRPC address, default the config's `listen`) and
the admin token from --admin-token-file or $SPINE_ADMIN_TOKEN (never from argv); `--ca FILE
[--cert FILE --key FILE]` for a spine that serves TLS; --json. `create` and `rotate` print
the key once: the store keeps only its keyed hash.
Exit codes: 0 ok, 1 refused (no such key, read-only, revoked, id taken), 2 bad input,
3 token not accepted, 4 spine unreachable.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from rich.table import Table

from runtime.tls import add_tls_client_arguments, client_credentials, open_channel, refusal_hint
from services.common.admin_token import read_admin_token
from spine.cli.output import add_output_arguments, as_json, dollars, table_console
from spine.tools.key_import import add_import_parser
from wire.v1 import keys_pb2, keys_pb2_grpc, spend_pb2, spend_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
_EXIT_CODES = {grpc.StatusCode.INVALID_ARGUMENT: 2, grpc.StatusCode.UNAUTHENTICATED: 3,
               grpc.StatusCode.UNAVAILABLE: 4, grpc.StatusCode.DEADLINE_EXCEEDED: 4,
               grpc.StatusCode.UNIMPLEMENTED: 4}
# create/update options -> KeySpec fields
_SPEC_OPTIONS = {"tenant": "tenant", "team": "team", "scope": "scopes", "max_priority": "max_priority",
                 "model": "models", "rpm": "requests_per_minute", "tpm": "tokens_per_minute",
                 "budget": "budget_usd", "window": "budget_window", "expires_at": "expires_at",
                 "expires_in": "expires_in_s"}


def add_keys_parser(subparsers: Any) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--address", default=DEFAULT_ADDRESS, help=f"the spine's gRPC address (default {DEFAULT_ADDRESS})")
    common.add_argument("--admin-token-file", help="file holding the admin token (else $SPINE_ADMIN_TOKEN)")
    add_output_arguments(common)
    common.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    add_tls_client_arguments(common)
    spec = argparse.ArgumentParser(add_help=False)
    spec.add_argument("--team")
    spec.add_argument("--scope", action="append", help="a scope it grants (repeat; default: generate)")
    spec.add_argument("--max-priority", type=int)
    spec.add_argument("--model", action="append", help="a model id or alias it may use (repeat; default: every one)")
    spec.add_argument("--rpm", type=float, help="its own requests per minute")
    spec.add_argument("--tpm", type=float, help="its own tokens per minute")
    spec.add_argument("--budget", type=float, help="what it may spend per window, USD")
    spec.add_argument("--window", choices=("daily", "monthly"), help="the budget's window (default monthly)")
    expiry = spec.add_mutually_exclusive_group()
    expiry.add_argument("--expires-in", type=float, metavar="SECONDS")
    expiry.add_argument("--expires-at", type=float, metavar="UNIX_SECONDS")

    keys: argparse.ArgumentParser = subparsers.add_parser("keys", help="API keys managed at run time, and spend (the admin API); import a "
                                              "legacy gateway's key list as auth.api_keys")
    sub = keys.add_subparsers(dest="keys_command", required=True)
    add_import_parser(sub)
    create = sub.add_parser("create", parents=[common, spec], help="make a key (printed once)")
    create.add_argument("--tenant", required=True)
    create.add_argument("--id", help="its id (default: one is picked)")
    create.set_defaults(handler=cmd_create)
    listing = sub.add_parser("list", parents=[common], help="every key (never a secret)")
    listing.add_argument("--tenant", default="")
    listing.add_argument("--team", default="")
    listing.add_argument("--all", action="store_true", help="revoked keys too")
    listing.set_defaults(handler=cmd_list)
    update = sub.add_parser("update", parents=[common, spec], help="change what a key may do")
    update.add_argument("id")
    update.add_argument("--tenant")
    update.set_defaults(handler=cmd_update)
    rotate = sub.add_parser("rotate", parents=[common], help="a new secret; the old one works --overlap more seconds")
    rotate.add_argument("id")
    rotate.add_argument("--overlap", type=float, default=0.0, metavar="SECONDS")
    rotate.set_defaults(handler=cmd_rotate)
    revoke = sub.add_parser("revoke", parents=[common], help="refused on every replica within a second")
    revoke.add_argument("id")
    revoke.set_defaults(handler=cmd_revoke)
    spend = sub.add_parser("spend", parents=[common], help="spend in the current day and month")
    spend.add_argument("--key-id", default="", help="one key's spend")
    spend.add_argument("--team", default="")
    spend.add_argument("--tenant", default="")
    spend.set_defaults(handler=cmd_spend)
    return keys


class _Admin:
    def __init__(self, args: argparse.Namespace) -> None:
        self.channel = open_channel(args.address, client_credentials(args))
        self.keys = keys_pb2_grpc.KeyAdminStub(self.channel)
        self.spend = spend_pb2_grpc.SpendAdminStub(self.channel)
        self.options = {"metadata": (("authorization", f"Bearer {read_admin_token(args.admin_token_file)}"),),
                        "timeout": args.timeout}


@contextmanager
def _admin(args: argparse.Namespace) -> Iterator[_Admin]:
    admin = _Admin(args)
    try:
        yield admin
    finally:
        admin.channel.close()


def _rpc(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            if code is grpc.StatusCode.UNIMPLEMENTED:
                details = (f"{args.address} serves no admin API: start it with an admin token "
                           "(spine up --admin-token-file FILE, or $SPINE_ADMIN_TOKEN)")
            elif code is grpc.StatusCode.UNAVAILABLE and "store" not in (details or ""):
                details = f"cannot reach the spine at {args.address}: {details}"
            print(f"error ({code.name.lower()}): {details}", file=sys.stderr)
            if hint := refusal_hint(code, details, getattr(args, "ca", None) is not None):
                print(f"hint: {hint}", file=sys.stderr)
            return _EXIT_CODES.get(code, 1)

    return wrapper


def _spec(args: argparse.Namespace) -> tuple[keys_pb2.KeySpec, list[str]]:
    values = {field: getattr(args, option) for option, field in _SPEC_OPTIONS.items()
              if getattr(args, option, None) is not None}
    return keys_pb2.KeySpec(**values), list(values)


def _plain(message: Any) -> dict[str, Any]:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _show_keys(args: argparse.Namespace, rows: list[keys_pb2.ApiKeyInfo], one: bool = False) -> None:
    if as_json(args):
        print(json.dumps(_plain(rows[0]) if one else [_plain(row) for row in rows], indent=2))
        return
    table = Table("id", "tenant", "team", "state", "models", "rpm", "tpm", "budget", "expires", "shown")
    for row in rows:
        table.add_row(row.id + (" (config)" if row.read_only else ""), row.tenant, row.team, row.state,
                      ",".join(row.models) or "all", f"{row.requests_per_minute:g}" if row.requests_per_minute else "",
                      f"{row.tokens_per_minute:g}" if row.tokens_per_minute else "",
                      f"${dollars(row.budget_usd)}/{row.budget_window}" if row.budget_usd else "",
                      f"{row.expires_at:.0f}" if row.expires_at else "", row.shown)
    table_console().print(table)


def _show_secret(args: argparse.Namespace, answer: keys_pb2.KeySecret) -> None:
    if as_json(args):
        print(json.dumps({"key": _plain(answer.key), "secret": answer.secret}, indent=2))
        return
    _show_keys(args, [answer.key])
    print(f"key {answer.key.id}: {answer.secret}")
    print("this is the only time the key is shown: the store keeps only its keyed hash", file=sys.stderr)


@_rpc
def cmd_create(args: argparse.Namespace) -> int:
    spec, _ = _spec(args)
    spec.id = args.id or ""
    with _admin(args) as admin:
        _show_secret(args, admin.keys.CreateKey(keys_pb2.CreateKeyRequest(key=spec), **admin.options))
    return 0


@_rpc
def cmd_list(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        answer = admin.keys.ListKeys(keys_pb2.ListKeysRequest(tenant=args.tenant, team=args.team,
                                                              include_revoked=args.all), **admin.options)
    _show_keys(args, list(answer.keys))
    return 0


@_rpc
def cmd_update(args: argparse.Namespace) -> int:
    spec, fields = _spec(args)
    if not fields:
        print("error (invalid_argument): nothing to change: give one of the create options", file=sys.stderr)
        return 2
    with _admin(args) as admin:
        row = admin.keys.UpdateKey(keys_pb2.UpdateKeyRequest(id=args.id, set=spec, fields=fields), **admin.options)
    _show_keys(args, [row], one=True)
    return 0


@_rpc
def cmd_rotate(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        answer = admin.keys.RotateKey(keys_pb2.RotateKeyRequest(id=args.id, overlap_s=args.overlap), **admin.options)
    _show_secret(args, answer)
    return 0


@_rpc
def cmd_revoke(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        row = admin.keys.RevokeKey(keys_pb2.KeyId(id=args.id), **admin.options)
    _show_keys(args, [row], one=True)
    return 0


@_rpc
def cmd_spend(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        answer = admin.spend.GetSpend(spend_pb2.SpendRequest(key=args.key_id, team=args.team, tenant=args.tenant),
                                      **admin.options)
    if as_json(args):
        print(json.dumps([_plain(line) for line in answer.lines], indent=2))
        return 0
    table = Table("scope", "name", "window", "period", "usd", "input", "cached", "output", "requests", "budget",
                  "remaining")
    for line in answer.lines:
        table.add_row(line.scope, line.name, line.window, line.period, f"{line.usd:.6f}", str(line.input_tokens),
                      str(line.cached_input_tokens), str(line.output_tokens), str(line.requests),
                      dollars(line.budget_usd) if line.budget_usd else "",
                      f"{line.remaining_usd:.6f}" if line.budget_usd else "")
    table_console().print(table)
    return 0
