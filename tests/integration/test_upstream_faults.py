"""Upstreams that misbehave: a clear error in the client's API shape, bounded retries, no stuck
slot, a spine that stays healthy; and a flaky upstream hidden by retries and a fallback.

Real servers on 127.0.0.1: the spine (collapsed, in this process), a fault-injecting upstream
(`tests.fault_upstream`) and the real bare model server as the healthy one."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from runtime.config.file import load_config, placements_for
from runtime.server import free_port
from runtime.stack import Stack
from services.common.token_estimate import estimate_tokens
from spine.tools.dev_certs import write_dev_certs
from tests.conftest import DEV_KEY, TEST_OVERRIDES, config_for_tests
from tests.fault_upstream import LEAKED_PASSWORD, NO_USAGE_TEXT, FaultUpstream
from tests.waiting import eventually

SOLO_KEY = "upstream-solo-key-0000"  # one request at a time: a slot that leaks refuses the next
LOAD_KEY = "upstream-load-key-0000"  # limits out of the way for the flaky upstream's thousand requests
METERED_KEY = "upstream-metered-key-0000"  # a tokens bucket that barely refills: what a request used is exact
SPINE_UPSTREAM_KEY = "sk-spine-upstream-secret-0123456789"  # what the spine sends its fault upstream


def _routes(bare: Any, fault: FaultUpstream, down_url: str, key_file: Path, secure: FaultUpstream,
            ca: Path, spine_key_file: Path, gone_url: str, tokenizer: Path) -> list[dict[str, Any]]:
    def at(url: str, model: str, **options: Any) -> dict[str, Any]:
        return {"base_url": url, "model": model, **options}

    faulty = fault.base_url
    return [
        {"id": "good", "upstream": at(bare.base_url, "default", api_key_file=str(key_file))},
        {"id": "hang", "upstream": at(faulty, "hang", timeout_s=0.4, retries=1)},
        {"id": "hang-long", "upstream": at(faulty, "hang", timeout_s=60, retries=0)},
        {"id": "reset", "upstream": at(faulty, "reset", retries=1)},
        {"id": "bad-json", "upstream": at(faulty, "bad-json", retries=1)},
        {"id": "bad-sse", "upstream": at(faulty, "bad-sse", retries=1)},
        {"id": "overloaded", "upstream": at(faulty, "overloaded")},
        {"id": "overloaded-fb", "upstream": at(faulty, "overloaded", fallbacks=["good"])},
        {"id": "overloaded-once", "upstream": at(faulty, "overloaded-once")},
        {"id": "too-long", "upstream": at(faulty, "context", context_fallback="good")},
        {"id": "down", "upstream": at(down_url, "default", retries=1, eject_after_failures=2, ejection_s=1.5,
                                      connect_timeout_s=0.5)},
        # Failing 30% of attempts, five in a row happens a few times in a thousand requests and would
        # eject it for a while (the "down" upstream tests ejection); here retries alone must hide it.
        {"id": "flaky", "upstream": at(faulty, "flaky", retries=2, fallbacks=["good"], eject_after_failures=25)},
        {"id": "brief", "upstream": at(faulty, "brief")},
        {"id": "secure", "upstream": at(secure.base_url, "forwarded", ca_file=str(ca))},
        {"id": "wrong-key", "upstream": at(faulty, "wrong-key", api_key_file=str(spine_key_file))},
        {"id": "leaky-500", "upstream": at(faulty, "leaky-500", api_key_file=str(spine_key_file), retries=0)},
        {"id": "echo-400", "upstream": at(faulty, "echo-400", api_key_file=str(spine_key_file))},
        {"id": "gone", "upstream": at(gone_url, "default", retries=0, eject_after_failures=100,
                                      api_key_file=str(spine_key_file))},
        {"id": "blank-lines", "upstream": at(faulty, "blank-lines", retries=0, eject_after_failures=1000)},
        {"id": "no-usage", "upstream": at(faulty, "no-usage")},
        {"id": "no-usage-tokenized", "upstream": at(faulty, "no-usage", tokenizer_file=str(tokenizer))},
    ]


def _word_tokenizer(path: Path) -> Path:
    """A tokenizer.json whose every word is one token (a stand-in for an upstream model's own)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # type: ignore[assignment]
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, bare_http_upstream: Any) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("faults")
    key_file = tmp / "bare.key"
    key_file.write_text(f"{bare_http_upstream.key}\n")
    fault = FaultUpstream(bare_http_upstream.base_url, bare_http_upstream.key).start()
    certs = write_dev_certs(tmp / "certs")
    secure = FaultUpstream(bare_http_upstream.base_url, bare_http_upstream.key,
                           tls=(str(certs["server.pem"]), str(certs["server-key.pem"]))).start()
    down_port = free_port()  # nothing listens here until a test starts a server on it
    spine_key_file = tmp / "spine-upstream.key"
    spine_key_file.write_text(f"{SPINE_UPSTREAM_KEY}\n")
    keys = [*TEST_OVERRIDES["auth"]["api_keys"],
            {"id": "solo", "tenant": "solo", "key": SOLO_KEY, "scopes": ["generate"]},
            {"id": "load", "tenant": "load", "key": LOAD_KEY, "scopes": ["generate"]},
            {"id": "metered", "tenant": "metered", "key": METERED_KEY, "scopes": ["generate"]}]
    config = config_for_tests(
        auth={"api_keys": keys},
        ratelimit={"tenants": {**TEST_OVERRIDES["ratelimit"]["tenants"],
                               "solo": {"max_concurrent_requests": 1},
                               "load": {"requests_per_second": 1e6, "burst": 1e6, "tokens_per_minute": 1e9,
                                        "token_burst": 1e8},
                               "metered": {"tokens_per_minute": 0.006, "token_burst": 10000}}},
        router={"models": [*(model.model_dump(exclude_none=True) for model in load_config().router.models),
                           *_routes(bare_http_upstream, fault, f"http://127.0.0.1:{down_port}/v1", key_file, secure,
                                    certs["ca.pem"], spine_key_file, f"http://127.0.0.1:{free_port()}/v1",
                                    _word_tokenizer(tmp / "tokenizer.json"))]})
    stack = Stack(config, placements_for("collapsed", config), run_dir=tmp / "run", http_listen="127.0.0.1:0").start()
    try:
        yield {"stack": stack, "fault": fault, "down_port": down_port,
               "endpoints": stack.local_servicer("inference").upstreams.endpoints}
    finally:
        stack.stop()
        fault.stop()
        secure.stop()


