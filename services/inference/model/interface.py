"""The contract between the generation engine and a model it drives.

The engine owns scheduling (slots, sampling, finishing); a model owns its weights and its
per-slot state (a KV cache, or anything else). Each step the engine hands the model one
`Segment` per active sequence — the new tokens of that sequence and where they start — and
gets back the logits after each segment's last token. Keeping the contract this small is
what lets a user's own torch model replace the embedded one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from services.common import DeviceState

DeviceLike = torch.device | DeviceState
KV_CACHE_OWNER = "inference.kv_cache"


@dataclass(frozen=True)
class Segment:
    """New tokens of one sequence in a step: `token_ids` go to positions `start`, `start+1`, …

    `start` is the number of tokens the model has already seen in `slot` for this
    sequence (0 for a new one, whose slot may still hold a previous sequence's state).
    `prefix` is how many of the first `token_ids` are a shared prefix (BOS and a system
    prompt) whose KV may be kept for later requests (`kv_prefix`): a model that must give
    the same answer whether that KV is computed here or reused forwards them apart.
    """

    slot: int
    start: int
    token_ids: tuple[int, ...]
    prefix: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@runtime_checkable
class Tokenizer(Protocol):
    """Text to ids and back, plus the two special ids the engine needs."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ModelSizes:
    """The two sizes a step model reports, kept as `_vocab_size` and `_max_context`: the
    engine reads them through the `StepModel` properties (every step model has both)."""

    _vocab_size: int
    _max_context: int

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_context(self) -> int:
        return self._max_context


@runtime_checkable
class StepModel(Protocol):
    """What the engine calls each step.

    Batch invariance is the model's duty: row i of `step`'s result must depend only on
    segment i and on what earlier steps stored in its slot — never on the other segments.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    def new_cache(self, slots: int, max_context: int, device: DeviceLike) -> Any:
        """Per-slot state for `slots` sequences of up to `max_context` tokens."""
        ...

    def release_cache(self, cache: Any, device: DeviceLike) -> None:
        """Give the cache's memory back (to the DeviceState budget where there is one)."""
        ...

    def step(self, segments: Sequence[Segment], cache: Any) -> torch.Tensor:
        """Float logits [len(segments), vocab_size] after each segment's last token."""
        ...


def torch_device(device: DeviceLike | str) -> torch.device:
    """The torch device of a DeviceState, a torch.device or a device string."""
    if isinstance(device, str):
        return torch.device(device)
    if isinstance(device, torch.device):
        return device
    return device.device


def allocate(device: DeviceLike, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor, charged to the KV-cache owner when `device` keeps a budget."""
    if isinstance(device, torch.device):
        return torch.zeros(shape, dtype=dtype, device=device)
    return device.allocate(KV_CACHE_OWNER, shape, dtype, 0.0)


def release(device: DeviceLike, tensor: torch.Tensor) -> None:
    """Return a tensor allocated by `allocate` to the budget (no-op for a bare device)."""
    if not isinstance(device, torch.device):
        device.release(KV_CACHE_OWNER, tensor)


@dataclass
class TokenizedBackend:
    """A backend from parts: any StepModel with any tokenizer."""

    id: str
    model: StepModel
    tokenizer: Tokenizer

    @property
    def max_context(self) -> int:
        return self.model.max_context

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)
