"""Fuzzing the public Gateway of both layouts.

Hypothesis draws Gateway calls — request fields, credentials (API keys, JWTs, junk),
`x-spine-*`, `x-request-id` and `traceparent` headers, raw bodies that may not decode, a
client deadline now and then, a stream cancelled after its first chunk — and sends each one,
unary or streamed, to a collapsed and a layered stack started once for the module. Every
answer is held to docs/status-codes.md:

- its code is the one the "Status codes" table gives for that input (an oracle below,
  written from the docs, not from the pipeline's code): never UNKNOWN or INTERNAL, and
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

import json
import math
import os
import random
import re
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

from runtime.observability.tracing import Tracing, installed_tracing
from runtime.running_stack import RunningStack
from runtime.server import MAX_METADATA_BYTES
from services.inference.load_hints import parse_load
from tests.conftest import DEV_KEY, TEST_OVERRIDES, config_for_tests, make_jwt, start_stack
from tests.fuzz_inputs import (
    FUZZ_KEY,
    KNOWN_MODELS,
    MAX_PROMPT_CHARS,
    MAX_TEMPERATURE,
    MAX_TIMEOUT_MS,
    MAX_TOKENS,
    NO_SCOPE_KEY,
    SURELY_ACCEPTED,
    SURELY_REFUSED,
    Credential,
    bodies,
    credentials,
    headers,
    metadata_bytes,
    requests,
)
from tests.waiting import eventually
from wire.v1 import gateway_pb2_grpc, generation_pb2

LAYOUTS = ("collapsed", "layered")
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

# The documented limits (runtime/default_config.yaml) are restated in tests.fuzz_inputs: the oracle is not the code's.
TIMED_BELOW_MS = 1_000  # a compute budget under this may or may not be enough: OK or DEADLINE_EXCEEDED
NEVER = {"UNKNOWN", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNIMPLEMENTED"}


# -- the stacks ----------------------------------------------------------------------------
@dataclass
class Side:
    stack: RunningStack
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
        stacks: dict[str, RunningStack] = {}
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


# -- the oracle: the docs' table --------------------------------------------------------------
def expected_codes(request: generation_pb2.GenerateRequest, verdicts: frozenset[Any],
                   context: int) -> tuple[set[str], bool]:
    """The codes the docs allow for `request` under a credential with `verdicts`, and
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
    """One answer against the docs; `bare`: codes that may come from gRPC itself, before the
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


def _chunk(item: Any) -> generation_pb2.GenerateChunk:
    return item if isinstance(item, generation_pb2.GenerateChunk) else generation_pb2.GenerateChunk.FromString(item)


def model_context(sides: dict[str, Side]) -> int:
    return int(sides["collapsed"].stack.local_servicer("inference").first.engine.max_context)


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
        assert (collapsed.code, comparable(collapsed.details)) == (layered.code, comparable(layered.details)), \
            f"layouts disagree: collapsed {collapsed.code} {collapsed.details!r}, layered {layered.code} {layered.details!r}"


TRANSPORT_METADATA_REFUSAL = "received metadata size exceeds hard limit"


def comparable(details: str) -> str:
    """`details` with what the clock writes masked. gRPC core's own refusal of oversized
    metadata lists every header's size, `grpc-timeout` included, and that header carries the
    time left (`29999m`, `29998032u`), so the same request refused the same way by both
    layouts can differ by a few bytes; every other message is compared as it is."""
    if not details.startswith(TRANSPORT_METADATA_REFUSAL):
        return details
    details = re.sub(r"grpc-timeout:\d+B", "grpc-timeout:?B", details)
    return re.sub(r"\(\d+ vs\.", "(? vs.", details)


def settle(sides: dict[str, Side], within_s: float = 5.0) -> None:
    """Wait until no call is left in either Gateway: a call the client cancelled or gave up on
    still ends on the server, and the next example should not meet it (nor it the next
    example's draws)."""
    eventually(lambda: not any(side.stack.gateway.in_flight for side in sides.values()), within_s,
               "no call left in either gateway", interval=0.002,
               seen=lambda: {name: side.stack.gateway.in_flight for name, side in sides.items()})


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


@pytest.mark.parametrize("kind", ["unary", "stream"])
def test_a_token_whose_tenant_is_any_unicode_is_served_in_both_layouts(sides: dict[str, Side], kind: str) -> None:
    """A draw the fuzz meets only now and then, pinned: the tenant is whatever the issuer
    wrote, and it reaches the model's queue as it is (not as an illegal metadata value that
    fails the model call, five of which eject the model)."""
    token = make_jwt("テナント\x01 ü")
    credential = Credential((("authorization", f"Bearer {token}"),), frozenset({0}), "unicode")
    request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="whose?", max_tokens=1)
    fuzz_both(sides, kind, request, credential.metadata, request, credential.verdicts)


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

    def on_disk() -> dict[str, dict[str, Any]]:
        found = {}
        if path.exists():
            for line in path.read_text().splitlines():
                record = json.loads(line)
                if record["request_id"] in request_ids:
                    found[record["request_id"]] = record
        return found

    found: dict[str, dict[str, Any]] = eventually(lambda: got if set(got := on_disk()) == request_ids else None,
                                                  10, "every request's log line", interval=0.1,
                                                  seen=lambda: request_ids - set(on_disk()))
    return found


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
        # Cancelled streams and deadlines end in their own threads: on a loaded host, seconds later.
        eventually(lambda side=side: side.stack.gateway.in_flight == 0, timeout=30, what=f"{side.layout}: in flight",
                   seen=lambda side=side: side.stack.gateway.in_flight)
        request = generation_pb2.GenerateRequest(model="tiny-lm", prompt="still there?", max_tokens=4)
        for kind in ("unary", "stream"):
            answer = call(side, kind, request, (("authorization", f"Bearer {DEV_KEY}"),))
            assert answer.code == "OK", (side.layout, kind, answer.details)
            assert answer.trailing.get("x-spine-layout") == side.layout and answer.trailing.get("x-request-id")
        uncached = generation_pb2.GenerateRequest(model="tiny-lm", prompt="still there?", max_tokens=4, temperature=1.0)
        load = parse_load(call(side, "unary", uncached, (("authorization", f"Bearer {DEV_KEY}"),)).trailing["x-spine-load"])
        assert load["kv_free"] == load["slots"] and load["queue"] == 0, (side.layout, load)  # no slot left held