def _client(world: dict[str, Any], key: str = SOLO_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{world['stack'].http_address}/v1", api_key=key, max_retries=0,
                         timeout=20)


def _chat(world: dict[str, Any], model: str, **options: Any) -> Any:
    return _client(world).chat.completions.with_raw_response.create(
        model=model, max_tokens=4, temperature=0.5, messages=[{"role": "user", "content": f"to {model}"}], **options)


def _error(world: dict[str, Any], model: str, kind: type[openai.APIStatusError], **options: Any) -> Any:
    with pytest.raises(kind) as raised:
        _chat(world, model, **options)
    return raised.value


def test_a_hung_upstream_times_out_with_a_bounded_retry(world: dict[str, Any]) -> None:
    started = time.monotonic()
    error = _error(world, "hang", openai.InternalServerError)
    assert error.status_code == 504 and "upstream hang did not answer within 0.4s" in error.message
    assert error.response.headers["x-spine-attempts"] == "2" and world["fault"].hits["hang"] == 2
    assert time.monotonic() - started < 5


def test_a_client_that_hangs_up_on_a_unary_request_ends_the_upstream_exchange_at_once(world: dict[str, Any]) -> None:
    endpoint, fault = world["endpoints"]["hang-long"], world["fault"]
    before = fault.left["hang"]
    client = openai.OpenAI(base_url=f"http://{world['stack'].http_address}/v1", api_key=SOLO_KEY, max_retries=0,
                           timeout=0.5)
    with pytest.raises(openai.APITimeoutError):  # the client gives up and closes its connection
        client.chat.completions.create(model="hang-long", max_tokens=4,
                                       messages=[{"role": "user", "content": "anyone there?"}])
    # Its upstream's timeout is a minute away: the exchange ends because the client left.
    eventually(lambda: fault.left["hang"] > before, 10, "the spine to close its exchange with the upstream")
    eventually(lambda: endpoint.in_flight == 0, 10, "the upstream's slot to be given back")
    _chat(world, "good")  # the solo tenant's one concurrent request was given back too


