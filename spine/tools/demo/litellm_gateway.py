"""LiteLLM's proxy as a real legacy gateway, on loopback and offline: what `make run LEGACY=litellm`
and the tests migrate from.

    python -m spine.tools.demo.litellm_gateway --config FILE --port PORT   # what `LiteLLMGateway` runs

LiteLLM's proxy binds 0.0.0.0 unless told otherwise and fetches a few documents at start (its
model price map, and at times blog posts, policy templates, router presets and Anthropic's
beta headers); each has a documented switch to use the copy bundled in the wheel instead
(`OFFLINE_ENV`), and `--host 127.0.0.1` keeps it on loopback. Started this way (strace'd:
`connect` calls to loopback only) it makes no other network call.

Without a database (Postgres) LiteLLM has no virtual keys: the master key is the one key it
accepts, and its limits are per model entry (`rpm`, `max_parallel_requests`), which is what
`LiteLLMGateway` configures. The wrapper entry point exists so that the proxy dies with
whoever started it (`runtime.processes.parent.follow_parent`), as every child of the project does,
and so that its garbage is collected on a thread of its own: on CPython 3.11 its per-request
context variables meet a collector bug that kills the process with SIGSEGV
(`runtime.processes.gc_thread`).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import yaml

from runtime.processes.gc_thread import collect_on_a_thread
from runtime.processes.launch import Launched, launch
from runtime.processes.parent import follow_parent
from runtime.processes.run_dir import write_private
from runtime.server import free_port

OFFLINE_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # the documented switch: the price map bundled in the wheel
    "LITELLM_LOCAL_BLOG_POSTS": "True",
    "LITELLM_LOCAL_POLICY_TEMPLATES": "True",
    "LITELLM_LOCAL_AUTOROUTER_PRESETS": "True",
    "LITELLM_LOCAL_ANTHROPIC_BETA_HEADERS": "True",
    "LITELLM_LOG": "ERROR",
}
# Whatever the caller's environment says, no proxy and no database: loopback only.
_DROPPED_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy",
                "DATABASE_URL", "LITELLM_MASTER_KEY", "REDIS_HOST", "REDIS_URL")


@dataclass
class LiteLLMGateway:
    """One LiteLLM proxy in front of one OpenAI-compatible upstream, serving it as `model`.

    `upstream_base_url` as the openai SDK takes it (ending in /v1); `upstream_key` the key the
    upstream wants; `master_key` the one key clients use (it must start with `sk-`).
    `rpm`/`max_parallel_requests`: the model entry's limits (no-database mode has no per-key ones)."""

    run_dir: Path
    upstream_base_url: str
    upstream_key: str
    master_key: str
    model: str = "default"
    rpm: int | None = None
    max_parallel_requests: int | None = None
    timeout_s: float = 30.0
    port: int = 0
    launched: Launched | None = None
    _started: float = 0.0
    started_in_s: float = 0.0  # how long the last start took, until it answered its liveness probe

    @property
    def url(self) -> str:
        """Its root (`legacy: {http: URL}`); the openai SDK's base_url is this plus /v1."""
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict[str, Any]:
        params: dict[str, Any] = {"model": f"openai/{self.model}", "api_base": self.upstream_base_url,
                                  "api_key": self.upstream_key, "timeout": self.timeout_s}
        if self.rpm is not None:
            params["rpm"] = self.rpm
        if self.max_parallel_requests is not None:
            params["max_parallel_requests"] = self.max_parallel_requests
        return {
            "model_list": [{"model_name": self.model, "litellm_params": params}],
            # No retries of its own: a failing upstream reaches the client (and the front) as it is.
            "router_settings": {"num_retries": 0},
            # Anthropic's /v1/messages to the upstream's chat completions (by default LiteLLM calls an
            # openai/ model's Responses API, which a model server such as vLLM's need not have).
            "litellm_settings": {"num_retries": 0, "request_timeout": self.timeout_s, "telemetry": False,
                                 "use_chat_completions_url_for_anthropic_messages": True},
            "general_settings": {"master_key": self.master_key},
        }

    def start(self, timeout_s: float = 120.0) -> str:
        """Start it and wait until it answers; its root URL."""
        self.begin()
        return self.wait_ready(timeout_s)

    def begin(self) -> None:
        """Start it without waiting (from a thread that outlives it: it dies with that thread)."""
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        config_file = write_private(self.run_dir, "litellm.yaml", yaml.safe_dump(self.config(), sort_keys=False))
        self.port = self.port or free_port()
        env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV} | OFFLINE_ENV
        argv = [sys.executable, "-m", "spine.tools.demo.litellm_gateway", "--config", str(config_file),
                "--port", str(self.port)]
        self._started = time.monotonic()
        self.launched = launch("litellm", argv, log_path=self.run_dir / "litellm.log",
                               out_path=self.run_dir / "litellm.out", env=env)

    def wait_ready(self, timeout_s: float = 120.0) -> str:
        """Wait until it answers its liveness probe; its root URL."""
        assert self.launched is not None, "begin() first"
        started = self._started
        deadline = started + timeout_s
        with httpx2.Client(timeout=1.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if not self.launched.alive():
                    tail = self.launched.log_tail()
                    self.stop()
                    raise RuntimeError(f"LiteLLM's proxy exited while starting: {tail}")
                try:
                    if client.get(f"{self.url}/health/liveliness").status_code == 200:
                        self.started_in_s = time.monotonic() - started
                        return self.url
                except httpx2.TransportError:
                    pass
                time.sleep(0.2)
        tail = self.launched.log_tail()
        self.stop()
        raise TimeoutError(f"LiteLLM's proxy did not answer within {timeout_s:g}s: {tail}")

    def alive(self) -> bool:
        return self.launched is not None and self.launched.alive()

    def log_tail(self, chars: int = 2000) -> str:
        return self.launched.log_tail(chars) if self.launched is not None else ""

    def stop(self) -> None:
        launched, self.launched = self.launched, None
        if launched is not None:
            launched.stop(10.0)


def main(argv: list[str] | None = None) -> int:
    """Run LiteLLM's proxy CLI on loopback, dying with the process that started this one."""
    if not follow_parent():
        return 1
    faulthandler.enable()  # a crash in one of its native extensions leaves its stack in the log
    collect_on_a_thread()  # its context variables crash CPython 3.11's collector (runtime.processes.gc_thread)
    parser = argparse.ArgumentParser(prog="python -m spine.tools.demo.litellm_gateway")
    parser.add_argument("--config", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    os.environ.update(OFFLINE_ENV)  # before litellm is imported: it reads them at import
    from litellm.proxy.proxy_cli import run_server

    sys.argv[0] = "litellm"  # what its CLI expects to be called
    run_server.main(args=["--config", args.config, "--host", "127.0.0.1", "--port", str(args.port),
                          "--num_workers", "1"], prog_name="litellm", standalone_mode=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
