"""Analysis gates: pure arithmetic on one window of layered vs spine traffic.

Each gate compares the spine with the layered baseline measured over the SAME window, so a
bad minute for everyone does not roll the migration back. Too little traffic on either side,
or a side the metrics source could not read, says nothing, so it is `inconclusive` (the
stage holds) rather than a pass or a fail: no data is never a pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from migration.plan import DEFAULT_MIN_DELTA_MS, GateSpec


class Verdict(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class WindowStats:
    """One side's traffic in one window, as the gates compare it.

    `requests` and `errors` count every request (shadow traffic left out; `errors` are the
    ones the layout failed). The latency is over successful requests only, `ok_requests` of
    them: a side answering refusals in a tenth of a millisecond is not comparable with one
    doing real work. `missing` says why a source could not read this side at all (its
    Prometheus query failed, no endpoint answered); every gate that needs the side then holds.
    """

    requests: int
    errors: int
    p99_ms: float | None  # p99 latency of the successful requests; None or 0: none measured
    ok_requests: int | None = None  # None: not counted apart, taken as requests - errors
    missing: str = ""
    p50_ms: float | None = None  # median of the same requests, where the source has it (the dashboard shows it)
    # Each successful request's latency (ms), where the source has them: what the judge
    # compares (`migration.judge`); the threshold gates read only the numbers above.
    latency_samples_ms: tuple[float, ...] = field(default=(), repr=False, compare=False)

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def successes(self) -> int:
        return self.ok_requests if self.ok_requests is not None else self.requests - self.errors


@dataclass(frozen=True)
class ParityStats:
    """Shadow comparisons in one window, as the parity gate reads them (`migration.metrics`).

    `compared`: pairs of answers compared across layouts (calibration pairs, a layout
    compared with itself, left out). `mismatches`: field mismatches among them that noise
    does not explain — one count per field that differed as a cause (a rate-limited side's
    status and tokens are consequences), in every field on which the baseline (layered) did
    not disagree with itself lately (`noisy_fields`). `missing` says why the source could not
    read them; the gate then holds.
    """

    compared: int
    mismatches: int
    by_field: Mapping[str, int] = field(default_factory=dict)  # every cross-layout field mismatch, noisy or not
    noisy_fields: tuple[str, ...] = ()
    missing: str = ""


@dataclass(frozen=True)
class GateResult:
    gate: str
    verdict: Verdict
    value: float | None  # the measured quantity; None when there was nothing to measure
    threshold: float
    dry_run: bool
    message: str
    # False for a row recorded only to be read (the judge's per-metric rows): the judge's
    # own row decides for them, so it never counts twice.
    counts: bool = True


def _missing(layered: WindowStats, spine: WindowStats, baseline: str = "layered") -> str | None:
    gaps = [f"{side}: {stats.missing}" for side, stats in ((baseline, layered), ("spine", spine)) if stats.missing]
    return "no data to judge: " + "; ".join(gaps) if gaps else None


def _too_few(layered: WindowStats, spine: WindowStats, min_requests: int, baseline: str = "layered") -> str | None:
    """Why a side's request count says nothing; a side with none never passes, whatever `min_requests` says."""
    need = max(min_requests, 1)
    if layered.requests < need or spine.requests < need:
        return (f"too few requests to judge: {baseline} {layered.requests}, spine {spine.requests}, "
                f"need {need} on each side")
    return None


