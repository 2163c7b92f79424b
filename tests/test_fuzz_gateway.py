"""Fuzzing the public Gateway of both layouts (issue 15, part 4).

Hypothesis draws Gateway calls — request fields, credentials (API keys, JWTs, junk),
`x-spine-*`, `x-request-id` and `traceparent` headers, raw bodies that may not decode, a
client deadline now and then, a stream cancelled after its first chunk — and sends each one,
unary or streamed, to a collapsed and a layered stack started once for the module. Every
answer is held to the README:

- its code is the one the "Status codes" table gives for that input (an oracle below,
  written from the README, not from the pipeline's code): never UNKNOWN or INTERNAL, and
  never UNAVAILABLE (every component is up, so nothing can justify it);
- it carries `x-spine-layout` (the layout's name) and `x-request-id` (the caller's when
  short and plain, else one of the server's) in its trailing metadata — unless gRPC itself
  answered before the Gateway saw the call (the client's own deadline, metadata over
  `MAX_METADATA_BYTES`);
- both layouts give the same code and message for the same input, except where the input
  itself is decided by time (a compute budget or a client deadline of a few ms).

After the fuzz both servers are SERVING, every layered child is still its first process (no
crash hidden by a restart), no fail-open middleware failed, no call is left in flight, every
KV slot is free, and a valid request is answered.

Sized for well under a minute of fuzzing on a shared 2-core machine (the stacks' start is
most of the module's time): `EXAMPLES` per property, no example database (`database=None`),
no deadline. The tenants the fuzz authenticates as have limits it can never reach, so no
code depends on rate-limit budget.
"""

from __future__ import annotations

import base64
import hmac
import json
import math
import os
import random
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace.id_generator import IdGenerator

from services.inference_load import parse_load
from spine.runtime.server import MAX_METADATA_BYTES
from spine.runtime.stack import Stack
from spine.runtime.tracing import Tracing, installed_tracing
from spine.v1 import gateway_pb2_grpc, generation_pb2
from tests.conftest import DEV_KEY, JWT_SECRET, TEST_OVERRIDES, config_for_tests, make_jwt, start_stack

LAYOUTS = ("collapsed", "layered")
FUZZ_KEY = "fuzz-tenant-key-0000"
NO_SCOPE_KEY = "fuzz-no-scope-key-0000"
UNLIMITED = {"requests_per_second": 1e6, "burst": 1e6, "tokens_per_minute": 1e12, "token_burst": 1e12}
CONFIG = config_for_tests(
    auth={"api_keys": [*TEST_OVERRIDES["auth"]["api_keys"],
                       {"id": "fuzz-key", "tenant": "fuzz", "key": FUZZ_KEY, "scopes": ["generate"], "max_priority": 1},
                       {"id": "fuzz-no-scope", "tenant": "fuzz", "key": NO_SCOPE_KEY, "scopes": ["read"]}]},
    ratelimit={"tenants": {"dev": UNLIMITED, "fuzz": UNLIMITED}},
)
# Examples per property; SPINE_FUZZ_EXAMPLES=2000 for a longer hunt (about 2 minutes more).
EXAMPLES = int(os.environ.get("SPINE_FUZZ_EXAMPLES", "150"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])
TIMEOUT_S = 30.0  # the client's deadline: far above anything a request here may take

# The README's limits (spine/default_config.yaml), restated: the oracle is not the code's.
KNOWN_MODELS = ("tiny-lm", "default", "tiny")
MAX_PROMPT_CHARS = 2048
MAX_TOKENS = 256
MAX_TEMPERATURE = 2.0
MAX_TIMEOUT_MS = 120_000
TIMED_BELOW_MS = 1_000  # a compute budget under this may or may not be enough: OK or DEADLINE_EXCEEDED
NEVER = {"UNKNOWN", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNIMPLEMENTED"}
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)


# -- the stacks ----------------------------------------------------------------------------
@dataclass
class Side:
    stack: Stack
    channel: grpc.Channel

    @property
    def layout(self) -> str:
        return self.stack.layout


class OwnIds(IdGenerator):
    """Span and trace ids from a generator of their own. The SDK's default draws from the
    `random` module, which hypothesis seeds and watches while it draws an example: a span
    ended meanwhile by a background writer (the spine's deferred completions) would change it."""

    def __init__(self) -> None:
        self._random = random.Random()

    def generate_span_id(self) -> int:
        return self._random.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        return self._random.getrandbits(128) or 1

    def is_trace_id_random(self) -> bool:
        return True


@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory, torch_one_thread: None) -> Iterator[dict[str, Side]]:
    """One collapsed and one layered stack for the whole module, with tracing on (sampled
    at half), so a client's `traceparent` is read on the way in."""
    tmp = tmp_path_factory.mktemp("fuzz")
    tracing = Tracing(sample_ratio=0.5, exporters=[], batch=False)
    setattr(tracing.tracer, "id_generator", OwnIds())  # noqa: B010 (an SDK attribute the API type lacks)
    with installed_tracing(tracing):
        stacks: dict[str, Stack] = {}
        opened: dict[str, Side] = {}
        try:
            for layout in LAYOUTS:
                stacks[layout] = start_stack(layout, tmp, CONFIG)
                channel = grpc.insecure_channel(stacks[layout].address, options=[
                    ("grpc.max_send_message_length", 8 << 20), ("grpc.max_receive_message_length", 8 << 20)])
                opened[layout] = Side(stacks[layout], channel)
            yield opened
        finally:
            for side in opened.values():
                side.channel.close()
            for stack in stacks.values():
                stack.stop()


