"""Keys managed at run time, on one machine: the admin API (HTTP /admin/keys, gRPC KeyAdmin
through `spine keys`) behind the admin token, keys stored hashed in the sqlite key store, and
auth deciding the same whether it runs in its own process (the mixed layout: auth and the rate
limiter remote) or in the spine; official openai and anthropic SDKs as clients."""

from __future__ import annotations

import hashlib
import io
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import anthropic
import grpc
import httpx
import openai
import pytest

from runtime.config.file import placements_for
from runtime.running_stack import RunningStack
from runtime.stack import Stack
from spine.cli import main as spine_main
from tests.conftest import config_for_tests
from tests.http_helpers import anthropic_client, openai_client
from tests.waiting import eventually
from wire.v1 import keys_pb2, keys_pb2_grpc

TOKEN = "keys-admin-token-0123456789"


def within(seconds: float, ok: Callable[[], bool]) -> float:
    """How long until `ok()` (polled); fails the test past `seconds`."""
    started = time.monotonic()
    eventually(ok, timeout=seconds, what=f"within {seconds}s")
    return time.monotonic() - started


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningStack]]:
    """The mixed layout (auth and the rate limiter in processes of their own) and the spine,
    sharing one key store file and its secret."""
    tmp = tmp_path_factory.mktemp("keys")
    secret = tmp / "hmac.secret"
    secret.write_text("k" * 48)
    secret.chmod(0o600)
    config = config_for_tests(auth={"store": {"sqlite": str(tmp / "keys.sqlite"), "hmac_secret_file": str(secret)}})
    started: dict[str, RunningStack] = {}
    try:
        for layout in ("mixed", "collapsed"):
            started[layout] = Stack(config, placements_for(layout, config), run_dir=tmp / layout,
                                    http_listen="127.0.0.1:0", admin_token=TOKEN).start()
        yield started
    finally:
        for stack in started.values():
            stack.stop()


def admin(stack: RunningStack, method: str, path: str, body: Any = None, token: str = TOKEN) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, f"http://{stack.http_address}{path}", json=body, headers=headers, timeout=10)


def works(stack: RunningStack, key: str, model: str = "tiny-lm") -> bool:
    try:
        openai_client(stack, key).chat.completions.create(model=model, max_tokens=2, temperature=0,
                                                          messages=[{"role": "user", "content": "hi"}])
        return True
    except openai.AuthenticationError:
        return False


def spine_keys(stack: RunningStack, *args: str) -> tuple[int, Any]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = spine_main(["keys", *args, "--address", stack.address, "--json"])
    return code, json.loads(out.getvalue()) if out.getvalue().strip() else None


