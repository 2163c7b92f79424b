"""`python -m bench.lease_bench`: what the shared lease store (`ratelimit.store`) costs and how exact it is.

Not part of `make bench` (it runs its own redis-server and, by default, two 30 s traffic
runs). Three measurements, each in this process against a real `redis-server` on loopback:

1. **decision cost**: `admit` of one request (the hot path, `TokenBucketTable.decide_alone`)
   in a warm loop on one limiter without a store and on one leasing from the store, taking
   turns in rounds (the host's drift meets both alike); decisions per second each, the ratio,
   and the store's round trips per second meanwhile;
2. **skew**: three replicas, one tenant limited to `--rate`/s (burst as much), all its
   traffic on one replica at ten times that for `--seconds`: admitted / (burst + rate x time);
3. **even**: the same spread round robin over the three;
4. **partition**: the same spread, with one of the three cut off from the store
   (`CuttableLink`): it falls back to its share (a third) while the other two lease; the
   over-admission measured against the bound stated (`deploy/README.md`): at most its share
   of burst + rate x time cut off, plus the replicas' reserves.

Writes `bench/leases.json` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from monolith.device import DeviceContext
from services.ratelimit.admission import AdmitItem, AdmitVerdict
from services.ratelimit.config import RateLimitConfig
from services.ratelimit.service import RateLimitService
from spine.tools.local_redis import CuttableLink, LocalRedis

ROOMY = {"requests_per_second": 1e9, "burst": 1e9, "tokens_per_minute": 1e12, "token_burst": 1e12}


def limiter(address: str | None, tenants: dict[str, Any], prefix: str) -> RateLimitService:
    store = None if address is None else {"redis": {"address": address, "key_prefix": prefix}}
    return RateLimitService(RateLimitConfig.parse({"tenants": tenants, "store": store}), DeviceContext())


def decisions_per_s(service: RateLimitService, count: int) -> float:
    item = [AdmitItem("bench", "m", 10)]
    admit = service.admit
    started = time.perf_counter()
    for _ in range(count):
        admit(item)
    return count / (time.perf_counter() - started)


def decision_cost(address: str, rounds: int, per_round: int) -> dict[str, Any]:
    plain = limiter(None, {"bench": ROOMY}, "")
    leased = limiter(address, {"bench": ROOMY}, "cost:")
    try:
        for service in (plain, leased):
            decisions_per_s(service, 2000)  # warm: buckets made, first lease taken
        store = leased.store
        assert store is not None
        calls_before, started = store.store.calls, time.monotonic()
        off: list[float] = []
        on: list[float] = []
        for turn in range(rounds):  # the order alternates: going first or second is worth a few %
            for service in (plain, leased) if turn % 2 else (leased, plain):
                (off if service is plain else on).append(decisions_per_s(service, per_round))
        calls_per_s = (store.store.calls - calls_before) / (time.monotonic() - started)
    finally:
        plain.close()
        leased.close()
    off_m, on_m = statistics.median(off), statistics.median(on)
    return {"decisions_per_s_store_off": off_m, "decisions_per_s_store_on": on_m,
            "us_per_decision_store_off": 1e6 / off_m, "us_per_decision_store_on": 1e6 / on_m,
            "cost_on_vs_off": off_m / on_m, "store_calls_per_s": calls_per_s,
            "rounds": rounds, "decisions_per_round": per_round}


def traffic(address: str, rate: float, seconds: float, skewed: bool, prefix: str) -> dict[str, Any]:
    tenants = {"t": {"requests_per_second": rate, "burst": rate}}
    replicas = [limiter(address, tenants, prefix) for _ in range(3)]
    admitted = [0, 0, 0]
    sent = 0
    try:
        start = time.monotonic()
        calls_before = [r.store.store.calls for r in replicas if r.store]
        while (elapsed := time.monotonic() - start) < seconds:
            while sent < int(elapsed * 10 * rate):
                i = 0 if skewed else sent % 3
                verdict = replicas[i].admit([AdmitItem("t", "m", 10)])[0]
                admitted[i] += isinstance(verdict, AdmitVerdict) and verdict.admitted
                sent += 1
            time.sleep(0.001)
        elapsed = time.monotonic() - start
        calls = [r.store.store.calls - before for r, before in zip(replicas, calls_before, strict=True) if r.store]
    finally:
        for replica in replicas:
            replica.close()
    limit = rate + rate * elapsed
    return {"sent": sent, "admitted_per_replica": admitted, "admitted": sum(admitted), "limit": limit,
            "admitted_vs_limit": sum(admitted) / limit, "seconds": elapsed,
            "store_calls_per_s_per_replica": [c / elapsed for c in calls]}


def partition(redis: LocalRedis, rate: float, seconds: float, prefix: str) -> dict[str, Any]:
    tenants = {"t": {"requests_per_second": rate, "burst": rate}}
    link = CuttableLink(redis.port)
    replicas = [limiter(redis.address, tenants, prefix) for _ in range(2)] + [limiter(link.address, tenants, prefix)]
    admitted = [0, 0, 0]
    sent = 0
    try:
        deadline = time.monotonic() + 10.0
        while any(r.store and r.store.replicas < 3 for r in replicas) and time.monotonic() < deadline:
            time.sleep(0.05)  # every replica counted by the store: the cut-off one's share is a third
        link.cut()
        cut_off = replicas[2].store
        assert cut_off is not None
        while cut_off.leasing and time.monotonic() < deadline:
            time.sleep(0.01)
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) < seconds:
            while sent < int(elapsed * 10 * rate):
                i = sent % 3
                verdict = replicas[i].admit([AdmitItem("t", "m", 10)])[0]
                admitted[i] += isinstance(verdict, AdmitVerdict) and verdict.admitted
                sent += 1
            time.sleep(0.001)
        elapsed = time.monotonic() - start
        share = min(cut_off.controller_share, 1.0 / max(cut_off.replicas, 1))  # what `shares` decides on
        reserve = cut_off.config.reserve
    finally:
        for replica in replicas:
            replica.close()
        link.close()
    limit = rate + rate * elapsed
    over = sum(admitted) - limit
    return {"sent": sent, "admitted_per_replica": admitted, "admitted": sum(admitted), "limit": limit,
            "seconds": elapsed, "over_admitted": over, "over_vs_limit": over / limit,
            "cut_off_share": share, "bound": share * limit + 3 * reserve * rate}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lease_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=50.0, help="the tenant's limit, requests/s (burst as much)")
    parser.add_argument("--seconds", type=float, default=30.0, help="each traffic run")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--per-round", type=int, default=20000)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("leases.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="spine-bench-redis-") as workdir, LocalRedis(Path(workdir)) as redis:
        results = {"decision_cost": decision_cost(redis.address, args.rounds, args.per_round),
                   "skew": traffic(redis.address, args.rate, args.seconds, True, "skew:"),
                   "even": traffic(redis.address, args.rate, args.seconds, False, "even:"),
                   "partition": partition(redis, args.rate, args.seconds, "partition:")}
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    cost = results["decision_cost"]
    print(f"decisions/s per replica: store off {cost['decisions_per_s_store_off']:,.0f} "
          f"({cost['us_per_decision_store_off']:.2f} µs), on {cost['decisions_per_s_store_on']:,.0f} "
          f"({cost['us_per_decision_store_on']:.2f} µs): cost x{cost['cost_on_vs_off']:.3f}; "
          f"store calls/s {cost['store_calls_per_s']:.1f}")
    for name in ("skew", "even"):
        run = results[name]
        print(f"{name}: sent {run['sent']}, admitted {run['admitted']} {run['admitted_per_replica']} "
              f"of a limit of {run['limit']:.0f} over {run['seconds']:.1f} s: {run['admitted_vs_limit']:.4f}; "
              f"store calls/s per replica {[round(c, 1) for c in run['store_calls_per_s_per_replica']]}")
    cut = results["partition"]
    print(f"partition (one of three cut off, share {cut['cut_off_share']:.3f}): admitted {cut['admitted']} "
          f"{cut['admitted_per_replica']} of a limit of {cut['limit']:.0f} over {cut['seconds']:.1f} s: "
          f"{cut['over_admitted']:.0f} over ({cut['over_vs_limit']:.3f} of the limit; bound {cut['bound']:.0f})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
