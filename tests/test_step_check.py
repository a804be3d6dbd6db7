"""The runtime check of the first steps (offload_compiler/step_check.py).

A kernel that allocates scratch its fake kernel does not show breaks a plan made from fake
tensors. Here a custom op does it on purpose; the compiled code must measure the first step, see
the measured peak above the budget, plan again with the measured workspace, and then stay within
the budget with gradients still equal to the reference's. A second case mimics what an
AVX512-BF16/AMX CPU does to ``test_e2e.py::test_bf16_autocast``: a bf16 ``mm`` kernel with an fp32
accumulator as scratch.
"""

import contextlib
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import offload_compiler
from offload_compiler import measure_peak_device_bytes, step_check, step_report
from offload_compiler.graph_pair import GraphPair
from offload_compiler.passes import liveness
from offload_compiler.passes.margins import WorkspaceMargins, matches, op_key
from offload_compiler.pipeline import InfeasibleBudgetError

from . import models
from .test_e2e import PEAK_SLACK_BYTES, SideBySide

D, N, DEPTH = 128, 4096, 8
ACT_BYTES = N * D * 4


@torch.library.custom_op("trinity_test::scratch_tanh", mutates_args=())
def scratch_tanh(x: torch.Tensor, factor: int) -> torch.Tensor:
    """tanh whose kernel allocates ``factor`` times its input as scratch (the fake kernel does not)."""
    scratch = torch.empty(x.numel() * factor, dtype=x.dtype, device=x.device)
    scratch.fill_(1.0)
    return torch.tanh(x)


@scratch_tanh.register_fake
def _(x, factor):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _backward(ctx, grad):
    (y,) = ctx.saved_tensors
    return grad * (1 - y * y), None


scratch_tanh.register_autograd(_backward, setup_context=_setup)


class ScratchMLP(nn.Module):
    def __init__(self, factor=2):
        super().__init__()
        self.factor = factor
        self.lins = nn.ModuleList(nn.Linear(D, D) for _ in range(DEPTH))
        self.head = nn.Linear(D, 16)

    def forward(self, x, y):
        for lin in self.lins:
            x = scratch_tanh(lin(x), self.factor)
        return F.cross_entropy(self.head(x), y)


def scratch_batch(n=N):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, D, generator=g), torch.randint(0, 16, (n,), generator=g)


def _measure(sbs, batch):
    sbs.model.zero_grad(set_to_none=True)
    resident = list(sbs.model.parameters()) + list(batch)
    m = measure_peak_device_bytes(lambda: sbs.trinity_step(batch), resident=resident, device="cpu")
    sbs.model.zero_grad(set_to_none=True)
    return m.peak_bytes


def _report(sbs):
    (r,) = sbs.reports()
    return r


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_scratch_workspace_is_measured_and_replanned(inner):
    sbs = SideBySide(lambda: ScratchMLP(factor=2), inner)
    batch = scratch_batch()
    sbs.step(batch)
    first = _report(sbs)
    assert first.budget_bytes is not None and first.peak_bytes_planned <= first.budget_bytes
    assert first.correction is None
    # The scratch the plan did not see: the first step is above the plan and the budget.
    assert first.measured_peak_bytes > first.budget_bytes >= first.peak_bytes_planned, first.summary()
    step = step_report(sbs.model)
    assert not step.within_budget and step.pairs[0].measured_replan_due, step.summary()
    assert "planned again at the next call" in step.summary()
    sbs.step(batch)  # runs the replanned pair (gradients checked against the reference)
    r = _report(sbs)
    assert r.graph_id == first.graph_id and r.budget_bytes == first.budget_bytes
    c = r.correction
    assert c is not None and c.replans == 1, r.summary()
    assert c.first_measured_peak_bytes == first.measured_peak_bytes
    assert c.first_planned_peak_bytes == first.peak_bytes_planned
    scratch_nodes = [m for m in c.margins if m[1] == "trinity_test::scratch_tanh"]
    assert len(scratch_nodes) == DEPTH and all(b == 2 * ACT_BYTES for _, _, b in scratch_nodes), c.margins
    assert c.total_margin_bytes == sum(b for _, _, b in c.margins) >= DEPTH * 2 * ACT_BYTES
    assert r.num_evicted > first.num_evicted
    # The corrected plan, measured by the check and independently, is within the budget.
    assert r.measured_peak_bytes is not None and r.measured_peak_bytes <= r.budget_bytes, r.summary()
    assert r.peak_bytes_planned <= r.budget_bytes
    assert _measure(sbs, batch) <= r.budget_bytes + PEAK_SLACK_BYTES
    step = step_report(sbs.model)
    assert step.within_budget and step.measured_peak_bytes == r.measured_peak_bytes, step.summary()
    sbs.step(batch)
    # Which step each figure is of: the corrected plan's first step, and the first plan's.
    from offload_compiler.options import format_bytes

    text = r.summary()
    assert f"measured   {format_bytes(r.measured_peak_bytes)} peak in this plan's first step" in text, text
    assert (
        f"corrected  replanned 1x after measuring {format_bytes(c.first_measured_peak_bytes)} in the first plan's measured step"
        in text
    )


