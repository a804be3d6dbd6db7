"""Named model sizes for the ``plan`` command and the benchmarks.

GPT-2 sizes from Radford et al., "Language Models are Unsupervised Multitask Learners" (2019),
Table 2, with the released models' vocabulary (50257) and context (1024). Llama sizes from the
released configurations: Llama 2 7B and 13B (Touvron et al., "Llama 2", 2023, Table 1 and the
released config.json: width 4096/5120, 32/40 layers and heads, SwiGLU width 11008/13824,
vocabulary 32000), Llama 3 8B and Llama 3.2 1B (Meta's released config.json files: grouped-query
attention with 8 key/value heads, vocabulary 128256; 1B ties its embeddings). Llama 2 70B from
the same paper (Table 1: grouped-query attention) and its released config.json: width 8192, 80
layers, 64 query heads sharing 8 key/value heads, SwiGLU width 28672, vocabulary 32000. Llama 2
has no released 30B, so ``llama-30b`` is the LLaMA 30B shape (Touvron et al., "LLaMA", 2023,
Table 2, the released "30B"/33B config: width 6656, 60 layers, 52 heads, SwiGLU width 17920)
with the Llama 2 architecture and vocabulary (32000).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn

from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig

__all__ = ["Preset", "PRESETS", "get_preset"]


@dataclass(frozen=True)
class Preset:
    """A buildable model size: ``build(max_seq_len)`` makes the module; ``vocab_size`` bounds the
    token ids; ``max_seq_len`` is the longest sequence the architecture allows (``None``: any)."""

    name: str
    family: str
    build: Callable[[int], nn.Module]
    vocab_size: int
    max_seq_len: int | None
    description: str


def _gpt(n_layer: int, n_head: int, n_embd: int, vocab: int = 50257, block: int = 1024) -> Callable[[int], nn.Module]:
    def build(seq_len: int) -> nn.Module:
        return GPT(
            GPTConfig(vocab_size=vocab, block_size=max(block, seq_len), n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        )

    return build


def _llama(**kw) -> Callable[[int], nn.Module]:
    def build(seq_len: int) -> nn.Module:
        return Llama(LlamaConfig(max_seq_len=max(seq_len, 4096), **kw))

    return build


PRESETS: dict[str, Preset] = {
    "demo": Preset("demo", "gpt", _gpt(4, 4, 128, vocab=256, block=128), 256, None, "the demo's character-level GPT"),
    "gpt2-small": Preset("gpt2-small", "gpt", _gpt(12, 12, 768), 50257, 1024, "GPT-2 124M"),
    "gpt2-medium": Preset("gpt2-medium", "gpt", _gpt(24, 16, 1024), 50257, 1024, "GPT-2 350M"),
    "gpt2-large": Preset("gpt2-large", "gpt", _gpt(36, 20, 1280), 50257, 1024, "GPT-2 774M"),
    "gpt2-xl": Preset("gpt2-xl", "gpt", _gpt(48, 25, 1600), 50257, 1024, "GPT-2 1.5B"),
    "llama-1b": Preset(
        "llama-1b",
        "llama",
        _llama(
            vocab_size=128256,
            n_layer=16,
            n_head=32,
            n_kv_head=8,
            n_embd=2048,
            intermediate_size=8192,
            rope_theta=500000.0,
            tie_weights=True,
        ),
        128256,
        None,
        "Llama 3.2 1B shape (GQA, 8 KV heads, tied embeddings)",
    ),
    "llama-7b": Preset(
        "llama-7b",
        "llama",
        _llama(vocab_size=32000, n_layer=32, n_head=32, n_kv_head=32, n_embd=4096, intermediate_size=11008),
        32000,
        None,
        "Llama 2 7B shape",
    ),
    "llama3-8b": Preset(
        "llama3-8b",
        "llama",
        _llama(
            vocab_size=128256,
            n_layer=32,
            n_head=32,
            n_kv_head=8,
            n_embd=4096,
            intermediate_size=14336,
            rope_theta=500000.0,
        ),
        128256,
        None,
        "Llama 3 8B shape (GQA, 8 KV heads)",
    ),
    "llama-13b": Preset(
        "llama-13b",
        "llama",
        _llama(vocab_size=32000, n_layer=40, n_head=40, n_kv_head=40, n_embd=5120, intermediate_size=13824),
        32000,
        None,
        "Llama 2 13B shape",
    ),
    "llama-30b": Preset(
        "llama-30b",
        "llama",
        _llama(vocab_size=32000, n_layer=60, n_head=52, n_kv_head=52, n_embd=6656, intermediate_size=17920),
        32000,
        None,
        "LLaMA 30B shape (32.5B parameters; Llama 2 vocabulary)",
    ),
    "llama-70b": Preset(
        "llama-70b",
        "llama",
        _llama(vocab_size=32000, n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, intermediate_size=28672),
        32000,
        None,
        "Llama 2 70B shape (GQA, 8 KV heads)",
    ),
}


def get_preset(name: str) -> Preset:
    """The preset called ``name``.

    Raises:
        ValueError: naming ``name`` and listing the presets.
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; presets: {', '.join(PRESETS)} (or hf:<model_type> with transformers)"
        ) from None
