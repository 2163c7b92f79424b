"""What the Gateway fuzz (`test_fuzz_gateway.py`) sends: credentials (API keys, JWTs made
right and each way wrong, junk), headers (`x-spine-*`, `x-request-id`, `traceparent`) and
request fields, as hypothesis strategies, with each credential's verdict — and the documented
limits they are drawn around, restated here so that the oracle is the docs, not the code.
"""

from __future__ import annotations

import base64
import hmac
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from runtime.server import MAX_METADATA_BYTES
from tests.conftest import DEV_KEY, JWT_SECRET, make_jwt
from wire.v1 import generation_pb2

FUZZ_KEY = "fuzz-tenant-key-0000"
NO_SCOPE_KEY = "fuzz-no-scope-key-0000"
KNOWN_MODELS = ("tiny-lm", "default", "tiny")
MAX_PROMPT_CHARS = 2048
MAX_TOKENS = 256
MAX_TEMPERATURE = 2.0
MAX_TIMEOUT_MS = 120_000
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)


# -- credentials ------------------------------------------------------------------------------
# A credential's verdict: the codes auth alone may give it, and an int for "authenticated,
# with this max_priority". More than one where the docs leave the spelling open.
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


def metadata_bytes(metadata: Sequence[tuple[str, Any]]) -> int:
    """About what gRPC counts against its metadata limit: each entry's name and value (a
    binary one base64-encoded) plus 32 bytes, without the call's own headers."""
    return sum(len(key) + (len(value) * 4 + 2) // 3 if isinstance(value, bytes) else len(key) + len(value)
               for key, value in metadata) + 32 * len(metadata)


# The call's own headers (path, authority, user-agent, timeout, ...) take about 600 bytes of
# the limit; around it (the estimate above is not gRPC's count) either answer is right.
SURELY_ACCEPTED = MAX_METADATA_BYTES - 1500
SURELY_REFUSED = MAX_METADATA_BYTES + 500
