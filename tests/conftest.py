"""Shared test set-up: a test config, credentials, and running layouts.

Layouts are real: remote components are child processes behind gRPC servers on unix
sockets; the Gateway listens on loopback.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jwt
import pytest

from runtime.config.file import SpineConfig, load_config, placements_for
from runtime.running_stack import RunningStack
from runtime.stack import Stack

DEV_KEY = "spine-dev-key-0000"
TIGHT_KEY = "tight-tenant-key-0000"
OTHER_KEY = "other-tenant-key-0000"
SPLIT_KEYS = {"remote": "split-remote-key-0000", "local": "split-local-key-0000"}
JWT_SECRET = "spine-dev-jwt-secret-change-me-0123456789"

# A tenant whose buckets barely refill during a test, so the count of admitted requests
# is exact and the same in every layout.
TEST_OVERRIDES: dict[str, Any] = {
    "auth": {
        "api_keys": [
            {"id": "dev-key", "tenant": "dev", "key": DEV_KEY, "scopes": ["generate"], "max_priority": 1},
            {"id": "tight-key", "tenant": "tight", "key": TIGHT_KEY, "scopes": ["generate"], "max_priority": 0},
            {"id": "other-key", "tenant": "other", "key": OTHER_KEY, "scopes": ["generate"], "max_priority": 1},
            *({"id": f"split-{where}", "tenant": f"split-{where}", "key": key, "scopes": ["generate"]}
              for where, key in SPLIT_KEYS.items()),
        ],
    },
    "ratelimit": {
        "tenants": {"tight": {"requests_per_second": 0.001, "burst": 4, "tokens_per_minute": 60000,
                              "token_burst": 10000},
                    **{f"split-{where}": {"requests_per_second": 0.001, "burst": 20, "tokens_per_minute": 60000,
                                          "token_burst": 100000} for where in SPLIT_KEYS}},
    },
}


def pytest_configure(config: pytest.Config) -> None:
    """The runner hosts models itself: on the pages a serving process asks for."""
    from monolith.runtime_env import prefer_huge_pages

    prefer_huge_pages()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Take what collection made (every test module, torch, grpc, hypothesis) out of the
    cyclic collector's sight, as a serving process does before it says ready
    (`monolith.runtime_env.freeze_startup_heap`). Why: the runner hosts gateways itself
    (`start_stack`), and unfrozen, a full collection of its ~370k objects took 150–260 ms —
    as long as a step's 250 ms budget — so an in-process layered gateway's call to its remote
    auth now and then ran out of budget and answered UNAVAILABLE (test_fuzz_gateway)."""
    from monolith.runtime_env import freeze_startup_heap

    freeze_startup_heap()


@pytest.fixture(autouse=True)
def _runner_is_never_placed() -> Iterator[None]:
    """The test runner is a library user: no test may leave it set to move to one CPU when
    an in-process model starts (`services.inference.cpu_placement`). Every child the runner starts
    afterwards inherits its CPUs, so one such leak ran the rest of the suite, children
    included, on a single core. Fails the test that turned it on."""
    import services.inference.cpu_placement as cpu_placement

    cpus = os.sched_getaffinity(0)
    yield
    leaked = cpu_placement.enabled()
    cpu_placement.disable()
    moved = os.sched_getaffinity(0) != cpus
    if moved:
        cpu_placement.move_threads(cpus)
    if leaked or moved:
        pytest.fail("this test left the test runner placed on CPUs of its own (SPINE_CPU placement "
                    "enabled in-process, e.g. by spine.cli's `up` or configure_threads)")


def stop_process(pid: int, within_s: float = 5.0) -> None:
    """SIGSTOP our own child `pid` and return once the kernel reports it stopped (state T
    in /proc), so a test's next call is made to a process that can no longer answer: the
    stop is delivered to each of its threads when that thread next runs, not by `kill`."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + within_s
    while True:
        state = process_state(pid)
        if state in ("T", "t"):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} not stopped {within_s:g}s after SIGSTOP (state {state})")
        time.sleep(0.001)


def process_state(pid: int) -> str | None:
    """The state letter /proc shows for `pid` (R, S, T, Z, ...); None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]  # after the command name, which may hold spaces


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie, exited but not reaped, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return process_state(pid) not in (None, "Z")


def split_tenant_through(address: str, key: str, label: str, count: int = 60) -> tuple[int, dict[str, int]]:
    """`count` requests of one split tenant (`SPLIT_KEYS`) through a front, each its own
    session so both sides get some: how many were admitted in total, and how many each side
    served. Every answer must be OK or RESOURCE_EXHAUSTED — after retrying an UNAVAILABLE, as a
    client does: on a loaded CI host a remote rate limiter can miss its 250 ms budget, and the
    gateway then fails closed (a retry can only be charged again, never admit more)."""
    from spine.client.gateway_client import GatewayClient
    from wire.v1 import generation_pb2

    admitted, sides = 0, {"layered": 0, "spine": 0}
    with GatewayClient(address, key) as client:
        for i in range(count):
            request = generation_pb2.GenerateRequest(model="tiny-lm", prompt=f"{label} {i}", max_tokens=2)
            for _ in range(3):
                result = client.generate(request, headers={"x-session-id": f"{label}-{i}"})
                if result.code.name != "UNAVAILABLE":
                    break
            assert result.code.name in ("OK", "RESOURCE_EXHAUSTED"), result.details
            sides[result.trailing["x-spine-side"]] += 1
            admitted += result.ok
    return admitted, sides


