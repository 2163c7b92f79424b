"""A dataclass and the protobuf message with the same field names, converted by name.

An item that crosses the wire is a dataclass on each side (cheap to build and read, typed) and a
message between them. Spelling the fields out in the encoder, again in the decoder and once
more in the dataclass let a field added to one of the three be dropped silently by another;
`FieldCodec` reads the names from the dataclass once, refuses at import time a dataclass
whose fields the message lacks, and converts by name in both directions.

Only scalar fields are converted (a repeated or message field would come back as a protobuf
container, not the dataclass's type): a record with such a field says so when the codec is made.
"""

from __future__ import annotations

from dataclasses import fields
from operator import attrgetter
from typing import TYPE_CHECKING, Generic, TypeVar

from google.protobuf.message import Message

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Record = TypeVar("Record", bound="DataclassInstance")
Msg = TypeVar("Msg", bound=Message)
_SCALARS = (bool, int, float, str, bytes)  # what a singular scalar field reads as (an enum: int)


class FieldCodec(Generic[Record, Msg]):
    """`record` <-> `message` by field name: every field of the dataclass, in its order, is a
    singular scalar field of the message of the same name (the message may have more)."""

    def __init__(self, record: type[Record], message: type[Msg]) -> None:
        names = tuple(field.name for field in fields(record))
        by_name = message.DESCRIPTOR.fields_by_name
        missing = [name for name in names if name not in by_name]
        if missing:
            raise TypeError(f"{message.DESCRIPTOR.full_name} has no field {', '.join(missing)} "
                            f"of {record.__name__}: add it to the proto, or take it out of the dataclass")
        empty = message()
        composite = [name for name in names if not isinstance(getattr(empty, name), _SCALARS)]
        if composite:
            raise TypeError(f"{record.__name__}.{', '.join(composite)}: only singular scalar fields convert by "
                            "name; convert a repeated or message field by hand")
        self._record = record
        self._message = message
        self._names = names
        self._read = attrgetter(*names) if len(names) > 1 else (lambda value: (getattr(value, names[0]),))

    def to_message(self, record: Record) -> Msg:
        """The message holding `record`'s fields."""
        return self._message(**dict(zip(self._names, self._read(record), strict=True)))

    def from_message(self, message: Msg) -> Record:
        """The dataclass holding `message`'s fields of the same names."""
        return self._record(*self._read(message))
