"""Tiny forward/backward graph pairs for the per-pass unit tests.

``capture_pair(fn, *inputs)`` traces ``fn`` with AOTAutograd (fake tensors, PyTorch's min-cut
partitioner, exactly what the backend sees) and returns the partitioned pair without compiling or
running anything; inputs that require grad and are listed in ``static`` count as parameters.
"""

from __future__ import annotations

import torch
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import min_cut_rematerialization_partition

from offload_compiler.graph_pair import GraphPair


class _Captured(Exception):
    pass


def capture_pair(fn, *inputs, static: tuple[int, ...] = (), partition=min_cut_rematerialization_partition) -> GraphPair:
    """The (forward, backward) pair AOTAutograd's partitioner makes for ``fn(*inputs)``.

    Args:
        fn: a function of tensors returning a tensor (or a tuple of tensors).
        inputs: example tensors; those with ``requires_grad`` get gradients.
        static: positions of inputs to treat as parameters (static lifetime).
        partition: the partition function (PyTorch's min-cut by default, as the backend uses).
    """
    box = {}

    def partition_fn(joint, joint_inputs, *, num_fwd_outputs, static_lifetime_input_indices=None, **kw):
        fw, bw = partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)
        box["pair"] = GraphPair(fw, bw, num_fwd_outputs, tuple(static))
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
