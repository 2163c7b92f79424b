"""A deploy/k8s overlay's Deployments as podman containers on one machine: one container per
Deployment, running the manifest's own command and args, with its ConfigMap's config.

What has to change for one machine, and nothing else:

- every `0.0.0.0:PORT` a container binds becomes `127.0.0.1:<a free port>` (all containers share
  the host's network: docs/deploy.md says why), and every Service address a config names
  (`dns:///spine-auth.spine.svc.cluster.local:50061`) becomes that port of that Deployment's
  container; metrics listen on an ephemeral loopback port, the HTTP API on a port of its own;
- the `tls:` section goes (cert-manager's certificates are a cluster's; deploy/README.md);
- a Secret's value becomes a fresh random one, `metadata.name` from the downward API the
  container's name; a ConfigMap volume is the rewritten config, read-only, an emptyDir a
  directory of the image's user, /tmp the tmpfs every container gets.

One replica per Deployment: replicas change how many, not what each one runs.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from runtime.config.file import merge
from runtime.server import free_ports
from spine.tools.containers import Mount, owned_by_image_user

CLUSTER_SUFFIX = ".spine.svc.cluster.local"


@dataclass
class ContainerSpec:
    """One Deployment's container, as podman runs it here."""

    deployment: str
    command: list[str]  # the manifest's command (the ENTRYPOINT it replaces) and args, rewritten
    mounts: list[Mount]
    env: dict[str, str]
    ports: dict[int, int]  # containerPort -> the loopback port it is on here
    config: dict[str, Any] = field(default_factory=dict)

    def local(self, container_port: int) -> str:
        return f"127.0.0.1:{self.ports[container_port]}"


def deployments(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o.get("kind") == "Deployment"]


def service_targets(objects: list[dict[str, Any]]) -> dict[tuple[str, int], tuple[str, int]]:
    """(Service DNS name, port) -> (the Deployment it selects, the containerPort it targets)."""
    found: dict[tuple[str, int], tuple[str, int]] = {}
    by_labels = {tuple(sorted(d["spec"]["selector"]["matchLabels"].items())): d for d in deployments(objects)}
    for service in (o for o in objects if o.get("kind") == "Service"):
        deployment = by_labels.get(tuple(sorted(service["spec"]["selector"].items())))
        if deployment is None:
            continue
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            found[(service["metadata"]["name"] + CLUSTER_SUFFIX, port["port"])] = (
                deployment["metadata"]["name"], named.get(target, target))
    return found


def bound_ports(container: dict[str, Any]) -> list[int]:
    """Every port the container binds: its declared ports and any `0.0.0.0:PORT` in its args."""
    ports = {int(p["containerPort"]) for p in container.get("ports", [])}
    for arg in map(str, container.get("args", [])):
        if arg.startswith("0.0.0.0:"):
            ports.add(int(arg.rsplit(":", 1)[1]))
    return sorted(ports)


def localize_address(address: str, services: Mapping[tuple[str, int], tuple[str, int]],
                     specs: Mapping[str, ContainerSpec]) -> str:
    """`dns:///NAME.spine.svc.cluster.local:PORT` -> `127.0.0.1:<that container's port>`."""
    host_port = address.removeprefix("dns:///")
    host, _, port = host_port.rpartition(":")
    deployment, container_port = services[(host, int(port))]
    return specs[deployment].local(container_port)


def localize_config(config: dict[str, Any], spec: ContainerSpec, services: Mapping[tuple[str, int], tuple[str, int]],
                    specs: Mapping[str, ContainerSpec]) -> dict[str, Any]:
    local = dict(config)
    local.pop("tls", None)
    if str(local.get("listen", "")).startswith("0.0.0.0:"):  # a component's own --listen wins over it
        port = int(str(local["listen"]).rsplit(":", 1)[1])
        if port not in spec.ports:
            spec.ports[port] = free_ports(1)[0]
        local["listen"] = spec.local(port)
    local["remote_addresses"] = {name: localize_address(address, services, specs)
                                 for name, address in (local.get("remote_addresses") or {}).items()}
    if "metrics" in local:
        local["metrics"] = {**local["metrics"], "http_listen": "127.0.0.1:0"}
    http = dict(local.get("http") or {})  # in a pod its own 127.0.0.1:8000; here one port each
    port = int(str(http.get("listen") or "127.0.0.1:8000").rsplit(":", 1)[1])
    if port not in spec.ports:
        spec.ports[port] = free_ports(1)[0]
    local["http"] = {**http, "listen": spec.local(port)}
    shadow = local.get("shadow") or {}
    if shadow.get("layered_address"):
        local["shadow"] = {**shadow, "layered_address": localize_address(shadow["layered_address"], services, specs)}
    return local


