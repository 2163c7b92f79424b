"""Config: a placement naming a foreign endpoint and its protocol, and the `envoy_api` section.

Every problem names its file, line and path, one line each, before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config.file import load_config, placements_for
from tests.integration.test_config_model import problems, write

LEGACY = """placements:
  auth: {remote: "authz.legacy:9001", protocol: envoy-ext-authz, tenant_header: x-org-id}
  ratelimit: {remote: "ratelimit.legacy:8081", protocol: envoy-rls, domain: edge}
"""


def test_a_foreign_placement_is_remote_at_that_endpoint_in_its_protocol(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, LEGACY))
    assert placements_for("mixed", config)["auth"] == placements_for("mixed", config)["ratelimit"] == "remote"
    endpoints = config.placements.foreign()
    assert {name: (e.remote, e.protocol) for name, e in endpoints.items()} == {
        "auth": ("authz.legacy:9001", "envoy-ext-authz"), "ratelimit": ("ratelimit.legacy:8081", "envoy-rls")}
    assert endpoints["auth"].options() == {"remote": "authz.legacy:9001", "protocol": "envoy-ext-authz",
                                           "tenant_header": "x-org-id"}
    assert endpoints["ratelimit"].options()["domain"] == "edge"


def test_plain_placements_name_no_foreign_endpoint() -> None:
    assert load_config().placements.foreign() == {}


@pytest.mark.parametrize(("text", "expected"), [
    ("placements:\n  ratelimit: {remote: 'x:1', protocol: envoy-ext-authz}\n",
     "2: placements.ratelimit.protocol: expected one of envoy-rls, got 'envoy-ext-authz'"),
    ("placements:\n  auth:\n    remote: 'x:1'\n", "2: placements.auth.protocol: required"),
    ("placements:\n  auth:\n    protocol: envoy-ext-authz\n", "2: placements.auth.remote: required"),
    ("placements:\n  auth:\n    remote: 'x:1'\n    protocol: envoy-ext-authz\n    domain: edge\n",
     "5: placements.auth.domain: only for protocol envoy-rls, not envoy-ext-authz"),
    ("placements:\n  ratelimit:\n    remote: 'x:1'\n    protocol: envoy-rls\n    tenant_header: x-t\n",
     "5: placements.ratelimit.tenant_header: only for protocol envoy-ext-authz, not envoy-rls"),
    ("placements:\n  auth:\n    remote: 'x:1'\n    protocol: envoy-ext-authz\n    tenant-header: x\n",
     "5: placements.auth.tenant-header: unknown key; known: remote, protocol, tenant_header, domain"),
    ("placements:\n  auth: nearby\n",
     "2: placements.auth: expected local, remote or {remote: HOST:PORT, protocol: envoy-ext-authz}, got 'nearby'"),
    ("placements:\n  router: {remote: 'x:1', protocol: envoy-rls}\n",
     "2: placements.router: Input should be 'local' or 'remote', got dict"),
    ("envoy_api:\n  listen: nowhere\n", "2: envoy_api.listen:"),
    ("envoy_api:\n  enabled: 1\n", "2: envoy_api.enabled:"),
], ids=["protocol-of-another-component", "no-protocol", "no-remote", "rls-option-on-authz",
        "authz-option-on-rls", "misspelled-option", "unknown-placement", "component-without-a-protocol",
        "bad-listen", "enabled-not-a-bool"])
def test_a_bad_foreign_placement_is_one_line_naming_file_line_and_path(
        tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    [line] = problems(path)
    assert line.startswith(f"{path}:{expected}"), line
