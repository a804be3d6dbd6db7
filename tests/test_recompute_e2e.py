"""End to end with recomputation chosen: bit-identical to eager's compile (``inner="eager"`` against
``aot_eager``), the measured peak within the budget, and the report and dumps saying what was
recomputed.

Recomputation is forced with ``strategy="recompute"`` (keep or recompute, never offload), or
chosen by ``strategy="auto"`` on device figures with a slow host link, where copies would be
exposed and recomputing is cheaper.
"""

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import offload_compiler
from offload_compiler import measure_peak_device_bytes
from offload_compiler.pipeline import InfeasibleBudgetError

from . import models
from .test_e2e import PEAK_SLACK_BYTES, SideBySide, assert_same

SLOW_LINK = {"h2d_bytes_per_s": 1e7, "d2h_bytes_per_s": 1e7}


class DropoutMLP(nn.Module):
    """Linear, LayerNorm, GELU, dropout per layer: random ops on the recompute chains."""

    def __init__(self, d=64, depth=6, p=0.25):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(depth))
        self.p = p
        self.head = nn.Linear(d, 16)

    def forward(self, x, y):
        for lin, norm in zip(self.lins, self.norms):
            x = x + F.dropout(F.gelu(norm(lin(x))), self.p, self.training)
        return F.cross_entropy(self.head(x), y)


def dropout_batch(n=512):
    return torch.randn(n, 64), torch.randint(0, 16, (n,))


def recomputed(sbs) -> int:
    return sum(r.recompute["num_recomputed"] for r in sbs.reports() if r.recompute)


def seeded_step(sbs, batch, seed):
    """A step of both models from the same generator state (dropout draws the same masks)."""
    sbs.sync()
    torch.manual_seed(seed)
    ref = sbs.ref(*batch)
    ref.backward()
    torch.manual_seed(seed)
    loss = sbs.compiled(*batch)
    loss.backward()
    assert_same(loss.detach(), ref.detach(), sbs.exact, "loss")
    sbs.check_grads()
    # The backward's replay restored the generator: both models left it in the same state.
    a = torch.rand(4)
    torch.manual_seed(seed)
    sbs.ref(*batch).backward()
    b = torch.rand(4)
    assert torch.equal(a, b), "the generator state after the step differs from the reference's"
    sbs.model.zero_grad(set_to_none=True)
    sbs.ref_model.zero_grad(set_to_none=True)
    return a, b


def check_peak(sbs, batch):
    reports = sbs.reports()
    resident = list(sbs.model.parameters()) + [t for t in batch if isinstance(t, torch.Tensor)]
    m = measure_peak_device_bytes(lambda: sbs.trinity_step(batch), resident=resident, device="cpu")
    sbs.model.zero_grad(set_to_none=True)
    budget = sum(r.budget_bytes for r in reports)
    assert m.peak_bytes <= budget + PEAK_SLACK_BYTES, "\n".join(r.summary() for r in reports)


@pytest.mark.parametrize("strategy, options", [("recompute", {}), ("auto", SLOW_LINK)])
def test_dropout_bit_identical_with_replayed_generator_state(strategy, options):
    sbs = SideBySide(DropoutMLP, "eager", budget="70%", strategy=strategy, **options)
    batch = dropout_batch()
    for seed in (1, 2):
        seeded_step(sbs, batch, seed)
    (r,) = sbs.reports()
    assert r.recompute["num_recomputed"] > 0, r.summary()
    assert any(d == "recompute" for _n, _b, d in r.decisions)
    if strategy == "recompute":
        assert r.num_evicted == 0
    check_peak(sbs, batch)


