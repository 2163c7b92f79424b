"""Config sections as pydantic models: the shared base, field types and the one error format.

Every section of the YAML config is a `Section`: unknown keys are refused (a typo such as
`bach_lines:` must not silently drop a setting) and a loaded section is immutable. A
`ValidationError` becomes a `ConfigError` listing every problem, one per line, as
`<path>: <what is wrong>, got <value>`, where the path is the one the YAML uses
(`auth.api_keys[0].scopes`), so `runtime.config.file` can add the file and line.

Values are strict where YAML is ambiguous: `true` is not the number 1 and `"16"` is not an
integer, as the hand-written parsers this replaces insisted. Secrets (SecretStr fields) and
containers are never echoed back in a message.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Self, TypeVar, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from services.common import ConfigError

T = TypeVar("T")
Loc = tuple[int | str, ...]

_CUSTOM = "config"  # the error type of every problem raised by our own validators
_ECHO_LIMIT = 80


class Section(BaseModel):
    """Base of every config section: unknown keys refused, values immutable once loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # Its key in a config file (`inference`, `auth`), for a top-level section: where its
    # problems are said to be when `parse` is not told.
    where: ClassVar[str] = ""

    @model_validator(mode="before")
    @classmethod
    def _null_is_empty(cls, data: Any) -> Any:
        """YAML's `cache:` with nothing under it is null: the section with all its defaults."""
        return {} if data is None else data

    @classmethod
    def parse(cls, data: Any, where: str | None = None) -> Self:
        """Validate `data` (None reads as an empty section); ConfigError lists every problem under
        `where` (its path in a config file; default the section's own `where`). The one way plain
        data becomes a section."""
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            raise ConfigProblems([str(p) for p in describe(error, cls, cls.where if where is None else where)]) from None


class ConfigProblems(ConfigError):
    """One or more config problems; `problems` holds one line each (also the message, joined)."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = list(problems)


def problem(message: str, *at: int | str, show_input: bool = False) -> PydanticCustomError:
    """An error our validators raise: `message` about the value at `at` below the validated one.

    Raise it from a field or model validator; `at` lets a check on a whole list point at the
    item it is about (`models[1].id`) rather than at the list."""
    return PydanticCustomError(_CUSTOM, "{message}", {"message": message, "at": at, "show_input": show_input})


# --- field types --------------------------------------------------------------------------


def _not_blank(value: str) -> str:
    if not value.strip():
        raise problem("expected a non-empty string", show_input=True)
    return value


def _none_as_empty(value: Any) -> Any:
    """YAML's `key:` with nothing after it is null; for a list or mapping it means 'none'."""
    return () if value is None else value


def _none_as_empty_mapping(value: Any) -> Any:
    return {} if value is None else value


NonEmptyStr = Annotated[StrictStr, AfterValidator(_not_blank), Field(json_schema_extra={"minLength": 1})]
Float = Annotated[StrictFloat, Field(allow_inf_nan=False)]
Items = Annotated[tuple[T, ...], BeforeValidator(_none_as_empty)]
Table = Annotated[dict[str, T], BeforeValidator(_none_as_empty_mapping)]


def one_of_error(message: str) -> WrapValidator:
    """Collapse a union's per-member errors (`'auto'` or an integer) into one line."""

    def validate(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise problem(message, show_input=True) from None

    return WrapValidator(validate)


AutoOrCount = Annotated[
    Literal["auto"] | Annotated[StrictInt, Field(ge=1)], one_of_error("expected 'auto' or an integer >= 1")
]


# --- the error format ---------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One thing wrong: where (`path`, as the YAML spells it) and what."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


def join_path(where: str, loc: Loc) -> str:
    """`auth` + ("api_keys", 0, "id") -> `auth.api_keys[0].id` (the yamlsource path format)."""
    path = where
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path = f"{path}.{part}" if path else str(part)
    return path


def describe(error: ValidationError, model: type[BaseModel], where: str = "") -> list[Problem]:
    """Every error of a validation of `model`, as problems with YAML paths under `where`."""
    problems: list[Problem] = []
    for item in error.errors():
        ctx = item.get("ctx") or {}
        loc: Loc = tuple(item["loc"]) + tuple(ctx.get("at", ()))
        kind = item["type"]
        if kind == "extra_forbidden":
            known = _known_keys(model, loc[:-1])
            noun = "unknown section" if len(loc) == 1 and not where else "unknown key"
            message = f"{noun}; known: {', '.join(known)}" if known else noun
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            message = f"expected a mapping, got {type(item['input']).__name__}"
        elif kind == "missing":
            message = "required"
        elif kind == _CUSTOM:
            message = ctx["message"]
            if ctx.get("show_input"):
                message += _got(item["input"], model, loc)
        else:
            message = item["msg"] + _got(item["input"], model, loc, kind)
        problems.append(Problem(join_path(where, loc), message))
    return problems


def _got(value: Any, model: type[BaseModel], loc: Loc, kind: str = "") -> str:
    """`, got <value>` for a scalar; never a secret's value, a container's or a long text."""
    if isinstance(value, SecretStr) or _is_secret(model, loc):
        return f", got {type(value).__name__}"
    if isinstance(value, Mapping | list | tuple | set):
        return "" if kind in ("too_short", "too_long") else f", got {type(value).__name__}"
    shown = repr(value)
    return f", got {shown if len(shown) <= _ECHO_LIMIT else shown[:_ECHO_LIMIT] + '...'}"


def _known_keys(model: type[BaseModel], loc: Loc) -> list[str]:
    """The keys the section at `loc` accepts, for an 'unknown key' message ([] if not found)."""
    found = _model_in(_type_at(model, loc))
    if found is None:
        return []
    return [info.alias or name for name, info in found.model_fields.items()]


def _is_secret(model: type[BaseModel], loc: Loc) -> bool:
    return any(arg is SecretStr for arg in _flatten(_type_at(model, loc)))


def _type_at(tp: Any, loc: Loc) -> Any:
    """The declared type at `loc` inside `tp`, following models, lists, tuples and dicts."""
    for part in loc:
        tp = _child(tp, part)
        if tp is None:
            return None
    return tp


def _child(tp: Any, part: int | str) -> Any:
    for candidate in _flatten(tp):
        origin, args = typing.get_origin(candidate), typing.get_args(candidate)
        if isinstance(candidate, type) and issubclass(candidate, BaseModel) and isinstance(part, str):
            for name, info in candidate.model_fields.items():
                if part in (name, info.alias):
                    return info.annotation
        elif origin in (list, tuple, Sequence) and isinstance(part, int) and args:
            return args[0]
        elif origin in (dict, Mapping) and isinstance(part, str) and len(args) == 2:
            return args[1]
    return None


def _flatten(tp: Any) -> list[Any]:
    """`tp` without Annotated, split into its union members."""
    if typing.get_origin(tp) is Annotated:
        return _flatten(typing.get_args(tp)[0])
    if typing.get_origin(tp) in (Union, types.UnionType):
        return [member for arg in typing.get_args(tp) for member in _flatten(arg)]
    return [tp]


def _model_in(tp: Any) -> type[BaseModel] | None:
    for candidate in _flatten(tp):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None
