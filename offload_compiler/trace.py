"""Trace a model's training step on fake tensors: the graphs the backend would see, no memory used.

The model is built on the ``meta`` device (no storage), its parameters and buffers become fake
tensors, and AOTAutograd traces the step forward and backward and partitions it through
:func:`offload_compiler.pipeline.partition`, the partition entry the backend uses, with the same
arguments: the parameters and buffers are the static-lifetime inputs (Dynamo marks them so for
the backend). With ``inner="inductor"`` the trace also uses Inductor's decompositions and its
joint-graph passes, as ``torch.compile(backend="trinity")`` with Inductor does. Nothing runs and
nothing real is allocated, so a 70B-parameter model traces on a laptop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._functorch.aot_autograd import aot_function
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from .graph_pair import GraphPair

__all__ = ["trace_training_step", "trace_step", "TracedStep"]


class _Captured(Exception):
    pass


@dataclass(frozen=True)
class TracedStep:
    """A traced training step.

    Attributes:
        pair: the partitioned (forward, backward) graphs.
        param_bytes: bytes of the trainable parameters (each storage once).
        num_params: number of trainable parameter elements.
        param_positions: forward input positions of the parameters (``nn.Parameter``s: what
            parameter offload moves; buffers are static inputs too but stay resident).
        param_nbytes: storage bytes of each of those parameters (same order).
        inner: the inner compiler whose decompositions the trace used (``"eager"`` or
            ``"inductor"``); a plan must assume the same one.
    """

    pair: GraphPair
    param_bytes: int
    num_params: int
    param_positions: tuple[int, ...] = ()
    param_nbytes: tuple[int, ...] = ()
    inner: str = "eager"


def _capture_partitioner(box: dict, static: tuple[int, ...], joint_pass=None):
    """A partition function that partitions with :func:`offload_compiler.pipeline.partition`
    (``static`` as the static-lifetime inputs, which AOTAutograd without Dynamo does not know),
    keeps the pair in ``box`` and stops the trace."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    from .pipeline import partition

    class Capture(CustomPartitionerFn):
        def __call__(self, joint, joint_inputs, **kwargs):
            kwargs["static_lifetime_input_indices"] = list(static)
            if joint_pass is not None:
                joint_pass(joint)
            box["pair"] = partition(joint, joint_inputs, **kwargs)
            raise _Captured

        def uuid(self):
            return f"trinity-trace-capture-{id(box)}"

    return Capture()


