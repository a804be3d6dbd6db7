"""Reorder: compute each node as soon as that frees more memory than it allocates.

The partitioner emits some nodes late: a mask the backward needs (``le = relu <= 0``) or a
reduction is often placed at the end of the forward, which keeps its (larger) input alive until
then. This pass moves such a node to right after its latest input when the inputs it is the last
reader of hold more bytes than its own output. Only pure, deterministic ops move (no random ops,
no mutation, no trinity ops), and only earlier, so every value is the same as before: with
``inner="eager"`` the results stay bit-identical.

Before that, every ``getitem`` of a multi-output op (``native_layer_norm``'s mean and rstd, an
SDPA's log-sum-exp) moves to right after that op: indexing a tuple reads no memory, but while a
late ``getitem`` is pending the generated code keeps the whole tuple, and so every tensor in it,
alive, which would keep an evicted element allocated past its planned free.

Reads ``node.meta["val"]``; writes no meta. Mutates the graph's node order.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..ir.alias import is_view, node_span_bytes
from ..ir.ops import TRANSFER_OPS

__all__ = ["hoist_frees"]


def _movable(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target in TRANSFER_OPS:
        return False
    if node.is_impure():
        return False
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags and not target._schema.is_mutable


def _hoist_getitems(graph: fx.Graph) -> int:
    """Move each ``operator.getitem`` of a tuple-valued node to right after that node (keeping
    their order); returns how many moved."""
    moved = 0
    nodes = list(graph.nodes)
    # Moving a node does not change the relative order of the others: one numbering serves.
    order = {u: i for i, u in enumerate(nodes)}
    for n in nodes:
        if n.op != "call_function" or isinstance(n.meta.get("val"), torch.Tensor):
            continue
        getitems = [u for u in n.users if u.op == "call_function" and u.target is operator.getitem]
        if not getitems or len(getitems) != len(n.users):
            continue
        anchor = n
        for g in sorted(getitems, key=order.__getitem__):
            if anchor.next is not g:
                anchor.append(g)
                moved += 1
            anchor = g
    return moved


def hoist_frees(gm: fx.GraphModule) -> int:
    """Move memory-freeing nodes of ``gm`` earlier (see module docstring); returns how many moved.

    Getitems of multi-output ops move first (not counted). The graph is linted and recompiled
    when anything moved.
    """
    graph = gm.graph
    regrouped = _hoist_getitems(graph)
    nodes = list(graph.nodes)
    pos: dict[fx.Node, float] = {n: float(i) for i, n in enumerate(nodes)}
    view = {n: is_view(n) for n in nodes}
    placeholders = [m for m in nodes if m.op == "placeholder"]
    last_placeholder = max(placeholders, key=lambda m: pos[m]) if placeholders else None
    moved = 0
    for n in nodes:
        if not _movable(n) or view[n] or not n.all_input_nodes:
            continue
        latest = max(n.all_input_nodes, key=lambda m: pos[m])
        if latest.op == "placeholder":
            # Placeholders come first; "right after" the last one is the first compute slot.
            latest = last_placeholder
        if pos[latest] >= pos[n] - 1:
            continue
        freed = 0
        for m in n.all_input_nodes:
            if m.op == "placeholder" or view[m]:
                continue
            others = [u for u in m.users if u is not n]
            if any(pos[u] > pos[n] or view[u] for u in others):
                continue
            freed += node_span_bytes(m)
        if freed > node_span_bytes(n):
            latest.append(n)
            # n now sits between latest and latest's old successor: a position between theirs
            # (renumbering the whole graph per move made this quadratic on a 70B model's graph).
            gap = pos[n.next] - pos[latest]
            if gap > 1e-6:
                pos[n] = pos[latest] + gap / 2
            else:
                pos = {m: float(i) for i, m in enumerate(graph.nodes)}
            moved += 1
    if moved or regrouped:
        graph.lint()
        gm.recompile()
    return moved
