"""`spine model make-tiny`: a small, randomly initialised causal LM directory, made offline.

    spine model make-tiny --arch llama|gpt2 --out DIR [--seed 0]

The directory is what the transformers backend serves (`spine up --model DIR`) and what
every test of it uses, so nothing is ever downloaded: `config.json`, `model.safetensors`
and a tokenizer (`tokenizer.json`, `tokenizer_config.json` with a chat template, and
`special_tokens_map.json`). The tokenizer is a byte-level BPE trained here on a short
built-in text, so any prompt encodes; the weights come from `seed`, so the same command
makes the same model. The answers are random text: this is for trials, not for reading.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHS = ("llama", "gpt2")
SPECIALS = ("<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}\n"
    "{% else %}<|assistant|>{{ m['content'] }}</s>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# The BPE's training text: enough words for a few hundred merges, the same on every machine.
CORPUS = """\
The spine collapses a layered stack of middleware into one process. Each request passes
authentication, a rate limit, a router, a response cache, metrics and logs before the model
answers it. The model decodes many sequences together: new requests join the running batch
between two steps and leave it when they finish. A key and a value cache per slot keeps what
the model has seen, so each step only computes the new token. Tokens, prompts, answers,
latency, throughput, memory, budget, device, context, layers, heads, weights and batches are
the words of this trade. Hello, world! How are you today? I am fine, thank you. What is the
time? It is half past nine in the morning, and the weather is clear and bright.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024.
"""


@dataclass(frozen=True)
class TinySpec:
    arch: str = "llama"
    seed: int = 0
    vocab_size: int = 512        # the BPE's target; the model takes the tokenizer's actual size
    hidden_size: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2            # llama only (grouped-query attention); gpt2 has one per head
    intermediate_size: int = 128
    max_context: int = 512
    dtype: str = "float32"


def make_tiny(out: str | os.PathLike[str], spec: TinySpec = TinySpec()) -> Path:
    """Write the model directory `out` (created; existing files are replaced); return its path."""
    if spec.arch not in ARCHS:
        raise ValueError(f"--arch: expected one of {', '.join(ARCHS)}, got {spec.arch!r}")
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(spec.vocab_size)
    config = _config(spec, len(tokenizer), tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config)
    model = model.to(getattr(torch, spec.dtype))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE trained on CORPUS, wrapped for transformers, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=list(SPECIALS[3:]), chat_template=CHAT_TEMPLATE,
                                   model_max_length=1 << 30)


def _config(spec: TinySpec, vocab: int, tokenizer: Any) -> Any:
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    if spec.arch == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(vocab_size=vocab, n_positions=spec.max_context, n_embd=spec.hidden_size,
                          n_layer=spec.layers, n_head=spec.heads, n_inner=spec.intermediate_size,
                          dtype=spec.dtype, **ids)
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                       num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                       num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.max_context,
                       tie_word_embeddings=False, dtype=spec.dtype, **ids)


def describe(path: Path) -> str:
    """One line: what was written where."""
    config = json.loads((path / "config.json").read_text())
    files = sorted(p.name for p in path.iterdir())
    return (f"{path}: {config.get('model_type')} with {config.get('num_hidden_layers', config.get('n_layer'))} "
            f"layers, vocab {config.get('vocab_size')}, context "
            f"{config.get('max_position_embeddings', config.get('n_positions'))} ({', '.join(files)})")
