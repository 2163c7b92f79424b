"""A migration from LiteLLM's proxy to the spine on one machine, every part real and its own process.

- **the model server**: the model alone over the OpenAI API (`spine up --layout bare`, a key
  of its own), what LiteLLM and the spine both call upstream;
- **the legacy gateway**: LiteLLM's proxy (`LiteLLMGateway`), its master key the clients' key;
- **the spine**: a collapsed spine whose model is that same upstream (`CollapsedSpineProcess`,
  faults switchable), its auth configured with LiteLLM's key (`spine keys import`'s `from_lines`);
- **the front and the controller** (`LegacyCutover`): clients call the front, which splits
  their traffic between LiteLLM and the spine by the stage's weight.

`make run LEGACY=litellm` and tests/end_to_end/test_legacy_litellm.py start one; `LegacyTraffic` drives
it with the official `openai` SDK, as a team's clients would.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from migration.legacy_endpoint import LegacyEndpoint
from migration.plan import load_plan
from migration.status import State
from migration.traffic.http_mirror import MirrorSettings
from migration.traffic.legacy_cutover import LegacyCutover, RunningLegacyCutover
from migration.traffic.spine_process import CollapsedSpineProcess
from runtime.bare import API_KEY_ENV, BARE_LAYOUT
from runtime.config.file import load_config, merge
from runtime.config.model import SpineConfig
from runtime.processes.launch import Launched, launch, spine_up_argv
from runtime.processes.run_dir import write_private
from runtime.server import free_port
from spine.tools.demo.litellm_gateway import LiteLLMGateway
from spine.tools.key_import import config_fragment, from_lines

REPO = Path(__file__).resolve().parents[3]
LEGACY_PLAN = REPO / "deploy" / "plans" / "legacy-litellm.yaml"
MODEL = "default"
DEV_KEY = "spine-dev-key-0000"  # the default config's key
FINISHED = (State.PROMOTED, State.ROLLED_BACK, State.ABORTED)
# Each middleware's budget on a machine this rig shares with LiteLLM, the front, the clients and
# (in CI) the rest of a test suite: the default 250 ms is a production figure, and a refusal
# for a missed budget here would be the harness's doing, not the migration's.
BUDGETS = {"calls": {"budgets_ms": dict.fromkeys(("auth", "ratelimit", "router", "cache"), 2000)}}


@dataclass
class ModelServer:
    launched: Launched
    base_url: str  # as the openai SDK takes it
    key: str


def start_model_server(run_dir: Path, port: int) -> ModelServer:
    """The model alone (`spine up --layout bare`) on `port`, behind a key of its own: the
    upstream both LiteLLM and the spine call. Launched, not yet awaited (its `launched`'s
    `wait_ready`)."""
    key = f"bare-{secrets.token_hex(12)}"
    env = {name: value for name, value in os.environ.items() if name != API_KEY_ENV} | {API_KEY_ENV: key}
    argv = spine_up_argv(None, BARE_LAYOUT, listen="127.0.0.1:0", http_listen=f"127.0.0.1:{port}",
                         run_dir=run_dir / "model-server")
    launched = launch("model-server", argv, log_path=run_dir / "model-server.log", env=env)
    return ModelServer(launched, f"http://127.0.0.1:{port}/v1", key)


def replace_legacy(plan_text: str, legacy: LegacyEndpoint) -> str:
    """The plan with its `legacy.http` pointed at where the legacy endpoint listens this run."""
    replaced, count = re.subn(r"(?<![\w-])(http:\s*[\"']?)https?://[^\s\"',}]+", lambda m: m.group(1) + legacy.http,
                              plan_text, count=1)
    if count != 1:
        raise ValueError("the plan has no legacy.http line to point at the running endpoint")
    return replaced


@dataclass
class LegacyRig:
    run_dir: Path
    shadow_share: float = 0.25
    master_key: str = field(default_factory=lambda: f"sk-legacy-{secrets.token_hex(12)}")
    spine_config: dict[str, Any] = field(default_factory=dict)  # laid over the spine's
    model_server: ModelServer | None = None
    gateway: LiteLLMGateway | None = None
    spine: CollapsedSpineProcess | None = None
    cutover: RunningLegacyCutover | None = None
    timings: dict[str, float] = field(default_factory=dict)  # seconds each part took to start

    def start(self) -> str:
        """Start every part (the processes side by side); the front's base URL for the openai SDK.

        Each child dies with the thread that launched it, so all are launched from this one."""
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        began = time.monotonic()
        try:
            self.model_server = start_model_server(self.run_dir, free_port())
            self.gateway = LiteLLMGateway(self.run_dir / "litellm", self.model_server.base_url,
                                          self.model_server.key, self.master_key, model=MODEL, rpm=60_000,
                                          max_parallel_requests=256)
            self.gateway.begin()
            self.model_server.launched.wait_ready(120)  # the spine's upstream: serving before the spine starts
            self.timings["model_server"] = time.monotonic() - began
            internal_secret = secrets.token_urlsafe(32)
            self.spine = CollapsedSpineProcess(self._spine_config(internal_secret), self.run_dir / "spine")
            self.spine.start()
            self.timings["spine"] = time.monotonic() - began
            self.gateway.wait_ready(180)
            self.timings["litellm"] = self.gateway.started_in_s
            legacy = LegacyEndpoint(self.gateway.url, "authorization")
            self.cutover = LegacyCutover(legacy, f"http://{self.spine.http_address}", self.run_dir / "cutover",
                                         mirror=MirrorSettings(share=self.shadow_share),
                                         internal_key=internal_secret.encode()).start()
            self.timings["all"] = time.monotonic() - began
        except BaseException:
            self.stop()
            raise
        return self.cutover.base_url

    def _spine_config(self, internal_secret: str) -> SpineConfig:
        """The default config, LiteLLM's key accepted (imported by digest) beside the dev key,
        the internal secret that marks the front's shadow copies."""
        imported = config_fragment(from_lines(self.master_key, "legacy-clients"), ["generate"])
        dev = {"id": "dev-key", "tenant": "dev", "key": DEV_KEY, "scopes": ["generate"], "max_priority": 1}
        keys = {"auth": {"api_keys": [dev, *imported["auth"]["api_keys"]]}}
        assert self.model_server is not None
        key_file = write_private(self.run_dir, "model-server.key", self.model_server.key + "\n")
        # The same model LiteLLM serves: the model server's, as an upstream of the spine's router.
        model = {"router": {"models": [{"id": MODEL, "upstream": {"base_url": self.model_server.base_url,
                                                                  "api_key_file": str(key_file)}}]}}
        written = merge(merge(merge(merge(keys, {"internal": {"secret": internal_secret}}), BUDGETS), model),
                        self.spine_config)
        return load_config(None, written)

    def plan_text(self, text: str | None = None) -> str:
        assert self.cutover is not None
        return replace_legacy(LEGACY_PLAN.read_text() if text is None else text, self.cutover.legacy)

    def switch_fault(self, command: str) -> dict[str, Any]:
        assert self.spine is not None
        return self.spine.switch_fault(command)

    def walk(self, plan_text: str, timeout_s: float = 90.0, actor: str = "legacy-rig",
             on_stage: Callable[[int, str, float], None] | None = None) -> State:
        """Start the plan and wait until it finishes (or `timeout_s`); the state it ended in."""
        assert self.cutover is not None and self.cutover.controller is not None
        controller = self.cutover.controller.controller
        plan = load_plan(plan_text)
        controller.start(plan, actor=actor, reason=f"walk {plan.name}")
        seen = -1
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = controller.status
            if on_stage is not None and status.stage_index != seen and status.state is State.PROGRESSING:
                seen = status.stage_index
                on_stage(seen, plan.stages[seen].name, status.spine_weight)
            if status.state in FINISHED:
                return status.state
            time.sleep(0.05)
        return controller.status.state

    def stop(self) -> None:
        if self.cutover is not None:
            self.cutover.stop()
            self.cutover = None
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None
        if self.spine is not None:
            self.spine.stop()
            self.spine = None
        if self.model_server is not None:
            self.model_server.launched.stop()
            self.model_server = None


