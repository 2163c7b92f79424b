"""A component placed in this process: its servicer behind its interface, under the wire's rules.

The servicer implements its interface itself (`services/<name>/api.py`); what a call in this
process adds is what the wire would have done to it (`services.pipeline.local_call.call_batch`:
the deadline before and after, an exception as UNKNOWN). One class per interface, made from
the interface's table of operations, so every component is reached the same way — the twin
of `runtime.placement.remote`, which makes the other placement from the same table.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

from services.inference.api import AsyncChunkStream, Generated
from services.pipeline.interface import NO_OPTIONS, CallOptions, Interface
from services.pipeline.local_call import call_batch
from wire.v1 import generation_pb2

T = TypeVar("T")


class InProcess:
    """Base of the in-process implementations: the servicer they call."""

    placement = "local"

    def __init__(self, servicer: object) -> None:
        self.servicer = servicer

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {type(self.servicer).__name__}>"

    # A servicer that can also answer on the caller's event loop (`services.inference.api.OnLoop`:
    # an upstream engine's answer) is reached that way too; the rules are the servicer's
    # (`services.pipeline.local_call.call_local_on_loop`).
    def on_loop(self, model: str) -> bool:
        check = getattr(self.servicer, "on_loop", None)
        return check is not None and bool(check(model))

    async def generate_on_loop(self, request: generation_pb2.GenerateRequest,
                               options: CallOptions = NO_OPTIONS) -> Generated:
        answer: Generated = await self.servicer.generate_on_loop(request, options)  # type: ignore[attr-defined]
        return answer

    def generate_stream_on_loop(self, request: generation_pb2.GenerateRequest,
                                options: CallOptions = NO_OPTIONS) -> AsyncChunkStream:
        stream: AsyncChunkStream = self.servicer.generate_stream_on_loop(request, options)  # type: ignore[attr-defined]
        return stream


def in_process(interface: Interface[T], servicer: T) -> T:
    """`servicer` as its component's callers reach it in this process. The servicer is a `T`
    (the component table's factory says so, `services.component.ComponentSpec`); the one cast
    is the class made from the interface's table of operations, which the type checker cannot
    follow: each of its methods calls the servicer's method of the same name."""
    return cast(T, _in_process_class(interface)(servicer))


@functools.cache
def _in_process_class(interface: Interface[Any]) -> type[InProcess]:
    operations = {name: _operation(name) for name in interface.methods}
    return type(f"InProcess_{interface.component}", (InProcess,), operations)


def _operation(name: str) -> Callable[..., Any]:
    def operation(self: InProcess, argument: Any, options: CallOptions = NO_OPTIONS) -> Any:
        method = getattr(self.servicer, name)
        return call_batch(lambda: method(argument, options), options.timeout)

    operation.__name__ = name
    return operation
