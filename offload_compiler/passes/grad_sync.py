"""Gradient averaging under DDP with ``offload="all"``: rewrite the gradients' trips to the host.

Runs after :func:`.param_residency.apply` (and its check) on a pair compiled inside a DDP
forward. It

* inserts ``trinity::grad_sync_mark`` as the forward's first node after its placeholders (the
  forward records whether its backward syncs: DDP's ``no_sync()``);
* replaces, for every parameter DDP reduces, ``trinity::grad_to_host(g, slot, rt)`` by
  ``trinity::grad_reduce(g, slot, rt, sync, inplace)`` and its ``trinity::grad_to_host_wait`` by
  ``trinity::grad_reduce_wait(g, slot, rt, sync)`` at the same places: the all-reduce is issued
  where the copy was issued, and waited for (with the copy) where the copy was waited for, so it
  overlaps the backward's compute in between (see :mod:`offload_compiler.runtime.grad_sync`).

``inplace`` is true when the graph cannot observe ``g`` being scaled: no node holding its storage
(``g`` and its views, e.g. the ``mm`` whose transpose is a weight's gradient) is a placeholder
or a graph output, or is read after the issue except by the copy ops. Otherwise the sum is
formed in a new tensor.

Matches nodes by op target. Reads ``node.meta["val"]`` (storage identity of fake values); writes
``node.meta["trinity"]`` on the nodes it inserts or replaces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.fx as fx

from ..graph_pair import GraphPair
from ..ir.alias import storage_key
from ..ir.meta import NOTE_KEY, PARAM_COPY_KEY
from ..ir.ops import GRAD_REDUCE, GRAD_REDUCE_WAIT, GRAD_SYNC_MARK, GRAD_TO_HOST, GRAD_TO_HOST_WAIT

__all__ = ["GradSyncRewrite", "GradSyncSpec", "apply"]


class GradSyncSpec(Protocol):
    """What :func:`apply` reads of the gradient sync it rewrites for (the runtime's
    :class:`~offload_compiler.runtime.grad_sync.GradSync` is one)."""

    id: int  # the sync's id, an argument of the inserted ops
    slot_ids: frozenset[int]  # the parameter slots whose gradients are reduced
    world_size: int  # ranks in the process group


@dataclass(frozen=True)
class GradSyncRewrite:
    """What :func:`apply` did: gradients whose trip to the host now all-reduces first, of which
    how many in place."""

    num_reduced: int
    num_inplace: int


def _storage(node: fx.Node):
    val = node.meta.get("val")
    return storage_key(val) if isinstance(val, torch.Tensor) else None


def _inplace_ok(g: fx.Node, issue: fx.Node, slot: int, order: dict[fx.Node, int]) -> bool:
    """Whether nothing can observe ``g``'s storage being written at ``issue``: no node holding
    that storage (``g`` and its views) is a placeholder or feeds the output, and none is read
    after ``issue`` except by this slot's gradient-copy ops."""
    st = _storage(g)
    if st is None:
        return False
    holders = [n for n in order if (s := _storage(n)) is not None and s == st]
    if g not in holders:
        holders.append(g)
    for h in holders:
        if h.op == "placeholder":
            return False
        for user in h.users:
            if user.op == "output":
                return False
            own_copy = user.op == "call_function" and user.target in (GRAD_TO_HOST, GRAD_TO_HOST_WAIT)
            if user is issue or (own_copy and user.args[1] == slot):
                continue
            if order[user] > order[issue]:
                return False
    return True


def apply(pair: GraphPair, sync: GradSyncSpec) -> GradSyncRewrite:
    """Rewrite ``pair`` in place for ``sync`` (module docstring); returns what was done."""
    fw = pair.forward.graph
    placeholders = list(fw.find_nodes(op="placeholder"))
    anchor = placeholders[-1] if placeholders else None
    if anchor is not None:
        with fw.inserting_after(anchor):
            mark = fw.call_function(GRAD_SYNC_MARK, (sync.id,))
    else:
        with fw.inserting_before(next(iter(fw.nodes))):
            mark = fw.call_function(GRAD_SYNC_MARK, (sync.id,))
    mark.meta["val"] = None
    mark.meta[NOTE_KEY] = "records DDP's require_backward_grad_sync (no_sync) for this forward's backward"
    bw = pair.backward.graph
    order = {n: i for i, n in enumerate(bw.nodes)}
    reduced = inplace_count = 0
    issues = {}
    for n in list(bw.nodes):
        if n.op != "call_function" or n.target is not GRAD_TO_HOST:
            continue
        g, slot, rt = n.args
        if slot not in sync.slot_ids:
            continue
        inplace = _inplace_ok(g, n, slot, order)
        with bw.inserting_before(n):
            new = bw.call_function(GRAD_REDUCE, (g, slot, rt, sync.id, inplace))
        new.meta["val"] = None
        new.meta[NOTE_KEY] = (
            f"gradient (slot {slot}) x 1/{sync.world_size}, all-reduce issued"
            + (" in place" if inplace else " (in a copy)")
            + "; its D2H copy follows at the wait"
        )
        if PARAM_COPY_KEY in n.meta:
            new.meta[PARAM_COPY_KEY] = n.meta[PARAM_COPY_KEY]
        bw.erase_node(n)
        issues[slot] = new
        reduced += 1
        inplace_count += inplace
    for n in list(bw.nodes):
        if n.op != "call_function" or n.target is not GRAD_TO_HOST_WAIT:
            continue
        g, slot, rt = n.args
        if slot not in issues:
            continue
        with bw.inserting_before(n):
            new = bw.call_function(GRAD_REDUCE_WAIT, (g, slot, rt, sync.id))
        new.meta["val"] = None
        new.meta[NOTE_KEY] = f"all-reduce of the gradient (slot {slot}) done, D2H of the average done"
        bw.erase_node(n)
    for gm in (pair.forward, pair.backward):
        gm.graph.lint()
        gm.recompile()
    return GradSyncRewrite(reduced, inplace_count)