# -- what a call gave ------------------------------------------------------------------------
@dataclass
class Answer:
    code: str
    details: str
    trailing: dict[str, str]
    responses: list[Any]


def call(side: Side, kind: str, body: Any, metadata: Sequence[tuple[str, Any]], timeout: float = TIMEOUT_S) -> Answer:
    """One call: `kind` is unary|stream|stream-cancel (a GenerateRequest; stream-cancel
    reads one chunk, then cancels) or raw-unary|raw-stream (bytes, no serializers)."""
    if kind.startswith("raw"):
        method = (side.channel.unary_unary("/spine.v1.Gateway/Generate") if kind == "raw-unary"
                  else side.channel.unary_stream("/spine.v1.Gateway/GenerateStream"))
        return _invoke(method, kind, body, metadata, timeout)
    stub = gateway_pb2_grpc.GatewayStub(side.channel)
    return _invoke(stub.Generate if kind == "unary" else stub.GenerateStream, kind, body, metadata, timeout)


def _invoke(method: Any, kind: str, body: Any, metadata: Sequence[tuple[str, Any]], timeout: float) -> Answer:
    if not kind.endswith("unary"):
        stream = method(body, timeout=timeout, metadata=metadata)
        chunks: list[Any] = []
        try:
            for chunk in stream:
                chunks.append(chunk)
                if kind == "stream-cancel":
                    stream.cancel()
                    return Answer("CANCELLED", "cancelled by the fuzz after one chunk", {}, chunks)
        except grpc.RpcError as error:
            return Answer(error.code().name, error.details() or "", dict(stream.trailing_metadata() or ()), chunks)
        return Answer("OK", "", dict(stream.trailing_metadata() or ()), chunks)
    try:
        response, done = method.with_call(body, timeout=timeout, metadata=metadata)
    except grpc.RpcError as failed:
        error: Any = failed
        return Answer(error.code().name, error.details() or "", dict(error.trailing_metadata() or ()), [])
    return Answer("OK", "", dict(done.trailing_metadata() or ()), [response])


# -- credentials ------------------------------------------------------------------------------
# A credential's verdict: the codes auth alone may give it, and an int for "authenticated,
# with this max_priority". More than one where the README leaves the spelling open.
UNAUTH, DENIED = "UNAUTHENTICATED", "PERMISSION_DENIED"


@dataclass(frozen=True)
class Credential:
    metadata: tuple[tuple[str, str], ...]
    verdicts: frozenset[Any]
    label: str


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _token(header: dict[str, Any], payload: dict[str, Any], secret: str | None = JWT_SECRET,
           digest: str = "sha256") -> str:
    """A hand-made JWS: any header and payload, HMAC-signed with the test secret (or unsigned)."""
    signing = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(payload).encode())}"
    if secret is None:
        return signing + "."
    return f"{signing}.{_b64(hmac.new(secret.encode(), signing.encode(), digest).digest())}"


def _claims(tenant: Any = "fuzz", **over: Any) -> dict[str, Any]:
    now = int(time.time())
    claims = {"iss": "spine-dev", "aud": "spine", "sub": "fuzzer", "tenant": tenant, "scope": "generate",
              "iat": now, "exp": now + 600, **over}
    return {k: v for k, v in claims.items() if v is not _DROP}


_DROP = object()
PRINTABLE = st.characters(min_codepoint=0x20, max_codepoint=0x7E)  # what a non-binary header may hold
B64URL = st.text(st.sampled_from("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"), max_size=60)