def config_for_tests(**extra: Any) -> SpineConfig:
    """The config the tests share (`TEST_OVERRIDES`), with `extra` sections merged over it."""
    from runtime.config.file import merge

    return load_config(overrides=merge(TEST_OVERRIDES, extra))


def make_jwt(tenant: str = "dev", *, expires_in: float = 300, secret: str = JWT_SECRET, **claims: Any) -> str:
    now = int(time.time())
    payload = {"iss": "spine-dev", "aud": "spine", "sub": f"user-of-{tenant}", "tenant": tenant,
               "scope": "generate", "iat": now, "exp": now + int(expires_in), **claims}
    return jwt.encode(payload, secret, algorithm="HS256")


@pytest.fixture(scope="session")
def ec_key() -> Any:
    """A P-256 key for ES256 tokens (made once: key generation is slow)."""
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


@pytest.fixture(scope="session")
def rsa_key() -> Any:
    """An RSA key for RS256 tokens (made once)."""
    from cryptography.hazmat.primitives.asymmetric import rsa

    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def torch_one_thread() -> Iterator[None]:
    """Tiny ops run fastest on one thread; more only add contention on a shared 2-core box.
    Modules that time or batch the model use it (`pytestmark = usefixtures(...)`)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def served(component: str, servicer: Any) -> Iterator[Any]:
    """One servicer behind a real gRPC server on a unix socket (the project's own
    `start_server`, with health and reflection), and a stub to it."""
    from runtime.server import start_server
    from services.registry import DEFAULT

    sock_dir = tempfile.mkdtemp(prefix=f"spine-{component}-", dir="/tmp")  # unix paths max ~107 bytes
    spec = DEFAULT[component]
    server = start_server([(spec, servicer)], f"unix:{sock_dir}/{component}.sock")
    channel = grpc.insecure_channel(server.address)
    try:
        yield spec.stub_class()(channel)
    finally:
        channel.close()
        server.stop(0)
        shutil.rmtree(sock_dir, ignore_errors=True)


def start_stack(layout: str, tmp: Path, config: SpineConfig | None = None) -> RunningStack:
    config = config or config_for_tests()
    run_dir = tmp / layout
    stack = Stack(config, placements_for(layout, config), run_dir=run_dir).start()
    return stack


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningStack]]:
    """One stack per layout — layered, collapsed and a mixed one — for the module."""
    tmp = tmp_path_factory.mktemp("layouts")
    stacks: dict[str, RunningStack] = {}
    try:
        for layout in ("collapsed", "layered", "mixed"):
            stacks[layout] = start_stack(layout, tmp)
        yield stacks
    finally:
        for stack in stacks.values():
            stack.stop()


@pytest.fixture(scope="session")
def bare_http_upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real bare model server (`spine up --layout bare`, with an API key): the upstream of
    the HTTP stacks' upstream models, and the healthy upstream of the fault tests."""
    from tests.bare_server import bare_upstream

    with bare_upstream(tmp_path_factory.mktemp("bare-upstream")) as server:
        yield server


@pytest.fixture(scope="session")
def http_stacks(tmp_path_factory: pytest.TempPathFactory, bare_http_upstream: Any) -> Iterator[dict[str, RunningStack]]:
    """Both layouts with their HTTP API (`tests.http_helpers.http_config`), shared by the HTTP
    tests: starting a layered stack costs seconds, and they only read what it answers. Their
    router has two models served by `bare_http_upstream` (`tests.http_helpers.UPSTREAM_MODELS`)."""
    from tests.http_helpers import http_layouts

    with http_layouts(tmp_path_factory.mktemp("http"), bare_http_upstream) as running:
        yield running


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """vLLM serving the SmolLM2 directory `make model` writes, started once for the session
    (`tests.vllm_server`); the tests that need it skip, saying why, where it cannot run."""
    from tests.vllm_server import running_engine

    with running_engine(tmp_path_factory.mktemp("vllm")) as engine:
        yield engine


@pytest.fixture(scope="session")
def vllm_stacks(tmp_path_factory: pytest.TempPathFactory, vllm_engine: Any) -> Iterator[dict[str, RunningStack]]:
    """Both layouts with their HTTP API in front of `vllm_engine` (router model
    `tests.vllm_server.VLLM_MODEL`)."""
    from tests.vllm_server import spine_layouts

    with spine_layouts(vllm_engine, tmp_path_factory.mktemp("vllm-spine")) as stacks:
        yield stacks
