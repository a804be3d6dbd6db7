"""The (forward, backward) graph pair that AOTAutograd's partitioner produced, and how they bind.

The forward graph returns ``[num_fwd_outputs user outputs] + [saved values]``; each saved tensor
arrives in the backward graph as a placeholder with the name of the forward node it comes from.
Parameters and buffers are the forward placeholders listed in ``static_input_indices``
(AOTAutograd's own metadata; never guessed from names).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .ir.alias import hint_int, tensor_vals

__all__ = ["GraphPair", "SavedLink", "tensor_vals", "fake_mode_of", "hint_int", "is_rng_state"]


@dataclass(frozen=True)
class SavedLink:
    """One saved value: forward output position, forward node, backward placeholder."""

    fw_output_index: int
    fw_node: fx.Node
    bw_placeholder: fx.Node | None


@dataclass(frozen=True)
class GraphPair:
    """A forward/backward graph pair (the graphs themselves are mutable FX graph modules).

    Attributes:
        forward, backward: the partitioned graph modules.
        num_fwd_outputs: how many leading forward outputs go to the user (including mutated inputs
            and other AOTAutograd runtime outputs); the rest are saved for the backward.
        static_input_indices: positions of forward placeholders with static lifetime (parameters
            and buffers).
    """

    forward: fx.GraphModule
    backward: fx.GraphModule
    num_fwd_outputs: int
    static_input_indices: tuple[int, ...] = ()

    def fw_output_node(self) -> fx.Node:
        return next(iter(self.forward.graph.find_nodes(op="output")))

    def bw_output_node(self) -> fx.Node:
        return next(iter(self.backward.graph.find_nodes(op="output")))

    def fw_outputs(self) -> list:
        out = self.fw_output_node().args[0]
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def saved_links(self, sizes: bool = False) -> list[SavedLink]:
        """Saved tensor outputs of the forward with their backward placeholders; a saved tensor
        with no placeholder has ``None``. With ``sizes``, the saved values that are not tensors
        (size symbols) follow, bound by name.

        Bound by name, which the partitioner keeps equal, except for the random-number-generator
        states of activation checkpointing: the partitioner names their backward placeholders
        ``rng_state_output_<k>``. Those are bound by position: the backward's tensor placeholders
        are the saved tensors in the forward's output order, then the tangents
        (``torch/_functorch/partitioners.py``, ``functionalize_rng_ops``). Position is used only
        where every name-bound link agrees with it.

        This is the one place the two graphs are bound to each other; the analyses carry the nodes
        from here on (:mod:`offload_compiler.ir.refs`)."""
        bw_placeholders = list(self.backward.graph.find_nodes(op="placeholder"))
        bw_by_name = {n.name: n for n in bw_placeholders}
        bw_tensors = [n for n in bw_placeholders if isinstance(n.meta.get("val"), torch.Tensor)]
        saved = []
        for i, node in enumerate(self.fw_outputs()):
            if i < self.num_fwd_outputs or not isinstance(node, fx.Node):
                continue
            if not isinstance(node.meta.get("val"), torch.Tensor):
                continue
            saved.append((i, node))
        positional = all(
            j < len(bw_tensors) and bw_tensors[j] is bw_by_name[node.name]
            for j, (_, node) in enumerate(saved)
            if node.name in bw_by_name
        )
        links = []
        for j, (i, node) in enumerate(saved):
            ph = bw_by_name.get(node.name)
            if ph is None and positional and is_rng_state(node) and j < len(bw_tensors):
                candidate = bw_tensors[j]
                if candidate.name.startswith("rng_state_output"):
                    ph = candidate
            links.append(SavedLink(i, node, ph))
        if sizes:
            for i, node in enumerate(self.fw_outputs()):
                if i >= self.num_fwd_outputs and isinstance(node, fx.Node):
                    if not isinstance(node.meta.get("val"), torch.Tensor):
                        links.append(SavedLink(i, node, bw_by_name.get(node.name)))
        return links


def called_op(node: fx.Node) -> tuple[object, tuple, dict]:
    """``(target, args, kwargs)`` of the op ``node`` runs: the node's own, except for the
    random-number-state wrappers (``torch/_prims/rng_prims.py``), which run the op they are given:
    ``run_and_save_rng_state(op, *args, **kwargs)`` and ``run_with_rng_state(state, op, *args,
    **kwargs)`` give ``(op, args, kwargs)``. The op's workspace (:mod:`.passes.liveness`) and its
    key in a measured step (:mod:`.passes.margins`; the profiler sees the op inside the wrapper)
    are the wrapped op's."""
    if node.op == "call_function":
        from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

        if node.target is run_and_save_rng_state and node.args:
            return node.args[0], tuple(node.args[1:]), dict(node.kwargs)
        if node.target is run_with_rng_state and len(node.args) > 1:
            return node.args[1], tuple(node.args[2:]), dict(node.kwargs)
    return node.target, tuple(node.args), dict(node.kwargs)


def is_rng_state(node: fx.Node) -> bool:
    """Whether ``node`` is the random-number-generator state that activation checkpointing's
    ``run_and_save_rng_state`` returns at index 0 (saved for the backward's recomputation).

    Its fake kernel returns a real tensor (``torch.get_rng_state()``, ``torch/_prims/rng_prims.py``),
    so Inductor sees a real tensor there: no trinity op may take it as an argument."""
    if node.op != "call_function" or node.target is not operator.getitem or node.args[1] != 0:
        return False
    src = node.args[0]
    return (
        isinstance(src, fx.Node)
        and src.op == "call_function"
        and src.target is torch._prims.rng_prims.run_and_save_rng_state
    )


def fill_tuple_vals(gm: fx.GraphModule) -> int:
    """Give ``meta["val"]`` to tuple-valued nodes that AOTAutograd leaves without one, from their
    ``getitem`` users; returns how many nodes got one.

    The partitioner emits the random-number-state wrappers of activation checkpointing
    (``run_and_save_rng_state``, ``run_with_rng_state``) without ``meta["val"]``, while the
    ``getitem`` nodes that unpack them have theirs. The tuple's value is those getitems' values
    (the same fake tensors, so aliasing analysis sees the same storages), ``None`` at indices
    nobody reads. Nodes with a non-getitem user are left alone (liveness then reports them).
    An aten op that returns nothing (``_assert_scalar``, ``_assert_async``: the runtime checks of
    data-dependent sizes, ``capture_dynamic_output_shape_ops``) gets ``None``.

    Writes ``node.meta["val"]``; reads the users' ``meta["val"]``.
    """
    filled = 0
    for n in gm.graph.nodes:
        if (
            n.op == "call_function"
            and "val" not in n.meta
            and isinstance(n.target, torch._ops.OpOverload)
            and not n.target._schema.returns
        ):
            n.meta["val"] = None
            filled += 1
            continue
        if n.op != "call_function" or "val" in n.meta or not n.users:
            continue
        users = list(n.users)
        if not all(
            u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int) and "val" in u.meta
            for u in users
        ):
            continue
        vals: list = [None] * (max(u.args[1] for u in users) + 1)
        for u in users:
            vals[u.args[1]] = u.meta["val"]
        n.meta["val"] = tuple(vals)
        filled += 1
    return filled


def fake_mode_of(*graphs: fx.GraphModule):
    """The FakeTensorMode the graphs' ``meta["val"]`` tensors belong to (or ``None``)."""
    from torch._guards import detect_fake_mode

    vals = []
    for gm in graphs:
        for node in gm.graph.nodes:
            vals.extend(tensor_vals(node))
            if len(vals) > 8:
                break
    return detect_fake_mode(vals) if vals else None
