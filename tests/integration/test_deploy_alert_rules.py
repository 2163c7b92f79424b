"""deploy/prometheus's rules and deploy/grafana's dashboard: tested by promtool, and naming
only families the project exports (or records), so a renamed metric fails here, not on call."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from migration.dashboard.metrics import ControllerCollector
from migration.gates import WindowStats
from migration.notify import RESULTS
from migration.testing import make_controller, run_windows, three_stages
from services.inference.gpu_metrics import FIELDS
from services.inference.serving_metrics import HISTOGRAMS
from services.metrics.service import FAMILIES

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "spine-rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "spine-rules.test.yml"
GRAFANA = DEPLOY / "grafana" / "spine-migration.json"
NAME = re.compile(r"\b(spine_[a-z0-9_]+|layout:[a-z0-9_:]+|DCGM_[A-Z0-9_]+)")
# The model server's gauges (services/inference/serving_metrics.py builds them by name).
INFERENCE_GAUGES = {"spine_kv_slots", "spine_kv_blocks", "spine_queue_depth", "spine_device_bytes",
                    "spine_device_budget_bytes", "spine_prefix_cache_lookups_total"}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not on PATH: `make test` installs it with Prometheus (Debian package "
                    "`prometheus`, via .ci/install-prometheus)")
    return path


def controller_families(tmp_path: Path) -> set[str]:
    """The spine_migration_* sample names a controller exports, every family present."""
    controller, target, clock = make_controller(str(tmp_path / "m.db"))
    controller.start(three_stages(), "test")
    target.spine = WindowStats(requests=0, errors=0, p99_ms=None)  # an inconclusive window
    run_windows(controller, clock, 1)
    collector = ControllerCollector(controller, lambda: {"https://hooks.example": dict.fromkeys(RESULTS, 0)})
    families = list(collector.collect())
    names = {family.name for family in families if family.type == "gauge"}  # present even without samples
    names |= {sample.name for family in families for sample in family.samples}
    controller.close()
    return names


def exported(tmp_path: Path) -> set[str]:
    names = set(controller_families(tmp_path)) | INFERENCE_GAUGES | {name for name, _ in FIELDS}
    for family in FAMILIES.values():
        if family.kind == "histogram":
            names |= {f"{family.name}_bucket", f"{family.name}_sum", f"{family.name}_count"}
        else:
            names.add(family.name)
    names |= {f"{name}_bucket" for _, name, _ in HISTOGRAMS}
    return names


def recorded() -> set[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["record"] for group in groups for rule in group["rules"] if "record" in rule}


def test_promtool_passes_the_rules_unit_tests():
    checked = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run([promtool(), "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent,
                            capture_output=True, text=True, timeout=120)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_the_rules_alert_on_what_the_issue_names():
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = {rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule}
    assert {"SpineMigrationRolledBack", "SpineMigrationGateInconclusive", "SpineMigrationDataPlaneNotAcking",
            "SpineTTFTAboveLayered", "SpineErrorRateAboveLayered"} <= alerts


def test_the_rules_name_only_families_the_project_exports(tmp_path):
    known = exported(tmp_path) | recorded()
    groups = yaml.safe_load(RULES.read_text())["groups"]
    named = {name for group in groups for rule in group["rules"] for name in NAME.findall(rule["expr"])}
    assert named and named <= known, f"not exported by anything: {sorted(named - known)}"


def test_the_grafana_dashboard_names_only_families_the_project_exports_or_records(tmp_path):
    dashboard = json.loads(GRAFANA.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert len(exprs) >= 20
    named = {name for expr in exprs for name in NAME.findall(expr)}
    known = exported(tmp_path) | recorded()
    assert named <= known, f"not exported by anything: {sorted(named - known)}"
    # The golden signals per layout, KV/queue/TTFT and the device are all on it.
    for family in ("layout:spine_requests:rate5m", "layout:spine_request_errors:ratio_rate5m",
                   "layout:spine_ttft_seconds:p99_5m", "spine_kv_slots", "spine_queue_depth",
                   "DCGM_FI_DEV_GPU_UTIL", "spine_migration_gate_value"):
        assert family in named


def test_the_controllers_manifest_serves_the_dashboard_over_tls_behind_the_token():
    from migration.runner import parse_args

    documents = yaml.safe_load_all((DEPLOY / "k8s" / "controller" / "controller.yaml").read_text())
    deployment = next(d for d in documents if d and d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = parse_args(container["args"])
    assert args.dashboard_listen == "0.0.0.0:8470" and args.tls_cert_file and args.tls_client_ca_file
    assert not args.dashboard_view_without_token
    assert {"name": "https-dashboard", "containerPort": 8470} in container["ports"]