def test_without_the_check_the_scratch_breaks_the_budget():
    """The control for the test above: the same model and budget with runtime_check='off'."""
    sbs = SideBySide(lambda: ScratchMLP(factor=2), "eager", runtime_check="off")
    batch = scratch_batch()
    sbs.step(batch)
    sbs.step(batch)
    r = _report(sbs)
    assert r.measured_peak_bytes is None and r.correction is None
    assert _measure(sbs, batch) > r.budget_bytes + PEAK_SLACK_BYTES


def test_measure_only_reports_and_warns():
    sbs = SideBySide(lambda: ScratchMLP(factor=2), "eager", runtime_check="measure")
    batch = scratch_batch()
    with pytest.warns(UserWarning, match="measured peak of the first step.*above the budget.*'measure'"):
        sbs.step(batch)
    r = _report(sbs)
    assert r.measured_peak_bytes > r.budget_bytes and r.correction is None
    sbs.step(batch)
    assert _report(sbs) is r  # measured once, not replanned
    # The step report judges the step by the measurement too (a fresh-user trial: it said "within
    # budget" from the prediction while every step measured 9.9% above).
    step = step_report(sbs.model)
    (pair,) = step.pairs
    assert step.predicted_peak_bytes <= step.budget_bytes
    assert pair.own_measured_peak_bytes == r.measured_peak_bytes and not pair.measured_replan_due
    assert step.measured_peak_bytes == r.measured_peak_bytes + pair.held_bytes > step.budget_bytes
    assert not step.within_budget
    assert "ABOVE the budget" in step.summary() and "the runtime check's warning says why" in step.summary()


def test_infeasible_with_the_measured_workspace_names_it():
    # Scratch of 12 activations at every layer: no plan fits it under 50%.
    sbs = SideBySide(lambda: ScratchMLP(factor=12), "eager")
    batch = scratch_batch()
    sbs.step(batch)
    with pytest.raises(InfeasibleBudgetError, match=r"measured \d+ bytes against the budget.*scratch_tanh"):
        sbs.trinity_step(batch)
    # The pair keeps running its first plan.
    sbs.model.zero_grad(set_to_none=True)
    sbs.step(batch)


def test_infeasible_with_warn_runs_the_lowest_peak_plan_with_the_workspace():
    sbs = SideBySide(lambda: ScratchMLP(factor=12), "eager", on_infeasible="warn")
    batch = scratch_batch()
    sbs.step(batch)
    first = _report(sbs)
    with pytest.warns(UserWarning, match="lowest-peak plan"):
        sbs.step(batch)
    r = _report(sbs)
    assert r.correction is not None and not r.feasible
    assert first.feasible and first.measured_peak_bytes > first.budget_bytes
    # The lowest-peak plan now counts the scratch, and predicts the step it runs.
    assert r.peak_bytes_planned >= 12 * ACT_BYTES + first.peak_bytes_planned // 2
    sbs.step(batch)
    r = _report(sbs)
    assert r.measured_peak_bytes <= r.peak_bytes_planned + PEAK_SLACK_BYTES < first.measured_peak_bytes


