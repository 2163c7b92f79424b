"""The `KeyAdmin` gRPC service: `services.auth.key_admin` behind the admin token.

Every call carries `authorization: Bearer <admin token>` metadata, compared in constant time;
a missing or wrong token is UNAUTHENTICATED and touches nothing. Refusals keep their own
codes (INVALID_ARGUMENT naming the field, NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION for
a read-only or revoked key, ABORTED for a concurrent change); a store that cannot be reached
is UNAVAILABLE.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from services.auth.key_admin import KeyAdmin, KeyAdminError
from services.auth.managed_keys import ManagedKey
from services.common.admin_token import run_admin
from wire.v1 import keys_pb2, keys_pb2_grpc

_SPEC_FIELDS = tuple(keys_pb2.KeySpec.DESCRIPTOR.fields_by_name)


def info(row: dict[str, Any]) -> keys_pb2.ApiKeyInfo:
    return keys_pb2.ApiKeyInfo(**row)


def secret_answer(admin: KeyAdmin, made: tuple[ManagedKey, str]) -> keys_pb2.KeySecret:
    key, secret = made
    return keys_pb2.KeySecret(key=info(admin.get(key.id)), secret=secret)


def spec_fields(spec: keys_pb2.KeySpec, only: tuple[str, ...] = ()) -> dict[str, Any]:
    """A KeySpec as the fields it sets: those named in `only`, else every non-zero one."""
    if only:
        unknown = [name for name in only if name not in _SPEC_FIELDS]
        if unknown:
            raise KeyAdminError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"fields: no such field {unknown[0]!r}; one of {', '.join(_SPEC_FIELDS)}")
        full = MessageToDict(spec, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        return {name: full[name] for name in only}
    return MessageToDict(spec, preserving_proto_field_name=True)


class KeyAdminService(keys_pb2_grpc.KeyAdminServicer):
    def __init__(self, admin: KeyAdmin, admin_token: str) -> None:
        if not admin_token:
            raise ValueError("admin_token: must be non-empty")
        self.admin = admin
        self._token = admin_token.encode()

    def CreateKey(self, request: keys_pb2.CreateKeyRequest, context: grpc.ServicerContext) -> keys_pb2.KeySecret:
        return run_admin(context, self._token,
                         lambda: secret_answer(self.admin, self.admin.create(spec_fields(request.key))))

    def ListKeys(self, request: keys_pb2.ListKeysRequest, context: grpc.ServicerContext) -> keys_pb2.ListKeysResponse:
        return run_admin(context, self._token, lambda: keys_pb2.ListKeysResponse(keys=[
            info(row) for row in self.admin.list(request.tenant, request.team, request.include_revoked)]))

    def GetKey(self, request: keys_pb2.KeyId, context: grpc.ServicerContext) -> keys_pb2.ApiKeyInfo:
        return run_admin(context, self._token, lambda: info(self.admin.get(request.id)))

    def UpdateKey(self, request: keys_pb2.UpdateKeyRequest, context: grpc.ServicerContext) -> keys_pb2.ApiKeyInfo:
        return run_admin(context, self._token, lambda: info(
            self.admin.update(request.id, spec_fields(request.set, tuple(request.fields)))))

    def RotateKey(self, request: keys_pb2.RotateKeyRequest, context: grpc.ServicerContext) -> keys_pb2.KeySecret:
        return run_admin(context, self._token,
                         lambda: secret_answer(self.admin, self.admin.rotate(request.id, request.overlap_s)))

    def RevokeKey(self, request: keys_pb2.KeyId, context: grpc.ServicerContext) -> keys_pb2.ApiKeyInfo:
        return run_admin(context, self._token, lambda: info(self.admin.revoke(request.id)))
