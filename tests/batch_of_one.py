"""A batch rpc asked about one item, read as that item's answer (a test's shorthand).

Every middleware's rpcs are batch rpcs: a request is a batch of one, and a refused item is
that item's status, not the call's. `one` reads a batch-of-one answer as a single call would
have been read: its response, or its status raised as a `grpc.RpcError`.
"""

from __future__ import annotations

from typing import Any

from services.common import status_code
from services.pipeline.batch_rpc import StatusError


def one(answer: Any) -> Any:
    """The response of a batch-of-one answer (None for a bare status), or its status raised."""
    (result,) = answer.results
    status = result.status if hasattr(result, "response") else result
    if status.code:
        raise StatusError(status_code(status.code), status.message)
    return result.response if hasattr(result, "response") else None