def test_malformed_answers_are_the_upstreams_fault_not_text(world: dict[str, Any]) -> None:
    error = _error(world, "bad-json", openai.InternalServerError)
    assert error.status_code == 503 and "upstream bad-json answered something unreadable" in error.message
    assert world["fault"].hits["bad-json"] == 2  # the first attempt and one retry, no more
    stream_error = _error(world, "bad-sse", openai.InternalServerError, stream=True)
    assert "unreadable stream" in stream_error.message  # before the first byte: a plain HTTP error


def test_a_stream_reset_after_its_first_piece_ends_in_an_error_event(world: dict[str, Any]) -> None:
    chunks = _client(world).chat.completions.create(
        model="reset", max_tokens=4, temperature=0.5, stream=True, messages=[{"role": "user", "content": "r"}])
    with pytest.raises(openai.APIError, match="the stream broke after 1 chunk"):
        for _ in chunks:
            pass
    error = _error(world, "reset", openai.InternalServerError)  # a whole answer cut short: retried, then said
    assert "unreachable" in error.message and error.response.headers["x-spine-attempts"] == "2", (error.message, error.response.headers)


def test_429_with_a_long_retry_after_is_said_or_falls_back(world: dict[str, Any]) -> None:
    error = _error(world, "overloaded", openai.InternalServerError)
    assert error.status_code == 503 and error.response.headers["retry-after"] == "30"
    assert "answered 429 (overloaded)" in error.message and world["fault"].hits["overloaded"] == 1
    assert "slow down" not in error.message  # the upstream's words are the operator's
    answered = _chat(world, "overloaded-fb")
    assert answered.headers["x-spine-upstream"] == "good" and answered.headers["x-spine-attempts"] == "2"


def test_429_with_a_short_retry_after_is_waited_out_and_retried(world: dict[str, Any]) -> None:
    started = time.monotonic()
    answered = _chat(world, "overloaded-once")
    assert answered.headers["x-spine-upstream"] == "overloaded-once" and answered.headers["x-spine-attempts"] == "2"
    assert time.monotonic() - started >= 0.2  # it waited what the upstream asked


def test_a_prompt_too_long_falls_back_to_the_longer_context_model(world: dict[str, Any]) -> None:
    answered = _chat(world, "too-long")
    assert answered.headers["x-spine-upstream"] == "good" and answered.parse().choices[0].message.content


def test_an_upstream_down_at_start_is_ejected_then_readmitted(world: dict[str, Any]) -> None:
    first = _error(world, "down", openai.InternalServerError)
    assert "upstream down is unreachable" in first.message and first.response.headers["x-spine-attempts"] == "2"
    ejected = _error(world, "down", openai.InternalServerError)  # two failures in a row: cooling down
    assert "ejected" in ejected.message and ejected.response.headers["x-spine-attempts"] == "0"
    endpoint = world["endpoints"]["down"]
    server = FaultUpstream(world["fault"].forward_to, world["fault"].key, port=world["down_port"]).start()
    try:
        deadline = time.monotonic() + 10
        while True:  # the cooldown ends; one probe goes through and puts it back
            try:
                answered = _chat(world, "down")
                break
            except openai.InternalServerError:
                assert time.monotonic() < deadline, "never readmitted"
                time.sleep(0.1)
        assert answered.headers["x-spine-upstream"] == "down" and endpoint.outlier.state == "in"
    finally:
        server.stop()


