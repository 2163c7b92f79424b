"""A component's interface: what every caller sees of it, wherever it runs.

Each middleware declares a `typing.Protocol` of its operations (`services/<name>/api.py`) and
an `Interface` that says how each operation crosses the wire: a batch rpc on plain items
(`BatchRpc`, `services.pipeline.batch_rpc`), a unary rpc (`UnaryRpc`) or a server stream
(`StreamRpc`). Three kinds of object implement a Protocol, and a caller cannot tell them apart:

- its servicer, in this process (the spine's placement, with the wire's rules added by
  `runtime.placement.in_process`);
- one generic proxy for every interface (`runtime.placement.remote`), which encodes each call with the
  method's codec and sends it over gRPC (the layered placement);
- a client of another service's protocol (Envoy's ext_authz or rate limit service), for a
  placement on a service the team already runs.

Service Weaver's shape in Python: the component never knows which one its callers hold, and
moving it swaps one object behind its interface. `CallOptions` is what travels with every
call in every placement: its budget, its metadata and, for a call a client may walk away
from, the client's own call (its cancellation reaches the component).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, cast

from services.pipeline.batch_rpc import BatchRpc

T = TypeVar("T")
Request = TypeVar("Request")
Response = TypeVar("Response")

Metadata = Sequence[tuple[str, str]]
CallMetadata = Sequence[tuple[str, str | bytes]]  # what a call sends: a `-bin` key carries bytes


class Cancellable(Protocol):
    """A caller's own call (a gRPC servicer context, or its in-process twin): a callback
    added to it runs when it ends, so a component's work stops with its client."""

    def add_callback(self, callback: Callable[[], None]) -> bool: ...

    def time_remaining(self) -> float | None: ...


@dataclass(frozen=True, slots=True)
class CallOptions:
    """What travels with a call: how long the caller waits (seconds; None: no limit), the
    metadata it sends (the request id, the trace context), and the caller's own call whose
    end ends this one (`parent`)."""

    timeout: float | None = None
    metadata: CallMetadata = ()
    parent: Cancellable | None = None


NO_OPTIONS = CallOptions()


@dataclass(frozen=True)
class UnaryRpc(Generic[Request, Response]):
    """A unary rpc as an operation of an interface: `encode`/`decode` turn its argument into
    the rpc's request and the rpc's answer (with its trailing metadata) into its result."""

    rpc: str  # the proto's method, e.g. "SetShare"
    method: str  # the interface's operation, e.g. "set_share"
    encode: Callable[[Request], Any]
    decode: Callable[[Any, Metadata], Response]


@dataclass(frozen=True)
class StreamRpc(Generic[Request]):
    """A server-streaming rpc as an operation: the request message in, a stream of messages out."""

    rpc: str
    method: str


Method = BatchRpc[Any, Any, Any, Any] | UnaryRpc[Any, Any] | StreamRpc[Any]


def message(rpc: str, method: str) -> UnaryRpc[Any, Any]:
    """A unary rpc whose operation takes and returns its messages as they are."""
    return UnaryRpc(rpc, method, _same, _answer)


def _same(value: Any) -> Any:
    return value


def _answer(response: Any, trailing: Metadata) -> Any:
    return response


class Interface(Generic[T]):
    """A component's interface `T` (a Protocol) and how each of its operations crosses the
    wire. Declared once per component, e.g. `AUTH: Interface[Auth] = Interface("auth", ...)`;
    its type parameter is what a caller gets back for it (`Placed.get`, `runtime.placement.remote`)."""

    def __init__(self, component: str, methods: Sequence[Method]) -> None:
        self.component = component
        self.methods: Mapping[str, Method] = {_name(method): method for method in methods}

    def __repr__(self) -> str:
        return f"<Interface {self.component}: {', '.join(self.methods)}>"


def _name(method: Method) -> str:
    return method.method


class Placed:
    """Each component as its callers reach it now — its servicer, a remote proxy or a foreign
    client — by interface. Moving a component is one `swap`: a dict assignment, so a caller
    sees the old implementation or the new one, never a mix; a call already made finishes
    where it started."""

    def __init__(self, implementations: Mapping[str, object] | None = None) -> None:
        self._by_component: dict[str, object] = dict(implementations or {})

    def get(self, interface: Interface[T]) -> T:
        return cast(T, self._by_component[interface.component])

    def named(self, component: str) -> object:
        """The implementation of `component` (for code that handles every component alike)."""
        return self._by_component[component]

    def swap(self, component: str, implementation: object) -> object | None:
        """Put `implementation` in place of `component`'s; the one it replaces (None: none)."""
        old = self._by_component.get(component)
        self._by_component[component] = implementation
        return old

    def items(self) -> list[tuple[str, object]]:
        return list(self._by_component.items())

    def __contains__(self, component: object) -> bool:
        return component in self._by_component
