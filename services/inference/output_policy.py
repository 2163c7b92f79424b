"""The output policy: what a model's answer may not say, checked before it reaches the client.

The gateway runs it where the model's output passes (`services.gateway.service`), the same
code in every layout, after the model (or the cache) and before any byte is sent: a unary
answer is checked whole; a stream chunk by chunk, each over a window (the last
`window_chars` characters already released plus the chunk) before the chunk is released, so
a phrase split across chunks is still caught and its last piece is never sent.

A rule is a list of phrases (matched as text, case-insensitive unless `case_sensitive`),
regular expressions, and optionally a classifier (`module:function`, for a model that ships
one: called with the text and its token ids, truthy on a violation). It applies to the
tenants and models it names (none named: all). Everything is compiled once, at start; the
rules of a (tenant, model) pair are looked up once and remembered.

A violation ends the answer with `FAILED_PRECONDITION`, details starting
`content_policy_violation` (`VIOLATION`): a status the Gateway API never answers otherwise,
so a client can tell it apart by the code alone. The log line and the details name the rule,
never the offending text.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import grpc
from pydantic import Field, StrictBool, StrictInt, field_validator

from services.common import ConfigError
from services.common.config_section import Items, NonEmptyStr, Section, problem

VIOLATION = "content_policy_violation"
VIOLATION_CODE = grpc.StatusCode.FAILED_PRECONDITION

Classifier = Callable[[str, Sequence[int]], Any]


class PolicyRule(Section):
    """One rule of `output_policy.rules`."""

    name: NonEmptyStr
    phrases: Items[NonEmptyStr] = ()
    patterns: Items[NonEmptyStr] = ()  # Python regular expressions
    case_sensitive: StrictBool = False
    classifier: Annotated[str, Field(pattern=r"^[\w.]+:\w+$")] | None = None  # "package.module:function"
    tenants: Items[NonEmptyStr] = ()  # none: every tenant
    models: Items[NonEmptyStr] = ()  # resolved model ids; none: every model

    @field_validator("patterns")
    @classmethod
    def _patterns_compile(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        for i, pattern in enumerate(patterns):
            try:
                re.compile(pattern)
            except re.error as error:
                raise problem(f"not a regular expression: {error}", i) from None
        return patterns


class OutputPolicyConfig(Section):
    """The `output_policy` section (no rules: nothing is checked, at no cost)."""

    where = "output_policy"

    rules: Items[PolicyRule] = ()
    window_chars: Annotated[StrictInt, Field(ge=16)] = 256  # a stream's text re-checked with each chunk

    @field_validator("rules")
    @classmethod
    def _names_are_unique(cls, rules: tuple[PolicyRule, ...]) -> tuple[PolicyRule, ...]:
        seen: set[str] = set()
        for i, rule in enumerate(rules):
            if rule.name in seen:
                raise problem(f"rule {rule.name!r} is named twice", i, "name")
            seen.add(rule.name)
        return rules


@dataclass(frozen=True)
class Violation:
    """Which rule an answer broke, and how (never the text)."""

    rule: str
    kind: str  # "phrase or pattern" | "classifier"

    @property
    def details(self) -> str:
        return (f"{VIOLATION}: the answer broke the output policy (rule {self.rule!r}, {self.kind}); "
                f"suggestion: rephrase")


def load_classifier(path: str) -> Classifier:
    """The callable a rule's `classifier` names (ImportError/AttributeError when it does not exist)."""
    module, _, attribute = path.partition(":")
    found = getattr(importlib.import_module(module), attribute)
    if not callable(found):
        raise TypeError(f"classifier {path!r} is not callable")
    return found  # type: ignore[no-any-return]


class CompiledRule:
    """A rule made ready: its phrases and patterns one regular expression, its classifier imported."""

    def __init__(self, rule: PolicyRule) -> None:
        self.name = rule.name
        alternatives = [re.escape(phrase) for phrase in rule.phrases] + [f"(?:{p})" for p in rule.patterns]
        flags = 0 if rule.case_sensitive else re.IGNORECASE
        self.regex = re.compile("|".join(alternatives), flags) if alternatives else None
        self.classifier = load_classifier(rule.classifier) if rule.classifier else None
        self.tenants = frozenset(rule.tenants)
        self.models = frozenset(rule.models)

    def applies(self, tenant: str, model: str) -> bool:
        return (not self.tenants or tenant in self.tenants) and (not self.models or model in self.models)

    def check(self, text: str, token_ids: Sequence[int]) -> Violation | None:
        if self.regex is not None and self.regex.search(text):
            return Violation(self.name, "phrase or pattern")
        if self.classifier is not None and self.classifier(text, token_ids):
            return Violation(self.name, "classifier")
        return None


class OutputPolicy:
    """Every rule compiled once; `check` a whole answer, `stream` a window per chunk."""

    def __init__(self, config: OutputPolicyConfig) -> None:
        self.window_chars = config.window_chars
        rules = []
        for i, rule in enumerate(config.rules):
            try:
                rules.append(CompiledRule(rule))
            except (ImportError, AttributeError, TypeError) as error:
                raise ConfigError(f"output_policy.rules[{i}].classifier: cannot use {rule.classifier!r}: "
                                  f"{error}") from None
        self.rules = tuple(rules)
        self._for: dict[tuple[str, str], tuple[CompiledRule, ...]] = {}

    @classmethod
    def of(cls, section: OutputPolicyConfig) -> OutputPolicy | None:
        """The section's policy; None when it has no rule (the gateway then checks nothing)."""
        return cls(section) if section.rules else None

    def rules_for(self, tenant: str, model: str) -> tuple[CompiledRule, ...]:
        found = self._for.get((tenant, model))
        if found is None:
            found = tuple(rule for rule in self.rules if rule.applies(tenant, model))
            if len(self._for) < 4096:  # tenants and model ids are the server's own names: few
                self._for[(tenant, model)] = found
        return found

    def check(self, tenant: str, model: str, text: str, token_ids: Sequence[int]) -> Violation | None:
        """A whole answer: the first rule it breaks, or None."""
        for rule in self.rules_for(tenant, model):
            found = rule.check(text, token_ids)
            if found is not None:
                return found
        return None

    def stream(self, tenant: str, model: str) -> StreamCheck | None:
        """The check of one stream, chunk by chunk; None when no rule applies to it."""
        rules = self.rules_for(tenant, model)
        return StreamCheck(rules, self.window_chars) if rules else None


class StreamCheck:
    """One stream's window: the text (and tokens) already released, up to `window_chars`."""

    def __init__(self, rules: tuple[CompiledRule, ...], window_chars: int) -> None:
        self._rules = rules
        self._window = window_chars
        self._text = ""
        self._tokens: list[int] = []
        self._keeps_tokens = any(rule.classifier is not None for rule in rules)  # only a classifier reads them

    def check(self, text: str, token_ids: Sequence[int]) -> Violation | None:
        """Whether the next chunk may be released: the window with it, checked by every rule."""
        window = self._text + text
        tokens = [*self._tokens, *token_ids] if self._keeps_tokens else self._tokens
        for rule in self._rules:
            found = rule.check(window, tokens)
            if found is not None:
                return found
        self._text = window[-self._window:]
        if self._keeps_tokens:
            self._tokens = tokens[-self._window:]
        return None