@pytest.mark.parametrize("strategy", ["auto", "offload"])
def test_dropout_noise_is_planned_from_the_first_step(strategy):
    """From a fresh-user trial: the CPU dropout kernel draws its noise into a tensor of its input's
    size (``native_dropout``, inner="eager"), which the plan did not count: the first step of an
    MLP with dropout measured one such tensor above the budget (3.03 MiB at 60%), until the
    runtime check's replan. The workspace table counts it now: no correction is needed."""
    sbs = SideBySide(functools.partial(DropoutMLP, d=256, depth=4), "eager", budget="60%", strategy=strategy)
    batch = (torch.randn(1024, 256), torch.randint(0, 16, (1024,)))
    seeded_step(sbs, batch, 6)
    (r,) = sbs.reports()
    assert r.measured_peak_bytes is not None, r.summary()
    assert r.measured_peak_bytes <= r.budget_bytes + PEAK_SLACK_BYTES, r.summary()
    assert r.correction is None, r.summary()
    # Offload-only: the lowest reachable peak is the lowest any offload plan reaches, unqualified.
    assert ("with this recomputation" in r.summary()) == (r.recompute["num_recomputed"] > 0), r.summary()


def test_dropout_recomputed_under_inductor_close():
    """Under Inductor dropout is ``inductor_random`` from a seed tensor: the seed is saved, the
    random op recomputed; the gradients match (to Inductor's tolerance) only if the masks do."""
    sbs = SideBySide(DropoutMLP, "inductor", budget="70%", strategy="recompute")
    batch = dropout_batch()
    seeded_step(sbs, batch, 3)
    assert recomputed(sbs) > 0


def test_views_bit_identical():
    """GPT: q, k, v are views of one projection (one buffer, three saved views), LayerNorm
    outputs are views of its result."""
    sbs = SideBySide(models.GPTLoss, "eager", budget="75%", strategy="recompute")
    batch = models.gpt_batch()
    for _ in range(2):
        sbs.step(batch)
    (r,) = sbs.reports()
    assert r.recompute["num_recomputed"] > 0, r.summary()
    assert r.peak_bytes_planned <= r.budget_bytes
    check_peak(sbs, batch)
    sbs.step(batch)


def test_inplace_forward_bit_identical():
    sbs = SideBySide(models.InPlace, "eager", budget="75%", strategy="recompute")
    batch = models.inplace_batch()
    for _ in range(2):
        sbs.step(batch)
    assert recomputed(sbs) > 0
    check_peak(sbs, batch)


def test_bf16_autocast_bit_identical():
    sbs = SideBySide(DropoutMLP, "eager", budget="70%", strategy="recompute")
    batch = dropout_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for seed in (4, 5):
            seeded_step(sbs, batch, seed)
    assert recomputed(sbs) > 0


def test_dynamic_shapes_bit_identical():
    sbs = SideBySide(models.MLP, "eager", budget="75%", dynamic=True, strategy="recompute")
    for n in (2048, 1536, 2048):
        sbs.step(models.mlp_batch(n))
    assert recomputed(sbs) > 0
    assert all(r.size_bounds for r in sbs.reports())


def test_retain_graph_two_backwards_bit_identical():
    sbs = SideBySide(DropoutMLP, "eager", budget="70%", strategy="recompute")
    batch = dropout_batch()
    for seed in (6, 7):
        torch.manual_seed(seed)
        ref = sbs.ref(*batch)
        ref.backward(retain_graph=True)
        ref.backward()
        torch.manual_seed(seed)
        loss = sbs.compiled(*batch)
        loss.backward(retain_graph=True)
        loss.backward()  # the recomputation runs again from the same saved values and state
        assert_same(loss.detach(), ref.detach(), True, "loss")
        sbs.check_grads("two backwards")
        sbs.model.zero_grad(set_to_none=True)
        sbs.ref_model.zero_grad(set_to_none=True)
    assert recomputed(sbs) > 0


