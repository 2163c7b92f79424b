"""Every file under deploy/envoy and deploy/k8s parses strictly, so a broken config fails CI."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import envoy.extensions.access_loggers.stream.v3.stream_pb2  # noqa: F401  (Any types in the config)
import envoy.extensions.filters.http.basic_auth.v3.basic_auth_pb2  # noqa: F401  (Any types in the config)
import envoy.extensions.filters.http.ext_authz.v3.ext_authz_pb2  # noqa: F401  (Any types in the config)
import envoy.extensions.filters.http.header_mutation.v3.header_mutation_pb2  # noqa: F401  (Any types)
import envoy.extensions.filters.http.ratelimit.v3.rate_limit_pb2  # noqa: F401  (Any types in the config)
import envoy.extensions.filters.http.router.v3.router_pb2  # noqa: F401  (Any types in the config)
import envoy.extensions.transport_sockets.tls.v3.tls_pb2  # noqa: F401  (Any types in the config)
import pytest
import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.core.v3 import config_source_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from google.protobuf import json_format

from migration.xds import Endpoint, build_snapshot
from migration.xds.snapshot import CLUSTER, ROUTE
from runtime.config.yamlsource import load_located
from services.registry import COMPONENTS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ENVOY_FILES = sorted((DEPLOY / "envoy").glob("*.yaml"))
K8S_FILES = sorted((DEPLOY / "k8s").rglob("*.yaml"))
LAYERED_COMPONENTS = list(COMPONENTS)  # the manifests name every component of the table


def load_bootstrap(path: Path) -> bootstrap_pb2.Bootstrap:
    return json_format.ParseDict(
        yaml.safe_load(path.read_text()), bootstrap_pb2.Bootstrap(), ignore_unknown_fields=False
    )


def k8s_docs(path: Path) -> list[dict[str, Any]]:
    """Every document of a manifest, strictly: a repeated key (which Kubernetes refuses) fails."""
    docs = []
    for text in path.read_text().split("\n---\n"):
        located = load_located(text)  # raises naming the line of a duplicate key
        if located.data is not None:
            docs.append(located.data)
    return docs


def all_k8s_docs() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in K8S_FILES for d in k8s_docs(p) if d.get("kind") != "Kustomization"]


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _, d in all_k8s_docs() if d["kind"] == kind}


def test_there_are_configs_to_check() -> None:
    assert [p.name for p in ENVOY_FILES] == ["edge-decisions.yaml", "edge-tls.yaml", "front-proxy.yaml"]
    assert len(K8S_FILES) >= 10


@pytest.mark.parametrize("path", ENVOY_FILES, ids=lambda p: p.name)
def test_envoy_config_parses_strictly_as_a_bootstrap(path: Path) -> None:
    bootstrap = load_bootstrap(path)
    assert bootstrap.node.id


def test_unknown_envoy_field_is_rejected_by_the_strict_parse(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text((DEPLOY / "envoy" / "front-proxy.yaml").read_text().replace("stat_prefix:", "stats_prefix:"))
    with pytest.raises(json_format.ParseError, match="stats_prefix"):
        load_bootstrap(broken)


def test_envoy_gets_rds_and_eds_over_ads_from_an_http2_controller_cluster() -> None:
    bootstrap = load_bootstrap(DEPLOY / "envoy" / "front-proxy.yaml")
    ads = bootstrap.dynamic_resources.ads_config
    assert ads.api_type == ads.GRPC and ads.transport_api_version == config_source_pb2.V3
    controller = ads.grpc_services[0].envoy_grpc.cluster_name
    clusters = {c.name: c for c in bootstrap.static_resources.clusters}
    options = clusters[controller].typed_extension_protocol_options[
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    protocol = http_protocol_options_pb2.HttpProtocolOptions()
    assert options.Unpack(protocol) and protocol.explicit_http_config.HasField("http2_protocol_options")
    # Static clusters would clash with dynamic ones of the same name.
    assert not bootstrap.dynamic_resources.HasField("cds_config")
    assert not bootstrap.dynamic_resources.HasField("lds_config")


def test_envoy_listener_uses_the_router_filter_rds_over_ads_and_logs_to_stdout() -> None:
    bootstrap = load_bootstrap(DEPLOY / "envoy" / "front-proxy.yaml")
    listeners = {listener.name: listener for listener in bootstrap.static_resources.listeners}
    assert sorted(listeners) == ["grpc_ingress", "http_ingress"]  # the Gateway API, and the HTTP API
    listener = listeners["grpc_ingress"]
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    assert listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    assert hcm.http_filters[-1].typed_config.type_url.endswith("envoy.extensions.filters.http.router.v3.Router")
    assert hcm.rds.config_source.HasField("ads")
    assert hcm.rds.config_source.resource_api_version == config_source_pb2.V3
    assert [a.typed_config.type_url.rsplit(".", 1)[-1] for a in hcm.access_log] == ["StdoutAccessLog"]


@pytest.mark.parametrize("name", ["front-proxy.yaml", "edge-tls.yaml"])
def test_envoy_names_match_what_the_control_plane_serves(name: str) -> None:
    """The route and the EDS clusters Envoy asks for are the ones build_snapshot publishes."""
    bootstrap = load_bootstrap(DEPLOY / "envoy" / name)
    endpoints = {"layered": [Endpoint("127.0.0.1", 1)], "spine": [Endpoint("127.0.0.1", 2)]}
    if len(bootstrap.static_resources.listeners) > 1:  # the HTTP API's listener and clusters too
        endpoints.update({"layered-http": [Endpoint("127.0.0.1", 3)], "spine-http": [Endpoint("127.0.0.1", 4)]})
    snapshot = build_snapshot("spine-gateway", {"layered": 1, "spine": 1}, endpoints, "v1")
    for listener in bootstrap.static_resources.listeners:
        hcm = http_connection_manager_pb2.HttpConnectionManager()
        listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
        assert hcm.rds.route_config_name in snapshot.of_type(ROUTE)
    eds = {c.name: c for c in bootstrap.static_resources.clusters if c.type == c.EDS}
    assert sorted(eds) == sorted(snapshot.of_type(CLUSTER))
    for name, cluster in eds.items():
        assert cluster.eds_cluster_config.service_name == name
        assert cluster.eds_cluster_config.eds_config.HasField("ads")
        (check,) = cluster.health_checks
        assert check.HasField("http_health_check" if name.endswith("-http") else "grpc_health_check")


@pytest.mark.parametrize("path", K8S_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_k8s_manifest_has_the_required_keys(path: Path) -> None:
    docs = k8s_docs(path)
    assert docs, f"{path}: no documents"
    for doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), f"{path}: apiVersion/kind missing in {doc}"
        if doc["kind"] == "Kustomization":
            for resource in doc["resources"]:
                assert (path.parent / resource).exists(), f"{path}: resource {resource} does not exist"
            continue
        assert doc["metadata"].get("name"), f"{path}: metadata.name missing"
        if doc["kind"] not in ("Namespace", "ConfigMap"):
            assert doc.get("spec"), f"{path}: {doc['kind']} {doc['metadata']['name']} has no spec"
        if doc["kind"] == "Deployment":
            check_deployment(path, doc)
        if doc["kind"] == "Service":
            assert doc["spec"]["selector"] and doc["spec"]["ports"]
        if doc["kind"] == "ConfigMap":
            for key, text in doc["data"].items():
                assert isinstance(yaml.safe_load(text), dict), f"{path}: {key} is not a YAML mapping"


def check_deployment(path: Path, doc: dict[str, Any]) -> None:
    name = doc["metadata"]["name"]
    spec = doc["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items(), f"{name}: selector misses its pods"
    for container in spec["template"]["spec"]["containers"]:
        where = f"{path.name}: {name}/{container.get('name')}"
        assert container.get("image"), f"{where}: no image"
        ports = {p["containerPort"] for p in container.get("ports", [])}
        assert ports, f"{where}: no ports"
        for probe in ("readinessProbe", "livenessProbe"):
            grpc_probe = container.get(probe, {}).get("grpc")
            assert grpc_probe, f"{where}: {probe} must use the gRPC health check"
            assert grpc_probe["port"] in ports, f"{where}: {probe} port {grpc_probe['port']} not in {ports}"


def test_services_select_a_deployment_and_target_named_ports() -> None:
    deployments = list(by_kind("Deployment").values())
    for name, service in by_kind("Service").items():
        selector = service["spec"]["selector"].items()
        matches = [d for d in deployments if selector <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matches) == 1, f"Service {name} selects {len(matches)} Deployments"
        port_names = {p.get("name") for c in matches[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"Service {name}: targetPort {port['targetPort']} unknown"


def test_layered_layout_has_a_deployment_and_service_per_middleware_gateway_and_inference() -> None:
    deployments, services = by_kind("Deployment"), by_kind("Service")
    for component in LAYERED_COMPONENTS:
        assert f"spine-{component}" in deployments and f"spine-{component}" in services, component
    assert "spine-gateway-layered" in deployments and "spine-gateway-layered" in services


def test_collapsed_spine_requests_one_gpu() -> None:
    (container,) = by_kind("Deployment")["spine"]["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1


def test_controller_takes_its_admin_token_from_a_secret_and_serves_xds() -> None:
    controller = by_kind("Deployment")["spine-controller"]
    (container,) = controller["spec"]["template"]["spec"]["containers"]
    (token,) = [e for e in container["env"] if e["name"] == "SPINE_ADMIN_TOKEN"]
    assert "value" not in token and token["valueFrom"]["secretKeyRef"]["name"] == "spine-admin-token"
    assert not by_kind("Secret"), "the admin token must not be committed"
    ports = {p["name"] for p in by_kind("Service")["spine-controller"]["spec"]["ports"]}
    assert {"grpc-admin", "grpc-xds"} <= ports


def test_controller_replicas_share_postgres_and_only_the_leader_is_ready() -> None:
    """Two replicas are safe only with a shared store and the leader alone behind the Service."""
    controller = by_kind("Deployment")["spine-controller"]
    assert controller["spec"]["replicas"] >= 2
    (container,) = controller["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--db") + 1].startswith("postgresql://"), "sqlite cannot be shared"
    assert "--controller-id" in args and "--advertise" in args
    assert container["readinessProbe"]["grpc"]["service"] == "spine.v1.MigrationLeader"
    (password,) = [e for e in container["env"] if e["name"] == "PGPASSWORD"]
    assert "value" not in password and "secretKeyRef" in password["valueFrom"]


def test_the_spine_mirrors_to_the_layered_gateway_so_production_parity_gates_can_judge() -> None:
    """deploy/plans/production.yaml has parity gates: the spine must export comparisons."""
    assert "type: parity" in (DEPLOY / "plans" / "production.yaml").read_text()
    spine_config = yaml.safe_load(by_kind("ConfigMap")["spine-collapsed-config"]["data"]["config.yaml"])
    assert spine_config["shadow"]["share"] > 0 and spine_config["placements"]["metrics"] == "local"
    service = spine_config["shadow"]["layered_address"].removeprefix("dns:///").split(".")[0]
    assert service == "spine-gateway-layered" and service in by_kind("Service")
    layered_config = yaml.safe_load(by_kind("ConfigMap")["spine-layered-config"]["data"]["config.yaml"])
    for deployment, config in (("spine", spine_config), ("spine-gateway-layered", layered_config)):
        (container,) = by_kind("Deployment")[deployment]["spec"]["template"]["spec"]["containers"]
        env = config["internal"]["secret_env"]
        (secret,) = [e for e in container["env"] if e["name"] == env]
        assert secret["valueFrom"]["secretKeyRef"]["name"] == "spine-internal-secret", deployment


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("layout", ["layered", "collapsed", "controller"])
def test_kustomize_builds_each_layout(layout: str) -> None:
    result = subprocess.run(
        ["kubectl", "kustomize", str(DEPLOY / "k8s" / layout)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(result.stdout) if d]
    assert "Namespace" in kinds and "Deployment" in kinds
