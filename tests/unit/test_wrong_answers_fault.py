"""The parity fault must reach an upstream engine, which reads the client's body, not the fields."""

from __future__ import annotations

import json

from runtime.faults import FaultHook, WrongAnswers
from services.inference.upstream.translate import ANTHROPIC, OPENAI
from wire.v1 import generation_pb2


class _Recorder:
    def __init__(self) -> None:
        self.seen: list[generation_pb2.GenerateRequest] = []

    def generate(self, request: generation_pb2.GenerateRequest, options: object = None) -> str:
        self.seen.append(request)
        return "ok"


def _fault(on: bool) -> tuple[WrongAnswers, _Recorder]:
    recorder = _Recorder()
    hook = FaultHook()
    hook.wrong_answers = on
    return WrongAnswers(recorder, hook), recorder  # type: ignore[arg-type]


def _request(api: str, body: dict[str, object]) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt="hi", temperature=0.0, api=api,
                                          body=json.dumps(body).encode())


def test_a_greedy_openai_body_is_sampled_with_the_faults_seed() -> None:
    fault, recorder = _fault(True)
    fault.generate(_request(OPENAI, {"model": "m", "messages": [], "temperature": 0}))
    fault.generate(_request(OPENAI, {"model": "m", "messages": [], "temperature": 0}))
    first, second = (json.loads(r.body) for r in recorder.seen)
    assert first["temperature"] == 1.0 and first["seed"] == recorder.seen[0].seed
    assert first == second, "the same prompt must get the same wrong answer"


def test_an_anthropic_body_gets_its_highest_temperature_and_no_seed_it_has_no_field_for() -> None:
    fault, recorder = _fault(True)
    fault.generate(_request(ANTHROPIC, {"model": "m", "messages": [], "max_tokens": 4}))
    body = json.loads(recorder.seen[0].body)
    assert body["temperature"] == 1.0 and "seed" not in body


def test_switched_off_the_body_is_passed_as_sent() -> None:
    fault, recorder = _fault(False)
    request = _request(OPENAI, {"model": "m", "messages": [], "temperature": 0})
    fault.generate(request)
    assert recorder.seen[0].body == request.body