def test_cpu_attention_recomputed_bit_identical(tmp_path):
    """The CPU attention kernel (``_scaled_dot_product_flash_attention_for_cpu``, no formula of its
    own in torch's FLOP registry) is priced by the flash kernel's formula, so its output may be
    recomputed: at the lowest reachable peak the backward runs the forward kernel again (matched
    by its target in the rewritten backward's code), the gradients stay bit-identical, and the
    measured peak stays within the planned one."""
    sbs = SideBySide(
        models.GPTLoss, "eager", budget="35%", strategy="recompute", on_infeasible="warn", dump_dir=str(tmp_path)
    )
    batch = models.gpt_batch()
    for _ in range(2):
        sbs.step(batch)
    (r,) = sbs.reports()
    backward = (Path(r.dump_dir) / "07_insert_recompute.backward.py").read_text()
    assert "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(" in backward
    resident = list(sbs.model.parameters()) + list(batch)
    m = measure_peak_device_bytes(lambda: sbs.trinity_step(batch), resident=resident, device="cpu")
    assert m.peak_bytes <= r.peak_bytes_planned + PEAK_SLACK_BYTES, r.summary()


def test_fits_without_a_plan_rewrites_nothing():
    sbs = SideBySide(models.MLP, "eager", budget="100%")
    sbs.step(models.mlp_batch(512))
    (r,) = sbs.reports()
    assert r.fits_without_plan and r.num_evicted == 0 and r.recompute["num_recomputed"] == 0
    assert "fits without a plan" in r.summary()
    assert dict(r.pass_seconds).get("insert_recompute") is None
    assert "(the budget is at or above the unplanned peak)" in r.summary()
    # From the sixth fresh-user trial: a pair after a graph break (a loss) fits beside what the
    # earlier pair keeps under its plan, not beside what it keeps unplanned; the summary said
    # "the budget is at or above the unplanned peak" beside an unplanned peak above the budget.
    beside = dataclasses.replace(r, budget_bytes=r.peak_bytes_unplanned - 1)
    assert "(the budget is at or above its peak with what the rest of the step holds under their plans)" in (
        beside.summary()
    )
    # A lowest-peak plan (on_infeasible="warn") meets no budget: its exposed copies are its own.
    exposed = dataclasses.replace(r, exposed_transfer_seconds=r.compute_seconds, feasible=False)
    assert "the lowest-peak plan has" in exposed.summary() and "budget is met only" not in exposed.summary()
    assert "the budget is met only with" in dataclasses.replace(exposed, feasible=True).summary()


def test_report_and_dumps_show_the_choice(tmp_path):
    sbs = SideBySide(DropoutMLP, "eager", budget="70%", strategy="auto", dump_dir=str(tmp_path), **SLOW_LINK)
    batch = dropout_batch()
    seeded_step(sbs, batch, 8)
    (r,) = sbs.reports()
    rc = r.recompute
    assert rc["num_recomputed"] > 0 and rc["recompute_seconds"] > 0 and rc["recomputed_bytes"] > 0
    assert rc["strategy"] == "auto" and rc["solver"] in ("highs", "greedy")
    text = r.summary()
    assert "recompute" in text and f"strategy {rc['strategy']}" in text
    # FLOPs where there are some, else it says the recomputation is memory-bound (not "0 GFLOP").
    flops_text = "GFLOP" if rc["recompute_flops"] else "no matmul FLOPs (memory-bound ops, timed by their bytes)"
    assert flops_text in text and "0 GFLOP" not in text, text
    folder = Path(r.dump_dir)
    dump = json.loads((folder / "recompute.json").read_text())
    decided = {d["saved"]: d["decision"] for d in dump["decisions"]}
    assert set(decided.values()) <= {"keep", "offload", "recompute"}
    assert sum(1 for d in decided.values() if d == "recompute") == sum(len(x["saved"]) for x in dump["recomputes"])
    assert dump["recompute_flops"] == sum(x["flops"] for x in dump["recomputes"])
    backward = (folder / "07_insert_recompute.backward.py").read_text()
    assert "recomputed for saved" in backward
    assert ("run_with_rng_state" in backward) == any(x["rng_nodes"] for x in dump["recomputes"])
    report = json.loads((folder / "report.json").read_text())
    assert report["decisions"] and report["recompute"]["num_recomputed"] == rc["num_recomputed"]


