"""Shared pieces of the per-pass unit tests: tiny functions to capture, a device spec with round
numbers, running a (forward, backward) pair on real tensors, and independent recomputations that
the tests compare the passes against."""

from __future__ import annotations

import torch
from torch import fx
from torch._functorch.partitioners import default_partition

from offload_compiler.devices import DeviceSpec
from offload_compiler.graph_pair import GraphPair
from offload_compiler.passes import cost_model, liveness, plan_window

from .graphs import capture_pair, mlp_pair

# 1 GFLOP/s, 1 GB/s memory, 0.1 GB/s host link each way, 1 us launch: times are easy by hand.
ROUND = DeviceSpec(
    name="round numbers",
    flops_fp32=1e9,
    flops_tf32=4e9,
    flops_bf16=8e9,
    hbm_bytes_per_s=1e9,
    memory_bytes=1 << 30,
    h2d_bytes_per_s=1e8,
    d2h_bytes_per_s=1e8,
    launch_overhead_s=1e-6,
)


def spec(**fields) -> DeviceSpec:
    """:data:`ROUND` with some fields replaced."""
    from dataclasses import replace

    return replace(ROUND, **fields)


# ------------------------------------------------------------------------------ tiny functions
def tanh_mm(w, x):
    """w: (3, 5) parameter, x: (2, 3) input. Saves tanh(x @ w) (40 bytes) and x.t() (an input)."""
    return torch.tanh(x @ w).sum()


def tanh_mm_pair(device="cpu") -> GraphPair:
    torch.manual_seed(0)
    w = torch.randn(3, 5, device=device, requires_grad=True)
    x = torch.randn(2, 3, device=device)
    return capture_pair(tanh_mm, w, x, static=(0,))


def tanh_mm_inputs():
    torch.manual_seed(1)
    return [torch.randn(3, 5), torch.randn(2, 3)]


def qkv(w, x):
    """One projection split into q, k, v (views of one storage), all three saved."""
    q, k, v = (x @ w).split(4, dim=-1)
    return (q * k * v).sum()


def qkv_pair(partition=default_partition, device="cpu") -> GraphPair:
    """With PyTorch's default partitioner the three views are saved as they are (the min-cut one
    saves the projection instead)."""
    torch.manual_seed(0)
    w = torch.randn(4, 12, device=device, requires_grad=True)
    x = torch.randn(2, 4, device=device)
    return capture_pair(qkv, w, x, static=(0,), partition=partition)


def qkv_inputs():
    torch.manual_seed(2)
    return [torch.randn(4, 12), torch.randn(2, 4)]


def gram(w, x):
    """y = x @ w and its transpose, both saved (default partitioner)."""
    y = x @ w
    return (y @ y.t()).sum()


def gram_pair(device="cpu") -> GraphPair:
    torch.manual_seed(0)
    w = torch.randn(4, 6, device=device, requires_grad=True)
    x = torch.randn(2, 4, device=device)
    return capture_pair(gram, w, x, static=(0,), partition=default_partition)


def gram_inputs():
    torch.manual_seed(3)
    return [torch.randn(4, 6), torch.randn(2, 4)]


def tanh2(w0, w1, x):
    return torch.tanh(torch.tanh(x @ w0) @ w1).sum()


def tanh2_pair(device="cpu") -> GraphPair:
    """Two tanh layers under the default partitioner, which saves the first activation twice (as
    ``tanh`` and as its ``detach``): one buffer, two saved tensors of the same view."""
    torch.manual_seed(0)
    ws = [torch.randn(4, 4, device=device, requires_grad=True) for _ in range(2)]
    x = torch.randn(8, 4, device=device)
    return capture_pair(tanh2, *ws, x, static=(0, 1), partition=default_partition)


def tanh2_inputs():
    torch.manual_seed(6)
    return [torch.randn(4, 4), torch.randn(4, 4), torch.randn(8, 4)]


def mlp4_pair(device="cpu") -> GraphPair:
    """tanh MLP, 4 layers of width 4, batch 16: four 256-byte saved activations."""
    if device == "cpu":
        return mlp_pair(batch=16, width=4, depth=4)
    torch.manual_seed(0)
    ws = [torch.randn(4, 4, device=device, requires_grad=True) for _ in range(4)]
    x = torch.randn(16, 4, device=device)

    def fn(*args):
        *ws_, h = args
        for w in ws_:
            h = torch.tanh(h @ w)
        return h.sum()

    return capture_pair(fn, *ws, x, static=(0, 1, 2, 3))


def mlp4_inputs():
    torch.manual_seed(4)
    return [torch.randn(4, 4) * 0.5 for _ in range(4)] + [torch.randn(16, 4)]


# ------------------------------------------------------------------------------ analysis
def analyze(pair: GraphPair, device_spec: DeviceSpec = ROUND, **kw):
    live = liveness.analyze(pair, **kw)
    costs = cost_model.estimate(pair, live, device_spec)
    return live, costs


