"""``inline_reused_pointwise``: a reused pointwise value is copied into each reader when what it is
computed from is no larger than it (never more memory in use, never more bytes moved); the values
are bit-identical."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from offload_compiler.ir.meta import TARGET_DEVICE_KEY
from offload_compiler.passes import liveness
from offload_compiler.passes.inline_pointwise import inline_reused_pointwise

N, V = 64, 1024  # tokens x vocabulary: one float32 logits-sized buffer is 256 KiB
F32 = N * V * 4


def _logits_sized(live, graph: str) -> list:
    """The allocated float32 (N, V) buffers of ``graph`` (not fused)."""
    return [
        b
        for b in live.buffers
        if b.size_bytes == F32 and not b.fused and b.on_device and all(h.startswith(graph + ":") for h in b.nodes)
    ]


def _head_step():
    """A bf16 language-model head and its float32 cross-entropy, traced as the backend traces it
    for Inductor (its decompositions and joint passes, the min-cut partitioner)."""
    from offload_compiler.trace import trace_step

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, V, bias=False)

        def forward(self, x, target):
            return self.proj(x)

    return trace_step(
        Head,
        lambda: (torch.randn(N, 16, dtype=torch.bfloat16), torch.randint(0, V, (N,))),
        dtype=torch.bfloat16,
        loss=lambda logits, x, target: torch.nn.functional.cross_entropy(logits.float(), target),
        inner="inductor",
    ).pair


def test_the_loss_temporaries_are_computed_in_their_readers():
    """The float32 logits ``x``, ``x - amax`` (both read by a reduction and the next op) and the
    backward's ``where(target == iota, -1, 0) * scale`` (read by a sum and a subtraction) are
    allocated under trinity's realize-once rule; copied into their readers, none is, and the peak
    drops by those buffers. Only the bf16 logits (saved) remain."""
    pair = _head_step()
    for gm in (pair.forward, pair.backward):
        gm.meta[TARGET_DEVICE_KEY] = "cuda"
    before = liveness.analyze(pair, assume_fusion=True)
    assert len(_logits_sized(before, "forward")) >= 2
    assert len(_logits_sized(before, "backward")) >= 1
    inserted = inline_reused_pointwise(pair.forward, "cuda") + inline_reused_pointwise(pair.backward, "cuda")
    assert inserted > 0
    after = liveness.analyze(pair, assume_fusion=True)
    assert _logits_sized(after, "forward") == [] and _logits_sized(after, "backward") == []
    assert after.peak_bytes <= before.peak_bytes - F32
    # what remains at the peak: the saved bf16 logits, its gradient, the input logits
    assert after.peak_bytes < 4 * N * V * 2
    # every copy has one reader and carries a dump note
    copies = [
        n for gm in (pair.forward, pair.backward) for n in gm.graph.nodes if "copy of" in n.meta.get("trinity", "")
    ]
    assert len(copies) == inserted and all(len(n.users) == 1 for n in copies)
    # idempotent: nothing left to copy
    assert inline_reused_pointwise(pair.forward, "cuda") + inline_reused_pointwise(pair.backward, "cuda") == 0


def _run(pair, weight, x, target):
    """The traced step on real tensors: (loss, weight gradient, input gradient)."""
    fw_out = pair.forward(weight, x, target)
    n = pair.num_fwd_outputs
    bw_out = pair.backward(*fw_out[n:], torch.ones(()))
    return (fw_out[0], *[g for g in bw_out if g is not None])


def test_copies_compute_the_same_values_bit_for_bit():
    pair = _head_step()
    g = torch.Generator().manual_seed(0)
    args = (
        torch.randn(V, 16, generator=g).to(torch.bfloat16),
        torch.randn(N, 16, generator=g).to(torch.bfloat16),
        torch.randint(0, V, (N,), generator=g),
    )
    expected = _run(pair, *args)
    assert inline_reused_pointwise(pair.forward, "cuda") + inline_reused_pointwise(pair.backward, "cuda") > 0
    got = _run(pair, *args)
    assert len(got) == len(expected) == 2
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize(
    "fn, why",
    [
        (lambda a, b: ((a + b).sum(1), (a + b) * 2.0), "reads two inputs of its size"),
        (lambda a, b: (torch.mm(a.float() * 2.0, b), (a.float() * 2.0).sum()), "read by an mm"),
        (lambda a, b: ((a.float() * 2.0), (a.float() * 2.0).sum()), "a graph output"),
    ],
)
def test_not_copied(fn, why):
    """Copies only where the chain's inputs are no larger than the value, every reader computes it
    inside its kernel, and the value is not kept (a graph output)."""

    def once(a, b):
        out = fn(a, b)
        return out

    a, b = torch.randn(32, 32, dtype=torch.bfloat16), torch.randn(32, 32)
    if why == "reads two inputs of its size":
        a = a.float()
    gm = make_fx(once, tracing_mode="fake")(a, b)
    # one node, two readers (make_fx does not merge the two spellings: merge them as CSE would)
    from torch.fx.passes.dialect.common.cse_pass import CSEPass

    gm = CSEPass()(gm).graph_module
    reused = [n for n in gm.graph.nodes if n.op == "call_function" and len(n.users) >= 2]
    assert reused, why
    assert inline_reused_pointwise(gm, "cuda") == 0, why


def test_cpu_keeps_reused_transcendentals_realized():
    """Inductor realizes a reused ``exp``/``log``/``tanh``... result on the CPU (recomputing it is
    costly there); the pass leaves it for a CPU target and copies it for a GPU target."""

    def fn(x):
        e = x.float().exp()
        return e.sum(1) + (e * 2.0).amax(1)

    x = torch.randn(16, 256, dtype=torch.bfloat16)
    for target, expect in (("cpu", 0), ("cuda", 1)):  # one copy of exp (make_fx keeps `_to_copy`, not pointwise)
        gm = make_fx(fn, tracing_mode="fake")(x)
        assert inline_reused_pointwise(gm, target) == expect, target
        assert torch.equal(gm(x), fn(x))


def test_max_leaves_is_validated():
    gm = make_fx(lambda x: x * 2.0, tracing_mode="fake")(torch.randn(4))
    with pytest.raises(ValueError, match="max_leaves must be at least 1, got 0"):
        inline_reused_pointwise(gm, "cuda", max_leaves=0)