def error_rate_gate(layered: WindowStats, spine: WindowStats, max_delta: float, min_requests: int,
                    dry_run: bool = False, baseline: str = "layered") -> GateResult:
    """Pass while spine_rate <= layered_rate + max_delta; the value is the delta.

    A baseline failing more than max_delta itself is no baseline: the gate is then inconclusive
    (the stage holds, never a pass), unless the spine fails even more (a fail)."""
    few = _missing(layered, spine, baseline) or _too_few(layered, spine, min_requests, baseline)
    if few:
        return GateResult("error_rate", Verdict.INCONCLUSIVE, None, max_delta, dry_run, few)
    delta = spine.error_rate - layered.error_rate
    ok = spine.error_rate <= layered.error_rate + max_delta
    message = (f"spine error rate {spine.error_rate:.4f} vs {baseline} {layered.error_rate:.4f}: "
               f"delta {delta:+.4f} {'<=' if ok else '>'} max_delta {max_delta:g}")
    if ok and layered.error_rate > max_delta:
        # The baseline is failing itself (a legacy endpoint going down, say): its failures are
        # its own, counted on its side. They never excuse the spine's, and a window in which
        # the baseline is broken is no evidence for the spine either: the stage holds.
        return GateResult("error_rate", Verdict.INCONCLUSIVE, delta, max_delta, dry_run,
                          f"{message}, but the {baseline} side itself failed {layered.error_rate:.4f} > max_delta "
                          f"{max_delta:g}: its failures are its own and never a reason to pass the spine; "
                          f"holding until it recovers")
    return GateResult("error_rate", Verdict.PASS if ok else Verdict.FAIL, delta, max_delta, dry_run, message)


def latency_p99_ratio_gate(layered: WindowStats, spine: WindowStats, max_ratio: float, min_requests: int,
                           dry_run: bool = False, min_delta_ms: float = DEFAULT_MIN_DELTA_MS,
                           baseline: str = "layered") -> GateResult:
    """Fail only when spine_p99 / layered_p99 > max_ratio AND spine_p99 - layered_p99 > min_delta_ms.

    Like for like: both p99s are over successful requests only, and each side needs
    `min_requests` of them. The floor keeps a ratio of two sub-millisecond numbers (noise)
    from rolling a migration back. The value is the ratio.
    """
    gate = "latency_p99_ratio"
    missing = _missing(layered, spine, baseline)
    if missing:
        return GateResult(gate, Verdict.INCONCLUSIVE, None, max_ratio, dry_run, missing)
    need = max(min_requests, 1)
    if layered.successes < need or spine.successes < need:
        return GateResult(gate, Verdict.INCONCLUSIVE, None, max_ratio, dry_run,
                          f"too few successful requests to compare latency: {baseline} {layered.successes}, "
                          f"spine {spine.successes}, need {need} on each side")
    if not (layered.p99_ms and layered.p99_ms > 0 and spine.p99_ms and spine.p99_ms > 0):
        return GateResult(gate, Verdict.INCONCLUSIVE, None, max_ratio, dry_run,
                          f"no latency measured for successful requests ({baseline} p99 {_ms(layered.p99_ms)}, "
                          f"spine p99 {_ms(spine.p99_ms)})")
    ratio = spine.p99_ms / layered.p99_ms
    delta = spine.p99_ms - layered.p99_ms
    comparison = (f"spine p99 {_ms(spine.p99_ms)} / {baseline} p99 {_ms(layered.p99_ms)} = {ratio:.3f} "
                  f"{'<=' if ratio <= max_ratio else '>'} max_ratio {max_ratio:g}")
    if ratio <= max_ratio:
        return GateResult(gate, Verdict.PASS, ratio, max_ratio, dry_run, comparison)
    if delta <= min_delta_ms:
        return GateResult(gate, Verdict.PASS, ratio, max_ratio, dry_run,
                          f"{comparison}, but only {delta:+.3f} ms apart <= min_delta_ms {min_delta_ms:g}")
    return GateResult(gate, Verdict.FAIL, ratio, max_ratio, dry_run,
                      f"{comparison}, {delta:+.3f} ms apart > min_delta_ms {min_delta_ms:g}")


def _ms(value: float | None) -> str:
    return "none" if value is None else f"{value:.3f} ms"


