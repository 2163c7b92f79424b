"""Priority classes pick the device stream of each decode step (on CUDA: stream priorities).

On the CPU `DeviceContext.stream` is None; this records what the scheduler asked for."""

from __future__ import annotations

import threading

from monolith.device import DeviceContext
from services.inference.service import InferenceConfig, InferenceService
from services.pipeline.local_context import LocalContext
from wire.v1 import generation_pb2


class RecordingDevice(DeviceContext):
    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    def stream(self, priority: int = 0) -> object | None:
        self.asked.append(priority)
        return super().stream(priority)


def test_each_step_runs_on_the_stream_of_the_highest_class_in_the_batch() -> None:
    device = RecordingDevice()
    service = InferenceService(InferenceConfig.parse({"max_batch": 4}), device)
    try:
        device.asked.clear()
        service.Generate(generation_pb2.GenerateRequest(model="tiny-lm", prompt="alone", max_tokens=4,
                                                        priority=-1), LocalContext())
        assert device.asked and set(device.asked) == {-1}
        device.asked.clear()
        threads = [threading.Thread(target=service.Generate, args=(generation_pb2.GenerateRequest(
            model="tiny-lm", prompt=f"mixed {p}", max_tokens=40, priority=p), LocalContext())) for p in (-1, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert 1 in device.asked, "a step with a latency-class request must ask for its stream"
        assert set(device.asked) <= {-1, 1}
    finally:
        service.close()
