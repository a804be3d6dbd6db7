"""The memory budget of the training step (``offload_compiler.step_budget``), in one process: a
model with a graph break gives two graph pairs, and the second is planned against what the first
holds while it runs. DDP's graph splits are checked under ``torchrun`` in
``tests/test_distributed.py`` (case ``ddp_split_bytes``).

Each run compares gradients with ``aot_eager`` and measures the step's peak (the CPU allocator's
trace, parameters and the input declared resident) against the step's budget.
"""

import re

import pytest
import torch
import torch.nn as nn

import offload_compiler
from bench.step_budget import Broken  # the model of the step-budget benchmark
from offload_compiler import measure_peak_device_bytes, step_report
from offload_compiler.pipeline import InfeasibleBudgetError

PEAK_SLACK_BYTES = 64 * 1024  # as in test_e2e.py


def nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def train(budget, backend="trinity", on_infeasible="warn"):
    """Two warm-up steps, then one measured; returns (model, measurement, gradients)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Broken()
    x = torch.randn(512, 64)
    if backend == "trinity":
        opts = {"inner": "eager", "memory_budget": budget, "min_offload_bytes": 0, "on_infeasible": on_infeasible}
        compiled = torch.compile(model, backend="trinity", options=opts)
    else:
        compiled = torch.compile(model, backend=backend)
    for _ in range(2):
        compiled(x).backward()
        model.zero_grad(set_to_none=True)
    m = measure_peak_device_bytes(lambda: compiled(x).backward(), resident=list(model.parameters()) + [x], device="cpu")
    grads = [p.grad.clone() for p in model.parameters()]
    return model, m, grads


@pytest.fixture(scope="module")
def reference():
    model, m, grads = train(None, backend="aot_eager")
    return m.peak_bytes, grads


def check_grads(grads, ref_grads):
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=0)


def test_graph_break_pairs_share_an_absolute_budget(reference):
    ref_peak, ref_grads = reference
    budget = 1_800_000
    assert ref_peak > budget + PEAK_SLACK_BYTES  # the step does not fit without a plan
    model, m, grads = train(budget)
    check_grads(grads, ref_grads)
    report = step_report(model)
    assert report is not None and len(report.pairs) == 2
    first, second = report.pairs
    assert "DDP" not in first.label and second.label.startswith("torch_dynamo_resume")
    # Both pairs: the step's budget; the second also sees the first's saved activations and input.
    assert first.budget_bytes == second.budget_bytes == report.budget_bytes == budget
    half = nbytes(model.a.parameters())
    assert nbytes(model.b.parameters()) == half
    assert first.held_bytes == 2 * half  # the other half's parameters and gradients
    assert second.held_bytes == 2 * half + first.kept_bytes + first.input_bytes
    assert first.input_bytes == 512 * 64 * 4 and first.kept_bytes > 0
    # Alone, the second pair's unplanned peak is within the budget: planned per graph, it would
    # evict nothing. Planned against the step, it evicts.
    assert second.own_unplanned_peak_bytes < budget
    assert second.own_planned_peak_bytes < second.own_unplanned_peak_bytes
    assert report.within_budget and report.predicted_peak_bytes == second.step_peak_bytes
    assert m.peak_bytes <= budget + PEAK_SLACK_BYTES, report.summary()
    # The pair reports count what the rest of the step holds.
    last = offload_compiler.last_report()
    assert last.peak_bytes_planned == second.step_peak_bytes


@pytest.mark.parametrize("fraction", [0.6, 0.75])
def test_graph_break_percentage_is_of_the_step(reference, fraction):
    ref_peak, ref_grads = reference
    # The first piece cannot reach its provisional budget (a percentage of its own part of the
    # step): not refused, the step's check at the second piece's compile decides.
    model, m, grads = train(f"{fraction:.0%}", on_infeasible="error")
    check_grads(grads, ref_grads)
    report = step_report(model)
    # The step's unplanned peak: the largest of the pairs' own plus what the other holds.
    assert report.unplanned_peak_bytes == max(p.step_unplanned_peak_bytes for p in report.pairs)
    assert report.unplanned_peak_bytes >= ref_peak - PEAK_SLACK_BYTES  # it is the step's, not one graph's
    assert report.budget_bytes == int(fraction * report.unplanned_peak_bytes)
    assert report.within_budget
    assert m.peak_bytes <= report.budget_bytes + PEAK_SLACK_BYTES, report.summary()
    assert m.peak_bytes <= fraction * ref_peak + PEAK_SLACK_BYTES


def test_later_pair_that_cannot_fit_is_refused_naming_the_step():
    # At 1.6 MB the first pair fits keeping its saved activations; the second then cannot fit
    # beside them (earlier pairs are not replanned: README "Distributed").
    with pytest.raises(Exception) as info:
        train(1_600_000, on_infeasible="error")
    inner = getattr(info.value, "inner_exception", info.value)
    assert isinstance(inner, InfeasibleBudgetError)
    assert "training step's other graph pairs hold" in str(inner)


def test_percentage_the_step_cannot_reach_is_refused():
    with pytest.raises(Exception) as info:
        train("40%", on_infeasible="error")
    inner = getattr(info.value, "inner_exception", info.value)
    assert isinstance(inner, InfeasibleBudgetError)
    msg = str(inner)
    assert "40%" in msg and "training step" in msg
    # The one percentage to pass back is the step's (not the pair's own), and it runs.
    assert "of this graph's peak" not in msg
    match = re.search(r"memory_budget='([0-9.]+%)' of the step's peak", msg)
    assert match, msg
    torch._dynamo.reset()
    train(match.group(1), on_infeasible="error")


def test_single_graph_is_its_own_step():
    """Without a graph break the ledger has one pair and holds nothing: the plan is the pair's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x):
            return self.net(x).pow(2).mean()

    root = Loss()
    opts = {"inner": "eager", "memory_budget": "70%", "min_offload_bytes": 0, "on_infeasible": "warn"}
    compiled = torch.compile(root, backend="trinity", options=opts)
    compiled(torch.randn(256, 64)).backward()
    report = step_report(root)
    assert report is not None and len(report.pairs) == 1
    (pair,) = report.pairs
    assert pair.held_bytes == 0 and pair.held_unplanned_bytes == 0
    assert report.budget_bytes == int(0.7 * pair.own_unplanned_peak_bytes)
    assert offload_compiler.last_report().budget_bytes == report.budget_bytes