def _infeasible_text(strategy, min_offload_bytes):
    """The InfeasibleBudgetError's text for the MLP at 5% (below any plan's lowest peak)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    options = {"memory_budget": "5%", "inner": "eager", "strategy": strategy, "min_offload_bytes": min_offload_bytes}
    f = torch.compile(models.MLP(), backend="trinity", options=options)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        f(*models.mlp_batch(1024))
    inner = getattr(info.value, "inner_exception", None) or info.value.__cause__
    assert isinstance(inner, InfeasibleBudgetError), inner
    return str(inner)


def test_recompute_only_infeasible_budget_advises_what_helps_recomputation():
    """strategy="recompute" never offloads, so min_offload_bytes changes nothing there: the error
    names the lowest budget that runs and offers strategy 'auto' or 'offload' (with a lower
    min_offload_bytes only where it holds back every kept saved activation), not "lower
    min_offload_bytes" alone, nor what offloading would reach (not planned under "recompute")."""
    # The MLP's 8 tanh outputs (512 KiB each at n=1024) and its 2 other saved buffers: 4 of the 10
    # recomputed at the lowest peak (3994248 bytes against 6025352 unplanned: 66.3%), 6 kept.
    for mob in (0, 1 << 20):
        text = _infeasible_text("recompute", mob)
        assert "lowest peak any plan reaches, 3.81 MiB (3994248 bytes; 5.75 MiB without recomputation)" in text
        assert "The lowest budget that runs is memory_budget='66.3%'" in text and "memory_budget=3994248" in text
        assert "strategy='recompute' never offloads" in text
        assert "can be offloaded" not in text and "Offloading cannot" not in text
        assert "lower min_offload_bytes" not in text and "strategy='auto' may also offload" not in text
        assert "Raise memory_budget or pass on_infeasible='warn' to run with the lowest-peak plan." in text
        assert "what that would reach is not planned under strategy='recompute'" in text
        assert "4 of 10 recomputable saved buffers recomputed" in text
    assert "strategy='auto' or strategy='offload' may also offload the 6 saved activations this plan keeps" in (
        _infeasible_text("recompute", 0)
    )
    # The kept tanh outputs (512 KiB) are all below the 1 MiB default: offloading them needs both.
    assert (
        "strategy='auto' or strategy='offload' with min_offload_bytes below 1.00 MiB may also offload the 6 saved "
        "activations this plan keeps on the device" in text
    )
    # The strategies that offload keep their advice: at 1 MiB nothing can be offloaded.
    for strategy in ("auto", "offload"):
        text = _infeasible_text(strategy, 1 << 20)
        assert "No saved activation of at least 1.00 MiB can be offloaded." in text
        assert "Raise memory_budget, lower min_offload_bytes or pass on_infeasible='warn'" in text
        assert "without offloading" in text and "never offloads" not in text


def test_strategy_option_validated_eagerly():
    f = torch.compile(models.MLP(), backend="trinity", options={"inner": "eager", "strategy": "fastest"})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        f(*models.mlp_batch(8))
    inner = getattr(info.value, "inner_exception", None) or info.value.__cause__
    assert isinstance(inner, ValueError)
    assert "'strategy'" in str(inner) and "'fastest'" in str(inner) and "'auto', 'offload', 'recompute'" in str(inner)
    with pytest.raises(ValueError, match="'recompute' is not combined with offload='all'"):
        offload_compiler.TrinityOptions.from_user({"strategy": "recompute", "offload": "all", "inner": "eager"}, env={})
    opts = offload_compiler.TrinityOptions.from_user({}, env={})
    assert opts.strategy == "auto"
    assert offload_compiler.TrinityOptions.from_user({}, env={"TRINITY_STRATEGY": "offload"}).strategy == "offload"


def _frontier_gpt():
    from offload_compiler.models import GPTConfig

    return models.GPTLoss(GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128))