@st.composite
def jwts(draw: st.DrawFn) -> tuple[str, frozenset[Any]]:
    """A JWT and its verdict: valid ones, and each way one can be wrong."""
    kind = draw(st.sampled_from([
        "valid", "valid-priority", "expired", "not-yet", "wrong-secret", "alg-none", "alg-hs512", "alg-rs256",
        "wrong-iss", "wrong-aud", "no-exp", "no-iss", "no-aud", "no-tenant", "empty-tenant", "tenant-int",
        "no-scope", "other-scope", "scope-list", "scope-int", "sub-int", "bad-priority", "exp-text",
        "exp-huge", "tampered", "truncated", "garbage", "header-not-object", "unicode-tenant", "extra-segment"]))
    tenant = draw(st.sampled_from(["fuzz", "dev"]))
    if kind == "valid":
        return make_jwt(tenant), frozenset({0})
    if kind == "valid-priority":
        priority = draw(st.integers(0, 3))
        return make_jwt(tenant, max_priority=priority), frozenset({priority})
    if kind == "expired":  # beyond the 30 s leeway
        return make_jwt(tenant, expires_in=-draw(st.integers(60, 10**8))), frozenset({UNAUTH})
    if kind == "not-yet":
        return make_jwt(tenant, nbf=int(time.time()) + draw(st.integers(60, 10**6))), frozenset({UNAUTH})
    if kind == "wrong-secret":
        return make_jwt(tenant, secret=draw(st.text(PRINTABLE, min_size=32, max_size=40))), frozenset({UNAUTH})
    if kind == "alg-none":
        return _token({"alg": draw(st.sampled_from(["none", "None", "NONE"])), "typ": "JWT"}, _claims(tenant),
                      None), frozenset({UNAUTH})
    if kind == "alg-hs512":
        return _token({"alg": "HS512", "typ": "JWT"}, _claims(tenant), digest="sha512"), frozenset({UNAUTH})
    if kind == "alg-rs256":  # a public-key algorithm no key is configured for, "signed" with the secret
        return _token({"alg": "RS256", "typ": "JWT"}, _claims(tenant)), frozenset({UNAUTH})
    if kind in ("wrong-iss", "wrong-aud"):
        claim = "iss" if kind == "wrong-iss" else "aud"
        return make_jwt(tenant, **{claim: draw(st.text(max_size=20))}), frozenset({UNAUTH})
    if kind in ("no-exp", "no-iss", "no-aud", "no-tenant"):
        claim = kind.removeprefix("no-")
        claims = _claims(_DROP) if claim == "tenant" else _claims(tenant, **{claim: _DROP})
        return _token({"alg": "HS256", "typ": "JWT"}, claims), frozenset({UNAUTH})
    if kind == "empty-tenant":
        return make_jwt(""), frozenset({UNAUTH})
    if kind == "tenant-int":
        return _token({"alg": "HS256"}, _claims(draw(st.integers()))), frozenset({UNAUTH})  # type: ignore[arg-type]
    if kind == "no-scope":
        return _token({"alg": "HS256"}, _claims(tenant, scope=_DROP)), frozenset({DENIED})
    if kind == "other-scope":
        return make_jwt(tenant, scope=draw(st.sampled_from(["read", "generat", "Generate", ""]))), frozenset({DENIED})
    if kind == "scope-list":
        return make_jwt(tenant, scope=["read", "generate"]), frozenset({0})
    if kind == "scope-int":
        return make_jwt(tenant, scope=draw(st.integers())), frozenset({UNAUTH})
    if kind == "sub-int":
        return make_jwt(tenant, sub=draw(st.integers())), frozenset({UNAUTH})
    if kind == "bad-priority":
        value = draw(st.sampled_from([-1, "1", True, 1.5, None, [1]]))
        return make_jwt(tenant, max_priority=value), frozenset({UNAUTH})
    if kind == "exp-text":
        return make_jwt(tenant, exp=draw(st.sampled_from(["tomorrow", "", None, [1], {"t": 1}]))), frozenset({UNAUTH})
    if kind == "exp-huge":  # a number, far in the future (or too large to be one)
        exp = draw(st.sampled_from([2**53, 10**30, 1e300, 10**400]))
        return make_jwt(tenant, exp=exp), frozenset({0, UNAUTH})
    if kind == "tampered":  # a valid token with one payload character changed
        header, payload, signature = make_jwt(tenant).split(".")
        at = draw(st.integers(0, len(payload) - 1))
        swapped = "A" if payload[at] != "A" else "B"
        return f"{header}.{payload[:at]}{swapped}{payload[at + 1:]}.{signature}", frozenset({UNAUTH, 0})
    if kind == "truncated":
        token = make_jwt(tenant)
        return token[:draw(st.integers(0, len(token) - 1))], frozenset({UNAUTH})
    if kind == "garbage":
        return ".".join(draw(st.lists(B64URL, min_size=3, max_size=3))), frozenset({UNAUTH})
    if kind == "header-not-object":
        header = _b64(draw(st.sampled_from([b"[]", b"1", b"null", b'"x"', b"{"])))
        return f"{header}.{_b64(json.dumps(_claims(tenant)).encode())}.c2ln", frozenset({UNAUTH})
    if kind == "unicode-tenant":
        return make_jwt(draw(st.text(min_size=1, max_size=30))), frozenset({0})
    assert kind == "extra-segment"
    return make_jwt(tenant) + "." + draw(B64URL), frozenset({UNAUTH})


# Kinds of credential that are one `authorization` header each ("several" combines them).
ONE_HEADER = ("key", "key", "jwt", "jwt", "scheme", "junk", "long", "escaped", "near-key", "no-scope")


