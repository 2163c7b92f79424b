"""`make rehearse RUNTIME=podman`: the production walk with every process a container of the image.

The whole walk (slow: left out of `make test`, run with `pytest -m slow`) is the rehearsal's own
test with `runtime="podman"`: the layered gateway and each layered component, the following rate
limiter, both spine replicas, the controller and the proxyless clients each a container; the
plan promoted, the parity fault rolled back, every follower ACKing each stage. The image's
commands themselves run in containers in `make test` too: tests/end_to_end/test_image.py's layered layout
runs the manifests' commands one container each.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from spine.tools.containers import Podman
from spine.tools.rehearsal.containers import Containers
from spine.tools.rehearsal.run import Options, run_rehearsal, summary
from tests.end_to_end.test_rehearsal import SHORT_PLAN
from tests.image_helpers import built_image, skip_without_podman


def test_a_command_becomes_podman_run_of_the_image_with_the_work_directory_at_its_own_path(tmp_path: Path) -> None:
    containers = Containers.__new__(Containers)  # no podman needed to build a command line
    containers.podman, containers.workdir = Podman("localhost/spine:test", "spine-unit-0-abc"), tmp_path
    argv = containers.wrap("spine-a-1", [sys.executable, "-m", "spine", "up", "--run-dir", str(tmp_path / "a")],
                           env_keys=["SPINE_INTERNAL_SECRET"], stdin=True)
    image = argv.index("localhost/spine:test")
    assert argv[:2] == ["podman", "run"] and "--name=spine-unit-0-abc-spine-a-1" in argv
    assert argv[image + 1:] == ["-m", "spine", "up", "--run-dir", str(tmp_path / "a")]
    assert "--entrypoint=python" in argv and f"--volume={tmp_path}:{tmp_path}:rw" in argv
    assert {"--network=host", "--ulimit=host", "--runtime=runc", "--read-only", "--cap-drop=ALL",
            "--interactive", "--env=SPINE_INTERNAL_SECRET"} <= set(argv[:image])
    assert not any(arg.startswith("--env=") and "=" in arg[len("--env="):] for arg in argv), "a value on the line"
    with pytest.raises(ValueError):
        containers.wrap("x", ["redis-server"])
    containers.podman.remove_all()


@pytest.mark.slow
@skip_without_podman()
def test_the_production_walk_in_containers_promotes_then_rolls_the_parity_fault_back() -> None:
    image_id, _ = built_image()
    report = run_rehearsal(Options(plan_text=SHORT_PLAN, clients=2, rate=8.0, runtime="podman", image=image_id))
    print(summary(report))
    assert report.ok(), summary(report)
    assert report.runs["healthy"].final_state == "promoted"
    assert report.runs["parity"].final_state == "rolled_back" and "parity" in report.runs["parity"].failed_gates
    for record in report.runs["healthy"].stages:
        spines = [row for row in record.followers if row["role"] == "spine"]
        assert len(spines) == 2 and all(not row["nack_error"] for row in spines), record.followers
