"""Embeddings from a causal LM's own hidden states: the mean of the last layer over the input's
tokens, scaled to length 1.

Why mean pooling: the model directories spine serves are generative (no pooling head, no
`sentence_transformers` config); the mean of the final hidden states is the standard pooled
representation of such a model (what `transformers`' feature-extraction pipeline and vLLM's
`--task embed` with `MEAN` pooling give), and normalised vectors make the cosine a dot product,
as OpenAI's embeddings are. It is a real embedding of the text by the served model — similar
texts land near each other — not a hash.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def mean_pooled(module: Any, ids: Sequence[int], bos_id: int | None) -> list[float]:
    """The normalised mean of `module`'s last hidden states over `ids` (BOS first where the model
    has one, as its generation sees the text)."""
    tokens = [bos_id, *ids] if bos_id is not None else list(ids)
    device = next(module.parameters()).device
    with torch.inference_mode():  # no cache: this forward shares nothing with the engine's slots
        out = module(input_ids=torch.tensor([tokens], device=device), output_hidden_states=True, use_cache=False)
        hidden = out.hidden_states[-1][0].float()
        pooled = hidden.mean(dim=0)
        pooled = pooled / pooled.norm().clamp_min(1e-12)
    return [float(x) for x in pooled.cpu()]


def hidden_size(module: Any) -> int:
    """The length of a pooled vector (the model's hidden size)."""
    config = getattr(module, "config", None)
    size = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if not isinstance(size, int):
        raise ValueError("the model's config names no hidden_size")
    return size
