"""A plan's `judge:` section: the metrics, their groups and weights, the confidence, the thresholds.

It is read by the plan's own checker (`migration.plan`), so a problem is reported with its
field path and YAML line like every other plan problem. A stage's `judge:` overrides the
plan's field by field (the groups as a whole), so a plan states its statistics once and a
stage changes only what differs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

# Each metric kind and the fields it takes beside name, kind, critical.
METRIC_OPTIONS: dict[str, tuple[str, ...]] = {
    "latency": ("direction", "min_shift_ms"),
    "error_rate": ("max_delta",),
    "parity": ("max_mismatches",),
}
DIRECTIONS = ("increase", "decrease", "either")
OUTLIER_METHODS = ("iqr", "none")
DEFAULT_CONFIDENCE = 0.98
DEFAULT_EFFECT_SIZE = 0.25
DEFAULT_MIN_SAMPLES = 50
DEFAULT_IQR_FACTOR = 3.0
DEFAULT_PASS = 90.0
DEFAULT_MARGINAL = 75.0
_JUDGE_KEYS = {"confidence", "effect_size", "min_samples", "outliers", "thresholds", "groups", "dry_run"}


class Checker(Protocol):
    """What the plan's checker offers: the problems so far, a problem with its line, typed fields."""

    problems: list[str]

    def fail(self, path: str, message: str) -> None: ...

    def unknown_keys(self, raw: Mapping[str, Any], path: str, allowed: set[str]) -> None: ...

    def text(self, raw: Mapping[str, Any], key: str, path: str, default: str = "",
             required: bool = True) -> str: ...

    def number(self, raw: Mapping[str, Any], key: str, path: str, default: float | None, *,
               minimum: float, maximum: float | None = None, exclusive: bool = False,
               required: bool | None = None) -> Any: ...

    def integer(self, raw: Mapping[str, Any], key: str, path: str, default: int | None, *,
                minimum: int, required: bool | None = None) -> Any: ...

    def flag(self, raw: Mapping[str, Any], key: str, path: str, default: bool = False) -> bool: ...


@dataclass(frozen=True)
class MetricSpec:
    """One judged metric. `direction`: which shift of the spine's latency counts against it
    (a faster spine is no regression); `min_shift_ms`: a shift smaller than this is never
    flagged, however sure; `max_delta`: the error-rate difference tolerated;
    `max_mismatches`: the parity gate's limit, as today."""

    name: str
    kind: str
    critical: bool = False
    direction: str = "increase"
    min_shift_ms: float = 0.0
    max_delta: float = 0.0
    max_mismatches: int = 0
    path: str = ""  # where the plan declares it (for a refusal naming its line)


@dataclass(frozen=True)
class GroupSpec:
    name: str
    weight: float
    metrics: tuple[MetricSpec, ...]


DEFAULT_GROUPS = (
    GroupSpec("latency", 50.0, (MetricSpec("latency", "latency"),)),
    GroupSpec("errors", 50.0, (MetricSpec("error_rate", "error_rate", critical=True),)),
)


@dataclass(frozen=True)
class JudgeSpec:
    """How a stage's windows are judged (module doc). `effect_size`: the margin, a share of the
    Hodges–Lehmann shift, that the confidence interval must clear before a metric is High or
    Low; `min_samples`: per side, below it a metric cannot tell; `outliers`: `iqr` drops
    values beyond `iqr_factor` interquartile ranges from the quartiles, per side, before
    the test; `pass_score`/`marginal_score`: advance at or above the first, hold at or above
    the second, roll back below it."""

    confidence: float = DEFAULT_CONFIDENCE
    effect_size: float = DEFAULT_EFFECT_SIZE
    min_samples: int = DEFAULT_MIN_SAMPLES
    outliers: str = "iqr"
    iqr_factor: float = DEFAULT_IQR_FACTOR
    pass_score: float = DEFAULT_PASS
    marginal_score: float = DEFAULT_MARGINAL
    groups: tuple[GroupSpec, ...] = DEFAULT_GROUPS
    dry_run: bool = False
    path: str = "judge"

    def metrics(self) -> list[MetricSpec]:
        return [metric for group in self.groups for metric in group.metrics]

    def parity_paths(self) -> list[str]:
        return [metric.path or self.path for metric in self.metrics() if metric.kind == "parity"]

    def describe(self) -> str:
        metrics = ", ".join(f"{m.name}{' (critical)' if m.critical else ''}" for m in self.metrics())
        text = (f"judge at {self.confidence:.0%} confidence, pass {self.pass_score:g} / marginal "
                f"{self.marginal_score:g}: {metrics}")
        return text + " (dry run)" if self.dry_run else text


