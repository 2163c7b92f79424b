"""The pre-generated table and the output policy, through real stacks in both layouts: a table
hit takes no model step, a bad table is refused with one log line while the server answers,
and a configured phrase ends the answer with content_policy_violation, the same in both."""

from __future__ import annotations

import json
import logging
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from monolith.device import DeviceContext
from runtime.config.file import placements_for
from runtime.running_stack import RunningStack
from runtime.stack import Stack
from services.cache.pregenerated import served_digests, write_table
from services.inference.output_policy import VIOLATION
from spine.client.gateway_client import GatewayClient
from spine.tools.model.cache_build import PromptLine, answer_prompts
from tests.conftest import DEV_KEY, OTHER_KEY, config_for_tests, start_stack
from tests.waiting import eventually
from wire.v1 import generation_pb2

LAYOUTS = ("collapsed", "layered")
TABLE = [PromptLine("tiny-lm", "", "a common question", 6),
         PromptLine("tiny-lm", "Be brief.", "where is my order?", 8)]
PROBES = [f"policy probe {i}" for i in range(20)]
LATER = PromptLine("tiny-lm", "", "a question added later", 5)  # only in the replacement table


def metric(address: str, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def greedy(line: PromptLine) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(model=line.model, system=line.system, prompt=line.prompt,
                                          max_tokens=line.max_tokens)


def _phrase(text: str, avoid: list[str]) -> str | None:
    """Five printable characters of `text`, not all blank, found in none of `avoid`."""
    for start in range(len(text) - 4):
        piece = text[start:start + 5]
        if piece.isprintable() and piece.strip() and "\ufffd" not in piece and not any(piece in a for a in avoid):
            return piece
    return None


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A table of TABLE's answers, and a probe prompt with a phrase only its answer holds."""
    from services.registry import DEFAULT

    tmp = tmp_path_factory.mktemp("answers")
    config = config_for_tests().with_overrides({"inference": {"deterministic": True}})
    model = DEFAULT["inference"].build(config, DeviceContext.for_section(config.device), tmp)
    try:
        answers = answer_prompts(model, "tiny-lm", TABLE)
        later = answer_prompts(model, "tiny-lm", [LATER])
        texts = [a.text for _, a in answers + later]
        for prompt in PROBES:
            probe = answer_prompts(model, "tiny-lm", [PromptLine("tiny-lm", "", prompt, 24)])[0][1]
            phrase = _phrase(probe.text, texts)
            if phrase is not None:
                break
        else:
            raise AssertionError("no probe answer holds a phrase of its own")
    finally:
        model.close()
    digests = served_digests(config.inference)
    write_table(tmp / "table.bin", "tiny-lm", digests["tiny-lm"], answers)
    return {"table": tmp / "table.bin", "answers": [a for _, a in answers], "probe": prompt, "phrase": phrase,
            "replacement": (digests["tiny-lm"], answers + later)}


@pytest.fixture(scope="module")
def stacks(built: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningStack]]:
    config = config_for_tests(cache={"pregenerated": str(built["table"])},
                              output_policy={"rules": [{"name": "probe-phrase", "phrases": [built["phrase"]]}]})
    tmp = tmp_path_factory.mktemp("stacks")
    running: dict[str, RunningStack] = {}
    try:
        for layout in LAYOUTS:  # with the HTTP API too (the last test here)
            running[layout] = Stack(config, placements_for(layout, config), run_dir=tmp / layout,
                                    http_listen="127.0.0.1:0").start()
        yield running
    finally:
        for stack in running.values():
            stack.stop()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_greedy_request_in_the_table_is_answered_without_a_model_step(
        stacks: dict[str, RunningStack], built: dict[str, Any], layout: str) -> None:
    stack = stacks[layout]
    address = stack.metrics_address()
    assert address is not None
    steps = metric(address, "spine_batch_size_count", model="tiny-lm")
    with GatewayClient(stack.address, DEV_KEY) as client:
        results = [client.generate(greedy(line)) for line in TABLE]
        for result, stored in zip(results, built["answers"], strict=True):
            assert result.ok, result.details
            assert result.response is not None and result.response.cached
            expected = generation_pb2.GenerateResponse()
            expected.CopyFrom(stored)
            expected.cached = True
            assert result.response == expected
        assert metric(address, "spine_batch_size_count", model="tiny-lm") == steps
        assert metric(address, "spine_cache_pregenerated_hits_total", layout=layout, tenant="dev") >= len(TABLE)
        fresh = client.generate(generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"not in the table {layout}",
                                                               max_tokens=3))
    assert fresh.ok and not fresh.response.cached  # type: ignore[union-attr]
    assert metric(address, "spine_batch_size_count", model="tiny-lm") > steps  # the counter is live


