"""Fault injection for the demo and tests: make one side of a migration misbehave.

A binding hook, so the fault sits exactly where a real one would — on the call into a
component — and is seen by the front's gates like any other failure.

A parity fault is a different kind: every call succeeds and the answers differ. It sits
in the model servicer itself (`WrongAnswers`, wrapped around the spine's model when the
stack is built) and is switched by the same `FaultHook` (`wrong_answers`).
"""

from __future__ import annotations

import json
import random
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from runtime.config.model import SpineConfig
from services.inference.api import AsyncChunkStream, ChunkStream, Generated, OnLoop
from services.inference.upstream.translate import OPENAI
from services.pipeline.interface import NO_OPTIONS, CallOptions
from services.pipeline.local_context import LocalRpcError
from wire.v1 import generation_pb2, inference_pb2

if TYPE_CHECKING:
    from services.inference.service import InferenceService


@dataclass
class FaultHook:
    """Fail a share of calls to `component` with UNAVAILABLE and/or add latency to them."""

    component: str = "inference"
    error_rate: float = 0.0
    added_latency_s: float = 0.0
    seed: int = 0
    wrong_answers: bool = False  # read by `WrongAnswers` around the model
    _rng: random.Random = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @property
    def may_block(self) -> bool:
        """An added latency sleeps in the calling thread: never on an event loop."""
        return self.added_latency_s > 0

    def begin(self, component: str, method: str, metadata: list[tuple[str, str]]) -> Any:
        if component != self.component:
            return None
        if self.added_latency_s:
            time.sleep(self.added_latency_s)
        with self._lock:
            fail = self._rng.random() < self.error_rate
        if fail:
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, f"injected fault in {component}.{method}")
        return None

    def end(self, token: Any, code: grpc.StatusCode) -> None:
        return None

    def fail_share(self, rate: float) -> None:
        """Fail `rate` of the calls from now on."""
        self.error_rate = rate

    def answer_wrongly(self, on: bool) -> None:
        """The model answers differently (greedy requests) while on."""
        self.wrong_answers = on

    def clear(self) -> None:
        self.error_rate = 0.0
        self.added_latency_s = 0.0
        self.wrong_answers = False