def test_dynamic_shapes_replan_keeps_them_symbolic():
    sbs = SideBySide(lambda: ScratchMLP(factor=2), "eager", dynamic=True)
    sbs.step(scratch_batch(N))
    sbs.step(scratch_batch(N))
    r = _report(sbs)
    assert r.correction is not None and r.measured_peak_bytes <= r.budget_bytes
    for n in (N // 2, N):  # other sizes run the same replanned code, correctly
        sbs.step(scratch_batch(n))
    assert len(sbs.reports()) == 1


def test_a_running_profiler_defers_the_measurement():
    sbs = SideBySide(lambda: ScratchMLP(factor=2), "eager")
    batch = scratch_batch()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        sbs.step(batch)
    assert _report(sbs).measured_peak_bytes is None
    sbs.step(batch)
    assert _report(sbs).measured_peak_bytes is not None


def test_first_steps_all_under_a_profiler_warn_that_the_plan_is_unchecked():
    # A new user measured every step with measure_peak_device_bytes (it runs a profiler on the
    # CPU): the check never ran, and a reused block graph went 2x over budget in silence.
    sbs = SideBySide(lambda: ScratchMLP(factor=2), "eager")
    batch = scratch_batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(step_check.PROFILED_CALLS_WARN):
            _measure(sbs, batch)
    unchecked = [w for w in caught if "has not measured this pair's first step" in str(w.message)]
    assert len(unchecked) == 1, [str(w.message) for w in caught]
    assert f"last {step_check.PROFILED_CALLS_WARN} training calls ran while a profiler was on" in str(
        unchecked[0].message
    )
    assert _report(sbs).measured_peak_bytes is None
    # One step without a profiler: measured, and no second warning.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sbs.step(batch)
        assert _report(sbs).measured_peak_bytes is not None
        _measure(sbs, batch)
    assert not [w for w in caught if "has not measured this pair's first step" in str(w.message)]


def test_a_model_without_unmodelled_workspace_is_not_replanned():
    sbs = SideBySide(models.MLP, "eager")
    batch = models.mlp_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        sbs.step(batch)
        sbs.step(batch)
    r = _report(sbs)
    assert r.correction is None
    assert r.measured_peak_bytes is not None and r.measured_peak_bytes <= r.budget_bytes
    # The check's measurement is the independent one's, up to what runs outside the graphs.
    assert abs(r.measured_peak_bytes - _measure(sbs, batch)) <= PEAK_SLACK_BYTES


@contextlib.contextmanager
def amx_like_bf16_mm():
    """``aten::mm`` on the CPU with an fp32 accumulator of the output as scratch for bf16 inputs,
    as oneDNN's AMX path allocates (the values are the stock kernel's: it calls ``mm.out``)."""
    lib = torch.library.Library("aten", "IMPL")

    def mm(a, b):
        out = a.new_empty((a.shape[0], b.shape[1]))
        if a.dtype == torch.bfloat16:
            torch.empty(a.shape[0] * b.shape[1], dtype=torch.float32).zero_()
        torch.ops.aten.mm.out(a, b, out=out)
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
        lib.impl("mm", mm, "CPU")
    try:
        yield
    finally:
        lib._destroy()


@pytest.mark.parametrize("check", ["replan", "off"])
def test_bf16_autocast_with_amx_like_mm_workspace(check):
    """``test_e2e.py::test_bf16_autocast[eager]`` with a bf16 matmul that allocates what the one
    on an AVX512-BF16/AMX CPU does: the check corrects the plan (and without it the same
    ``check_memory`` fails, as it did on that machine)."""
    with amx_like_bf16_mm():
        # The offload-only plan, which the workspace pushes over the budget: the joint planner's
        # choice depends on the CPU's per-node times and may leave slack for it by chance.
        sbs = SideBySide(models.GPTLoss, "eager", budget="60%", runtime_check=check, strategy="offload")
        batch = models.gpt_batch()
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ref = sbs.ref(*batch)
                loss = sbs.compiled(*batch)
            ref.backward()
            loss.backward()
            assert torch.equal(loss.detach(), ref.detach())
            sbs.check_grads("bf16")
            sbs.model.zero_grad(set_to_none=True)
            sbs.ref_model.zero_grad(set_to_none=True)
        r = _report(sbs)
        context = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
        if check == "off":
            with pytest.raises(AssertionError, match="exceeds budget"):
                sbs.check_memory(batch, context=context)
            return
        assert r.correction is not None and any(op == "aten::mm" for _, op, _ in r.correction.margins)
        assert r.correction.first_measured_peak_bytes > r.budget_bytes
        sbs.check_memory(batch, context=context)


# ------------------------------------------------------------------------------ units


def _pair_of(fn, *args):
    """A (forward, backward) pair of ``fn`` traced by AOTAutograd's partitioner."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    got = {}

    def partition(gm, inputs, **kwargs):
        fw, bw = min_cut_rematerialization_partition(gm, inputs, **kwargs)
        got["pair"] = GraphPair(
            fw, bw, kwargs["num_fwd_outputs"], tuple(kwargs.get("static_lifetime_input_indices") or ())
        )
        return fw, bw

    from torch._dynamo.backends.debugging import boxed_nop

    compiled = torch.compile(
        fn, backend=aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partition)
    )
    compiled(*args).sum().backward()
    return got["pair"]


def test_op_keys_match_out_calls_and_margins_feed_liveness():
    a = torch.randn(64, 32, requires_grad=True)
    b = torch.randn(32, 16, requires_grad=True)
    pair = _pair_of(lambda a, b: torch.mm(a, b).tanh(), a, b)
    (mm,) = [n for n in pair.forward.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.mm.default]
    key = op_key(mm)
    assert key == ("aten::mm", (((64, 32), "torch.float32"), ((32, 16), "torch.float32")))
    # Inductor calls mm(a, b, out=buf): one more tensor.
    out_call = (key[0], key[1] + (((64, 16), "torch.float32"),))
    assert matches(out_call, key) and not matches(key, out_call[:1] + ((key[1][1], key[1][0]),))
    assert op_key(next(iter(pair.forward.graph.find_nodes(op="placeholder")))) is None
    margins = WorkspaceMargins(((out_call, 10_000),), budget_bytes=123)
    assert margins.bytes_for(key) == 10_000 and margins.node_bytes(mm) == 10_000
    assert margins.merged({key: 4_000}).bytes_for(key) == 10_000
    assert margins.merged({key: 40_000}).bytes_for(key) == 40_000
    assert margins.merged({}).budget_bytes == 123
    plain = liveness.analyze(pair)
    with_m = liveness.analyze(pair, margins=margins)
    step = plain.step_named("forward", mm.name)
    assert plain.workspace_bytes[step] == 0 and with_m.workspace_bytes[step] == 10_000
    assert (with_m.live_bytes() - plain.live_bytes()).tolist() == [
        10_000 if s == step else 0 for s in range(plain.num_steps)
    ]


def test_a_100_percent_budget_replanned_with_margins_fits_without_a_plan():
    """A fraction budget replanned with measured margins is of the unplanned peak without them
    (a margin never raises the budget), except 100%: the step as measured, margins included,
    fits without a plan. (A fresh-user trial's LayerNorm MLP at 100% measured 12 bytes above its
    modelled peak, and the replan against the old figure offloaded 8 MiB every step.)"""
    from offload_compiler.options import TrinityOptions
    from offload_compiler.pipeline import plan_pair

    a = torch.randn(256, 64, requires_grad=True)
    b = torch.randn(64, 64, requires_grad=True)
    pair = _pair_of(lambda a, b: torch.mm(a, b).tanh().mm(b.t()).tanh(), a, b)
    mm = next(n for n in pair.forward.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.mm.default)
    peak = liveness.analyze(pair).peak_bytes
    margins = WorkspaceMargins(((op_key(mm), 200_000),), budget_bytes=peak, unplanned_peak_bytes=peak)
    assert liveness.analyze(pair, margins=margins).peak_bytes > peak  # the margin raises the peak

    def plan(pct):
        opts = TrinityOptions.from_user({"memory_budget": pct, "inner": "eager", "min_offload_bytes": 0}, env={})
        return plan_pair(pair, opts, margins=margins)

    full = plan("100%")
    assert full.joint.recompute.fits_without_plan and not full.activations.evictions
    assert full.step_budget_bytes >= liveness.analyze(pair, margins=margins).peak_bytes
    # Below 100% the budget stays a fraction of the peak without the margins.
    assert plan("90%").step_budget_bytes == int(0.9 * peak)


def test_a_reserve_counts_at_every_node_and_survives_merging():
    """Bytes a measured step held beyond the plan with the measured workspace that no op
    explains (oneDNN's AMX bf16 matmuls on a Sapphire Rapids CPU: 76 KiB on the bf16 autocast GPT
    block, whose plan then measured above its budget) are planned again as a reserve: liveness
    counts them at every node, on top of the op margins."""
    a = torch.randn(64, 32, requires_grad=True)
    b = torch.randn(32, 16, requires_grad=True)
    pair = _pair_of(lambda a, b: torch.mm(a, b).tanh(), a, b)
    (mm,) = [n for n in pair.forward.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.mm.default]
    margins = WorkspaceMargins(((op_key(mm), 10_000),), budget_bytes=123).with_reserve(5_000).with_reserve(1_000)
    assert margins.reserve_bytes == 6_000
    assert margins.merged({op_key(mm): 40_000}).reserve_bytes == 6_000
    with pytest.raises(ValueError, match="more_bytes must be >= 0"):
        margins.with_reserve(-1)
    plain = liveness.analyze(pair)
    with_r = liveness.analyze(pair, margins=margins)
    step = plain.step_named("forward", mm.name)
    assert (with_r.live_bytes() - plain.live_bytes()).tolist() == [
        16_000 if s == step else 6_000 for s in range(plain.num_steps)
    ]
    assert with_r.peak_bytes > plain.peak_bytes


def test_analyze_counts_transients_held_excess_and_the_step_peak():
    a = torch.randn(64, 32, requires_grad=True)
    b = torch.randn(32, 16, requires_grad=True)
    pair = _pair_of(lambda a, b: torch.mm(a, b).tanh(), a, b)
    planned = step_check.PlannedSteps.of(pair, False, None)
    mm_step = planned.ops.index("aten::mm")
    key = planned.keys[mm_step]
    trace = step_check._Trace(torch.device("cpu"), frozenset({"aten::mm"}))
    out_bytes = planned.defined_bytes[mm_step]
    assert out_bytes == 64 * 16 * 4
    # mm: its output, 8 KiB of scratch, and 5 KiB more output than modelled; then a free.
    trace.allocations = [(1, 100, out_bytes + 5120), (2, 200, 8192), (3, 200, -8192), (9, 100, -(out_bytes + 5120))]
    trace.ops = [(key, 8192, out_bytes + 5120), (("aten::mm", ()), 1 << 20, 0)]  # the second matches no node
    m = step_check.analyze(trace, planned)
    assert m.peak_bytes == planned.resident_bytes + out_bytes + 5120 + 8192
    assert m.op_workspace == ((key, 8192 + 5120),)
    assert m.node_margins == ((planned.nodes[mm_step], "aten::mm", 8192 + 5120),)
    assert m.extra_bytes == 8192 + 5120
    assert m.predicted_with_margins_bytes == max(
        b + (8192 + 5120 if i == mm_step else w)
        for i, (b, w) in enumerate(zip(planned.base_bytes, planned.workspace_bytes))
    )
    # Below MIN_TRANSIENT_BYTES it is bookkeeping, not a margin.
    trace.ops = [(key, step_check.MIN_TRANSIENT_BYTES - 1, out_bytes)]
    assert step_check.analyze(trace, planned).op_workspace == ()


def test_parameter_offload_first_step_is_measured_without_the_parameters():
    """With ``offload="all"`` every parameter lives in host memory between steps and its device
    copy is fetched inside the step, where the allocator trace sees it: the check must not add the
    parameters again as if resident (it measured the unplanned peak and warned "above the budget"
    on every such run)."""
    import offload_compiler

    torch.manual_seed(0)
    model = models.GPTLoss()
    compiled = torch.compile(
        model,
        backend="trinity",
        options={"memory_budget": "60%", "offload": "all", "inner": "eager", "min_offload_bytes": 0},
    )
    opt = offload_compiler.CPUOptimizer(model.parameters(), torch.optim.SGD, lr=0.01)
    x, y = models.gpt_batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            compiled(x, y).backward()
            opt.step()
            opt.zero_grad()
    r = offload_compiler.last_report()
    assert r.measured_peak_bytes is not None, r.summary()
    assert r.measured_peak_bytes <= r.peak_bytes_planned + PEAK_SLACK_BYTES, r.summary()
    assert not [w for w in caught if "above the budget" in str(w.message)], [str(w.message) for w in caught]


def test_offload_all_first_step_holds_no_more_than_the_plan():
    """With ``offload="all"`` the plan counts a parameter from its fetch inside the step. The model
    was built on the device, and the compile runs inside the first call: a parameter still there
    then stayed until the first step's release of it, so that step held it from its start, above
    the plan and, on this model, the budget. The compile now frees what its graphs fetch (the host
    master copy is current), and the first step, measured with the parameters the device really
    holds when it starts, is within the plan and the budget."""
    import offload_compiler
    from offload_compiler.models import GPTConfig

    torch.manual_seed(0)
    model = models.GPTLoss(GPTConfig(vocab_size=128, block_size=32, n_layer=4, n_head=2, n_embd=64))
    param_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())
    compiled = torch.compile(
        model,
        backend="trinity",
        options={"memory_budget": "30%", "offload": "all", "inner": "eager", "min_offload_bytes": 0},
    )
    opt = offload_compiler.CPUOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    x, y = models.gpt_batch(n=4, t=32, vocab=128)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(x, y).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    r = offload_compiler.last_report()
    assert r.peak_bytes_planned <= r.budget_bytes, r.summary()
    # The parameters on the device from the step's start would break the budget: the case can fail.
    assert r.peak_bytes_planned + param_bytes > r.budget_bytes, (param_bytes, r.summary())
    assert r.measured_peak_bytes is not None, r.summary()
    assert r.measured_peak_bytes <= r.budget_bytes, r.summary()
    assert abs(r.measured_peak_bytes - r.peak_bytes_planned) <= PEAK_SLACK_BYTES, r.summary()
    assert not [w for w in caught if "above the budget" in str(w.message)], [str(w.message) for w in caught]
    # Between steps, as before the first one, the parameters hold no device storage.
    assert sum(p.untyped_storage().nbytes() for p in model.parameters()) == 0


def test_activations_params_first_step_is_measured_within_the_budget():
    """With ``offload="activations+params"`` each offloaded parameter is resident when the step
    starts, released after its last forward reader (written back to its host master) and fetched
    back, a new allocation, for the backward, where the user's optimizer finds it. The allocator
    trace sees the fetch but, on the CPU, not the free of a block allocated before the trace: the
    check counted those parameters twice from their backward fetch on, measured a first step above
    the budget that the device never held, and warned. The check must measure what an independent
    measurement of the step measures, within the plan and the budget; so must
    ``measure_peak_device_bytes`` with the parameters declared resident and no warmup."""
    import offload_compiler
    from offload_compiler.models import GPTConfig

    cfg = GPTConfig(vocab_size=512, block_size=32, n_layer=4, n_head=2, n_embd=128)
    torch.manual_seed(0)
    model = models.GPTLoss(cfg)
    compiled = torch.compile(
        model,
        backend="trinity",
        options={"memory_budget": "8MiB", "offload": "activations+params", "inner": "eager"},
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the user's own, on the device
    x, y = models.gpt_batch(n=4, t=32, vocab=512)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            compiled(x, y).backward()
            opt.step()
            opt.zero_grad()
    r = offload_compiler.last_report()
    assert r.param_offload["mode"] == "activations+params", r.summary()
    assert r.peak_bytes_planned <= r.budget_bytes, r.summary()
    released = [p for p in model.parameters() if p._trinity_slot is not None and p._trinity_slot.num_releases]
    released_bytes = sum(p.untyped_storage().nbytes() for p in released)
    # Counting the released parameters twice would break the budget: the case can fail.
    assert r.peak_bytes_planned + released_bytes > r.budget_bytes, (released_bytes, r.summary())
    assert r.measured_peak_bytes is not None, r.summary()
    assert r.measured_peak_bytes <= r.budget_bytes, r.summary()
    assert abs(r.measured_peak_bytes - r.peak_bytes_planned) <= PEAK_SLACK_BYTES, r.summary()
    assert not [w for w in caught if "above the budget" in str(w.message)], [str(w.message) for w in caught]

    def step():
        for p in model.parameters():
            p.grad = None
        compiled(x, y).backward()

    # Independently: a warmup step under the same trace allocates the parameters the measured step
    # releases (their frees are then seen); the others are declared resident.
    kept = [p for p in model.parameters() if all(p is not q for q in released)]
    truth = measure_peak_device_bytes(step, resident=kept + [x, y], device="cpu", warmup=step).peak_bytes
    assert truth <= r.budget_bytes and abs(truth - r.measured_peak_bytes) <= PEAK_SLACK_BYTES, (truth, r.summary())
    # Every parameter declared resident, no warmup: the releases stop counting them.
    declared = measure_peak_device_bytes(step, resident=list(model.parameters()) + [x, y], device="cpu").peak_bytes
    assert abs(declared - truth) <= PEAK_SLACK_BYTES, (declared, truth)


def test_analyze_stops_counting_a_resident_storage_where_it_is_released():
    """A storage resident when the forward starts counts until the ``trinity::param_release`` call
    that frees it (the CPU allocator reports no free of a block allocated before the trace) or the
    allocator's free of it (CUDA's reports one), once when both arrive; a release of a storage the
    trace saw allocated changes nothing before its own free."""
    a = torch.randn(64, 32, requires_grad=True)
    b = torch.randn(32, 16, requires_grad=True)
    pair = _pair_of(lambda a, b: torch.mm(a, b).tanh(), a, b)
    planned = step_check.PlannedSteps.of(pair, False, None)
    kib = 1024
    trace = step_check._Trace(torch.device("cpu"), frozenset())
    trace.resident = {1000: 40 * kib, 2000: 8 * kib}
    # 1000 released (no free event) and 40 KiB fetched back at 4000; 5000 allocated and released
    # under the trace (its free is seen); 4 KiB allocated meanwhile.
    trace.releases = [(10, 1000), (31, 5000)]
    trace.allocations = [(20, 3000, 4 * kib), (30, 5000, 16 * kib), (31, 5000, -16 * kib), (40, 4000, 40 * kib)]
    m = step_check.analyze(trace, planned)
    assert m.peak_bytes == 48 * kib + 4 * kib, m  # the start, plus 4 KiB; the fetch replaced the release
    # The same with the allocator's free of the released block reported too (CUDA): counted once.
    trace.allocations = sorted(trace.allocations + [(11, 1000, -40 * kib)])
    assert step_check.analyze(trace, planned).peak_bytes == 52 * kib
    # Without the release call and with no free event (the bug): the fetch counts on top.
    trace.releases, trace.allocations = [], [a for a in trace.allocations if a[0] != 11]
    assert step_check.analyze(trace, planned).peak_bytes == 48 * kib + 4 * kib + 40 * kib
    # A trace made by hand without storages counts the resident bytes as the plan does.
    trace.resident = None
    assert step_check.analyze(trace, planned).peak_bytes == planned.resident_bytes + 4 * kib + 40 * kib


def _tanh_stack():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(8)], nn.Linear(256, 1))


def _retain_graph_steps(steps=3, retain=True):
    """The tanh stack at 70% with ``backward(retain_graph=retain)``: the warnings of each step,
    the model, the compiled pair's backward node of the first step and its loss (alive, so the
    node's saved tensors are too)."""
    torch._dynamo.reset()
    m = _tanh_stack()
    options = {"memory_budget": "70%", "inner": "eager", "min_offload_bytes": 0}
    c = torch.compile(m, backend="trinity", options=options)
    x = torch.randn(1024, 256)
    seen, first = [], None
    for _ in range(steps):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            loss = c(x).pow(2).mean()
            loss.backward(retain_graph=retain)
            m.zero_grad(set_to_none=True)
        seen.append([str(x.message) for x in w if "trinity" in str(x.message)])
        first = first or loss
    node = first.grad_fn
    while "CompiledFunction" not in type(node).__name__:
        node = node.next_functions[0][0]
    return seen, m, x, node