def test_no_slot_is_left_held_and_the_spine_stays_healthy(world: dict[str, Any]) -> None:
    _error(world, "hang", openai.InternalServerError, stream=True)
    deadline = time.monotonic() + 5
    while any(endpoint.in_flight for endpoint in world["endpoints"].values()):
        assert time.monotonic() < deadline, {name: e.in_flight for name, e in world["endpoints"].items()}
        time.sleep(0.02)
    assert _chat(world, "good").headers["x-spine-upstream"] == "good"  # the solo tenant's one slot is free
    with httpx2.Client(timeout=5) as raw:
        assert raw.get(f"http://{world['stack'].http_address}/health").json() == {"serving": True}


def test_an_upstream_failing_30_percent_with_503_is_hidden(world: dict[str, Any]) -> None:
    url = f"http://{world['stack'].http_address}/v1/chat/completions"
    headers = {"authorization": f"Bearer {LOAD_KEY}"}

    def one(i: int) -> tuple[int, str]:
        answer = client.post(url, headers=headers, json={
            "model": "flaky", "max_tokens": 1, "temperature": 0.5, "messages": [{"role": "user", "content": f"f{i}"}]})
        return answer.status_code, answer.headers.get("x-spine-upstream", "")

    with httpx2.Client(timeout=30, limits=httpx2.Limits(max_connections=8)) as client, \
            concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(1000)))
    ok = sum(status == 200 for status, _ in results)
    assert ok >= 999, f"{1000 - ok} of 1000 requests failed"
    assert world["fault"].hits["flaky"] >= 1000 * 0.9  # it was tried, and failed about 30% of the time
    assert any(upstream == "good" for _, upstream in results)  # some were answered by the fallback


@pytest.mark.parametrize("stream", [False, True])
def test_tokens_per_minute_count_what_the_upstream_used(world: dict[str, Any], stream: bool) -> None:
    """Admission charges prompt bytes + max_tokens (200 here); the upstream says it used 6: the
    tenant's tokens bucket ends 6 lower, not 200-odd, for a stream as for a whole answer."""
    limiter = world["stack"].local_servicer("ratelimit")
    key = (("tenant", "metered"), ("model", "brief"), ("resource", "tokens"))
    client = _client(world, METERED_KEY)
    before = limiter.bucket(key)
    answer = client.chat.completions.create(model="brief", max_tokens=200, stream=stream,
                                            messages=[{"role": "user", "content": f"meter {stream}"}])
    if stream:
        assert "".join(c.choices[0].delta.content or "" for c in answer if c.choices) == "ok"
    else:
        assert answer.usage is not None and answer.usage.total_tokens == 6
    after = limiter.bucket(key)
    level_before = 10000.0 if before is None else before.level
    assert after is not None and abs((level_before - after.level) - 6) < 0.01