def test_tied_weights_under_inductor_measured_as_planned():
    """A tied embedding's gradient is ``add(mm(dlogits^T, h), embedding_grad)``; Inductor makes it
    an ``addmm`` at the add, at the backward's end, so the logits' gradient and the head's input
    stay allocated through the backward. The plan must count that (liveness's addmm model): the
    first step's measured peak is at most the plan's (within the allocator slack) and within the
    budget. Before the model, recompute-only on this GPT (the frontier benchmark's) measured
    1.28 MB above its plan and 1.16 MB above the budget."""
    sbs = SideBySide(_frontier_gpt, "inductor", budget="75%", strategy="recompute")
    batch = models.gpt_batch(n=16, t=128, vocab=256)
    sbs.step(batch)
    (r,) = sbs.reports()
    assert r.recompute["num_recomputed"] > 0, r.summary()
    assert r.measured_peak_bytes is not None, r.summary()
    assert r.measured_peak_bytes <= r.peak_bytes_planned + PEAK_SLACK_BYTES, r.summary()
    assert r.measured_peak_bytes <= r.budget_bytes + PEAK_SLACK_BYTES, r.summary()
    check_peak(sbs, batch)


class _NormMLPLoss(nn.Module):
    """Linear, LayerNorm, GELU x4, then a scalar head; the loss is the mean square."""

    def __init__(self, width=512, depth=4):
        super().__init__()
        blocks = [nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()) for _ in range(depth)]
        self.body = nn.Sequential(*blocks, nn.Linear(width, 1))

    def forward(self, x):
        return self.body(x).square().mean()


def test_inductor_keeps_recomputed_chains_where_the_plan_put_them():
    """From a fresh-user trial: at 80% `auto` recomputes three LayerNorm/GELU chains. With
    Inductor's own reorder_for_peak_memory on, its scheduler ran all three at the top of the
    backward, and every step measured the unplanned peak (25,243,656 bytes against a
    20,190,009-byte budget; no replan could help). Trinity turns that reordering off. Then the
    first step still measured 22,095,880 bytes: Inductor's C++ backend ran each layer's LayerNorm
    and GELU backward as one kernel function, which held a prefetched 2 MiB input and a 2 MiB
    product to its end (inductor_fixes.py: trinity's CPU compiles now end a kernel function where
    64 KiB or more would be freed). The first step is measured as planned (19,990,540 bytes
    against 19,980,300), within the budget, with no replan."""
    sbs = SideBySide(_NormMLPLoss, "inductor", budget="80%")
    torch.manual_seed(1)
    batch = (torch.randn(1024, 512),)
    sbs.step(batch)
    (r,) = sbs.reports()
    assert r.recompute["num_recomputed"] > 0, r.summary()
    assert r.measured_peak_bytes <= r.budget_bytes + PEAK_SLACK_BYTES, r.summary()
    assert r.measured_peak_bytes <= r.peak_bytes_planned + PEAK_SLACK_BYTES, r.summary()
    assert r.correction is None, r.summary()
    # Its lowest reachable peak is the one with this recomputation (another may reach lower).
    assert "lowest reachable with this recomputation" in r.summary(), r.summary()
    for _ in range(2):
        sbs.step(batch)
    (r,) = sbs.reports()
    assert r.correction is None, r.summary()
    assert r.measured_peak_bytes <= r.budget_bytes + PEAK_SLACK_BYTES, r.summary()
    check_peak(sbs, batch)


class _DropoutBlocks(nn.Module):
    """Embedding, two pre-norm attention blocks (SDPA with dropout, MLP with dropout), head: the
    second fresh-user trial's model, smaller."""

    def __init__(self, d=128, heads=4, vocab=64, p=0.1):
        super().__init__()
        self.emb, self.head, self.p, self.heads = nn.Embedding(vocab, d), nn.Linear(d, vocab), p, heads
        self.blocks = models.attention_blocks(d)

    def forward(self, idx, targets):
        x = self.emb(idx)
        b, t, d = x.shape
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).split(d, dim=-1)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p)
            x = x + blk["proj"](a.transpose(1, 2).reshape(b, t, d))
            x = x + blk["fc2"](F.dropout(F.gelu(blk["fc"](blk["ln2"](x))), self.p))
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def test_dropout_backward_mask_is_planned_from_the_first_step():
    """From the second fresh-user trial: ``native_dropout_backward`` (inner="eager") converts its
    bool mask to the gradient's dtype before the product, a tensor of the gradient's size that
    the plan did not count: the first step at every new size (dynamic shapes) measured above the
    budget (83.87 MiB against 81.47 MiB at 75%) until the runtime check's replan. The workspace
    table counts it now: the first step is within the budget, no correction."""
    sbs = SideBySide(_DropoutBlocks, "eager", budget="75%", strategy="auto")
    batch = (torch.randint(0, 64, (8, 128)), torch.randint(0, 64, (8, 128)))
    seeded_step(sbs, batch, 2)
    (r,) = sbs.reports()
    assert r.measured_peak_bytes is not None, r.summary()
    assert r.correction is None, r.summary()
    assert r.measured_peak_bytes <= r.budget_bytes + PEAK_SLACK_BYTES, r.summary()


