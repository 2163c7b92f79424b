"""The embedded default model (TinyLM), its generation engine and the backend interface."""

from services.inference.model.backend import (
    ModelBackend,
    ModuleStepModel,
    TinyLMBackend,
    load_backend,
    make_engine,
)
from services.inference.model.engine import (
    GenerationEngine,
    GenerationRequest,
    GenerationResult,
    SequenceHandle,
    SlotsExhausted,
    StepOutput,
)
from services.inference.model.interface import Segment, StepModel, Tokenizer
from services.inference.model.tiny_lm import TinyLM
from services.inference.model.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "GenerationEngine",
    "GenerationRequest",
    "GenerationResult",
    "ModelBackend",
    "ModuleStepModel",
    "Segment",
    "SequenceHandle",
    "SlotsExhausted",
    "StepModel",
    "StepOutput",
    "TinyLM",
    "TinyLMBackend",
    "Tokenizer",
    "load_backend",
    "make_engine",
]
