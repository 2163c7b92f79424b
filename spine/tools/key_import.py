"""`spine keys import`: a legacy gateway's API keys as the spine's `auth.api_keys`, digests only.

During a migration from a foreign gateway the front forwards each client's key unchanged to
both sides, so the spine must accept the keys the gateway accepts. This turns a key list
into a config fragment to lay over the spine's config (`--config`):

- `--from lines`: one key per line, optionally followed by its tenant (`KEY [TENANT]`; `#`
  starts a comment). Each key is hashed here: the fragment holds `key_sha256` only.
- `--from litellm`: LiteLLM's own key table, as `GET /key/list?return_full_object=true`
  answers it (`{"keys": [...]}`) or as a JSON list of its rows. LiteLLM keeps each virtual
  key as the SHA-256 hex of the key (its `token` column), the very digest the spine checks,
  so no plaintext is needed. A key's tenant is its team, else its user, else the key itself
  (`--tenant-by`); with `--tenant-by key` its `rpm_limit`, `tpm_limit` and
  `max_parallel_requests` become that tenant's `ratelimit.tenants` block (a bucket refilling
  rpm/60 a second that holds a minute's worth; tpm likewise).

A key that is given twice, a digest that is not 64 hex characters, or a row without a
token is refused with its line or row; nothing is written then.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from services.common import ConfigError

_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")
_ID = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class ImportedKey:
    id: str
    tenant: str
    key_sha256: str
    limits: dict[str, Any] = field(default_factory=dict)  # the tenant's ratelimit block, when known


def add_import_parser(keys_sub: Any) -> None:
    """`import` under `spine keys` (`spine.cli.keys`, whose other commands are the admin API's)."""
    imp = keys_sub.add_parser("import", help="print a config fragment (auth.api_keys by digest, and per-key "
                                             "limits as ratelimit.tenants) from a key list")
    imp.add_argument("file", help="the key list ('-': standard input)")
    imp.add_argument("--from", dest="source", choices=("lines", "litellm"), default="lines",
                     help="lines: KEY [TENANT] per line; litellm: LiteLLM's /key/list?return_full_object=true JSON")
    imp.add_argument("--tenant", default="legacy", help="with --from lines: the tenant of a key that names none")
    imp.add_argument("--tenant-by", choices=("team", "user", "key"), default="team",
                     help="with --from litellm: a key's tenant is its team (else user, else the key), its user "
                          "(else the key), or the key itself (its limits imported)")
    imp.add_argument("--scopes", default="generate", help="comma-separated scopes every imported key gets")
    imp.add_argument("--out", help="write the fragment here (mode 600) instead of standard output")
    imp.set_defaults(handler=cmd_keys)


def cmd_keys(args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    keys = from_lines(text, args.tenant) if args.source == "lines" else from_litellm(text, args.tenant_by)
    scopes = [scope.strip() for scope in args.scopes.split(",") if scope.strip()]
    fragment = yaml.safe_dump(config_fragment(keys, scopes), sort_keys=False)
    if args.out:
        out = Path(args.out)
        out.touch(mode=0o600, exist_ok=True)
        out.write_text(fragment, encoding="utf-8")
    else:
        sys.stdout.write(fragment)
    print(f"{len(keys)} keys imported for {len({key.tenant for key in keys})} tenants", file=sys.stderr)
    return 0


def from_lines(text: str, tenant: str) -> list[ImportedKey]:
    """`KEY [TENANT]` per line; each key hashed (never kept)."""
    keys: list[ImportedKey] = []
    problems: list[str] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2:
            problems.append(f"line {number}: expected KEY [TENANT], got {len(words)} words")
            continue
        digest = hashlib.sha256(words[0].encode("utf-8")).hexdigest()
        if digest in seen:
            problems.append(f"line {number}: the same key as line {seen[digest]}")
            continue
        seen[digest] = number
        keys.append(ImportedKey(f"imported-{digest[:12]}", words[1] if len(words) == 2 else tenant, digest))
    _raise(problems)
    return keys


def from_litellm(text: str, tenant_by: str = "team") -> list[ImportedKey]:
    """LiteLLM's key rows (`token` = sha256 hex of the key) as imported keys."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"not JSON (LiteLLM's /key/list?return_full_object=true answer): {error}") from None
    rows = data.get("keys") if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise ConfigError("expected LiteLLM's {\"keys\": [...]} or a JSON list of its key rows")
    keys: list[ImportedKey] = []
    problems: list[str] = []
    seen: dict[str, int] = {}
    for index, row in enumerate(rows):
        token = row.get("token") if isinstance(row, dict) else None
        if not isinstance(token, str) or not _SHA256_HEX.fullmatch(token):
            problems.append(f"keys[{index}]: no `token` of 64 hex characters (list the keys with "
                            f"return_full_object=true: a bare list of key names has no digests)")
            continue
        digest = token.lower()
        if digest in seen:
            problems.append(f"keys[{index}]: the same key as keys[{seen[digest]}]")
            continue
        seen[digest] = index
        assert isinstance(row, dict)
        name = _plain(row.get("key_alias") or row.get("key_name") or "") or f"litellm-{digest[:12]}"
        own = f"key-{name}"
        tenant = {"team": row.get("team_id") or row.get("user_id") or own,
                  "user": row.get("user_id") or own, "key": own}[tenant_by]
        limits = _limits(row) if tenant == own else {}
        keys.append(ImportedKey(name, _plain(str(tenant)) or own, digest, limits))
    _raise(problems)
    return keys


def config_fragment(keys: Iterable[ImportedKey], scopes: list[str]) -> dict[str, Any]:
    """`auth.api_keys` (and `ratelimit.tenants` where limits came along) for `--config`."""
    keys = list(keys)
    fragment: dict[str, Any] = {"auth": {"api_keys": [
        {"id": key.id, "tenant": key.tenant, "key_sha256": key.key_sha256, "scopes": list(scopes)} for key in keys]}}
    tenants = {key.tenant: key.limits for key in keys if key.limits}
    if tenants:
        fragment["ratelimit"] = {"tenants": tenants}
    return fragment


def _limits(row: dict[str, Any]) -> dict[str, Any]:
    limits: dict[str, Any] = {}
    rpm, tpm, parallel = row.get("rpm_limit"), row.get("tpm_limit"), row.get("max_parallel_requests")
    if isinstance(rpm, int | float) and rpm > 0:
        limits.update(requests_per_second=rpm / 60.0, burst=float(rpm))
    if isinstance(tpm, int | float) and tpm > 0:
        limits.update(tokens_per_minute=float(tpm), token_burst=float(tpm))
    if isinstance(parallel, int) and parallel > 0:
        limits["max_concurrent_requests"] = parallel
    return limits


def _plain(value: object) -> str:
    return _ID.sub("-", str(value)).strip("-")[:64]


def _raise(problems: list[str]) -> None:
    if problems:
        error = ConfigError("\n".join(problems))
        error.problems = problems  # type: ignore[attr-defined]  # printed one per line by the CLI
        raise error
