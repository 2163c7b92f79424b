"""Every field a client sends reaches an upstream engine, and the engine's answer reaches the
client, in both APIs and both layouts; across the APIs it is translated or refused by name.

The engine is `tests.fault_upstream`'s `echo` model (`tests.echo_engine`), a real HTTP server
on 127.0.0.1 that answers what a full engine would (forced tool calls, logprobs, `n` choices,
usage details) and keeps every body it was sent; the clients are the official SDKs.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from runtime.config.file import load_config, placements_for
from runtime.running_stack import RunningStack
from runtime.stack import Stack
from tests.conftest import DEV_KEY, TEST_OVERRIDES, config_for_tests
from tests.echo_engine import ARGUMENTS
from tests.fault_upstream import FaultUpstream
from tests.http_helpers import anthropic_client, openai_client
from tests.waiting import eventually

LAYOUTS = ("collapsed", "layered")
ENGINE_KEY = "sk-engine-secret-for-fidelity-0000"
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLAUDE_WEATHER = {"name": "weather", "description": "The weather in a city.",
                  "input_schema": WEATHER["function"]["parameters"]}  # type: ignore[index]
PIXEL = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 32).decode()


@pytest.fixture(scope="module")
def engine() -> Iterator[FaultUpstream]:
    fault = FaultUpstream("http://127.0.0.1:9/v1", None).start()  # echo answers itself: nothing is forwarded
    try:
        yield fault
    finally:
        fault.stop()


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory, engine: FaultUpstream) -> Iterator[dict[str, RunningStack]]:
    tmp = tmp_path_factory.mktemp("fidelity")
    key_file = tmp / "engine.key"
    key_file.write_text(ENGINE_KEY + "\n")
    served = {"base_url": engine.base_url, "api_key_file": str(key_file)}
    routes = [{"id": "engine", "upstream": {**served, "model": "echo"}},
              {"id": "claude-engine", "upstream": {**served, "model": "echo", "protocol": "anthropic"}},
              {"id": "text-only", "upstream": {**served, "model": "bad-image"}},
              {"id": "policed-engine", "upstream": {**served, "model": "echo"}}]
    # The echo engine's tool calls ask for Paris: on this route only, an answer that says so is refused.
    policy = {"rules": [{"name": "no-paris-calls", "phrases": ["Paris"], "models": ["policed-engine"]}]}
    config = config_for_tests(
        router={"models": [*(m.model_dump(exclude_none=True) for m in load_config().router.models), *routes]},
        http={"max_body_bytes": 8192}, ratelimit={"tenants": TEST_OVERRIDES["ratelimit"]["tenants"]},
        output_policy=policy)
    running: dict[str, RunningStack] = {}
    try:
        for layout in LAYOUTS:
            running[layout] = Stack(config, placements_for(layout, config), run_dir=Path(tmp / layout),
                                    http_listen="127.0.0.1:0").start()
        yield running
    finally:
        for stack in running.values():
            stack.stop()


def _last(engine: FaultUpstream) -> dict[str, Any]:
    return engine.received[-1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_openai_field_reaches_the_engine_and_its_answer_comes_back(
        stacks: dict[str, RunningStack], engine: FaultUpstream, layout: str) -> None:
    sent: dict[str, Any] = dict(
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "weather"}}, parallel_tool_calls=False,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}},
        stop=["\n"], n=2, logprobs=True, top_logprobs=2, logit_bias={"50256": -100}, top_p=0.9,
        presence_penalty=0.5, frequency_penalty=0.25, seed=7, user="u-1", metadata={"team": "rag"},
        max_completion_tokens=12, temperature=0)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": f"weather in Paris? ({layout})"},
        {"type": "image_url", "image_url": {"url": "https://images.invalid/paris.png", "detail": "low"}}]}]
    answer = openai_client(stacks[layout]).chat.completions.create(
        model="engine", messages=messages, extra_body={"guided_decoding_backend": "xgrammar"}, **sent)  # type: ignore[call-overload]
    got = _last(engine)
    assert got["model"] == "echo" and got["messages"] == messages
    assert {name: got[name] for name in sent} == sent
    assert got["guided_decoding_backend"] == "xgrammar"  # a field the spine does not know
    assert len(answer.choices) == 2 and answer.choices[0].finish_reason == "tool_calls"
    call = answer.choices[0].message.tool_calls[0]
    assert call.function.name == "weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert answer.choices[0].logprobs is not None and len(answer.choices[0].logprobs.content[0].top_logprobs) == 2
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    assert answer.usage.prompt_tokens_details.cached_tokens == 3
    assert answer.usage.completion_tokens_details is not None
    assert answer.usage.completion_tokens_details.reasoning_tokens == 1
    assert answer.model == "engine"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_streamed_tool_call_and_its_result_round_trip(stacks: dict[str, RunningStack], engine: FaultUpstream,
                                                        layout: str) -> None:
    client = openai_client(stacks[layout])
    ask = [{"role": "user", "content": f"weather? stream {layout}"}]
    chunks = list(client.chat.completions.create(
        model="engine", messages=ask, tools=[WEATHER], tool_choice="required", stream=True))  # type: ignore[arg-type]
    calls = [c for chunk in chunks for choice in chunk.choices for c in (choice.delta.tool_calls or [])]
    assert calls[0].function is not None and calls[0].function.name == "weather" and calls[0].id == "call_0"
    assert "".join(c.function.arguments or "" for c in calls if c.function) == ARGUMENTS
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and chunks[-1].usage is None  # usage not asked for
    result = [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "weather", "arguments": ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "18C"}]
    after = client.chat.completions.create(model="engine", messages=result, tools=[WEATHER])  # type: ignore[arg-type]
    assert after.choices[0].message.content == "the tool said 18C"
    assert _last(engine)["messages"] == result
    streamed = list(client.chat.completions.create(model="engine", messages=result, stream=True, logprobs=True,  # type: ignore[arg-type]
                                                   stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "the tool said 18C"
    assert any(c.choices and c.choices[0].logprobs for c in streamed)
    assert streamed[-1].usage is not None and streamed[-1].usage.prompt_tokens == 11


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_anthropic_client_with_tools_over_an_openai_engine(stacks: dict[str, RunningStack], engine: FaultUpstream,
                                                              layout: str) -> None:
    claude = anthropic_client(stacks[layout])
    ask: list[Any] = [{"role": "user", "content": [
        {"type": "text", "text": "weather in this picture?", "cache_control": {"type": "ephemeral"}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PIXEL}}]}]
    message = claude.messages.create(model="engine", max_tokens=20, system="be brief", messages=ask,
                                     tools=[CLAUDE_WEATHER], tool_choice={"type": "tool", "name": "weather"},  # type: ignore[list-item]
                                     stop_sequences=["END"])
    got = _last(engine)
    assert got["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
        {"type": "text", "text": "weather in this picture?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PIXEL}"}}]}]
    assert got["tools"] == [WEATHER] and got["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert got["stop"] == ["END"] and got["max_tokens"] == 20
    block = message.content[0]
    assert message.stop_reason == "tool_use" and block.type == "tool_use"
    assert block.name == "weather" and block.input == {"city": "Paris"}
    assert message.usage.input_tokens == 8 and message.usage.cache_read_input_tokens == 3
    result = [*ask, {"role": "assistant", "content": [block.model_dump()]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "18C"}]}]
    after = claude.messages.create(model="engine", max_tokens=20, messages=result, tools=[CLAUDE_WEATHER])  # type: ignore[list-item]
    assert after.content[0].type == "text" and after.content[0].text == "the tool said 18C"
    assert _last(engine)["messages"][-2]["tool_calls"][0]["function"]["name"] == "weather"
    with claude.messages.stream(model="engine", max_tokens=20, messages=ask, tools=[CLAUDE_WEATHER],  # type: ignore[list-item]
                                tool_choice={"type": "any"}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use" and "input_json" in kinds


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_openai_client_with_tools_over_an_anthropic_engine(stacks: dict[str, RunningStack], engine: FaultUpstream,
                                                              layout: str) -> None:
    client = openai_client(stacks[layout])
    answer = client.chat.completions.create(
        model="claude-engine", max_tokens=20, stop="END", tools=[WEATHER],  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "weather"}},
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather?"}])
    got = _last(engine)
    assert got["system"] == "be brief" and got["tools"] == [CLAUDE_WEATHER]
    assert got["tool_choice"] == {"type": "tool", "name": "weather"} and got["stop_sequences"] == ["END"]
    call = answer.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert answer.choices[0].finish_reason == "tool_calls" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert answer.usage is not None and answer.usage.prompt_tokens == 11
    chunks = list(client.chat.completions.create(model="claude-engine", max_tokens=20, tools=[WEATHER],  # type: ignore[arg-type]
                                                 tool_choice="required", stream=True,
                                                 messages=[{"role": "user", "content": "weather?"}]))
    calls = [c for chunk in chunks for choice in chunk.choices for c in (choice.delta.tool_calls or [])]
    assert calls[0].function is not None and calls[0].function.name == "weather"
    assert "".join(c.function.arguments or "" for c in calls if c.function) == ARGUMENTS


def test_what_has_no_translation_is_refused_by_name(stacks: dict[str, RunningStack], engine: FaultUpstream) -> None:
    before = len(engine.received)
    claude = anthropic_client(stacks["collapsed"])
    with pytest.raises(anthropic.BadRequestError) as thinking:
        claude.messages.create(model="engine", max_tokens=100, messages=[{"role": "user", "content": "hi"}],
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert "thinking" in thinking.value.message and "no translation" in thinking.value.message
    with pytest.raises(openai.BadRequestError) as logprobs:
        openai_client(stacks["collapsed"]).chat.completions.create(
            model="claude-engine", max_tokens=5, logprobs=True, messages=[{"role": "user", "content": "hi"}])
    assert "logprobs" in logprobs.value.message and "no translation" in logprobs.value.message
    assert len(engine.received) == before  # nothing was sent


def test_a_built_in_model_refuses_what_it_cannot_honour_by_name(stacks: dict[str, RunningStack]) -> None:
    client = openai_client(stacks["collapsed"])
    with pytest.raises(openai.BadRequestError) as tools:
        client.chat.completions.create(model="default", max_tokens=2, tools=[WEATHER],  # type: ignore[list-item]
                                       messages=[{"role": "user", "content": "hi"}])
    assert "tools: not supported by the built-in model" in tools.value.message
    with pytest.raises(openai.BadRequestError) as image:
        client.chat.completions.create(model="default", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://images.invalid/a.png"}}]}])
    assert "messages[0].content[0].type" in image.value.message


def test_malformed_tools_and_schemas_never_reach_the_engine(stacks: dict[str, RunningStack], engine: FaultUpstream) -> None:
    before = len(engine.received)
    client = openai_client(stacks["collapsed"])
    bad_schema = {"type": "function", "function": {"name": "w", "parameters": {"type": "objekt"}}}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": [bad_schema]}, "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ]
    for options, field in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="engine", max_tokens=2, messages=[{"role": "user", "content": "x"}],
                                           **options)
        assert f"400 - {field}" in refused.value.message, (field, refused.value.message)
    with pytest.raises(anthropic.BadRequestError) as claude:
        anthropic_client(stacks["collapsed"]).messages.create(
            model="engine", max_tokens=2, messages=[{"role": "user", "content": "x"}],
            tools=[{"name": "w", "input_schema": {"type": "objekt"}}])  # type: ignore[list-item]
    assert "tools[0].input_schema" in claude.value.message
    assert len(engine.received) == before


def test_an_engines_refusal_of_the_request_reaches_the_client_in_its_api(stacks: dict[str, RunningStack],
                                                                          engine: FaultUpstream) -> None:
    image = {"type": "image_url", "image_url": {"url": "https://images.invalid/a.png"}}
    for layout in LAYOUTS:
        with pytest.raises(openai.BadRequestError) as refused:
            openai_client(stacks[layout]).chat.completions.create(
                model="text-only", max_tokens=2, messages=[{"role": "user", "content": [image]}])
        assert "Image input is not supported by this model" in refused.value.message
        assert ENGINE_KEY not in refused.value.response.text
    assert _last(engine)["messages"][0]["content"] == [image]  # the URL went untouched: the spine fetched nothing
    with pytest.raises(anthropic.BadRequestError) as claude:
        anthropic_client(stacks["layered"]).messages.create(
            model="text-only", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "https://images.invalid/b.png"}}]}])
    assert claude.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "Image input is not supported" in claude.value.message


def test_a_base64_image_over_the_body_limit_is_refused_unread(stacks: dict[str, RunningStack], engine: FaultUpstream) -> None:
    before = len(engine.received)
    huge = base64.b64encode(b"\0" * 9000).decode()
    with pytest.raises(openai.APIStatusError) as refused:
        openai_client(stacks["collapsed"]).chat.completions.create(model="engine", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{huge}"}}]}])
    assert refused.value.status_code == 413 and len(engine.received) == before


def test_the_cache_keys_on_the_whole_canonical_request(stacks: dict[str, RunningStack], engine: FaultUpstream) -> None:
    url = f"http://{stacks['collapsed'].http_address}/v1/chat/completions"
    headers = {"authorization": f"Bearer {DEV_KEY}", "content-type": "application/json"}
    tools = json.dumps(WEATHER)
    one = ('{"model":"engine","temperature":0,"max_tokens":3,"tools":[' + tools + '],'
           '"messages":[{"role":"user","content":"cache me"}]}')
    reordered = ('{ "messages": [ {"content": "cache me", "role": "user"} ], "tools": [' + json.dumps(WEATHER, indent=1)
                 + '],\n  "max_tokens": 3, "temperature": 0, "model": "engine" }')
    other_tools = one.replace('"weather"', '"forecast"')
    hits = engine.hits["echo"]
    with httpx.Client(timeout=20) as http:
        first = http.post(url, content=one, headers=headers)
        again = http.post(url, content=reordered, headers=headers)
        assert first.status_code == again.status_code == 200
        assert engine.hits["echo"] == hits + 1 and again.json()["choices"] == first.json()["choices"]
        assert http.post(url, content=other_tools, headers=headers).status_code == 200
    assert engine.hits["echo"] == hits + 2  # other tools: another answer


def test_a_built_in_model_ends_its_answer_at_a_stop_string(stacks: dict[str, RunningStack]) -> None:
    client = openai_client(stacks["collapsed"])
    ask: Any = {"model": "default", "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": "tell me about stops"}]}
    whole = client.chat.completions.create(**ask).choices[0].message.content or ""
    stop = whole[5:7]
    assert len(whole) >= 8 and stop, whole
    expected = whole[:whole.find(stop)]
    stopped = client.chat.completions.create(**ask, stop=[stop])
    assert stopped.choices[0].message.content == expected and stopped.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**ask, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    claude = anthropic_client(stacks["layered"]).messages.create(
        model="default", max_tokens=16, extra_body={"temperature": 0}, stop_sequences=[stop],
        messages=[{"role": "user", "content": "tell me about stops"}])
    assert claude.stop_reason == "stop_sequence" and claude.stop_sequence == stop
    assert claude.content[0].type == "text" and claude.content[0].text == expected


def test_the_log_line_names_the_tools_offered_and_called_never_an_image(stacks: dict[str, RunningStack],
                                                                          engine: FaultUpstream) -> None:
    response = openai_client(stacks["collapsed"]).chat.completions.with_raw_response.create(
        model="engine", tools=[WEATHER], tool_choice="required", messages=[{"role": "user", "content": [  # type: ignore[list-item]
            {"type": "text", "text": "log me"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PIXEL}"}}]}])
    request_id = response.headers["x-request-id"]
    logs = stacks["collapsed"].local_servicer("logs")

    def logged() -> dict[str, Any] | None:  # the completions writer hands the record on after the answer
        logs.flush()
        lines = [json.loads(line) for line in Path(logs.path).read_text().splitlines()]
        return next((entry["fields"] for entry in lines if entry["request_id"] == request_id), None)

    fields = eventually(logged, what=f"the log line of request {request_id}")
    assert fields["tools_offered"] == "weather" and fields["tools_called"] == "weather"
    assert fields["images"] == "1" and fields["api"] == "openai.chat"
    assert PIXEL not in Path(logs.path).read_text()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_embeddings_from_an_engine_through_the_pipeline(stacks: dict[str, RunningStack], engine: FaultUpstream,
                                                        layout: str) -> None:
    client = openai_client(stacks[layout])
    texts = [f"first text {layout}", "second"]
    hits = engine.hits["echo"]
    answer = client.embeddings.create(model="engine", input=texts, dimensions=4, user="u-2")
    assert [len(item.embedding) for item in answer.data] == [4, 4]
    assert answer.data[0].embedding[0] == float(len(texts[0])) and answer.model == "engine"
    assert answer.usage.prompt_tokens == 4
    got = _last(engine)
    assert got == {"model": "echo", "input": texts, "dimensions": 4, "user": "u-2", "encoding_format": "base64"}
    again = client.embeddings.create(model="engine", input=texts, dimensions=4, user="u-2")
    assert again.data[0].embedding == answer.data[0].embedding and engine.hits["echo"] == hits + 1  # cached


def test_embeddings_are_refused_by_name_where_no_engine_serves_them(stacks: dict[str, RunningStack]) -> None:
    client = openai_client(stacks["collapsed"])
    with pytest.raises(openai.BadRequestError) as built_in:
        client.embeddings.create(model="default", input="x")
    assert "400 - embeddings: the built-in model" in built_in.value.message
    with pytest.raises(openai.BadRequestError) as claude:
        client.embeddings.create(model="claude-engine", input="x")
    assert "embeddings: an Anthropic-protocol engine has no embeddings endpoint" in claude.value.message
    with pytest.raises(openai.BadRequestError) as empty:
        client.embeddings.create(model="engine", input=[])
    assert "input: required" in empty.value.message


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_responses_api_over_an_engines_chat_completions(stacks: dict[str, RunningStack], engine: FaultUpstream,
                                                            layout: str) -> None:
    client = openai_client(stacks[layout])
    tool = {"type": "function", "name": "weather", "parameters": WEATHER["function"]["parameters"]}  # type: ignore[index]
    called = client.responses.create(model="engine", instructions="be brief", input="weather in Paris?",
                                     tools=[tool], tool_choice={"type": "function", "name": "weather"},  # type: ignore[list-item]
                                     max_output_tokens=30)
    got = _last(engine)
    assert got["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Paris?"}]
    assert got["tools"] == [WEATHER | {"function": {k: v for k, v in WEATHER["function"].items()  # type: ignore[attr-defined]
                                                    if k != "description"}}]
    assert got["tool_choice"] == {"type": "function", "function": {"name": "weather"}} and got["max_tokens"] == 30
    call = called.output[0]
    assert call.type == "function_call" and call.name == "weather" and json.loads(call.arguments) == {"city": "Paris"}
    items: list[Any] = [{"role": "user", "content": "weather in Paris?"},
                        {"type": "function_call", "call_id": call.call_id, "name": "weather", "arguments": call.arguments},
                        {"type": "function_call_output", "call_id": call.call_id, "output": "18C"}]
    after = client.responses.create(model="engine", input=items,
                                    text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}})
    assert after.output_text == "the tool said 18C" and after.usage is not None and after.usage.input_tokens == 11
    assert _last(engine)["response_format"] == {"type": "json_schema",
                                                "json_schema": {"name": "w", "schema": {"type": "object"}}}
    events = list(client.responses.create(model="engine", input="stream me", stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "ok"
    assert events[-1].response.output_text == "ok"  # type: ignore[union-attr]
    streamed_call = list(client.responses.create(model="engine", input="weather?", tools=[tool],  # type: ignore[list-item]
                                                 tool_choice="required", stream=True))
    done = [e for e in streamed_call if e.type == "response.function_call_arguments.done"]
    assert done and json.loads(done[0].arguments) == {"city": "Paris"}  # type: ignore[union-attr]


def test_the_responses_api_on_a_built_in_model_and_what_it_refuses(stacks: dict[str, RunningStack]) -> None:
    client = openai_client(stacks["collapsed"])
    plain = client.responses.create(model="default", input="hello there", max_output_tokens=4, temperature=0)
    assert plain.output_text and plain.usage is not None and plain.usage.output_tokens <= 4
    events = list(client.responses.create(model="default", input="hello there", max_output_tokens=4, temperature=0,
                                          stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
    with pytest.raises(openai.BadRequestError) as stored:
        client.responses.create(model="engine", input="again", previous_response_id="resp_1")
    assert "previous_response_id: not supported: this server stores no responses" in stored.value.message
    with pytest.raises(openai.BadRequestError) as search:
        client.responses.create(model="engine", input="x", tools=[{"type": "web_search"}])  # type: ignore[list-item]
    assert "tools[0].type" in search.value.message


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_output_policy_reads_tool_call_arguments_plain_and_streamed(stacks: dict[str, RunningStack],
                                                                       layout: str) -> None:
    """A call's arguments reach a tool with more consequence than prose: the policy reads them in
    each API, whole and as streamed pieces, and the call never reaches the client."""
    from tests.http_helpers import sse_events

    forced = {"type": "function", "function": {"name": "weather"}}
    chat = {"model": "policed-engine", "max_tokens": 16, "tools": [WEATHER], "tool_choice": forced,
            "messages": [{"role": "user", "content": "Weather?"}]}
    claude = {"model": "policed-engine", "max_tokens": 16, "tools": [CLAUDE_WEATHER],
              "tool_choice": {"type": "tool", "name": "weather"}, "messages": [{"role": "user", "content": "Weather?"}]}
    with httpx.Client(base_url=f"http://{stacks[layout].http_address}", timeout=30) as client:
        answers = [client.post("/v1/chat/completions", headers={"authorization": f"Bearer {DEV_KEY}"}, json=chat),
                   client.post("/v1/messages", headers={"x-api-key": DEV_KEY}, json=claude)]
        streams = [client.post("/v1/chat/completions", headers={"authorization": f"Bearer {DEV_KEY}"},
                               json={**chat, "stream": True}),
                   client.post("/v1/messages", headers={"x-api-key": DEV_KEY}, json={**claude, "stream": True})]
        unpoliced = client.post("/v1/chat/completions", headers={"authorization": f"Bearer {DEV_KEY}"},
                                json={**chat, "model": "engine"})
    for answer in answers:
        assert answer.status_code == 400 and answer.json()["error"] == "content_policy_violation", answer.text
    for streamed in streams:
        assert "Paris" not in streamed.text
        if streamed.status_code == 200:  # the stream had begun: it ends with the error
            assert json.loads(sse_events(streamed.text)[-1][1])["error"] == "content_policy_violation"
        else:
            assert streamed.status_code == 400 and streamed.json()["error"] == "content_policy_violation"
    assert unpoliced.status_code == 200 and "Paris" in unpoliced.text  # the rule names its route only

