"""Rewrite: recompute chosen saved activations in the backward instead of saving them.

For each recomputed buffer (a :class:`~.recompute_chains.Chain`), in place:

* the forward stops returning its saved views (and the backward loses their placeholders), so
  the forward frees the buffer after its last forward reader;
* the chain's forward nodes are duplicated into the backward as plain FX nodes (``node_copy``,
  the same ops on the same arguments), placed right before the first backward node that reads
  one of the saved views, or before the first recomputation that reads them as a leaf (a chain
  that depends on another recomputed buffer finds it rebuilt first); the inner compiler fuses
  them like any other backward node;
* leaves the backward did not receive become new saved values: a parameter or input is appended
  to the forward's saved tensors and gets a backward placeholder of the same name (the
  partitioner's convention that binds them, see ``graph_pair.py``);
* a random op on a chain is replayed bit-identically: in the forward it becomes
  ``run_and_save_rng_state(op, ...)``, which returns the generator state it ran with (a new saved
  value, ``<node>_rng_state``) and the op's result; the backward copy is
  ``run_with_rng_state(state, op, ...)`` (``torch._prims.rng_prims``).
* under Inductor (``pin``), a chain whose first reader is a kernel of its own (an ``mm``,
  attention) is kept there by a ``trinity::fence`` right before that reader (:func:`_pin`):
  Inductor would otherwise fuse the chain into a later kernel that reads the same input.

The chains and the liveness carry the nodes they are about (:mod:`offload_compiler.ir.refs`);
names matter only where the partitioner's convention binds a new saved value's backward
placeholder to its forward node (the same name). Inserted nodes are recognised by
``node.meta["trinity_recompute"]``; the pin's fences by target
(:data:`~offload_compiler.ir.ops.FENCE`, with ``hosts``), their ``meta["val"]`` ``None``.

Reads ``node.meta["val"]``. Writes, on inserted nodes: ``node.meta["val"]`` (the forward's fake
values, as the partitioner does for the nodes it recomputes), ``node.meta["tensor_meta"]``,
``node.meta["trinity"]`` (a description for dumps), ``node.meta["trinity_recompute"]`` (the
liveness buffer id the node rebuilds) and ``node.meta["autograd_backward"]``; on the forward's
output node ``meta["desc"]`` (AOTAutograd's output descriptors, kept aligned with the outputs).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.fx as fx

from ..graph_pair import GraphPair, fake_mode_of
from ..ir.alias import is_view
from ..ir.meta import NOTE_KEY, RECOMPUTE_KEY, TARGET_DEVICE_KEY
from ..ir.ops import FENCE
from .insert_transfers import _set_val
from .liveness import BufferKind, Liveness, inlining_reader
from .recompute_chains import RNG_STATE_SUFFIX, Chain

__all__ = ["apply", "RECOMPUTE_KEY", "copy_pair", "copied_node"]


class _DetachedGraph:
    """A graph without a module: what the analyses read (``.graph``), without generating code.
    ``copied`` maps each node of the graph it was copied from to its copy here."""

    def __init__(self, graph: fx.Graph, meta: dict, copied: dict[fx.Node, fx.Node]):
        self.graph = graph
        self.meta = meta
        self.copied = copied

    def recompile(self) -> None:
        pass


def copy_pair(pair: GraphPair) -> GraphPair:
    """A copy of ``pair`` with new graphs (same node names, same ``meta`` values: the fake
    tensors are shared, so aliasing analysis sees the same storages) that a rewrite may change
    without touching ``pair``. The copies are bare graphs (no Python code is generated): enough
    for liveness, the cost model and this rewrite, not for running."""

    def copy_gm(gm: fx.GraphModule) -> _DetachedGraph:
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for n in gm.graph.nodes:
            env[n] = graph.node_copy(n, lambda x: env[x])
        graph._codegen = gm.graph._codegen
        return _DetachedGraph(graph, dict(getattr(gm, "meta", {})), env)

    return GraphPair(copy_gm(pair.forward), copy_gm(pair.backward), pair.num_fwd_outputs, pair.static_input_indices)


def copied_node(pair: GraphPair, node: fx.Node) -> fx.Node:
    """``node`` as a node of ``pair``'s graphs: itself when it is one, else its copy when ``pair``
    is a :func:`copy_pair` of the graphs ``node`` belongs to.

    The one place this rewrite finds a plan's node in other graphs: the planner applies a plan made
    on the real graphs to a copy of them (:func:`.plan_recompute.plan_joint`, stage 3), and
    :func:`copy_pair` recorded the copy of each node (node for node, not by name).

    Raises:
        ValueError: for a node of neither.
    """
    if node.graph is pair.forward.graph or node.graph is pair.backward.graph:
        return node
    for gm in (pair.forward, pair.backward):
        copy = getattr(gm, "copied", {}).get(node)
        if copy is not None:
            return copy
    raise ValueError(f"insert_recompute: node {node.name!r} of the plan is not in these graphs")


def _rng_state_val(device: torch.device, fake_mode):
    """A fake value shaped like the generator state of ``device`` (a CPU uint8 tensor)."""
    if device.type == "cuda":
        shape = torch.cuda.get_rng_state(device).shape
    else:
        shape = torch.get_rng_state().shape
    with fake_mode:
        return torch.empty(shape, dtype=torch.uint8, device="cpu")


def _saved_desc(i: int):
    from torch._functorch._aot_autograd.descriptors import SavedForBackwardsAOTOutput

    return SavedForBackwardsAOTOutput(i)


def apply(pair: GraphPair, liveness: Liveness, chains: Sequence[Chain], pin: bool = False) -> dict[str, int]:
    """Recompute ``chains`` in the backward of ``pair`` (in place; see the module docstring) and
    recompile both graphs.

    Args:
        pair: the graphs ``liveness`` (and the chains) were computed on, not rewritten yet.
        liveness: their liveness (the saved views and their placeholders).
        chains: the buffers to recompute (from :func:`.recompute_chains.analyze`).
        pin: keep each chain where it is placed under Inductor (``inner="inductor"``; see
            :func:`_pin`). The planner's copy and the real rewrite must pass the same value.

    Returns:
        Counts: ``{"recomputed_buffers", "recompute_nodes", "new_saved", "rng_replays", "pins"}``.

    Raises:
        ValueError: if a chain refers to nodes that are not in these graphs (nor in the graphs
            ``pair`` was copied from by :func:`copy_pair`).
    """
    counts = {"recomputed_buffers": 0, "recompute_nodes": 0, "new_saved": 0, "rng_replays": 0, "pins": 0}
    if not chains:
        return counts
    fw, bw = pair.forward.graph, pair.backward.graph
    fake_mode = fake_mode_of(pair.forward, pair.backward)
    recomputed = {c.buffer for c in chains}

    def here(node: fx.Node | None, graph: fx.Graph, what: str) -> fx.Node:
        """The plan's ``node`` in ``graph`` (see :func:`copied_node`)."""
        got = copied_node(pair, node) if node is not None else None
        if (
            got is None
            or got.graph is not graph
            or (graph is bw and what == "saved placeholder" and got.op != "placeholder")
        ):
            name = node.name if node is not None else None
            raise ValueError(
                f"insert_recompute: {what} {name!r} is not in the {'forward' if graph is fw else 'backward'} graph"
            )
        return got

    saved_fw = {c.buffer: [here(liveness.saved[i].fw_ref, fw, "saved view") for i in c.saved] for c in chains}
    saved_bw = {c.buffer: [here(liveness.saved[i].bw_ref, bw, "saved placeholder") for i in c.saved] for c in chains}
    saved_names = {c.buffer: [liveness.saved[i].fw_node for i in c.saved] for c in chains}
    chain_nodes = {c.buffer: [here(n, fw, "chain node") for n in c.node_refs] for c in chains}
    # Forward node -> the backward placeholder that receives it (leaves saved already).
    bw_of: dict[fx.Node, fx.Node] = {}
    for c in chains:
        for leaf in c.leaves:
            if leaf.bw_ref is not None:
                bw_of[here(leaf.fw_ref, fw, "leaf")] = here(leaf.bw_ref, bw, "leaf placeholder")

    # 1. Random ops on a chain: run them under run_and_save_rng_state in the forward.
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    fw_pos = {n: i for i, n in enumerate(fw.nodes)}
    rng_nodes = sorted({here(n, fw, "random op") for c in chains for n in c.rng_refs}, key=fw_pos.__getitem__)
    rng_orig: dict[fx.Node, tuple] = {}  # replaced random op -> (op, args, kwargs, value)
    rng_result: dict[fx.Node, fx.Node] = {}  # the forward node that now holds its value -> the op
    rng_state: dict[fx.Node, fx.Node] = {}  # the op -> the forward node of its generator state
    for node in rng_nodes:
        name = node.name
        val = node.meta["val"]
        first = val[0] if isinstance(val, (tuple, list)) else val
        state_val = _rng_state_val(first.device, fake_mode)
        with fw.inserting_before(node):
            both = fw.call_function(run_and_save_rng_state, (node.target, *node.args), dict(node.kwargs))
            both.meta["val"] = (state_val, val)
            state = fw.create_node("call_function", operator.getitem, (both, 0), name=name + RNG_STATE_SUFFIX)
            _set_val(state, state_val)
            result = fw.call_function(operator.getitem, (both, 1))
            result.meta["val"] = val
        for n in (both, state, result):
            n.meta[NOTE_KEY] = f"generator state saved for the recomputation of {name}"
        rng_orig[node] = (node.target, node.args, dict(node.kwargs), val)
        rng_result[result] = node
        rng_state[node] = state
        node.replace_all_uses_with(result)
        fw.erase_node(node)
        counts["rng_replays"] += 1

    # 2. New saved values (leaves the backward did not receive).
    out_node = pair.fw_output_node()
    outputs = list(pair.fw_outputs())
    descs = list(out_node.meta.get("desc") or [])
    tensor_positions = [
        i
        for i in range(pair.num_fwd_outputs, len(outputs))
        if isinstance(outputs[i], fx.Node)
        and isinstance(outputs[i].meta.get("val"), torch.Tensor)
        and not outputs[i].meta.get("saved_tensor_with_no_vc_check", False)
    ]
    insert_at = (tensor_positions[-1] + 1) if tensor_positions else pair.num_fwd_outputs
    # The saved values' backward placeholders by position (checkpointing's RNG states have
    # placeholders named unlike their forward nodes; GraphPair.saved_links binds them).
    placeholder_at = {link.fw_output_index: link.bw_placeholder for link in pair.saved_links()}
    after_ph = placeholder_at.get(tensor_positions[-1]) if tensor_positions else None
    if after_ph is None:
        after_ph = next(iter(bw.find_nodes(op="placeholder")))
    new_links: list[fx.Node] = []  # forward nodes to save: parameters, inputs, generator states
    for c in chains:
        for leaf in c.leaves:
            if leaf.bw_ref is not None:
                continue
            op = here(leaf.fw_ref, fw, "leaf") if leaf.kind != "rng state" else here(leaf.fw_ref, fw, "random op")
            src = rng_state[op] if leaf.kind == "rng state" else op
            if src not in bw_of and src not in new_links:
                new_links.append(src)
    for src in new_links:
        name = src.name
        outputs.insert(insert_at, src)
        if descs:
            descs.insert(insert_at, _saved_desc(insert_at - pair.num_fwd_outputs))
        insert_at += 1
        with bw.inserting_after(after_ph):
            # The partitioner's convention: a saved value's placeholder has its forward node's name.
            ph = bw.placeholder(name)
        if ph.name != name:
            raise ValueError(f"insert_recompute: the backward already has a node named {name!r}")
        _set_val(ph, src.meta["val"])
        ph.meta[NOTE_KEY] = "saved for a recomputation"
        bw_of[src] = ph
        after_ph = ph
        counts["new_saved"] += 1

    # 3. Where each chain goes: before the first backward reader of its saved views, or earlier
    #    when a recomputation that reads it as a leaf comes first.
    order = {n: i for i, n in enumerate(bw.nodes)}
    end = len(order)

    def first_reader(placeholders) -> int:
        pos = [order[u] for ph in placeholders for u in ph.users]
        return min(pos) if pos else end

    anchor = {c.buffer: first_reader(saved_bw[c.buffer]) for c in chains}
    changed = True
    while changed:
        changed = False
        for c in chains:
            for dep in c.depends_on:
                if dep in recomputed and anchor[dep] > anchor[c.buffer]:
                    anchor[dep] = anchor[c.buffer]
                    changed = True
    bw_nodes = list(bw.nodes)
    fw_pos = {n: i for i, n in enumerate(fw.nodes)}
    env: dict[fx.Node, fx.Node] = {}  # forward node (a random op: the replaced one) -> its recomputation
    for c in sorted(chains, key=lambda c: (anchor[c.buffer], min(fw_pos.get(n, 0) for n in saved_fw[c.buffer]))):
        if anchor[c.buffer] >= end:
            raise ValueError(f"insert_recompute: buffer {c.buffer} has no backward reader")
        at = bw_nodes[anchor[c.buffer]]
        what = ", ".join(saved_names[c.buffer])

        def arg(n: fx.Node) -> fx.Node:
            key = rng_result.get(n, n)
            if key in env:
                return env[key]
            if n in bw_of:
                return bw_of[n]
            raise ValueError(f"insert_recompute: {n.name!r} is neither recomputed nor saved")

        for node in chain_nodes[c.buffer]:
            if node in env:
                continue
            with bw.inserting_before(at):
                if node in rng_orig:
                    op, op_args, op_kwargs, val = rng_orig[node]
                    state = bw_of[rng_state[node]]
                    new = bw.call_function(
                        run_with_rng_state, (state, op, *fx.node.map_arg(op_args, arg)), fx.node.map_arg(op_kwargs, arg)
                    )
                    new.meta["val"] = val
                else:
                    new = bw.node_copy(node, arg)
            new.meta[NOTE_KEY] = f"recomputed for saved {what}"
            new.meta[RECOMPUTE_KEY] = c.buffer
            new.meta["autograd_backward"] = True
            env[node] = new
            counts["recompute_nodes"] += 1
        counts["recomputed_buffers"] += 1

    # 4. The saved views' readers read the recomputed values; the saved outputs go.
    drop = set()
    for c in chains:
        for fnode, ph in zip(saved_fw[c.buffer], saved_bw[c.buffer]):
            ph.replace_all_uses_with(env[fnode])
            bw.erase_node(ph)
            drop.add(fnode)
    keep = [
        (i, o)
        for i, o in enumerate(outputs)
        if not (i >= pair.num_fwd_outputs and isinstance(o, fx.Node) and o in drop)
    ]
    out_node.args = (tuple(o for _, o in keep),) + tuple(out_node.args[1:])
    if descs:
        new_descs = []
        k = 0
        for i, _ in keep:
            d = descs[i]
            if i >= pair.num_fwd_outputs and type(d).__name__.startswith("SavedForBackwards"):
                d = type(d)(k)
                k += 1
            new_descs.append(d)
        out_node.meta["desc"] = new_descs
    fw.eliminate_dead_code()
    if pin:
        device_type = pair.forward.meta.get(TARGET_DEVICE_KEY)
        # The backward placeholders of saved activations the chains read (not parameters, their
        # saved views or inputs: never declared written).
        activations = {
            bw_of[here(leaf.fw_ref, fw, "leaf")]
            for c in chains
            for leaf in c.leaves
            if leaf.buffer is not None and liveness.buffers[leaf.buffer].kind is BufferKind.SAVED
        }
        for c in chains:
            outs = [env[f] for f in saved_fw[c.buffer]]
            counts["pins"] += _pin(bw, outs, chain_nodes[c.buffer], env, activations, device_type)
    for gm in (pair.forward, pair.backward):
        if not isinstance(gm, _DetachedGraph):
            gm.graph.lint()
        gm.recompile()
    return counts


