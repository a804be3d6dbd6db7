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
from bench.step_budget import REUSE_ROWS, REUSE_WIDTH, Blocks, Broken  # the step-budget benchmark's models
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
    with pytest.warns(UserWarning, match="below the lowest peak") as caught:
        compiled(torch.randn(256, 64)).backward()
    # The infeasible warning of the step's only pair has no (empty) step summary.
    text = "\n".join(str(w.message) for w in caught)
    assert "graph pair(s)" not in text, text
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


# ---------------------------------------------------------------- a block graph run N times per step

# The benchmark's Blocks (3 linear+tanh layers with a residual, width 128, 2048 rows): every block
# compiled with trinity on its own (``block.compile``), so Dynamo compiles one graph at the first block's call
# and all blocks run it: ``F1 .. F4 B4 .. B1``. One run's own peak is 7.25 MiB unplanned; the
# step, with three earlier runs' saved activations (3 MiB each) held beside the last, 18.8 MiB
# measured. 12 MB fits one run without a plan but not the step.
REUSE_BUDGET = 12_000_000


def train_blocks(budget, backend="trinity", n=4, rows=REUSE_ROWS, input_grad=True, **options):
    """Each block compiled on its own; three unmeasured steps (the first step's check measures and
    replans, the second measures the new plan), then one measured. Returns (model, measurement,
    gradients of the parameters and the input, reports of its pairs)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Blocks(n)
    before = len(offload_compiler.reports())
    opts = {"inner": "eager", "memory_budget": budget, "min_offload_bytes": 0, **options}
    for b in model.blocks:
        if backend == "trinity":
            b.compile(backend="trinity", options=opts)
        else:
            b.compile(backend=backend)
    x = torch.randn(rows, REUSE_WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=input_grad)

    def step():
        model(x).backward()

    for _ in range(3):
        step()
        model.zero_grad(set_to_none=True)
        x.grad = None
    m = measure_peak_device_bytes(step, resident=list(model.parameters()) + [x], device="cpu")
    grads = [p.grad.clone() for p in model.parameters()] + ([x.grad.clone()] if input_grad else [])
    return model, m, grads, offload_compiler.reports()[before:]


@pytest.fixture(scope="module")
def blocks_reference():
    _, m, grads, _ = train_blocks(None, backend="aot_eager")
    return m.peak_bytes, grads


def check_equal(grads, ref_grads):
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)  # the same ops in the same order: bit-identical


def test_reused_block_graph_without_replanning_breaks_the_step_budget(blocks_reference):
    """The control: planned for one run (the pair's plan at compile time, what the measure-only
    check keeps), the block graph fits the budget, and the step with its 4 runs does not."""
    ref_peak, ref_grads = blocks_reference
    assert ref_peak > REUSE_BUDGET + PEAK_SLACK_BYTES
    with pytest.warns(UserWarning, match=r"ran this graph 4 times at once.*runtime_check='measure'"):
        model, m, grads, reps = train_blocks(REUSE_BUDGET, runtime_check="measure")
    check_equal(grads, ref_grads)
    (r,) = reps
    assert r.reuse_count == 1 and r.reuse_measured == 4 and r.correction is None
    assert r.peak_bytes_planned <= r.budget_bytes == REUSE_BUDGET
    assert "plan covers 1 run(s)" in r.summary()
    assert m.peak_bytes > REUSE_BUDGET + PEAK_SLACK_BYTES


@pytest.mark.parametrize("budget", [REUSE_BUDGET, "60%"])
def test_reused_block_graph_is_planned_for_its_runs_per_step(blocks_reference, budget):
    ref_peak, ref_grads = blocks_reference
    model, m, grads, reps = train_blocks(budget, on_infeasible="error")
    check_equal(grads, ref_grads)
    (r,) = reps  # one graph, run by all four blocks
    # Measured across the step, all 4 runs, within the budget.
    assert m.peak_bytes <= r.budget_bytes + PEAK_SLACK_BYTES, r.summary()
    # The first step's check counted 4 runs alive at once and planned the pair again for them.
    assert r.reuse_count == r.reuse_measured == 4, r.summary()
    assert r.correction is not None and r.correction.reuse_count == 4 and r.correction.replans == 1
    assert "run 4 times per step" in r.summary() and "the budget covers the 4 runs" in r.summary()
    assert r.feasible and r.num_evicted > 0
    # The planned peak is the last run's own plus what the 3 earlier runs and the rest hold.
    assert r.peak_bytes_planned <= r.budget_bytes
    assert r.peak_bytes_planned >= r.held_bytes + r.reuse_held_bytes + 3 * REUSE_ROWS * REUSE_WIDTH * 4
    if isinstance(budget, str):
        # A percentage is of the step's unplanned peak: the 4 runs, not one.
        assert r.budget_bytes == int(0.6 * r.peak_bytes_unplanned)
        assert r.peak_bytes_unplanned >= ref_peak - PEAK_SLACK_BYTES
    else:
        assert r.budget_bytes == budget
    report = step_report(model)  # the blocks' ledgers
    (pair,) = report.pairs
    assert pair.runs == 4 and report.within_budget and report.budget_bytes == r.budget_bytes
    assert report.predicted_peak_bytes == pair.step_peak_bytes <= r.budget_bytes
    assert "run 4 times per step" in report.summary()


def test_reused_block_graph_infeasible_names_the_lowest_step_budget():
    with pytest.raises(InfeasibleBudgetError) as info:
        train_blocks("40%", on_infeasible="error")
    msg = str(info.value)
    assert "ran this graph 4 times at once" in msg and "runs 4 times per step" in msg
    match = re.search(r"memory_budget='([0-9.]+%)' of the step's peak", msg)
    assert match, msg
    # The percentage it names runs.
    _, m, _, reps = train_blocks(match.group(1), on_infeasible="error")
    assert reps[-1].feasible and reps[-1].reuse_count == 4
    assert m.peak_bytes <= reps[-1].budget_bytes + PEAK_SLACK_BYTES


def test_many_runs_before_the_first_backward_are_counted():
    """Six blocks: six forwards before the first backward (more calls than the check waits for
    a measured forward's backward without one)."""
    _, m, _, reps = train_blocks(6_000_000, n=6, rows=512)
    (r,) = reps
    assert r.reuse_count == r.reuse_measured == 6 and r.feasible, r.summary()
    assert m.peak_bytes <= r.budget_bytes + PEAK_SLACK_BYTES, r.summary()


def test_first_block_graph_and_the_reused_one_share_the_budget():
    """The input does not require a gradient: the first block compiles its own graph and the other
    three run a second one. The second sees the first's run beside its three runs."""
    model, m, _, reps = train_blocks(15_000_000, input_grad=False, on_infeasible="error")
    first, second = reps
    assert first.reuse_count == 1 and second.reuse_count == second.reuse_measured == 3
    # The first pair's run (its kept saved activations and input) is held beside the second's.
    assert second.held_bytes >= first.held_bytes + REUSE_ROWS * REUSE_WIDTH * 4
    report = step_report(model)
    assert len(report.pairs) == 2 and report.within_budget
    assert m.peak_bytes <= 15_000_000 + PEAK_SLACK_BYTES, report.summary()


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
