"""The admin token: read from a file or SPINE_ADMIN_TOKEN, never from argv; and how an admin
API checks it (the controller's operator API, the spine's key and spend admin APIs).

Command lines are visible to every user of the machine (`ps`), so a token on argv is a
leaked token. Files and the environment are not — as long as the file is the user's alone:
a token file readable by group or others is refused, as ssh refuses such a private key.
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

import grpc

from services.common import ConfigError

log = logging.getLogger("spine.admin")
T = TypeVar("T")

ENV_VAR = "SPINE_ADMIN_TOKEN"
MIN_LENGTH = 16


def read_secret_file(path: str, flag: str) -> str:
    """A secret from `path` (stripped), refused when group or others can read the file."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        secret = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path}: {exc.strerror}") from None
    if mode & 0o077:  # like ssh with a private key: a secret others can read is no secret
        raise ConfigError(f"{flag} {path}: readable by other users (mode {mode:04o}); chmod 600 {path}")
    return secret


def token_matches(presented: str | bytes, token: str | bytes) -> bool:
    """Whether `presented` is the admin token, in constant time (no timing oracle)."""
    given = presented.encode() if isinstance(presented, str) else presented
    expected = token.encode() if isinstance(token, str) else token
    return bool(given) and hmac.compare_digest(given, expected)


def bearer(header: str) -> str:
    """The credential of an `authorization: Bearer <token>` value ("" for any other scheme)."""
    scheme, _, credential = header.partition(" ")
    return credential.strip() if scheme.lower() == "bearer" else ""


def read_admin_token(path: str | None, env: Mapping[str, str] | None = None) -> str:
    """The token from `path` if given, else from $SPINE_ADMIN_TOKEN; ConfigError if neither."""
    env = os.environ if env is None else env
    if path:
        token = read_secret_file(path, "--admin-token-file")
        where = f"--admin-token-file {path}"
    else:
        token = env.get(ENV_VAR, "").strip()
        where = f"${ENV_VAR}"
        if not token:
            raise ConfigError(f"no admin token: pass --admin-token-file FILE or set ${ENV_VAR}")
    if len(token) < MIN_LENGTH:
        raise ConfigError(f"{where}: the admin token must be at least {MIN_LENGTH} characters, "
                          f"got {len(token)}")
    return token


class AdminError(Exception):
    """A refused admin call: its gRPC code and a message an admin can act on."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def authorize(context: grpc.ServicerContext, token: bytes) -> None:
    """Abort with UNAUTHENTICATED unless the call carries the admin token."""
    value = dict(context.invocation_metadata() or ()).get("authorization", "")
    presented = bearer(value if isinstance(value, str) else value.decode("latin-1"))
    if not presented:
        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                      "missing admin token: send `authorization: Bearer <token>` metadata")
    if not token_matches(presented, token):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "admin token not accepted")


def run_admin(context: grpc.ServicerContext, token: bytes, call: Callable[[], T]) -> T:
    """`call` for a caller with the admin token, its refusals (`AdminError`) as the call's
    status; a store that cannot be reached is UNAVAILABLE."""
    authorize(context, token)
    try:
        return call()
    except AdminError as error:
        context.abort(error.code, error.message)
    except Exception as error:  # redis.RedisError, sqlite3.Error, OSError
        log.warning("admin call failed: %s: %s", type(error).__name__, error)
        context.abort(grpc.StatusCode.UNAVAILABLE, f"the store cannot be reached: {type(error).__name__}")
    raise AssertionError("context.abort returned")  # pragma: no cover
