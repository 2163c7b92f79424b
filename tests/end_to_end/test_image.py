"""spine's image, built as `make image` builds it, run by a real container runtime (podman + runc).

- the collapsed spine in a container answers the official `openai` SDK and a gRPC call, and the
  image's own HEALTHCHECK (grpc.health.v1 on the probe port) says healthy;
- it runs as the production securityContext asks: the image's non-root user, a read-only root
  file system (only the mounted run directory and /tmp written), no capabilities, no privilege
  escalation; the image holds no compiler, no pip and no cache;
- the layered layout as one container per Deployment of deploy/k8s/layered, each running its
  manifest's command with its ConfigMap's config (`spine.tools.rehearsal.k8s_containers`), answers the
  same requests as the collapsed container with the same verdicts;
- SIGTERM to the container drains: a stream in flight is finished and the spine exits 0 well
  within its grace period (the last test here: it stops the collapsed container).

One image build per test session (tests/image_helpers.py); each container is started once per
module and removed by name at its end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from runtime.processes.launch import Launched
from runtime.server import free_ports
from spine.client.gateway_client import GatewayClient
from spine.tools.containers import Mount, Podman, owned_by_image_user, unique_prefix
from spine.tools.image import version
from spine.tools.rehearsal.k8s_containers import containers_of, layered_host_ports, start_order
from spine.tools.rehearsal.kustomize import render
from tests.conftest import DEV_KEY, config_for_tests
from tests.image_helpers import (
    built_image,
    image_config,
    logs_of,
    skip_without_podman,
    start_detached,
    start_foreground,
    wait_serving_at,
)
from tests.integration.test_layouts import LONG_PROMPT, gen, parity_sequence
from tests.waiting import eventually
from wire.v1 import generation_pb2

pytestmark = skip_without_podman()

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
GRACE_S = 30.0  # the containers' --stop-timeout, as terminationGracePeriodSeconds


class Collapsed:
    """The collapsed spine in its container: addresses, its run directory, its podman process."""

    def __init__(self, podman: Podman, launched: Launched, ports: dict[str, int], run_dir: Path,
                 ready: dict[str, Any]) -> None:
        self.podman, self.launched, self.run_dir, self.ready = podman, launched, run_dir, ready
        self.grpc = f"127.0.0.1:{ports['grpc']}"
        self.http = f"127.0.0.1:{ports['http']}"
        self.probe = f"127.0.0.1:{ports['probe']}"


@pytest.fixture(scope="module")
def image() -> str:
    image_id, _ = built_image()
    return image_id


@pytest.fixture(scope="module")
def collapsed(image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Collapsed]:
    work = tmp_path_factory.mktemp("image-collapsed")
    podman = Podman(image, unique_prefix("test-image"))
    config_dir, run_dir = work / "config", work / "run"
    config_dir.mkdir()
    (config_dir / "config.yaml").write_text(config_for_tests().to_yaml())
    owned_by_image_user(run_dir)
    grpc_port, http_port, probe_port = free_ports(3)
    args = ["--config", "/etc/spine/config.yaml", "up", "--layout", "collapsed", "--listen", f"127.0.0.1:{grpc_port}",
            "--http-listen", f"127.0.0.1:{http_port}", "--probe-listen", f"127.0.0.1:{probe_port}",
            "--run-dir", "/var/run/spine"]
    launched = start_foreground(podman, "collapsed", args, work, mounts=[
        Mount(config_dir, "/etc/spine"), Mount(run_dir, "/var/run/spine", read_only=False)],
        env={"SPINE_PROBE_ADDRESS": f"127.0.0.1:{probe_port}"}, remove=False)
    try:
        ready = launched.wait_ready(120)
        yield Collapsed(podman, launched, {"grpc": grpc_port, "http": http_port, "probe": probe_port}, run_dir, ready)
    finally:
        launched.stop(5)
        podman.remove_all()


@pytest.fixture(scope="module")
def layered(image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """deploy/k8s/layered, one container per Deployment, ready; its gateway's addresses."""
    work = tmp_path_factory.mktemp("image-layered")
    podman = Podman(image, unique_prefix("test-layered"))
    specs = containers_of(render(K8S / "layered"), work, base_config=config_for_tests().written())
    try:
        for wave in start_order(specs):
            for name in wave:
                start_detached(podman, name, specs[name].command, mounts=specs[name].mounts, env=specs[name].env)
            wait_serving_at({name: specs[name].local(50080) for name in wave}, podman, timeout_s=180)
        yield {**layered_host_ports(specs), "logs": lambda: "\n".join(
            f"--- {name} ---\n{logs_of(podman, name, 1200)}" for name in specs)}
    finally:
        podman.remove_all()