@st.composite
def credentials(draw: st.DrawFn, kinds: Sequence[str] = (*ONE_HEADER, "missing", "several")) -> Credential:
    """An `authorization` header (or none, or several) and the verdict it must get."""
    kind = draw(st.sampled_from(kinds))
    if kind == "missing":
        return Credential((), frozenset({UNAUTH}), kind)
    if kind == "key":
        key = draw(st.sampled_from([DEV_KEY, FUZZ_KEY]))
        scheme = draw(st.sampled_from(["Bearer", "bearer", "BEARER", "bEaReR"]))
        return Credential((("authorization", f"{scheme} {key}"),), frozenset({1}), kind)
    if kind == "no-scope":
        return Credential((("authorization", f"Bearer {NO_SCOPE_KEY}"),), frozenset({DENIED}), kind)
    if kind == "jwt":
        token, verdicts = draw(jwts())
        return Credential((("authorization", f"Bearer {token}"),), verdicts, f"jwt {token[:12]}")
    if kind == "scheme":  # a good key under a bad scheme or spacing
        key = draw(st.sampled_from([DEV_KEY, make_jwt("fuzz")]))
        value, verdicts = draw(st.sampled_from([
            (f"Basic {key}", {UNAUTH}), (f"Token {key}", {UNAUTH}), (key, {UNAUTH}), ("Bearer", {UNAUTH}),
            ("Bearer ", {UNAUTH}), ("", {UNAUTH}), (f"Bearer{key}", {UNAUTH}), (f"Bearer: {key}", {UNAUTH}),
            # the README does not say whether spacing around the token counts: either, the same in both
            (f"Bearer  {key}", {UNAUTH, 0, 1}), (f"Bearer {key} ", {UNAUTH, 0, 1}),
            (f" Bearer {key}", {UNAUTH, 0, 1}), (f"Bearer {key} extra", {UNAUTH}),
        ]))
        return Credential((("authorization", value),), frozenset(verdicts), kind)
    if kind == "junk":
        return Credential((("authorization", draw(st.text(PRINTABLE, max_size=200))),), frozenset({UNAUTH}), kind)
    if kind == "long":  # up to past the metadata limit (MAX_METADATA_BYTES)
        value = "Bearer " + draw(st.sampled_from("ax.-_")) * draw(st.integers(100, 20_000))
        return Credential((("authorization", value),), frozenset({UNAUTH}), kind)
    if kind == "escaped":  # unicode spelled in ASCII: still not a key
        text = draw(st.text(min_size=1, max_size=40))
        spelled = draw(st.sampled_from([
            text.encode("unicode_escape").decode("ascii"), text.encode("utf-8").hex(),
            "".join(f"%{b:02X}" for b in text.encode("utf-8")), text.encode("punycode").decode("ascii")]))
        spelled = "".join(c for c in spelled if " " <= c <= "~")  # punycode keeps ASCII controls as they are
        return Credential((("authorization", f"Bearer {spelled}"),), frozenset({UNAUTH}), kind)
    if kind == "near-key":
        near = draw(st.sampled_from([DEV_KEY + "x", DEV_KEY[:-1], DEV_KEY.upper(), "x" + DEV_KEY,
                                     DEV_KEY.replace("-", "_"), FUZZ_KEY[::-1]]))
        return Credential((("authorization", f"Bearer {near}"),), frozenset({UNAUTH}), kind)
    assert kind == "several"  # more than one authorization header: whichever one counts, the same in both
    parts = draw(st.lists(credentials(ONE_HEADER), min_size=2, max_size=3))
    metadata = tuple(item for part in parts for item in part.metadata)
    return Credential(metadata, frozenset({UNAUTH}).union(*(p.verdicts for p in parts)), kind)


# -- other headers --------------------------------------------------------------------------
KEY_CHARS = st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789-_.")
HEX = "0123456789abcdef"


def _hex(n: int) -> st.SearchStrategy[str]:
    return st.text(st.sampled_from(HEX + "ABCDEF"), min_size=n, max_size=n)


TRACEPARENTS = st.one_of(
    st.builds(lambda v, t, s, f: f"{v}-{t}-{s}-{f}", _hex(2), _hex(32), _hex(16), _hex(2)),
    st.sampled_from(["00-" + "0" * 32 + "-" + "0" * 16 + "-01", "ff-" + "a" * 32 + "-" + "b" * 16 + "-01",
                     "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "", "-", "00---"]),
    st.text(PRINTABLE, max_size=120),
)
REQUEST_IDS = st.one_of(
    st.text(st.sampled_from("abcXYZ019-_."), min_size=1, max_size=70),  # plain: kept up to 64 characters
    st.text(PRINTABLE, max_size=100),
    st.builds(lambda n: "r" * n, st.integers(60, 4000)),
)
SPINE_HEADER_NAMES = st.one_of(
    st.sampled_from(["x-spine-shadow", "x-spine-route", "x-spine-tenant", "x-spine-layout", "x-spine-load",
                     "x-spine-session", "x-spine-priority", "x-spine-internal"]),
    st.builds(lambda s: "x-spine-" + s, st.text(KEY_CHARS, min_size=1, max_size=20)),
)


@st.composite
def headers(draw: st.DrawFn) -> tuple[tuple[str, Any], ...]:
    """Everything but the credential: junk x-spine-*, x-request-id, traceparent, binary headers."""
    out: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["spine", "spine-bin", "request-id", "traceparent", "tracestate", "session"]))
        if kind == "spine":
            out.append((draw(SPINE_HEADER_NAMES), draw(st.text(PRINTABLE, max_size=200))))
        elif kind == "spine-bin":
            out.append((draw(SPINE_HEADER_NAMES) + "-bin", draw(st.binary(max_size=200))))
        elif kind == "request-id":
            out.append(("x-request-id", draw(REQUEST_IDS)))
        elif kind == "traceparent":
            out.append(("traceparent", draw(TRACEPARENTS)))
        elif kind == "tracestate":
            out.append(("tracestate", draw(st.text(PRINTABLE, max_size=200))))
        else:
            out.append(("x-session-id", draw(st.text(PRINTABLE, max_size=100))))
    return tuple(out)


