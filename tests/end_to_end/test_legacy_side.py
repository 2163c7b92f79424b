"""A foreign legacy side without processes: the plan's `legacy:`, the controller's check that a
plan matches its data path, the comparison of two gateways' answers, and the key import."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from migration.controller import Controller
from migration.legacy_endpoint import LegacyEndpoint, endpoint
from migration.plan import PlanError, load_plan
from migration.recording import RecordingTarget
from migration.traffic.http_answers import Answer, differences, is_greedy, read_answer
from migration.traffic.http_front import HttpFront
from migration.traffic.legacy_target import LegacyTarget
from runtime.config.file import load_config
from spine.tools.demo.legacy_rig import LEGACY_PLAN, replace_legacy
from spine.tools.demo.litellm_gateway import OFFLINE_ENV
from spine.tools.key_import import config_fragment, from_lines, from_litellm

PLAN = """name: p
legacy: {http: "http://127.0.0.1:4000", api_key_header: authorization}
stages:
  - {name: a, spine_weight: 50, hold_s: 1, gates: [{type: error_rate, max_delta: 0.02}]}
"""


def test_a_plan_names_its_legacy_endpoint_and_moves_only_traffic() -> None:
    plan = load_plan(PLAN)
    assert plan.legacy == LegacyEndpoint("http://127.0.0.1:4000", "authorization")
    assert load_plan(LEGACY_PLAN.read_text()).legacy is not None  # the shipped plan is valid
    with pytest.raises(PlanError) as bad:
        load_plan(PLAN.replace('"http://127.0.0.1:4000"', '"ftp://x"').replace("authorization", "X Key")
                  .replace("hold_s: 1,", "hold_s: 1, placements: {auth: local},"))
    problems = "\n".join(bad.value.problems)
    assert "legacy.http (line 2)" in problems and "legacy.api_key_header (line 2)" in problems
    assert "stages[0].placements (line 4): a foreign legacy side has no middlewares to move" in problems
    with pytest.raises(PlanError, match="without /v1"):
        load_plan(PLAN.replace("4000", "4000/v1"))
    with pytest.raises(PlanError, match="x-spine-"):
        load_plan(PLAN.replace("authorization", "x-spine-key"))


def test_the_controller_refuses_a_plan_for_another_from_side(tmp_path: Path) -> None:
    front = HttpFront(endpoint("http://127.0.0.1:4000"), "http://127.0.0.1:8000")  # nothing dialled
    legacy_controller = Controller.open(str(tmp_path / "a.sqlite"), LegacyTarget(front))
    layered_controller = Controller.open(str(tmp_path / "b.sqlite"), RecordingTarget())
    try:
        legacy_controller.check_plan(load_plan(PLAN))  # the same endpoint: accepted
        with pytest.raises(PlanError, match="front splits traffic with http://127.0.0.1:4000"):
            legacy_controller.check_plan(load_plan(PLAN.replace("4000", "4001")))
        layered_plan = PLAN.replace('legacy: {http: "http://127.0.0.1:4000", api_key_header: authorization}\n', "")
        with pytest.raises(PlanError, match="a plan for it says so: legacy: {http: http://127.0.0.1:4000"):
            legacy_controller.check_plan(load_plan(layered_plan))
        with pytest.raises(PlanError, match="migrates from spine's layered stack"):
            layered_controller.check_plan(load_plan(PLAN))
    finally:
        legacy_controller.close()
        layered_controller.close()
    assert replace_legacy(PLAN, endpoint("http://127.0.0.1:5555")).count("http://127.0.0.1:5555") == 1


OPENAI_JSON = b'{"id": "a", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi there"}}]}'
OPENAI_SSE = (b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}\n\n'
              b'data: {"choices": [{"delta": {"content": "hi "}}]}\n\ndata: {"choices": [{"delta": {"content": '
              b'"there"}}]}\n\ndata: [DONE]\n\n')
ANTHROPIC_SSE = (b'event: message_start\ndata: {"type": "message_start"}\n\n'
                 b'event: content_block_delta\ndata: {"type": "content_block_delta", "delta": {"type": "text_delta",'
                 b' "text": "hi there"}}\n\n')
ANTHROPIC_JSON = b'{"type": "message", "content": [{"type": "text", "text": "hi there"}]}'


def test_two_gateways_answers_compare_on_what_a_client_acts_on() -> None:
    texts = {read_answer(200, body, kind).text for body, kind in (
        (OPENAI_JSON, "application/json"), (OPENAI_SSE, "text/event-stream"), (ANTHROPIC_SSE, "text/event-stream"),
        (ANTHROPIC_JSON, "application/json"))}
    assert texts == {"hi there"}
    limited = read_answer(429, b'{"error": {"type": "rate_limit_error", "message": "slow down"}}')
    other = read_answer(429, b'{"type": "error", "error": {"type": "invalid_request_error", "message": "?"}}')
    assert (limited.status_class, limited.error_type) == ("4xx", "rate_limit_error")
    assert differences(limited, other, greedy=True) == ("error_type",)
    ok, sampled = Answer(200, "", "hi there"), Answer(200, "", "something else")
    assert differences(ok, sampled, greedy=True) == ("text",)
    assert differences(ok, sampled, greedy=False) == ()  # a sampled text may differ
    assert differences(ok, limited, greedy=True) == ("status",)  # the cause only
    assert differences(ok, sampled, greedy=True, ignore=("text",)) == ()
    assert Answer(0).layout_failure and Answer(503).layout_failure and not limited.layout_failure
    assert is_greedy({"temperature": 0}) and is_greedy({"top_k": 1}) and not is_greedy({"temperature": 0.7})
    assert not is_greedy({}) and read_answer(200, b"<html>").status_class == "2xx"


def test_a_key_list_becomes_auth_api_keys_by_digest(tmp_path: Path) -> None:
    keys = from_lines("sk-one team-a\n# a comment\nsk-two\n", "legacy")
    assert [(key.tenant, key.key_sha256) for key in keys] == [
        ("team-a", hashlib.sha256(b"sk-one").hexdigest()), ("legacy", hashlib.sha256(b"sk-two").hexdigest())]
    with pytest.raises(Exception, match="line 2: the same key as line 1"):
        from_lines("sk-one\nsk-one\n", "legacy")
    rows = {"keys": [{"token": hashlib.sha256(b"sk-bot").hexdigest(), "key_alias": "ci bot", "rpm_limit": 120,
                      "tpm_limit": 6000, "max_parallel_requests": 4},
                     {"token": hashlib.sha256(b"sk-team").hexdigest(), "team_id": "research", "rpm_limit": 5}]}
    litellm = from_litellm(json.dumps(rows), tenant_by="key")
    assert [key.tenant for key in litellm] == ["key-ci-bot", "key-litellm-" + litellm[1].key_sha256[:12]]
    assert litellm[0].limits == {"requests_per_second": 2.0, "burst": 120.0, "tokens_per_minute": 6000.0,
                                 "token_burst": 6000.0, "max_concurrent_requests": 4}
    assert [key.tenant for key in from_litellm(json.dumps(rows))] == ["key-ci-bot", "research"]
    assert from_litellm(json.dumps(rows))[1].limits == {}  # a team's tenant: per-key limits not merged
    fragment = tmp_path / "keys.yaml"
    import yaml

    fragment.write_text(yaml.safe_dump(config_fragment(litellm, ["generate"])))
    config = load_config(fragment)  # a valid config fragment
    assert {entry.key_sha256 for entry in config.auth.api_keys} == {key.key_sha256 for key in litellm}
    with pytest.raises(Exception, match=r"keys\[0\]: no `token`"):
        from_litellm('{"keys": ["sk-...abc"]}')


def test_litellm_runs_on_its_bundled_documents() -> None:
    """The documented switch for its price map, and the same for every other document it would fetch."""
    assert OFFLINE_ENV["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    import importlib.util

    spec = importlib.util.find_spec("litellm")  # found, not imported (seconds)
    assert spec is not None and spec.submodule_search_locations
    package = Path(next(iter(spec.submodule_search_locations)))
    for name, module in (("LITELLM_LOCAL_MODEL_COST_MAP", "litellm_core_utils/get_model_cost_map.py"),
                         ("LITELLM_LOCAL_BLOG_POSTS", "litellm_core_utils/get_blog_posts.py"),
                         ("LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS", "anthropic_beta_headers_manager.py")):
        assert name in OFFLINE_ENV and name in (package / module).read_text()  # still the switch LiteLLM reads


def test_the_runner_names_what_a_legacy_http_target_lacks() -> None:
    from migration.runner import build_target, parse_args
    from services.common import ConfigError

    base = ["--db", "x.sqlite", "--listen", "unix:/tmp/x.sock", "--target", "legacy-http"]
    with pytest.raises(ConfigError, match="needs --legacy-http, --spine-http, --front-listen"):
        build_target(parse_args(base))
    with pytest.raises(ConfigError, match="without /v1"):
        build_target(parse_args([*base, "--legacy-http", "http://127.0.0.1:4000/v1", "--spine-http",
                                 "http://127.0.0.1:8000", "--front-listen", "127.0.0.1:0"]))
    with pytest.raises(ConfigError, match="--shadow-share: must be between 0 and 1"):
        build_target(parse_args([*base, "--legacy-http", "http://127.0.0.1:4000", "--spine-http",
                                 "http://127.0.0.1:8000", "--front-listen", "127.0.0.1:0", "--shadow-share", "2"]))
    with pytest.raises(ConfigError, match="--front-listen"):
        build_target(parse_args([*base, "--legacy-http", "http://127.0.0.1:4000", "--spine-http",
                                 "http://127.0.0.1:8000", "--front-listen", "10.1.2.3:4400"]))
