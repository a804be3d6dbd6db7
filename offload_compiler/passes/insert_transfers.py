"""Rewrite: insert the ``trinity::evict`` / ``prefetch`` / wait nodes a plan asks for.

Forward, per copy group of an evicted buffer::

    host = trinity.evict(view, rt)            # right after the view is defined
    ...                                       # compute the copy hides under
    trinity.evict_wait(host, view, rt)        # after the buffer's last forward reader (or later)
    return (..., host, ...)                   # the host copy replaces the view among saved outputs

Backward, per copy group::

    dev = trinity.prefetch(host_placeholder, device, rt)   # the planned prefetch point
    ...
    trinity.prefetch_wait(dev, rt)                         # right before the first reader
    <every reader of the saved placeholder now reads dev>

Inserted nodes at one gap come issues first, then waits (the simulator's convention).

Reads ``node.meta["val"]``. Writes ``node.meta["val"]`` (fake tensors for inserted nodes; the host
placeholder's value becomes a CPU tensor of the same layout), ``node.meta["tensor_meta"]`` (kept
consistent) and ``node.meta["trinity"]`` (a short description shown in dumps).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from torch.multiprocessing.reductions import StorageWeakRef

from ..graph_pair import GraphPair, fake_mode_of, tensor_vals
from ..options import format_bytes
from ..runtime.ops import EVICT, EVICT_WAIT, PREFETCH, PREFETCH_WAIT
from .liveness import Liveness
from .plan_window import Plan

__all__ = ["apply"]


def _set_val(node: fx.Node, val) -> None:
    node.meta["val"] = val
    if isinstance(val, torch.Tensor):
        node.meta["tensor_meta"] = _extract_tensor_metadata(val)
    else:
        node.meta.pop("tensor_meta", None)


def _fake_args(a):
    if isinstance(a, fx.Node):
        return a.meta.get("val")
    if isinstance(a, (list, tuple)):
        return type(a)(_fake_args(x) for x in a)
    if isinstance(a, dict):
        return {k: _fake_args(v) for k, v in a.items()}
    return a


def _refresh_aliases(graph: fx.Graph, new_nodes, fake_mode) -> None:
    """Views that the backward takes of a prefetched tensor still carry fake values aliasing the
    forward's storage (the joint graph traced them so). Recompute them from the prefetched value
    so that aliasing in ``meta["val"]`` matches the rewritten graph."""
    fresh = set(new_nodes)
    if not fresh:
        return
    started = False
    for n in graph.nodes:
        if n in fresh:
            started = True
            continue
        if not started or n.op != "call_function":
            continue
        if not any(m in fresh for m in n.all_input_nodes):
            continue
        inputs = [t for m in n.all_input_nodes if m in fresh for t in tensor_vals(m)]
        in_storages = {StorageWeakRef(t.untyped_storage()) for t in inputs}
        # Only nodes whose value is a view of a refreshed input need a new value; a fresh
        # computation (a new storage) is unaffected.
        old_vals = tensor_vals(n)
        if not old_vals:
            continue
        with fake_mode:
            new_val = n.target(*_fake_args(n.args), **_fake_args(n.kwargs))
        new_vals = new_val if isinstance(new_val, (tuple, list)) else [new_val]
        if any(
            isinstance(t, torch.Tensor) and StorageWeakRef(t.untyped_storage()) in in_storages for t in new_vals
        ):
            _set_val(n, new_val)
            fresh.add(n)


def apply(pair: GraphPair, liveness: Liveness, plan: Plan, runtime_id: int) -> dict[str, int]:
    """Insert the transfer nodes of ``plan`` into ``pair`` (in place) and recompile both graphs.

    Args:
        pair: the graphs ``liveness`` was computed on (not yet rewritten).
        liveness: their liveness.
        plan: the plan to apply.
        runtime_id: id of the :class:`~offload_compiler.runtime.transfer.TransferRuntime` the ops
            will use.

    Returns:
        Counts of inserted nodes by op (``{"evict": n, ...}``).

    Raises:
        ValueError: if the plan refers to steps that are not in these graphs.
    """
    fw_nodes = list(pair.forward.graph.nodes)
    bw_nodes = list(pair.backward.graph.nodes)
    F = len(fw_nodes)
    if F + len(bw_nodes) != liveness.num_steps:
        raise ValueError("insert_transfers: the graphs do not match the liveness the plan was made on")
    fake_mode = fake_mode_of(pair.forward, pair.backward)
    fw_out = pair.fw_output_node()
    outputs = list(pair.fw_outputs())
    bw_placeholders = {n.name: n for n in pair.backward.graph.find_nodes(op="placeholder")}

    # Collect the insertions per gap so issues precede waits at each gap.
    fw_after: dict[int, list] = {}  # step -> [("issue"|"wait", payload)]
    bw_before: dict[int, list] = {}
    for ev in plan.evictions:
        for g in ev.groups:
            fw_after.setdefault(g.issue_after, []).append(("issue", ev, g))
            fw_after.setdefault(ev.wait_after, []).append(("wait", ev, g))
            bw_before.setdefault(ev.prefetch_before, []).append(("issue", ev, g))
            bw_before.setdefault(g.wait_before, []).append(("wait", ev, g))

    counts = {"evict": 0, "evict_wait": 0, "prefetch": 0, "prefetch_wait": 0}
    host_of: dict[int, fx.Node] = {}  # id(group) -> host node in the forward
    src_of: dict[int, fx.Node] = {}
    fw_graph = pair.forward.graph
    for step in sorted(fw_after):
        if not (0 <= step < F - 1):
            raise ValueError(f"insert_transfers: forward step {step} is not a node before the output")
        anchor = fw_nodes[step]
        items = sorted(fw_after[step], key=lambda it: 0 if it[0] == "issue" else 1)
        # inserting_after(anchor) puts each new node right after anchor; keep order by chaining.
        cursor = anchor
        for kind, ev, g in items:
            if kind == "issue":
                src = fw_nodes[g.issue_after]  # the group's earliest-defined saved view
                if g.layout == "span":
                    # A 1-D view over every member's elements of the shared storage.
                    with fw_graph.inserting_after(cursor):
                        cover = fw_graph.call_function(
                            torch.ops.aten.as_strided.default, (src, [g.span_numel], [1], g.span_offset)
                        )
                    with fake_mode:
                        _set_val(cover, torch.ops.aten.as_strided.default(src.meta["val"], [g.span_numel], [1], g.span_offset))
                    cover.meta["trinity"] = f"span of buffer {ev.buffer} covering {len(g.saved)} saved views"
                    cursor = src = cover
                with fw_graph.inserting_after(cursor):
                    host = fw_graph.call_function(EVICT, (src, runtime_id))
                with fake_mode:
                    _set_val(host, EVICT(src.meta["val"], runtime_id))
                host.meta["trinity"] = f"evict {format_bytes(g.copy_bytes)} of buffer {ev.buffer} to host"
                host_of[id(g)] = host
                src_of[id(g)] = src
                counts["evict"] += 1
                cursor = host
            else:
                host, src = host_of[id(g)], src_of[id(g)]
                with fw_graph.inserting_after(cursor):
                    w = fw_graph.call_function(EVICT_WAIT, (host, src, runtime_id))
                _set_val(w, None)
                w.meta["trinity"] = f"D2H done; buffer {ev.buffer} freed after this"
                counts["evict_wait"] += 1
                cursor = w
    for ev in plan.evictions:
        for g in ev.groups:
            for i in g.saved:
                outputs[liveness.saved[i].fw_output_index] = host_of[id(g)]
    fw_out.args = (tuple(outputs),) + tuple(fw_out.args[1:])

    bw_graph = pair.backward.graph
    dev_of: dict[int, fx.Node] = {}
    rebuilt: list[fx.Node] = []
    for step in sorted(bw_before):
        local = step - F
        if not (0 <= local < len(bw_nodes)) or bw_nodes[local].op == "placeholder":
            raise ValueError(f"insert_transfers: backward step {step} is not a compute node")
        anchor = bw_nodes[local]
        items = sorted(bw_before[step], key=lambda it: 0 if it[0] == "issue" else 1)
        for kind, ev, g in items:
            first = liveness.saved[g.saved[0]]
            if kind == "issue":
                ph = bw_placeholders[first.bw_node]
                old = ph.meta["val"]
                with fake_mode:
                    if g.layout == "span":
                        host_val = torch.empty((g.span_numel,), dtype=old.dtype, device="cpu")
                    else:
                        host_val = torch.empty_strided(old.size(), old.stride(), dtype=old.dtype, device="cpu")
                _set_val(ph, host_val)
                ph.meta["trinity"] = "host copy of a saved activation"
                with bw_graph.inserting_before(anchor):
                    dev = bw_graph.call_function(PREFETCH, (ph, old.device, runtime_id))
                with fake_mode:
                    _set_val(dev, PREFETCH(host_val, old.device, runtime_id))
                dev.meta["trinity"] = f"prefetch {format_bytes(g.copy_bytes)} of buffer {ev.buffer}"
                dev_of[id(g)] = dev
                counts["prefetch"] += 1
                if g.layout == "view":
                    # Every reader of every placeholder of the group now reads the prefetched tensor.
                    for i in g.saved:
                        other = bw_placeholders[liveness.saved[i].bw_node]
                        other.replace_all_uses_with(dev, delete_user_cb=lambda user: user is not dev)
            else:
                dev = dev_of[id(g)]
                with bw_graph.inserting_before(anchor):
                    w = bw_graph.call_function(PREFETCH_WAIT, (dev, runtime_id))
                _set_val(w, None)
                w.meta["trinity"] = "H2D done"
                counts["prefetch_wait"] += 1
                if g.layout == "span":
                    # Rebuild each saved view from the prefetched span, after the wait.
                    for i in g.saved:
                        st = liveness.saved[i]
                        other = bw_placeholders[st.bw_node]
                        args = (dev, list(st.shape), list(st.stride), st.storage_offset - g.span_offset)
                        with bw_graph.inserting_before(anchor):
                            view = bw_graph.call_function(torch.ops.aten.as_strided.default, args)
                        with fake_mode:
                            _set_val(view, torch.ops.aten.as_strided.default(dev.meta["val"], *args[1:]))
                        view.meta["trinity"] = f"saved view {st.fw_node} rebuilt from the prefetched span"
                        other.replace_all_uses_with(view, delete_user_cb=lambda user: user.target is not PREFETCH)
                        rebuilt.append(view)
    # Placeholders of a group other than the one prefetched are unused now; give them the same
    # host value so the graph's input signature stays consistent.
    for ev in plan.evictions:
        for g in ev.groups:
            host_val = bw_placeholders[liveness.saved[g.saved[0]].bw_node].meta["val"]
            for i in g.saved[1:]:
                _set_val(bw_placeholders[liveness.saved[i].bw_node], host_val)
    _refresh_aliases(bw_graph, list(dev_of.values()) + rebuilt, fake_mode)
    for gm in (pair.forward, pair.backward):
        gm.graph.lint()
        gm.recompile()
    return counts
