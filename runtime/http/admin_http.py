"""`/admin/keys` and `/admin/spend` on the HTTP API's listener: the admin API as JSON.

The same operations as the gRPC `KeyAdmin` and `SpendAdmin` services (`runtime.admin_api`),
behind the same admin token (`Authorization: Bearer <token>`, compared in constant time):

| method and path | does |
|---|---|
| `POST /admin/keys` | create a key: `{"tenant": ..., ...}` -> 201 `{"key": {...}, "secret": "sk-spine-..."}` |
| `GET /admin/keys` | list (`?tenant=`, `?team=`, `?include_revoked=true`); never a secret |
| `GET /admin/keys/{id}` | one key |
| `PATCH /admin/keys/{id}` | change the fields given |
| `POST /admin/keys/{id}/rotate` | a new secret; `{"overlap_s": 3600}` keeps the old one working that long |
| `POST /admin/keys/{id}/revoke`, `DELETE /admin/keys/{id}` | revoke |
| `GET /admin/spend` | spend in the current day and month (`?key=`, `?team=`, `?tenant=`) |

An error is `{"error": {"message", "type", "code"}}` with the status its gRPC code maps to
(400 a bad field, named; 401 the token; 404; 409 taken id, read-only or revoked key, or a
concurrent change; 503 the store unreachable, or its file removed while the process runs: the message
names the file and what to do).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import parse_qs

import grpc
import orjson

from runtime.admin_api import AdminApi
from services.common.admin_token import AdminError, bearer, token_matches

log = logging.getLogger("spine.http")

_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.FAILED_PRECONDITION: 409, grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.UNAVAILABLE: 503,
}


class AdminHttp:
    """Routes an `/admin/` request to the admin API; runs on a handler thread (it does I/O)."""

    def __init__(self, admin: AdminApi) -> None:
        self.admin = admin
        self._token = admin.token.encode()

    def handle(self, method: str, path: str, query: bytes, headers: Mapping[str, str],
               body: Callable[[], Any]) -> tuple[int, bytes]:
        """(status, JSON body) for one request; `body()` reads its JSON (only asked when needed)."""
        try:
            self._authorize(headers)
            status, answer = self._route(method, path.rstrip("/"), parse_qs(query.decode("latin-1")), body)
            return status, orjson.dumps(answer)
        except AdminError as error:
            return _error(_STATUS.get(error.code, 500), error.code, error.message)
        except Exception as error:  # the store unreachable (redis.RedisError, sqlite3.Error, OSError)
            log.warning("admin request %s %s failed: %s: %s", method, path, type(error).__name__, error)
            return _error(503, grpc.StatusCode.UNAVAILABLE, f"the store cannot be reached: {type(error).__name__}")

    def _authorize(self, headers: Mapping[str, str]) -> None:
        presented = bearer(headers.get("authorization", ""))
        if not presented:
            raise AdminError(grpc.StatusCode.UNAUTHENTICATED,
                             "missing admin token: send `Authorization: Bearer <admin token>`")
        if not token_matches(presented, self._token):
            raise AdminError(grpc.StatusCode.UNAUTHENTICATED, "admin token not accepted")

    def _route(self, method: str, path: str, query: dict[str, list[str]],
               body: Callable[[], Any]) -> tuple[int, Any]:
        parts = path.split("/")[2:]  # "", "admin", then these
        if parts == ["spend"] and method == "GET":
            return 200, {"lines": self.admin.spend.report(_one(query, "key"), _one(query, "team"),
                                                          _one(query, "tenant"))}
        if not parts or parts[0] != "keys":
            raise AdminError(grpc.StatusCode.NOT_FOUND, f"no route {path}; the admin API has /admin/keys and "
                                                        "/admin/spend")
        keys = self.admin.keys
        if keys is None:
            raise AdminError(grpc.StatusCode.FAILED_PRECONDITION, "keys managed at run time are off (auth.store.enabled)")
        if parts == ["keys"] and method == "GET":
            return 200, {"keys": keys.list(_one(query, "tenant"), _one(query, "team"),
                                           _one(query, "include_revoked") in ("true", "1"))}
        if parts == ["keys"] and method == "POST":
            return 201, _secret(keys, keys.create(_object(body())))
        if len(parts) == 2 and method == "GET":
            return 200, keys.get(parts[1])
        if len(parts) == 2 and method == "PATCH":
            return 200, keys.update(parts[1], _object(body()))
        if (len(parts) == 2 and method == "DELETE") or (parts[2:] == ["revoke"] and method == "POST"):
            return 200, keys.revoke(parts[1])
        if parts[2:] == ["rotate"] and method == "POST":
            fields = _object(body())
            overlap = fields.get("overlap_s", 0.0)
            if isinstance(overlap, bool) or not isinstance(overlap, int | float):
                raise AdminError(grpc.StatusCode.INVALID_ARGUMENT, f"overlap_s: expected a number, got {overlap!r}")
            return 200, _secret(keys, keys.rotate(parts[1], float(overlap)))
        raise AdminError(grpc.StatusCode.NOT_FOUND, f"no route {method} {path}")


def _secret(keys: Any, made: Any) -> dict[str, Any]:
    key, secret = made
    return {"key": keys.get(key.id), "secret": secret}


def _one(query: dict[str, list[str]], name: str) -> str:
    values = query.get(name)
    return values[-1] if values else ""


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise AdminError(grpc.StatusCode.INVALID_ARGUMENT, "the body must be a JSON object")
    return value


def _error(status: int, code: grpc.StatusCode, message: str) -> tuple[int, bytes]:
    kind = {401: "authentication_error", 404: "not_found_error", 503: "unavailable"}.get(status, "invalid_request_error")
    return status, orjson.dumps({"error": {"message": message, "type": kind, "code": code.name}})
