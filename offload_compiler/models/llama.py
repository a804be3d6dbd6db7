"""A Llama-style decoder: RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query attention.

Shapes: ``forward(idx [batch, seq] int64) -> logits [batch, seq, vocab_size]``. Written from the
published architecture (Touvron et al., "LLaMA" and "Llama 2", 2023): pre-norm blocks with
RMSNorm (Zhang & Sennrich, 2019), rotary embeddings (Su et al., "RoFormer", 2021) on queries and
keys, SwiGLU feed-forward (Shazeer, "GLU Variants Improve Transformer", 2020), and grouped-query
attention (Ainslie et al., 2023) with ``n_kv_head`` key/value heads shared by ``n_head`` queries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LlamaConfig", "Llama", "RMSNorm"]


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of the model.

    Attributes:
        vocab_size, n_layer, n_head, n_embd: vocabulary, depth, query heads, width.
        n_kv_head: key/value heads (``n_head % n_kv_head == 0``; equal to ``n_head`` is plain
            multi-head attention).
        intermediate_size: width of the SwiGLU hidden layer.
        max_seq_len: longest sequence the rotary table covers.
        rope_theta: rotary base.
        norm_eps: RMSNorm epsilon.
        tie_weights: share the token embedding with the output projection.
    """

    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    n_kv_head: int = 32
    n_embd: int = 4096
    intermediate_size: int = 11008
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_weights: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"LlamaConfig: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"LlamaConfig: n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(f"LlamaConfig: head dim {self.n_embd // self.n_head} must be even for rotary embeddings")


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q = nn.Linear(cfg.n_embd, cfg.n_head * self.head_dim, bias=False)
        self.k = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.v = nn.Linear(cfg.n_embd, cfg.n_kv_head * self.head_dim, bias=False)
        self.o = nn.Linear(cfg.n_head * self.head_dim, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # Head counts from the projections' widths (the -1s): a tensor-parallel shard holds
        # n_head / tp query and n_kv_head / tp key/value heads, in the same ratio.
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if self.n_kv_head != self.n_head:
            repeat = self.n_head // self.n_kv_head
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Llama decoder. ``forward(idx [B, T] int64) -> logits [B, T, vocab_size]``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok.weight
        head_dim = cfg.n_embd // cfg.n_head
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        std = 0.02
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)) and m.weight.device.type != "meta":
                nn.init.normal_(m.weight, mean=0.0, std=std)
        for name, p in self.named_parameters():
            if (name.endswith("o.weight") or name.endswith("down.weight")) and p.device.type != "meta":
                nn.init.normal_(p, mean=0.0, std=std / math.sqrt(2 * cfg.n_layer))

    def rotary(self, seq_len: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[seq_len, head_dim]`` (broadcast over batch and heads)."""
        t = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.to(device))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.cfg.max_seq_len}")
        x = self.tok(idx)
        cos, sin = self.rotary(T, idx.device, x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))