def test_the_percentage_a_recompute_refusal_names_runs():
    """From the third fresh-user trial: under strategy="recompute" the attention blocks' refusal
    at 25% named the lowest-peak choice's percentage (66%), and passed back it was refused again
    (the three best-scored candidates' estimated peaks were within it and their rewrites' 7 KB
    above). The planner now tries the lowest-peak choice exactly as well before refusing: the
    named percentage runs, within its budget, bit-equal to eager."""
    batch = (torch.randint(0, 64, (8, 128)), torch.randint(0, 64, (8, 128)))

    def refusal():
        sbs = SideBySide(_DropoutBlocks, "eager", budget="25%", strategy="recompute")
        with pytest.raises(Exception) as info:
            seeded_step(sbs, batch, 1)
        inner = getattr(info.value, "inner_exception", info.value)
        assert isinstance(inner, InfeasibleBudgetError), inner
        return str(inner)

    named = re.search(r"memory_budget='([0-9.]+%)'", refusal()).group(1)
    torch._dynamo.reset()
    sbs = SideBySide(_DropoutBlocks, "eager", budget=named, strategy="recompute")
    for seed in (1, 2):
        seeded_step(sbs, batch, seed)
    (r,) = sbs.reports()
    assert r.feasible and r.recompute["num_recomputed"] > 0 and r.num_evicted == 0, r.summary()
    check_peak(sbs, batch)


def test_a_busy_machine_gets_the_same_plan():
    """The solver's time limits count its thread's CPU time (``plan_recompute.solver_clock``), not
    wall time: with more busy processes than cores beside the compile, the attention blocks'
    recompute refusal is word for word the one an idle machine gives. A CI run at 460c0e0 with
    tests running beside it failed test_the_percentage_a_recompute_refusal_names_runs: the
    lowest-peak program (0.19 s of CPU, its optimum found at 0.19 s) took 0.49 s of wall time
    with three busy processes, near the 0.5 s wall-clock limit that stopped it at an earlier
    incumbent. Here the limit is 1.0 s and six busy processes per core run beside it: the old
    wall-clock limit stops at that incumbent (about 1.2 s of wall time), while the CPU-time limit
    leaves 5x room for what contention adds to the solver's CPU time (with a 0.3 s limit and
    two more busy processes than cores, a CI run at b5d6cde with the other test worker beside
    it stopped there too)."""
    batch = (torch.randint(0, 64, (8, 128)), torch.randint(0, 64, (8, 128)))

    def refusal() -> str:
        torch._dynamo.reset()
        sbs = SideBySide(_DropoutBlocks, "eager", budget="25%", strategy="recompute", solver_time_limit=1.0)
        with pytest.raises(Exception) as info:
            seeded_step(sbs, batch, 1)
        inner = getattr(info.value, "inner_exception", info.value)
        assert isinstance(inner, InfeasibleBudgetError), inner
        return str(inner)

    idle = refusal()
    busy_count = 6 * len(os.sched_getaffinity(0))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy_count)]
    try:
        loaded = refusal()
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert re.search(r"memory_budget='([0-9.]+%)'", idle), idle
    assert loaded == idle