# -- requests ---------------------------------------------------------------------------------
def _repeated(chars: str, low: int, high: int) -> st.SearchStrategy[str]:
    return st.builds(lambda c, n: c * n, st.sampled_from(chars), st.integers(low, high))


MODELS = st.one_of(
    st.sampled_from(KNOWN_MODELS), st.sampled_from(["", "Tiny-LM", " tiny-lm", "tiny-lm\x00", "gpt-9"]),
    st.text(max_size=50), _repeated("mé😀\x00", 1000, 100_000))
PROMPTS = st.one_of(
    st.text(min_size=1, max_size=60),  # any code point but surrogates: controls, NULs, emoji
    st.text(st.characters(max_codepoint=0x1F), min_size=1, max_size=30),
    st.just(""),
    _repeated("a\x00é😀", 500, 2100),  # around the 2048-character limit and the model's context
    st.sampled_from(["a" * MAX_PROMPT_CHARS, "a" * (MAX_PROMPT_CHARS + 1), "😀" * 300]),
)
MAX_TOKENS_ANY = st.one_of(st.integers(1, 8), st.sampled_from([0, -1, MAX_TOKENS, MAX_TOKENS + 1, 2**31 - 1]), INT32)
FLOAT32 = st.floats(width=32)  # NaN and the infinities included
TEMPERATURES = st.one_of(
    st.sampled_from([0.0, -0.0, 0.5, 1.0, MAX_TEMPERATURE, 2.0000002, 1e-45, 1e-38, 1e-7, -1e-45, 3.4e38,
                     math.nan, math.inf, -math.inf]), FLOAT32)
SEEDS = st.one_of(st.none(), st.sampled_from([0, -1, 2**63 - 1, -(2**63)]), INT64)
PRIORITIES = st.one_of(st.sampled_from([-1, 0, 1]), st.sampled_from([2, -2, 2**31 - 1, -(2**31)]), INT32)
TIMEOUTS = st.one_of(
    st.sampled_from([0, -1, MAX_TIMEOUT_MS, MAX_TIMEOUT_MS + 1, 2**31 - 1, -(2**31)]),
    st.integers(1, 50),  # decided by time: OK or DEADLINE_EXCEEDED
    st.integers(10_000, MAX_TIMEOUT_MS), INT32)
WILD = {"model": MODELS, "prompt": PROMPTS, "max_tokens": MAX_TOKENS_ANY, "temperature": TEMPERATURES,
        "seed": SEEDS, "priority": PRIORITIES, "inference_timeout_ms": TIMEOUTS}


@st.composite
def requests(draw: st.DrawFn) -> generation_pb2.GenerateRequest:
    """A valid, cheap request with up to three of its fields replaced by anything."""
    fields: dict[str, Any] = {
        "model": draw(st.sampled_from(KNOWN_MODELS)),
        "prompt": draw(st.text(st.sampled_from("fuzz me abc"), min_size=1, max_size=20)),
        "max_tokens": draw(st.integers(1, 6)),
        "temperature": draw(st.sampled_from([0.0, 0.0, 0.7, 1.3])),
        "seed": draw(st.one_of(st.none(), st.integers(0, 9))),
        "priority": draw(st.sampled_from([-1, 0])),
        "inference_timeout_ms": draw(st.sampled_from([0, 60_000])),
    }
    for name in draw(st.lists(st.sampled_from(sorted(WILD)), max_size=3, unique=True)):
        fields[name] = draw(WILD[name])
    if fields["seed"] is None:
        del fields["seed"]
    return generation_pb2.GenerateRequest(**fields)


# -- the oracle: the README's table ------------------------------------------------------------
def expected_codes(request: generation_pb2.GenerateRequest, verdicts: frozenset[Any],
                   context: int) -> tuple[set[str], bool]:
    """The codes the README allows for `request` under a credential with `verdicts`, and
    whether the answer is decided by the input alone (False: by time as well)."""
    codes: set[str] = set()
    timed = False
    for verdict in verdicts:
        if isinstance(verdict, str):  # auth decides first: a bad credential never reaches validation
            codes.add(verdict)
            continue
        code, by_time = _authenticated(request, verdict, context)
        codes |= code
        timed |= by_time
    return codes, not timed


def _authenticated(request: generation_pb2.GenerateRequest, max_priority: int, context: int) -> tuple[set[str], bool]:
    invalid = (
        not request.model or not request.prompt or len(request.prompt) > MAX_PROMPT_CHARS
        or not 0 < request.max_tokens <= MAX_TOKENS
        or not (math.isfinite(request.temperature) and 0.0 <= request.temperature <= MAX_TEMPERATURE)
        or request.priority not in (-1, 0, 1)
        or not 0 <= request.inference_timeout_ms <= MAX_TIMEOUT_MS)
    if invalid:
        return {"INVALID_ARGUMENT"}, False
    if request.priority > max_priority:
        return {"PERMISSION_DENIED"}, False
    if request.model not in KNOWN_MODELS:
        return {"NOT_FOUND"}, False
    if len(request.prompt.encode()) + 1 + request.max_tokens > context:  # the model's context (bytes + BOS)
        return {"INVALID_ARGUMENT"}, False
    if 0 < request.inference_timeout_ms < TIMED_BELOW_MS:
        return {"OK", "DEADLINE_EXCEEDED"}, True
    return {"OK"}, False


