"""Analysis gates: pure arithmetic on one window of layered vs spine traffic.

Each gate compares the spine with the layered baseline measured over the SAME window, so a
bad minute for everyone does not roll the migration back. Too little traffic on either side
says nothing, so it is `inconclusive` (the stage holds) rather than a pass or a fail.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from migration.plan import GateSpec


class Verdict(StrEnum):
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class WindowStats:
    """One side's traffic in one window: request and error counts and the p99 latency."""

    requests: int
    errors: int
    p99_ms: float

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


@dataclass(frozen=True)
class GateResult:
    gate: str
    verdict: Verdict
    value: float | None  # the measured quantity; None when there was nothing to measure
    threshold: float
    dry_run: bool
    message: str


def _too_few(layered: WindowStats, spine: WindowStats, min_requests: int) -> str | None:
    if layered.requests < min_requests or spine.requests < min_requests:
        return (f"too few requests to judge: layered {layered.requests}, spine {spine.requests}, "
                f"need {min_requests} on each side")
    return None


def error_rate_gate(layered: WindowStats, spine: WindowStats, max_delta: float, min_requests: int,
                    dry_run: bool = False) -> GateResult:
    """Pass while spine_rate <= layered_rate + max_delta; the value is the delta."""
    few = _too_few(layered, spine, min_requests)
    if few:
        return GateResult("error_rate", Verdict.INCONCLUSIVE, None, max_delta, dry_run, few)
    delta = spine.error_rate - layered.error_rate
    ok = spine.error_rate <= layered.error_rate + max_delta
    message = (f"spine error rate {spine.error_rate:.4f} vs layered {layered.error_rate:.4f}: "
               f"delta {delta:+.4f} {'<=' if ok else '>'} max_delta {max_delta:g}")
    return GateResult("error_rate", Verdict.PASS if ok else Verdict.FAIL, delta, max_delta, dry_run, message)


def latency_p99_ratio_gate(layered: WindowStats, spine: WindowStats, max_ratio: float, min_requests: int,
                           dry_run: bool = False) -> GateResult:
    """Pass while spine_p99 / layered_p99 <= max_ratio; the value is the ratio."""
    few = _too_few(layered, spine, min_requests)
    if few:
        return GateResult("latency_p99_ratio", Verdict.INCONCLUSIVE, None, max_ratio, dry_run, few)
    if layered.p99_ms <= 0:
        return GateResult("latency_p99_ratio", Verdict.INCONCLUSIVE, None, max_ratio, dry_run,
                          f"no layered latency baseline (layered p99 {layered.p99_ms:g} ms)")
    ratio = spine.p99_ms / layered.p99_ms
    ok = ratio <= max_ratio
    message = (f"spine p99 {spine.p99_ms:.1f} ms / layered p99 {layered.p99_ms:.1f} ms = {ratio:.3f} "
               f"{'<=' if ok else '>'} max_ratio {max_ratio:g}")
    return GateResult("latency_p99_ratio", Verdict.PASS if ok else Verdict.FAIL, ratio, max_ratio,
                      dry_run, message)


def parity_gate(spine: WindowStats, mismatches: int, max_mismatches: float, min_requests: int,
                dry_run: bool = False) -> GateResult:
    """Fail once mismatches exceed the limit, however little traffic there was.

    A mismatch count only grows with traffic, so a count already over the limit is a
    definite fail; a count under it means something only with enough spine requests.
    """
    if mismatches > max_mismatches:
        return GateResult("parity", Verdict.FAIL, float(mismatches), max_mismatches, dry_run,
                          f"{mismatches} decision mismatches > max_mismatches {max_mismatches:g}")
    if spine.requests < min_requests:
        return GateResult("parity", Verdict.INCONCLUSIVE, float(mismatches), max_mismatches, dry_run,
                          f"too few spine requests to judge parity: {spine.requests}, need {min_requests}")
    return GateResult("parity", Verdict.PASS, float(mismatches), max_mismatches, dry_run,
                      f"{mismatches} decision mismatches <= max_mismatches {max_mismatches:g}")


def evaluate(gates: Iterable[GateSpec], layered: WindowStats, spine: WindowStats, mismatches: int,
             min_requests: int) -> list[GateResult]:
    """Every gate of a stage on one window, in plan order."""
    results = []
    for gate in gates:
        if gate.type == "error_rate":
            results.append(error_rate_gate(layered, spine, gate.threshold, min_requests, gate.dry_run))
        elif gate.type == "latency_p99_ratio":
            results.append(latency_p99_ratio_gate(layered, spine, gate.threshold, min_requests, gate.dry_run))
        elif gate.type == "parity":
            results.append(parity_gate(spine, mismatches, gate.threshold, min_requests, gate.dry_run))
        else:  # the plan validator admits only the types above
            raise ValueError(f"unknown gate type {gate.type!r}")
    return results


def window_verdict(results: Sequence[GateResult]) -> Verdict:
    """Fail if any counting gate failed, else inconclusive if any could not judge, else pass.

    Dry-run gates never count: they exist to try a threshold before trusting it.
    """
    counting = [r for r in results if not r.dry_run]
    if any(r.verdict is Verdict.FAIL for r in counting):
        return Verdict.FAIL
    if any(r.verdict is Verdict.INCONCLUSIVE for r in counting):
        return Verdict.INCONCLUSIVE
    return Verdict.PASS
