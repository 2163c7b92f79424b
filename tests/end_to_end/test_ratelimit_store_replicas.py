"""Limits across replicas, tried as an operator would: three collapsed replicas (`spine up
--layout collapsed`, three processes) sharing one Redis (`ratelimit.store.redis.address`,
every other store setting its default), the default tier limited to 50 requests/s (burst 50),
and one client sending ten times that open loop (gRPC `Gateway.Generate` futures, paced by
the clock, never waiting for an answer; `max_tokens: 1`, a distinct prompt each, the dev key).

Each run must admit within [0.9, 1.05] of its ideal, burst + rate x the time the sending
actually took (docs/limits-across-replicas.md states the bound: at most the replicas'
reserves over it, at most about one renewal's refill under it). Spread round robin, several
runs back to back on the same replicas: a replica that admits tokens nobody granted shows as
an overshoot, and the debt it leaves in the store as a starved run (or a store bucket that
does not come back) after it. All on one replica, it must hold as well; with the store
stopped, each replica keeps answering within its share.
"""

from __future__ import annotations

import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from runtime.processes.launch import Launched, launch, spine_up_argv
from spine.client.gateway_client import GatewayClient
from spine.tools.local_redis import LocalRedis
from tests.waiting import eventually
from wire.v1 import generation_pb2

RATE, BURST = 50.0, 50.0
OVERLOAD = 10  # requests sent per request the limit allows
SECONDS = 5.0  # each run; the check runs 10 s, ten times
SPREAD_RUNS = 3
BOUNDS = (0.9, 1.05)  # admitted / ideal, every run
KEY = "spine-dev-key-0000"  # the default config's dev tenant
PREFIX = "spine:ratelimit:"  # the store's default key prefix


@dataclass
class Cluster:
    redis: LocalRedis
    clients: list[GatewayClient]
    metrics: list[str]  # each replica's /metrics address


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("replicas")
    with LocalRedis(workdir / "redis") as redis_server:
        config = workdir / "spine.yaml"
        config.write_text(yaml.safe_dump({"ratelimit": {
            "store": {"redis": {"address": redis_server.address}},
            "default": {"requests_per_second": RATE, "burst": BURST}}}))
        replicas: list[Launched] = []
        clients: list[GatewayClient] = []
        metrics: list[str] = []
        try:
            for i in range(3):  # started side by side, then awaited
                replicas.append(launch(f"replica {i}", spine_up_argv(config, "collapsed", listen="127.0.0.1:0",
                                                                     http_listen="127.0.0.1:0", run_dir=workdir / f"run{i}"),
                                       log_path=workdir / f"replica-{i}.log"))
            for replica in replicas:
                ready = replica.wait_ready(120)
                assert "leasing from the shared store" in ready["health"]["components"]["ratelimit"]["reason"]
                clients.append(GatewayClient(str(ready["address"]), token=KEY))
                metrics.append(str(ready["metrics"]))
            yield Cluster(redis_server, clients, metrics)
        finally:
            for client in clients:
                client.close()
            for replica in replicas:
                replica.terminate()
            deadline = time.monotonic() + 30
            for replica in replicas:
                replica.finish_stop(deadline)


@dataclass
class Run:
    sent: int
    seconds: float  # how long the sending took (a loaded host may lag behind the clock)
    admitted: list[int]  # per replica

    @property
    def ideal(self) -> float:
        return BURST + RATE * self.seconds

    @property
    def ratio(self) -> float:
        return sum(self.admitted) / self.ideal


def send(cluster: Cluster, route: str, run: int) -> Run:
    """OVERLOAD x the limit for SECONDS, open loop; request n to replica n % 3 (`spread`) or
    to the first (`one`). Any answer but OK and RESOURCE_EXHAUSTED fails the test."""
    clients = cluster.clients
    futures: list[tuple[int, grpc.Future]] = []
    start, sent = time.monotonic(), 0
    while (elapsed := time.monotonic() - start) < SECONDS:
        while sent < int(elapsed * OVERLOAD * RATE):
            i = sent % len(clients) if route == "spread" else 0
            request = generation_pb2.GenerateRequest(model="default", prompt=f"run {run} request {sent}", max_tokens=1)
            futures.append((i, clients[i].stub.Generate.future(request, timeout=60.0, metadata=clients[i].metadata())))
            sent += 1
        time.sleep(0.001)
    seconds = time.monotonic() - start
    admitted = [0] * len(clients)
    codes: Counter[str] = Counter()
    for i, future in futures:
        error = future.exception()
        code = error.code() if isinstance(error, grpc.RpcError) else grpc.StatusCode.OK if error is None else None
        assert code is not None, error
        codes[code.name] += 1
        admitted[i] += code == grpc.StatusCode.OK
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, codes
    outcome = Run(sent, seconds, admitted)
    # Sending must have kept up well enough to be an overload at all, or the run checks nothing.
    assert sent >= 3 * outcome.ideal, f"the client sent only {sent} in {seconds:.2f} s (host too slow to check)"
    return outcome


