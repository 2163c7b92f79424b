"""A process whose components keep no tensors never makes a device context nor imports torch.

Auth, the router and logs keep their state on the host; importing torch was most of their
process's start (~1.5 of ~2.3 s here) and of its memory. The tensor-keeping components
(the rate limiter, the cache, metrics, the model) still get their context at start, with
the thread count `configure_threads` asked for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from monolith.device_on_use import DeviceOnFirstUse
from runtime.processes.launch import launch, serving_on
from tests.conftest import config_for_tests

REPO = Path(__file__).resolve().parents[2]


def test_the_context_is_made_once_on_first_use_and_only_then() -> None:
    device = DeviceOnFirstUse(config_for_tests().device)
    assert not device.made and device.usage() == {}  # reading usage makes nothing
    made: list[object] = []
    barrier = threading.Barrier(8)

    def first_use() -> None:
        barrier.wait()
        made.append(device.context)

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert device.made and len({id(context) for context in made}) == 1
    table = device.allocate("test", (4,), torch.float32, fill=1.0)
    assert table.sum().item() == 4.0 and device.usage() == {"test": 16}
    device.release("test", table)
    assert device.usage() == {"test": 0}


@pytest.mark.parametrize(("component", "needs_torch"), [("auth", False), ("router", False), ("logs", False),
                                                        ("cache", True)])
def test_a_component_process_imports_torch_only_when_it_keeps_tensors(component: str, needs_torch: bool,
                                                                     tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(config_for_tests().to_yaml())
    process = launch(component, [sys.executable, "-m", "runtime.process", component, "--listen",
                                 f"unix:{tmp_path / component}.sock", "--config", str(config), "--run-dir", str(tmp_path)],
                     log_path=tmp_path / f"{component}.log")
    try:
        process.wait_ready(60, serving_on)
        maps = Path(f"/proc/{process.pid}/maps").read_text()
        assert ("libtorch" in maps) is needs_torch, f"{component}: torch loaded: {'libtorch' in maps}"
    finally:
        code = process.stop(30)
    assert code == 0  # SIGTERM: stopped in order, whichever it was


def test_torch_imported_after_configure_threads_gets_its_thread_count() -> None:
    script = textwrap.dedent("""
        import json, sys
        from monolith.runtime_env import configure_threads
        configure_threads()
        assert "torch" not in sys.modules
        from monolith.device_config import DeviceConfig
        from monolith.device_on_use import DeviceOnFirstUse
        device = DeviceOnFirstUse(DeviceConfig())
        device.make_now()
        import torch
        print(json.dumps({"threads": torch.get_num_threads()}))
    """)
    env = {**os.environ, "SPINE_TORCH_THREADS": "1", "SPINE_CPU": "off"}
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"threads": 1}