_PLAIN_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def check_answer(side: Side, answer: Answer, allowed: set[str], metadata: Sequence[tuple[str, Any]],
                 request: generation_pb2.GenerateRequest | None, bare: set[str]) -> None:
    """One answer against the README; `bare`: codes that may come from gRPC itself, before the
    Gateway saw the call, and so without its trailers (a client's own deadline, metadata over
    the limit)."""
    where = f"{side.layout}: {answer.code} {answer.details[:200]!r}"
    assert answer.code not in NEVER, where
    assert answer.code in allowed, f"{where}; the README allows {sorted(allowed)}"
    if answer.code in bare and "x-spine-layout" not in answer.trailing:
        return
    assert answer.trailing.get("x-spine-layout") == side.layout, f"{where}; trailers {answer.trailing}"
    request_id = answer.trailing.get("x-request-id", "")
    assert _PLAIN_ID.fullmatch(request_id), f"{where}; x-request-id {request_id!r}"
    sent = [value for key, value in metadata if key == "x-request-id"]
    if sent and _PLAIN_ID.fullmatch(sent[-1]):
        assert request_id in sent, f"{where}; a plain request id is kept: sent {sent}, got {request_id!r}"
    elif sent:
        assert request_id not in sent, f"{where}; {request_id!r} is not plain, it must be replaced"
    if answer.code == "RESOURCE_EXHAUSTED":
        assert "retry-after" in answer.trailing, where
    if answer.code == "OK" and request is not None:
        completion = (answer.responses[0].completion_tokens if len(answer.responses) == 1
                      and isinstance(answer.responses[0], generation_pb2.GenerateResponse)
                      else sum(len(_chunk(c).token_ids) for c in answer.responses))
        assert 0 <= completion <= request.max_tokens, where


def metadata_bytes(metadata: Sequence[tuple[str, Any]]) -> int:
    """About what gRPC counts against its metadata limit: each entry's name and value (a
    binary one base64-encoded) plus 32 bytes, without the call's own headers."""
    return sum(len(key) + (len(value) * 4 + 2) // 3 if isinstance(value, bytes) else len(key) + len(value)
               for key, value in metadata) + 32 * len(metadata)


# The call's own headers (path, authority, user-agent, timeout, ...) take about 600 bytes of
# the limit; around it (the estimate above is not gRPC's count) either answer is right.
SURELY_ACCEPTED = MAX_METADATA_BYTES - 1500
SURELY_REFUSED = MAX_METADATA_BYTES + 500


def _chunk(item: Any) -> generation_pb2.GenerateChunk:
    return item if isinstance(item, generation_pb2.GenerateChunk) else generation_pb2.GenerateChunk.FromString(item)


def model_context(sides: dict[str, Side]) -> int:
    return int(sides["collapsed"].stack.local_servicer("inference").engine.max_context)


def fuzz_both(sides: dict[str, Side], kind: str, body: Any, metadata: Sequence[tuple[str, Any]],
              request: generation_pb2.GenerateRequest | None, verdicts: frozenset[Any],
              timeout: float = TIMEOUT_S) -> None:
    """Send one input to both layouts; check each answer, then that they agree."""
    if request is None:
        allowed, deterministic = {"INVALID_ARGUMENT"}, True
    else:
        allowed, deterministic = expected_codes(request, verdicts, model_context(sides))
    bare: set[str] = set()
    size = metadata_bytes(metadata)
    if size > SURELY_REFUSED:  # gRPC refuses the call before the Gateway sees it
        allowed, bare = {"RESOURCE_EXHAUSTED"}, {"RESOURCE_EXHAUSTED"}
    elif size > SURELY_ACCEPTED:
        allowed, bare, deterministic = allowed | {"RESOURCE_EXHAUSTED"}, {"RESOURCE_EXHAUSTED"}, False
    if timeout < TIMEOUT_S:  # the client's own deadline may pass first, wherever the call is
        allowed, deterministic = allowed | {"DEADLINE_EXCEEDED"}, False
        bare.add("DEADLINE_EXCEEDED")
    if kind == "stream-cancel":  # whatever the first chunk came after, the client cancelled
        allowed, deterministic = allowed | {"CANCELLED"}, False
        bare.add("CANCELLED")
    answers = {}
    for layout, side in sides.items():
        answers[layout] = answer = call(side, kind, body, metadata, timeout)
        check_answer(side, answer, allowed, metadata, request, bare)
    if kind == "stream-cancel" or timeout < TIMEOUT_S:
        settle(sides)
    if deterministic:
        collapsed, layered = answers["collapsed"], answers["layered"]
        assert (collapsed.code, collapsed.details) == (layered.code, layered.details), \
            f"layouts disagree: collapsed {collapsed.code} {collapsed.details!r}, layered {layered.code} {layered.details!r}"


