"""Split late addmm: keep a matrix product where the graph computes it when Inductor would move it late.

Inductor's post-grad ``addmm`` pattern (``torch/_inductor/fx_passes/post_grad.py``) replaces
``add(mm(a, b), c)`` by ``addmm(c, a, b)`` *at the add* (:func:`.liveness.addmm_fused_into` gives
the exact conditions). When the add comes much later than the product, the product's inputs then
stay allocated up to the add. The common case is a tied weight: a language model's head and its
token embedding share one matrix, whose gradient is the sum of the head's product
``grad_logits^T @ hidden`` (computed at the start of the backward) and the embedding's
gradient (made at its end). Fused, the logits' gradient (tokens x vocabulary elements: 1 GiB for
Llama 3.2 1B at 4096 tokens in bf16) stays allocated through the whole backward, while the product
it feeds is only vocabulary x width (0.5 GiB there; 50257 x 768 against 8192 x 50257 for GPT-2
small at 8192 tokens: 77 MB against 823 MB).

This pass keeps such a product where the graph computes it: when the bytes that running the
``mm`` at its own place frees (its inputs' storages that nothing after it but the fused add would
keep) exceed its output's bytes, a ``trinity::fence([], mm)`` is inserted right after the ``mm``.
The fence does nothing at run time; as a second reader of the product it stops the pattern (which
needs the ``mm`` read by the ``add`` alone), so Inductor allocates the product and frees its
inputs where the graph says. Liveness then sees the ``mm`` as unfused by the same rule
(:func:`.liveness.addmm_fused_into`), so the plan and the run agree. The values are the same
products and sums; only Inductor's kernel choice changes (``mm`` then ``add`` instead of one
``addmm``), so results match within floating-point rounding, not bit for bit.

Only for Inductor as the inner compiler (``inner="eager"`` runs the graph as written: nothing to
undo). Reads ``node.meta["val"]``; writes ``meta["val"]`` (``None``) and the dump note of each fence. Mutates the graph: inserts ``trinity::fence``
nodes (matched by target, :data:`~offload_compiler.ir.ops.FENCE`).
"""

from __future__ import annotations

import torch.fx as fx

from ..ir.alias import node_span_bytes, node_storages
from ..ir.meta import NOTE_KEY
from ..ir.ops import FENCE
from .liveness import addmm_fused_into

__all__ = ["split_late_addmm"]


def split_late_addmm(gm: fx.GraphModule, device_type: str | None = None) -> int:
    """Insert a ``trinity::fence`` after each ``mm`` that Inductor would fuse into a later ``add``
    when that frees more bytes than the product holds (see the module docstring). Returns how many
    were inserted; the graph is linted and recompiled when any was.

    Storages are told apart by the fake values' storage identity (every view of a storage counts
    as its reader); a storage that a placeholder holds (a parameter, an input, a saved value) is
    not counted as freed.

    ``device_type``: the device the graph is compiled for (``None``: the fake values'), as
    :func:`.liveness.addmm_fused_into` takes it (on a GPU the pattern is skipped when every reader
    of the add is pointwise).
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    owner: dict = {}  # storage -> the first node holding it (its allocation, or a placeholder)
    readers: dict = {}  # storage -> the nodes reading it (through any view)
    for n in nodes:
        for s in node_storages(n):
            owner.setdefault(s, n)
        for m in n.all_input_nodes:
            for s in node_storages(m):
                readers.setdefault(s, []).append(n)
    split = 0
    for n in nodes:
        add = addmm_fused_into(n, device_type)
        if add is None or pos[add] <= pos[n] + 1:
            continue
        freed, seen = 0, set()
        for m in n.all_input_nodes:
            for s in node_storages(m):
                if s in seen or owner[s].op == "placeholder":
                    continue
                seen.add(s)
                # Fused, the storage lives up to the add; split, up to its last other reader.
                if max((pos[u] for u in readers[s] if u is not n), default=-1) < pos[add]:
                    freed += node_span_bytes(owner[s])
        if freed > node_span_bytes(n):
            with graph.inserting_after(n):
                fence = graph.call_function(FENCE, ([], n))
            fence.meta["val"] = None
            fence.meta[NOTE_KEY] = f"keeps {n.name} here: Inductor's addmm would run it at {add.name}"
            split += 1
    if split:
        graph.lint()
        gm.recompile()
    return split
