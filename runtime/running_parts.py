"""A started thing's parts, each stopped by the `ExitStack` it joined when it started.

A builder (`runtime.stack.Stack`, the cutovers in `migration.traffic`) starts its parts one
after another under one `ExitStack`: each part, once started, puts its own stop on the stack.
A part that fails to start then unwinds the ones before it, and the running thing stops by
closing the stack: the reverse of the order it started in, with no chain of stop calls to keep
in step with the starts. The record it returns derives from `RunningParts`.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self


@dataclass(frozen=True)
class RunningParts:
    """What a started builder holds: its parts' stops, in the order they started.

    `stop()` (or leaving a `with` block) closes the stack; a second stop does nothing."""

    parts: ExitStack = field(repr=False, compare=False)

    def stop(self) -> None:
        self.parts.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()