def test_a_configured_phrase_is_a_content_policy_violation_the_same_in_both_layouts(
        stacks: dict[str, RunningStack], built: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    request = generation_pb2.GenerateRequest(model="tiny-lm", prompt=built["probe"], max_tokens=24)
    verdicts = {}
    for layout in LAYOUTS:
        stack = stacks[layout]
        address = stack.metrics_address()
        assert address is not None
        with GatewayClient(stack.address, DEV_KEY) as client, caplog.at_level(logging.DEBUG, "spine.gateway"):
            unary = client.generate(request)
            streamed = client.stream(request)
        for result in (unary, streamed):
            assert result.code == grpc.StatusCode.FAILED_PRECONDITION, (layout, result.code, result.details)
            assert result.details.startswith(VIOLATION)
            assert built["phrase"] not in result.details
        released = "".join(chunk.text for chunk in streamed.chunks)
        assert built["phrase"] not in released  # the chunk completing it was never sent
        assert metric(address, "spine_output_policy_violations_total", layout=layout, tenant="dev") == 2
        verdicts[layout] = [(r.code, r.details) for r in (unary, streamed)]
    assert verdicts["collapsed"] == verdicts["layered"]
    # One DEBUG line each (at WARNING, at most one a second: `services.common.log_limit`).
    logged = [r.getMessage() for r in caplog.records if VIOLATION in r.getMessage() and r.levelno == logging.DEBUG]
    assert len(logged) == 4 and all("probe-phrase" in line and built["phrase"] not in line for line in logged)


def test_a_flood_of_violations_is_one_warning_a_second_per_tenant_and_rule(
        stacks: dict[str, RunningStack], built: dict[str, Any]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from services.gateway import policing
    from tests.log_lines import LogLines, assert_summarized

    request = generation_pb2.GenerateRequest(model="tiny-lm", prompt=built["probe"], max_tokens=24)
    with GatewayClient(stacks["collapsed"].address, DEV_KEY) as client, \
            LogLines("spine.gateway", policing._violations) as lines, ThreadPoolExecutor(6) as pool:
        codes = set(pool.map(lambda _: client.generate(request).code, range(24)))
        assert codes == {grpc.StatusCode.FAILED_PRECONDITION}
        loud = assert_summarized(lines, policing._violations, 24, containing=VIOLATION)
    assert all(built["phrase"] not in line for line in loud + lines.at(logging.DEBUG))  # never the text


def test_a_replaced_table_is_swapped_in_by_every_layout_without_dropping_a_request(
        stacks: dict[str, RunningStack], built: dict[str, Any]) -> None:
    stop = threading.Event()
    failures: list[str] = []

    def traffic(stack: RunningStack) -> None:  # table hits all through the swap, under the dev tenant's rate
        with GatewayClient(stack.address, DEV_KEY) as client:
            for _ in range(3000):
                if stop.wait(0.01):
                    break
                result = client.generate(greedy(TABLE[0]))
                if not result.ok:  # (a cached answer is likely, not owed: the cache fails open past its budget)
                    failures.append(f"{stack.layout}: {result.code.name} {result.details}")

    threads = [threading.Thread(target=traffic, args=(stacks[layout],)) for layout in LAYOUTS]
    for thread in threads:
        thread.start()
    try:
        digest, answers = built["replacement"]
        write_table(built["table"], "tiny-lm", digest, answers)  # a temporary file renamed over the old one
        for layout in LAYOUTS:
            address = stacks[layout].metrics_address()
            assert address is not None
            with GatewayClient(stacks[layout].address, DEV_KEY) as client:
                def swapped(client: GatewayClient = client, address: str = address, layout: str = layout) -> bool:
                    before = metric(address, "spine_cache_pregenerated_hits_total", layout=layout, tenant="other")
                    client.generate(greedy(LATER), token=OTHER_KEY)
                    return metric(address, "spine_cache_pregenerated_hits_total", layout=layout,
                                  tenant="other") > before
                eventually(swapped, timeout=60, what=f"the {layout} cache mapping the new table")
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert failures == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_corrupt_table_is_refused_with_one_log_line_and_the_server_still_answers(
        built: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture, layout: str) -> None:
    corrupt = tmp_path / "corrupt.bin"
    data = bytearray(Path(built["table"]).read_bytes())
    data[-1] ^= 0xFF
    corrupt.write_bytes(data)
    with caplog.at_level(logging.INFO, logger="spine.cache"):
        stack = start_stack(layout, tmp_path, config_for_tests(cache={"pregenerated": str(corrupt)}))
        try:
            with GatewayClient(stack.address, DEV_KEY) as client:
                result = client.generate(greedy(TABLE[0]))
        finally:
            stack.stop()
    assert result.ok and result.response is not None and not result.response.cached  # from the model
    if layout == "collapsed":
        lines = [r.getMessage() for r in caplog.records if "cache.pregenerated" in r.getMessage()]
    else:
        assert stack.run_dir is not None
        lines = [line for line in (Path(stack.run_dir) / "logs" / "cache.log").read_text().splitlines()
                 if "cache.pregenerated" in line]
    assert len(lines) == 1 and "refused (corrupt" in lines[0] and str(corrupt) in lines[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_over_http_a_violation_is_the_content_policy_error_in_both_apis(stacks: dict[str, RunningStack], built: dict[str, Any],
                                                                         layout: str) -> None:
    """`{"error": "content_policy_violation", "suggestion": "rephrase"}` (400) for an answer, and
    as the last event of a stream that had begun (a 400 where the first chunk already broke it)."""
    import httpx

    from tests.http_helpers import sse_events

    chat = {"model": "tiny-lm", "max_tokens": 24, "temperature": 0,
            "messages": [{"role": "user", "content": built["probe"]}]}
    with httpx.Client(base_url=f"http://{stacks[layout].http_address}", timeout=30) as client:
        plain = client.post("/v1/chat/completions", headers={"authorization": f"Bearer {DEV_KEY}"}, json=chat)
        message = client.post("/v1/messages", headers={"x-api-key": DEV_KEY}, json=chat)
        streamed = client.post("/v1/chat/completions", headers={"authorization": f"Bearer {DEV_KEY}"},
                               json={**chat, "stream": True})
    for answer in (plain, message):
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"] == "content_policy_violation" and answer.json()["suggestion"] == "rephrase"
        assert built["phrase"] not in answer.text
    assert built["phrase"] not in streamed.text and "[DONE]" not in streamed.text
    if streamed.status_code == 200:  # the stream had begun: it ends with the error
        last = json.loads(sse_events(streamed.text)[-1][1])
        assert last["error"] == "content_policy_violation" and last["suggestion"] == "rephrase"
    else:
        assert streamed.status_code == 400 and streamed.json()["error"] == "content_policy_violation"
