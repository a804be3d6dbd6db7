"""Recompute chains: for each saved activation buffer, the forward ops that rebuild it in the backward.

An analysis (pure; reads ``node.meta["val"]``, writes nothing). For a saved buffer ``b`` (every
saved view of it), the chain is the smallest set of forward nodes whose re-execution rebuilds
those views from values the backward has anyway. Walking back from each saved view, a node is a
**leaf** (not recomputed) when it is

* a saved value: a forward output the backward receives as a placeholder (another saved
  activation, which the plan may itself keep, offload or recompute; a parameter's saved view; a
  saved size symbol);
* a forward placeholder (a parameter or an input, live the whole step anyway) that is not
  saved, or a tensor constant of the forward module (``get_attr``; ``torch.tensor(...)`` in the
  model): the rewrite adds it as a new saved value;
* Inductor's dropout seeds (``prims.inductor_seeds``, drawn once per forward), also added as a
  new saved value, as Inductor's own partitioner saves them;
* the random-number state of a random op (see below), also added as a new saved value;

and every other node on the way is recomputed. A chain is refused (the buffer can only be kept
or offloaded), with the reason recorded, when a node on it

* mutates an argument, has side effects (registered with ``torch.fx.node.has_side_effect``), is a collective,
  a trinity op or a higher-order op;
* has no known cost: no FLOP formula in ``torch.utils.flop_counter`` (for the CPU attention
  kernels the flash kernels' formula, as the cost model counts them:
  :func:`.cost_model.flop_packet`) and not a view, pointwise, reduction or listed memory-bound op
  (:data:`_MEMORY_BOUND`), so the cost model could not price its recomputation;
* is random (``Tag.nondeterministic_seeded``) and cannot be replayed bit-identically: with
  ``rng_replay`` (the inner compiler runs the graphs as written, ``inner="eager"``) a random op is
  recomputed under ``run_with_rng_state`` with the generator state saved right before the
  forward ran it (``torch._prims.rng_prims``, the partitioner's own mechanism); under Inductor the
  joint graph carries dropout as ``prims.inductor_random`` seeded by an explicit seed tensor,
  which is deterministic given the seed, so the seed is saved and the op recomputed as is;
* would need a leaf that cannot be bound in the backward (a name taken there, a size symbol not
  saved), or the chain grows past :data:`MAX_CHAIN_NODES` nodes.

Seconds and FLOPs of a chain are the cost model's figures for its nodes (the same op on the same
shapes), summed; ``transient_bytes`` are the fresh intermediates the recomputation allocates besides
the buffer itself (an upper bound: the inner compiler may fuse them away).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..graph_pair import GraphPair
from ..ir.refs import node_ref
from .cost_model import Costs, flop_packet
from .liveness import BufferKind, Liveness, _is_collective

__all__ = ["Leaf", "Chain", "ChainAnalysis", "analyze", "MAX_CHAIN_NODES", "RNG_STATE_SUFFIX"]

MAX_CHAIN_NODES = 48
RNG_STATE_SUFFIX = "_rng_state"

aten = torch.ops.aten
prims = torch.ops.prims

# Memory-bound ops without a FLOP formula whose cost is their bytes (the roofline's memory term).
_MEMORY_BOUND_NAMES = (
    "aten.native_layer_norm",
    "aten.native_group_norm",
    "aten._softmax",
    "aten._safe_softmax",  # SDPA's math path (dropout, masks): softmax with all -inf rows set to 0
    "aten._log_softmax",
    "aten.embedding",
    "aten.native_dropout",
    "aten.bernoulli",
    "aten.rand_like",
    "aten.randn_like",
    "aten.rand",
    "aten.randn",
    "aten._to_copy",
    "aten.clone",
    "aten.lift_fresh_copy",  # a copy of a constant (``torch.tensor(...)`` in the model)
    "aten.cat",
    "aten.stack",
    "aten.index_select",
    "aten.gather",
    "aten.index",
    "aten.where",
    "aten.arange",
    "aten.full",
    "aten.fill",  # out of place (a masked_fill's functionalized form)
    "aten.zeros",
    "aten.ones",
    "aten.scalar_tensor",
    "aten.constant_pad_nd",
    "aten._unsafe_view",
    "aten.slice_scatter",
    "aten.select_scatter",
    "aten.repeat",
    "aten.tril",
    "aten.triu",
    "aten.masked_fill",
    "aten.nll_loss_forward",
    "aten.mean",
    "aten.sum",
    "aten.cumsum",  # a scan: reads and writes each element once (OPT's position ids)
    "aten.amax",
    "aten.var_mean",
    "aten._fused_rms_norm",
    "prims.convert_element_type",
    "prims.inductor_random",
    "prims.inductor_lookup_seed",  # one element of the seeds tensor
    "prims.iota",  # arange under Inductor's decompositions
)


# By qualified name ("aten::_softmax"), not by op packet: Inductor's prims (``inductor_random``,
# ``inductor_seeds``) exist only once ``torch._inductor`` is imported, which may come after this
# module (a packet set built at import left them out, and dropout under Inductor was refused).
_MEMORY_BOUND = frozenset(name.replace(".", "::", 1) for name in _MEMORY_BOUND_NAMES)
_INDUCTOR_RANDOM = "prims::inductor_random"
_INDUCTOR_SEEDS = "prims::inductor_seeds"


def _op_name(target) -> str | None:
    """``"aten::mm"`` for an ATen-style op overload, ``None`` for anything else."""
    return target._schema.name if isinstance(target, torch._ops.OpOverload) else None


# Size arithmetic on symbolic ints (dynamic shapes).
_SYM_OPS = frozenset(
    {operator.mul, operator.add, operator.sub, operator.floordiv, operator.mod, operator.neg, operator.truediv}
)
_SYM_SIZE_OPS = frozenset(
    op
    for op in (
        getattr(aten, "sym_size", None) and aten.sym_size.int,
        getattr(aten, "sym_stride", None) and aten.sym_stride.int,
        getattr(aten, "sym_numel", None) and aten.sym_numel.default,
        getattr(aten, "sym_storage_offset", None) and aten.sym_storage_offset.default,
    )
    if op is not None
)


@dataclass(frozen=True)
class Leaf:
    """A value a chain reads without recomputing it.

    Attributes:
        fw_node: the forward node.
        bw_node: the backward placeholder that has it, or ``None``: the rewrite adds one (a new
            saved value, named like the forward node).
        kind: ``"saved"`` (a saved tensor), ``"symint"`` (a saved size), ``"parameter"``,
            ``"input"``, ``"constant"`` (a tensor attribute of the forward module),
            ``"seeds"`` (Inductor's dropout seeds) or ``"rng state"`` (see the module docstring).
        buffer: the liveness buffer of a ``"saved"`` leaf (``None`` otherwise).
        fw_ref / bw_ref: the forward node and the backward placeholder as references into the
            graphs analysed; for an ``"rng state"`` leaf (a node the rewrite makes) ``fw_ref`` is
            the random op whose state it is.
    """

    fw_node: str
    bw_node: str | None
    kind: str
    buffer: int | None = None
    fw_ref: fx.Node | None = node_ref()
    bw_ref: fx.Node | None = node_ref()


@dataclass(frozen=True)
class Chain:
    """How one saved buffer is rebuilt in the backward (steps are joint-schedule indices).

    Attributes:
        buffer: the liveness buffer id.
        saved: indices into ``Liveness.saved`` of its saved views (all rebuilt).
        nodes: forward node names to duplicate, in forward order.
        node_refs / rng_refs: ``nodes`` and ``rng_nodes`` as references into the graphs analysed.
        leaves: what the chain reads (see :class:`Leaf`).
        depends_on: buffers of ``"saved"`` leaves that are saved activations (the plan may offload
            or recompute them too; a recomputed one is rebuilt first).
        rng_nodes: random ops among ``nodes`` replayed from their saved generator state.
        size_bytes: device bytes of the buffer.
        flops: FLOPs of the recomputation.
        seconds: its time on the cost model's device (seconds).
        transient_bytes: fresh intermediates it allocates besides the buffer (bytes, upper bound).
        recompute_before: the buffer's first backward reader (the recomputation goes right before).
        last_fw_use: its last forward reader (the forward frees it after that).
        rng_states: ``(forward step of the random op, bytes)`` of each generator state the
            forward saves for it: device bytes only where liveness counts host tensors as device
            memory (a CPU graph); a CUDA generator's state is a host tensor (0 bytes).
    """

    buffer: int
    saved: tuple[int, ...]
    nodes: tuple[str, ...]
    leaves: tuple[Leaf, ...]
    depends_on: tuple[int, ...]
    rng_nodes: tuple[str, ...]
    size_bytes: int
    flops: int
    seconds: float
    transient_bytes: int
    recompute_before: int
    last_fw_use: int
    rng_states: tuple[tuple[int, int], ...] = ()
    node_refs: tuple[fx.Node, ...] = node_ref(())
    rng_refs: tuple[fx.Node, ...] = node_ref(())


@dataclass(frozen=True)
class ChainAnalysis:
    """Result of :func:`analyze`: the recomputable buffers and why the others are not."""

    chains: tuple[Chain, ...]
    refused: tuple[tuple[int, str], ...]

    def by_buffer(self) -> dict[int, Chain]:
        return {c.buffer: c for c in self.chains}


def _is_random(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def _deterministic_sdpa(node: fx.Node) -> bool:
    """A scaled-dot-product-attention op (tagged random for its dropout) with ``dropout_p == 0``."""
    name = node.target._schema.name if isinstance(node.target, torch._ops.OpOverload) else ""
    if "scaled_dot_product" not in name:
        return False
    schema = node.target._schema
    for i, arg in enumerate(schema.arguments):
        if arg.name == "dropout_p":
            value = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", arg.default_value)
            return isinstance(value, (int, float)) and float(value) == 0.0
    return False


def _known_cost(node: fx.Node) -> bool:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is None:
        return False
    if flop_packet(target) is not None or _op_name(target) in _MEMORY_BOUND:
        return True
    tags = target.tags
    if torch.Tag.pointwise in tags or torch.Tag.reduction in tags:
        return True
    # A view (every output aliases an input per the schema) costs nothing.
    rets = target._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def refusal(node: fx.Node, rng_replay: bool) -> str | None:
    """Why ``node`` may not be recomputed, or ``None`` when it may (see the module docstring)."""
    from ..ir.ops import STREAM_OPS, TRANSFER_OPS

    if node.op != "call_function":
        return f"{node.name!r} is a {node.op}"
    target = node.target
    if target is operator.getitem:
        return None
    if target in _SYM_OPS or target in _SYM_SIZE_OPS:
        return None
    if not isinstance(target, torch._ops.OpOverload):
        return f"{node.name!r} ({target}) is not an ATen-style op"
    if target in TRANSFER_OPS or target in STREAM_OPS or target.namespace == "trinity":
        return f"{node.name!r} is a trinity op"
    if target._schema.is_mutable:
        return f"{node.name!r} ({target}) mutates an argument"
    # FX's registry of side-effectful ops (what ``has_side_effect`` registers; DCE keeps them).
    if target in getattr(fx.node, "_side_effectful_functions", ()) or torch.Tag.inplace_view in target.tags:
        return f"{node.name!r} ({target}) has side effects"
    if _is_collective(node):
        return f"{node.name!r} ({target}) is a collective"
    if _op_name(target) == _INDUCTOR_RANDOM:
        pass  # deterministic given its seed argument, which is saved (a leaf)
    elif _is_random(target) and not _deterministic_sdpa(node):
        if not rng_replay:
            return f"{node.name!r} ({target}) is random and its state cannot be replayed under this inner compiler"
    if not _known_cost(node):
        return f"{node.name!r} ({target}) has no known cost"
    vals = node.meta.get("val")
    if vals is None:
        return f"{node.name!r} has no meta['val']"
    return None


def _rng_replayed(node: fx.Node) -> bool:
    return (
        isinstance(node.target, torch._ops.OpOverload)
        and _is_random(node.target)
        and not _deterministic_sdpa(node)
        and _op_name(node.target) != _INDUCTOR_RANDOM
    )


def analyze(pair: GraphPair, liveness: Liveness, costs: Costs, rng_replay: bool = False) -> ChainAnalysis:
    """The recompute chain of every saved activation buffer that has one (module docstring).

    Args:
        pair: the partitioned graphs ``liveness`` and ``costs`` describe (not rewritten yet).
        liveness: their liveness.
        costs: their costs (seconds and FLOPs of each forward node).
        rng_replay: whether random ops may be replayed from saved generator state (``inner="eager"``).
    """
    fw_graph = pair.forward.graph
    # Names in use: the rewrite adds nodes named after forward nodes (the partitioner's binding).
    fw_names = {n.name for n in fw_graph.nodes}
    bw_names = {n.name for n in pair.backward.graph.nodes}
    fw_placeholders = list(fw_graph.find_nodes(op="placeholder"))
    static = set(pair.static_input_indices)
    placeholder_kind = {n: ("parameter" if i in static else "input") for i, n in enumerate(fw_placeholders)}
    saved_by_node: dict[fx.Node, int] = {s.fw_ref: s.index for s in liveness.saved}
    # Saved values the backward receives (tensors and sizes): forward node -> placeholder, where
    # the partitioner bound them by name (a checkpointed region's generator state, bound by
    # position, is no leaf: a chain through it is refused).
    links = {
        link.fw_node: link.bw_placeholder
        for link in pair.saved_links(sizes=True)
        if link.bw_placeholder is not None and link.bw_placeholder.name == link.fw_node.name
    }
    buffer_of: dict[fx.Node, list[int]] = {}
    for b in liveness.buffers:
        for holder in b.holders:
            if holder.graph is fw_graph:
                buffer_of.setdefault(holder, []).append(b.id)

    state_bytes = int(torch.get_rng_state().numel())  # the CPU generator's state (uint8)
    chains, refused = [], []
    for b in liveness.buffers:
        if b.kind is not BufferKind.SAVED or not b.on_device or not b.saved:
            continue
        if b.first_bw_use is None or b.last_fw_use is None:
            continue
        own = list(dict.fromkeys(liveness.saved[i].fw_ref for i in b.saved))
        own_set = set(own)
        nodes: dict[fx.Node, None] = {}
        leaves: dict[object, Leaf] = {}  # by forward node; a generator state by ("rng state", its op)
        reason = None
        stack = list(own)
        while stack and reason is None:
            n = stack.pop()
            if n in nodes or n in leaves:
                continue
            if n not in own_set and n in links:
                j = saved_by_node.get(n)
                if j is not None:
                    kind = "saved"
                    buf = liveness.saved[j].buffer
                else:
                    kind, buf = "symint" if not isinstance(n.meta.get("val"), torch.Tensor) else "saved", None
                ph = links[n]
                leaves[n] = Leaf(n.name, ph.name, kind, buf, fw_ref=n, bw_ref=ph)
                continue
            if n not in own_set and (n.op == "get_attr" or _op_name(n.target) == _INDUCTOR_SEEDS):
                # A constant of the forward module, or Inductor's dropout seeds (drawn once per
                # forward; saved, the random ops they seed replay bit-identically): a new saved
                # value, as Inductor's partitioner saves the seeds itself.
                if not isinstance(n.meta.get("val"), torch.Tensor):
                    reason = f"needs {n.name!r}, which is not a tensor"
                elif n.name in bw_names:
                    reason = f"needs {n.name!r}, whose name the backward already uses"
                else:
                    leaves[n] = Leaf(n.name, None, "constant" if n.op == "get_attr" else "seeds", fw_ref=n)
                continue
            if n.op == "placeholder":
                if not isinstance(n.meta.get("val"), torch.Tensor):
                    reason = f"needs size {n.name!r}, which the backward does not receive"
                elif n.name in bw_names:
                    reason = f"needs {n.name!r}, whose name the backward already uses"
                else:
                    leaves[n] = Leaf(n.name, None, placeholder_kind[n], fw_ref=n)
                continue
            why = refusal(n, rng_replay)
            if why is not None:
                reason = why
                break
            if _rng_replayed(n):
                state = n.name + RNG_STATE_SUFFIX
                if state in bw_names or state in fw_names:
                    reason = f"the name {state!r} for {n.name!r}'s generator state is taken"
                    break
                leaves[("rng state", n)] = Leaf(state, None, "rng state", fw_ref=n)
            nodes[n] = None
            if len(nodes) > MAX_CHAIN_NODES:
                reason = f"the chain is longer than {MAX_CHAIN_NODES} nodes"
                break
            stack.extend(n.all_input_nodes)
        if reason is not None:
            refused.append((b.id, reason))
            continue
        order = {n: liveness.step_at(n) for n in nodes}
        chain_nodes = tuple(sorted(nodes, key=order.__getitem__))
        seconds = sum(costs.step_seconds[order[n]] for n in chain_nodes)
        flops = sum(costs.step_flops[order[n]] for n in chain_nodes)
        transient = 0
        for n in chain_nodes:
            for bid in buffer_of.get(n, ()):
                other = liveness.buffers[bid]
                if bid != b.id and other.def_step == order[n] and other.on_device and not other.fused:
                    transient += other.size_bytes
        depends = sorted(
            {
                leaf.buffer
                for leaf in leaves.values()
                if leaf.buffer is not None and liveness.buffers[leaf.buffer].kind is BufferKind.SAVED
            }
        )
        rng = tuple(n for n in chain_nodes if _rng_replayed(n))
        chains.append(
            Chain(
                buffer=b.id,
                saved=tuple(b.saved),
                nodes=tuple(n.name for n in chain_nodes),
                leaves=tuple(sorted(leaves.values(), key=lambda x: x.fw_node)),
                depends_on=tuple(depends),
                rng_nodes=tuple(n.name for n in rng),
                size_bytes=b.size_bytes,
                flops=int(flops),
                seconds=float(seconds),
                transient_bytes=int(transient),
                recompute_before=int(b.first_bw_use),
                last_fw_use=int(b.last_fw_use),
                rng_states=tuple((order[n], state_bytes if liveness.device == "cpu" else 0) for n in rng),
                node_refs=chain_nodes,
                rng_refs=rng,
            )
        )
    return ChainAnalysis(tuple(chains), tuple(refused))
