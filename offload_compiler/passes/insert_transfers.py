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
consistent) and ``node.meta["trinity"]`` (a short description shown in dumps). Each evict is given
the strides its host tensor must have: its source's in the graph (:func:`_declared_stride`), or
for Inductor the ones Inductor requires of that forward output (:func:`_inductor_output_strides`).
"""

from __future__ import annotations

import logging
import operator
from types import SimpleNamespace

import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.multiprocessing.reductions import StorageWeakRef

from ..graph_pair import GraphPair, fake_mode_of, is_rng_state, tensor_vals
from ..ir.alias import is_view
from ..ir.meta import NOTE_KEY
from ..ir.ops import EVICT, EVICT_WAIT, FENCE, PREFETCH, PREFETCH_WAIT, TRANSFER_OPS
from ..options import format_bytes
from .liveness import Buffer, Liveness, fused_chain_end
from .plan_window import Plan

log = logging.getLogger(__name__)

__all__ = ["apply"]


def _set_val(node: fx.Node, val) -> None:
    node.meta["val"] = val
    if isinstance(val, torch.Tensor):
        node.meta["tensor_meta"] = _extract_tensor_metadata(val)
    else:
        node.meta.pop("tensor_meta", None)


def _declared_stride(val) -> list[int] | None:
    """The strides an evict's host tensor is given: its source's strides in the graph, passed as
    the op's ``stride`` argument (see ``trinity::evict`` in :mod:`offload_compiler.ir.ops`), so
    that it keeps them whatever layout Inductor gives the source. ``None`` (the source's own
    strides at run time) where a stride is symbolic: FX would need ``sym_stride`` nodes for it."""
    stride = val.stride()
    return [int(s) for s in stride] if all(isinstance(s, int) for s in stride) else None


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
        if any(isinstance(t, torch.Tensor) and StorageWeakRef(t.untyped_storage()) in in_storages for t in new_vals):
            _set_val(n, new_val)
            fresh.add(n)


def _holders(buf: Buffer, present: set[fx.Node]) -> list[fx.Node]:
    """The nodes among ``present`` (one graph's nodes) that hold ``buf``, in liveness's order
    (:attr:`.liveness.Buffer.holders`); holders of the other graph, and holders no longer in the
    graph (removed as dead), are left out."""
    return [n for n in buf.holders if n in present]


def _check_refs(pair: GraphPair, liveness: Liveness, plan: Plan) -> None:
    """Raise ``ValueError`` unless the saved tensors ``plan`` moves are nodes of ``pair``'s graphs
    (the liveness was computed on them, or rebound to them: :meth:`.liveness.Liveness.rebind`)."""
    fw, bw = pair.forward.graph, pair.backward.graph
    for ev in plan.evictions:
        for g in ev.groups:
            for i in g.saved:
                st = liveness.saved[i]
                if st.fw_ref is None or st.fw_ref.graph is not fw or st.bw_ref is None or st.bw_ref.graph is not bw:
                    raise ValueError(
                        f"insert_transfers: saved tensor {st.fw_node!r} of the plan is not a node of these graphs "
                        "(the liveness was computed on other graphs)"
                    )


class _OrderingEdges:
    """Chooses the ``after`` node of an inserted op: the closest node before the insertion point
    that computes a fresh tensor in this graph and whose buffer the plan keeps alive across that
    point, so the extra edge extends no lifetime. Skipped: placeholders, views, trinity ops, and
    nodes the inner compiler fuses into their reader (an extra reader would make it materialise
    them)."""

    def __init__(self, liveness: Liveness, plan: Plan, graph: fx.Graph):
        present = set(graph.nodes)
        evicted_until = {ev.buffer: ev.wait_after for ev in plan.evictions}
        self.alive: dict[fx.Node, tuple[int, int]] = {}
        self.fused: set[fx.Node] = set()
        for b in liveness.buffers:
            end = min(b.last_step, evicted_until.get(b.id, b.last_step))
            for node in _holders(b, present):
                self.alive[node] = (b.def_step, end)
                if b.fused:
                    self.fused.add(node)

    def before(self, node: fx.Node, step: int) -> fx.Node | None:
        """The edge for an op placed after ``node`` and alive-checked at joint step ``step``."""
        while node.op != "root":
            if node.op == "placeholder":
                return None
            span = self.alive.get(node)
            if (
                node.op == "call_function"
                and node.target not in TRANSFER_OPS
                and node not in self.fused
                and span is not None
                and span[0] <= step <= span[1]
                and isinstance(node.meta.get("val"), torch.Tensor)
                and not is_view(node)
            ):
                return node
            node = node.prev
        return None


def _fused_nodes(graph: fx.Graph, liveness: Liveness) -> set:
    """The nodes of ``graph`` whose buffers liveness marked fused."""
    present = set(graph.nodes)
    return {b.holders[0] for b in liveness.buffers if b.fused and b.holders and b.holders[0] in present}


def _past_sibling_getitems(node: fx.Node) -> fx.Node:
    """The last of the ``getitem`` nodes that directly follow ``node`` and unpack the same
    multi-output op (``node`` itself, or the op ``node`` indexes; nested tuples included), or
    ``node`` when none follows. Transfers go after the whole group: a getitem after an
    ``evict_wait`` would keep the op's tuple, and so the evicted element, alive past its free
    (see ``reorder``, which groups the getitems); and a wait between a multi-output reader and its
    getitems would come before the fence that orders the reader ahead of it."""
    group = {node}
    if node.op == "call_function" and node.target is operator.getitem:
        group.add(node.args[0])
    while node.next.op == "call_function" and node.next.target is operator.getitem and node.next.args[0] in group:
        node = node.next
        group.add(node)
    return node


def _after_in_order(a: fx.Node, b: fx.Node) -> bool:
    """Whether ``a`` comes after ``b`` in their graph."""
    node = b.next
    while node.op != "root":
        if node is a:
            return True
        node = node.next
    return False


def _fence_operand(reader: fx.Node, order: dict) -> fx.Node | None:
    """The tensor a fence takes from ``reader``: its own value, or for a multi-output op (a tuple,
    possibly nested, unpacked by ``getitem`` nodes) the first element in graph order that is a
    tensor, leaving out an RNG state (see :func:`~offload_compiler.graph_pair.is_rng_state`). ``None`` when there is none."""
    if isinstance(reader.meta.get("val"), torch.Tensor):
        return None if is_rng_state(reader) else reader
    found = []
    frontier = [reader]
    while frontier:
        node = frontier.pop()
        for u in node.users:
            if u.op != "call_function" or u.target is not operator.getitem or is_rng_state(u):
                continue
            if isinstance(u.meta.get("val"), torch.Tensor):
                found.append(u)
            else:
                frontier.append(u)
    return min(found, key=lambda n: order[n]) if found else None


def _is_multi_output(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list)) or any(
        u.op == "call_function" and u.target is operator.getitem for u in node.users
    )


def _insert_fences(fw_graph: fx.Graph, liveness: Liveness, plan: Plan, host_of: dict) -> int:
    """Put a ``trinity::fence`` after every forward reader of an evicted buffer (see ``ir/ops.py``), so
    Inductor orders it before the buffer's waits. A reader fused into its only reader is fenced
    where the fused chain ends (fencing it directly would make Inductor materialise it).

    When the evicted buffer is one output of a multi-output op (SDPA's logsumexp, a checkpointed
    op's result), the op node holds it too, but the op's other ``getitem`` nodes are siblings, not
    readers: each selects its own output. A multi-output reader is fenced through one of its
    tensor outputs (never an RNG state, which is a real tensor under Inductor)."""
    present = set(fw_graph.nodes)
    # Readers the inner compiler fuses into their only reader are read where that chain ends.
    fused = _fused_nodes(fw_graph, liveness)
    count = 0
    for ev in plan.evictions:
        buf = liveness.buffers[ev.buffer]
        # Holders removed as dead (saved-only views the host copy replaced) are skipped.
        aliases = set(_holders(buf, present))
        hosts = [host_of[id(g)] for g in ev.groups]
        skip = set(hosts) | aliases
        readers = []
        for a in aliases:
            multi = _is_multi_output(a)
            for u in a.users:
                if u in skip or u.op != "call_function" or u.target in TRANSFER_OPS:
                    continue
                if multi and u.target is operator.getitem:
                    continue  # a sibling output (the buffer's own getitem is an alias, skipped)
                if u.target is torch.ops.aten.as_strided.default and any(h.args[0] is u for h in hosts):
                    continue  # the span/view the copy reads
                end = fused_chain_end(u, fused)
                if end.op == "call_function" and end.target not in TRANSFER_OPS:
                    readers.append(end)
        order = {n: i for i, n in enumerate(fw_graph.nodes)}
        for r in sorted(set(readers), key=lambda n: order[n]):
            r = _fence_operand(r, order)
            if r is None:
                continue
            after = max([r] + hosts, key=lambda n: order[n])
            with fw_graph.inserting_after(after):
                fence = fw_graph.call_function(FENCE, (hosts, r))
            _set_val(fence, None)
            fence.meta[NOTE_KEY] = f"reader of evicted buffer {ev.buffer} done before its wait"
            order = {n: i for i, n in enumerate(fw_graph.nodes)}
            count += 1
    return count


def apply(
    pair: GraphPair,
    liveness: Liveness,
    plan: Plan,
    runtime_id: int,
    fence_readers: bool = False,
    inductor_layouts: bool = False,
) -> dict[str, int]:
    """Insert the transfer nodes of ``plan`` into ``pair`` (in place) and recompile both graphs.

    Args:
        pair: the graphs ``liveness`` was computed on (not yet rewritten).
        liveness: their liveness.
        plan: the plan to apply.
        runtime_id: id of the :class:`~offload_compiler.runtime.transfer.TransferRuntime` the ops
            will use.
        fence_readers: insert ``trinity::fence`` after the forward readers of evicted buffers
            (for Inductor, which may otherwise inline them past the wait).
        inductor_layouts: the inner compiler is Inductor: host tensors get the layout Inductor
            gives the forward's outputs (see :func:`_inductor_output_strides`).

    Returns:
        Counts of inserted nodes by op (``{"evict": n, ...}``).

    Raises:
        ValueError: if the plan refers to steps or nodes that are not in these graphs.
    """
    fw_nodes = list(pair.forward.graph.nodes)
    bw_nodes = list(pair.backward.graph.nodes)
    if len(fw_nodes) + len(bw_nodes) != liveness.num_steps:
        raise ValueError("insert_transfers: the graphs do not match the liveness the plan was made on")
    _check_refs(pair, liveness, plan)
    fake_mode = fake_mode_of(pair.forward, pair.backward)
    fw_after, bw_before = _gaps(plan)
    counts = {"evict": 0, "evict_wait": 0, "prefetch": 0, "prefetch_wait": 0}
    host_of = _insert_evictions(pair, liveness, plan, fw_nodes, fw_after, runtime_id, fake_mode, counts)
    if fence_readers:
        counts["fence"] = _insert_fences(pair.forward.graph, liveness, plan, host_of)
    if inductor_layouts:
        _inductor_output_strides(pair.forward, host_of.values(), fake_mode)
    _insert_prefetches(pair, liveness, plan, len(fw_nodes), bw_nodes, bw_before, runtime_id, fake_mode, counts, host_of)
    for gm in (pair.forward, pair.backward):
        gm.graph.lint()
        gm.recompile()
    return counts


def _inductor_output_strides(gm: fx.GraphModule, hosts, fake_mode) -> None:
    """Give each evict's host tensor the strides Inductor requires of that forward output.

    Inductor makes every output of the graph it compiles have the strides of its fake value,
    except that with its layout optimization (channels-last convolutions,
    ``GraphLowering.decide_layout_opt``) a dense 4-D output among the nodes that prefer
    channels-last (``GraphLowering.find_nodes_prefer_channels_last``, asked here of Inductor
    itself on this graph) must be channels-last (``GraphLowering.run_node`` in
    ``torch/_inductor/graph.py``). Where the host tensor is laid out otherwise, Inductor adds a
    kernel copying it into the required strides: a second tensor of its size saved for the
    backward, made while the copy into the host block may still run. So an evict with such an
    output is given channels-last strides (``stride`` argument and fake value).

    Reads and writes the evicts' ``args`` and ``meta["val"]``."""
    from torch._prims_common import make_channels_last_strides_for

    from .liveness import _channels_last_copied, inductor_layout_opt

    if not inductor_layout_opt(gm):
        return
    try:
        from torch._inductor.graph import GraphLowering

        prefer = GraphLowering.find_nodes_prefer_channels_last(SimpleNamespace(module=gm))
    except (ImportError, AttributeError, TypeError) as exc:  # another torch: keep the graph's strides
        log.warning("insert_transfers: no channels-last output layouts for Inductor (%s)", exc)
        return
    for host in hosts:
        val = host.meta["val"]
        static = all(isinstance(d, int) for d in val.shape)  # a symbolic shape keeps the graph's strides
        if host in prefer and static and _channels_last_copied(val):
            stride = [int(x) for x in make_channels_last_strides_for(val.shape)]
            host.args = (host.args[0], host.args[1], stride)
            with fake_mode:
                _set_val(host, EVICT(*_fake_args(host.args)))


def _gaps(plan: Plan) -> tuple[dict[int, list], dict[int, list]]:
    """The insertions per gap, ``step -> [("issue" | "wait", eviction, group)]``: after forward
    steps and before backward steps (so that issues can precede waits at each gap)."""
    fw_after: dict[int, list] = {}
    bw_before: dict[int, list] = {}
    for ev in plan.evictions:
        for g in ev.groups:
            fw_after.setdefault(g.issue_after, []).append(("issue", ev, g))
            fw_after.setdefault(ev.wait_after, []).append(("wait", ev, g))
            bw_before.setdefault(ev.prefetch_before, []).append(("issue", ev, g))
            bw_before.setdefault(g.wait_before, []).append(("wait", ev, g))
    return fw_after, bw_before


def _insert_evictions(
    pair: GraphPair,
    liveness: Liveness,
    plan: Plan,
    fw_nodes: list[fx.Node],
    fw_after: dict[int, list],
    runtime_id: int,
    fake_mode,
    counts: dict[str, int],
) -> dict[int, fx.Node]:
    """The forward's ``evict`` (with the view it copies, where that is not a holder's own) and
    ``evict_wait`` nodes; the forward then returns the host tensors in place of the saved ones,
    and the saved-only views they replaced are removed. Returns ``id(group) -> host node``.

    Raises:
        ValueError: for a forward step that is not a node before the output.
    """
    F = len(fw_nodes)
    fw_graph = pair.forward.graph
    fw_edges = _OrderingEdges(liveness, plan, fw_graph)
    host_of: dict[int, fx.Node] = {}  # id(group) -> host node in the forward
    src_of: dict[int, fx.Node] = {}
    last_at: dict[fx.Node, fx.Node] = {}  # anchor -> the last node inserted after it
    for step in sorted(fw_after):
        if not (0 <= step < F - 1):
            raise ValueError(f"insert_transfers: forward step {step} is not a node before the output")
        anchor = _past_sibling_getitems(fw_nodes[step])
        items = sorted(fw_after[step], key=lambda it: 0 if it[0] == "issue" else 1)
        # inserting_after(anchor) puts each new node right after anchor; keep order by chaining,
        # across steps too: the getitems of one multi-output node share their anchor, and a wait
        # after a later getitem must follow an evict issued after an earlier one.
        cursor = last_at.get(anchor, anchor)
        for kind, ev, g in items:
            if kind == "issue":
                src = fw_nodes[g.issue_after]
                first = liveness.saved[g.saved[0]]
                if g.layout == "span":
                    view_args = ([g.span_numel], [1], g.span_offset)
                    note = f"span of buffer {ev.buffer} covering {len(g.saved)} saved views"
                elif g.from_source and not first.same_view_as_source:
                    view_args = (list(first.shape), list(first.stride), first.storage_offset)
                    note = f"saved view {first.fw_node} taken from its buffer's first holder"
                else:
                    view_args = None
                if view_args is not None:
                    with fw_graph.inserting_after(cursor):
                        cover = fw_graph.call_function(torch.ops.aten.as_strided.default, (src, *view_args))
                    with fake_mode:
                        _set_val(cover, torch.ops.aten.as_strided.default(src.meta["val"], *view_args))
                    cover.meta[NOTE_KEY] = note
                    cursor = src = cover
                with fw_graph.inserting_after(cursor):
                    host = fw_graph.call_function(EVICT, (src, runtime_id, _declared_stride(src.meta["val"])))
                with fake_mode:
                    _set_val(host, EVICT(*_fake_args(host.args)))
                host.meta[NOTE_KEY] = f"evict {format_bytes(g.copy_bytes)} of buffer {ev.buffer} to host"
                host_of[id(g)] = host
                src_of[id(g)] = src
                counts["evict"] += 1
                cursor = host
            else:
                host, src = host_of[id(g)], src_of[id(g)]
                after = fw_edges.before(anchor, step + 1)
                with fw_graph.inserting_after(cursor):
                    w = fw_graph.call_function(EVICT_WAIT, (host, src, runtime_id, after))
                _set_val(w, None)
                w.meta[NOTE_KEY] = f"D2H done; buffer {ev.buffer} freed after this"
                counts["evict_wait"] += 1
                cursor = w
        last_at[anchor] = cursor
    fw_out = pair.fw_output_node()
    outputs = list(pair.fw_outputs())
    for ev in plan.evictions:
        for g in ev.groups:
            for i in g.saved:
                outputs[liveness.saved[i].fw_output_index] = host_of[id(g)]
    fw_out.args = (tuple(outputs),) + tuple(fw_out.args[1:])
    # Saved views the host copies replaced (e.g. a late ``detach`` of an evicted activation) are
    # dead now; left in, they would read the evicted storage after it was freed.
    fw_graph.eliminate_dead_code()
    return host_of


def _insert_prefetches(
    pair: GraphPair,
    liveness: Liveness,
    plan: Plan,
    F: int,
    bw_nodes: list[fx.Node],
    bw_before: dict[int, list],
    runtime_id: int,
    fake_mode,
    counts: dict[str, int],
    host_of: dict[int, fx.Node],
) -> None:
    """The backward's ``prefetch`` and ``prefetch_wait`` nodes: the saved placeholders become
    host tensors (in the layout of the forward's host tensor, ``host_of``), their readers read the prefetched tensor (or, for a span, the views rebuilt from
    it after the wait).

    Raises:
        ValueError: for a backward step that is not a compute node.
    """
    bw_graph = pair.backward.graph
    bw_edges = _OrderingEdges(liveness, plan, bw_graph)
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
                ph = first.bw_ref
                old = ph.meta["val"]
                with fake_mode:
                    if g.layout == "span":
                        host_val = torch.empty((g.span_numel,), dtype=old.dtype, device="cpu")
                    else:
                        stride = host_of[id(g)].meta["val"].stride()
                        host_val = torch.empty_strided(old.size(), stride, dtype=old.dtype, device="cpu")
                _set_val(ph, host_val)
                ph.meta[NOTE_KEY] = "host copy of a saved activation"
                after = bw_edges.before(anchor.prev, step)
                with bw_graph.inserting_before(anchor):
                    dev = bw_graph.call_function(PREFETCH, (ph, old.device, runtime_id, after))
                with fake_mode:
                    _set_val(dev, PREFETCH(host_val, old.device, runtime_id, after.meta["val"] if after else None))
                dev.meta[NOTE_KEY] = f"prefetch {format_bytes(g.copy_bytes)} of buffer {ev.buffer}"
                dev_of[id(g)] = dev
                counts["prefetch"] += 1
                if g.layout == "view":
                    # Every reader of every placeholder of the group now reads the prefetched tensor.
                    for i in g.saved:
                        other = liveness.saved[i].bw_ref
                        other.replace_all_uses_with(dev, delete_user_cb=lambda user, dev=dev: user is not dev)
            else:
                dev = dev_of[id(g)]
                after = bw_edges.before(anchor.prev, step)
                if after is not None and not _after_in_order(after, dev):
                    after = None  # the node before the reader precedes the prefetch itself
                with bw_graph.inserting_before(anchor):
                    w = bw_graph.call_function(PREFETCH_WAIT, (dev, runtime_id, after))
                _set_val(w, None)
                w.meta[NOTE_KEY] = "H2D done"
                counts["prefetch_wait"] += 1
                if g.layout == "span":
                    rebuilt += _rebuild_span_views(bw_graph, liveness, g, dev, anchor, fake_mode)
    # Placeholders of a group other than the one prefetched are unused now; give them the same
    # host value so the graph's input signature stays consistent.
    for ev in plan.evictions:
        for g in ev.groups:
            host_val = liveness.saved[g.saved[0]].bw_ref.meta["val"]
            for i in g.saved[1:]:
                _set_val(liveness.saved[i].bw_ref, host_val)
    _refresh_aliases(bw_graph, list(dev_of.values()) + rebuilt, fake_mode)


def _rebuild_span_views(
    bw_graph: fx.Graph, liveness: Liveness, g, dev: fx.Node, anchor: fx.Node, fake_mode
) -> list[fx.Node]:
    """Each saved view of span group ``g``, rebuilt from the prefetched span ``dev`` before
    ``anchor`` (after the wait); their readers read the rebuilt views. Returns the views."""
    views = []
    for i in g.saved:
        st = liveness.saved[i]
        other = st.bw_ref
        args = (dev, list(st.shape), list(st.stride), st.storage_offset - g.span_offset)
        with bw_graph.inserting_before(anchor):
            view = bw_graph.call_function(torch.ops.aten.as_strided.default, args)
        with fake_mode:
            _set_val(view, torch.ops.aten.as_strided.default(dev.meta["val"], *args[1:]))
        view.meta[NOTE_KEY] = f"saved view {st.fw_node} rebuilt from the prefetched span"
        other.replace_all_uses_with(view, delete_user_cb=lambda user: user.target is not PREFETCH)
        views.append(view)
    return views
