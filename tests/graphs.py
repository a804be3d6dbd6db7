"""Tiny forward/backward graph pairs for the per-pass unit tests.

``capture_pair(fn, *inputs)`` traces ``fn`` with AOTAutograd (fake tensors, PyTorch's min-cut
partitioner through the backend's own partition entry, ``offload_compiler.pipeline.partition``,
with the same arguments) and returns the partitioned pair without compiling or running anything;
inputs listed in ``static`` count as parameters: they are the static-lifetime inputs the
partitioner is told about, as Dynamo tells the backend.
"""

from __future__ import annotations

import torch
from torch._functorch.aot_autograd import aot_function

from offload_compiler.graph_pair import GraphPair
from offload_compiler.pipeline import partition as backend_partition


class _Captured(Exception):
    pass


def capture_pair(fn, *inputs, static: tuple[int, ...] = (), partition=None) -> GraphPair:
    """The (forward, backward) pair AOTAutograd's partitioner makes for ``fn(*inputs)``.

    Args:
        fn: a function of tensors returning a tensor (or a tuple of tensors).
        inputs: example tensors; those with ``requires_grad`` get gradients.
        static: positions of inputs to treat as parameters (static lifetime).
        partition: another partition function (e.g. PyTorch's ``default_partition``), called
            with the same arguments; ``None``: the backend's.
    """
    box = {}

    def partition_fn(joint, joint_inputs, **kw):
        kw["static_lifetime_input_indices"] = list(static)
        if partition is None:
            box["pair"] = backend_partition(joint, joint_inputs, **kw)
        else:
            fw, bw = partition(joint, joint_inputs, **kw)
            box["pair"] = GraphPair(fw, bw, kw["num_fwd_outputs"], tuple(static))
        raise _Captured

    def nop(gm, _):
        return gm

    compiled = aot_function(fn, fw_compiler=nop, bw_compiler=nop, partition_fn=partition_fn)
    try:
        compiled(*inputs)
    except _Captured:
        pass
    if "pair" not in box:
        raise RuntimeError("capture_pair: fn produced no backward graph (do any inputs require grad?)")
    return box["pair"]


def partition_unaware_of_parameters(joint, joint_inputs, **kwargs):
    """PyTorch's min-cut partitioner told nothing about static-lifetime inputs (what ``plan``'s
    trace did before issue 11): it saves views of the parameters (``t(w)``, ``t(t(w))`` after the
    loss) instead of the parameters. A valid partition all the same: the passes must handle it."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    kwargs = {k: v for k, v in kwargs.items() if k != "static_lifetime_input_indices"}
    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def mlp_pair(batch: int = 64, width: int = 32, depth: int = 2) -> GraphPair:
    """A tanh MLP with its weights as parameters: inputs are ``[w_0, ..., w_{depth-1}, x]``."""
    torch.manual_seed(0)
    weights = [torch.randn(width, width, requires_grad=True) for _ in range(depth)]
    x = torch.randn(batch, width)

    def fn(*args):
        *ws, h = args
        for w in ws:
            h = torch.tanh(h @ w)
        return h.sum()

    return capture_pair(fn, *weights, x, static=tuple(range(depth)))


def dynamo_pair(fn, *inputs):
    """The (forward, backward) pair the backend's partitioner sees for ``fn`` captured by Dynamo
    (activation checkpointing only becomes its higher-order op, with RNG-state wrappers for
    random ops, under Dynamo)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from offload_compiler.graph_pair import GraphPair, fill_tuple_vals

    box = {}

    def partition(joint, joint_inputs, **kw):
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kw)
        fill_tuple_vals(fw)
        fill_tuple_vals(bw)
        box["pair"] = GraphPair(fw, bw, kw["num_fwd_outputs"], tuple(kw.get("static_lifetime_input_indices") or ()))
        return fw, bw

    torch._dynamo.reset()
    compiled = torch.compile(
        fn, backend=aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition)
    )
    compiled(*inputs).backward()
    torch._dynamo.reset()
    return box["pair"]