def read_judge(check: Checker, raw: Any, path: str, base: JudgeSpec | None = None) -> JudgeSpec | None:
    """The `judge:` mapping at `path`, each absent field taken from `base` (the plan's judge for
    a stage's) or the defaults; None after reporting its problems to `check`."""
    base = base or JudgeSpec()
    if not isinstance(raw, Mapping):
        check.fail(path, f"expected a mapping (confidence, effect_size, min_samples, outliers, thresholds, "
                         f"groups, dry_run), got {type(raw).__name__} {raw!r}")
        return None
    problems = _count(check)
    check.unknown_keys(raw, path, _JUDGE_KEYS)
    confidence = check.number(raw, "confidence", path, base.confidence, minimum=0.5, maximum=0.9999)
    effect = check.number(raw, "effect_size", path, base.effect_size, minimum=0.0)
    min_samples = check.integer(raw, "min_samples", path, base.min_samples, minimum=3)
    outliers, factor = _outliers(check, raw.get("outliers"), f"{path}.outliers", base) \
        if "outliers" in raw else (base.outliers, base.iqr_factor)
    pass_score, marginal = base.pass_score, base.marginal_score
    if "thresholds" in raw:
        pass_score, marginal = _thresholds(check, raw["thresholds"], f"{path}.thresholds", base)
    groups = _groups(check, raw["groups"], f"{path}.groups") if "groups" in raw else base.groups
    dry_run = check.flag(raw, "dry_run", path, base.dry_run)
    if _count(check) > problems:
        return None
    return replace(base, confidence=float(confidence), effect_size=float(effect), min_samples=int(min_samples),
                   outliers=outliers, iqr_factor=factor, pass_score=pass_score, marginal_score=marginal,
                   groups=groups, dry_run=dry_run, path=path)


def stage_judge(check: Checker, raw: Mapping[str, Any], path: str, weight: float,
                plan_judge: JudgeSpec | None) -> JudgeSpec | None:
    """A stage's judge: its own `judge:` over the plan's, `judge: false` for none; the plan's
    applies only where both sides get traffic (a judge compares them)."""
    if "judge" not in raw:
        return plan_judge if 0 < weight < 100 else None
    if raw["judge"] is False:
        return None
    judge = read_judge(check, raw["judge"], f"{path}.judge", plan_judge)
    if judge is not None and not 0 < weight < 100:
        check.fail(f"{path}.judge", f"a judge compares the spine with the layered side, and spine_weight "
                                    f"{weight:g} leaves one of them no traffic; remove it or use judge: false")
    return judge


def _count(check: Checker) -> int:
    return len(check.problems)


def _outliers(check: Checker, raw: Any, path: str, base: JudgeSpec) -> tuple[str, float]:
    if raw in OUTLIER_METHODS:
        return str(raw), base.iqr_factor
    if not isinstance(raw, Mapping):
        check.fail(path, f"expected iqr, none or {{method: iqr, factor: N}}, got {raw!r}")
        return base.outliers, base.iqr_factor
    check.unknown_keys(raw, path, {"method", "factor"})
    method = raw.get("method", "iqr")
    if method not in OUTLIER_METHODS:
        check.fail(f"{path}.method", f"expected one of {', '.join(OUTLIER_METHODS)}, got {method!r}")
    factor = check.number(raw, "factor", path, base.iqr_factor, minimum=0.0, exclusive=True)
    return str(method), float(factor)