def parity_gate(spine: WindowStats, parity: ParityStats, max_mismatches: float, min_requests: int,
                dry_run: bool = False) -> GateResult:
    """Fail once mismatches exceed the limit, however little traffic there was.

    A mismatch count only grows with traffic, so a count already over the limit is a
    definite fail; a count under it means something only with enough spine requests and
    at least one comparison: a window without shadow comparisons is no evidence of parity.
    """
    mismatches = parity.mismatches
    if mismatches > max_mismatches:
        noisy = f" (not counted, noisy: {', '.join(parity.noisy_fields)})" if parity.noisy_fields else ""
        fields = ", ".join(f"{name} {count}" for name, count in sorted(parity.by_field.items())
                           if name not in parity.noisy_fields)
        return GateResult("parity", Verdict.FAIL, float(mismatches), max_mismatches, dry_run,
                          f"{mismatches} decision mismatches in {parity.compared} shadow comparisons ({fields})"
                          f"{noisy} > max_mismatches {max_mismatches:g}")
    if parity.missing:
        return GateResult("parity", Verdict.INCONCLUSIVE, None, max_mismatches, dry_run,
                          f"no shadow comparisons to judge parity: {parity.missing}")
    if spine.missing:
        return GateResult("parity", Verdict.INCONCLUSIVE, float(mismatches), max_mismatches, dry_run,
                          f"no spine data to judge parity: {spine.missing}")
    if spine.requests < max(min_requests, 1):
        return GateResult("parity", Verdict.INCONCLUSIVE, float(mismatches), max_mismatches, dry_run,
                          f"too few spine requests to judge parity: {spine.requests}, need {max(min_requests, 1)}")
    if parity.compared < 1:
        return GateResult("parity", Verdict.INCONCLUSIVE, None, max_mismatches, dry_run,
                          "no shadow comparisons across layouts in the window: nothing was mirrored, so "
                          "nothing says the answers agree (is shadow traffic on?)")
    noisy = f"; noisy, not counted: {', '.join(parity.noisy_fields)}" if parity.noisy_fields else ""
    return GateResult("parity", Verdict.PASS, float(mismatches), max_mismatches, dry_run,
                      f"{mismatches} decision mismatches in {parity.compared} shadow comparisons <= "
                      f"max_mismatches {max_mismatches:g}{noisy}")


def evaluate(gates: Iterable[GateSpec], layered: WindowStats, spine: WindowStats, parity: ParityStats,
             min_requests: int, baseline: str = "layered") -> list[GateResult]:
    """Every gate of a stage on one window, in plan order.

    `min_requests` is the plan's `min_window_requests`; a gate's own `min_requests` wins.
    `baseline`: what the messages call the from-side (`legacy_endpoint.from_side`: a foreign
    gateway's name, else layered)."""
    results = []
    for gate in gates:
        need = gate.min_requests if gate.min_requests is not None else min_requests
        if gate.type == "error_rate":
            results.append(error_rate_gate(layered, spine, gate.threshold, need, gate.dry_run, baseline))
        elif gate.type == "latency_p99_ratio":
            results.append(latency_p99_ratio_gate(layered, spine, gate.threshold, need, gate.dry_run,
                                                  gate.min_delta_ms, baseline))
        elif gate.type == "parity":
            results.append(parity_gate(spine, parity, gate.threshold, need, gate.dry_run))
        else:  # the plan validator admits only the types above
            raise ValueError(f"unknown gate type {gate.type!r}")
    return results


def window_verdict(results: Sequence[GateResult]) -> Verdict:
    """Fail if any counting gate failed, else inconclusive if any could not judge, else pass.

    Dry-run gates never count: they exist to try a threshold before trusting it; nor do
    rows recorded only to be read (`GateResult.counts`).
    """
    counting = [r for r in results if r.counts and not r.dry_run]
    if any(r.verdict is Verdict.FAIL for r in counting):
        return Verdict.FAIL
    if any(r.verdict is Verdict.INCONCLUSIVE for r in counting):
        return Verdict.INCONCLUSIVE
    return Verdict.PASS
