"""Every object deploy/k8s renders, checked against the Kubernetes API's schema and for what a
production rollout needs.

Each overlay is rendered as kustomize renders it (`spine.tools.rehearsal.kustomize`; compared with
`kubectl kustomize` where kubectl is installed) and every object validated, strictly (an
unknown field is an error), against the OpenAPI schema of Kubernetes KUBERNETES_VERSION shipped
by `kubernetes-validate`. cert-manager's objects (Certificate, Issuer) are custom resources the
core schema cannot know; they are the only kinds let through unvalidated.

Then what the schema cannot say: each container is probed on the port its command serves
health on, asks for resources, runs as the image's non-root user on a read-only root with a
writable /tmp, no privilege escalation and no capabilities; every Deployment of more than one
replica has a PodDisruptionBudget (but the controller's, whose follower is never Ready) and
spreads its replicas over nodes; the controller's replicas share their state in PostgreSQL and
elect a leader, the only one Ready; every image is one `make image` builds.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError, ValidationError, validate

from migration.leadership import LeaseSettings
from migration.runner import parse_args as runner_args
from migration.runner import store_of
from migration.server import LEADER_HEALTH
from migration.store_backends import carries_password, is_postgres
from spine.cli import build_parser as cli_parser
from spine.tools.image import tags
from spine.tools.image_inputs import VARIANTS
from spine.tools.rehearsal.kustomize import KustomizeError, render

KUBERNETES_VERSION = "1.33"
K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = ["layered", "collapsed", "controller"]
CUSTOM_RESOURCE_GROUPS = ("cert-manager.io/",)
IMAGE_USER = 10001  # deploy/image/Containerfile's USER


@functools.cache
def rendered(overlay: str) -> list[dict[str, Any]]:
    """The overlay's objects (rendered once; the tests only read them)."""
    return render(K8S / overlay)


def objects() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{overlay}:{o['kind']}/{o['metadata']['name']}", o) for overlay in OVERLAYS for o in rendered(overlay)]


def deployments() -> list[tuple[str, dict[str, Any]]]:
    return [(where, o) for where, o in objects() if o["kind"] == "Deployment"]