def settle(sides: dict[str, Side], within_s: float = 5.0) -> None:
    """Wait until no call is left in either Gateway: a call the client cancelled or gave up on
    still ends on the server, and the next example should not meet it (nor it the next
    example's draws)."""
    deadline = time.monotonic() + within_s
    while any(side.stack.gateway.in_flight for side in sides.values()):
        assert time.monotonic() < deadline, {name: side.stack.gateway.in_flight for name, side in sides.items()}
        time.sleep(0.002)


# -- the properties ---------------------------------------------------------------------------
CLIENT_TIMEOUTS = st.sampled_from([TIMEOUT_S] * 9 + [0.001, 0.01, 0.05])  # mostly none that matters


@SETTINGS
@given(request=requests(), credential=credentials(), extra=headers(), timeout=CLIENT_TIMEOUTS,
       kind=st.sampled_from(["unary", "unary", "stream", "stream", "stream-cancel"]))
def test_fuzzed_requests_get_the_readmes_codes_in_both_layouts(
        sides: dict[str, Side], request: generation_pb2.GenerateRequest, credential: Credential,
        extra: tuple[tuple[str, Any], ...], timeout: float, kind: str) -> None:
    fuzz_both(sides, kind, request, credential.metadata + extra, request, credential.verdicts, timeout)


@SETTINGS
@given(credential=credentials(), extra=headers(), kind=st.sampled_from(["unary", "stream"]),
       prompt=st.text(min_size=1, max_size=30), priority=st.sampled_from([-1, 0, 1]))
def test_fuzzed_credentials_and_headers_decide_the_same_in_both_layouts(
        sides: dict[str, Side], credential: Credential, extra: tuple[tuple[str, Any], ...], kind: str,
        prompt: str, priority: int) -> None:
    request = generation_pb2.GenerateRequest(model="tiny-lm", prompt=prompt, max_tokens=1, priority=priority)
    fuzz_both(sides, kind, request, credential.metadata + extra, request, credential.verdicts)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """Raw request bodies: random bytes, a real request damaged, strings that are not UTF-8."""
    kind = draw(st.sampled_from(["random", "damaged", "bad-utf8", "wire-types", "valid"]))
    if kind == "random":
        return draw(st.binary(max_size=300))
    good = draw(requests()).SerializeToString()
    if kind == "valid":
        return good
    if kind == "damaged":
        data = bytearray(good)
        for _ in range(draw(st.integers(1, 4))):
            op = draw(st.sampled_from(["flip", "cut", "insert"]))
            at = draw(st.integers(0, len(data)))
            if op == "flip" and at < len(data):
                data[at] ^= 1 << draw(st.integers(0, 7))
            elif op == "cut":
                del data[at:]
            else:
                data[at:at] = draw(st.binary(min_size=1, max_size=8))
        return bytes(data)
    if kind == "bad-utf8":  # model (1) or prompt (2) as length-delimited bytes that are not UTF-8
        field = draw(st.sampled_from([0x0A, 0x12]))
        junk = draw(st.binary(min_size=1, max_size=40))
        return good + bytes([field, len(junk)]) + junk
    # a field with another wire type than its own, or a varint past int32
    tag = draw(st.sampled_from([0x08, 0x0A, 0x10, 0x15, 0x18, 0x1A, 0x1D, 0x25, 0x28, 0x30, 0x38, 0x3A, 0x78]))
    return good + bytes([tag]) + draw(st.binary(min_size=0, max_size=12))


@SETTINGS
@given(body=bodies(), credential=credentials(), kind=st.sampled_from(["raw-unary", "raw-stream"]))
def test_fuzzed_raw_bodies_are_decided_like_the_request_they_decode_to(
        sides: dict[str, Side], body: bytes, credential: Credential, kind: str) -> None:
    try:
        request: generation_pb2.GenerateRequest | None = generation_pb2.GenerateRequest.FromString(body)
    except DecodeError:
        request = None  # not a GenerateRequest: INVALID_ARGUMENT before anything else, credential or not
    fuzz_both(sides, kind, body, credential.metadata, request, credential.verdicts)


# -- what the transport refuses before the Gateway ---------------------------------------------
def test_what_grpc_itself_refuses_is_resource_exhausted_and_harmless(sides: dict[str, Side]) -> None:
    """A body over `limits.max_message_bytes` never reaches the Gateway: gRPC answers
    RESOURCE_EXHAUSTED itself, without the Gateway's trailers."""
    auth = (("authorization", f"Bearer {FUZZ_KEY}"),)
    too_big = generation_pb2.GenerateRequest(model="tiny-lm", prompt="x" * (1 << 20), max_tokens=1)
    for side in sides.values():
        for kind in ("unary", "stream"):
            assert call(side, kind, too_big, auth).code == "RESOURCE_EXHAUSTED"
        assert call(side, "raw-unary", b"\xff" * ((1 << 20) + 1), auth).code == "RESOURCE_EXHAUSTED"


