"""deploy/ speaks TLS everywhere: every pod mounts a cert-manager certificate valid for the names
it is dialed by, every config and the controller use it, kubelet probes a plaintext health-only
port, and every Envoy bootstrap terminates TLS and talks mTLS to the layouts and the controller."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2

from migration.runner import parse_args as runner_args
from runtime.config.file import load_config
from runtime.process import build_parser as process_parser
from spine.cli import build_parser as cli_parser
from tests.integration.test_deploy_configs import ENVOY_FILES, by_kind, load_bootstrap

MOUNT = "/etc/spine-tls"


def command(deployment: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    argv = list(container["command"]) + [str(arg) for arg in container.get("args", [])]
    if argv[:3] == ["python", "-m", "runtime.process"]:
        return container, process_parser().parse_args(argv[3:])
    if argv[:3] == ["python", "-m", "migration.runner"]:
        return container, runner_args(argv[3:])
    return container, cli_parser().parse_args(argv[1:])


def certificate_of(deployment: dict[str, Any]) -> dict[str, Any]:
    """The cert-manager Certificate whose Secret the pod mounts at /etc/spine-tls."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == MOUNT]
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    secret = volume["secret"]["secretName"]
    (certificate,) = [c for c in by_kind("Certificate").values() if c["spec"]["secretName"] == secret]
    return certificate


def host(target: str) -> str:
    return target.removeprefix("dns:///").rsplit(":", 1)[0]


def deployment_behind(name: str) -> dict[str, Any]:
    """The Deployment a Service DNS name (NAME.spine.svc.cluster.local) selects."""
    service = by_kind("Service")[name.split(".")[0]]
    selector = service["spec"]["selector"].items()
    (deployment,) = [d for d in by_kind("Deployment").values()
                     if selector <= d["spec"]["template"]["metadata"]["labels"].items()]
    return deployment


def test_the_ca_and_every_certificate_come_from_cert_manager() -> None:
    issuers = by_kind("Issuer")
    assert issuers["spine-ca"]["spec"]["ca"]["secretName"] == by_kind("Certificate")["spine-ca"]["spec"]["secretName"]
    for name, certificate in by_kind("Certificate").items():
        assert certificate["spec"]["issuerRef"]["name"] in issuers, name
        if name != "spine-ca":
            assert certificate["spec"]["issuerRef"]["name"] == "spine-ca", name
            assert "client auth" in certificate["spec"]["usages"], name


@pytest.mark.parametrize("name", sorted(by_kind("Deployment")))
def test_every_pod_serves_tls_with_a_certificate_for_its_services_and_probes_a_plaintext_health_port(
        name: str) -> None:
    deployment = by_kind("Deployment")[name]
    container, args = command(deployment)
    certificate = certificate_of(deployment)
    assert certificate["spec"]["usages"] == ["server auth", "client auth"]
    for service, spec in by_kind("Service").items():
        if spec["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items():
            assert f"{service}.spine.svc.cluster.local" in certificate["spec"]["dnsNames"], (name, service)
    probe_port = {p["name"]: p["containerPort"] for p in container["ports"]}["grpc-probe"]
    assert args.probe_listen == f"0.0.0.0:{probe_port}"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        if probe in container:
            assert container[probe]["grpc"]["port"] == probe_port, (name, probe)


@pytest.mark.parametrize("config_map", ["spine-layered-config", "spine-collapsed-config"])
def test_every_config_has_tls_from_the_mounted_secret_with_client_certificates_required(config_map: str) -> None:
    config = load_config(overrides=yaml.safe_load(by_kind("ConfigMap")[config_map]["data"]["config.yaml"]))
    tls = config.tls
    assert tls is not None and tls.client_ca_file == f"{MOUNT}/ca.crt"
    assert (tls.cert_file, tls.key_file) == (f"{MOUNT}/tls.crt", f"{MOUNT}/tls.key")


def test_the_controller_serves_both_listeners_over_mtls() -> None:
    _, args = command(by_kind("Deployment")["spine-controller"])
    assert (args.tls_cert_file, args.tls_key_file, args.tls_client_ca_file) == (
        f"{MOUNT}/tls.crt", f"{MOUNT}/tls.key", f"{MOUNT}/ca.crt")


def test_every_name_a_pod_dials_is_in_the_certificate_of_the_pod_behind_it() -> None:
    """gRPC checks the server's certificate against the name it dials: each remote address,
    the shadow target, the controller the followers dial and the gateways the controller asks."""
    dialed: list[str] = []
    for config_map in ("spine-layered-config", "spine-collapsed-config"):
        config = yaml.safe_load(by_kind("ConfigMap")[config_map]["data"]["config.yaml"])
        dialed += [host(target) for target in config.get("remote_addresses", {}).values()]
        if config.get("shadow", {}).get("layered_address"):
            dialed.append(host(config["shadow"]["layered_address"]))
    _, spine = command(by_kind("Deployment")["spine"])
    _, controller = command(by_kind("Deployment")["spine-controller"])
    dialed += [host(spine.follow_controller), *(host(a) for a in controller.layered + controller.spine)]
    assert len(dialed) >= 10
    for name in dialed:
        assert name in certificate_of(deployment_behind(name))["spec"]["dnsNames"], name
    assert urlparse(controller.prometheus_url).scheme == "http"  # metrics stay plain HTTP, scraped in-cluster


@pytest.mark.parametrize("path", ENVOY_FILES, ids=lambda p: p.name)
def test_envoy_terminates_tls_and_talks_mtls_to_the_layouts_and_the_controller(path: Any) -> None:
    bootstrap = load_bootstrap(path)
    for listener in bootstrap.static_resources.listeners:
        for chain in listener.filter_chains:
            downstream = tls_pb2.DownstreamTlsContext()
            assert chain.transport_socket.typed_config.Unpack(downstream), listener.name
    ours = {"xds_controller", "layered", "spine", "spine_decisions"}
    clusters = [c for c in bootstrap.static_resources.clusters if c.name in ours]
    assert clusters
    for cluster in clusters:
        upstream = tls_pb2.UpstreamTlsContext()
        assert cluster.transport_socket.typed_config.Unpack(upstream), cluster.name
        common = upstream.common_tls_context
        (certificate,) = common.tls_certificates
        assert certificate.certificate_chain.filename and certificate.private_key.filename, cluster.name
        assert common.validation_context.trusted_ca.filename, cluster.name
        assert common.validation_context.match_typed_subject_alt_names, cluster.name
