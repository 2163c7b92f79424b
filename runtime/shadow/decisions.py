"""What two layouts must agree on for one request, and how to compare it.

Shared by `spine ab` (every request through every layout) and shadow mode (a share of
live requests mirrored by the front or by the spine itself), so all count a mismatch the
same way.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, get_args

import grpc

from runtime.config.sections import DecisionField
from wire.v1 import generation_pb2

# The shadow section's `ignore_fields` names these; its schema lists them (a test keeps both
# equal to Decision's fields).
FIELDS: tuple[str, ...] = get_args(DecisionField)
# Codes that say the layout failed, as opposed to a request that was rightly refused: what
# the error-rate gate counts, and answers the shadow mirror does not compare.
LAYOUT_ERRORS = frozenset({"UNAVAILABLE", "INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED", "DATA_LOSS"})
_TIMING = re.compile(r"\d+(\.\d+)?s\b")
_AUTH_DENIED = ("UNAUTHENTICATED", "PERMISSION_DENIED")


@dataclass(frozen=True)
class Decision:
    """One request's outcome, less what legitimately varies (latency, retry-after)."""

    status: str
    details: str
    auth: str        # "passed" | "denied"
    ratelimit: str   # "passed" | "limited"
    route: str       # the resolved model, "" when the request never got an answer
    cached: bool
    # The answer's token ids (None: sampled without a seed, so any answer is right). An upstream
    # engine's answer has no ids, only text: its characters' code points are compared instead,
    # so a spine answering differently over an engine is caught as over a built-in model.
    tokens: tuple[int, ...] | None

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["tokens"] = None if self.tokens is None else list(self.tokens)
        return data


def decide(request: generation_pb2.GenerateRequest, code: grpc.StatusCode | str, details: str = "",
           response: generation_pb2.GenerateResponse | None = None,
           chunks: Sequence[generation_pb2.GenerateChunk] = ()) -> Decision:
    """The decision a layout took on `request`, from its status and answer (or stream)."""
    status = code if isinstance(code, str) else code.name
    if response is not None:
        tokens: tuple[int, ...] = tuple(response.token_ids)
        cached, model = response.cached, response.model
        text = response.text
    else:
        tokens = tuple(t for chunk in chunks for t in chunk.token_ids)
        cached = any(chunk.cached for chunk in chunks)
        model = next((chunk.model for chunk in chunks if chunk.model), "")
        text = "".join(chunk.text for chunk in chunks)
    if not tokens and text:  # an upstream engine's answer carries no token ids: its characters stand in
        tokens = tuple(map(ord, text))
    sampled_unseeded = request.temperature > 0 and not request.HasField("seed")
    limited = status == "RESOURCE_EXHAUSTED" and "rate limit" in details
    return Decision(
        status=status,
        details=_TIMING.sub("<t>", details) if status != "OK" else "",
        auth="denied" if status in _AUTH_DENIED else "passed",
        ratelimit="limited" if limited else "passed",
        route=model if status == "OK" else ("not_found" if status == "NOT_FOUND" else ""),
        cached=cached,
        tokens=None if sampled_unseeded or status != "OK" else tokens,
    )


# A request is authenticated, then rate limited, then answered or refused (its status): a side
# that stopped it at one of these had nothing to say about anything after it.
_STOPS = ("auth", "ratelimit", "status")
# Another model answers with other tokens (and another cache entry).
_ROUTE_CONSEQUENCES = ("tokens", "cached")


def differing(a: Decision, b: Decision, ignore: Iterable[str] = ()) -> tuple[str, ...]:
    """The fields on which two decisions differ, in `FIELDS` order."""
    skip = set(ignore)
    return tuple(name for name in FIELDS if name not in skip and getattr(a, name) != getattr(b, name))


def root_differences(a: Decision, b: Decision, ignore: Iterable[str] = ()) -> tuple[str, ...]:
    """The fields two decisions differ on as causes, not as consequences of another difference.

    One side rate limited and the other answered differ in status, details, route and tokens
    too, but only because of the limiter. Counting those as well made the parity gate's noise
    wrong: a tenant at its limit, where a copy is limited or not by timing alone, made
    `tokens` noise, and a spine answering other tokens was excused. The first differing stop
    (`_STOPS`) is the whole difference; a differing route explains the tokens. A pair
    explained by an ignored field differs in nothing.
    """
    every = differing(a, b)
    skip = set(ignore)
    for stop in _STOPS:
        if stop in every:
            return () if stop in skip else (stop,)
    if "route" in every:
        every = tuple(name for name in every if name not in _ROUTE_CONSEQUENCES)
    return tuple(name for name in every if name not in skip)


def first_difference(name: str, a: Decision, b: Decision, a_side: str = "a", b_side: str = "b") -> str:
    """Where two decisions differ in field `name`, in a few words (a log line's, not the
    whole answers: a real model's tokens run to hundreds): "tokens differ at position 3
    (layered 8 tokens, spine 8)", "status: layered OK, spine NOT_FOUND"."""
    left, right = getattr(a, name), getattr(b, name)
    if name == "tokens" and left is not None and right is not None:
        at = next((i for i, (x, y) in enumerate(zip(left, right, strict=False)) if x != y), min(len(left), len(right)))
        return f"tokens differ at position {at} ({a_side} {len(left)} tokens, {b_side} {len(right)})"
    return f"{name}: {a_side} {_short(left)}, {b_side} {_short(right)}"


def _short(value: Any, limit: int = 80) -> str:
    text = "no tokens (sampled)" if value is None else str(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"
