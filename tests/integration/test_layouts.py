"""Both layouts (and a mixed one) serve one Gateway API and decide identically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from runtime.config.file import placements_for
from runtime.running_stack import RunningStack
from runtime.stack import Stack
from services.inference.load_hints import parse_load
from spine.client.gateway_client import GatewayClient
from tests.conftest import DEV_KEY, OTHER_KEY, TIGHT_KEY, config_for_tests, make_jwt
from tests.waiting import eventually
from wire.v1 import generation_pb2


def gen(prompt: str = "hello", max_tokens: int = 6, model: str = "tiny-lm", **fields: Any,
        ) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(model=model, prompt=prompt, max_tokens=max_tokens, **fields)


# A prompt whose greedy answer runs all 250 tokens (many stop early at EOS, and a short answer
# can beat a deadline on a fast machine). Never completed in the deadline and cancellation
# tests, so never cached; `test_the_long_prompt_runs_to_its_length` keeps this true.
LONG_PROMPT = "a long greedy answer for collapsed"


def parity_sequence() -> list[tuple[generation_pb2.GenerateRequest, str | None]]:
    """Auth denials, rate-limit denials, cache hits, sampled and greedy answers, bad input."""
    jwt_ok = make_jwt("dev")
    jwt_expired = make_jwt("dev", expires_in=-3600)
    jwt_wrong_key = make_jwt("dev", secret="another-secret-that-is-long-enough-000000")
    seq: list[tuple[generation_pb2.GenerateRequest, str | None]] = [
        (gen("parity greedy one"), DEV_KEY),
        (gen("parity greedy one"), DEV_KEY),                 # cache hit
        (gen("parity sampled", temperature=0.9, seed=11), DEV_KEY),
        (gen("parity sampled", temperature=0.9, seed=11), DEV_KEY),  # seeded: cacheable
        (gen("parity sampled", temperature=0.9, seed=12), DEV_KEY),
        (gen("parity jwt"), jwt_ok),
        (gen("parity jwt"), jwt_expired),
        (gen("parity jwt"), jwt_wrong_key),
        (gen("parity none"), None),
        (gen("parity bad key"), "not-a-key"),
        (gen("parity alias", model="default"), DEV_KEY),
        (gen("parity unknown", model="gpt-9"), DEV_KEY),
        (gen("parity zero", max_tokens=0), DEV_KEY),
        (gen("parity big", max_tokens=100000), DEV_KEY),
        (gen("", max_tokens=3), DEV_KEY),
        (gen("parity hot", temperature=9.0), DEV_KEY),
        (gen("parity greedy one", inference_timeout_ms=120_001), DEV_KEY),  # over the cap, though cached
        (gen("parity prio", priority=1), TIGHT_KEY),         # above the tight tenant's allowance
    ]
    # The tight tenant's burst is 4 requests: the 5th and 6th are refused.
    seq += [(gen(f"parity tight {i}", max_tokens=2), TIGHT_KEY) for i in range(6)]
    return seq


def run_sequence(stack: RunningStack) -> list[tuple[Any, ...]]:
    with GatewayClient(stack.address) as client:
        results = []
        for request, token in parity_sequence():
            result = client.generate(request, token=token or "")
            assert result.layout == stack.layout
            results.append(result.decision())
    return results


def test_layouts_decide_identically(layouts: dict[str, RunningStack]) -> None:
    decisions = {name: run_sequence(stack) for name, stack in layouts.items()}
    assert decisions["layered"] == decisions["collapsed"]
    assert decisions["mixed"] == decisions["collapsed"]
    codes = [d[0] for d in decisions["collapsed"]]
    # The sequence really exercised every kind of decision:
    assert codes[:6] == ["OK"] * 6
    assert decisions["collapsed"][1][2] is True, "second identical greedy request must be a cache hit"
    assert decisions["collapsed"][3][2] is True, "seeded sampled request must be a cache hit"
    assert decisions["collapsed"][4][3] != decisions["collapsed"][2][3], "another seed gives other tokens"
    assert codes[6:10] == ["UNAUTHENTICATED"] * 4
    assert codes[10] == "OK" and codes[11] == "NOT_FOUND"
    assert codes[12:17] == ["INVALID_ARGUMENT"] * 5
    assert codes[17] == "PERMISSION_DENIED"
    assert codes[18:] == ["OK"] * 4 + ["RESOURCE_EXHAUSTED"] * 2


def test_every_answer_names_its_layout_and_request_id(layouts: dict[str, RunningStack]) -> None:
    for name, stack in layouts.items():
        with GatewayClient(stack.address, DEV_KEY) as client:
            ok = client.generate(gen("trailers"))
            denied = client.generate(gen("trailers"), token="nope")
        for result in (ok, denied):
            assert result.trailing["x-spine-layout"] == ("mixed" if name == "mixed" else name)
            assert len(result.trailing["x-request-id"]) >= 16


@pytest.mark.parametrize("layout", ["layered", "collapsed"])
def test_rate_limit_denial_carries_retry_after(layouts: dict[str, RunningStack], layout: str) -> None:
    with GatewayClient(layouts[layout].address, TIGHT_KEY) as client:
        results = [client.generate(gen(f"retry {layout} {i}", max_tokens=2)) for i in range(8)]
    denied = [r for r in results if r.code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert denied, "the tight tenant must be rate limited"
    assert float(denied[0].trailing["retry-after"]) > 0
    assert "tenant=tight" in denied[0].details


@pytest.mark.parametrize("layout", ["layered", "collapsed"])
def test_bad_input_gets_clear_errors_and_the_process_keeps_serving(layouts: dict[str, RunningStack],
                                                                   layout: str) -> None:
    stack = layouts[layout]
    with GatewayClient(stack.address, DEV_KEY) as client:
        cases = {
            "max_tokens": gen(max_tokens=-1),
            "prompt": gen("x" * 5000),
            "temperature": gen(temperature=-0.5),
            "model": gen(model=""),
        }
        for field, request in cases.items():
            result = client.generate(request)
            assert result.code == grpc.StatusCode.INVALID_ARGUMENT, field
            assert result.details.startswith(field), result.details
        oversize = client.generate(gen("y" * (2 << 20)))
        assert oversize.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.generate(gen("still serving")).ok


def test_the_long_prompt_runs_to_its_length(tmp_path: Any) -> None:
    from tests.conftest import config_for_tests, start_stack

    stack = start_stack("collapsed", tmp_path, config_for_tests(cache={"max_entries": 1, "ttl_s": 0.001}))
    try:
        with GatewayClient(stack.address, DEV_KEY) as client:
            result = client.generate(gen(LONG_PROMPT, max_tokens=250), timeout=60)
    finally:
        stack.stop()
    assert result.ok and result.response is not None
    assert (result.response.completion_tokens, result.response.finish_reason) == (250, "length")


@pytest.mark.parametrize("layout", ["layered", "collapsed"])
def test_deadline_is_honoured(layouts: dict[str, RunningStack], layout: str) -> None:
    with GatewayClient(layouts[layout].address, DEV_KEY) as client:
        result = client.generate(gen(LONG_PROMPT, max_tokens=250), timeout=0.05)
        assert result.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert client.generate(gen("after the deadline")).ok


def test_client_cancellation_frees_the_generation_slot(layouts: dict[str, RunningStack]) -> None:
    stack = layouts["collapsed"]
    engine = stack.local_servicers["inference"].first.engine
    wait_until_idle(engine)
    with GatewayClient(stack.address, DEV_KEY) as client:
        call = client.stub.GenerateStream(gen(LONG_PROMPT, max_tokens=250),
                                          metadata=client.metadata(), timeout=30)
        next(iter(call))
        assert engine.active_count == 1
        call.cancel()
        wait_until_idle(engine)
    assert engine.active_count == 0


def test_deadline_frees_the_generation_slot(layouts: dict[str, RunningStack]) -> None:
    stack = layouts["collapsed"]
    engine = stack.local_servicers["inference"].first.engine
    wait_until_idle(engine)
    with GatewayClient(stack.address, DEV_KEY) as client:
        result = client.generate(gen(LONG_PROMPT, max_tokens=250), timeout=0.1)
    assert result.code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until_idle(engine)
    assert engine.active_count == 0


def wait_until_idle(engine: Any, timeout: float = 5.0) -> None:
    eventually(lambda: not engine.active_count, timeout, "the engine idle")


@pytest.mark.parametrize("layout", ["layered", "collapsed", "mixed"])
def test_answers_carry_the_model_load_hint(layouts: dict[str, RunningStack], layout: str) -> None:
    with GatewayClient(layouts[layout].address, DEV_KEY) as client:
        unary = client.generate(gen(f"load hint {layout}", max_tokens=3))
        streamed = client.stream(gen(f"load hint stream {layout}", max_tokens=3))
    for result in (unary, streamed):
        assert result.ok, result.details
        hint = parse_load(result.trailing["x-spine-load"])
        assert {"queue", "running", "slots", "kv_free"} <= set(hint), result.trailing["x-spine-load"]
        assert hint["slots"] >= 1


@pytest.mark.parametrize("layout", ["layered", "collapsed"])
def test_stream_equals_unary_answer(layouts: dict[str, RunningStack], layout: str) -> None:
    with GatewayClient(layouts[layout].address, DEV_KEY) as client:
        request = gen("stream parity", max_tokens=12, temperature=0.8, seed=5)
        streamed = client.stream(request)
        unary = client.generate(request, token=OTHER_KEY)  # another tenant: no cache hit
    assert streamed.ok and unary.ok and not unary.response.cached
    assert streamed.token_ids == unary.token_ids
    assert streamed.text == unary.text


def test_the_run_dir_and_the_config_copy_are_readable_by_this_user_only(tmp_path: Path) -> None:
    import stat

    run_dir = tmp_path / "private"
    run_dir.mkdir(mode=0o755)
    with Stack(config_for_tests(), placements_for("collapsed", config_for_tests()), run_dir=run_dir).start():
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE((run_dir / "config.yaml").stat().st_mode) == 0o600


@pytest.mark.parametrize("layout", ["collapsed", "layered"])
def test_an_undecodable_body_is_invalid_argument_with_both_trailers(
        layouts: dict[str, RunningStack], layout: str, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    with grpc.insecure_channel(layouts[layout].address) as channel:
        raw = channel.unary_unary("/spine.v1.Gateway/Generate")  # bytes in, bytes out
        with caplog.at_level(logging.DEBUG, logger="spine.gateway"), pytest.raises(grpc.RpcError) as raised:
            raw(b"\xff\xff\xff\xff not a protobuf", timeout=10)
    error: Any = raised.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid spine.v1.GenerateRequest" in error.details()
    trailers = dict(error.trailing_metadata())
    assert trailers["x-spine-layout"] == layout and trailers["x-request-id"]
    lines = [r for r in caplog.records if "not a spine.v1.GenerateRequest" in r.getMessage()
             and r.levelno == logging.DEBUG]  # each one at DEBUG; at WARNING, at most one a second
    assert len(lines) == 1 and lines[0].exc_info is None  # one line, no traceback


def test_a_flood_of_undecodable_bodies_is_one_warning_a_second_and_a_debug_line_each(
        layouts: dict[str, RunningStack]) -> None:
    from services.gateway import wire
    from tests.log_lines import LogLines, assert_summarized

    with grpc.insecure_channel(layouts["collapsed"].address) as channel, LogLines("spine.gateway", wire._undecodable) as lines:
        raw = channel.unary_unary("/spine.v1.Gateway/Generate")
        for _ in range(100):
            with pytest.raises(grpc.RpcError):
                raw(b"\xff\xff\xff\xff not a protobuf", timeout=10)
        assert_summarized(lines, wire._undecodable, 100, containing="not a spine.v1.GenerateRequest")