def parse_quantity(quantity: str | int) -> float:
    """A Kubernetes quantity (`512Mi`, `8Gi`, `500m`, `2`) as a number."""
    text = str(quantity)
    for suffix, factor in (("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30), ("Ti", 2**40), ("k", 1e3), ("M", 1e6),
                           ("G", 1e9), ("T", 1e12), ("m", 1e-3)):
        if text.endswith(suffix):
            return float(text[:-len(suffix)]) * factor
    return float(text)


def argv(container: dict[str, Any]) -> list[str]:
    return [*map(str, container["command"]), *map(str, container.get("args", []))]


def flag(container: dict[str, Any], name: str) -> str | None:
    words = argv(container)
    return words[words.index(name) + 1] if name in words else None


@pytest.mark.parametrize(("where", "obj"), objects(), ids=[where for where, _ in objects()])
def test_every_object_validates_strictly_against_the_kubernetes_schema(where: str, obj: dict[str, Any]) -> None:
    try:
        validate(obj, KUBERNETES_VERSION, strict=True)
    except SchemaNotFoundError:
        assert obj["apiVersion"].startswith(CUSTOM_RESOURCE_GROUPS), f"{where}: no schema for {obj['apiVersion']}"
    except ValidationError as error:
        pytest.fail(f"{where}: {error}")


def test_the_schema_check_rejects_an_unknown_field_and_a_wrong_type() -> None:
    """The check can fail: a typo'd field and a string where an integer goes are both refused."""
    (deployment,) = [o for o in rendered("controller") if o["kind"] == "Deployment"]
    typo = yaml.safe_load(yaml.safe_dump(deployment))
    typo["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 50080}}
    with pytest.raises(ValidationError):
        validate(typo, KUBERNETES_VERSION, strict=True)
    wrong = yaml.safe_load(yaml.safe_dump(deployment))
    wrong["spec"]["replicas"] = "one"
    with pytest.raises(ValidationError):
        validate(wrong, KUBERNETES_VERSION, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed: the renderer alone is used")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_python_renderer_matches_kubectl_kustomize(overlay: str) -> None:
    result = subprocess.run(["kubectl", "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    by_key = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(result.stdout) if o}
    ours = {(o["kind"], o["metadata"]["name"]): o for o in rendered(overlay)}
    assert ours == by_key


def test_the_renderer_refuses_what_it_does_not_render(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nimages: [{name: spine, newTag: x}]\n")
    with pytest.raises(KustomizeError, match="images"):
        render(tmp_path)


@pytest.mark.parametrize(("where", "deployment"), deployments(), ids=[w for w, _ in deployments()])
def test_probes_ask_the_plaintext_health_port_the_command_serves(where: str, deployment: dict[str, Any]) -> None:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    probe_listen = flag(container, "--probe-listen")
    assert probe_listen, f"{where}: no --probe-listen (kubelet's grpc probes cannot speak TLS)"
    port = int(probe_listen.rsplit(":", 1)[1])
    assert port in {p["containerPort"] for p in container["ports"]}, f"{where}: probe port not declared"
    for kind in ("readinessProbe", "livenessProbe"):
        assert container[kind]["grpc"]["port"] == port, f"{where}: {kind}"
    if container["command"] == ["spine"] and flag(container, "--layout") == "collapsed":  # loads a model
        assert container["startupProbe"]["grpc"]["port"] == port


@pytest.mark.parametrize(("where", "deployment"), deployments(), ids=[w for w, _ in deployments()])
def test_every_container_asks_for_cpu_and_memory_and_caps_memory(where: str, deployment: dict[str, Any]) -> None:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    requests, limits = container["resources"]["requests"], container["resources"]["limits"]
    assert {"cpu", "memory"} <= set(requests), where
    assert parse_quantity(limits["memory"]) >= parse_quantity(requests["memory"]), where


@pytest.mark.parametrize(("where", "deployment"), deployments(), ids=[w for w, _ in deployments()])
def test_every_pod_runs_non_root_read_only_without_privileges(where: str, deployment: dict[str, Any]) -> None:
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == IMAGE_USER
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
    context = container["securityContext"]
    assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False, where
    assert context["capabilities"]["drop"] == ["ALL"] and not context["capabilities"].get("add"), where
    # A read-only root needs its writable directories mounted: /tmp (HOME in the image), and
    # the run directory its command writes sockets, logs and state to.
    writable = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert "/tmp" in writable, f"{where}: no writable /tmp"
    for name in ("--run-dir", "--db"):
        path = flag(container, name)
        if path and not is_postgres(path):  # a sqlite file, not a server
            directory = path if name == "--run-dir" else str(Path(path).parent)
            assert directory in writable, f"{where}: {name} {path} is not on a writable mount"


@pytest.mark.parametrize(("where", "deployment"), deployments(), ids=[w for w, _ in deployments()])
def test_replicated_deployments_have_a_disruption_budget_and_spread_over_nodes(
        where: str, deployment: dict[str, Any]) -> None:
    overlay = where.split(":", 1)[0]
    labels = deployment["spec"]["selector"]["matchLabels"]
    budgets = [o for o in rendered(overlay) if o["kind"] == "PodDisruptionBudget"
               and o["spec"]["selector"]["matchLabels"] == labels]
    spread = deployment["spec"]["template"]["spec"].get("topologySpreadConstraints", [])
    if deployment["spec"]["replicas"] < 2 or leader_ready(deployment):
        # one replica, or only the leader Ready (the follower counts as unavailable): a budget
        # would only block node drains
        assert not budgets, where
        if deployment["spec"]["replicas"] < 2:
            return
    else:
        (budget,) = budgets
        assert budget["spec"].get("maxUnavailable") == 1 or budget["spec"].get("minAvailable") == 1, where
    by_node = [c for c in spread if c["topologyKey"] == "kubernetes.io/hostname"]
    assert by_node and by_node[0]["labelSelector"]["matchLabels"] == labels and by_node[0]["maxSkew"] == 1, where


def leader_ready(deployment: dict[str, Any]) -> bool:
    """Whether its pods are Ready only while they lead (the readiness probe asks for the leader's
    health service): the Service then sends everything to the leader."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container.get("readinessProbe", {}).get("grpc", {}).get("service") == LEADER_HEALTH


def test_the_controller_replicas_share_their_state_in_postgres_and_only_the_leader_is_ready() -> None:
    objs = rendered("controller")
    (deployment,) = [o for o in objs if o["kind"] == "Deployment"]
    assert not [o for o in objs if o["kind"] == "PersistentVolumeClaim"]  # no disk of its own
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert deployment["spec"]["replicas"] == 2 and leader_ready(deployment)
    args = runner_args(argv(container)[3:])
    assert is_postgres(args.db) and not carries_password(args.db)  # the password from a Secret, not argv
    env = {e["name"]: e for e in container["env"]}
    assert env["PGPASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "spine-controller-db"
    assert args.controller_id == "$(POD_NAME)" and env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert store_of(args)[1] == LeaseSettings()  # Kubernetes' timings: 15 s / 10 s / 2 s


def test_every_image_is_one_make_image_builds() -> None:
    built = {tags(variant, "0" * 40)[0] for variant in VARIANTS.values()}
    for where, deployment in deployments():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["image"] in built, f"{where}: {container['image']} is not one of {sorted(built)}"
        assert container["imagePullPolicy"] == "IfNotPresent", where
        wants_gpu = "nvidia.com/gpu" in container["resources"].get("limits", {})
        assert container["image"].endswith("-cuda") == wants_gpu, where
    spine = next(d for w, d in deployments() if d["metadata"]["name"] == "spine")
    (container,) = spine["spec"]["template"]["spec"]["containers"]
    assert cli_parser().parse_args(argv(container)[1:]).command == "up"
