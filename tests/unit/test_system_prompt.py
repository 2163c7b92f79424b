"""GenerateRequest.system: read before the prompt, echoed, validated, keyed, charged — and its KV reused."""

from __future__ import annotations

import grpc
import pytest

from services.cache.service import cache_key
from services.pipeline.limits import RequestLimits
from services.pipeline.local_context import LocalRpcError
from services.pipeline.system_prompt import system_digest
from services.pipeline.verdicts import rate_limit_cost, validation_error
from tests.unit.test_serving_support import Call, generate, make_service, request
from wire.v1 import generation_pb2

pytestmark = pytest.mark.usefixtures("torch_one_thread")

SYSTEM = "You are a careful assistant. Answer in one short sentence, then stop."


def test_the_model_reads_the_system_prompt_and_a_blank_line_before_the_prompt() -> None:
    service, _ = make_service()
    try:
        with_system, _ = generate(service, request("Why is the sky blue?", 10, system=SYSTEM))
        joined, _ = generate(service, request(f"{SYSTEM}\n\nWhy is the sky blue?", 10))
        assert list(with_system.token_ids) == list(joined.token_ids)
        assert with_system.prompt_tokens == joined.prompt_tokens == len(SYSTEM) + 2 + len("Why is the sky blue?")
        assert with_system.system_digest == system_digest(SYSTEM) and joined.system_digest == ""
    finally:
        service.close()


def test_every_chunk_of_a_stream_echoes_the_system_prompt_used() -> None:
    service, _ = make_service()
    try:
        from services.pipeline.local_context import LocalContext

        chunks = list(service.GenerateStream(request("Hi", 4, system=SYSTEM), LocalContext()))
        assert chunks and {c.system_digest for c in chunks} == {system_digest(SYSTEM)}
    finally:
        service.close()


def test_requests_sharing_a_system_prompt_share_its_kv_blocks_and_get_the_same_answers() -> None:
    reused, _ = make_service(kv_cache_max_entries=4, max_batch=4)
    fresh, _ = make_service(kv_cache_max_entries=4, max_batch=4, prefix_cache=False)
    try:
        prompts = [f"Question {i}: what now?" for i in range(8)]
        answers = {}
        for name, service in (("reused", reused), ("fresh", fresh)):
            calls = [Call(service, request(p, 6, system=SYSTEM * 3)) for p in prompts]
            answers[name] = [call.wait().tokens for call in calls]
        assert answers["reused"] == answers["fresh"]
        kv_reused, kv_fresh = reused.engine.kv, fresh.engine.kv
        assert kv_reused is not None and kv_fresh is not None
        assert kv_reused.prefixes.hits == len(prompts) - 1 and kv_reused.prefixes.misses == 1
        assert kv_reused.pool.peak < kv_fresh.pool.peak
    finally:
        reused.close()
        fresh.close()


def test_a_system_prompt_past_the_context_is_refused_naming_it() -> None:
    service, _ = make_service()
    try:
        with pytest.raises(LocalRpcError) as refused:
            generate(service, request("Hi", 8, system="x" * 1100))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("system (1102 tokens) + prompt (2 tokens) + BOS + max_tokens (8)")
    finally:
        service.close()


def test_the_gateway_refuses_a_system_prompt_over_the_limit_naming_the_field() -> None:
    limits = RequestLimits.parse({"max_system_chars": 10}, "limits")
    ok = generation_pb2.GenerateRequest(model="tiny-lm", prompt="hi", max_tokens=4, system="short")
    assert validation_error(ok, limits) is None
    long = generation_pb2.GenerateRequest(model="tiny-lm", prompt="hi", max_tokens=4, system="x" * 11)
    assert validation_error(long, limits) == (
        "system: 11 characters is over the limit of 10 (limits.max_system_chars)")


def test_the_system_prompt_is_part_of_the_cache_key_and_of_the_rate_limit_cost() -> None:
    plain = generation_pb2.GenerateRequest(model="tiny-lm", prompt="hi", max_tokens=4)
    keys = {cache_key("dev", generation_pb2.GenerateRequest(model="tiny-lm", prompt="hi", max_tokens=4, system=s))
            for s in ("", "be brief", "be verbose")}
    assert len(keys) == 3 and cache_key("dev", plain) in keys
    with_system = generation_pb2.GenerateRequest(model="tiny-lm", prompt="hi", max_tokens=4, system="héllo")
    assert rate_limit_cost(with_system) == rate_limit_cost(plain) + len("héllo".encode())
