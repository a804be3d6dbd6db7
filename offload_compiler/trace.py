"""Trace a model's training step on fake tensors: the graphs the backend would see, no memory used.

The model is built on the ``meta`` device (no storage), its parameters and buffers become fake
tensors, and AOTAutograd traces ``loss(model(idx))`` forward and backward and partitions it with
PyTorch's min-cut partitioner, exactly as ``torch.compile(backend="trinity")`` would; nothing runs
and nothing real is allocated, so a 7B-parameter model traces on a laptop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from .graph_pair import GraphPair

__all__ = ["trace_training_step", "TracedStep"]


class _Captured(Exception):
    pass


class TracedStep:
    """A traced training step.

    Attributes:
        pair: the partitioned (forward, backward) graphs.
        param_bytes: bytes of the trainable parameters.
        num_params: number of trainable parameter elements.
        prepared: whether the planning passes' graph preparation (tuple values, ``reorder``) has
            run on ``pair`` (``plan_model`` does it once; reusing the trace skips it).
    """

    def __init__(self, pair: GraphPair, param_bytes: int, num_params: int):
        self.pair = pair
        self.param_bytes = param_bytes
        self.num_params = num_params
        self.prepared = False


def trace_training_step(
    build: Callable[[], nn.Module],
    batch: int,
    seq_len: int,
    vocab_size: int,
    dtype: torch.dtype = torch.float32,
    joint_pass: Callable[[torch.fx.GraphModule], None] | None = None,
) -> TracedStep:
    """Trace ``cross_entropy(build()(idx), idx)`` forward and backward on fake tensors.

    Args:
        build: makes the model (called under ``torch.device("meta")``; its ``forward`` takes token
            ids ``[batch, seq_len]`` and returns logits ``[batch, seq_len, vocab_size]``).
        batch, seq_len: the token batch shape.
        vocab_size: ids are drawn from ``[0, vocab_size)``.
        dtype: parameter dtype (``torch.bfloat16`` for a bf16 model); the loss runs in float32.
        joint_pass: called on the joint graph before it is partitioned (e.g. to tag nodes with
            activation-checkpointing policies, as Dynamo does for ``torch.utils.checkpoint``); with
            it the trace keeps node metadata (``torch.fx.traceback.preserve_node_meta``), so
            ``torch.fx.traceback.annotate`` annotations reach ``node.meta["custom"]``.

    Returns:
        A :class:`TracedStep`. Parameters are marked static (AOTAutograd's parameters).

    Raises:
        ValueError: for non-positive sizes.
    """
    for name, value in (("batch", batch), ("seq_len", seq_len), ("vocab_size", vocab_size)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"trace_training_step: {name} must be a positive int, got {value!r}")
    with torch.device("meta"):
        model = build().to(dtype)
    named_params = [(n, p) for n, p in model.named_parameters()]
    named_buffers = [(n, b) for n, b in model.named_buffers()]
    fake = FakeTensorMode(shape_env=ShapeEnv())
    with fake:
        params = [torch.empty(p.shape, dtype=p.dtype, device="cpu", requires_grad=True) for _, p in named_params]
        buffers = [torch.empty(b.shape, dtype=b.dtype, device="cpu") for _, b in named_buffers]
        idx = torch.zeros(batch, seq_len, dtype=torch.int64, device="cpu")
    pnames = [n for n, _ in named_params]
    bnames = [n for n, _ in named_buffers]
    box: dict = {}

    def partition(joint, joint_inputs, *, num_fwd_outputs, static_lifetime_input_indices=None, **kw):
        if joint_pass is not None:
            joint_pass(joint)
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)
        box["pair"] = GraphPair(fw, bw, num_fwd_outputs, tuple(range(len(params))))
        raise _Captured

    def step(*args):
        ps, bs, ids = args[: len(pnames)], args[len(pnames) : len(pnames) + len(bnames)], args[-1]
        logits = functional_call(model, {**dict(zip(pnames, ps)), **dict(zip(bnames, bs))}, (ids,))
        return F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())

    import contextlib

    from torch.fx import traceback as fx_traceback

    keep_meta = fx_traceback.preserve_node_meta() if joint_pass is not None else contextlib.nullcontext()
    try:
        with keep_meta:
            aot_function(step, fw_compiler=lambda gm, _: gm, partition_fn=partition)(*params, *buffers, idx)
    except _Captured:
        pass
    if "pair" not in box:
        raise RuntimeError("trace_training_step: AOTAutograd produced no backward graph")
    num = sum(p.numel() for p in params)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    return TracedStep(box["pair"], nbytes, num)
