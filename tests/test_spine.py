"""One planning spine: the ``plan`` command's numbers are the backend's numbers.

For four models (the project's GPT, a Llama with tied embeddings, a CNN with batch norm, a
``transformers`` causal LM built from a config) and each ``offload`` mode, the backend compiles
the model (``torch.compile(backend="trinity")``, which partitions through
``pipeline.partition`` and plans with ``pipeline.plan_pair``) and the ``plan`` command's path
traces the same step on fake tensors (``trace.trace_step``) and plans it
(``plan_cli.plan_step``) for the same budget. The planned peak, the lowest reachable peak and the
peak's step must agree (within 1%; today they are equal), so the two paths cannot diverge again
without this test failing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import offload_compiler
from offload_compiler.devices import KNOWN_DEVICES
from offload_compiler.models import Llama, LlamaConfig
from offload_compiler.plan_cli import HFCausalLM, plan_step
from offload_compiler.trace import trace_step

from . import models

DEVICE = "a100-80gb"
MODES = ("activations", "activations+params", "all")


class TiedLlama(nn.Module):
    """A one-layer Llama whose output projection is its token embedding, with the loss."""

    def __init__(self):
        super().__init__()
        self.llama = Llama(
            LlamaConfig(vocab_size=96, n_layer=1, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64,
                        max_seq_len=32, tie_weights=True)
        )  # fmt: skip

    def forward(self, idx, targets):
        return F.cross_entropy(self.llama(idx).flatten(0, 1), targets.flatten())


class HFLoss(nn.Module):
    """A ``transformers`` GPT-2 built from a config (no download), with the loss."""

    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=1, n_head=2, attn_implementation="eager")
        self.lm = HFCausalLM(GPT2LMHeadModel(cfg))

    def forward(self, idx, targets):
        return F.cross_entropy(self.lm(idx).flatten(0, 1), targets.flatten())


def _gpt():
    return models.GPTLoss(models.GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=32))


def _tokens(vocab):
    return lambda: (torch.randint(0, vocab, (8, 32)), torch.randint(0, vocab, (8, 32)))


CASES = {
    "gpt": (_gpt, _tokens(64)),
    "tied_llama": (TiedLlama, _tokens(96)),
    "cnn_batchnorm": (lambda: models.CNN(depth=3), models.cnn_batch),
    "transformers_gpt2": (HFLoss, _tokens(96)),
}


@pytest.fixture(scope="module")
def traced():
    """Each model's step traced once, the ``plan`` command's way (fake tensors, eager)."""
    out = {}
    for name, (make, inputs) in CASES.items():
        if name.startswith("transformers"):
            pytest.importorskip("transformers")
        torch.manual_seed(0)
        out[name] = trace_step(make, inputs)
    return out


def _backend_report(make, inputs, offload, budget):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make()
    before = len(offload_compiler.reports())
    options = {
        "memory_budget": budget,
        "inner": "eager",
        "offload": offload,
        "min_offload_bytes": 0,
        "device": DEVICE,
        "on_infeasible": "warn",
        "num_streams": 1,
    }
    compiled = torch.compile(model, backend="trinity", options=options)
    compiled(*inputs())  # the partitioner (and so the planner) runs when the forward compiles
    (report,) = offload_compiler.reports()[before:]
    return report


@pytest.mark.parametrize("offload", MODES)
@pytest.mark.parametrize("model", list(CASES))
def test_plan_equals_the_backend(model, offload, traced):
    if model.startswith("transformers"):
        pytest.importorskip("transformers")
    make, inputs = CASES[model]
    budget = "60%"
    r = _backend_report(make, inputs, offload, budget)
    res = plan_step(
        traced[model], KNOWN_DEVICES[DEVICE], [budget], optimizer="none", min_offload_bytes=0, offload=offload,
        inner="eager",
    )  # fmt: skip
    (row,) = res.rows
    assert r.budget_bytes == pytest.approx(row.budget_bytes, rel=0.01)
    assert r.peak_bytes_unplanned == pytest.approx(res.unplanned_peak_bytes, rel=0.01)
    assert r.peak_bytes_planned == pytest.approx(row.planned_peak_bytes, rel=0.01)
    assert r.lowest_reachable_peak_bytes == pytest.approx(row.lowest_reachable_bytes, rel=0.01)
    assert r.peak_step_planned == row.peak_step
    assert r.feasible == row.feasible
    if offload != "activations":
        # Offloading parameters lowers the floor below "every parameter resident".
        assert row.lowest_reachable_bytes < res.unplanned_peak_bytes
        # The backend's host gradients come from its bucketed host pool (rounded up).
        assert row.host_bytes <= r.param_offload["host_bytes"] <= 1.5 * row.host_bytes


def test_plan_equals_the_backend_under_inductor():
    """``plan``'s default for ``offload="activations"`` is the backend's default inner compiler,
    Inductor: its decompositions and joint-graph passes are traced too."""
    make, inputs = CASES["gpt"]
    torch._dynamo.reset()
    torch.manual_seed(0)
    before = len(offload_compiler.reports())
    options = {"memory_budget": "70%", "inner": "inductor", "min_offload_bytes": 0, "device": DEVICE}
    torch.compile(make(), backend="trinity", options=options)(*inputs())
    (r,) = offload_compiler.reports()[before:]
    res = plan_step(trace_step(make, inputs, inner="inductor"), KNOWN_DEVICES[DEVICE], ["70%"], optimizer="none",
                    min_offload_bytes=0)  # fmt: skip
    (row,) = res.rows
    assert res.inner == "inductor" and r.feasible and r.num_evicted > 0
    assert (r.peak_bytes_planned, r.lowest_reachable_peak_bytes) == (row.planned_peak_bytes, row.lowest_reachable_bytes)
    assert r.peak_bytes_unplanned == res.unplanned_peak_bytes
