"""Model-specific pieces the layouts of ``plan --world`` need around PyTorch's own engines.

The engines themselves are stock: ``DistributedDataParallel``, FSDP2's ``fully_shard``,
``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``, and
``torch.distributed.pipelining`` (``PipelineStage``, ``ScheduleGPipe``, ``Schedule1F1B``). What
they cannot know is the model: which linears of a block are column- or row-parallel, how the
project's fused ``qkv`` projection must be laid out so a contiguous shard holds whole heads,
and how to cut the model into pipeline stages. That is here, for the project's two model
families (:mod:`offload_compiler.models`: ``gpt`` and ``llama``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = [
    "TP_LINEARS",
    "tp_divisor_error",
    "tp_plan",
    "interleave_fused_qkv",
    "PipelineStageModule",
    "pipeline_stage_module",
]

# Per family, the linears of one block: (module path inside the block, "colwise" | "rowwise").
# Megatron-LM's split (Shoeybi et al. 2019, section 3): the first linear of attention and MLP
# column-parallel, the second row-parallel, so each block needs one all-reduce per half forward.
TP_LINEARS: dict[str, tuple[tuple[str, str], ...]] = {
    "gpt": (("attn.qkv", "colwise"), ("attn.proj", "rowwise"), ("fc", "colwise"), ("out", "rowwise")),
    "llama": (
        ("attn.q", "colwise"),
        ("attn.k", "colwise"),
        ("attn.v", "colwise"),
        ("attn.o", "rowwise"),
        ("mlp.gate", "colwise"),
        ("mlp.up", "colwise"),
        ("mlp.down", "rowwise"),
    ),
}


def tp_divisor_error(family: str, cfg, tp: int) -> str | None:
    """Why ``tp``-way tensor parallelism cannot split a model of ``family`` with config ``cfg``
    (``None`` when it can): heads, key/value heads and the MLP width must divide by ``tp``."""
    if family not in TP_LINEARS:
        return f"tensor parallelism is planned for the gpt and llama families, not {family!r}"
    sizes = {"attention heads": cfg.n_head}
    if family == "llama":
        sizes["key/value heads"] = cfg.n_kv_head
        sizes["MLP width"] = cfg.intermediate_size
    for what, n in sizes.items():
        if n % tp:
            return f"{n} {what} do not divide by tp={tp}"
    return None


def tp_plan(family: str) -> dict[str, str]:
    """``{module path in a block: "colwise" | "rowwise"}`` for ``family``.

    Raises:
        ValueError: for a family without a plan.
    """
    if family not in TP_LINEARS:
        raise ValueError(f"no tensor-parallel plan for model family {family!r}; known: {', '.join(TP_LINEARS)}")
    return dict(TP_LINEARS[family])


@torch.no_grad()
def interleave_fused_qkv(linear: nn.Linear, tp: int) -> None:
    """Reorder a fused ``qkv`` projection's output rows (weight ``[3C, C]``, bias ``[3C]``) from
    ``[q; k; v]`` to ``[q_0; k_0; v_0; q_1; ...]``, the rows of tensor-parallel rank ``r``'s heads
    together, so ``ColwiseParallel``'s contiguous shard of rank ``r`` is that rank's ``q, k, v``.

    The GPT's attention splits its projection with ``chunk(3)`` and counts heads from widths,
    so after this the sharded model computes exactly what the unsharded one did (the state dict's
    ``qkv`` rows are in the interleaved order). Call it before ``parallelize_module``.

    Raises:
        ValueError: if the output width is not ``3 * C`` with ``C`` divisible by ``tp``.
    """
    out = linear.weight.shape[0]
    if out % 3 or (out // 3) % tp:
        raise ValueError(f"interleave_fused_qkv: output width {out} is not 3 x C with C divisible by tp={tp}")
    c = out // 3
    idx = torch.arange(out).view(3, tp, c // tp).transpose(0, 1).reshape(-1)
    linear.weight.copy_(linear.weight[idx])
    if linear.bias is not None:
        linear.bias.copy_(linear.bias[idx])


class PipelineStageModule(nn.Module):
    """One pipeline stage of a project GPT or Llama: the embedding (first stage), a contiguous
    range of blocks, the final norm and the head (last stage).

    ``forward`` takes token ids ``[B, T]`` (int64) on the first stage, hidden states
    ``[B, T, C]`` otherwise; returns hidden states, or logits ``[B, T, vocab]`` on the last.
    ``tied`` is the embedding/head weight when the model ties them and this stage holds one end
    (the other end's stage holds the other copy: sum their gradients, see the layout script).
    """

    def __init__(self, model: nn.Module, family: str, first: bool, last: bool, blocks: list[nn.Module]):
        super().__init__()
        self.family, self.first, self.last = family, first, last
        self.tok = model.tok if first else None
        self.pos = getattr(model, "pos", None) if first else None
        self.blocks = nn.ModuleList(blocks)
        self.norm = (model.ln_f if family == "gpt" else model.norm) if last else None
        self.head = model.head if last else None
        self._rotary = model.rotary if family == "llama" else None
        if family == "llama":
            self.register_buffer("inv_freq", model.inv_freq, persistent=False)
        tied = model.head.weight is model.tok.weight
        self.tied = model.tok.weight if tied and (first or last) and not (first and last) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            T = x.shape[1]
            idx = x
            x = self.tok(idx)
            if self.pos is not None:
                x = x + self.pos(torch.arange(T, device=idx.device))
        if self.family == "llama":
            t = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq.to(x.device))
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
            for block in self.blocks:
                x = block(x, cos, sin)
        else:
            for block in self.blocks:
                x = block(x)
        if self.last:
            x = self.head(self.norm(x))
        return x


def pipeline_stage_module(model: nn.Module, family: str, stage: int, num_stages: int) -> PipelineStageModule:
    """Stage ``stage`` of ``num_stages`` of ``model`` (blocks split as evenly as possible, the
    earlier stages taking the remainder: stage sizes ``ceil`` then ``floor`` of ``n / stages``).

    Raises:
        ValueError: for a stage out of range, more stages than blocks, or an unknown family.
    """
    if family not in ("gpt", "llama"):
        raise ValueError(f"pipeline stages are cut for the gpt and llama families, not {family!r}")
    blocks = list(model.blocks)
    if not 0 <= stage < num_stages or num_stages > len(blocks):
        raise ValueError(f"stage {stage} of {num_stages}: need 0 <= stage < stages <= {len(blocks)} blocks")
    base, extra = divmod(len(blocks), num_stages)
    start = stage * base + min(stage, extra)
    end = start + base + (1 if stage < extra else 0)
    return PipelineStageModule(model, family, stage == 0, stage == num_stages - 1, blocks[start:end])