def test_the_collapsed_container_answers_the_openai_sdk_and_a_grpc_call(collapsed: Collapsed) -> None:
    assert collapsed.ready["layout"] == "collapsed" and collapsed.ready["pid"] == 1  # spine is the container's init
    chat = openai.OpenAI(base_url=f"http://{collapsed.http}/v1", api_key=DEV_KEY, max_retries=0, timeout=60)
    raw = chat.chat.completions.with_raw_response.create(
        model="default", max_tokens=8, temperature=0, messages=[{"role": "user", "content": "Hello from a container"}])
    completion = raw.parse()
    assert raw.headers["x-spine-layout"] == "collapsed"
    assert completion.choices[0].message.content and completion.usage is not None
    assert completion.usage.completion_tokens > 0
    with GatewayClient(collapsed.grpc, DEV_KEY) as client:
        result = client.generate(gen("hello over grpc from a container"))
        denied = client.generate(gen("hello over grpc from a container"), token="not-a-key")
    assert result.ok and result.layout == "collapsed" and result.token_ids
    assert denied.code == grpc.StatusCode.UNAUTHENTICATED


def test_the_images_healthcheck_asks_grpc_health_on_the_probe_port(collapsed: Collapsed, image: str) -> None:
    healthcheck = image_config(image)["Healthcheck"]
    assert healthcheck["Test"] == ["CMD", "python", "-m", "spine.tools.healthcheck"]
    result = collapsed.podman.command("healthcheck", "run", collapsed.podman.name("collapsed"), check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    # It is the probe port that answers: asked elsewhere, the same command fails.
    elsewhere = collapsed.podman.command("exec", collapsed.podman.name("collapsed"), "python", "-m",
                                         "spine.tools.healthcheck", f"127.0.0.1:{free_ports(1)[0]}", check=False)
    assert elsewhere.returncode == 1 and "no answer" in elsewhere.stdout


def test_the_image_is_described_as_make_image_says(image: str) -> None:
    config = image_config(image)
    _, record = built_image()
    assert config["Config"]["Entrypoint"] == ["spine"]
    assert config["Config"]["User"] == "10001:10001"
    labels = config["Config"]["Labels"]
    assert labels["org.opencontainers.image.version"] == version()
    assert labels["org.opencontainers.image.revision"] == record.revision
    assert {"50051/tcp", "8000/tcp", "50080/tcp", "9090/tcp"} <= set(config["Config"]["ExposedPorts"])
    assert record.tags == [f"spine:{version()}", f"spine:{version()}-{record.revision[:12]}"]
    assert record.size_bytes > 0 and record.seconds > 0


def test_the_container_runs_non_root_on_a_read_only_root(collapsed: Collapsed) -> None:
    name = collapsed.podman.name("collapsed")
    status = collapsed.podman.command("exec", name, "cat", "/proc/1/status").stdout
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["Uid"].split()[:2] == ["10001", "10001"]
    assert int(fields["CapEff"], 16) == 0 and fields["NoNewPrivs"].strip() == "1"
    assert collapsed.podman.inspect("collapsed", "{{.HostConfig.ReadonlyRootfs}}") == "true"
    refused = collapsed.podman.command("exec", name, "sh", "-c", "echo x > /opt/spine/written", check=False)
    assert refused.returncode != 0 and "Read-only file system" in refused.stderr
    # The mounted run directory is where it writes: its request log is there, the user's own.
    log = collapsed.run_dir / "requests.jsonl"
    eventually(lambda: log.exists() and log.stat().st_size, 10, "the request log written", interval=0.1)
    assert log.stat().st_uid == 10001 and log.stat().st_size > 0


def test_the_image_holds_no_compiler_no_pip_and_no_cache(collapsed: Collapsed) -> None:
    found = collapsed.podman.command("exec", collapsed.podman.name("collapsed"), "sh", "-c",
                                     "for tool in gcc cc c++ g++ clang ld make apt-get pip pip3; do "
                                     "command -v $tool; done; python -c 'import pip' 2>/dev/null && echo pip; "
                                     "find / -xdev \\( -path /proc -o -path /sys \\) -prune -o \\( -name '*.whl' "
                                     "-o -path '*/.cache/pip' -o -path '/var/lib/apt/*' -o -path '/var/cache/apt/*' \\) -print",
                                     check=False)
    assert found.stdout.strip() == "", found.stdout


def _wait_answering(name: str, address: str, logs: Any) -> None:
    """Until `address` answers a request (else fail with its last answer and the containers' logs)."""
    last: list[Any] = []
    with GatewayClient(address, DEV_KEY) as client:
        def answers() -> bool:
            last[:] = [client.generate(gen("are you all up"))]
            return bool(last[0].ok)

        eventually(answers, timeout=30, what=f"{name} answering", interval=0.2,
                   seen=lambda: (last[-1].decision() if last else None, logs()))


def test_the_layered_containers_answer_as_the_collapsed_one_with_the_same_verdicts(
        collapsed: Collapsed, layered: dict[str, Any]) -> None:
    decisions = {}
    for name, address in (("collapsed", collapsed.grpc), ("layered", layered["grpc"])):
        # Every part reachable first: a health probe that timed out on a loaded host marks its
        # part down until the next probe (fail-closed, by design).
        _wait_answering(name, address, layered["logs"] if name == "layered" else (lambda: ""))
        with GatewayClient(address) as client:
            results = [client.generate(request, token=token or "") for request, token in parity_sequence()]
        assert {r.layout for r in results if r.trailing.get("x-spine-layout")} == {name}
        decisions[name] = [r.decision() for r in results]
    assert decisions["layered"] == decisions["collapsed"]
    codes = [d[0] for d in decisions["collapsed"]]  # and the sequence exercised every kind of verdict
    assert {"OK", "UNAUTHENTICATED", "NOT_FOUND", "INVALID_ARGUMENT", "PERMISSION_DENIED",
            "RESOURCE_EXHAUSTED"} <= set(codes), codes


def test_sigterm_to_the_container_drains_and_exits_0_within_its_grace(collapsed: Collapsed) -> None:
    """Last: it stops the module's collapsed container."""
    chunks: list[generation_pb2.GenerateResponse] = []
    outcome: dict[str, Any] = {}

    def stream() -> None:
        with GatewayClient(collapsed.grpc, DEV_KEY) as client:
            call = client.stub.GenerateStream(gen(LONG_PROMPT + " in a container", max_tokens=200), timeout=60,
                                              metadata=client.metadata())
            try:
                for chunk in call:
                    chunks.append(chunk)
                outcome["code"] = grpc.StatusCode.OK
            except grpc.RpcError as error:
                outcome["code"] = error.code()

    reader = threading.Thread(target=stream)
    reader.start()
    eventually(lambda: chunks, 30, "a stream under way", interval=0.02)
    began = time.monotonic()
    collapsed.podman.command("kill", "--signal", "TERM", collapsed.podman.name("collapsed"))
    exit_code = collapsed.podman.command("wait", collapsed.podman.name("collapsed"), timeout_s=GRACE_S + 30).stdout
    took = time.monotonic() - began
    reader.join(30)
    assert outcome.get("code") == grpc.StatusCode.OK, (outcome, logs_of(collapsed.podman, "collapsed"))
    assert int(exit_code.strip()) == 0, logs_of(collapsed.podman, "collapsed")
    assert took < GRACE_S, f"took {took:.1f}s"
    assert "stopping: finishing in-flight requests" in logs_of(collapsed.podman, "collapsed", 20000)