def _pin(
    bw: fx.Graph, outs: list[fx.Node], fw_chain: list[fx.Node], env: dict, activations: set, device_type: str | None
) -> int:
    """Keep a recomputed chain where the rewrite put it, under Inductor. Returns 1 if a fence was
    inserted, else 0.

    Inductor fuses kernels that read the same buffer (horizontal fusion) wherever no dependency
    forbids it, and a fused kernel runs where its later part would. A chain that rebuilds a
    layer norm's output just before the weight-gradient ``mm`` reading it shares the normalised
    input with that layer norm's backward, a few kernels later: Inductor fuses the two, so the
    chain, and the ``mm`` after it, run late while the buffers between stay allocated (measured
    on a tied GPT under Inductor: 785 KB above the plan). When the chain's first reader is a
    kernel of its own (an ``mm``, attention: not a pointwise op, a reduction or ``gather`` that
    the chain fuses into, :func:`~.liveness.inlining_reader`), a ``trinity::fence(hosts, out)``
    right before that reader declares a write on ``hosts``, the chain's leaves (saved activations'
    placeholders, ``activations``, or other chains' recomputed values) that backward nodes after
    the reader also read: those
    readers now follow the fence, which follows the chain, so fusing the chain into one of them
    would make a cycle and Inductor does not. The fence does nothing at run time.
    """
    copies = {env[n] for n in fw_chain}
    order = {n: i for i, n in enumerate(bw.nodes)}
    readers, stack, seen = [], list(outs), set()
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in seen or u in copies:
                continue
            seen.add(u)
            if u.op == "call_function" and is_view(u):
                stack.append(u)
            else:
                readers.append(u)
    if not readers:
        return 0
    first = min(readers, key=order.__getitem__)
    if first.op != "call_function" or first.target is FENCE or inlining_reader(first, device_type):
        return 0
    hosts = []
    for leaf in dict.fromkeys(a for c in copies for a in c.all_input_nodes if a not in copies):
        if not isinstance(leaf.meta.get("val"), torch.Tensor):
            continue
        if (RECOMPUTE_KEY in leaf.meta or leaf in activations) and any(
            order[u] > order[first] for u in leaf.users if u not in copies
        ):
            hosts.append(leaf)
    if not hosts:
        return 0
    with bw.inserting_before(first):
        fence = bw.call_function(FENCE, (hosts, outs[-1]))
    _set_val(fence, None)
    fence.meta[NOTE_KEY] = (
        f"keeps the recomputation of {outs[-1].name} before {first.name} (no horizontal fusion later)"
    )
    return 1