def containers_of(objects: list[dict[str, Any]], workdir: Path, base_config: Mapping[str, Any] | None = None,
                  secret_values: Mapping[str, str] | None = None) -> dict[str, ContainerSpec]:
    """Every Deployment of `objects` as a ContainerSpec, its files under `workdir`.

    `base_config` is laid under each ConfigMap's config (e.g. a test's tenants); the secrets'
    values are random unless given (`secret_values`: by Secret name)."""
    services = service_targets(objects)
    config_maps = {o["metadata"]["name"]: o for o in objects if o.get("kind") == "ConfigMap"}
    secret_values = dict(secret_values or {})
    specs: dict[str, ContainerSpec] = {}
    for deployment in deployments(objects):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        ports = bound_ports(container)
        specs[deployment["metadata"]["name"]] = ContainerSpec(
            deployment["metadata"]["name"], [], [], {}, dict(zip(ports, free_ports(len(ports)), strict=True)))
    for deployment in deployments(objects):
        name = deployment["metadata"]["name"]
        spec = specs[name]
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        home = workdir / name
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if mount["mountPath"] == "/tmp" or "secret" in volume:  # the tmpfs every container gets; TLS: above
                continue
            if "configMap" in volume:
                config_map = config_maps[volume["configMap"]["name"]]
                config = yaml.safe_load(config_map["data"]["config.yaml"])
                spec.config = localize_config(merge(dict(base_config or {}), config), spec, services, specs)
                (home / "config").mkdir(parents=True, exist_ok=True)
                (home / "config" / "config.yaml").write_text(yaml.safe_dump(spec.config))
                spec.mounts.append(Mount(home / "config", mount["mountPath"]))
            else:  # an emptyDir or a PersistentVolumeClaim: a directory of the image's user
                directory = home / mount["name"]
                owned_by_image_user(directory)
                spec.mounts.append(Mount(directory, mount["mountPath"], read_only=False))
        for variable in container.get("env", []):
            source = variable.get("valueFrom", {})
            if "secretKeyRef" in source:
                secret = source["secretKeyRef"]["name"]
                spec.env[variable["name"]] = secret_values.setdefault(secret, secrets.token_hex(24))
            elif source.get("fieldRef", {}).get("fieldPath") == "metadata.name":
                spec.env[variable["name"]] = name
            elif "value" in variable:
                spec.env[variable["name"]] = str(variable["value"])
        args = []
        for arg in map(str, container.get("args", [])):
            if arg.startswith("0.0.0.0:"):
                arg = spec.local(int(arg.rsplit(":", 1)[1]))
            for variable, value in spec.env.items():
                arg = arg.replace(f"$({variable})", value)
            args.append(arg)
        spec.command = [*map(str, container["command"]), *args]
    return specs


def start_order(specs: Mapping[str, ContainerSpec]) -> list[list[str]]:
    """The Deployments in two waves: the components, then what calls them (`spine up`). A
    gateway started with its components would find them down and back its channels off (gRPC's
    reconnect backoff); in a cluster their readiness gates the Services the same way."""
    components = [name for name, spec in specs.items() if spec.command[0] != "spine"]
    return [components, [name for name in specs if name not in components]]


def layered_host_ports(specs: Mapping[str, ContainerSpec]) -> dict[str, str]:
    """Where the layered gateway answers here: its Gateway API and its probe port."""
    gateway = specs["spine-gateway-layered"]
    return {"grpc": gateway.local(50051), "probe": gateway.local(50080)}
