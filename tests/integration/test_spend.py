"""Spend, budgets and tokens per minute in one spine: each answer priced from its real usage
(both APIs, streams, an aborted stream), a key's and a team's budget refusing once reached in
each API's shape (official openai and anthropic SDKs, and the gRPC Gateway), and the tokens
bucket charged the prompt at admission and settled with what was generated."""

from __future__ import annotations

import calendar
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import grpc
import httpx
import openai
import pytest

from runtime.config.file import placements_for
from runtime.running_stack import RunningStack
from runtime.stack import Stack
from services.common.redis_link import RedisLink
from services.ratelimit.spend import Payer, SpendLedger, period
from services.ratelimit.spend_config import Price, SpendConfig
from services.ratelimit.spend_store import RedisSpendStore
from spine.client.gateway_client import GatewayClient
from spine.tools.local_redis import LocalRedis
from tests.conftest import config_for_tests
from tests.http_helpers import anthropic_client, openai_client
from tests.waiting import eventually
from wire.v1 import generation_pb2

TOKEN = "spend-admin-token-0123456789"
INPUT, OUTPUT = 1000.0, 2000.0  # USD per million tokens of tiny-lm: a token costs $0.001 in, $0.002 out
TOKENS_KEY = (("tenant", "metered"), ("model", "tiny-lm"), ("resource", "tokens"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    config = config_for_tests(ratelimit={
        "tenants": {"metered": {"tokens_per_minute": 0.6, "token_burst": 100}},
        "spend": {"prices": {"tiny-lm": {"input": INPUT, "output": OUTPUT, "cached_input": 500.0}},
                  "teams": {"red": {"budget_usd": 0.05, "window": "daily"}}, "refresh_s": 0.05}})
    running = Stack(config, placements_for("collapsed", config), run_dir=tmp_path_factory.mktemp("spend") / "run",
                    http_listen="127.0.0.1:0", admin_token=TOKEN).start()
    yield running
    running.stop()


def new_key(stack: RunningStack, **fields: Any) -> tuple[str, str]:
    answer = httpx.post(f"http://{stack.http_address}/admin/keys", json={"tenant": "dev", **fields},
                        headers={"authorization": f"Bearer {TOKEN}"}, timeout=10).json()
    secret = answer["secret"]
    eventually(lambda: _works(stack, secret), 1.0, interval=0.02)
    return answer["key"]["id"], secret


def _works(stack: RunningStack, secret: str) -> bool:
    """Whether auth knows the key yet (asked for a model that does not exist: nothing is charged)."""
    with GatewayClient(stack.address, token=secret) as client:
        result = client.generate(generation_pb2.GenerateRequest(model="no-such-model", prompt="?", max_tokens=1),
                                 timeout=5)
    return result.code != grpc.StatusCode.UNAUTHENTICATED


def spent(stack: RunningStack, key: str, window: str = "monthly") -> dict[str, Any]:
    lines = httpx.get(f"http://{stack.http_address}/admin/spend", params={"key": key},
                      headers={"authorization": f"Bearer {TOKEN}"}, timeout=10).json()["lines"]
    return next(line for line in lines if line["window"] == window)


def cost(prompt: int, completion: int) -> float:
    return (prompt * INPUT + completion * OUTPUT) / 1e6


def test_prices_periods_and_windows() -> None:
    price = Price(input=3.0, output=15.0, cached_input=0.3)
    assert price.cost(1_000_000, 0, 0) == pytest.approx(3.0)
    assert price.cost(1_000_000, 400_000, 100_000) == pytest.approx(0.6 * 3 + 0.4 * 0.3 + 0.1 * 15)
    assert Price(input=2.0, output=1.0).cost(10, 10, 0) == pytest.approx(20 * 1e-6)  # no cached price: input's
    end_of_june = calendar.timegm((2025, 6, 30, 23, 59, 59))
    assert period("daily", end_of_june) == ("2025-06-30", pytest.approx(1.0))
    assert period("monthly", end_of_june) == ("2025-06", pytest.approx(1.0))
    assert period("monthly", end_of_june + 1)[0] == "2025-07"  # a new bucket: the window starts again
    assert period("monthly", calendar.timegm((2025, 12, 31, 12, 0, 0)))[0] == "2025-12"


def test_spend_is_priced_from_the_real_usage_of_both_apis_and_their_streams(stack: RunningStack) -> None:
    key, secret = new_key(stack)
    expected = 0.0
    answer = openai_client(stack, secret).chat.completions.create(
        model="tiny-lm", max_tokens=7, temperature=0, messages=[{"role": "user", "content": "price me"}])
    assert answer.usage is not None
    expected += cost(answer.usage.prompt_tokens, answer.usage.completion_tokens)
    chunks = list(openai_client(stack, secret).chat.completions.create(
        model="tiny-lm", max_tokens=9, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "stream me"}]))
    usage = chunks[-1].usage
    assert usage is not None
    expected += cost(usage.prompt_tokens, usage.completion_tokens)
    with anthropic_client(stack, secret).messages.stream(model="tiny-lm", max_tokens=5, extra_body={"temperature": 0},
                                                         messages=[{"role": "user", "content": "and me"}]) as s:
        final = s.get_final_message()
    expected += cost(final.usage.input_tokens, final.usage.output_tokens)
    line = eventually(lambda: (got := spent(stack, key))["requests"] == 3 and got, 2.0, interval=0.02)
    assert line["usd"] == pytest.approx(expected) and line["output_tokens"] == 7 + 9 + 5
    assert spent(stack, key, "daily")["usd"] == pytest.approx(expected)