def buffer_holding(live: liveness.Liveness, node: str) -> liveness.Buffer:
    """The buffer whose nodes include ``node`` (``"forward:name"`` / ``"backward:name"``)."""
    found = [b for b in live.buffers if node in b.nodes]
    assert len(found) == 1, f"{node} is in {len(found)} buffers"
    return found[0]


def planned_live_by_hand(live: liveness.Liveness, evictions) -> list[int]:
    """Device bytes per step with ``evictions`` applied, step by step from the buffers: an evicted
    buffer holds device memory from its definition through ``wait_after`` only; each host copy
    holds its bytes again from ``prefetch_before`` through its group's last use."""
    by_buffer = {e.buffer: e for e in evictions}
    out = []
    for s in range(live.num_steps):
        total = live.workspace_bytes[s] if live.workspace_bytes else 0
        for b in live.buffers:
            if not b.on_device or b.fused or not (b.def_step <= s <= b.last_step):
                continue
            ev = by_buffer.get(b.id)
            if ev is not None and s > ev.wait_after:
                continue
            total += b.size_bytes
        for ev in evictions:
            for g in ev.groups:
                if ev.prefetch_before <= s <= g.last_use:
                    total += g.copy_bytes
        out.append(total)
    return out


def tight_peak_by_hand(live: liveness.Liveness, min_bytes: int = 0) -> int:
    """The peak when every candidate is evicted as tightly as possible: its device storage lives
    from its definition through its last forward reader, and comes back at its first backward
    reader (for the single-view buffers these tests use, the host copy is the whole buffer)."""
    cands = {b.id for b in live.candidates(min_bytes)}
    peak = 0
    for s in range(live.num_steps):
        total = live.workspace_bytes[s] if live.workspace_bytes else 0
        for b in live.buffers:
            if not b.on_device or b.fused or not (b.def_step <= s <= b.last_step):
                continue
            if b.id in cands and b.last_fw_use < s < b.first_bw_use:
                continue
            total += b.size_bytes
        peak = max(peak, total)
    return peak


# A budget for make_plan: evict every candidate (see every_candidate_plan).
EVERY = "every candidate"


def make_plan(pair: GraphPair, budget, device_spec: DeviceSpec = ROUND, min_offload_bytes: int = 0, **kw):
    """Liveness, costs and the planner's plan of ``pair`` at ``budget`` (bytes, ``None``, or
    :data:`EVERY` for :func:`every_candidate_plan`); ``kw`` goes to liveness."""
    live, costs = analyze(pair, device_spec, **kw)
    if budget == EVERY:
        return live, costs, every_candidate_plan(live, costs, min_offload_bytes)
    return live, costs, plan_window.plan(live, costs, budget, min_offload_bytes)


def every_candidate_plan(live: liveness.Liveness, costs, min_offload_bytes: int = 0) -> plan_window.Plan:
    """A plan that evicts every candidate with its tightest window (the D2H wait right after its
    last forward reader, the prefetch right before its first backward reader), with the
    planner's own copy groups. The planner itself evicts only what lowers the peak; the rewrite
    and the verifier are tested on every candidate, whether or not it lowers the peak."""
    from dataclasses import replace

    import numpy as np

    evictions = []
    for b in live.candidates(min_offload_bytes):
        groups = plan_window.copy_groups(live, b.id)
        issue = max(g.issue_after for g in groups)
        evictions.append(
            plan_window.Eviction(
                buffer=b.id,
                size_bytes=b.size_bytes,
                groups=groups,
                wait_after=max(b.last_fw_use, issue),
                prefetch_before=b.first_bw_use,
                idle_gap_seconds=0.0,
            )
        )
    after = plan_window.planned_live_bytes(live, evictions)
    return replace(
        plan_window.plan(live, costs, None, min_offload_bytes),
        budget_bytes=0,
        evictions=tuple(evictions),
        peak_bytes_planned=int(after.max()),
        peak_step_planned=int(np.argmax(after)),
        feasible=False,
    )


# ------------------------------------------------------------------------------ running
def tangent_placeholders(pair: GraphPair) -> list[fx.Node]:
    phs = list(pair.backward.graph.find_nodes(op="placeholder"))
    num_saved = len(pair.fw_outputs()) - pair.num_fwd_outputs
    return phs[num_saved:]


def run_pair(pair: GraphPair, primals, tangents=None):
    """Run the forward graph on ``primals`` and the backward on its saved outputs and
    ``tangents`` (by default fixed pseudo-random tensors shaped like the tangent placeholders).
    Returns (user outputs, saved values, gradients)."""
    if tangents is None:
        g = torch.Generator().manual_seed(5)
        tangents = [
            torch.randn(tuple(n.meta["val"].shape), generator=g, dtype=n.meta["val"].dtype)
            for n in tangent_placeholders(pair)
        ]
    with torch.no_grad():
        out = pair.forward(*primals)
        user = list(out[: pair.num_fwd_outputs])
        saved = list(out[pair.num_fwd_outputs :])
        grads = list(pair.backward(*saved, *tangents))
    return user, saved, grads


def nodes_with_target(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]