def _thresholds(check: Checker, raw: Any, path: str, base: JudgeSpec) -> tuple[float, float]:
    if not isinstance(raw, Mapping):
        check.fail(path, f"expected {{pass: 90, marginal: 75}}, got {raw!r}")
        return base.pass_score, base.marginal_score
    check.unknown_keys(raw, path, {"pass", "marginal"})
    pass_score = float(check.number(raw, "pass", path, base.pass_score, minimum=0.0, maximum=100.0))
    marginal = float(check.number(raw, "marginal", path, base.marginal_score, minimum=0.0, maximum=100.0))
    if marginal > pass_score:
        check.fail(f"{path}.marginal", f"must not exceed pass ({pass_score:g}), got {marginal:g}")
    return pass_score, marginal


def _groups(check: Checker, raw: Any, path: str) -> tuple[GroupSpec, ...]:
    if not isinstance(raw, list) or not raw:
        check.fail(path, "expected a non-empty list of groups, each {name, weight, metrics}")
        return ()
    groups: list[GroupSpec] = []
    names: set[str] = set()
    for index, item in enumerate(raw):
        where = f"{path}[{index}]"
        if not isinstance(item, Mapping):
            check.fail(where, f"a group is a mapping {{name, weight, metrics}}, got {item!r}")
            continue
        check.unknown_keys(item, where, {"name", "weight", "metrics"})
        name = check.text(item, "name", where)
        if any(group.name == name for group in groups):
            check.fail(f"{where}.name", f"duplicate group name {name!r}: name each group once in a judge")
        weight = float(check.number(item, "weight", where, 1.0, minimum=0.0, exclusive=True))
        metrics = item.get("metrics")
        if not isinstance(metrics, list) or not metrics:
            check.fail(f"{where}.metrics", "expected a non-empty list of metrics, each {name, kind, ...}")
            continue
        specs = tuple(spec for j, metric in enumerate(metrics)
                      if (spec := _metric(check, metric, f"{where}.metrics[{j}]", names)) is not None)
        groups.append(GroupSpec(name, weight, specs))
    return tuple(groups)


def _metric(check: Checker, raw: Any, path: str, names: set[str]) -> MetricSpec | None:
    if not isinstance(raw, Mapping):
        check.fail(path, f"a metric is a mapping {{name, kind, critical, ...}}, got {raw!r}")
        return None
    kind = raw.get("kind")
    if kind not in METRIC_OPTIONS:
        check.fail(f"{path}.kind" if "kind" in raw else path,
                   f"unknown metric kind {kind!r}; expected one of {', '.join(METRIC_OPTIONS)}")
        return None
    check.unknown_keys(raw, path, {"name", "kind", "critical", *METRIC_OPTIONS[kind]})
    name = check.text(raw, "name", path, str(kind), required=False)
    if name in names:
        check.fail(f"{path}.name", f"duplicate metric name {name!r}: name each metric once in a judge")
    names.add(name)
    direction = raw.get("direction", "increase")
    if direction not in DIRECTIONS:
        check.fail(f"{path}.direction", f"expected one of {', '.join(DIRECTIONS)}, got {direction!r}")
    return MetricSpec(
        name, str(kind), check.flag(raw, "critical", path), str(direction),
        min_shift_ms=float(check.number(raw, "min_shift_ms", path, 0.0, minimum=0.0)),
        max_delta=float(check.number(raw, "max_delta", path, 0.0, minimum=0.0, maximum=1.0)),
        max_mismatches=int(check.integer(raw, "max_mismatches", path, 0, minimum=0)),
        path=path)
