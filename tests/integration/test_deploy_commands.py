"""Every Kubernetes container runs a command spine really has, with a config spine really loads.

The manifests are checked for shape elsewhere (test_deploy_configs); here each container's
command line goes through the project's own argument parsers, and each ConfigMap's
config through the project's own loaders — so a renamed flag or config key breaks CI
instead of a rollout.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from migration.runner import parse_args as runner_args
from runtime.config.file import load_config, remote_addresses
from runtime.process import build_parser as process_parser
from services.registry import COMPONENTS
from spine.cli import build_parser as cli_parser

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def documents() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                yield path, document


def containers() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path, document in documents():
        if document.get("kind") != "Deployment":
            continue
        for container in document["spec"]["template"]["spec"]["containers"]:
            found.append((f"{path.relative_to(K8S)}:{container['name']}", container))
    return found


def configs() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path, document in documents():
        if document.get("kind") == "ConfigMap" and "config.yaml" in document.get("data", {}):
            found.append((str(path.relative_to(K8S)), yaml.safe_load(document["data"]["config.yaml"])))
    return found


@pytest.mark.parametrize(("where", "container"), containers(), ids=[name for name, _ in containers()])
def test_container_command_parses_with_the_real_cli(where: str, container: dict[str, Any]) -> None:
    command = list(container["command"]) + [str(arg) for arg in container.get("args", [])]
    if command[:3] == ["python", "-m", "runtime.process"]:
        args = process_parser().parse_args(command[3:])
        assert args.component in COMPONENTS
        if not args.listen.startswith(("127.", "unix:", "localhost")):
            assert args.allow_external, f"{where}: a pod address needs --allow-external"
    elif command[:3] == ["python", "-m", "migration.runner"]:
        args = runner_args(command[3:])
        if args.target == "xds":
            assert args.xds_listen and args.layered and args.spine
            assert args.prometheus_url or (args.layered_metrics and args.spine_metrics), f"{where}: no metrics source"
        if not args.listen.startswith(("127.", "unix:", "localhost")):
            assert args.allow_external, f"{where}: a pod address needs --allow-external"
    elif command[0] == "spine":
        args = cli_parser().parse_args(command[1:])
        assert args.command == "up"
        if args.listen and not args.listen.startswith("127."):
            assert args.allow_external, f"{where}: a pod address needs --allow-external"
    else:
        pytest.fail(f"{where}: unknown command {command}")


@pytest.mark.parametrize(("where", "config"), configs(), ids=[name for name, _ in configs()])
def test_configmap_config_loads_and_every_section_parses(where: str, config: dict[str, Any]) -> None:

    merged = load_config(overrides=config)
    remote_addresses(merged)
    if not str(merged.metrics.http_listen).startswith("127."):
        assert merged.metrics.allow_external, f"{where}: metrics on a pod address needs allow_external"


def test_spine_replicas_and_layered_rate_limiters_follow_the_controllers_xds_port() -> None:
    """Each stage's placements and rate-limit shares reach every pod that holds them, at the
    port the controller serves xDS on, under the pod's own name; and the controller waits for
    as many spine replicas as the spine Deployment runs."""
    deployments = {document["metadata"]["name"]: document for _, document in documents()
                   if document.get("kind") == "Deployment"}

    def command(name: str) -> list[str]:
        (container,) = deployments[name]["spec"]["template"]["spec"]["containers"]
        return list(container["command"]) + [str(arg) for arg in container.get("args", [])]

    controller = runner_args(command("spine-controller")[3:])
    port = controller.xds_listen.rsplit(":", 1)[1]
    spine = cli_parser().parse_args(command("spine")[1:])
    ratelimit = process_parser().parse_args(command("spine-ratelimit")[3:])
    for args in (spine, ratelimit):
        assert args.follow_controller == f"spine-controller.spine.svc.cluster.local:{port}"
        assert args.node_id == "$(POD_NAME)"  # the pod's name, from the downward API
    assert controller.min_spine_replicas == deployments["spine"]["spec"]["replicas"]