def trace_step(
    build: Callable[[], nn.Module],
    make_inputs: Callable[[], Sequence[torch.Tensor]],
    dtype: torch.dtype | None = None,
    loss: Callable[..., torch.Tensor] | None = None,
    inner: str = "eager",
    joint_pass: Callable[[torch.fx.GraphModule], None] | None = None,
) -> TracedStep:
    """Trace ``loss(build()(*inputs), *inputs)`` (or the module's own scalar output when ``loss``
    is ``None``) forward and backward on fake tensors.

    Args:
        build: makes the model (called under ``torch.device("meta")``).
        make_inputs: makes the step's inputs (called under the fake mode, so ``torch.randn`` and
            ``torch.randint`` give fake tensors of the right shapes and dtypes).
        dtype: parameter and buffer dtype (``torch.bfloat16`` for a bf16 model); ``None`` keeps
            the module's own.
        loss: maps the module's output and the inputs to a scalar loss.
        inner: ``"eager"`` (AOTAutograd with no decompositions, as trinity's ``inner="eager"``)
            or ``"inductor"`` (Inductor's decompositions and joint-graph passes first).
        joint_pass: called on the joint graph before it is partitioned (e.g. to tag nodes with
            activation-checkpointing policies, as Dynamo does for ``torch.utils.checkpoint``); with
            it the trace keeps node metadata (``torch.fx.traceback.preserve_node_meta``), so
            ``torch.fx.traceback.annotate`` annotations reach ``node.meta["custom"]``.

    Returns:
        A :class:`TracedStep`. Parameters and buffers are the static-lifetime inputs.

    Raises:
        ValueError: for an unknown ``inner``.
        RuntimeError: when the step has no backward graph.
    """
    if inner not in ("eager", "inductor"):
        raise ValueError(f"trace_step: inner must be 'eager' or 'inductor', got {inner!r}")
    with torch.device("meta"):
        model = build()
        if dtype is not None:
            model = model.to(dtype)
    named_params = list(model.named_parameters())
    named_buffers = list(model.named_buffers())
    fake = FakeTensorMode(shape_env=ShapeEnv())
    with fake:
        params = [
            torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="cpu", requires_grad=p.requires_grad)
            for _, p in named_params
        ]
        buffers = [torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device="cpu") for _, b in named_buffers]
        inputs = list(make_inputs())
    pnames = [n for n, _ in named_params]
    bnames = [n for n, _ in named_buffers]
    n_p, n_b = len(pnames), len(bnames)
    box: dict = {}
    capture = _capture_partitioner(box, tuple(range(n_p + n_b)), joint_pass)

    def step(*args):
        ps, bs, xs = args[:n_p], args[n_p : n_p + n_b], args[n_p + n_b :]
        out = functional_call(model, {**dict(zip(pnames, ps)), **dict(zip(bnames, bs))}, tuple(xs))
        return out if loss is None else loss(out, *xs)

    kwargs = {}
    if inner == "inductor":
        import torch._inductor.config as inductor_config
        from torch._inductor.compile_fx import partition_fn
        from torch._inductor.decomposition import select_decomp_table
        from torch._inductor.virtualized import V

        kwargs = {"partition_fn": partition_fn, "decompositions": select_decomp_table()}
        # Inductor's joint-graph passes read the compile's fake mode from ``V`` (its random-op
        # pass, for a model with dropout: ``fuse_seed_creation_pass``), which ``compile_fx`` sets
        # and a bare ``aot_function`` does not.
        patch = contextlib.ExitStack()
        patch.enter_context(inductor_config.patch(custom_partitioner_fn=capture))
        patch.enter_context(V.set_fake_mode(fake))
    else:
        kwargs = {"partition_fn": capture}
        patch = contextlib.nullcontext()
    from torch.fx import traceback as fx_traceback

    keep_meta = fx_traceback.preserve_node_meta() if joint_pass is not None else contextlib.nullcontext()
    try:
        with patch, keep_meta:
            # keep_inference_input_mutations: as the backend (and Inductor) call AOTAutograd, a
            # buffer the step updates (batch norm's running statistics) is written in the graph
            # (``copy_``) instead of being returned.
            aot_function(step, fw_compiler=lambda gm, _: gm, keep_inference_input_mutations=True, **kwargs)(
                *params, *buffers, *inputs
            )
    except _Captured:
        pass
    if "pair" not in box:
        raise RuntimeError("trace_step: AOTAutograd produced no backward graph")
    seen: set = set()
    trainable = []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            trainable.append(p)
    return TracedStep(
        pair=box["pair"],
        param_bytes=sum(p.untyped_storage().nbytes() for p in trainable),
        num_params=sum(p.numel() for p in trainable),
        param_positions=tuple(range(n_p)),
        param_nbytes=tuple(p.untyped_storage().nbytes() for p in params),
        inner=inner,
    )


def trace_training_step(
    build: Callable[[], nn.Module],
    batch: int,
    seq_len: int,
    vocab_size: int,
    dtype: torch.dtype = torch.float32,
    inner: str = "eager",
    joint_pass: Callable[[torch.fx.GraphModule], None] | None = None,
) -> TracedStep:
    """Trace ``cross_entropy(build()(idx), targets)`` forward and backward on fake tensors (see
    :func:`trace_step`): token ids and targets are two ``[batch, seq_len]`` int64 inputs, as a
    language model is trained (the demo's next-token targets), so the targets' bytes are in the
    step as they are in the backend's (with ``idx`` as its own targets ``plan --model demo`` was
    16,384 bytes under the demo's compile, a fresh-user trial found).

    Args:
        build: makes the model; its ``forward`` takes token ids ``[batch, seq_len]`` and returns
            logits ``[batch, seq_len, vocab_size]``.
        batch, seq_len: the token batch shape.
        vocab_size: ids are drawn from ``[0, vocab_size)``.
        dtype: parameter dtype (``torch.bfloat16`` for a bf16 model); the loss runs in float32.
        inner: ``"eager"`` or ``"inductor"`` (see :func:`trace_step`).
        joint_pass: see :func:`trace_step`.

    Raises:
        ValueError: for non-positive sizes.
    """
    for name, value in (("batch", batch), ("seq_len", seq_len), ("vocab_size", vocab_size)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"trace_training_step: {name} must be a positive int, got {value!r}")

    return trace_step(
        lambda: _LanguageModelLoss(build()),
        lambda: tuple(torch.zeros(batch, seq_len, dtype=torch.int64, device="cpu") for _ in range(2)),
        dtype,
        None,
        inner,
        joint_pass,
    )


class _LanguageModelLoss(nn.Module):
    """``cross_entropy(model(idx), targets)`` in float32 (the model's logits upcast)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(idx).flatten(0, 1).float(), targets.flatten())