def test_retain_graph_backward_is_named_not_replanned_with_a_reserve():
    """retain_graph=True keeps the graph's saved tensors alive to the backward's end, where the
    plan frees each at its last use: the check reads the backward's flag and says so (with the
    device bytes of saved activations the plan keeps, as the backward node holds them), instead of
    "bytes no op explains" and a reserve at every node that no plan meets."""
    from offload_compiler.runtime.pool import live_pool_blocks

    seen, m, x, node = _retain_graph_steps()
    assert [len(s) for s in seen] == [1, 0, 0], seen  # warned once, at the measured step
    (text,) = seen[0]
    r = offload_compiler.last_report()
    assert r.correction is None and r.measured_peak_bytes > r.budget_bytes  # not replanned
    # The saved activations the node still holds on the device (not the parameters and input,
    # not the host copies of the evicted ones in the pool's blocks).
    pool = {p for p, _ in live_pool_blocks()}
    resident = {t.untyped_storage().data_ptr() for t in [*m.parameters(), x]}
    kept = sum(
        t.untyped_storage().nbytes()
        for t in node.saved_tensors
        if t.untyped_storage().data_ptr() not in pool | resident
    )
    assert kept > 0 and r.num_evicted > 0
    assert f"the measured peak of the first step, {r.measured_peak_bytes} bytes, is above the budget" in text
    assert (
        "its backward ran with retain_graph=True, which keeps the graph's saved tensors alive until the graph" in text
    )
    assert f"(the {kept} bytes of saved activations this plan keeps on the device, and the host copies" in text
    assert "Call backward() without retain_graph=True where the graph is not needed again" in text
    assert "raise memory_budget" in text
    assert "no op explains" not in text and "no op's workspace explains" not in text
    assert "reserved at every node" not in text and "no plan reaches the budget" not in text
    # Without retain_graph the same plan is within its budget: nothing to say.
    seen, *_ = _retain_graph_steps(steps=2, retain=False)
    assert seen == [[], []]