@dataclass
class Call:
    started: float  # time.time() when it was sent
    at: float  # time.time() when it ended
    side: str  # x-spine-side ("" for a stream, or when no answer came)
    error: str  # "" when it succeeded, else the SDK's exception class and message
    text: str


class LegacyTraffic:
    """`workers` threads calling the front with the official openai SDK, as clients would: greedy
    chat completions (every fourth streamed), a new conversation (`x-session-id`) every four
    calls, no retries (a failed call is seen as failed), every prompt new. Bounded: it stops by itself after
    `max_s`, and on `stop()`."""

    def __init__(self, base_url: str, key: str, workers: int = 12, max_s: float = 300.0) -> None:
        self.base_url, self.key, self.workers, self.max_s = base_url, key, workers, max_s
        # Prompts of their own: the spine's response cache holds earlier runs' answers, and a
        # cache hit would hide a fault in its model.
        self.nonce = secrets.token_hex(4)
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> LegacyTraffic:
        self._stop.clear()
        self._threads = [threading.Thread(target=self._run, args=(worker,), name=f"legacy-traffic-{worker}",
                                          daemon=True) for worker in range(self.workers)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> list[Call]:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
        with self._lock:
            return list(self.calls)

    def since(self, at: float) -> list[Call]:
        with self._lock:
            return [call for call in self.calls if call.at >= at]

    def _run(self, worker: int) -> None:
        import openai

        client = openai.OpenAI(base_url=self.base_url, api_key=self.key, max_retries=0, timeout=30.0)
        deadline = time.monotonic() + self.max_s
        count = 0
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                if not self._one(client, worker, count):
                    self._stop.wait(0.05)  # a failed call is not retried, and the next one waits a moment
                count += 1
        finally:
            client.close()

    def _one(self, client: Any, worker: int, count: int) -> bool:
        messages = [{"role": "user", "content": f"Say something about {self.nonce}-{worker}-{count}."}]
        headers = {"x-session-id": f"w{worker}-{count // 4}"}
        side, error, text = "", "", ""
        started = time.time()
        try:
            if count % 4 == 3:
                stream = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, stream=True,
                                                        messages=messages, extra_headers=headers)
                text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
            else:
                raw = client.chat.completions.with_raw_response.create(model=MODEL, max_tokens=4, temperature=0,
                                                                       messages=messages, extra_headers=headers)
                side = raw.headers.get("x-spine-side", "")
                text = raw.parse().choices[0].message.content or ""
        except Exception as exc:  # the SDK's APIError family, or a broken connection
            error = f"{type(exc).__name__}: {str(exc)[:200]}"
        with self._lock:
            self.calls.append(Call(started, time.time(), side, error, text))
        return not error