def test_a_key_made_through_the_http_api_works_in_both_layouts_and_is_stored_only_hashed(
        stacks: dict[str, RunningStack]) -> None:
    made = admin(stacks["mixed"], "POST", "/admin/keys", {"tenant": "dev", "id": "web-1", "team": "blue"})
    assert made.status_code == 201, made.text
    secret = made.json()["secret"]
    assert secret.startswith("sk-spine-") and made.json()["key"]["team"] == "blue"
    # Seen by auth in its own process and in the spine, within a poll.
    within(1.0, lambda: all(works(stack, secret) for stack in stacks.values()))
    answer = anthropic_client(stacks["collapsed"], secret).messages.create(
        model="tiny-lm", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert answer.usage.output_tokens == 2
    listed = admin(stacks["collapsed"], "GET", "/admin/keys").json()["keys"]
    row = next(r for r in listed if r["id"] == "web-1")
    assert "secret" not in row and "digest" not in row and row["state"] == "active" and secret[:14] in row["shown"]
    assert {"dev-key", "tight-key"} <= {r["id"] for r in listed if r["read_only"]}  # the config's keys
    path = stacks["mixed"].config.auth.store.sqlite
    assert path is not None
    record = json.loads(sqlite3.connect(path).execute("SELECT record FROM keys WHERE id = 'web-1'").fetchone()[0])
    raw = Path(path).read_bytes()
    assert secret.encode() not in raw and hashlib.sha256(secret.encode()).hexdigest() not in raw.decode("latin-1")
    assert len(record["digest"]) == 64 and record["digest"] != hashlib.sha256(secret.encode()).hexdigest()


def test_spine_keys_creates_rotates_with_an_overlap_and_revokes_everywhere_within_a_second(
        stacks: dict[str, RunningStack], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPINE_ADMIN_TOKEN", TOKEN)
    code, made = spine_keys(stacks["collapsed"], "create", "--tenant", "dev", "--id", "cli-1", "--rpm", "600")
    assert code == 0 and made["key"]["requests_per_minute"] == 600
    first = made["secret"]
    within(1.0, lambda: all(works(s, first) for s in stacks.values()))
    code, rotated = spine_keys(stacks["mixed"], "rotate", "cli-1", "--overlap", "1.0")
    assert code == 0 and rotated["secret"] != first and rotated["key"]["previous_until"] > time.time()
    second = rotated["secret"]
    within(1.0, lambda: all(works(s, second) for s in stacks.values()))
    assert all(works(s, first) for s in stacks.values())  # the old key, within its overlap
    within(3.0, lambda: not any(works(s, first) for s in stacks.values()))  # and not after it
    code, listed = spine_keys(stacks["collapsed"], "list", "--tenant", "dev")
    assert code == 0 and "cli-1" in {row["id"] for row in listed} and all("secret" not in row for row in listed)
    code, revoked = spine_keys(stacks["collapsed"], "revoke", "cli-1")
    assert code == 0 and revoked["state"] == "revoked"
    assert within(1.0, lambda: not any(works(s, second) for s in stacks.values())) < 1.0
    code, _ = spine_keys(stacks["collapsed"], "rotate", "cli-1")
    assert code == 1  # a revoked key stays revoked


def chunked(stack: RunningStack, method: str, path: str, body: Any) -> httpx.Response:
    """An admin call whose body is sent `Transfer-Encoding: chunked` (no Content-Length), in pieces."""
    data = json.dumps(body).encode()
    pieces = iter([data[:5], data[5:]])
    answer = httpx.request(method, f"http://{stack.http_address}{path}", content=pieces, timeout=10,
                           headers={"authorization": f"Bearer {TOKEN}", "content-type": "application/json"})
    assert answer.request.headers["transfer-encoding"] == "chunked" and "content-length" not in answer.request.headers
    return answer


def test_chunked_admin_bodies_are_read_like_any_other(stacks: dict[str, RunningStack]) -> None:
    stack = stacks["collapsed"]
    made = chunked(stack, "POST", "/admin/keys", {"tenant": "dev", "id": "chunked-1", "team": "red"})
    assert made.status_code == 201, made.text
    assert made.json()["key"]["team"] == "red"
    changed = chunked(stack, "PATCH", "/admin/keys/chunked-1", {"team": "green", "requests_per_minute": 60})
    assert changed.status_code == 200, changed.text
    assert admin(stack, "GET", "/admin/keys/chunked-1").json()["team"] == "green"  # changed, not a 200 for nothing
    old = made.json()["secret"]
    within(1.0, lambda: works(stack, old))
    rotated = chunked(stack, "POST", "/admin/keys/chunked-1/rotate", {"overlap_s": 600})
    assert rotated.status_code == 200 and rotated.json()["key"]["previous_until"] > time.time() + 500
    within(1.0, lambda: works(stack, rotated.json()["secret"]))
    assert works(stack, old)  # the overlap was read: the old secret still works
    refused = chunked(stack, "PATCH", "/admin/keys/chunked-1", {"budjet_usd": 1})
    assert refused.status_code == 400 and "budjet_usd" in refused.json()["error"]["message"]
    huge = chunked(stack, "PATCH", "/admin/keys/chunked-1", {"team": "x" * stack.config.http.max_body_bytes})
    assert huge.status_code == 413 and "max_body_bytes" in huge.json()["error"]["message"]
    empty = httpx.post(f"http://{stack.http_address}/admin/keys/chunked-1/rotate", content=iter([b""]), timeout=10,
                       headers={"authorization": f"Bearer {TOKEN}", "content-type": "application/json"})
    assert empty.status_code == 200  # an empty chunked body is no fields: no overlap


def test_the_admin_api_needs_the_admin_token(stacks: dict[str, RunningStack], monkeypatch: pytest.MonkeyPatch) -> None:
    stack = stacks["collapsed"]
    for token in ("", "not-the-admin-token-at-all"):
        answer = admin(stack, "POST", "/admin/keys", {"tenant": "dev"}, token=token)
        assert answer.status_code == 401 and "admin token" in answer.json()["error"]["message"]
    with grpc.insecure_channel(stack.address) as channel, pytest.raises(grpc.RpcError) as refused:
        keys_pb2_grpc.KeyAdminStub(channel).ListKeys(keys_pb2.ListKeysRequest(), timeout=5,
                                                     metadata=(("authorization", "Bearer wrong-token-0123456789"),))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    monkeypatch.setenv("SPINE_ADMIN_TOKEN", "wrong-token-0123456789")
    assert spine_keys(stack, "list")[0] == 3
    assert all(row["id"] != "" for row in admin(stack, "GET", "/admin/keys").json()["keys"])


def test_refusals_name_what_to_fix(stacks: dict[str, RunningStack]) -> None:
    stack = stacks["collapsed"]
    bad = admin(stack, "POST", "/admin/keys", {"tenant": "dev", "budget_window": "weekly"})
    assert bad.status_code == 400 and "budget_window" in bad.json()["error"]["message"]
    unknown = admin(stack, "POST", "/admin/keys", {"tenant": "dev", "budjet_usd": 5})
    assert unknown.status_code == 400 and "budjet_usd" in unknown.json()["error"]["message"]
    assert admin(stack, "POST", "/admin/keys", {"id": "x"}).status_code == 400  # no tenant
    read_only = admin(stack, "PATCH", "/admin/keys/dev-key", {"team": "x"})
    assert read_only.status_code == 409 and "config file" in read_only.json()["error"]["message"]
    assert admin(stack, "GET", "/admin/keys/no-such-key").status_code == 404
    assert admin(stack, "POST", "/admin/keys", {"tenant": "dev", "id": "dev-key"}).status_code == 409


def test_a_key_may_be_limited_to_some_models_and_to_a_time(stacks: dict[str, RunningStack]) -> None:
    made = admin(stacks["mixed"], "POST", "/admin/keys", {"tenant": "dev", "models": ["tiny-lm"],
                                                          "expires_in_s": 1.0}).json()
    secret, stack = made["secret"], stacks["mixed"]
    within(1.0, lambda: works(stack, secret))
    assert works(stack, secret, model="default")  # an alias of tiny-lm
    with pytest.raises(openai.PermissionDeniedError, match="may not use model 'mini'"):
        openai_client(stack, secret).chat.completions.create(model="mini", max_tokens=2,
                                                             messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.PermissionDeniedError):
        anthropic_client(stack, secret).messages.create(model="mini", max_tokens=2,
                                                        messages=[{"role": "user", "content": "hi"}])
    within(3.0, lambda: not works(stack, secret))  # expired at its time
    assert admin(stack, "GET", f"/admin/keys/{made['key']['id']}").json()["state"] == "expired"


def test_a_keys_own_requests_per_minute_hold_beside_its_tenants(stacks: dict[str, RunningStack]) -> None:
    stack = stacks["mixed"]
    secret = admin(stack, "POST", "/admin/keys", {"tenant": "dev", "requests_per_minute": 3}).json()["secret"]
    within(1.0, lambda: works(stack, secret))
    client = openai_client(stack, secret)
    client.chat.completions.create(model="tiny-lm", max_tokens=1, messages=[{"role": "user", "content": "a"}])
    client.chat.completions.create(model="tiny-lm", max_tokens=1, messages=[{"role": "user", "content": "b"}])
    with pytest.raises(openai.RateLimitError, match="key=") as refused:
        client.chat.completions.create(model="tiny-lm", max_tokens=1, messages=[{"role": "user", "content": "c"}])
    assert float(refused.value.response.headers["retry-after-ms"]) > 0
    assert works(stack, "spine-dev-key-0000")  # the tenant's other keys are not held back


def test_the_stored_hash_is_hmac_sha256_under_the_servers_secret() -> None:
    import hmac

    from services.auth.managed_keys import KeyHasher

    for secret in (b"s" * 16, b"t" * 64, b"u" * 100):  # a secret longer than a block is hashed first
        for key in ("sk-spine-abc", "é" * 40):
            assert KeyHasher(secret).raw(key) == hmac.digest(secret, key.encode(), "sha256")


def test_tables_in_a_pipe_keep_whole_ids_and_amounts_and_output_json_gives_the_rows(
        stacks: dict[str, RunningStack], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPINE_ADMIN_TOKEN", TOKEN)
    long_id = "a-key-whose-id-is-long-enough-to-be-cut-at-eighty-cols-012345"
    code, _ = spine_keys(stacks["collapsed"], "create", "--tenant", "dev", "--id", long_id, "--team",
                         "a-team-with-a-long-name", "--budget", "12.345678")
    assert code == 0
    printed = subprocess.run([sys.executable, "-m", "spine", "keys", "list", "--address", stacks["collapsed"].address],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": ""})
    assert printed.returncode == 0, printed.stderr
    row = next(line for line in printed.stdout.splitlines() if long_id in line)  # on one line, whole
    assert "$12.345678/monthly" in row and "a-team-with-a-long-name" in row
    as_json = subprocess.run([sys.executable, "-m", "spine", "keys", "list", "--address",
                              stacks["collapsed"].address, "--output", "json"], capture_output=True, text=True,
                             timeout=60)
    assert long_id in {row["id"] for row in json.loads(as_json.stdout)}
