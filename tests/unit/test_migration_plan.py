"""Plan validation: every error names the field path and the YAML line."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from migration.plan import DEFAULT_MIN_DELTA_MS, MIDDLEWARES, PlanError, load_plan

PLANS = Path(__file__).resolve().parents[2] / "deploy" / "plans"

VALID = textwrap.dedent("""\
    name: p
    window_s: 2
    min_window_requests: 10
    stages:
      - name: first
        spine_weight: 5
        placements: {logs: local}
        hold_s: 30
        gates:
          - {type: error_rate, max_delta: 0.01}
          - {type: latency_p99_ratio, max_ratio: 1.2, dry_run: true}
      - name: second
        spine_weight: 50
        placements:
          cache: local
        min_requests: 1000
        failure_limit: 3
        manual_approval: true
        gates:
          - {type: parity, max_mismatches: 0}
    """)


def problems(text: str) -> list[str]:
    with pytest.raises(PlanError) as caught:
        load_plan(text)
    return caught.value.problems


def test_a_valid_plan_loads_with_defaults_and_inherited_placements():
    plan = load_plan(VALID)
    first, second = plan.stages
    assert first.placements == {**dict.fromkeys(MIDDLEWARES, "remote"), "logs": "local"}
    assert second.placements == {**first.placements, "cache": "local"}
    assert first.failure_limit == 1 and second.failure_limit == 3
    assert first.gates[1].dry_run and not first.gates[0].dry_run
    assert second.manual_approval and second.hold_s is None and second.min_requests == 1000
    assert plan.source == VALID


def test_a_latency_gate_has_a_floor_and_may_ask_for_more_requests_than_the_plan():
    default = load_plan(VALID).stages[0].gates[1]
    assert (default.min_delta_ms, default.min_requests) == (DEFAULT_MIN_DELTA_MS, None) == (5.0, None)
    text = VALID.replace("max_ratio: 1.2", "max_ratio: 1.2, min_delta_ms: 20, min_requests: 200")
    gate = load_plan(text).stages[0].gates[1]
    assert (gate.min_delta_ms, gate.min_requests) == (20.0, 200)
    assert gate.describe() == "latency_p99_ratio max_ratio=1.2 min_delta_ms=20 min_requests=200 (dry run)"


@pytest.mark.parametrize("name", ["demo.yaml", "production.yaml", "rehearsal.yaml"])
def test_the_shipped_plans_are_valid(name):
    plan = load_plan((PLANS / name).read_text())
    assert plan.stages[-1].spine_weight == 100
    assert all(v == "local" for v in plan.stages[-1].placements.values())


def test_the_production_plan_collapses_observability_first_and_auth_last_with_approval_before_100():
    plan = load_plan((PLANS / "production.yaml").read_text())
    assert [s.spine_weight for s in plan.stages] == [1, 5, 25, 50, 100]
    first_local = {s.name: [m for m, p in s.placements.items() if p == "local"] for s in plan.stages}
    assert sorted(first_local["canary-observability"]) == ["logs", "metrics"]
    assert plan.stages[-1].manual_approval
    assert all(s.hold_s and s.hold_s >= 60 for s in plan.stages)
    # The judge on trial in every stage with a baseline, none at 100 %.
    assert all(s.judge is not None and s.judge.dry_run for s in plan.stages[:-1]) and plan.stages[-1].judge is None


def test_route_header_is_on_unless_the_plan_turns_it_off():
    assert load_plan(VALID).route_header is True
    assert load_plan(VALID.replace("window_s: 2\n", "window_s: 2\nroute_header: true\n")).route_header is True
    assert load_plan(VALID.replace("window_s: 2\n", "window_s: 2\nroute_header: false\n")).route_header is False


@pytest.mark.parametrize("value", ["maybe", "1", "'false'", "[spine]"])
def test_a_route_header_that_is_not_true_or_false_names_its_line(value):
    [problem] = problems(VALID.replace("window_s: 2\n", f"window_s: 2\nroute_header: {value}\n"))
    assert problem.startswith("route_header (line 3): must be true or false, got "), problem


def test_production_does_not_let_clients_force_a_side():
    assert load_plan((PLANS / "production.yaml").read_text()).route_header is False
    assert load_plan((PLANS / "demo.yaml").read_text()).route_header is True  # the local operator's tool


def test_an_out_of_range_weight_names_field_line_and_value():
    text = VALID.replace("spine_weight: 50", "spine_weight: 150")
    assert problems(text) == ["stages[1].spine_weight (line 13): must be between 0 and 100, got 150"]


@pytest.mark.parametrize("old, new, expected", [
    ("    hold_s: 30\n", "    hold_s: 30\n    colour: red\n", "stages[0].colour (line 9): unknown field"),
    ("{logs: local}", "{logz: local}", "stages[0].placements.logz (line 7): unknown middleware 'logz'"),
    ("{logs: local}", "{logs: nearby}", "stages[0].placements.logs (line 7): must be local or remote"),
    ("type: parity", "type: vibes", "stages[1].gates[0].type (line 20): unknown gate type 'vibes'"),
    ("max_delta: 0.01", "max_delta: lots", "stages[0].gates[0].max_delta (line 10): must be a number"),
    ("max_mismatches: 0", "max_mismatches: 0, max_delta: 1", "stages[1].gates[0].max_delta (line 20): unknown field"),
    ("max_delta: 0.01", "max_delta: 0.01, min_delta_ms: 5", "stages[0].gates[0].min_delta_ms (line 10): unknown field"),
    ("max_ratio: 1.2", "max_ratio: 1.2, min_delta_ms: -1", "stages[0].gates[1].min_delta_ms (line 11): must be at least 0"),
    ("max_ratio: 1.2", "max_ratio: 1.2, min_requests: 0", "stages[0].gates[1].min_requests (line 11): must be at least 1"),
    ("failure_limit: 3", "failure_limit: 0", "stages[1].failure_limit (line 17): must be at least 1"),
    ("manual_approval: true", "manual_approval: yes please", "stages[1].manual_approval (line 18): must be true"),
    ("window_s: 2", "window_s: 0", "window_s (line 2): must be greater than 0"),
    ("name: second", "name: first", "stages[1].name (line 12): duplicate stage name 'first'"),
    ("    hold_s: 30\n", "", "stages[0] (line 5): needs hold_s and/or min_requests"),
    ("name: p\n", "", "plan (line 1): missing required field 'name'"),
])
def test_each_kind_of_mistake_is_reported_with_its_path_and_line(old, new, expected):
    assert old in VALID
    [problem] = problems(VALID.replace(old, new, 1))
    assert problem.startswith(expected), problem


def test_every_problem_is_reported_at_once():
    text = VALID.replace("spine_weight: 5\n", "spine_weight: -1\n").replace("{logs: local}", "{dns: local}")
    assert [p.split(":")[0] for p in problems(text)] == [
        "stages[0].spine_weight (line 6)", "stages[0].placements.dns (line 7)"]


def test_a_duplicate_key_is_an_error_not_a_silent_override():
    [problem] = problems(VALID.replace("    hold_s: 30\n", "    hold_s: 30\n    hold_s: 60\n"))
    assert problem == "stages[0].hold_s (line 9): duplicate key"


def test_broken_yaml_names_the_line():
    [problem] = problems("name: p\nstages:\n  - name: [unclosed\n")
    assert problem.startswith("plan (line 4): not valid YAML")


def test_manual_approval_on_the_first_stage_is_refused():
    text = VALID.replace("    hold_s: 30\n", "    hold_s: 30\n    manual_approval: true\n")
    [problem] = problems(text)
    assert problem.startswith("stages[0].manual_approval (line 9)")


def test_gates_that_could_never_conclude_are_refused():
    at_zero = VALID.replace("spine_weight: 5\n", "spine_weight: 0\n")
    assert problems(at_zero)[0].startswith("stages[0].gates (line 9): a stage with spine_weight 0")
    at_full = VALID.replace("spine_weight: 5\n", "spine_weight: 100\n")
    assert "no layered baseline" in problems(at_full)[0]


def test_a_plan_that_is_not_a_mapping_is_refused():
    assert problems("- just\n- a list\n") == [
        "plan (line 1): a plan is a mapping with name and stages, got a list"]
