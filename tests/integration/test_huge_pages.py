"""Every process that serves a model asks for huge pages before torch is loaded, whatever its
entry point (`monolith.runtime_env.prefer_huge_pages`): the layered child a Kubernetes pod
runs directly, `spine up`, `spine ab`'s servers and the bench. Each entry point runs in a
fresh interpreter with the variable unset, and an import hook reports what torch would read
the moment it is first imported (and ends the process there: nothing is served)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from monolith.runtime_env import HUGE_PAGES_ENV

REPO = Path(__file__).resolve().parents[2]

WATCH = f"""
import os, runpy, sys
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print("torch sees " + repr(os.environ.get({HUGE_PAGES_ENV!r})), flush=True)
            os._exit(0)
        return None
sys.meta_path.insert(0, Watch())
module, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
print("torch never imported", flush=True)
"""


def entry_points(tmp: Path) -> dict[str, list[str]]:
    config = tmp / "config.yaml"
    config.write_text("{}\n")
    run_dir = tmp / "run"
    run_dir.mkdir()
    return {
        "layered model child": ["runtime.process", "inference", "--listen", f"unix:{tmp}/inference.sock",
                                "--config", str(config), "--run-dir", str(run_dir)],
        "spine up": ["spine", "up", "--layout", "collapsed", "--listen", "127.0.0.1:0", "--http-listen", "off",
                     "--run-dir", str(tmp / "up")],
        "spine ab's server": ["spine.tools.ab.serve", "--layout", "collapsed", "--config", str(config),
                              "--run-dir", str(run_dir)],
        "the bench's serving rows": ["bench.run", "--only", "serving", "--out", str(tmp / "results.json")],
    }


def test_each_model_serving_entry_point_asks_for_huge_pages_before_torch_loads(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != HUGE_PAGES_ENV}
    running = {name: subprocess.Popen([sys.executable, "-c", WATCH, *argv], cwd=REPO, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for name, argv in entry_points(tmp_path).items()}
    seen = {}
    for name, process in running.items():
        try:
            out, err = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        lines = [line for line in out.splitlines() if line.startswith("torch ")]
        seen[name] = lines[0] if lines else f"no verdict (exit {process.returncode}): {err[-500:]}"
    assert seen == dict.fromkeys(running, "torch sees '1'"), seen


def test_importing_the_command_line_package_sets_nothing() -> None:
    env = {key: value for key, value in os.environ.items() if key != HUGE_PAGES_ENV}
    out = subprocess.run([sys.executable, "-c", f"import os, spine, spine.cli; print(os.environ.get({HUGE_PAGES_ENV!r}))"],
                         cwd=REPO, env=env, text=True, capture_output=True, check=True).stdout
    assert out.strip() == "None"


@pytest.mark.parametrize("given", ["0", "1"])
def test_an_operators_own_setting_wins(given: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from monolith.runtime_env import prefer_huge_pages

    monkeypatch.setenv(HUGE_PAGES_ENV, given)
    prefer_huge_pages()
    assert os.environ[HUGE_PAGES_ENV] == given