def test_copied_or_pickled_model_gets_its_own_ledger():
    import copy
    import io

    model, _, _ = train(1_800_000)
    assert len(step_report(model).pairs) == 2
    for other in (copy.deepcopy(model), torch.load(_saved(model, io), weights_only=False)):
        assert step_report(other).pairs == ()  # a ledger of no module: nothing compiled yet
        torch._dynamo.reset()  # else Dynamo may run the original's graphs for the copy
        compiled = torch.compile(
            other, backend="trinity", options={"inner": "eager", "memory_budget": 1_800_000, "min_offload_bytes": 0}
        )
        compiled(torch.randn(512, 64)).backward()
        report = step_report(other)
        assert len(report.pairs) == 2 and report.pairs[0].held_bytes == 2 * nbytes(other.a.parameters())


def _saved(model, io):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return buf


class _Inner(nn.Module):
    """Two layers with a graph break between them, inside the module that calls it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.b = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))

    def forward(self, x):
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h)


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Inner()
        self.head = nn.Linear(64, 64)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(x))).square().mean()


def test_graph_break_in_a_nested_module_joins_the_callers_step():
    """A graph break inside a nested call makes Dynamo compile the inner module's frames on their
    own (each pair's parameters belong to ``inner``) and the caller's resumed frame (``head``): all
    are one step, on one ledger, which ``step_report`` of either module returns."""
    torch.manual_seed(0)
    model = _Outer()
    x = torch.randn(512, 64)
    opts = {"inner": "eager", "memory_budget": "85%", "min_offload_bytes": 0, "on_infeasible": "error"}
    compiled = torch.compile(model, backend="trinity", options=opts)
    for _ in range(2):
        compiled(x).backward()
        model.zero_grad(set_to_none=True)
    report = step_report(model)
    assert report is not None
    assert step_report(model.inner) is not None and step_report(model.inner).pairs == report.pairs
    labels = [p.label for p in report.pairs]
    # inner's two pieces and the caller's resumed frame (the graph ending at the call compiles nothing)
    assert len(report.pairs) == 3, labels
    total = nbytes(model.parameters())
    # Each pair sees the parameters and gradients of the whole model outside its own.
    for p in report.pairs:
        assert p.held_bytes >= 2 * (total - p.param_bytes), report.summary()
    m = measure_peak_device_bytes(lambda: compiled(x).backward(), resident=list(model.parameters()) + [x], device="cpu")
    assert report.within_budget, report.summary()
    assert m.peak_bytes <= report.budget_bytes + PEAK_SLACK_BYTES, report.summary()