def test_an_aborted_stream_is_charged_for_what_was_generated(stack: RunningStack) -> None:
    key, secret = new_key(stack, tenant="aborts")
    received = 0
    with openai_client(stack, secret).chat.completions.create(
            model="tiny-lm", max_tokens=256, temperature=0, stream=True,
            messages=[{"role": "user", "content": "a long answer, cut short"}]) as stream:
        for chunk in stream:
            received += bool(chunk.choices and chunk.choices[0].delta.content)
            if received == 3:
                break  # the client goes away
    line = eventually(lambda: (got := spent(stack, key))["requests"] == 1 and got, 3.0, interval=0.02)
    assert 3 <= line["output_tokens"] <= 256
    assert line["usd"] == pytest.approx(cost(line["input_tokens"], line["output_tokens"]))


def test_a_keys_budget_refuses_once_reached_in_each_apis_shape(stack: RunningStack) -> None:
    budget = 0.1
    key, secret = new_key(stack, budget_usd=budget)
    remaining: list[float] = []
    charged = 0.0
    client = openai_client(stack, secret)
    with pytest.raises(openai.RateLimitError) as refused:
        for i in range(100):
            if i % 2:  # a stream, its usage from the model
                raw = client.chat.completions.with_raw_response.create(
                    model="tiny-lm", max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True},
                    messages=[{"role": "user", "content": f"turn {i}"}])
                usage = list(raw.parse())[-1].usage
            else:
                raw = client.chat.completions.with_raw_response.create(
                    model="tiny-lm", max_tokens=6, temperature=0, messages=[{"role": "user", "content": f"turn {i}"}])
                usage = raw.parse().usage
            remaining.append(float(raw.headers["x-spine-budget-remaining-usd"]))
            assert usage is not None
            charged += cost(usage.prompt_tokens, usage.completion_tokens)
            eventually(lambda total=charged: spent(stack, key)["usd"] >= total - 1e-9, 2.0, interval=0.02)  # priced and shared
    error = refused.value
    assert charged >= budget - cost(len("turn 99"), 0)  # not refused below the budget
    assert error.code == "insufficient_quota" and "budget of key" in error.message
    assert error.response.headers["x-should-retry"] == "false"
    assert float(error.response.headers["x-spine-budget-remaining-usd"]) == 0.0
    assert remaining == sorted(remaining, reverse=True) and remaining[0] == pytest.approx(budget)
    with pytest.raises(anthropic.RateLimitError) as by_anthropic:
        anthropic_client(stack, secret).messages.create(model="tiny-lm", max_tokens=2,
                                                        messages=[{"role": "user", "content": "hi"}])
    assert by_anthropic.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    with GatewayClient(stack.address, token=secret) as gateway:
        result = gateway.generate(generation_pb2.GenerateRequest(model="tiny-lm", prompt="hi", max_tokens=2),
                                  timeout=5)
    assert result.code == grpc.StatusCode.RESOURCE_EXHAUSTED and result.details.startswith("budget exhausted")
    line = spent(stack, key)
    assert line["budget_usd"] == budget and line["remaining_usd"] == 0.0 and line["usd"] == pytest.approx(charged)


