"""The embedded default model (TinyLM), its generation engine and the backend interface."""

from services.model.backend import ModelBackend, ModuleStepModel, TinyLMBackend, load_backend, make_engine
from services.model.engine import (
    GenerationEngine,
    GenerationRequest,
    GenerationResult,
    SequenceHandle,
    SlotsExhausted,
    StepOutput,
)
from services.model.interface import Segment, StepModel, Tokenizer
from services.model.tiny_lm import TinyLM
from services.model.tokenizer import ByteTokenizer

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