def store_families(metrics: str) -> dict[str, float]:
    """A replica's view of the store (its /metrics): leasing (1) or falling back (0), the
    requests tokens it holds that the store granted and it has not spent, its store calls."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as answer:
        families = {f.name: f for f in text_string_to_metric_families(answer.read().decode())}
    calls = {s.labels["result"]: s.value for s in families["spine_ratelimit_store_calls"].samples
             if s.name.endswith("_total")}
    return {"leasing": families["spine_ratelimit_store_leasing"].samples[0].value,
            "leased_requests": sum(s.value for s in families["spine_ratelimit_store_leased_tokens"].samples
                                   if s.labels.get("resource") == "requests"),
            "calls_ok": calls.get("ok", 0.0), "calls_error": calls.get("error", 0.0),
            "fallbacks": families["spine_ratelimit_store_fallbacks"].samples[0].value}


def leased_requests(metrics: str) -> float:
    return store_families(metrics)["leased_requests"]


def store_levels(cluster: Cluster) -> dict[str, float]:
    """The dev tenant's requests buckets in the store, by key, refilled to the store's clock now
    (a bucket that is missing has expired full)."""
    client = redis.Redis(host="127.0.0.1", port=cluster.redis.port, socket_timeout=2)
    try:
        seconds, micros = client.time()
        now = seconds + micros / 1e6
        levels = {}
        for key in client.scan_iter(match=f"{PREFIX}b:tenant=dev,*resource=requests"):
            level, last = client.hmget(key, "level", "last")
            if level is not None and last is not None:
                levels[key.decode()] = min(BURST, float(level) + RATE * max(0.0, now - float(last)))
        return levels
    finally:
        client.close()


def limit_full_again(cluster: Cluster) -> None:
    """Wait until the tenant's whole limit is there again, as a run's ideal assumes: the store's
    bucket refilled to its burst and no replica holding granted tokens (an idle replica gives
    them back within lease_s). A store left in debt (a tenant starved after an overshoot) fails
    here, naming the level it is stuck at."""
    eventually(lambda: all(level >= BURST - 1e-6 for level in store_levels(cluster).values())
               and all(leased_requests(m) == 0 for m in cluster.metrics),
               timeout=15.0, what="the store's bucket full again and no replica holding a lease",
               seen=lambda: (store_levels(cluster), [store_families(m) for m in cluster.metrics]))


def test_spread_round_robin_every_run_back_to_back_admits_the_limit(cluster: Cluster) -> None:
    runs: list[Run] = []
    report: list[str] = []
    for run in range(SPREAD_RUNS):
        limit_full_again(cluster)  # a run that left the store in debt fails here: the next one would starve
        runs.append(outcome := send(cluster, "spread", run))
        report.append(f"{outcome.ratio:.3f} ({sum(outcome.admitted)} {outcome.admitted} of {outcome.ideal:.0f}, "
                      f"sent {outcome.sent} in {outcome.seconds:.2f} s)")
        print(f"spread run {run}, admitted / ideal: {report[-1]}")
        assert BOUNDS[0] <= outcome.ratio <= BOUNDS[1], report
    # Every replica took part: the limit was shared, not held by one.
    assert all(sum(r.admitted[i] for r in runs) > 0 for i in range(3)), report


def test_all_on_one_replica_admits_the_limit(cluster: Cluster) -> None:
    limit_full_again(cluster)
    run = send(cluster, "one", 0)
    print(f"one replica, admitted / ideal: {run.ratio:.3f} ({run.admitted} of {run.ideal:.0f})")
    assert BOUNDS[0] <= run.ratio <= BOUNDS[1], run
    assert run.admitted[1:] == [0, 0]


def test_every_replicas_metrics_show_its_store(cluster: Cluster) -> None:
    for address in cluster.metrics:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as answer:
            families = {f.name: f for f in text_string_to_metric_families(answer.read().decode())}
        assert families["spine_ratelimit_store_leasing"].samples[0].value == 1.0
        assert families["spine_ratelimit_store_replicas"].samples[0].value == 3.0
        calls = {s.labels["result"]: s.value for s in families["spine_ratelimit_store_calls"].samples
                 if s.name.endswith("_total")}
        assert calls["ok"] > 0


def test_with_the_store_stopped_the_replicas_keep_answering_within_their_shares(cluster: Cluster) -> None:
    limit_full_again(cluster)
    cluster.redis.stop()
    try:
        eventually(lambda: all(_leasing(m) == 0.0 for m in cluster.metrics), timeout=10.0,
                   what="every replica found the store unreachable")
        run = send(cluster, "spread", 0)
        # Each replica decides on a third of the limit (1 / the replicas the store last counted),
        # and may hold a third of a burst when the store goes.
        share = (BURST + RATE * run.seconds) / 3 + BURST / 3 + 1
        assert all(0 < a <= share for a in run.admitted), (run.admitted, share)
    finally:
        cluster.redis.start()


def _leasing(metrics: str) -> float:
    return store_families(metrics)["leasing"]