class WrongAnswers:
    """A model servicer that answers differently while `fault.wrong_answers` is set.

    The bug it plays: greedy requests (temperature 0) are sampled at temperature 1, with a
    seed taken from the prompt. Every call succeeds and the same prompt always gets the
    same (wrong) answer, so the error-rate gate sees nothing and a layout compared with
    itself agrees: only the parity gate, comparing with the other side, can tell.
    Everything else is the wrapped servicer's.
    """

    def __init__(self, servicer: InferenceService, fault: FaultHook) -> None:
        self._servicer = servicer
        self._fault = fault

    def generate(self, request: generation_pb2.GenerateRequest, options: CallOptions = NO_OPTIONS) -> Generated:
        return self._servicer.generate(self._altered(request), options)

    def generate_stream(self, request: generation_pb2.GenerateRequest,
                        options: CallOptions = NO_OPTIONS) -> ChunkStream:
        return self._servicer.generate_stream(self._altered(request), options)

    async def generate_on_loop(self, request: generation_pb2.GenerateRequest,
                               options: CallOptions = NO_OPTIONS) -> Generated:
        model: OnLoop = self._servicer  # type: ignore[assignment]  # on_loop named the model: it has this
        return await model.generate_on_loop(self._altered(request), options)

    def generate_stream_on_loop(self, request: generation_pb2.GenerateRequest,
                                options: CallOptions = NO_OPTIONS) -> AsyncChunkStream:
        model: OnLoop = self._servicer  # type: ignore[assignment]  # on_loop named the model: it has this
        return model.generate_stream_on_loop(self._altered(request), options)

    def models(self, request: inference_pb2.ModelInfoRequest,
               options: CallOptions = NO_OPTIONS) -> inference_pb2.ModelInfoResponse:
        return self._servicer.models(request, options)

    def Generate(self, request: generation_pb2.GenerateRequest, context: Any) -> Any:
        return self._servicer.Generate(self._altered(request), context)

    def GenerateStream(self, request: generation_pb2.GenerateRequest, context: Any) -> Any:
        return self._servicer.GenerateStream(self._altered(request), context)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._servicer, name)

    def _altered(self, request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateRequest:
        if not self._fault.wrong_answers or request.temperature > 0:
            return request
        altered = generation_pb2.GenerateRequest()
        altered.CopyFrom(request)
        altered.temperature = 1.0
        altered.seed = zlib.crc32(request.prompt.encode())
        if request.body:  # an upstream engine reads the client's body, not the fields above
            altered.body = _sampled_body(request.body, request.api, altered.seed)
        return altered


def _sampled_body(raw: bytes, api: str, seed: int) -> bytes:
    """The client's body with the fault's sampling: temperature 1 (Anthropic's highest) and,
    where the API has one, the fault's seed, so the wrong answer is still the same each time."""
    body = json.loads(raw)
    if not isinstance(body, dict):
        return raw
    body["temperature"] = 1.0
    if api == OPENAI:
        body["seed"] = seed
    return json.dumps(body).encode()


# Faults `spine up --inject-fault NAME` can switch on: rehearsals and tests only.
SWITCHABLE = "switchable"
INJECTABLE = ("wrong-answers", SWITCHABLE)


def injected_fault(name: str, config: SpineConfig, run_dir: Path | None) -> dict[str, Any]:
    """`Stack` keyword arguments for a spine that runs with fault `name` switched on from its
    start, for rehearsing the production path (`python -m spine.tools.rehearsal.run`) and tests:

    - `wrong-answers`: the parity fault. The stack's model is the configured one wrapped in
      `WrongAnswers`, switched on: greedy requests are sampled, every call succeeds, so only
      the parity gate can tell. It applies wherever the model is placed local in the stack.
    - `switchable`: no fault yet; the model's calls go through a `FaultHook` (failures) and
      `WrongAnswers` (parity) that the process's parent switches with lines on its stdin
      (`FaultSwitch`): what `make run` does to a spine in a process of its own.

    The hook, when there is one, is the first of the returned `hooks`.
    """
    if name not in INJECTABLE:
        raise ValueError(f"unknown fault {name!r}; known: {', '.join(INJECTABLE)}")
    from monolith.device import DeviceContext
    from services.registry import DEFAULT

    device = DeviceContext.for_section(config.device)
    # The model's factory takes a run directory but keeps nothing there.
    model = DEFAULT["inference"].build(config, device, run_dir or Path(tempfile.gettempdir()))
    hook = FaultHook(wrong_answers=name == "wrong-answers")
    switched: dict[str, Any] = {"device": device, "servicers": {"inference": WrongAnswers(model, hook)}}
    if name == SWITCHABLE:
        switched["hooks"] = [hook]
    return switched


class FaultSwitch:
    """Switches a `FaultHook` from command lines, each answered with one JSON line.

    The channel is the process's stdin, which only its parent holds: nothing a client sends
    over the network can reach it (and `spine up` refuses `switchable` on a terminal or with
    --allow-external). Commands:

    - `error-rate R`: that share (0..1) of the model's calls fail with UNAVAILABLE;
    - `wrong-answers on|off`: the parity fault;
    - `clear`: no fault.

    Each applied command is answered `{"event": "fault", "command": ..., "error_rate": R,
    "wrong_answers": B}` (the state now), a line that is not one of them `{"event":
    "fault-refused", "command": ..., "why": ...}`; the parent matches the answer to its
    command and waits for it before it counts the fault as switched.
    """

    def __init__(self, hook: FaultHook, answer: Callable[[str], None]) -> None:
        self.hook = hook
        self._answer = answer

    def apply(self, line: str) -> dict[str, Any]:
        """One command line; the answer it gets (also written out)."""
        command = line.strip()[:200]
        try:
            self._switch(command.split())
            answer: dict[str, Any] = {"event": "fault", "command": command, "error_rate": self.hook.error_rate,
                                      "wrong_answers": self.hook.wrong_answers}
        except ValueError as error:
            answer = {"event": "fault-refused", "command": command, "why": str(error)}
        self._answer(json.dumps(answer))
        return answer

    def follow(self, lines: Iterable[bytes], closed: Callable[[], None] = lambda: None) -> threading.Thread:
        """Apply every line of `lines` (the parent's pipe, as bytes: a line that is not UTF-8
        is refused like any other bad line) on a daemon thread; `closed` once it ends."""
        def run() -> None:
            for raw in lines:
                line = raw.decode("utf-8", errors="replace")
                if line.strip():
                    self.apply(line)
            closed()
        thread = threading.Thread(target=run, name="fault-switch", daemon=True)
        thread.start()
        return thread

    def _switch(self, words: list[str]) -> None:
        if words == ["clear"]:
            self.hook.clear()
            return
        if len(words) == 2 and words[0] == "error-rate":
            try:
                rate = float(words[1])
            except ValueError:
                raise ValueError(f"error-rate: expected a number in [0, 1], got {words[1]!r}") from None
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"error-rate: expected a number in [0, 1], got {rate:g}")
            self.hook.fail_share(rate)
            return
        if len(words) == 2 and words[0] == "wrong-answers" and words[1] in ("on", "off"):
            self.hook.answer_wrongly(words[1] == "on")
            return
        raise ValueError("expected `error-rate R`, `wrong-answers on|off` or `clear`")
