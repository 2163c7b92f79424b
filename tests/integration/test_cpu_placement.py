"""A model-serving process on a CPU of its own (`services.inference.cpu_placement`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.inference.cpu_placement import PlacementError, least_claimed, requested

REPO = Path(__file__).resolve().parents[2]
TWO_CPUS = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a process allowed two CPUs")


def test_the_setting_is_read_strictly_and_names_the_variable() -> None:
    assert requested({}, {0, 1}) == "auto"
    assert requested({"SPINE_CPU": "off"}, {0, 1}) is None
    assert requested({"SPINE_CPU": "3"}, {0, 1, 2, 3}) == {3}
    assert requested({"SPINE_CPU": " 1,2 "}, {0, 1, 2, 3}) == {1, 2}
    assert requested({}, {5}) is None  # one CPU: nothing to choose
    assert requested({"SPINE_CPU": "auto"}, {0, 1}, count=2) is None  # it would take them all
    with pytest.raises(PlacementError, match=r"SPINE_CPU='7': names a CPU this process may not use \(it may use 0,1\)"):
        requested({"SPINE_CPU": "7"}, {0, 1})
    with pytest.raises(PlacementError, match="SPINE_CPU='fast': expected auto, off, or CPU numbers"):
        requested({"SPINE_CPU": "fast"}, {0, 1})


def test_auto_spreads_model_processes_over_the_cpus_and_forgets_the_dead(tmp_path: Path) -> None:
    first, second, third = os.getpid(), os.getppid(), 1  # three live processes
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead = int(gone.stdout)
    assert least_claimed({0, 1, 2}, 1, tmp_path, first) == {2}  # nothing claimed: the highest
    assert least_claimed({0, 1, 2}, 1, tmp_path, second) == {1}
    assert least_claimed({0, 1, 2}, 2, tmp_path, third) == {0, 2}  # 0 (none), then 2 over 1 (one each)
    # Now 0 and 1 hold one claim each, 2 two. Claims of a process that has ended hold
    # nothing: counted, they would push the choice from 1 to 0.
    for n in range(2):
        (tmp_path / f"1-{dead + n * 10_000_000}.claim").touch()
    (tmp_path / "not-a-claim.claim").touch()
    assert least_claimed({0, 1, 2}, 1, tmp_path, first) == {1}
    assert sorted(p.name for p in tmp_path.glob("*.claim")) == sorted(
        [f"2-{first}.claim", f"1-{second}.claim", f"0-{third}.claim", f"2-{third}.claim", f"1-{first}.claim"])


@TWO_CPUS
@pytest.mark.parametrize("setting", ["auto", "off"])
def test_when_a_model_starts_every_thread_of_its_process_moves_to_one_cpu(setting: str, tmp_path: Path) -> None:
    """In a process of its own (placement is for server processes: the test runner's
    threads must not move). Threads made before the model and after it both end up there."""
    script = textwrap.dedent("""
        import json, os, threading
        from monolith.runtime_env import configure_threads
        from services.inference.cpu_placement import place_process
        configure_threads()
        before = threading.Thread(target=threading.Event().wait, args=(30,), daemon=True)
        before.start()
        model = threading.Thread(target=place_process)  # what a scheduler's loop does first
        model.start(); model.join()
        after = {}
        late = threading.Thread(target=lambda: after.update(cpus=sorted(os.sched_getaffinity(0))))
        late.start(); late.join()
        tasks = {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
        from services.inference.cpu_placement import claims_dir
        print(json.dumps({"main": sorted(os.sched_getaffinity(0)), "before": tasks[before.native_id],
                          "late": after["cpus"], "all": sorted({tuple(c) for c in tasks.values()}),
                          "claims": sorted(p.name for p in claims_dir().glob("*.claim")), "pid": os.getpid()}))
    """)
    env = {**os.environ, "SPINE_CPU": setting, "TMPDIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         check=True, timeout=60)
    seen = json.loads(out.stdout)
    allowed = sorted(os.sched_getaffinity(0))
    if setting == "off":
        assert seen["main"] == seen["before"] == seen["late"] == allowed
        return
    assert len(seen["main"]) == 1 and seen["main"][0] in allowed
    assert seen["before"] == seen["late"] == seen["main"]
    assert seen["all"] == [seen["main"]]  # gRPC's and torch's threads too, whoever made them
    assert seen["claims"] == [f"{seen['main'][0]}-{seen['pid']}.claim"]
    assert not list((tmp_path / f"spine-cpu-claims-{os.getuid()}").glob("*.claim"))  # released at its exit