def test_a_teams_budget_holds_all_of_its_keys(stack: RunningStack) -> None:
    _, first = new_key(stack, team="red")
    _, second = new_key(stack, team="red")
    answers = 0
    with pytest.raises(openai.RateLimitError, match="budget of team red"):
        for i in range(100):
            openai_client(stack, (first, second)[i % 2]).chat.completions.create(
                model="tiny-lm", max_tokens=5, temperature=0, messages=[{"role": "user", "content": f"team {i:02d}"}])
            answers += 1
    assert answers == math.ceil(0.05 / cost(len("team 00"), 5))  # charged together, refused once reached


def test_tokens_per_minute_charge_the_prompt_then_settle_a_stream_past_the_limit(stack: RunningStack) -> None:
    """100 tokens of burst, barely refilled: a stream of 150 is admitted on its prompt, settled
    at its end with what it generated, and the next request is refused."""
    _, secret = new_key(stack, tenant="metered")
    limiter = stack.local_servicer("ratelimit")
    assert limiter.bucket(TOKENS_KEY) is None  # a full bucket of 100 once made
    chunks = list(openai_client(stack, secret).chat.completions.create(
        model="tiny-lm", max_tokens=150, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hi"}]))
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 150
    level = eventually(lambda: (b := limiter.bucket(TOKENS_KEY)).level < 0 and b.level, 2.0, interval=0.02)
    assert 100 - level == pytest.approx(usage.prompt_tokens + usage.completion_tokens, abs=0.1)
    with pytest.raises(openai.RateLimitError, match="resource=tokens"):
        openai_client(stack, secret).chat.completions.create(model="tiny-lm", max_tokens=1,
                                                             messages=[{"role": "user", "content": "again"}])


def test_the_ledger_keeps_deciding_and_keeps_its_charges_while_the_store_is_down(tmp_path: Path) -> None:
    with LocalRedis(tmp_path / "redis") as redis_server:
        config = SpendConfig(prices={"m": Price(input=1e6, output=0.0)}, refresh_s=5.0)  # $1 a prompt token
        store = RedisSpendStore(RedisLink(address=redis_server.address, timeout_s=0.1))
        other = RedisSpendStore(RedisLink(address=redis_server.address, timeout_s=0.1))
        ledger, replica = SpendLedger(config, store), SpendLedger(config, other)
        payer = Payer("t", key="k", key_budget_usd=5.0)
        try:
            replica.charge(payer, "m", 2, 0, 0)
            replica.exchange()
            assert ledger.check(payer).remaining_usd == 5.0  # not read yet
            ledger.exchange()
            assert ledger.check(payer).remaining_usd == 3.0  # the other replica's spend, once read
            redis_server.pause()
            ledger.charge(payer, "m", 2, 0, 0)
            ledger.exchange()
            assert not ledger.reachable and ledger.calls["error"] == 1 and ledger.outages == 1
            assert ledger.check(payer, estimate_usd=1.0).admitted  # $4 known spent, $1 more fits
            assert not ledger.check(payer, estimate_usd=1.5).admitted
            redis_server.resume()
            ledger.exchange()
            replica.check(payer)  # a budget checked here is read back at each exchange
            replica.exchange()
            assert ledger.reachable and replica.check(payer).remaining_usd == 1.0  # the kept charge arrived
        finally:
            redis_server.resume()
            ledger.close()
            replica.close()
