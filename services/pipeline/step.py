"""A step of the request path (auth, rate limit, cache, logs, …), run over a batch of requests.

The request path is an ordered list of steps (see `services/registry.py`), the same list
in every layout. A step knows its component, the rpc it stands for (which names its span),
its phase (admission before the model, completion after the answer), whether it fails
closed or open, and its call budget. It decides a batch of requests with one call of its
component's batch rpc; the per-request path is the same step with a batch of one.

A step only says what its component answered; the `Pipeline` (`pipeline.py`) times it,
runs the hooks (spans, injected faults) around each request's part, enforces the budget
and turns a failed call into each request's verdict, by the step's fail mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import grpc

from services.common import status_code
from services.pipeline.batch_rpc import ItemError
from services.pipeline.interface import CallOptions, Interface
from services.pipeline.limits import RequestLimits
from services.pipeline.state import RequestState
from services.pipeline.verdicts import Stop


class FailMode(StrEnum):
    CLOSED = "closed"  # without it a request must not be served: UNAVAILABLE
    OPEN = "open"  # the request goes on without it; the failure is counted


class Phase(StrEnum):
    ADMIT = "admit"  # before the model; may stop the request
    MODEL = "model"  # the model itself (batched by the engine, not by the pipeline)
    COMPLETE = "complete"  # after the answer; never changes it


@dataclass(frozen=True)
class StepPolicy:
    """What the component table says about the component a step calls."""

    component: str  # "" for the gateway's own checks, which call nothing
    fail_mode: FailMode = FailMode.CLOSED
    budget_s: float = 0.25
    # The component's own verdicts, which reach the client as they are (auth's
    # UNAUTHENTICATED, the router's NOT_FOUND); any other failure is UNAVAILABLE.
    passes: frozenset[grpc.StatusCode] = frozenset()


C = TypeVar("C")  # a component's interface (`services.pipeline.interface`)
C_co = TypeVar("C_co", covariant=True)


class StepCall(Protocol[C_co]):
    """What a step's `decide` uses: its component as placed now (its interface, a direct
    call in the spine and a gRPC call across the wire alike), the options every call of the
    batch carries (the step's budget, the request's id and trace context), and a
    per-request failure."""

    @property
    def component(self) -> C_co: ...

    @property
    def options(self) -> CallOptions: ...

    def fail(self, state: RequestState, code: grpc.StatusCode, message: str,
             trailing: Sequence[tuple[str, str]] = ()) -> None: ...


class ResultCountError(RuntimeError):
    """A component answered a batch with the wrong number of results (a broken peer)."""


# How each type of result carries its status, learnt once per type: 1 has a `status`
# with a `code` (a wire answer's item), 2 is a status itself (has a `code`), 0 carries none (a
# plain result of an operation). Why not `getattr(result, "status", None)` per result:
# on a protobuf message without the field, each miss raises and swallows an
# AttributeError (two per request per step: a large share of a lone request's admission
# in a warm loop, more on a cold core).
_STATUS_KIND: dict[type, int] = {}


def _status_of(result: Any) -> Any:
    """The status a result carries (None for a plain result)."""
    kind = _STATUS_KIND.get(type(result))
    if kind is None:
        kind = 1 if hasattr(getattr(result, "status", None), "code") else 2 if hasattr(result, "code") else 0
        _STATUS_KIND[type(result)] = kind
    return result.status if kind == 1 else result if kind == 2 else None


class Step(Generic[C]):
    """Base of every step. Subclasses set `interface` (the component they call), `method`,
    `phase` and `decide`; their order is the registry's `path`."""

    interface: Interface[C] | None = None  # the component's; None for the gateway's own checks
    method: ClassVar[str] = ""  # the operation, as hooks and spans name the call
    phase: ClassVar[Phase] = Phase.ADMIT
    # A completion step the spine may write a window later, off the request path
    # (`monolith.batched_pipeline.DeferredCompletions`); False: always at the request's last byte.
    deferrable: ClassVar[bool] = True
    # False: `screen` decides every request and `decide` has nothing to do (the gateway's own
    # checks); the runner then skips the call's bookkeeping (its object, two clock reads,
    # a no-op call: small warm for a batch of one, several times that on a cold core).
    decides: ClassVar[bool] = True

    def __init__(self, policy: StepPolicy, limits: RequestLimits) -> None:
        self.policy = policy
        self.limits = limits
        self.component = policy.component
        self.fail_open = policy.fail_mode == FailMode.OPEN
        self.budget_s = policy.budget_s
        self.name = f"{self.component or 'gateway'}.{self.method.lower()}"  # also the span name
        # Whether `screen` can say anything (the runner skips the call on the request path when not).
        self.screens = type(self).screen is not Step.screen

    def wants(self, state: RequestState) -> bool:
        """Whether this step acts on `state` (admission steps: while it is still open)."""
        return state.open

    def screen(self, state: RequestState) -> Stop | None:
        """A verdict that needs no call (e.g. no credential at all); runs before any hook."""
        return None

    def decide(self, batch: list[RequestState], call: StepCall[C]) -> None:
        """Decide each request's part: fill in the state, or `call.fail` it."""
        raise NotImplementedError

    @staticmethod
    def each(results: Sequence[Any], batch: Sequence[Any]) -> Any:
        """Pair results with the requests asked about, refusing a count that does not match."""
        if len(results) != len(batch):
            raise ResultCountError(f"{len(results)} results for {len(batch)} items")
        return zip(batch, results, strict=True)

    @classmethod
    def answered(cls, call: StepCall[Any], batch: Sequence[RequestState], results: Sequence[Any]) -> list[Any]:
        """Each request with its result, but those whose item failed: they go to `call.fail`
        with their item's status (an `ItemError`, a result's `status`, or the result itself
        when it is a status)."""
        ok = []
        for state, result in cls.each(results, batch):
            if isinstance(result, ItemError):
                call.fail(state, result.code, result.message)
                continue
            status = _status_of(result)
            if status is not None and status.code:
                call.fail(state, status_code(status.code), status.message)
            else:
                ok.append((state, result))
        return ok

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.policy.fail_mode} {self.budget_s * 1000:g}ms>"