def test_an_https_upstream_is_verified_and_spoken_to_over_httpx2(world: dict[str, Any]) -> None:
    """https with `http2: true`: httpx2 offers HTTP/2 by ALPN (this server takes HTTP/1.1), the
    certificate checked against `ca_file`; plain and streamed."""
    from services.inference.upstream.transports import Httpx2Transport

    assert isinstance(world["endpoints"]["secure"].transport, Httpx2Transport)
    assert _chat(world, "secure").headers["x-spine-upstream"] == "secure"
    chunks = _client(world).chat.completions.create(model="secure", max_tokens=4, temperature=0.5, stream=True,
                                                    messages=[{"role": "user", "content": "tls stream"}])
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_failing_upstream_never_ejects_the_inference_process(world: dict[str, Any], tmp_path: Path) -> None:
    """With the model in its own process, the gateway's remote proxy ejects the inference component
    after `calls.eject_after_failures` failures in a row: an upstream's failures are that
    component's answers, so the other models stay served. What the upstream said stays in that
    process's log, across the gRPC hop as in one process."""
    down = f"http://127.0.0.1:{free_port()}/v1"
    key_file = tmp_path / "spine-upstream.key"
    key_file.write_text(SPINE_UPSTREAM_KEY)
    config = config_for_tests(
        placements={name: "local" for name in ("auth", "ratelimit", "router", "cache", "metrics", "logs")}
        | {"inference": "remote"},
        calls={"eject_after_failures": 2},
        router={"models": [*(model.model_dump(exclude_none=True) for model in load_config().router.models),
                           {"id": "down", "upstream": {"base_url": down, "retries": 0, "eject_after_failures": 100}},
                           {"id": "wrong-key", "upstream": {"base_url": world["fault"].base_url, "model": "wrong-key",
                                                            "api_key_file": str(key_file)}}]})
    stack = Stack(config, placements_for("mixed", config), run_dir=tmp_path / "run", http_listen="127.0.0.1:0").start()
    try:
        client = openai.OpenAI(base_url=f"http://{stack.http_address}/v1", api_key=DEV_KEY, max_retries=0)
        for i in range(4):
            with pytest.raises(openai.InternalServerError, match="upstream down is unreachable") as raised:
                client.chat.completions.create(model="down", max_tokens=2, messages=[{"role": "user", "content": f"{i}"}])
            assert "127.0.0.1" not in raised.value.message  # its address stays in the inference process's log
        with pytest.raises(openai.InternalServerError, match="upstream wrong-key answered 401") as refused:
            client.chat.completions.create(model="wrong-key", max_tokens=2, messages=[{"role": "user", "content": "k"}])
        assert SPINE_UPSTREAM_KEY not in refused.value.message and "Incorrect API key" not in refused.value.message
        request_id = refused.value.response.headers["x-request-id"]
        logs = list((tmp_path / "run").rglob("*.log"))

        def logged() -> list[str]:
            return [line for log in logs for line in log.read_text(errors="replace").splitlines() if request_id in line]
        lines = eventually(logged, 10, "the inference process logged the upstream's words",
                           seen=lambda: [log.name for log in logs])
        assert any("Bearer [redacted]" in line for line in lines), lines
        assert not any(SPINE_UPSTREAM_KEY in log.read_text(errors="replace") for log in logs)
        answer = client.chat.completions.create(model="default", max_tokens=2, temperature=0,
                                                messages=[{"role": "user", "content": "still served"}])
        assert answer.usage is not None and answer.usage.completion_tokens == 2
    finally:
        stack.stop()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model", ["wrong-key", "leaky-500"])
def test_an_upstreams_own_words_reach_the_log_under_the_request_id_never_the_client(
        world: dict[str, Any], caplog: pytest.LogCaptureFixture, model: str, stream: bool) -> None:
    """A 401 quoting the key the spine sent, a 500 naming a database's password: the client reads
    the upstream's name, the status class and a request id; the log has the upstream's words,
    the key redacted, under that request id."""
    caplog.set_level(logging.WARNING, logger="spine.upstream")
    error = _error(world, model, openai.InternalServerError, stream=stream)
    request_id = error.response.headers["x-request-id"]
    status = "401 (the upstream refused the spine's credentials" if model == "wrong-key" else "500 (a server error)"
    assert f"upstream {model} answered {status}" in error.message and f"request id {request_id}" in error.message
    for secret in (SPINE_UPSTREAM_KEY, LEAKED_PASSWORD, "postgres://", "Incorrect API key", "10.1.2.3", "127.0.0.1"):
        assert secret not in error.message
    logged = [r.getMessage() for r in caplog.records if request_id in r.getMessage()]
    assert len(logged) == 1, caplog.text
    said = "Incorrect API key provided: Bearer [redacted]" if model == "wrong-key" else f"app:{LEAKED_PASSWORD}@10.1.2.3"
    assert said in logged[0] and SPINE_UPSTREAM_KEY not in caplog.text


def test_a_refusal_of_the_clients_own_request_reaches_it_with_the_key_redacted(world: dict[str, Any]) -> None:
    error = _error(world, "echo-400", openai.BadRequestError)
    assert "upstream echo-400 answered 400: temperature must be at most 2" in error.message
    assert "Bearer [redacted]" in error.message and SPINE_UPSTREAM_KEY not in error.message


