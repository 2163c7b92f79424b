"""The model's step in the request path (the gateway calls it itself, see `services.gateway.service`).

Apart from `services.inference.service` (the servicer, its engine and torch): a gateway whose model
runs in another process imports this and not torch.
"""

from __future__ import annotations

from services.inference.api import INFERENCE, Inference
from services.pipeline.step import Phase, Step


class InferenceStep(Step[Inference]):
    """The model's place in the path: fail closed, its budget the compute budget. The gateway
    calls it per request (unary or streaming); the engine batches decode steps itself."""

    interface = INFERENCE
    method = "Generate"
    phase = Phase.MODEL
