"""Fair sharing between tenants in numbers: tenant B's queue wait alone, and with tenant A
sending ten times B's rate, with the per-tenant queues and with the FIFO they replaced.

    python -m bench.fair_share [--rounds 3] [--seconds 3]
    python -m bench.run --only fair_share        (into bench/results.json)

One inference service in this process serving `sim` (its steps wait the default profile's
device time off the CPU, as a model on a GPU does), with 16 KV slots and answers of 1 to 15
tokens (8 on average). Arrivals are open loop (Poisson, seeded: B's arrival times are the same
in every condition), B at an eighth of the model's capacity alone and, when flooding, A at ten
times B's rate — more than the model serves, so A's backlog grows for the whole round. Jobs go
to the scheduler directly (no consumer threads to compete with the driver); a job's queue
wait is its admission into a slot minus its arrival, on the scheduler's clock.

Four conditions take turns round by round, in a rotating order, so the host's slow spells land
on all alike: `alone` (B only), `fair` (A floods; tenants named; the default headroom slot),
`fair-no-headroom` (the same with `inference.share_headroom_slots: 0`: every free slot to
whoever is next) and `fifo` (A floods; no tenant named: one FIFO per class, as before).
Reported per condition: B's p50 and p95 queue wait, the share of B's requests admitted at
their next turn (no admission of A's between B's arrival and its own) and the p95 count of
A's admissions ahead of one of B's; the ratios of B's p95 to B's p95 alone; how many of A's
requests a second the model admitted in the fair rounds, beside its capacity.

What bounds B's wait with A flooding, once B is next in line: the rest of the step in flight
(a full batch's step is longer than B's alone) and, without the headroom slot, a sequence
finishing to free a slot.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from monolith.device import DeviceContext
from services.inference.config import InferenceConfig
from services.inference.jobs import Job
from services.inference.model.engine import GenerationRequest
from services.inference.service import InferenceService

SLOTS = 16
MAX_TOKENS = 8
FLOOD = 10  # A's rate over B's
HEADROOM = 1  # inference.share_headroom_slots' default


def _arrivals(rate: float, seconds: float, seed: int) -> list[float]:
    rng, t = random.Random(seed), 0.0
    times: list[float] = []
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return times
        times.append(t)


def _round(service: InferenceService, rate_b: float, seconds: float, seed: int, condition: str) -> dict[str, Any]:
    """One round of one condition: B's queue waits (ms) and how many of A's were admitted."""
    service.scheduler.headroom_slots = 0 if condition == "fair-no-headroom" else HEADROOM
    plan = [(t, "b") for t in _arrivals(rate_b, seconds, seed)]
    if condition != "alone":
        plan += [(t, "a") for t in _arrivals(rate_b * FLOOD, seconds, seed + 1)]
    plan.sort()
    sent: list[tuple[str, Job]] = []  # who sent each job (also where no tenant is named)
    lengths = random.Random(seed + 2)
    started = time.perf_counter()
    for i, (at, who) in enumerate(plan):
        delay = started + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        prompt = list(f"{condition} {seed} {who} {i}".encode())
        tokens = lengths.randint(1, 2 * MAX_TOKENS - 1)  # answers of varied length, MAX_TOKENS on average
        job = Job(GenerationRequest(prompt_ids=prompt, max_tokens=tokens), tenant=who if condition != "fifo" else "")
        service.scheduler.submit(job)
        sent.append((who, job))
    ended = time.perf_counter()
    deadline = time.monotonic() + 120.0
    while any(not job.done and job.failure is None for _, job in sent):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{condition}: jobs still running after 120 s")
        time.sleep(0.01)
    a_admitted = [job for who, job in sent if who == "a" and job.admitted_seq is not None]
    b_jobs = [job for who, job in sent if who == "b" and job.started_at is not None]
    waits = [(job.started_at - job.enqueued_at) * 1000.0 for job in b_jobs if job.started_at is not None]
    # A's admissions between B's arrival and its own: 0 = admitted at its next turn.
    ahead = [sum(1 for other in a_admitted if other.started_at is not None and other.started_at >= job.enqueued_at
                 and (other.admitted_seq or 0) < (job.admitted_seq or 0)) for job in b_jobs]
    round_end = time.monotonic() - (time.perf_counter() - ended)
    admitted_a = sum(1 for who, job in sent if who == "a" and job.started_at is not None and job.started_at <= round_end)
    return {"waits_b_ms": waits, "ahead_b": ahead, "admitted_a": admitted_a, "seconds": ended - started,
            "total_s": time.perf_counter() - started}


def _p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[-1] if len(values) > 1 else values[0]


def measure(rounds: int = 3, seconds: float = 3.0) -> dict[str, Any]:
    config = InferenceConfig.parse({"backend": {"class": "sim"}, "kv_cache_max_entries": SLOTS,
                                     "max_batch": SLOTS, "max_queue": 100_000, "aging_ms": 60_000})
    service = InferenceService(config, DeviceContext())
    model: Any = service.backend.model  # the sim model, whose profile is its cost model
    step_ms = model.profile.step_ms(SLOTS, 0)
    capacity = SLOTS / (MAX_TOKENS * step_ms / 1000.0)  # requests a second at full batches
    rate_b = 0.12 * capacity  # B alone keeps about one sequence running; A floods at 1.2x capacity
    conditions = ("alone", "fair", "fair-no-headroom", "fifo")
    waits: dict[str, list[float]] = {c: [] for c in conditions}
    ahead: dict[str, list[int]] = {c: [] for c in conditions}
    admitted_a, fair_s, fair_total_s, fair_steps = 0, 0.0, 0.0, 0
    try:
        _round(service, rate_b, 0.5, 999, "alone")  # warm up
        for r in range(rounds):
            order = conditions[r % len(conditions):] + conditions[:r % len(conditions)]
            for condition in order:
                steps_before = model.steps
                result = _round(service, rate_b, seconds, 1000 + 7 * r, condition)
                waits[condition] += result["waits_b_ms"]
                ahead[condition] += result["ahead_b"]
                if condition == "fair":
                    admitted_a += result["admitted_a"]
                    fair_s += result["seconds"]
                    fair_total_s += result["total_s"]
                    fair_steps += model.steps - steps_before
    finally:
        service.close()
    p95 = {c: _p95(waits[c]) for c in conditions}
    return {
        "slots": SLOTS, "max_tokens": MAX_TOKENS, "rounds": rounds, "seconds_per_round": seconds,
        "step_ms_full_batch": round(step_ms, 2), "capacity_rps": round(capacity, 1),
        "rate_b_rps": round(rate_b, 1), "rate_a_rps": round(rate_b * FLOOD, 1),
        "requests_b_per_condition": {c: len(waits[c]) for c in conditions},
        "b_p50_wait_ms": {c: round(statistics.median(waits[c]), 2) for c in conditions},
        "b_p95_wait_ms": {c: round(p95[c], 2) for c in conditions},
        "b_admitted_at_next_turn_pct": {c: round(100.0 * ahead[c].count(0) / max(1, len(ahead[c])), 1)
                                        for c in conditions},
        "b_p95_admissions_ahead": {c: _p95([float(n) for n in ahead[c]]) for c in conditions},
        "fair_vs_alone_p95": round(p95["fair"] / p95["alone"], 2),
        "fair_no_headroom_vs_alone_p95": round(p95["fair-no-headroom"] / p95["alone"], 2),
        "fifo_vs_alone_p95": round(p95["fifo"] / p95["alone"], 2),
        "a_admitted_per_s_fair": round(admitted_a / fair_s, 1) if fair_s else 0.0,
        # The model's steps as this host ran them under the flood (the profile's device time, or
        # more where the host's own work per step took longer): B's wait once next in line.
        "step_ms_measured_fair": round(1000.0 * fair_total_s / fair_steps, 2) if fair_steps else 0.0,
    }


def describe(row: dict[str, Any]) -> str:
    p95 = row["b_p95_wait_ms"]
    return (f"fair share ({row['slots']} slots, B {row['rate_b_rps']} req/s, A {row['rate_a_rps']} req/s): B's p95 "
            f"queue wait {p95['alone']} ms alone, {p95['fair']} ms with A flooding ({row['fair_vs_alone_p95']}x), "
            f"{p95['fair-no-headroom']} ms without the headroom slot ({row['fair_no_headroom_vs_alone_p95']}x), "
            f"{p95['fifo']} ms with one FIFO ({row['fifo_vs_alone_p95']}x); B admitted at its next turn "
            f"{row['b_admitted_at_next_turn_pct']['fair']}% (FIFO {row['b_admitted_at_next_turn_pct']['fifo']}%); "
            f"a full batch's step {row['step_ms_full_batch']} ms by the profile, {row['step_ms_measured_fair']} ms "
            f"as run; A admitted {row['a_admitted_per_s_fair']}/s of the "
            f"model's {row['capacity_rps']}/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=None, help="also write the row as JSON here")
    args = parser.parse_args(argv)
    row = measure(args.rounds, args.seconds)
    print(describe(row))
    if args.out is not None:
        args.out.write_text(json.dumps(row, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