def test_retain_graph_unknown_is_named_as_a_possible_cause(monkeypatch):
    """Where the backward's retain_graph flag cannot be read, the bytes no op explains are planned
    for with a reserve as before, and the warning names retain_graph=True as a possible cause."""

    monkeypatch.setattr(step_check, "_backward_keeps_graph", lambda: None)
    seen, *_ = _retain_graph_steps()
    texts = [t for s in seen for t in s]
    assert len(texts) == 1, seen
    assert "which no op explains (a backward with retain_graph=True, or allocations the plan does not see)" in texts[0]
    assert "with them reserved at every node no plan reaches the budget" in texts[0]


def test_reserve_warning_names_retain_graph_only_where_it_may_be_the_cause(monkeypatch):
    """The warning for a reserve no plan fits names the causes the check cannot rule out: where the
    backward's flag reads False, retain_graph is not one of them (the same bytes, read as False)."""

    monkeypatch.setattr(step_check, "_backward_keeps_graph", lambda: False)
    seen, *_ = _retain_graph_steps()
    texts = [t for s in seen for t in s]
    assert len(texts) == 1, seen
    assert "which no op explains (allocations the plan does not see)" in texts[0]
    assert "with them reserved at every node no plan reaches the budget" in texts[0]
    assert "retain_graph" not in texts[0]
