"""Three spines (`spine up --layout collapsed`) sharing one Redis for keys, limits and spend:
a key made through the admin API on one works on all within a second and a revoked one is
refused on all within a second; a budget holds across the three under a concurrent soak (no
refusal below 0.9 of it, the overshoot within what was in flight); a stream past the tokens
limit on one replica is refused next on every replica; with the store down, keys keep
working from each replica's copy, and /metrics says so."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from runtime.processes.launch import Launched, launch, spine_up_argv
from spine.tools.local_redis import LocalRedis
from tests.waiting import eventually
from wire.v1 import keys_pb2, keys_pb2_grpc

TOKEN = "replicas-admin-token-0123456789"
INPUT, OUTPUT = 100.0, 200.0  # USD per million tokens of tiny-lm
REFRESH_S = 0.1
TOKEN_BURST = 200


@dataclass
class Replica:
    http: str
    grpc: str
    metrics: str


@dataclass
class Cluster:
    redis: LocalRedis
    replicas: list[Replica] = field(default_factory=list)

    def admin(self, i: int, method: str, path: str, body: Any = None) -> Any:
        answer = httpx.request(method, f"http://{self.replicas[i].http}{path}", json=body, timeout=10,
                               headers={"authorization": f"Bearer {TOKEN}"})
        assert answer.status_code < 300, answer.text
        return answer.json()

    def client(self, i: int, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://{self.replicas[i].http}/v1", api_key=key, max_retries=0, timeout=20)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("keys-replicas")
    secret, token = workdir / "hmac.secret", workdir / "admin.token"
    for path, text in ((secret, "s" * 48), (token, TOKEN)):
        path.write_text(text)
        path.chmod(0o600)
    with LocalRedis(workdir / "redis") as redis_server:
        redis = {"address": redis_server.address, "timeout_s": 0.1}
        config = workdir / "spine.yaml"
        config.write_text(yaml.safe_dump({
            "auth": {"store": {"redis": redis, "hmac_secret_file": str(secret)}},
            # The soak's tenant far from its rate limits: only the budget may refuse it.
            "ratelimit": {"tenants": {"metered": {"tokens_per_minute": 0.6, "token_burst": TOKEN_BURST},
                                      "soak": {"requests_per_second": 1.0e6, "burst": 1.0e6,
                                               "tokens_per_minute": 1.0e9, "token_burst": 1.0e9}},
                          "store": {"redis": redis, "renew_interval_s": 0.1, "lease_s": 0.5},
                          "spend": {"prices": {"tiny-lm": {"input": INPUT, "output": OUTPUT}}, "refresh_s": REFRESH_S}},
        }))
        started: list[Launched] = []
        cluster = Cluster(redis_server)
        try:
            for i in range(3):  # started side by side, then awaited
                argv = spine_up_argv(config, "collapsed", listen="127.0.0.1:0", http_listen="127.0.0.1:0",
                                     run_dir=workdir / f"run{i}", extra=["--admin-token-file", str(token)])
                started.append(launch(f"replica {i}", argv, log_path=workdir / f"replica-{i}.log"))
            for replica in started:
                ready = replica.wait_ready(120)
                assert ready["admin_api"] is True
                cluster.replicas.append(Replica(str(ready["http_address"]), str(ready["address"]), str(ready["metrics"])))
            yield cluster
        finally:
            for replica in started:
                replica.terminate()
            deadline = time.monotonic() + 30
            for replica in started:
                replica.finish_stop(deadline)


def works(cluster: Cluster, i: int, key: str) -> bool:
    try:
        cluster.client(i, key).chat.completions.create(model="no-such-model", max_tokens=1,
                                                       messages=[{"role": "user", "content": "?"}])
    except openai.AuthenticationError:
        return False
    except openai.NotFoundError:  # past auth; nothing generated, nothing charged
        return True
    raise AssertionError("no-such-model was answered")


def seen_within(check: Callable[[int], bool], replicas: int, limit_s: float) -> list[float]:
    """Per replica: seconds until `check(i)` held (polled every 20 ms), each within `limit_s`."""
    started = time.monotonic()
    seen: dict[int, float] = {}

    def every_replica() -> bool:
        for i in set(range(replicas)) - set(seen):
            if check(i):
                seen[i] = time.monotonic() - started
        return len(seen) == replicas

    eventually(every_replica, limit_s, "every replica", interval=0.02,
               seen=lambda: f"replicas {sorted(set(range(replicas)) - set(seen))} not yet")
    return [seen[i] for i in range(replicas)]


def metric(cluster: Cluster, i: int, family: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://{cluster.replicas[i].metrics}/metrics", timeout=5) as answer:
        families = text_string_to_metric_families(answer.read().decode())
        return sum(s.value for f in families for s in f.samples
                   if s.name == family and all(s.labels.get(k) == v for k, v in labels.items()))


def test_a_key_made_on_one_replica_works_on_all_within_a_second_and_a_revoked_one_is_refused_on_all(
        cluster: Cluster) -> None:
    made = cluster.admin(0, "POST", "/admin/keys", {"tenant": "dev", "id": "everywhere"})
    created = seen_within(lambda i: works(cluster, i, made["secret"]), 3, 1.0)
    with grpc.insecure_channel(cluster.replicas[1].grpc) as channel:  # revoked through another replica's gRPC
        keys_pb2_grpc.KeyAdminStub(channel).RevokeKey(keys_pb2.KeyId(id="everywhere"), timeout=5,
                                                      metadata=(("authorization", f"Bearer {TOKEN}"),))
    revoked = seen_within(lambda i: not works(cluster, i, made["secret"]), 3, 1.0)
    print(f"key seen on the replicas after {[f'{s:.3f}' for s in created]} s, "
          f"revoked after {[f'{s:.3f}' for s in revoked]} s")
    assert all(metric(cluster, i, "spine_auth_key_store_up") == 1.0 for i in range(3))


def test_a_budget_holds_across_three_replicas_under_a_concurrent_soak(cluster: Cluster) -> None:
    budget, threads = 0.5, 12
    key = cluster.admin(2, "POST", "/admin/keys", {"tenant": "soak", "id": "soaked", "budget_usd": budget})["secret"]
    seen_within(lambda i: works(cluster, i, key), 3, 1.0)
    clients = [cluster.client(i, key) for i in range(3)]
    lock = threading.Lock()
    done: list[tuple[float, float]] = []  # (finished at, cost) of every answer
    refusals: list[float] = []  # when each refused request was sent
    sent = [0]

    def worker(w: int) -> None:
        while True:
            with lock:
                n = sent[0]
                sent[0] += 1
            started = time.monotonic()
            try:
                answer = clients[n % 3].chat.completions.create(
                    model="tiny-lm", max_tokens=16, temperature=0, messages=[{"role": "user", "content": f"soak {n}"}])
            except openai.RateLimitError as error:
                assert error.code == "insufficient_quota"
                with lock:
                    refusals.append(started)
                    if len(refusals) >= 3 * threads:
                        return
                continue
            assert answer.usage is not None
            with lock:
                done.append((time.monotonic(), (answer.usage.prompt_tokens * INPUT
                                                + answer.usage.completion_tokens * OUTPUT) / 1e6))

    began = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(worker, range(threads)))
    first_refusal = min(refusals)
    before = sum(c for at, c in done if at < first_refusal)
    total = sum(c for _, c in done)
    max_cost = max(c for _, c in done)
    rate = len([at for at, _ in done if at < first_refusal]) / (first_refusal - began)
    # What was in flight when the budget was reached: every worker's request, plus what the
    # replicas answered in the two refresh intervals a charge takes to be seen everywhere.
    bound = max_cost * (threads + rate * 2 * REFRESH_S)
    print(f"budget ${budget}: first refusal at ${before:.4f} answered ({before / budget:.3f} of it), "
          f"{len(done)} answered at {rate:.0f}/s, final spend ${total:.4f}: overshoot ${total - budget:.4f} "
          f"({(total - budget) / max_cost:.1f} requests), bound ${bound:.4f}")
    assert before >= 0.9 * budget  # no refusal below 0.9 of the budget
    assert total - budget <= bound
    seen_within(lambda i: abs(_spend(cluster, i, "soaked") - total) < 1e-9, 1, 2.0)  # every charge arrived
    for i in range(3):  # and every replica refuses now
        with pytest.raises(openai.RateLimitError, match="budget of key soaked"):
            clients[i].chat.completions.create(model="tiny-lm", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    # Each replica's /metrics shows the total once its next exchange has read it back.
    seen_within(lambda i: metric(cluster, i, "spine_spend_usd", scope="key", name="soaked", window="monthly")
                == pytest.approx(total), 3, 1.0)


def _spend(cluster: Cluster, i: int, key: str) -> float:
    lines = cluster.admin(i, "GET", f"/admin/spend?key={key}")["lines"]
    return float(next(line["usd"] for line in lines if line["window"] == "monthly"))


def test_a_stream_past_the_tokens_limit_on_one_replica_is_refused_next_on_every_replica(cluster: Cluster) -> None:
    key = cluster.admin(0, "POST", "/admin/keys", {"tenant": "metered"})["secret"]
    seen_within(lambda i: works(cluster, i, key), 3, 1.0)
    for i in range(3):  # the tenant's bucket on every replica
        cluster.client(i, key).chat.completions.create(model="tiny-lm", max_tokens=1, temperature=0,
                                                       messages=[{"role": "user", "content": f"warm {i}"}])
    time.sleep(0.6)  # idle past lease_s: the replicas give back what they hold but their reserve
    chunks = list(cluster.client(0, key).chat.completions.create(
        model="tiny-lm", max_tokens=256, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "long"}]))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens + usage.completion_tokens > TOKEN_BURST

    def refused(i: int) -> bool:
        try:
            cluster.client(i, key).chat.completions.create(model="tiny-lm", max_tokens=1, temperature=0,
                                                           messages=[{"role": "user", "content": "next"}])
            return False
        except openai.RateLimitError as error:
            return "resource=tokens" in error.message

    after = seen_within(refused, 3, 1.0)
    print(f"refused on the replicas {[f'{s:.3f}' for s in after]} s after the stream ended")
    assert all(refused(i) for i in range(3))  # and it stays refused: the debt refills at 0.01 tokens/s


def test_with_the_store_down_the_replicas_serve_their_last_copy_of_the_keys(cluster: Cluster) -> None:
    key = cluster.admin(1, "POST", "/admin/keys", {"tenant": "dev"})["secret"]
    seen_within(lambda i: works(cluster, i, key), 3, 1.0)
    cluster.redis.pause()
    try:
        seen_within(lambda i: metric(cluster, i, "spine_auth_key_store_up") == 0.0, 3, 3.0)
        assert all(works(cluster, i, key) for i in range(3))
        assert all(metric(cluster, i, "spine_auth_key_store_polls_total", result="error") > 0 for i in range(3))
        assert all(metric(cluster, i, "spine_auth_key_store_stale_seconds") > 0 for i in range(3))
    finally:
        cluster.redis.resume()
    seen_within(lambda i: metric(cluster, i, "spine_auth_key_store_up") == 1.0, 3, 3.0)


def test_every_replicas_metrics_show_spend(cluster: Cluster, tmp_path: Path) -> None:
    for i in range(3):
        assert metric(cluster, i, "spine_spend_store_up") == 1.0
        assert metric(cluster, i, "spine_spend_store_calls_total", result="ok") > 0