def test_an_unreachable_upstream_is_named_never_its_address(world: dict[str, Any],
                                                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="spine.upstream")
    port = world["endpoints"]["gone"].spec.base_url.rsplit(":", 1)[1].split("/")[0]
    for stream in (False, True):
        error = _error(world, "gone", openai.InternalServerError, stream=stream)
        assert "upstream gone is unreachable" in error.message
        assert "127.0.0.1" not in error.message and port not in error.message and "Connect" not in error.message
        request_id = error.response.headers["x-request-id"]
        assert any(request_id in r.getMessage() and port in r.getMessage() for r in caplog.records), caplog.text


def test_blank_lines_are_cut_off_and_counted_while_a_healthy_upstream_answers(world: dict[str, Any]) -> None:
    """Four clients keep asking an upstream that streams nothing but blank lines as fast as it
    can; each stream is cut off once it has sent its bound without an event (a 503 naming the
    upstream), counted, and the healthy upstream in the same process goes on answering."""
    stop = threading.Event()
    refused: list[str] = []

    def bad() -> None:
        client = _client(world, LOAD_KEY)
        while not stop.is_set():
            with pytest.raises(openai.InternalServerError) as raised:
                client.chat.completions.create(model="blank-lines", max_tokens=4, stream=True,
                                               messages=[{"role": "user", "content": "blank"}])
            refused.append(raised.value.message)

    threads = [threading.Thread(target=bad) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        eventually(lambda: len(refused) >= 4, 30, "the blank-line streams were cut off")
        healthy = _client(world, LOAD_KEY)
        for i in range(10):
            answer = healthy.chat.completions.create(model="good", max_tokens=2, temperature=0,
                                                     messages=[{"role": "user", "content": f"healthy {i}"}])
            assert answer.choices[0].message.content
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert all("upstream blank-lines sent" in m and "bytes without an event" in m for m in refused), refused[:3]
    collector = world["stack"].local_servicer("inference").serving_collector
    cut = {tuple(s.labels.values()): s.value for family in collector.collect()
           if family.name == "spine_upstream_streams_cut" for s in family.samples}
    assert cut[("blank-lines", "no_events")] >= len(refused)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model", ["no-usage", "no-usage-tokenized"])
def test_an_answer_without_usage_is_counted_charged_and_says_how(world: dict[str, Any], model: str,
                                                                 stream: bool) -> None:
    """60 words and no usage: counted with the model's tokenizer where the upstream names one
    (here one token a word), else estimated (UTF-8 bytes / 4), charged to the tenant's tokens,
    and the usage says which (`spine_counted_by`) — whole or streamed alike."""
    limiter = world["stack"].local_servicer("ratelimit")
    key = (("tenant", "metered"), ("model", model), ("resource", "tokens"))
    before = limiter.bucket(key)
    client = _client(world, METERED_KEY)
    prompt = f"count me {stream}"
    if stream:
        chunks = list(client.chat.completions.create(model=model, max_tokens=200, stream=True,
                                                     stream_options={"include_usage": True},
                                                     messages=[{"role": "user", "content": prompt}]))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == NO_USAGE_TEXT
        usage = chunks[-1].usage
    else:
        answer = client.chat.completions.create(model=model, max_tokens=200,
                                                messages=[{"role": "user", "content": prompt}])
        assert answer.choices[0].message.content == NO_USAGE_TEXT
        usage = answer.usage
    assert usage is not None
    if model == "no-usage":
        assert usage.completion_tokens == estimate_tokens(NO_USAGE_TEXT) == 103
        assert usage.prompt_tokens == estimate_tokens(prompt)
        assert (usage.model_extra or {})["spine_counted_by"] == "estimate"
    else:
        assert usage.completion_tokens == 60 and usage.prompt_tokens == 3
        assert (usage.model_extra or {})["spine_counted_by"] == "tokenizer"
    after = limiter.bucket(key)
    level_before = 10000.0 if before is None else before.level
    assert after is not None and abs((level_before - after.level) - usage.total_tokens) < 0.01
