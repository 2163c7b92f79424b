"""Reading a migration plan: ordered stages of traffic weight, placements, hold and gates.

The plan is data (`migration.plan_spec`: `Plan`, `Stage`, `GateSpec`); this reads it from
YAML. Validation is strict and reports every problem at once, each with its field path and
YAML line, because a plan that means something other than what its author thought is how a
migration goes wrong. The checks of a plan against the data path it is to run on (a parity
gate needs shadow traffic, a plan's legacy side must be the one served) are here too.
The records are importable from here as well: `migration.plan` is where a plan comes from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from migration.judge_spec import JudgeSpec, read_judge, stage_judge
from migration.legacy_endpoint import DEFAULT_API_KEY_HEADER, LegacyEndpoint, legacy_problems, name_problem
from migration.plan_spec import (
    DEFAULT_MIN_DELTA_MS,
    DEFAULT_MIN_WINDOW_REQUESTS,
    DEFAULT_ROUTE_HEADER,
    DEFAULT_WINDOW_S,
    GATE_OPTIONS,
    GATE_THRESHOLDS,
    PLACEMENTS,
    GateSpec,
    Plan,
    PlanError,
    Stage,
)
from runtime.config.yamlsource import LocatedData, YamlSourceError, load_located
from services.registry import MIDDLEWARES

__all__ = ["DEFAULT_MIN_DELTA_MS", "DEFAULT_MIN_WINDOW_REQUESTS", "DEFAULT_ROUTE_HEADER", "DEFAULT_WINDOW_S",
           "GATE_OPTIONS", "GATE_THRESHOLDS", "MIDDLEWARES", "PLACEMENTS", "GateSpec", "Plan", "PlanError", "Stage",
           "load_plan", "refuse_other_legacy", "refuse_parity_without_shadow"]

# The keys each level of a plan may hold: any other is refused, named.
_PLAN_KEYS = {"name", "description", "window_s", "min_window_requests", "route_header", "legacy", "stages", "judge"}
_LEGACY_KEYS = {"http", "api_key_header", "name"}
_STAGE_KEYS = {
    "name", "spine_weight", "placements", "hold_s", "min_requests",
    "gates", "failure_limit", "manual_approval", "judge",
}


def refuse_parity_without_shadow(plan: Plan, why: str) -> None:
    """PlanError naming every parity gate of `plan` (field and line), when shadow is off.

    A parity gate reads shadow comparisons; with nothing mirrored it could never fail, so
    a plan that has one is refused where the data path has no shadow traffic (`why`: what
    the data path said). Checked by the controller against its target (`Controller.check_plan`);
    `spine migrate plan --offline` has no target and cannot tell."""
    paths = plan.parity_gates()
    if not paths:
        return
    located = load_located(plan.source)
    raise PlanError([f"a parity gate compares shadow traffic, and none is configured for this data path: {why}; "
                     f"turn shadow on, or remove the parity gates:",
                     *(f"{path} (line {located.line(path)}): parity gate with no shadow comparisons to read"
                       for path in paths)])


def refuse_other_legacy(plan: Plan, served: LegacyEndpoint | None) -> None:
    """PlanError when `plan`'s from side is not the one the data path splits traffic with
    (`served`: its foreign legacy endpoint, None for spine's layered stack)."""
    if plan.legacy == served:
        return
    line = load_located(plan.source).line("legacy")
    if served is None:
        problem = (f"legacy (line {line}): this plan migrates from the HTTP endpoint "
                   f"{plan.legacy.describe() if plan.legacy else ''}, but this controller's data path migrates from "
                   f"spine's layered stack; run a controller whose front splits traffic with that endpoint "
                   f"(python -m migration.runner --target legacy-http --legacy-http URL ...), or remove legacy:")
    elif plan.legacy is None:
        problem = (f"plan (line 1): this controller's data path migrates from the HTTP endpoint "
                   f"{served.describe()}; a plan for it says so: legacy: {{http: {served.http}, "
                   f"api_key_header: {served.api_key_header}}}")
    else:
        problem = (f"legacy (line {line}): this plan migrates from {plan.legacy.describe()}, but this "
                   f"controller's front splits traffic with {served.describe()}")
    raise PlanError([problem])


def load_plan(text: str, middlewares: Sequence[str] = MIDDLEWARES) -> Plan:
    """Parse and validate a plan; raise PlanError listing every problem with its line.

    `middlewares`: what a stage may place (the component table's middlewares)."""
    try:
        located = load_located(text)
    except YamlSourceError as exc:
        raise PlanError([f"{exc.path or 'plan'} (line {exc.line}): {exc}"]) from None
    checker = _Checker(located, tuple(middlewares))
    plan = checker.plan(text)
    if checker.problems or plan is None:
        raise PlanError(checker.problems)
    return plan


class _Checker:
    """Walks the located data, collecting problems instead of stopping at the first."""

    def __init__(self, located: LocatedData, middlewares: tuple[str, ...]) -> None:
        self.located = located
        self.middlewares = middlewares
        self.problems: list[str] = []

    def fail(self, path: str, message: str) -> None:
        self.problems.append(f"{path or 'plan'} (line {self.located.line(path)}): {message}")

    def plan(self, text: str) -> Plan | None:
        data = self.located.data
        if not isinstance(data, Mapping):
            self.fail("", f"a plan is a mapping with name and stages, got {_kind(data)}")
            return None
        self.unknown_keys(data, "", _PLAN_KEYS)
        name = self.text(data, "name", "")
        description = self.text(data, "description", "", required=False)
        window_s = self.number(data, "window_s", "", DEFAULT_WINDOW_S, minimum=0.0, exclusive=True)
        min_window = self.integer(data, "min_window_requests", "", DEFAULT_MIN_WINDOW_REQUESTS, minimum=0)
        route_header = self.flag(data, "route_header", "", DEFAULT_ROUTE_HEADER)
        legacy = self.legacy(data.get("legacy"), "legacy") if "legacy" in data else None
        judge = read_judge(self, data["judge"], "judge") if "judge" in data else None
        raw_stages = data.get("stages")
        stages: list[Stage] = []
        if not isinstance(raw_stages, list) or not raw_stages:
            self.fail("stages", f"must be a non-empty list of stages, got {_kind(raw_stages)}")
        else:
            previous = dict.fromkeys(self.middlewares, "remote")
            seen: dict[str, int] = {}
            for index, raw in enumerate(raw_stages):
                stage = self.stage(raw, f"stages[{index}]", index, previous, judge)
                if "legacy" in data and isinstance(raw, Mapping) and "placements" in raw:
                    self.fail(f"stages[{index}].placements", "a foreign legacy side has no middlewares to move "
                              "into the spine (the spine serves whole, collapsed): remove placements")
                if stage is None:
                    continue
                if stage.name in seen:
                    self.fail(f"stages[{index}].name", f"duplicate stage name {stage.name!r} "
                              f"(also stages[{seen[stage.name]}])")
                seen[stage.name] = index
                previous = stage.placements
                stages.append(stage)
        if self.problems:
            return None
        return Plan(name, tuple(stages), window_s, min_window, text, description, route_header, legacy)

    def legacy(self, raw: Any, path: str) -> LegacyEndpoint | None:
        if not isinstance(raw, Mapping):
            self.fail(path, f"expected a mapping {{http: URL, api_key_header: HEADER}}, got {_kind(raw)}")
            return None
        self.unknown_keys(raw, path, _LEGACY_KEYS)
        if "http" not in raw:
            self.fail(path, "missing required field 'http' (the endpoint's URL, e.g. http://127.0.0.1:4000)")
            return None
        header = raw.get("api_key_header", DEFAULT_API_KEY_HEADER)
        problems = legacy_problems(raw["http"], header)
        name = raw.get("name", "")
        if "name" in raw and (wrong := name_problem(name)):
            problems.append(("name", wrong))
        for field, problem in problems:
            self.fail(f"{path}.{field}", problem)
        return None if problems else LegacyEndpoint(str(raw["http"]).rstrip("/"), str(header), str(name))

    def stage(self, raw: Any, path: str, index: int, previous: dict[str, str],
              plan_judge: JudgeSpec | None = None) -> Stage | None:
        if not isinstance(raw, Mapping):
            self.fail(path, f"a stage is a mapping, got {_kind(raw)}")
            return None
        before = len(self.problems)
        self.unknown_keys(raw, path, _STAGE_KEYS)
        name = self.text(raw, "name", path)
        weight = self.number(raw, "spine_weight", path, None, minimum=0.0, maximum=100.0)
        placements = self.placements(raw.get("placements"), f"{path}.placements", previous)
        hold_s = self.number(raw, "hold_s", path, None, minimum=0.0, required=False)
        min_requests = self.integer(raw, "min_requests", path, None, minimum=0, required=False)
        if "hold_s" not in raw and "min_requests" not in raw:
            self.fail(path, "needs hold_s and/or min_requests: how long the stage holds before advancing")
        gates = self.gates(raw.get("gates", []), f"{path}.gates")
        failure_limit = self.integer(raw, "failure_limit", path, 1, minimum=1)
        approval = self.flag(raw, "manual_approval", path)
        if approval and index == 0:
            self.fail(f"{path}.manual_approval", "the first stage is entered by `start`, which is "
                      "already an operator's decision; put manual_approval on a later stage")
        if weight == 0 and gates:
            self.fail(f"{path}.gates", "a stage with spine_weight 0 sends the spine no traffic, "
                      "so its gates could never conclude; remove them or raise spine_weight")
        comparative = [g.type for g in gates if g.type != "parity" and not g.dry_run]
        if weight == 100 and comparative:
            self.fail(f"{path}.gates", f"a stage with spine_weight 100 leaves no layered baseline, so "
                      f"{', '.join(comparative)} could never conclude; use parity or dry_run there")
        if weight == 0 and min_requests:
            self.fail(f"{path}.min_requests", "a stage with spine_weight 0 sends the spine no "
                      f"traffic, so min_requests={min_requests} could never be met")
        judge = stage_judge(self, raw, path, float(weight or 0.0), plan_judge)
        if len(self.problems) > before:
            return None
        return Stage(name, float(weight or 0.0), placements, hold_s, min_requests, gates,
                     failure_limit, approval, judge)

    def placements(self, raw: Any, path: str, previous: dict[str, str]) -> dict[str, str]:
        out = dict(previous)
        if raw is None:
            return out
        if not isinstance(raw, Mapping):
            self.fail(path, f"expected a mapping of middleware to local|remote, got {_kind(raw)}")
            return out
        for middleware, placement in raw.items():
            where = f"{path}.{middleware}"
            if middleware not in self.middlewares:
                self.fail(where, f"unknown middleware {middleware!r}; expected one of {', '.join(self.middlewares)}")
            elif placement not in PLACEMENTS:
                self.fail(where, f"must be local or remote, got {placement!r}")
            else:
                out[middleware] = placement
        return out

    def gates(self, raw: Any, path: str) -> tuple[GateSpec, ...]:
        if raw is None:
            return ()
        if not isinstance(raw, list):
            self.fail(path, f"expected a list of gates, got {_kind(raw)}")
            return ()
        specs = []
        for index, gate in enumerate(raw):
            where = f"{path}[{index}]"
            if not isinstance(gate, Mapping):
                self.fail(where, f"a gate is a mapping with a type, got {_kind(gate)}")
                continue
            kind = gate.get("type")
            if kind not in GATE_THRESHOLDS:
                self.fail(f"{where}.type" if "type" in gate else where,
                          f"unknown gate type {kind!r}; expected one of {', '.join(GATE_THRESHOLDS)}")
                continue
            field = GATE_THRESHOLDS[kind]
            self.unknown_keys(gate, where, {"type", "dry_run", field, *GATE_OPTIONS[kind]})
            if kind == "parity":
                threshold = self.integer(gate, field, where, None, minimum=0)
            elif kind == "error_rate":
                threshold = self.number(gate, field, where, None, minimum=0.0, maximum=1.0)
            else:
                threshold = self.number(gate, field, where, None, minimum=0.0, exclusive=True)
            min_requests = self.integer(gate, "min_requests", where, None, minimum=1, required=False)
            min_delta_ms = self.number(gate, "min_delta_ms", where, DEFAULT_MIN_DELTA_MS, minimum=0.0)
            specs.append(GateSpec(kind, float(threshold or 0), self.flag(gate, "dry_run", where),
                                  min_requests, float(min_delta_ms)))
        return tuple(specs)

    def unknown_keys(self, raw: Mapping[str, Any], path: str, allowed: set[str]) -> None:
        for key in raw:
            if key not in allowed:
                where = f"{path}.{key}" if path else key
                self.fail(where, f"unknown field; expected one of {', '.join(sorted(allowed))}")

    def text(self, raw: Mapping[str, Any], key: str, path: str, default: str = "",
             required: bool = True) -> str:
        where = f"{path}.{key}" if path else key
        if key not in raw:
            if required:
                self.fail(path, f"missing required field {key!r}")
            return default
        value = raw[key]
        if not isinstance(value, str) or not value.strip():
            self.fail(where, f"must be a non-empty string, got {value!r}")
            return default
        return value

    def _field(self, raw: Mapping[str, Any], key: str, path: str, default: Any,
               required: bool | None) -> tuple[bool, Any, str]:
        """(present, its value or the default, where it is): a missing field fails when it is
        required, or when it is not said and has no default."""
        where = f"{path}.{key}" if path else key
        if key not in raw:
            if required or (required is None and default is None):
                self.fail(path, f"missing required field {key!r}")
            return False, default, where
        return True, raw[key], where

    def number(self, raw: Mapping[str, Any], key: str, path: str, default: float | None, *,
               minimum: float, maximum: float | None = None, exclusive: bool = False,
               required: bool | None = None) -> Any:
        present, value, where = self._field(raw, key, path, default, required)
        if not present:
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(where, f"must be a number, got {value!r}")
            return default
        if maximum is not None and not minimum <= value <= maximum:
            self.fail(where, f"must be between {minimum:g} and {maximum:g}, got {value!r}")
        elif exclusive and value <= minimum:
            self.fail(where, f"must be greater than {minimum:g}, got {value!r}")
        elif value < minimum:
            self.fail(where, f"must be at least {minimum:g}, got {value!r}")
        return float(value)

    def integer(self, raw: Mapping[str, Any], key: str, path: str, default: int | None, *,
                minimum: int, required: bool | None = None) -> Any:
        present, value, where = self._field(raw, key, path, default, required)
        if not present:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(where, f"must be a whole number, got {value!r}")
            return default
        if value < minimum:
            self.fail(where, f"must be at least {minimum}, got {value!r}")
        return value

    def flag(self, raw: Mapping[str, Any], key: str, path: str, default: bool = False) -> bool:
        value = raw.get(key, default)
        if not isinstance(value, bool):
            self.fail(f"{path}.{key}" if path else key, f"must be true or false, got {value!r}")
            return default
        return value


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"