def test_metadata_is_accepted_or_refused_by_its_size_alone(sides: dict[str, Side]) -> None:
    """Regression (found by the fuzz: a 8.6 KB `authorization` header refused in one layout and
    answered in the other): gRPC's defaults refuse metadata between 8 and 16 KiB at random.
    Now up to MAX_METADATA_BYTES it always reaches the Gateway; past it, never."""
    request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="x", max_tokens=1)
    for side in sides.values():
        for size, expected, tries in ((9_000, "UNAUTHENTICATED", 8), (MAX_METADATA_BYTES - 2_000, "UNAUTHENTICATED", 8),
                                      (MAX_METADATA_BYTES + 100, "RESOURCE_EXHAUSTED", 2)):
            header = (("authorization", "Bearer " + "a" * size),)
            answers = [call(side, kind, request, header) for kind in ("unary", "stream") for _ in range(tries)]
            assert {a.code for a in answers} == {expected}, (side.layout, size, [a.code for a in answers])
            if expected == "UNAUTHENTICATED":
                assert all(a.trailing.get("x-spine-layout") == side.layout for a in answers)


# -- what a request that was not routed leaves behind --------------------------------------------
def scrape(side: Side) -> str:
    import urllib.request

    address = side.stack.metrics_address()
    assert address, side.layout
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def log_records(side: Side, request_ids: set[str]) -> dict[str, dict[str, Any]]:
    """The log lines of `request_ids`, once all of them are on disk (the layered logs
    process writes every flush interval)."""
    side.stack.drain()
    logs = side.stack.local_servicers.get("logs")
    if logs is not None:
        logs.flush()
    path = side.stack.run_dir / "requests.jsonl"
    deadline = time.monotonic() + 10
    while True:
        found = {}
        if path.exists():
            for line in path.read_text().splitlines():
                record = json.loads(line)
                if record["request_id"] in request_ids:
                    found[record["request_id"]] = record
        if set(found) == request_ids or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_a_model_name_that_was_not_routed_is_no_metric_label_and_is_logged_cut(sides: dict[str, Side]) -> None:
    """Regression (found by the fuzz: a 100,000-character unknown model name made the logs
    middleware refuse the request's line). A name the router did not resolve was the request's
    `model` label and log field as sent: every made-up name a series of its own for the life
    of the process (a client without a credential could fill the device budget with them), and
    a long one a log line over `logs.max_line_bytes`, so the request was not logged at all."""
    names = ["made-up-model-" + "é" * 20_000, "made-up model two", "made-up-" + "😀" * 50_000]
    for side in sides.values():
        before = dict(side.stack.gateway.fail_open_failures)
        sent: dict[str, str] = {}
        for i, name in enumerate(names):
            for token in (None, FUZZ_KEY):  # refused by auth, or authenticated and NOT_FOUND
                request_id = f"unrouted-{side.layout}-{i}-{'key' if token else 'none'}"
                metadata = (("x-request-id", request_id),) + ((("authorization", f"Bearer {token}"),) if token else ())
                request = generation_pb2.GenerateRequest(model=name, prompt="x", max_tokens=1)
                answer = call(side, "unary", request, metadata)
                assert answer.code == ("NOT_FOUND" if token else "UNAUTHENTICATED"), answer.details
                sent[request_id] = name
        assert dict(side.stack.gateway.fail_open_failures) == before, side.layout
        assert "made-up" not in scrape(side), side.layout
        records = log_records(side, set(sent))
        assert set(records) == set(sent), side.layout
        for request_id, name in sent.items():
            logged = records[request_id]["model"]
            if len(name) <= 200:
                assert logged == name
            else:
                assert logged == f"{name[:200]}...({len(name)} characters)", (side.layout, logged[:50])


# -- afterwards ---------------------------------------------------------------------------------
def test_both_layouts_are_healthy_after_the_fuzz(sides: dict[str, Side]) -> None:
    for side in sides.values():
        health = health_pb2_grpc.HealthStub(side.channel)
        for service in ("", "spine.v1.Gateway"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, (side.layout, service)
        report = side.stack.health_report()
        for name, child in report.get("children", {}).items():
            assert child["restarts"] == 0 and child["state"] == "serving", (side.layout, name, child)
        assert not side.stack.gateway.fail_open_failures, (side.layout, dict(side.stack.gateway.fail_open_failures))
        deadline = time.monotonic() + 10  # cancelled streams and deadlines end in their own threads
        while side.stack.gateway.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert side.stack.gateway.in_flight == 0, side.layout
        request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="still there?", max_tokens=4)
        for kind in ("unary", "stream"):
            answer = call(side, kind, request, (("authorization", f"Bearer {DEV_KEY}"),))
            assert answer.code == "OK", (side.layout, kind, answer.details)
            assert answer.trailing.get("x-spine-layout") == side.layout and answer.trailing.get("x-request-id")
        uncached = generation_pb2.GenerateRequest(model="tiny-lm", prompt="still there?", max_tokens=4, temperature=1.0)
        load = parse_load(call(side, "unary", uncached, (("authorization", f"Bearer {DEV_KEY}"),)).trailing["x-spine-load"])
        assert load["kv_free"] == load["slots"] and load["queue"] == 0, (side.layout, load)  # no slot left held
