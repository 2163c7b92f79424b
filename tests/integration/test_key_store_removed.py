"""The sqlite key store's files removed while the spine runs (a cleanup of the run directory, a
volume swapped): the keys held in memory keep working, but the store says it is gone — on
/metrics, in the gateway's health — and the admin API refuses every write with a 503 that
says what happened and what to do, instead of answering 201 for a key written into a deleted
file and lost at the next restart."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from runtime.config.file import placements_for
from runtime.running_stack import RunningStack
from runtime.stack import Stack
from tests.conftest import config_for_tests
from tests.http_helpers import openai_client
from tests.waiting import eventually

TOKEN = "store-gone-admin-token-0123456789"


def admin(stack: RunningStack, method: str, path: str, body: Any = None) -> httpx.Response:
    return httpx.request(method, f"http://{stack.http_address}{path}", json=body, timeout=10,
                         headers={"authorization": f"Bearer {TOKEN}"})


def metric(stack: RunningStack, family: str) -> float | None:
    address = stack.metrics_address()
    assert address is not None
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as answer:
        for found in text_string_to_metric_families(answer.read().decode()):
            for sample in found.samples:
                if sample.name == family:
                    return float(sample.value)
    return None


def works(stack: RunningStack, key: str) -> bool:
    try:
        openai_client(stack, key).chat.completions.create(model="tiny-lm", max_tokens=2, temperature=0,
                                                          messages=[{"role": "user", "content": "hi"}])
        return True
    except openai.AuthenticationError:
        return False


def test_a_removed_key_store_is_reported_and_refuses_writes_it_could_not_keep(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "keys.sqlite"
    config = config_for_tests(auth={"store": {"sqlite": str(path)}})
    stack = Stack(config, placements_for("collapsed", config), run_dir=tmp_path / "run",
                  http_listen="127.0.0.1:0", admin_token=TOKEN).start()
    try:
        made = admin(stack, "POST", "/admin/keys", {"tenant": "dev", "id": "before"})
        assert made.status_code == 201, made.text
        secret = made.json()["secret"]
        eventually(lambda: works(stack, secret), what="the key made before works")
        assert metric(stack, "spine_auth_key_store_up") == 1.0
        for name in ("keys.sqlite", "keys.sqlite-wal", "keys.sqlite-shm"):
            (path.parent / name).unlink(missing_ok=True)

        eventually(lambda: metric(stack, "spine_auth_key_store_up") == 0.0, what="the store reported down")
        auth = eventually(lambda: (lambda a: a if "was removed" in a["reason"] else None)(
            stack.health_report()["components"]["auth"]), what="the gateway's health saying why",
            seen=lambda: stack.health_report()["components"]["auth"])
        assert auth["serving"] is True  # auth serves on from the keys it holds
        refused = admin(stack, "POST", "/admin/keys", {"tenant": "dev", "id": "after"})
        assert refused.status_code == 503, refused.text
        message = refused.json()["error"]["message"]
        assert str(path) in message and "was removed" in message and "Restore the file" in message
        for method, where, body in (("PATCH", "/admin/keys/before", {"team": "x"}),
                                    ("POST", "/admin/keys/before/rotate", {"overlap_s": 60}),
                                    ("POST", "/admin/keys/before/revoke", None)):
            answer = admin(stack, method, where, body)
            assert answer.status_code == 503 and "was removed" in answer.json()["error"]["message"], answer.text
        assert works(stack, secret)  # the keys held in memory keep working
        assert not path.exists()  # nothing made a new, empty store behind the operator's back
    finally:
        stack.stop()
