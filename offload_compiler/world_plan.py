"""``python -m offload_compiler plan --world N``: how should N GPUs on K nodes split this model?

Enumerates the layouts PyTorch's own engines run and scores each one:

* data parallel: ``DistributedDataParallel`` (optionally with trinity's adaptive PowerSGD hook,
  :mod:`offload_compiler.comm`), FSDP2 ``fully_shard`` with and without
  ``reshard_after_forward``, and HSDP (``fully_shard`` on a 2-D mesh: sharded inside a node,
  replicated across nodes);
* tensor parallel inside a node: ``parallelize_module`` with ``ColwiseParallel`` /
  ``RowwiseParallel`` on each block's linears (Megatron-LM's split, :mod:`.layouts`);
* pipeline stages: ``torch.distributed.pipelining`` with ``ScheduleGPipe`` or ``Schedule1F1B``
  and a micro-batch count;
* and, per stage, trinity's offload plan where the stage does not fit without one.

**The single-GPU plan of a stage** comes from :func:`offload_compiler.plan_cli.plan_model`, the
function ``plan`` uses (fake-tensor trace, liveness, cost model, planner, simulator), applied to
the stage as a model of its own: the preset cut to the stage's blocks and, for tensor
parallelism, with each block's parallel linears narrowed to one rank's shard. Without offloading,
the peak and the compute time of a stack of identical blocks are linear in the number of blocks
(measured: gpt2-small and llama-1b, 1, 2 and 12/16 blocks agree to the byte and to 1e-12 s), so
two small traces (one and two blocks) give every depth; a stage that needs offloading is traced
and planned whole, at the budget the layout leaves it. Each stage is planned with the
embedding and the head (an upper bound for middle stages).

**Memory per GPU** = what the engine holds + the stage's working memory. The working memory
``W`` is the single-GPU plan's peak minus its parameters and optimizer state (activations,
temporaries and the gradients live at that peak). The engine holds: DDP the parameters and
optimizer state (and, with PowerSGD, an error-feedback copy of the gradients); FSDP2 a
``1/shard`` slice of parameters, gradients and optimizer state plus the unsharded root unit
(embedding and head: FSDP2 keeps the root unsharded) and two unsharded blocks (the one running
and the one prefetched), or every parameter unsharded with ``reshard_after_forward=False``
(counting ``W``'s gradients as well is on the safe side for FSDP2, which frees a block's
unsharded gradients after its reduce-scatter). Pipeline stages hold ``k`` micro-batches'
activations: all ``m`` with GPipe, ``min(m, stages)`` with 1F1B (Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC21): the stage is
planned at ``k`` micro-batches' batch.

**Time** comes from the existing timeline simulator (:func:`.passes.simulate.simulate`): the
stage's compute as a sequence of per-block forward and backward steps (forward a third of a
block's time, backward two thirds: the 2N/4N FLOPs of Kaplan et al. 2020), the collectives as
copies on two channels (all-gathers on one stream, reduce-scatters and all-reduces on the
other, as FSDP2 and DDP issue them), each timed by the alpha-beta model of
:mod:`.collectives`. Tensor parallelism's four all-reduces per block per micro-batch sit on the
critical path. A pipeline step is ``(m + stages - 1)`` micro-batch times (the bubble) plus the
point-to-point sends of the fill and drain, with the data-parallel gradient reduction overlapped
with the last micro-batch's backward. Not modelled: the optimizer update (``plan`` leaves it out
too), the compute slow-down of kernels that share the GPU with communication kernels, and the
difference between first, middle and last pipeline stages.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn as nn

from .collectives import LINKS, NETWORKS, Cluster, Group, load_link
from .devices import KNOWN_DEVICES, DeviceSpec, lookup_device
from .layouts import TP_LINEARS, tp_divisor_error
from .options import format_bytes, parse_size
from .passes.simulate import CopyTask, simulate

__all__ = [
    "StageProfile",
    "OffloadRow",
    "Layout",
    "LayoutScore",
    "WorldPlan",
    "DP_KINDS",
    "stage_preset",
    "profile_stage",
    "enumerate_layouts",
    "score_layout",
    "compressed_numel",
    "plan_world",
    "layout_script",
    "frontier_png",
    "main",
]

DP_KINDS = ("none", "ddp", "ddp+powersgd", "fsdp", "fsdp-keep", "hsdp")
_DP_TEXT = {
    "none": "no data parallelism",
    "ddp": "DDP",
    "ddp+powersgd": "DDP + adaptive PowerSGD",
    "fsdp": "FSDP2 (reshard after forward)",
    "fsdp-keep": "FSDP2 (reshard_after_forward=False)",
    "hsdp": "HSDP (FSDP2 on a 2-D mesh)",
}
_SHORT = {"none": "-", "ddp": "DDP", "ddp+powersgd": "DDP+PowerSGD", "fsdp": "FSDP2", "fsdp-keep": "FSDP2 keep"}
_SHORT["hsdp"] = "HSDP"
_ELEM = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_DTYPES.update(float16=torch.float16, fp16=torch.float16)


# ------------------------------------------------------------------------------------------
# Stage models and their single-GPU plans


def _base_preset(model: str):
    from .models.presets import get_preset

    if model.startswith("hf:"):
        raise ValueError(
            f"plan --world plans the project's presets (their blocks, tensor-parallel linears and stages are "
            f"known); {model!r} is not one: use a preset name"
        )
    return get_preset(model)


def stage_preset(base, blocks: int, tp: int = 1):
    """A :class:`~.models.presets.Preset` for one pipeline stage / tensor-parallel shard of
    ``base``: its first ``blocks`` blocks (embedding and head kept) and, for ``tp > 1``, each
    block's column-parallel linears narrowed to ``out / tp`` outputs and row-parallel ones to
    ``in / tp`` inputs (:data:`.layouts.TP_LINEARS`): the model one rank runs, without the
    all-reduces.

    Raises:
        ValueError: for ``blocks < 1``, more blocks than the model has, or a ``tp`` the model
            cannot split (:func:`.layouts.tp_divisor_error`).
    """
    with torch.device("meta"):
        probe = base.build(8)
    n_layer = len(probe.blocks)
    if not 1 <= blocks <= n_layer:
        raise ValueError(f"stage of {blocks} blocks: the model has {n_layer}")
    if tp > 1:
        why = tp_divisor_error(base.family, probe.cfg, tp)
        if why:
            raise ValueError(f"tp={tp}: {why}")

    def build(seq_len: int) -> nn.Module:
        m = base.build(seq_len)
        m.blocks = nn.ModuleList(list(m.blocks)[:blocks])
        if tp > 1:
            for block in m.blocks:
                for path, kind in TP_LINEARS[base.family]:
                    parent_path, _, leaf = path.rpartition(".")
                    parent = block.get_submodule(parent_path) if parent_path else block
                    old: nn.Linear = getattr(parent, leaf)
                    i, o = old.in_features, old.out_features
                    i, o = (i, o // tp) if kind == "colwise" else (i // tp, o)
                    setattr(parent, leaf, nn.Linear(i, o, bias=old.bias is not None, device=old.weight.device))
        return m

    return replace(base, name=f"{base.name}[{blocks} blocks, tp={tp}]", build=build)


@dataclass(frozen=True)
class StageProfile:
    """Single-GPU plan of a stage without offloading, linear in its number of blocks.

    Bytes and seconds for ``batch`` sequences of ``seq_len`` tokens on one rank of a
    ``tp``-way tensor-parallel group. ``fixed_*`` is the part outside the blocks (embedding,
    head, loss), ``block_*`` one block's. ``*_work_bytes``: peak minus parameters and optimizer
    state (see the module docstring). ``seconds``: forward plus backward compute.
    ``optimizer_factor``: optimizer-state bytes per parameter byte (``plan``'s convention).
    ``block_shapes`` / ``fixed_shapes``: the parameters' shapes (for gradient compression).
    """

    tp: int
    batch: int
    seq_len: int
    hidden: int
    elem_bytes: int
    fixed_param_bytes: int
    block_param_bytes: int
    fixed_work_bytes: int
    block_work_bytes: int
    fixed_seconds: float
    block_seconds: float
    optimizer_factor: float
    block_shapes: tuple[tuple[int, ...], ...] = ()
    fixed_shapes: tuple[tuple[int, ...], ...] = ()

    def param_bytes(self, blocks: int) -> int:
        return self.fixed_param_bytes + blocks * self.block_param_bytes

    def work_bytes(self, blocks: int) -> int:
        return self.fixed_work_bytes + blocks * self.block_work_bytes

    def seconds(self, blocks: int) -> float:
        return self.fixed_seconds + blocks * self.block_seconds


@dataclass(frozen=True)
class OffloadRow:
    """A stage's trinity plan at a budget: ``budget_bytes`` is the ``memory_budget`` of the
    stage's plan (its own accounting: parameters, optimizer state and working memory);
    ``work_bytes`` the planned working memory; ``seconds`` the predicted step (compute plus
    exposed copies) of the ``k`` micro-batches it was planned for."""

    budget_bytes: int
    feasible: bool
    work_bytes: int
    seconds: float
    exposed_seconds: float
    evicted_bytes: int
    lowest_work_bytes: int


def _shapes(model: nn.Module) -> tuple[tuple, tuple]:
    block_ids = {id(p) for b in model.blocks for p in b.parameters()}
    block = tuple(tuple(p.shape) for p in model.blocks[0].parameters())
    seen, fixed = set(), []
    for p in model.parameters():
        if id(p) not in block_ids and id(p) not in seen:
            seen.add(id(p))
            fixed.append(tuple(p.shape))
    return block, tuple(fixed)


def profile_stage(
    base, tp: int, batch: int, seq_len: int, device: DeviceSpec, dtype: torch.dtype, optimizer: str
) -> StageProfile:
    """Plan one- and two-block stages of ``base`` with :func:`.plan_cli.plan_model` (budget
    ``"100%"``) and return the linear profile (see :class:`StageProfile`).

    Raises:
        ValueError: from :func:`stage_preset` or ``plan_model``.
    """
    from .plan_cli import plan_model

    rows = []
    for blocks in (1, 2):
        r = plan_model(stage_preset(base, blocks, tp), device, ["100%"], batch, seq_len, dtype, optimizer)
        rows.append(r)
    a, b = rows
    work = [r.unplanned_peak_bytes - r.param_bytes - r.optimizer_state_bytes for r in rows]
    with torch.device("meta"):
        m = stage_preset(base, 1, tp).build(seq_len)
    block_shapes, fixed_shapes = _shapes(m)
    return StageProfile(
        tp=tp,
        batch=batch,
        seq_len=seq_len,
        hidden=int(m.cfg.n_embd),
        elem_bytes=_ELEM.get(dtype, 4),
        fixed_param_bytes=2 * a.param_bytes - b.param_bytes,
        block_param_bytes=b.param_bytes - a.param_bytes,
        fixed_work_bytes=2 * work[0] - work[1],
        block_work_bytes=work[1] - work[0],
        fixed_seconds=2 * a.compute_seconds - b.compute_seconds,
        block_seconds=b.compute_seconds - a.compute_seconds,
        optimizer_factor=a.optimizer_state_bytes / a.param_bytes if a.param_bytes else 0.0,
        block_shapes=block_shapes,
        fixed_shapes=fixed_shapes,
    )


def _offload_rows(
    base, tp, blocks, batch, seq_len, device, dtype, optimizer, budgets: list[int]
) -> dict[int, OffloadRow]:
    """Trinity plans of the whole stage at each budget (bytes, ``plan_model``'s accounting)."""
    from .plan_cli import plan_model

    r = plan_model(
        stage_preset(base, blocks, tp), device, [str(int(b)) for b in budgets], batch, seq_len, dtype, optimizer
    )
    fixed = r.param_bytes + r.optimizer_state_bytes
    out = {}
    for b, row in zip(budgets, r.rows):
        out[b] = OffloadRow(
            budget_bytes=int(b),
            feasible=bool(row.feasible),
            work_bytes=int(row.planned_peak_bytes - fixed),
            seconds=float(row.predicted_step_seconds),
            exposed_seconds=float(row.exposed_seconds),
            evicted_bytes=int(row.evicted_bytes),
            lowest_work_bytes=int(row.lowest_reachable_bytes - fixed),
        )
    return out


# ------------------------------------------------------------------------------------------
# Layouts


@dataclass(frozen=True)
class Layout:
    """Degrees and engines of one layout: ``dp * tp * pp`` GPUs.

    ``dp_kind`` is one of :data:`DP_KINDS`; ``replicate`` the HSDP replica count (the shard
    group is ``dp / replicate``); ``schedule`` ``"gpipe"`` or ``"1f1b"`` for ``pp > 1``;
    ``microbatches`` per step and data-parallel rank."""

    dp: int
    tp: int
    pp: int
    dp_kind: str
    schedule: str | None = None
    microbatches: int = 1
    replicate: int = 1

    @property
    def shard(self) -> int:
        return self.dp // self.replicate if self.dp_kind == "hsdp" else self.dp

    @property
    def inflight(self) -> int:
        """Micro-batches whose activations a stage holds at once."""
        if self.pp == 1:
            return 1
        return self.microbatches if self.schedule == "gpipe" else min(self.microbatches, self.pp)

    def label(self) -> str:
        parts = [f"dp={self.dp}" + (f" {self.dp_kind}" if self.dp_kind != "none" else "")]
        if self.dp_kind == "hsdp":
            parts[0] += f" ({self.replicate}x{self.shard})"
        parts.append(f"tp={self.tp}")
        parts.append(f"pp={self.pp}" + (f" {self.schedule} m={self.microbatches}" if self.pp > 1 else ""))
        return ", ".join(parts)


def enumerate_layouts(
    world: int, gpus_per_node: int, n_layer: int, batch: int, tp_ok: Callable[[int], bool]
) -> list[Layout]:
    """Every layout of ``world`` GPUs the engines run for a model of ``n_layer`` blocks and a
    global ``batch`` (sequences per step): ``tp`` divides the GPUs of a node and passes
    ``tp_ok``; ``pp <= n_layer``; ``batch`` divides into ``dp`` ranks and ``m`` micro-batches
    (``m`` in ``pp, 2 pp, 4 pp, 8 pp`` and ``batch / dp``, at least ``pp``); DDP does not
    combine with tensor parallelism (DDP has no DTensor support: FSDP2 does), PowerSGD and
    ``reshard_after_forward=True`` not with pipelining (torchtitan's policy: stages keep their
    parameters unsharded across micro-batches); HSDP only where the data-parallel group spans
    nodes."""
    out: list[Layout] = []
    for tp in range(1, gpus_per_node + 1):
        if gpus_per_node % tp or world % tp or not tp_ok(tp):
            continue
        for pp in range(1, min(n_layer, world // tp) + 1):
            if (world // tp) % pp:
                continue
            dp = world // (tp * pp)
            if batch % dp:
                continue
            per_dp = batch // dp
            kinds = ["none"] if dp == 1 else ["ddp", "ddp+powersgd", "fsdp", "fsdp-keep"]
            if tp > 1:
                kinds = [k for k in kinds if not k.startswith("ddp")]
            if pp > 1:
                kinds = [k for k in kinds if k not in ("ddp+powersgd", "fsdp")]
            spans = dp * tp > gpus_per_node
            if dp > 1 and spans:
                shard = gpus_per_node // tp
                if 1 < shard < dp and dp % shard == 0:
                    kinds.append("hsdp")
            for kind in kinds:
                rep = dp // (gpus_per_node // tp) if kind == "hsdp" else 1
                if pp == 1:
                    out.append(Layout(dp, tp, pp, kind, None, 1, rep))
                    continue
                ms = sorted({m for m in (pp, 2 * pp, 4 * pp, 8 * pp, per_dp) if pp <= m <= per_dp and per_dp % m == 0})
                for m in ms:
                    for schedule in ("gpipe", "1f1b"):
                        out.append(Layout(dp, tp, pp, kind, schedule, m, rep))
    return out


# ------------------------------------------------------------------------------------------
# Scoring


@dataclass(frozen=True)
class LayoutScore:
    """A layout's predicted per-GPU peak (bytes) and step (seconds).

    ``engine_bytes``: what DDP/FSDP2 hold (parameters, gradients and optimizer state, sharded or
    not, unsharded working parameters); ``work_bytes``: the stage's working memory;
    ``comm_exposed_seconds``: communication on the critical path (DP stalls, TP all-reduces,
    pipeline sends); ``copy_exposed_seconds``: trinity's exposed host copies;
    ``comm_bytes``: bytes one GPU sends per step (ring volumes); ``offload_budget_bytes``: the
    trinity ``memory_budget`` of the stage plan (``None``: no offloading)."""

    layout: Layout
    stage_blocks: int
    peak_bytes: int
    engine_bytes: int
    work_bytes: int
    step_seconds: float
    compute_seconds: float
    comm_exposed_seconds: float
    copy_exposed_seconds: float
    comm_bytes: float
    tokens_per_s: float
    fits: bool
    offload_budget_bytes: int | None = None
    evicted_bytes: int = 0
    compression_rank: int | None = None

    def label(self) -> str:
        extra = f", trinity budget {format_bytes(self.offload_budget_bytes)}" if self.offload_budget_bytes else ""
        return self.layout.label() + extra


def compressed_numel(shape: tuple[int, ...], rank: int) -> tuple[int, bool]:
    """Elements PowerSGD sends for a gradient of ``shape`` at ``rank`` and whether it is
    compressed: a matrix view ``[n, m]`` (first dimension by the rest, as torch's hook) is sent
    as ``(n + m) * rank`` elements when that is at most half of ``n * m`` (the adaptive hook's
    cap, :mod:`offload_compiler.comm`); vectors and small matrices go uncompressed."""
    numel = math.prod(shape)
    if len(shape) < 2:
        return numel, False
    n, m = shape[0], numel // shape[0]
    r = min(rank, n, m)
    if 2 * (n + m) * r <= numel:
        return (n + m) * r, True
    return numel, False


def _powersgd_cost(shapes, rank: int, elem: int, device: DeviceSpec, dtype) -> tuple[float, float, float]:
    """``(P bytes, Q and uncompressed bytes, compute seconds)`` of one PowerSGD round over the
    gradients of ``shapes``: P = M Q, Q = M^T P and the decompression P Q^T are ``2 n m r``
    FLOPs each; error feedback reads and writes the gradient about six times (add the error,
    keep a copy, form the new error)."""
    p_bytes = q_bytes = flops = grad_bytes = 0
    for shape in shapes:
        numel = math.prod(shape)
        grad_bytes += numel * elem
        sent, compressed = compressed_numel(shape, rank)
        if compressed:
            n, m = shape[0], numel // shape[0]
            r = min(rank, n, m)
            p_bytes += n * r * elem
            q_bytes += m * r * elem
            flops += 6 * n * m * r
        else:
            p_bytes += numel * elem  # uncompressed tensors travel with the first round
    seconds = flops / device.peak_flops(dtype) + 6 * grad_bytes / device.hbm_bytes_per_s
    return p_bytes, q_bytes, seconds


def score_layout(
    layout: Layout,
    prof: StageProfile,
    n_layer: int,
    batch: int,
    cluster: Cluster,
    device: DeviceSpec,
    dtype: torch.dtype = torch.bfloat16,
    compression_rank: int = 4,
    offload: OffloadRow | None = None,
) -> LayoutScore:
    """Predict ``layout``'s per-GPU peak and step (see the module docstring).

    ``prof`` is the stage profile at ``layout.inflight`` micro-batches' batch (its ``tp`` equal
    to the layout's); ``offload`` replaces the stage's working memory and compute with a trinity
    plan. ``batch`` is the global batch (sequences per step).

    Raises:
        ValueError: when ``prof`` does not match the layout.
    """
    lay = layout
    if prof.tp != lay.tp:
        raise ValueError(f"score_layout: profile for tp={prof.tp}, layout has tp={lay.tp}")
    gpn = cluster.gpus_per_node
    blocks = -(-n_layer // lay.pp)
    k = lay.inflight
    per_dp = batch // lay.dp
    b_mb = per_dp // lay.microbatches
    if prof.batch != k * b_mb:
        raise ValueError(f"score_layout: profile planned at batch {prof.batch}, the layout's stage holds {k * b_mb}")
    P_s = prof.param_bytes(blocks)
    opt = prof.optimizer_factor * P_s
    work = prof.work_bytes(blocks)
    t_all = prof.seconds(blocks)
    copy_exposed = 0.0
    if offload is not None:
        work, copy_exposed = offload.work_bytes, offload.exposed_seconds / k
        t_scale = offload.seconds / t_all if t_all else 1.0
    else:
        t_scale = 1.0
    block_t = prof.block_seconds * t_scale / k
    fixed_t = prof.fixed_seconds * t_scale / k
    block_P, fixed_P = prof.block_param_bytes, prof.fixed_param_bytes

    # Memory the engine holds.
    kind, d = lay.dp_kind, lay.shard
    if kind in ("none", "ddp"):
        engine = P_s + opt
    elif kind == "ddp+powersgd":
        engine = 2 * P_s + opt  # error feedback keeps one gradient-sized tensor per bucket
    elif kind == "fsdp-keep":
        engine = (2 * P_s + opt) / d + P_s
    else:  # fsdp, hsdp
        engine = (2 * P_s + opt) / d + fixed_P + 2 * block_P
    engine = int(math.ceil(engine))
    peak = engine + int(work)

    # Groups (mesh order pp, dp, tp: tp innermost, inside a node).
    tp_group = Group(lay.tp, lay.tp)
    dp_group = Group(lay.dp, max(1, min(lay.dp, gpn // lay.tp)))
    shard_group = Group(d, max(1, min(d, gpn // lay.tp)))
    rep_group = Group(lay.replicate, 1)
    act = b_mb * prof.seq_len * prof.hidden * prof.elem_bytes
    tp_ar = cluster.seconds("all_reduce", act, tp_group) if lay.tp > 1 else 0.0
    block_f = block_t / 3 + 2 * tp_ar
    block_b = 2 * block_t / 3 + 2 * tp_ar
    fixed_f, fixed_b = fixed_t / 3, 2 * fixed_t / 3
    mb_seconds = blocks * (block_t + 4 * tp_ar) + fixed_t

    hook_seconds = 0.0
    if kind == "ddp+powersgd":
        bp, bq, hook_seconds = _powersgd_cost(prof.block_shapes, compression_rank, prof.elem_bytes, device, dtype)
        fp, fq, fixed_hook = _powersgd_cost(prof.fixed_shapes, compression_rank, prof.elem_bytes, device, dtype)
        block_b += hook_seconds
        fixed_b += fixed_hook

    comm_bytes = 0.0

    def ring(op, nbytes, group):
        nonlocal comm_bytes
        if group.size > 1:
            factor = 2 * (group.size - 1) / group.size if op == "all_reduce" else (group.size - 1) / group.size
            comm_bytes += factor * nbytes
        return cluster.seconds(op, nbytes, group)

    def grad_sync(pos, nbytes, which, tasks):
        """The collectives that reduce ``nbytes`` of gradients, issued at ``pos``."""
        if nbytes <= 0:
            return
        if kind == "ddp":
            tasks.append(("d2h", ring("all_reduce", nbytes, dp_group), pos))
        elif kind == "ddp+powersgd":
            p, q = (bp, bq) if which == "block" else (fp, fq)
            tasks.append(("d2h", ring("all_reduce", p, dp_group) + ring("all_reduce", q, dp_group), pos))
        elif kind in ("fsdp", "fsdp-keep", "hsdp"):
            tasks.append(("d2h", ring("reduce_scatter", nbytes, shard_group), pos))
            if kind == "hsdp":
                tasks.append(("d2h", ring("all_reduce", nbytes / d, rep_group), pos))

    gathers = kind in ("fsdp", "fsdp-keep", "hsdp")
    back_gathers = kind in ("fsdp", "hsdp")
    tasks: list[tuple[str, float, int]] = []  # (channel, seconds, issue position); waited at the position below
    waits: list[int] = []
    if lay.pp == 1:
        steps = [block_f] * blocks + [fixed_f, fixed_b] + [block_b] * blocks
        n = len(steps)
        if gathers:
            if fixed_P > 0:
                tasks.append(("h2d", ring("all_gather", fixed_P, shard_group), 0))
                waits.append(0)
            for i in range(blocks):
                tasks.append(("h2d", ring("all_gather", block_P, shard_group), max(0, i - 1)))
                waits.append(i)
        if back_gathers:
            for j in range(blocks):
                pos = blocks + 2 + j
                tasks.append(("h2d", ring("all_gather", block_P, shard_group), pos - 1))
                waits.append(pos)
        for j in range(blocks):
            before = len(tasks)
            grad_sync(blocks + 3 + j, block_P, "block", tasks)
            waits.extend([n] * (len(tasks) - before))
        before = len(tasks)
        grad_sync(n, fixed_P, "fixed", tasks)
        waits.extend([n] * (len(tasks) - before))
        p2p_exposed = 0.0
    else:
        total = (lay.microbatches + lay.pp - 1) * mb_seconds
        edge = blocks * block_f + fixed_b + blocks * block_b
        steps = [block_f] * blocks + [max(0.0, total - edge)] + [fixed_b] + [block_b] * blocks
        n = len(steps)
        if gathers:
            if fixed_P > 0:
                tasks.append(("h2d", ring("all_gather", fixed_P, shard_group), 0))
                waits.append(0)
            for i in range(blocks):
                tasks.append(("h2d", ring("all_gather", block_P, shard_group), max(0, i - 1)))
                waits.append(i)
        for j in range(blocks):
            before = len(tasks)
            grad_sync(blocks + 3 + j, block_P, "block", tasks)
            waits.extend([n] * (len(tasks) - before))
        before = len(tasks)
        grad_sync(n, fixed_P, "fixed", tasks)
        waits.extend([n] * (len(tasks) - before))
        spans = cluster.nodes > 1 and lay.dp * lay.tp >= gpn
        p2p = cluster.seconds("send_recv", act, Group(2, 1 if spans else 2))
        comm_bytes += 2 * lay.microbatches * act
        p2p_exposed = 2 * (lay.pp - 1) * p2p
    copies = [
        CopyTask(i, ch, s, min(pos, n), max(min(pos, n), w)) for i, ((ch, s, pos), w) in enumerate(zip(tasks, waits))
    ]
    timeline = simulate(steps, copies)
    step = timeline.step_seconds + p2p_exposed
    tp_exposed = 4 * tp_ar * blocks * lay.microbatches
    compute = lay.microbatches * (mb_seconds - 4 * tp_ar * blocks) + (
        hook_seconds * blocks if kind == "ddp+powersgd" else 0
    )
    if tp_ar:
        comm_bytes += 4 * blocks * lay.microbatches * 2 * (lay.tp - 1) / lay.tp * act
    return LayoutScore(
        layout=lay,
        stage_blocks=blocks,
        peak_bytes=peak,
        engine_bytes=engine,
        work_bytes=int(work),
        step_seconds=step,
        compute_seconds=compute,
        comm_exposed_seconds=timeline.exposed_seconds + tp_exposed + p2p_exposed,
        copy_exposed_seconds=copy_exposed * lay.microbatches,
        comm_bytes=comm_bytes,
        tokens_per_s=batch * prof.seq_len / step if step > 0 else float("inf"),
        fits=peak <= device.memory_bytes and (offload is None or offload.feasible),
        offload_budget_bytes=offload.budget_bytes if offload is not None else None,
        evicted_bytes=offload.evicted_bytes if offload is not None else 0,
        compression_rank=compression_rank if kind == "ddp+powersgd" else None,
    )


# ------------------------------------------------------------------------------------------
# The whole search


@dataclass(frozen=True)
class WorldPlan:
    """Result of :func:`plan_world`: every scored layout (fitting ones first, fastest first;
    then the rest by peak), the best, whether gradient compression pays, notes, and, when
    nothing fits, why."""

    model: str
    family: str
    world: int
    nodes: int
    gpus_per_node: int
    cluster: Cluster
    device: DeviceSpec
    batch: int
    seq_len: int
    dtype: str
    optimizer: str
    scores: tuple[LayoutScore, ...]
    best: LayoutScore | None
    compression: dict
    notes: tuple[str, ...] = ()
    infeasible: str | None = None
    plan_seconds: float = 0.0
    profiles: dict = field(default_factory=dict, compare=False, repr=False)

    def to_json(self) -> dict:
        """Everything as plain JSON types (bytes, seconds)."""

        def score(s: LayoutScore) -> dict:
            d = asdict(s)
            d["label"] = s.label()
            d["layout"]["engine"] = _DP_TEXT[s.layout.dp_kind]
            return d

        return {
            "model": self.model,
            "family": self.family,
            "world": self.world,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "intra_node": asdict(self.cluster.intra),
            "inter_node": asdict(self.cluster.inter) if self.cluster.inter else None,
            "device": self.device.name,
            "device_memory_bytes": self.device.memory_bytes,
            "device_source": self.device.source,
            "batch": self.batch,
            "seq_len": self.seq_len,
            "dtype": self.dtype,
            "optimizer": self.optimizer,
            "best": score(self.best) if self.best else None,
            "compression": self.compression,
            "infeasible": self.infeasible,
            "notes": list(self.notes),
            "plan_seconds": self.plan_seconds,
            "layouts": [score(s) for s in self.scores],
            "predictions": "cost-model predictions, not measurements",
        }


def _cluster(world: int, nodes: int, interconnect: str | None, intra_node: str) -> Cluster:
    if world < 1 or nodes < 1:
        raise ValueError(f"--world {world} / --nodes {nodes}: both must be >= 1")
    if world % nodes:
        raise ValueError(f"--world {world} does not split evenly over --nodes {nodes}")
    gpn = world // nodes
    if interconnect and (interconnect.endswith(".json") or Path(interconnect).is_file()):
        link = load_link(interconnect)
        return Cluster(gpn, nodes, link, link if nodes > 1 else None)
    if intra_node not in LINKS or LINKS[intra_node].network:
        inside = ", ".join(k for k, v in LINKS.items() if not v.network)
        raise ValueError(f"--intra-node {intra_node!r}: one of {inside}")
    if nodes == 1:
        name = interconnect or intra_node
        if name not in LINKS:
            raise ValueError(
                f"--interconnect {name!r}: one of {', '.join(LINKS)}, or a calibrate --collectives JSON file"
            )
        if LINKS[name].network:
            raise ValueError(
                f"--interconnect {name} joins nodes; with --nodes 1 the GPUs share a node (nvlink or pcie). "
                f"For one GPU per node over {name}, pass --nodes {world}"
            )
        return Cluster(gpn, 1, LINKS[name])
    name = interconnect or "ib-200g"
    if name not in NETWORKS:
        raise ValueError(
            f"--interconnect {name!r}: with --nodes {nodes} it names the network between nodes, one of "
            f"{', '.join(NETWORKS)} (the link inside a node is --intra-node, now {intra_node})"
        )
    return Cluster(gpn, nodes, LINKS[intra_node], LINKS[name])


def _compression_verdict(scores: list[LayoutScore], best: LayoutScore | None, rank: int) -> dict:
    """Whether the adaptive PowerSGD hook pays for the chosen layout on this interconnect."""
    out: dict = {"rank_assumed": rank, "applies": False, "pays": False}
    if best is None:
        out["message"] = "no layout fits, so no verdict on gradient compression"
        return out
    lay = best.layout
    if lay.dp == 1:
        out["message"] = "the chosen layout has no data parallelism: no gradient all-reduce to compress"
        return out

    def key(s):
        # The same degrees and pipeline schedule; each side's own offload budget (the hook's
        # buffers raise the peak, so the two may fit at different offload plans).
        return (s.layout.dp, s.layout.tp, s.layout.pp, s.layout.schedule, s.layout.microbatches)

    def fastest(kind: str) -> dict:
        out: dict = {}
        for s in scores:
            if s.layout.dp_kind == kind and s.fits and (key(s) not in out or s.step_seconds < out[key(s)].step_seconds):
                out[key(s)] = s
        return out

    plain, comp = fastest("ddp"), fastest("ddp+powersgd")
    pairs = [(plain[k], comp[k]) for k in plain if k in comp]
    if not pairs:
        out["message"] = "no DDP layout fits, and PowerSGD is a DDP comm hook (FSDP2's reduce-scatter has none)"
        return out
    if lay.dp_kind in ("ddp", "ddp+powersgd"):
        p, c = next((p, c) for p, c in pairs if key(p) == key(best))
    else:
        p, c = min(pairs, key=lambda pc: min(pc[0].step_seconds, pc[1].step_seconds))
    pays = c.step_seconds < p.step_seconds
    out.update(
        applies=lay.dp_kind in ("ddp", "ddp+powersgd"),
        pays=pays,
        step_plain_seconds=p.step_seconds,
        step_compressed_seconds=c.step_seconds,
        comm_bytes_plain=p.comm_bytes,
        comm_bytes_compressed=c.comm_bytes,
        layout=p.layout.label(),
    )
    change = (c.step_seconds / p.step_seconds - 1) * 100
    verdict = (
        f"compression pays: DDP + adaptive PowerSGD (rank ~{rank}) predicts {c.step_seconds * 1e3:.1f} ms vs "
        f"{p.step_seconds * 1e3:.1f} ms plain ({change:+.0f}%), sending {c.comm_bytes / max(p.comm_bytes, 1):.0%} of "
        "the bytes"
        if pays
        else f"compression does not pay: DDP + adaptive PowerSGD (rank ~{rank}) predicts {c.step_seconds * 1e3:.1f} ms "
        f"vs {p.step_seconds * 1e3:.1f} ms plain ({change:+.0f}%): the all-reduce already hides under the backward "
        "or the compression's compute costs more than it saves"
    )
    if not out["applies"]:
        verdict = (
            f"the chosen layout uses {_DP_TEXT[lay.dp_kind]}, whose reduce-scatter PowerSGD (a DDP comm hook) "
            f"cannot compress; for the best DDP layout ({p.layout.label()}): " + verdict
        )
    out["message"] = verdict
    return out


def plan_world(
    model: str,
    world: int,
    nodes: int = 1,
    interconnect: str | None = None,
    intra_node: str = "nvlink",
    device: DeviceSpec | None = None,
    batch: int | None = None,
    seq_len: int = 1024,
    dtype: torch.dtype = torch.bfloat16,
    optimizer: str = "adamw",
    compression_rank: int = 4,
    max_offload_plans: int = 8,
    progress: Callable[[str], None] | None = None,
) -> WorldPlan:
    """Enumerate, score and rank the layouts of ``world`` GPUs on ``nodes`` nodes for preset
    ``model`` (module docstring). ``batch`` is the global batch in sequences (default: one
    per GPU); ``interconnect`` a key of :data:`.collectives.LINKS` or a ``calibrate
    --collectives`` JSON file; ``intra_node`` the link inside a node when ``nodes > 1``. At most
    ``max_offload_plans`` stages that need offloading are traced and planned whole (the most
    promising first); the rest are named in the notes.

    Raises:
        ValueError: for a bad world, node count, interconnect, model, batch or sequence length,
            naming the value and what is allowed.
    """
    t0 = time.perf_counter()
    say = progress or (lambda _msg: None)
    device = device or KNOWN_DEVICES["h100-sxm"]
    cluster = _cluster(world, nodes, interconnect, intra_node)
    gpn = cluster.gpus_per_node
    base = _base_preset(model)
    if base.max_seq_len is not None and seq_len > base.max_seq_len:
        raise ValueError(f"model {model!r} takes sequences up to {base.max_seq_len}, got --seq-len {seq_len}")
    with torch.device("meta"):
        probe = base.build(8)
    n_layer, cfg = len(probe.blocks), probe.cfg
    batch = world if batch is None else batch
    if batch < 1:
        raise ValueError(f"--batch {batch}: the global batch must be >= 1 sequence")
    dtype_name = str(dtype).replace("torch.", "")
    layouts = enumerate_layouts(world, gpn, n_layer, batch, lambda tp: tp_divisor_error(base.family, cfg, tp) is None)
    if not layouts:
        why = (
            f"no layout of {world} GPUs splits a global batch of {batch} sequences: data-parallel degrees must divide "
            f"the batch, and tensor/pipeline degrees are limited to the {gpn} GPUs of a node (heads: {cfg.n_head}) and "
            f"the {n_layer} blocks"
        )
        return WorldPlan(
            model, base.family, world, nodes, gpn, cluster, device, batch, seq_len, dtype_name, optimizer, (), None,
            {"applies": False, "pays": False, "message": why}, (), why, time.perf_counter() - t0,
        )  # fmt: skip

    profiles: dict[tuple[int, int], StageProfile] = {}

    def profile(tp: int, b: int) -> StageProfile:
        if (tp, b) not in profiles:
            say(f"tracing a tp={tp} stage at batch {b} x {seq_len} (1 and 2 blocks)")
            profiles[(tp, b)] = profile_stage(base, tp, b, seq_len, device, dtype, optimizer)
        return profiles[(tp, b)]

    def stage_batch(lay: Layout) -> int:
        return lay.inflight * (batch // lay.dp // lay.microbatches)

    scores = []
    for lay in layouts:
        prof = profile(lay.tp, stage_batch(lay))
        scores.append(score_layout(lay, prof, n_layer, batch, cluster, device, dtype, compression_rank))

    # Stages that do not fit without offloading: plan them whole at the budget the layout leaves.
    notes: list[str] = []
    wanted: dict[tuple[int, int, int], set[int]] = {}
    for s in scores:
        if s.fits or s.engine_bytes >= device.memory_bytes:
            continue
        prof = profile(s.layout.tp, stage_batch(s.layout))
        p_s = prof.param_bytes(s.stage_blocks)
        budget = int(device.memory_bytes - s.engine_bytes + p_s + prof.optimizer_factor * p_s)
        wanted.setdefault((s.layout.tp, s.stage_blocks, stage_batch(s.layout)), set()).add(budget)
    order = sorted(
        wanted,
        key=lambda k: min(
            x.step_seconds for x in scores if (x.layout.tp, x.stage_blocks, stage_batch(x.layout)) == k and not x.fits
        ),
    )
    rows: dict[tuple[int, int, int], dict[int, OffloadRow]] = {}
    for key in order[:max_offload_plans]:
        tp, blocks, b = key
        say(f"planning trinity offload for a tp={tp} stage of {blocks} blocks at batch {b}")
        rows[key] = _offload_rows(base, tp, blocks, b, seq_len, device, dtype, optimizer, sorted(wanted[key]))
    if len(order) > max_offload_plans:
        notes.append(
            f"{len(order) - max_offload_plans} stage configurations that need offloading were not planned "
            f"(--max-offload-plans {max_offload_plans})"
        )
    for s in list(scores):
        key = (s.layout.tp, s.stage_blocks, stage_batch(s.layout))
        if s.fits or key not in rows:
            continue
        prof = profile(s.layout.tp, stage_batch(s.layout))
        p_s = prof.param_bytes(s.stage_blocks)
        budget = int(device.memory_bytes - s.engine_bytes + p_s + prof.optimizer_factor * p_s)
        row = rows[key].get(budget)
        if row is not None and row.feasible:
            scores.append(
                score_layout(s.layout, prof, n_layer, batch, cluster, device, dtype, compression_rank, offload=row)
            )
    scores.sort(key=lambda s: (not s.fits, s.step_seconds if s.fits else s.peak_bytes))
    fitting = [s for s in scores if s.fits]
    best = fitting[0] if fitting else None
    infeasible = None
    if best is None:
        low = min(scores, key=lambda s: s.peak_bytes)
        lowest_off = [
            (r.lowest_work_bytes, key) for key, rr in rows.items() for r in rr.values()
        ]  # what trinity could reach
        infeasible = (
            f"no layout of {world} x {device.name} ({format_bytes(device.memory_bytes)}) fits {model} at batch {batch} x "
            f"{seq_len}: the smallest per-GPU peak is {format_bytes(low.peak_bytes)} ({low.label()}): "
            f"{format_bytes(low.engine_bytes)} of parameters, gradients and optimizer state held by the engine and "
            f"{format_bytes(low.work_bytes)} of activations and temporaries for {low.stage_blocks} blocks"
        )
        if lowest_off:
            infeasible += (
                f"; offloading every saved activation a stage can evict still leaves "
                f"{format_bytes(min(w for w, _ in lowest_off))} of working memory"
            )
        infeasible += ". More GPUs, a smaller --batch or --seq-len, or --offload all on one GPU (plan) may fit."
    return WorldPlan(
        model=model,
        family=base.family,
        world=world,
        nodes=nodes,
        gpus_per_node=gpn,
        cluster=cluster,
        device=device,
        batch=batch,
        seq_len=seq_len,
        dtype=dtype_name,
        optimizer=optimizer,
        scores=tuple(scores),
        best=best,
        compression=_compression_verdict(scores, best, compression_rank),
        notes=tuple(notes),
        infeasible=infeasible,
        plan_seconds=time.perf_counter() - t0,
        profiles=profiles,
    )


# ------------------------------------------------------------------------------------------
# Output: the frontier, the layout script, the command


def frontier_png(plan: WorldPlan, path: Path) -> Path:
    """Per-GPU peak against predicted step, one point per layout; the Pareto frontier of the
    fitting layouts as a line, the device's memory dashed, the best layout marked (PNG)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    peaks = [s.peak_bytes for s in plan.scores] or [1]
    unit, scale = ("GiB", 2**30) if max(peaks) >= 2**30 else ("MiB", 2**20)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    colors = {"none": "#7f7f7f", "ddp": "#1f77b4", "ddp+powersgd": "#17becf", "fsdp": "#2ca02c"}
    colors.update({"fsdp-keep": "#98df8a", "hsdp": "#9467bd"})
    for kind in DP_KINDS:
        pts = [s for s in plan.scores if s.layout.dp_kind == kind]
        if not pts:
            continue
        ax.scatter(
            [s.step_seconds * 1e3 for s in pts],
            [s.peak_bytes / scale for s in pts],
            s=[22 if s.fits else 10 for s in pts],
            c=colors[kind],
            alpha=0.8,
            marker="o",
            label=_DP_TEXT[kind],
        )
    front, best_peak = [], float("inf")
    for s in sorted((s for s in plan.scores if s.fits), key=lambda s: s.step_seconds):
        if s.peak_bytes < best_peak:
            front.append(s)
            best_peak = s.peak_bytes
    if front:
        ax.plot(
            [s.step_seconds * 1e3 for s in front], [s.peak_bytes / scale for s in front], "-", color="#444444", lw=1
        )
        for s in front[:6]:
            ax.annotate(s.layout.label(), (s.step_seconds * 1e3, s.peak_bytes / scale), fontsize=6, xytext=(4, 3),
                        textcoords="offset points")  # fmt: skip
    if plan.best:
        ax.scatter([plan.best.step_seconds * 1e3], [plan.best.peak_bytes / scale], s=90, facecolors="none",
                   edgecolors="#d62728", linewidths=1.5, label="chosen")  # fmt: skip
    memory = plan.device.memory_bytes
    if memory <= 3 * max(peaks):
        ax.axhline(memory / scale, color="#d62728", linestyle="--", lw=1, label=f"{plan.device.name} memory")
    steps = [s.step_seconds for s in plan.scores if s.step_seconds > 0]
    if steps and max(steps) > 20 * min(steps):
        ax.set_xscale("log")
    ax.set_xlabel("predicted step time (ms)")
    ax.set_ylabel(f"per-GPU peak memory ({unit})")
    off = "" if memory <= 3 * max(peaks) else f"; device memory {format_bytes(memory)} off the scale"
    ax.set_title(
        f"{plan.model}: {plan.world} GPUs on {plan.nodes} node(s), batch {plan.batch} x {plan.seq_len}{off}\n"
        "(cost-model predictions; small dots do not fit)",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


_SCRIPT_HEAD = '''#!/usr/bin/env python
"""{title}

Chosen by: {command}
Predicted (cost model, not measured): per-GPU peak {peak}, step {step}, {tps} tokens/s.
Run with:  {launch}
Stock PyTorch engines; the model, the data (the demo's byte corpus) and the loop are placeholders
for your own.{notes}
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
{imports}
from offload_compiler.demo import Batches, load_corpus
from offload_compiler.models.presets import get_preset

MODEL, SEQ_LEN, BATCH = {model!r}, {seq_len}, {batch}  # BATCH: sequences per step, all ranks together
{degrees}
DTYPE = torch.{dtype}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--json", default=None, help="write step times and losses here (rank 0)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != {world_expr}:
        raise SystemExit(f"this layout runs on {{{world_expr}}} processes, got {{world}}")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, {mesh_shape}, mesh_dim_names={mesh_names})
    dp_rank = {dp_rank}
    torch.manual_seed(0)  # the same initial weights on every rank
    model = get_preset(MODEL).build(SEQ_LEN).to(device=device, dtype=DTYPE)
'''

_SCRIPT_LOOP = """    opt = torch.optim.AdamW(module.parameters(), lr=args.lr)
    # Each data-parallel rank reads its own batches; the ranks of one tensor-parallel group the same.
    data = Batches(load_corpus(), BATCH // DP, SEQ_LEN, seed=dp_rank)
    times, losses = [], []
    for step in range(args.steps):
        x, y = data.batch(step, device)
        t0 = time.perf_counter()
{body}        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        mean = torch.tensor([local_loss], dtype=torch.float64)
        dist.all_reduce(mean)  # the mean over data-parallel ranks (tensor-parallel ranks agree)
        losses.append(mean.item() / {loss_ranks})
        if rank == 0:
            print(f"step {{step}}: loss {{losses[-1]:.4f}}  {{times[-1] * 1e3:.1f}} ms", flush=True)
    if rank == 0:
        warm = times[min(3, len(times) - 1) :]
        print(f"median step {{statistics.median(warm) * 1e3:.1f}} ms over steps {{len(times) - len(warm)}}..{{len(times) - 1}}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({{"layout": {label!r}, "world": world, "step_seconds": times, "losses": losses}}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
"""


def layout_script(plan: WorldPlan, score: LayoutScore, command: str = "python -m offload_compiler plan --world") -> str:
    """A runnable ``torchrun`` script that builds ``score``'s layout with PyTorch's engines and
    trains ``plan``'s model on the demo corpus (NCCL on GPUs, gloo on the CPU).

    Raises:
        ValueError: for a layout of a model family without tensor-parallel / stage helpers.
    """
    lay = score.layout
    fam = plan.family
    if fam not in TP_LINEARS:
        raise ValueError(f"no layout script for model family {fam!r}")
    imports, notes = [], []
    hsdp = lay.dp_kind == "hsdp"
    if hsdp:
        degrees = f"PP, REPLICATE, SHARD, TP = {lay.pp}, {lay.replicate}, {lay.shard}, {lay.tp}\nDP = REPLICATE * SHARD"
        mesh_shape, names = "(PP, REPLICATE, SHARD, TP)", '("pp", "replicate", "shard", "tp")'
        dp_rank = 'mesh["replicate", "shard"]._flatten("dp").get_local_rank()'
        dp_mesh = 'mesh["replicate", "shard"]'
    else:
        degrees = f"PP, DP, TP = {lay.pp}, {lay.dp}, {lay.tp}"
        mesh_shape, names = "(PP, DP, TP)", '("pp", "dp", "tp")'
        dp_rank = 'mesh["dp"].get_local_rank()'
        dp_mesh = 'mesh["dp"]'
    if lay.pp > 1:
        degrees += f"\nMICROBATCHES = {lay.microbatches}  # per step and data-parallel rank"
    body = []
    if lay.tp > 1:
        imports.append(
            "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module"
        )
        plan_items = ", ".join(
            f'"{p}": {"ColwiseParallel" if k == "colwise" else "RowwiseParallel"}()' for p, k in TP_LINEARS[fam]
        )
        body.append("    # Tensor parallel inside a node: Megatron-LM's column/row split of each block's linears.")
        if fam == "gpt":
            imports.append("from offload_compiler.layouts import interleave_fused_qkv")
        body.append("    for block in model.blocks:")
        if fam == "gpt":
            body.append("        interleave_fused_qkv(block.attn.qkv, TP)  # each rank's rows hold its heads' q, k, v")
        body.append(f'        parallelize_module(block, mesh["tp"], {{{plan_items}}})')
    if lay.pp > 1:
        imports.append(
            "from torch.distributed.pipelining import PipelineStage, "
            + ("ScheduleGPipe" if lay.schedule == "gpipe" else "Schedule1F1B")
        )
        imports.append("from offload_compiler.layouts import pipeline_stage_module")
        body.append('    pp_rank = mesh["pp"].get_local_rank()')
        body.append(f"    module = pipeline_stage_module(model, {fam!r}, pp_rank, PP)  # embedding / blocks / head")
    else:
        body.append("    module = model")
    if lay.dp_kind in ("ddp", "ddp+powersgd"):
        imports.append("from torch.nn.parallel import DistributedDataParallel as DDP")
        body.append(
            f"    module = DDP(module, device_ids=[device.index] if cuda else None, "
            f"process_group={dp_mesh}.get_group(), gradient_as_bucket_view=True)"
        )
        if lay.dp_kind == "ddp+powersgd":
            imports.append("from offload_compiler.comm import AdaptivePowerSGDState, adaptive_powersgd_hook")
            body.append(
                "    # Opt-in low-rank gradients: this changes the training numerics (README, 'Gradient compression')."
            )
            body.append(f"    hook_state = AdaptivePowerSGDState(process_group={dp_mesh}.get_group())")
            body.append("    module.register_comm_hook(hook_state, adaptive_powersgd_hook)")
    elif lay.dp_kind in ("fsdp", "fsdp-keep", "hsdp"):
        imports.append("from torch.distributed.fsdp import fully_shard")
        reshard = lay.dp_kind != "fsdp-keep"
        what = "HSDP: sharded inside a node, replicated across nodes" if hsdp else "FSDP2"
        body.append(f"    # {what}; one unit per block, the root holds embedding and head.")
        body.append("    for block in module.blocks:")
        body.append(f"        fully_shard(block, mesh={dp_mesh}, reshard_after_forward={reshard})")
        body.append(f"    fully_shard(module, mesh={dp_mesh}, reshard_after_forward={reshard})")
    if score.offload_budget_bytes:
        body.append(
            f"    # trinity's plan for this stage: activations offloaded under a {format_bytes(score.offload_budget_bytes)}"
        )
        body.append("    # budget (parameters, optimizer state and working memory, as `plan` counts them).")
        body.append(
            f'    module = torch.compile(module, backend="trinity", options={{"memory_budget": {score.offload_budget_bytes}}})'
        )
    if lay.pp > 1:
        sched = "ScheduleGPipe" if lay.schedule == "gpipe" else "Schedule1F1B"
        body.append('    stage = PipelineStage(module, pp_rank, PP, device, group=mesh["pp"].get_group())')
        body.append(
            "    schedule = "
            + sched
            + "(stage, n_microbatches=MICROBATCHES, loss_fn=lambda out, tgt: F.cross_entropy(out.flatten(0, 1).float(), tgt.flatten()))"
        )
        body.append("    # A tied embedding/head lives on the first and the last stage: sum its two gradients.")
        body.append("    tied_group = None")
        body.append("    if PP > 1 and model.head.weight is model.tok.weight:")
        body.append("        ranks = mesh.mesh.reshape(PP, -1)")
        body.append("        for col in range(ranks.shape[1]):  # every rank creates every group, in the same order")
        body.append("            g = dist.new_group([int(ranks[0, col]), int(ranks[-1, col])])")
        body.append("            if rank in (int(ranks[0, col]), int(ranks[-1, col])):")
        body.append("                tied_group = g")
        step_body = [
            "        local_loss = 0.0",
            "        if pp_rank == 0:",
            "            schedule.step(x)",
            "        elif pp_rank == PP - 1:",
            "            mb_losses = []",
            "            schedule.step(target=y, losses=mb_losses)",
            "            local_loss = torch.stack(mb_losses).mean().item()",
            "        else:",
            "            schedule.step()",
            "        if tied_group is not None and module.tied is not None:",
            "            dist.all_reduce(module.tied.grad, group=tied_group)",
        ]
        loss_ranks = "(DP * TP)"
    else:
        step_body = [
            "        loss = F.cross_entropy(module(x).flatten(0, 1).float(), y.flatten())",
            "        loss.backward()",
            "        local_loss = loss.item()",
        ]
        loss_ranks = "world"
    if lay.tp > 1 and lay.dp == 1 and lay.pp == 1:
        notes.append("Tensor parallel only: the ranks see the same batches.")
    if fam == "gpt" and lay.tp > 1:
        notes.append(
            "The GPT's fused qkv rows are interleaved per rank (offload_compiler.layouts.interleave_fused_qkv)."
        )
    launch = f"torchrun --nproc-per-node {plan.gpus_per_node}" + (
        f" --nnodes {plan.nodes} --rdzv-backend c10d --rdzv-endpoint HOST:29500" if plan.nodes > 1 else ""
    )
    head = _SCRIPT_HEAD.format(
        title=f"{plan.model} on {plan.world} GPUs: {score.label()} ({_DP_TEXT[lay.dp_kind]}).",
        command=command,
        peak=format_bytes(score.peak_bytes),
        step=f"{score.step_seconds * 1e3:.1f} ms",
        tps=f"{score.tokens_per_s:,.0f}",
        launch=launch + " layout.py --steps 20",
        notes=("\n" + "\n".join(notes)) if notes else "",
        imports="\n".join(dict.fromkeys(imports)),
        model=plan.model,
        seq_len=plan.seq_len,
        batch=plan.batch,
        degrees=degrees,
        dtype=plan.dtype,
        world_expr="PP * DP * TP",
        mesh_shape=mesh_shape,
        mesh_names=names,
        dp_rank=dp_rank,
    )
    loop = _SCRIPT_LOOP.format(body="\n".join(step_body) + "\n", loss_ranks=loss_ranks, label=score.label())
    return head + "\n".join(body) + "\n" + loop


def _args(argv):
    from .plan_cli import DefaultsHelp

    p = argparse.ArgumentParser(
        prog="python -m offload_compiler plan --world N",
        description="Pick a data/tensor/pipeline-parallel layout (plus trinity's per-stage offload plan) for N GPUs "
        "by the cost model; print the best layouts, the frontier, and the code that builds the chosen one.",
        formatter_class=DefaultsHelp,
    )
    p.add_argument("--world", type=int, required=True, help="number of GPUs (processes)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes the GPUs are spread over (evenly)")
    p.add_argument(
        "--interconnect",
        default=None,
        help="the link between GPUs: with --nodes 1 one of nvlink, pcie (default nvlink); with more nodes the network, "
        "ib-200g or eth-25g (default ib-200g); or a JSON file from calibrate --collectives",
    )
    p.add_argument("--intra-node", default="nvlink", help="the link inside a node when --nodes > 1: nvlink or pcie")
    p.add_argument("--model", default="gpt2-small", help="a preset (demo, gpt2-*, llama-*)")
    p.add_argument("--batch", type=int, default=None, help="global batch in sequences per step (default: one per GPU)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 or float16")
    p.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd (momentum) or none")
    p.add_argument("--device", default="h100-sxm", help="a device from the table: " + ", ".join(sorted(KNOWN_DEVICES)))
    p.add_argument("--device-memory", default=None, help="override the device's memory, e.g. 24GiB")
    p.add_argument("--calibration", default=None, help="a calibrate JSON whose figures replace the device table's")
    p.add_argument("--compression-rank", type=int, default=4, help="PowerSGD rank assumed when scoring compression")
    p.add_argument("--max-offload-plans", type=int, default=8, help="stage configurations planned with offloading")
    p.add_argument("--top", type=int, default=10, help="layouts in the table")
    p.add_argument("--png", default="world_frontier.png", help="where to draw the frontier ('' for none)")
    p.add_argument("--json", default=None, help="write every scored layout here")
    p.add_argument("--script", default=None, help="write the chosen layout's torchrun script here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """``plan --world``'s command line (see ``--help``); returns the exit status (2 for bad
    input, 1 when no layout fits)."""
    from rich.console import Console
    from rich.table import Table

    args = _args(sys.argv[1:] if argv is None else argv)
    console = Console(width=max(140, Console().width))
    try:
        if args.dtype not in _DTYPES:
            raise ValueError(f"--dtype {args.dtype!r} is not one of {', '.join(_DTYPES)}")
        spec = lookup_device(args.device)
        if args.calibration:
            from .calibrate import load_calibration

            spec = replace(
                spec, **load_calibration(args.calibration), source=spec.source + f"; calibrated ({args.calibration})"
            )
        if args.device_memory:
            spec = replace(spec, memory_bytes=parse_size("--device-memory", args.device_memory))
        plan = plan_world(
            args.model,
            args.world,
            args.nodes,
            args.interconnect,
            args.intra_node,
            spec,
            args.batch,
            args.seq_len,
            _DTYPES[args.dtype],
            args.optimizer,
            args.compression_rank,
            args.max_offload_plans,
            progress=lambda m: console.print(f"[dim]{m}[/dim]"),
        )
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    c = plan.cluster
    link = f"{c.intra.name} inside nodes" + (f", {c.inter.name} between nodes" if c.inter else "")
    console.print(
        f"[bold]{plan.model}[/bold] on {plan.world} x {spec.name} ({format_bytes(spec.memory_bytes)}), {plan.nodes} node(s) "
        f"of {plan.gpus_per_node}, {link}; global batch {plan.batch} x {plan.seq_len} tokens, {plan.dtype}, "
        f"optimizer {plan.optimizer}. {len(plan.scores)} layouts scored in {plan.plan_seconds:.1f} s "
        "(predictions of the cost model, not measurements)."
    )
    table = Table(caption="FSDP2 keep: reshard_after_forward=False; trinity budget: the stage's offload plan")
    for col in ("#", "dp", "tp", "pp", "engine", "schedule", "per-GPU peak", "fits", "step (pred.)", "tokens/s",
                "comm exposed", "trinity budget"):  # fmt: skip
        table.add_column(col, justify="right", no_wrap=True)
    for i, s in enumerate(plan.scores[: args.top], 1):
        lay = s.layout
        dp = f"{lay.dp}" + (f" ({lay.replicate}x{lay.shard})" if lay.dp_kind == "hsdp" else "")
        table.add_row(
            str(i),
            dp,
            str(lay.tp),
            str(lay.pp),
            _SHORT[lay.dp_kind],
            f"{lay.schedule} m={lay.microbatches}" if lay.pp > 1 else "",
            format_bytes(s.peak_bytes),
            "yes" if s.fits else "[red]no[/red]",
            f"{s.step_seconds * 1e3:.1f} ms",
            f"{s.tokens_per_s:,.0f}",
            f"{s.comm_exposed_seconds * 1e3:.1f} ms",
            format_bytes(s.offload_budget_bytes) if s.offload_budget_bytes else "",
        )
    console.print(table)
    for note in plan.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    if args.png and plan.scores:
        console.print(f"frontier: {frontier_png(plan, Path(args.png))}")
    if args.json:
        Path(args.json).write_text(json.dumps(plan.to_json(), indent=1) + "\n")
        console.print(f"layouts: {args.json}")
    if plan.best is None:
        console.print(f"[red]infeasible:[/red] {plan.infeasible}")
        return 1
    b = plan.best
    console.print(
        f"chosen: [bold]{b.label()}[/bold] ({_DP_TEXT[b.layout.dp_kind]}): peak {format_bytes(b.peak_bytes)} per GPU, "
        f"step {b.step_seconds * 1e3:.1f} ms, {b.tokens_per_s:,.0f} tokens/s, {b.comm_exposed_seconds * 1e3:.1f} ms "
        "of communication exposed"
    )
    console.print(f"gradient compression: {plan.compression['message']}")
    command = "python -m offload_compiler plan " + " ".join(sys.argv[2:] if argv is None else argv)
    script = layout_script(plan, b, command)
    if args.script:
        Path(args.script).write_text(script)
        console.print(f"layout script: {args.script}")
    print("\n# ---- the chosen layout, with PyTorch's own engines ----\n" + script)
    return 0
