"""The joint keep/offload/recompute planner, its chains and its rewrite, on hand-built graphs.

The main graph is a GELU MLP (4 layers, width 32, batch 64, fp32): per layer the partitioner
saves the matmul output ``mm_i`` (for ``gelu_backward``) and the GELU output's transpose ``t_*``
(for the next weight's gradient), 8 KiB each. The GELU output's chain is one pointwise op on the
saved matmul output (cheap); a matmul output's chain is the matmul itself (expensive).

Two device figures make the choice clear-cut:

* ``SLOW_LINK``: 1 MB/s each way, so an 8 KiB copy takes 8 ms against ~2 ms of compute: copies
  would be exposed, recomputing GELU costs microseconds;
* ``SLOW_COMPUTE``: 1 MFLOP/s, so a 64x32x32 matmul takes 0.13 s, and a terabyte-per-second link
  hides every copy.
"""

import operator
import time

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from offload_compiler.graph_pair import GraphPair
from offload_compiler.passes import cost_model, insert_recompute, liveness, plan_recompute, recompute_chains

from ._pass_helpers import analyze, run_pair, spec
from .graphs import capture_pair

SLOW_LINK = spec(h2d_bytes_per_s=1e6, d2h_bytes_per_s=1e6)
SLOW_COMPUTE = spec(flops_fp32=1e6, hbm_bytes_per_s=1e12, h2d_bytes_per_s=1e12, d2h_bytes_per_s=1e12)
D, N, L = 32, 64, 4


def gelu_mlp(*args):
    *ws, h = args
    for w in ws:
        h = F.gelu(h @ w)
    return h.sum()


def gelu_mlp_inputs():
    torch.manual_seed(0)
    return [torch.randn(D, D) * 0.3 for _ in range(L)] + [torch.randn(N, D)]


@pytest.fixture(scope="module")
def mlp():
    inputs = gelu_mlp_inputs()
    ws = [w.clone().requires_grad_(True) for w in inputs[:-1]]
    return capture_pair(gelu_mlp, *ws, inputs[-1], static=tuple(range(L)))


def saved_by_name(live):
    return {s.fw_node: s for s in live.saved}


def decisions(joint) -> dict[str, str]:
    return {name: d for name, _b, d in plan_recompute.decisions(joint)}


# ---------------------------------------------------------------------------- chains
def test_chains_of_the_gelu_mlp(mlp):
    live, costs = analyze(mlp, SLOW_LINK)
    chains = {
        tuple(live.saved[i].fw_node for i in c.saved): c for c in recompute_chains.analyze(mlp, live, costs).chains
    }
    # Every saved activation buffer has a chain: 4 matmul outputs, 3 GELU outputs (the last
    # layer's GELU output is not saved: only sum reads it).
    assert len(chains) == 7
    gelu = chains[("t_4",)]
    assert gelu.nodes == ("gelu", "t_4")
    assert [(leaf.fw_node, leaf.kind, leaf.bw_node) for leaf in gelu.leaves] == [("mm", "saved", "mm")]
    assert gelu.depends_on == (live.saved[saved_by_name(live)["mm"].index].buffer,)
    # Its seconds are the cost model's for those nodes; GELU has no FLOP formula.
    steps = [live.step_named("forward", n) for n in gelu.nodes]
    assert gelu.seconds == pytest.approx(sum(costs.step_seconds[s] for s in steps), rel=1e-12)
    # GELU has no FLOP formula; its output is the buffer itself (t_4 is a view of it).
    assert gelu.flops == 0 and gelu.transient_bytes == 0
    mm1 = chains[("mm_1",)]
    assert mm1.nodes == ("gelu", "mm_1")
    kinds = {leaf.fw_node: (leaf.kind, leaf.bw_node) for leaf in mm1.leaves}
    # With the parameters as static inputs the partitioner saves the weight itself (not a view of
    # it), so the chain reads it as a saved value.
    assert kinds == {"mm": ("saved", "mm"), "primals_2": ("saved", "primals_2")}
    # The first layer's weight is not saved (the input needs no gradient), nor is the input
    # (its transpose is): both are new saved values of the first matmul's chain.
    mm0 = chains[("mm",)]
    assert mm0.nodes == ("mm",)
    kinds = {leaf.fw_node: (leaf.kind, leaf.bw_node) for leaf in mm0.leaves}
    assert kinds == {"primals_1": ("parameter", None), "primals_5": ("input", None)}
    assert mm1.flops == 2 * N * D * D
    assert mm1.transient_bytes == N * D * 4  # the GELU output the matmul reads
    assert mm1.recompute_before == live.buffers[mm1.buffer].first_bw_use


def test_random_ops_are_recomputed_only_with_their_state_replayed():
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)
    pair = capture_pair(lambda w, x: F.dropout(torch.tanh(x @ w), 0.5, True).sum(), w, torch.randn(8, 16), static=(0,))
    live, costs = analyze(pair)
    mask = live.saved[[s.fw_node for s in live.saved].index("getitem_1")].buffer
    refused = dict(recompute_chains.analyze(pair, live, costs, rng_replay=False).refused)
    assert "random" in refused[mask] and "native_dropout" in refused[mask]
    chain = recompute_chains.analyze(pair, live, costs, rng_replay=True).by_buffer()[mask]
    assert chain.rng_nodes == ("native_dropout",)
    assert ("native_dropout_rng_state", "rng state") in [(leaf.fw_node, leaf.kind) for leaf in chain.leaves]


def _one_node_graph(target, args_vals, build_args):
    g = fx.Graph()
    phs = []
    for i, v in enumerate(args_vals):
        ph = g.placeholder(f"x{i}")
        ph.meta["val"] = v
        phs.append(ph)
    node = g.call_function(target, build_args(phs))
    node.meta["val"] = torch.empty(2)
    g.output(node)
    return node


@pytest.mark.parametrize(
    "target, build, expected",
    [
        (torch.ops.aten.add_.Tensor, lambda p: (p[0], p[1]), "mutates"),
        (torch.ops.aten._assert_scalar.default, lambda p: (True, "msg"), "side effects"),
        (torch.ops.aten.sort.default, lambda p: (p[0],), "no known cost"),
        (torch.ops.aten.bernoulli.default, lambda p: (p[0],), "random"),
    ],
)
def test_ops_that_are_never_recomputed(target, build, expected):
    node = _one_node_graph(target, [torch.empty(2), torch.empty(2)], build)
    why = recompute_chains.refusal(node, rng_replay=False)
    assert why is not None and expected in why, why
    if expected == "random":  # recomputed once its generator state is replayed
        assert recompute_chains.refusal(node, rng_replay=True) is None


def test_collectives_are_never_recomputed():
    pytest.importorskip("torch.distributed")
    if not hasattr(torch.ops, "_c10d_functional") or not hasattr(torch.ops._c10d_functional, "all_reduce"):
        pytest.skip("no functional collectives in this torch")
    node = _one_node_graph(
        torch.ops._c10d_functional.all_reduce.default, [torch.empty(2)], lambda p: (p[0], "sum", "0")
    )
    why = recompute_chains.refusal(node, rng_replay=True)
    assert why is not None and "collective" in why


def test_known_recomputable_ops():
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 4)
    for target, args in (
        (torch.ops.aten.mm.default, (x, x)),  # FLOP formula
        (torch.ops.aten.gelu.default, (x,)),  # pointwise
        (torch.ops.aten.t.default, (x,)),  # a view
        (torch.ops.aten._log_softmax.default, (x, 1, False)),  # listed memory-bound op
        # listed too, found refused in transformers models (fresh-user trials, a scan)
        (torch.ops.aten._safe_softmax.default, (x, 1)),
        (torch.ops.aten.fill.Tensor, (x, x)),
        (torch.ops.aten.cumsum.default, (x, 1)),
        (torch.ops.aten.lift_fresh_copy.default, (x,)),
        # torch registers no formula for the CPU attention kernel; the flash kernel's counts it,
        # as in the cost model (dropout_p=0: deterministic)
        (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (x, x, x, 0.0, True)),
    ):
        n = g.call_function(target, args)
        n.meta["val"] = torch.empty(4, 4)
        assert recompute_chains.refusal(n, rng_replay=False) is None, target


def test_attention_probabilities_under_dropout_have_a_chain():
    """From the fifth fresh-user trial: SDPA with ``dropout_p > 0`` takes the math path, whose
    softmax is ``aten._safe_softmax``; it was refused as 'no known cost', so the attention
    probabilities and everything past them (16 saved buffers in a 4-block GPT) could only be kept
    or offloaded. It is priced as a memory-bound op now, and the dropped-out probabilities are
    recomputed from their saved RNG state."""

    def attn(w, x):
        q, k, v = (x @ w).view(2, 16, 3, 2, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.5)
        return y.sum()

    torch.manual_seed(0)
    w = (torch.randn(16, 48) * 0.3).requires_grad_(True)
    pair = capture_pair(attn, w, torch.randn(2, 16, 16), static=(0,))
    assert any(n.target is torch.ops.aten._safe_softmax.default for n in pair.forward.graph.nodes)
    live, costs = analyze(pair)
    analysis = recompute_chains.analyze(pair, live, costs, rng_replay=True)
    assert not [why for _b, why in analysis.refused if "_safe_softmax" in why], analysis.refused
    through = [c for c in analysis.chains if any(n.startswith("_safe_softmax") for n in c.nodes)]
    assert through, [c.nodes for c in analysis.chains]
    assert any(c.rng_nodes for c in through), "the dropout on the probabilities is not replayed"


def test_every_saved_activation_of_a_llama_traced_for_inductor_has_a_chain():
    """Under Inductor's decompositions the rotary positions are ``prims.iota`` (``arange``
    decomposed); it is priced as a memory-bound op, so the rotated q/k can be recomputed (they
    were refused as 'no known cost', which held the Llama preset's per-block checkpoint peak
    out of recompute's reach)."""
    from offload_compiler.models import Llama, LlamaConfig
    from offload_compiler.pipeline import prepare
    from offload_compiler.trace import trace_training_step

    cfg = LlamaConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64, max_seq_len=16)
    traced = trace_training_step(lambda: Llama(cfg), 2, 16, 64, inner="inductor")
    pair = traced.pair
    prepare(pair, "inductor")
    assert any(n.target is torch.ops.prims.iota.default for n in pair.forward.graph.nodes)
    live = liveness.analyze(pair, assume_fusion=True)
    costs = cost_model.estimate(pair, live, spec())
    analysis = recompute_chains.analyze(pair, live, costs)
    assert analysis.refused == ()
    through_iota = [c for c in analysis.chains if any(n.startswith("iota") for n in c.nodes)]
    assert through_iota, "no chain recomputes the rotary positions"
    saved = {b.id for b in live.buffers if b.kind is liveness.BufferKind.SAVED and b.on_device and b.saved}
    assert {c.buffer for c in analysis.chains} == {b for b in saved if live.buffers[b].first_bw_use is not None}


def test_a_chain_read_by_its_own_kernel_is_pinned_under_inductor():
    """The final layer norm's output, recomputed right before the head's weight-gradient ``mm``,
    shares its normalised input with that layer norm's backward a few kernels later; Inductor
    would fuse the two and run the chain (and the ``mm``) late. With ``pin`` a fence right
    before the ``mm`` declares a write on the normalised input, which every later reader then
    follows (the tied-GPT e2e test measures the difference: 785 KB above the plan without it)."""
    from offload_compiler.ir.ops import FENCE
    from offload_compiler.models import GPT, GPTConfig
    from offload_compiler.pipeline import prepare
    from offload_compiler.trace import trace_training_step

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    fences = {}
    for pin in (False, True):
        pair = trace_training_step(lambda: GPT(cfg), 2, 16, 64, inner="inductor").pair
        prepare(pair, "inductor")
        live = liveness.analyze(pair, assume_fusion=True)
        costs = cost_model.estimate(pair, live, spec())
        chains = recompute_chains.analyze(pair, live, costs).chains
        counts = insert_recompute.apply(pair, live, chains, pin=pin)
        # (the addmm split's fences have no hosts)
        fences[pin] = [n for n in pair.backward.graph.nodes if n.target is FENCE and n.args[0]]
        assert counts["pins"] == len(fences[pin])
    assert fences[False] == []
    assert any(f.next.target is torch.ops.aten.mm.default for f in fences[True]), fences[True]
    for f in fences[True]:
        hosts, out = f.args
        reader = f.next
        # its own kernel (mm, addmm, attention), nothing the chain fuses into
        assert reader.op == "call_function" and not liveness.inlining_reader(reader, "cpu"), reader.format_node()
        assert out.meta.get(insert_recompute.RECOMPUTE_KEY) is not None
        order = {n: i for i, n in enumerate(f.graph.nodes)}
        for h in hosts:
            later = [u for u in h.users if order[u] > order[f]]
            assert later, f"{h.name} is declared written but nothing after the fence reads it"
            assert h.op == "placeholder" or insert_recompute.RECOMPUTE_KEY in h.meta


# ---------------------------------------------------------------------------- the planner
def test_cheap_elementwise_chain_is_recomputed_not_offloaded_when_copies_would_be_exposed(mlp):
    live, costs = analyze(mlp, SLOW_LINK)
    budget = int(0.9 * live.peak_bytes)
    offload_only = plan_recompute.plan_joint(mlp, live, costs, budget, "offload", 0)
    assert offload_only.plan.feasible and offload_only.plan.exposed_transfer_seconds > 0  # copies would be exposed
    joint = plan_recompute.plan_joint(mlp, live, costs, budget, "auto", 0)
    assert joint.plan.feasible and joint.plan.peak_bytes_planned <= budget
    got = decisions(joint)
    recomputed = {n for n, d in got.items() if d == "recompute"}
    assert recomputed and recomputed <= {"t", "t_2", "t_4"}, got  # GELU outputs, not matmuls
    assert "offload" not in got.values(), got
    assert joint.plan.exposed_transfer_seconds == 0.0
    assert joint.plan.predicted_step_seconds < offload_only.plan.predicted_step_seconds
    # The recomputation is in the predicted step: compute grew by exactly the chains' seconds.
    rc = joint.recompute
    assert rc.recompute_seconds == pytest.approx(sum(r.seconds for r in rc.recomputes))
    assert joint.plan.compute_seconds == pytest.approx(costs.compute_seconds + rc.recompute_seconds, rel=1e-9)


def test_matmul_output_is_offloaded_not_recomputed_when_its_copy_hides(mlp):
    live, costs = analyze(mlp, SLOW_COMPUTE)
    budget = int(0.75 * live.peak_bytes)
    joint = plan_recompute.plan_joint(mlp, live, costs, budget, "auto", 0)
    assert joint.plan.feasible and joint.plan.peak_bytes_planned <= budget
    got = decisions(joint)
    matmuls = {"mm", "mm_1", "mm_2", "mm_3"}
    assert any(got[m] == "offload" for m in matmuls), got
    assert not any(got[m] == "recompute" for m in matmuls), got
    assert joint.plan.exposed_transfer_seconds == 0.0  # the copies hide
    assert joint.plan.predicted_step_seconds == pytest.approx(costs.compute_seconds, rel=1e-9)


def test_synchronous_copies_are_charged_in_full_so_recompute_wins(mlp):
    """Where the device is the host CPU, copies are memcpys on the compute cores: the same
    offload that hides on an asynchronous link costs its whole copy time, and ``auto`` then
    recomputes instead (the CPU frontier measures the same)."""
    figures = dict(flops_fp32=1e8, hbm_bytes_per_s=1e9, h2d_bytes_per_s=1e7, d2h_bytes_per_s=1e7)
    plans = {}
    for sync in (False, True):
        live, costs = analyze(mlp, spec(**figures, host_is_device=sync))
        assert costs.synchronous_copies is sync
        budget = int(0.75 * live.peak_bytes)
        plans[sync] = {s: plan_recompute.plan_joint(mlp, live, costs, budget, s, 0) for s in ("auto", "offload")}
    async_auto, sync_auto, sync_off = plans[False]["auto"], plans[True]["auto"], plans[True]["offload"]
    assert "offload" in decisions(async_auto).values() and async_auto.plan.exposed_transfer_seconds == 0.0
    # Offload only, synchronous: every copy's seconds are exposed.
    copy_bytes = sum(g.copy_bytes for ev in sync_off.plan.evictions for g in ev.groups)
    assert copy_bytes > 0
    assert sync_off.plan.exposed_transfer_seconds == pytest.approx(2 * copy_bytes / 1e7, rel=1e-9)
    assert sync_off.plan.predicted_step_seconds == pytest.approx(
        sync_off.costs.compute_seconds + 2 * copy_bytes / 1e7, rel=1e-9
    )
    assert "offload" not in decisions(sync_auto).values() and "recompute" in decisions(sync_auto).values()
    assert sync_auto.plan.feasible and sync_auto.plan.predicted_step_seconds < sync_off.plan.predicted_step_seconds


@pytest.mark.parametrize("budget", ["none", "peak", "above"])
def test_budget_at_or_above_the_unplanned_peak_gives_an_empty_plan(mlp, budget):
    live, costs = analyze(mlp, SLOW_LINK)
    b = {"none": None, "peak": live.peak_bytes, "above": live.peak_bytes + 1}[budget]
    nodes_before = [(n.name, n.target) for gm in (mlp.forward, mlp.backward) for n in gm.graph.nodes]
    joint = plan_recompute.plan_joint(mlp, live, costs, b, "auto", 0)
    rp = joint.recompute
    assert rp.fits_without_plan and rp.chosen == "none" and rp.note == "fits without a plan"
    assert rp.recomputes == () and joint.chains == () and joint.plan.evictions == ()
    assert rp.solver == "none" and rp.num_recomputable == 0  # nothing was even analysed
    assert joint.liveness is live and joint.plan.peak_bytes_planned == live.peak_bytes
    assert set(d for _n, _b, d in plan_recompute.decisions(joint)) == {"keep"}
    assert [(n.name, n.target) for gm in (mlp.forward, mlp.backward) for n in gm.graph.nodes] == nodes_before


@pytest.mark.parametrize("device", [SLOW_LINK, SLOW_COMPUTE])
@pytest.mark.parametrize("fraction", [0.9, 0.75, 0.6])
def test_auto_is_at_least_as_fast_as_either_single_strategy(mlp, device, fraction):
    live, costs = analyze(mlp, device)
    budget = int(fraction * live.peak_bytes)
    plans = {s: plan_recompute.plan_joint(mlp, live, costs, budget, s, 0).plan for s in plan_recompute.STRATEGIES}
    assert plans["offload"].evictions or not plans["offload"].feasible
    assert not plans["recompute"].evictions
    feasible = [plans[s].predicted_step_seconds for s in ("offload", "recompute") if plans[s].feasible]
    if feasible:
        assert plans["auto"].feasible
        assert plans["auto"].predicted_step_seconds <= min(feasible) * (1 + 1e-9)
    for p in plans.values():
        assert not p.feasible or p.peak_bytes_planned <= budget


def test_the_final_plan_is_exact_on_the_rewritten_graphs(mlp):
    """The planned peak is what liveness measures on the graphs with the recomputation applied
    (the verifier checks the same on the real graphs)."""
    live, costs = analyze(mlp, SLOW_LINK)
    joint = plan_recompute.plan_joint(mlp, live, costs, int(0.75 * live.peak_bytes), "auto", 0)
    assert joint.chains
    copy = insert_recompute.copy_pair(mlp)
    insert_recompute.apply(copy, live, joint.chains)
    again = liveness.analyze(copy)
    from offload_compiler.passes import plan_window

    assert int(plan_window.planned_live_bytes(again, joint.plan.evictions).max()) == joint.plan.peak_bytes_planned
    assert joint.rewritten_names == (
        tuple(n.name for n in copy.forward.graph.nodes),
        tuple(n.name for n in copy.backward.graph.nodes),
    )


def test_greedy_fallback_without_the_solver(mlp, monkeypatch):
    live, costs = analyze(mlp, SLOW_LINK)
    budget = int(0.75 * live.peak_bytes)
    forced = plan_recompute.plan_joint(mlp, live, costs, budget, "auto", 0, use_solver=False)
    assert forced.recompute.solver == "greedy" and forced.recompute.fallback_used
    assert forced.recompute.solver_status == "solver off"
    assert forced.plan.feasible and forced.recompute.recomputes
    monkeypatch.setattr(plan_recompute, "have_solver", lambda: False)
    missing = plan_recompute.plan_joint(mlp, live, costs, budget, "auto", 0)
    assert missing.recompute.solver == "greedy" and missing.recompute.fallback_used
    assert missing.recompute.solver_status == "highspy is not installed"
    assert missing.plan.feasible


def test_the_planners_cpu_seconds_are_reported(mlp):
    """``plan_cpu_seconds`` is the compiling thread's CPU time over the joint planner: more than
    nothing, at most its wall time (one thread), and in the report's summary."""
    live, costs = analyze(mlp, SLOW_LINK)
    rp = plan_recompute.plan_joint(mlp, live, costs, int(0.75 * live.peak_bytes), "auto", 0, use_solver=False).recompute
    assert 0.0 < rp.plan_cpu_seconds <= rp.plan_seconds + 0.02, (rp.plan_cpu_seconds, rp.plan_seconds)
    assert plan_recompute.summary(rp)["plan_cpu_seconds"] == rp.plan_cpu_seconds


@pytest.mark.skipif(not plan_recompute.have_solver(), reason="highspy is not installed")
def test_solver_used_and_bounded_by_its_time_limit(mlp):
    live, costs = analyze(mlp, SLOW_LINK)
    joint = plan_recompute.plan_joint(mlp, live, costs, int(0.75 * live.peak_bytes), "auto", 0, time_limit_s=0.2)
    rp = joint.recompute
    assert rp.solver == "highs" and not rp.fallback_used, rp.solver_status
    assert "Optimal" in rp.solver_status or "Time limit" in rp.solver_status
    assert rp.solver_seconds < 2.0  # two solves, each under the limit left (plus model building)


def _record_solves(monkeypatch):
    """``(limits, took)``: each solve's time limit and the solver seconds it took
    (:func:`~offload_compiler.passes.plan_recompute.solver_clock`, the clock of the limits), in
    call order."""
    limits, took = [], []
    solve = plan_recompute._Model.solve

    def recording(self, time_limit, hard_limit=None, mip_start=None):
        limits.append(time_limit)
        t0 = plan_recompute.solver_clock()
        try:
            return solve(self, time_limit, hard_limit, mip_start)
        finally:
            took.append(plan_recompute.solver_clock() - t0)

    monkeypatch.setattr(plan_recompute._Model, "solve", recording)
    return limits, took


@pytest.mark.skipif(not plan_recompute.have_solver(), reason="highspy is not installed")
def test_solver_time_limit_option_reaches_the_solver(mlp, monkeypatch):
    """The backend's ``solver_time_limit`` (and ``plan --solver-time-limit``, the same spine) is
    the joint planner's limit: the recompute-only program gets at most a quarter of it, the joint
    one what the first program's solve left."""
    from offload_compiler import pipeline
    from offload_compiler.options import TrinityOptions

    limits, took = _record_solves(monkeypatch)
    for limit in (0.5, 8.0):
        limits.clear()
        took.clear()
        opts = TrinityOptions.from_user(
            {"memory_budget": "75%", "inner": "eager", "min_offload_bytes": 0, "solver_time_limit": limit}, env={}
        )
        plan = pipeline.plan_pair(mlp, opts, spec=SLOW_LINK)
        assert plan.joint.recompute.solver == "highs"
        assert 0.25 * limit - 0.05 < limits[0] <= 0.25 * limit, limits
        # (A first solve past its share, stopped at its first incumbent: what it took is what is left.)
        assert limits[1] == pytest.approx(max(0.05, limit - took[0]), abs=0.02), (limits, took)


@pytest.mark.skipif(not plan_recompute.have_solver(), reason="highspy is not installed")
def test_joint_program_share_counts_from_its_own_start(mlp, monkeypatch):
    """A pause before the joint program (building it, the host's other work, a garbage collection
    in a large process) does not cut its search short: its share of the limit (what the first
    program's solve left) counts from its own start. (It once counted from the first program's
    start: in the GPU frontier run such a pause stopped the Llama preset's joint program at an
    earlier incumbent.)"""
    limits, took = _record_solves(monkeypatch)
    build = plan_recompute._build_model

    def slow_joint(live, costs, offs, chains, budget, use_offload, *args, **kwargs):
        if use_offload:
            time.sleep(0.3)
        return build(live, costs, offs, chains, budget, use_offload, *args, **kwargs)

    monkeypatch.setattr(plan_recompute, "_build_model", slow_joint)
    live, costs = analyze(mlp, SLOW_LINK)
    joint = plan_recompute.plan_joint(mlp, live, costs, int(0.75 * live.peak_bytes), "auto", 0, time_limit_s=0.5)
    assert joint.recompute.solver == "highs", joint.recompute.solver_status
    assert 0.075 < limits[0] <= 0.125, limits
    # The 0.3 s pause is not taken off the joint program's share (it once was: 0.5 - 0.3 - took).
    assert limits[1] == pytest.approx(max(0.05, 0.5 - took[0]), abs=0.02), (limits, took)


@pytest.mark.skipif(not plan_recompute.have_solver(), reason="highspy is not installed")
def test_joint_programs_earlier_incumbents_are_scored(mlp, monkeypatch):
    """The program's objective approximates the simulator's step, so the incumbent HiGHS found
    before its last is scored too (with offloading free), and the best scored plan wins: a
    longer search never gives a worse plan than a shorter one that stopped at that incumbent."""
    counts = []
    solve = plan_recompute._Model.solve

    def recording(self, *args, **kwargs):
        out = solve(self, *args, **kwargs)
        counts.append(len(self.incumbents))
        return out

    monkeypatch.setattr(plan_recompute._Model, "solve", recording)
    live, costs = analyze(mlp, SLOW_LINK)
    joint = plan_recompute.plan_joint(mlp, live, costs, int(0.9 * live.peak_bytes), "auto", 0)
    if counts[-1] < 2:
        pytest.skip(f"this HiGHS found one incumbent for the joint program ({counts})")
    scored = {name: (step, feasible) for name, _n, step, _peak, feasible in joint.recompute.scored}
    assert "solver's incumbent 1 before its last, offload free" in scored, scored
    assert sum("incumbent" in name for name in scored) <= plan_recompute._EARLIER_INCUMBENTS
    best = min(step for step, feasible in scored.values() if feasible)
    assert scored[joint.recompute.chosen] == (best, True), (joint.recompute.chosen, scored)


@pytest.mark.skipif(not plan_recompute.have_solver(), reason="highspy is not installed")
def test_solver_bound_is_reported_and_below_the_plans_cost(mlp):
    """The joint program's proven lower bound (HiGHS's dual bound, in seconds): solved to
    optimality it is at most the winning plan's recomputation and exposed copy time (up to the
    program's approximation of the simulator) and at least 0; with nothing to plan there is none."""
    live, costs = analyze(mlp, SLOW_LINK)
    joint = plan_recompute.plan_joint(mlp, live, costs, int(0.75 * live.peak_bytes), "auto", 0, time_limit_s=30)
    rp = joint.recompute
    assert "solver: Optimal" in rp.solver_status, rp.solver_status
    overhead = joint.plan.predicted_step_seconds - costs.compute_seconds
    assert rp.solver_bound_seconds is not None and 0.0 <= rp.solver_bound_seconds <= 1.25 * overhead + 1e-9
    assert plan_recompute.summary(rp)["solver_bound_seconds"] == rp.solver_bound_seconds
    fits = plan_recompute.plan_joint(mlp, live, costs, live.peak_bytes, "auto", 0)
    assert fits.recompute.solver_bound_seconds is None


def test_unknown_strategy_is_refused(mlp):
    live, costs = analyze(mlp)
    with pytest.raises(ValueError, match="unknown strategy 'fast'.*auto, offload, recompute"):
        plan_recompute.plan_joint(mlp, live, costs, 1, "fast", 0)


def test_recompute_view_of_one_chain_matches_the_rewritten_liveness(mlp):
    """For a chain whose leaves stay live anyway, the view (stage 2) is the rewritten graph's
    liveness step for step, up to where the recomputation sits: the view counts its
    intermediates and its output at the reader's step, the graph one node earlier."""
    live, costs = analyze(mlp, SLOW_LINK)
    analysis = recompute_chains.analyze(mlp, live, costs)
    chain = next(c for c in analysis.chains if [live.saved[i].fw_node for i in c.saved] == ["t_2"])
    view, vcosts = plan_recompute.recompute_view(live, costs, analysis.by_buffer(), {chain.buffer})
    copy = insert_recompute.copy_pair(mlp)
    insert_recompute.apply(copy, live, [chain])
    exact = liveness.analyze(copy)
    assert exact.peak_bytes <= view.peak_bytes  # the view never under-counts
    assert vcosts.compute_seconds == pytest.approx(costs.compute_seconds + chain.seconds, rel=1e-12)
    # Forward: identical (the buffer is freed after its last forward reader in both).
    F_ = live.num_fw_steps
    assert list(view.live_bytes()[: F_ - 1]) == list(exact.live_bytes()[: F_ - 1])


# ---------------------------------------------------------------------------- the rewrite
def dropout_ln_mlp(w1, w2, lw, x):
    h = F.layer_norm(x @ w1, (w1.shape[1],), lw)
    h = F.dropout(F.gelu(h), 0.3, training=True)
    return torch.tanh(h @ w2).sum()


def test_rewrite_is_bit_identical_with_random_ops_replayed():
    torch.manual_seed(0)
    w1, w2, lw, x = torch.randn(16, 32), torch.randn(32, 16), torch.randn(32), torch.randn(8, 16)
    params = [t.clone().requires_grad_(True) for t in (w1, w2, lw)]
    pair = capture_pair(dropout_ln_mlp, *params, x, static=(0, 1, 2))
    live, costs = analyze(pair)
    analysis = recompute_chains.analyze(pair, live, costs, rng_replay=True)
    assert any(c.rng_nodes for c in analysis.chains)
    torch.manual_seed(7)
    _, _, ref = run_pair(pair, [w1, w2, lw, x])
    copy = insert_recompute.copy_pair(pair)
    counts = insert_recompute.apply(copy, live, analysis.chains)
    assert counts["recomputed_buffers"] == len(analysis.chains) and counts["rng_replays"] == 1
    fw = fx.GraphModule(pair.forward, copy.forward.graph)
    bw = fx.GraphModule(pair.backward, copy.backward.graph)
    rewritten = GraphPair(fw, bw, pair.num_fwd_outputs, pair.static_input_indices)
    torch.manual_seed(7)
    _, _, got = run_pair(rewritten, [w1, w2, lw, x])
    for a, b in zip(ref, got):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)
    # Bookkeeping AOTAutograd relies on: every saved value has its placeholder (by name), the
    # output descriptors stay aligned, recomputed nodes are marked.
    links = rewritten.saved_links()
    assert links and all(link.bw_placeholder is not None for link in links)
    out = rewritten.fw_output_node()
    if out.meta.get("desc"):
        assert len(out.meta["desc"]) == len(rewritten.fw_outputs())
        saved_descs = out.meta["desc"][pair.num_fwd_outputs :]
        assert [d.idx for d in saved_descs] == list(range(len(saved_descs)))
    marked = [n for n in bw.graph.nodes if insert_recompute.RECOMPUTE_KEY in n.meta]
    assert marked and all(n.op == "call_function" for n in marked)
    replay = [n for n in marked if n.target is torch._prims.rng_prims.run_with_rng_state]
    assert len(replay) == 1 and replay[0].args[0].name == "native_dropout_rng_state"
    states = [n for n in fw.graph.nodes if n.target is operator.getitem and n.name == "native_dropout_rng_state"]
    assert len(states) == 1 and states[0] in rewritten.fw_outputs()


def test_liveness_of_the_recomputed_graphs(mlp):
    """After the rewrite the forward frees the buffer after its last forward reader (it is no
    longer saved) and the backward holds a fresh temporary from the recomputation to the last
    reader; the verifier accepts the rewritten pair and re-measures the same peak."""
    from offload_compiler.passes import verify

    live, costs = analyze(mlp, SLOW_LINK)
    analysis = recompute_chains.analyze(mlp, live, costs)
    chain = next(c for c in analysis.chains if [live.saved[i].fw_node for i in c.saved] == ["t_2"])
    copy = insert_recompute.copy_pair(mlp)
    insert_recompute.apply(copy, live, [chain])
    after = liveness.analyze(copy)
    F_ = after.num_fw_steps
    assert "t_2" not in {s.fw_node for s in after.saved}
    fw_buf = next(b for b in after.buffers if "forward:gelu_1" in b.nodes)
    assert fw_buf.kind is liveness.BufferKind.TEMPORARY and fw_buf.last_step < F_
    marked = [n.name for n in copy.backward.graph.nodes if insert_recompute.RECOMPUTE_KEY in n.meta]
    assert len(marked) == len(chain.nodes)
    bw_buf = next(b for b in after.buffers if f"backward:{marked[0]}" in b.nodes)
    assert bw_buf.kind is liveness.BufferKind.TEMPORARY and bw_buf.def_step >= F_
    assert bw_buf.size_bytes == chain.size_bytes
    # The backward's readers of the old saved view now read the recomputed one.
    reader_steps = [s for s in bw_buf.use_steps if s > bw_buf.def_step]
    assert reader_steps and max(reader_steps) == bw_buf.last_step
    rewritten = GraphPair(
        fx.GraphModule(mlp.forward, copy.forward.graph),
        fx.GraphModule(mlp.backward, copy.backward.graph),
        mlp.num_fwd_outputs,
        mlp.static_input_indices,
    )
    assert verify.verify(rewritten, None, expected_peak_bytes=after.peak_bytes) == after.peak_bytes


def test_verifier_refuses_a_recomputed_op_that_may_not_be(mlp):
    from offload_compiler.passes import verify

    live, costs = analyze(mlp, SLOW_LINK)
    analysis = recompute_chains.analyze(mlp, live, costs)
    chain = next(c for c in analysis.chains if [live.saved[i].fw_node for i in c.saved] == ["t_2"])
    copy = insert_recompute.copy_pair(mlp)
    insert_recompute.apply(copy, live, [chain])
    bw = fx.GraphModule(mlp.backward, copy.backward.graph)
    gelu = next(
        n
        for n in bw.graph.nodes
        if insert_recompute.RECOMPUTE_KEY in n.meta and n.target is torch.ops.aten.gelu.default
    )
    gelu.target = torch.ops.aten.bernoulli.default  # a random op, not replayed
    gelu.args = gelu.args[:1]
    bw.recompile()
    pair = GraphPair(fx.GraphModule(mlp.forward, copy.forward.graph), bw, mlp.num_fwd_outputs, mlp.static_input_indices)
    with pytest.raises(verify.VerificationError, match="may not be recomputed.*random"):
        verify.verify(pair, None)


def _multi_knapsack(n=400, k=30, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    m = plan_recompute._Model()
    value = rng.integers(1, 1000, n)
    xs = [m.var(cost=-float(value[i]), integer=True) for i in range(n)]
    weights = []
    for _ in range(k):
        w = rng.integers(1, 1000, n)
        weights.append(w)
        m.row({x: float(w[i]) for i, x in enumerate(xs)}, 0.0, float(w.sum() // 4))
    return m, weights


@pytest.mark.skipif(not plan_recompute.have_solver(), reason="highspy is not installed")
def test_solver_time_limit_is_soft_until_a_first_solution():
    """Past the soft limit the solver stops at its first feasible solution, but not before it has
    one (up to the hard limit): a busy machine gets a later plan, not the greedy fallback's."""
    m, weights = _multi_knapsack()
    status, sol = m.solve(0.0)
    assert sol is not None, status
    x = sol[: len(weights[0])]
    assert set(x.round().tolist()) <= {0.0, 1.0}
    for w in weights:
        assert float(w @ x.round()) <= w.sum() // 4
    status, sol = m.solve(0.0, hard_limit=0.0)  # a hard zero: no time to find anything
    assert sol is None and "time limit" in status.lower(), status


@pytest.mark.skipif(not plan_recompute.have_solver(), reason="highspy is not installed")
def test_mip_start_is_the_first_incumbent_and_a_bad_one_is_dropped(monkeypatch):
    """A feasible MIP start is an incumbent from the start: with no time past the soft limit
    and no patience the solver returns a solution at least as good as it; a start that breaks a
    row is dropped (the solver finds its own)."""
    import numpy as np

    m, weights = _multi_knapsack()
    n = len(weights[0])
    cost = np.asarray(m.cost[:n])
    one = int(np.argmin(cost))  # the most valuable item alone: feasible (each weight < sum // 4)
    start = {i: float(i == one) for i in range(n)}
    monkeypatch.setattr(plan_recompute, "SOLVER_START_PATIENCE_S", 0.0)
    status, sol = m.solve(0.0, mip_start=start)
    assert sol is not None, status
    x = sol[:n].round()
    assert float(cost @ x) <= float(cost[one])
    for w in weights:
        assert float(w @ x) <= w.sum() // 4
    everything = {i: 1.0 for i in range(n)}  # breaks every row
    status, sol = m.solve(0.0, mip_start=everything)
    assert sol is not None, status
    for w in weights:
        assert float(w @ sol[:n].round()) <= w.sum() // 4


@pytest.mark.parametrize("strategy", ["auto", "offload", "recompute"])
@pytest.mark.parametrize("use_solver", [True, False])
def test_kept_cap_is_met_by_every_strategy(mlp, strategy, use_solver):
    """A cap on the saved bytes kept across the forward/backward boundary (an earlier pair of a
    training step replanned for a later one): the solver's row, the greedy fallback and the exact
    plan all respect it, with a budget the pair meets without a plan."""
    from offload_compiler.step_budget import kept_saved_bytes

    live, costs = analyze(mlp, SLOW_LINK)
    total = sum(live.boundary_saved.values())
    cap = total // 3
    joint = plan_recompute.plan_joint(
        mlp, live, costs, live.peak_bytes, strategy, 0, rng_replay=True, use_solver=use_solver, kept_cap=cap
    )
    p = joint.plan
    assert not joint.recompute.fits_without_plan
    assert p.feasible and p.kept_cap_bytes == cap and p.peak_bytes_planned <= live.peak_bytes
    # Counted again on the rewritten graphs' liveness, with the plan's evictions.
    kept = kept_saved_bytes(joint.liveness, {e.buffer for e in p.evictions})
    assert kept == p.kept_bytes <= cap
    if strategy == "recompute":
        assert not p.evictions and joint.chains
    if strategy == "offload":
        assert not joint.chains and p.evictions
    # Without a cap the pair fits without a plan.
    free = plan_recompute.plan_joint(mlp, live, costs, live.peak_bytes, strategy, 0, use_solver=use_solver)
    assert free.recompute.fits_without_plan and free.plan.evictions == ()


@pytest.mark.skipif(not plan_recompute.have_solver(), reason="highspy is not installed")
@pytest.mark.parametrize("strategy", ["recompute", "auto"])
def test_an_infeasible_budget_gets_the_lowest_peak_choice_not_the_greedy_one(mlp, strategy):
    """Below the lowest reachable peak the budget's program is infeasible; the lowest-peak
    program's choice is scored, and no choice of recomputations has a lower peak (checked by
    scoring every subset the program allows, recompute only)."""
    import itertools

    live, costs = analyze(mlp, SLOW_LINK)
    chains = recompute_chains.analyze(mlp, live, costs).chains
    budget = 1
    joint = plan_recompute.plan_joint(mlp, live, costs, budget, strategy, 0)
    rp = joint.recompute
    assert not joint.plan.feasible
    assert "recompute only: Infeasible" in rp.solver_status, rp.solver_status
    assert "recompute only, lowest peak: Optimal" in rp.solver_status, rp.solver_status
    assert not rp.fallback_used and rp.solver == "highs"
    by_buf = {c.buffer: c for c in chains}
    best = None
    for k in range(len(chains) + 1):
        for subset in itertools.combinations(sorted(by_buf), k):
            trial = {b: by_buf[b] for b in subset}
            if plan_recompute._double_moves(trial, plan_recompute._moves(trial)):
                continue  # a move of a move: outside what the program allows
            view, vcosts = plan_recompute.recompute_view(live, costs, by_buf, frozenset(subset))
            p = plan_recompute.plan_offload(view, vcosts, budget, 0, only=frozenset())
            best = p.step_peak_bytes if best is None else min(best, p.step_peak_bytes)
    if strategy == "recompute":
        assert joint.plan.peak_bytes_planned == best
    else:  # offloading can only lower it further
        assert joint.plan.peak_bytes_planned <= best
    assert joint.plan.peak_bytes_planned < live.peak_bytes


def test_a_recomputed_fused_chain_costs_what_the_planner_counted():
    """Under Inductor a recomputed pointwise chain is one kernel in the backward, as its forward
    original is: the rewritten pair's cost is the unrewritten pair's plus the plan's recompute
    seconds (inserted nodes priced with the rewritten liveness's fused nodes; before, each
    inserted node was priced as a kernel of its own: 1.385 against 1.297 ms here)."""
    from offload_compiler.devices import lookup_device
    from offload_compiler.models.presets import get_preset
    from offload_compiler.options import TrinityOptions
    from offload_compiler.pipeline import ModelState, analyze_pair, plan_pair, prepare
    from offload_compiler.plan_cli import mark_target_device
    from offload_compiler.trace import trace_training_step

    device = lookup_device("h100-sxm")
    traced = trace_training_step(lambda: get_preset("demo").build(128), 8, 128, 256, torch.bfloat16, inner="inductor")
    pair = traced.pair
    mark_target_device(pair, device)
    prepare(pair, "inductor")
    opts = TrinityOptions.from_user(
        {"inner": "inductor", "verify": False, "min_offload_bytes": 0, "memory_budget": "60%", "strategy": "recompute"},
        env={},
    )
    analysis = analyze_pair(pair, opts, device)
    pp = plan_pair(
        pair, opts, ModelState(offload="activations", optimizer_state_bytes=0), spec=device, analysis=analysis
    )
    rp = pp.joint.recompute
    assert len(rp.recomputes) > 0 and rp.recompute_seconds > 0
    before, after = sum(analysis.costs.step_seconds), sum(pp.joint.costs.step_seconds)
    assert after == pytest.approx(before + rp.recompute_seconds, rel=1e-6)


# ------------------------------------------------------------------ the programs' buffers
def test_the_programs_leave_out_the_smallest_buffers_within_their_share(monkeypatch):
    """``_program_buffers`` keeps the smallest buffers out of the programs while their bytes
    total at most PROGRAM_SMALL_SHARE of the bytes to free (peak, earlier runs' kept saved
    activations included, minus the budget), and nothing when the budget needs no freeing."""
    from types import SimpleNamespace as NS

    import numpy as np

    monkeypatch.setattr(plan_recompute, "PROGRAM_SMALL_SHARE", 0.01)
    live = NS(live_bytes=lambda: np.array([0, 10_000, 4_000]), boundary_saved={3: 2_000})
    offs = [NS(buffer=b, size=s) for b, s in ((0, 30), (1, 10), (2, 1_000), (3, 2_000))]
    chains = [NS(buffer=b, size_bytes=s) for b, s in ((1, 10), (4, 20))]
    # 5,000 bytes to free: 50 may be left out, the 10 and 20 (then 30 would make 60).
    got_offs, got_chains, n, nbytes = plan_recompute._program_buffers(live, offs, chains, 5_000)
    assert (n, nbytes) == (2, 30)
    assert [o.buffer for o in got_offs] == [0, 2, 3] and [c.buffer for c in got_chains] == []
    # Two earlier runs hold buffer 3's 2,000 bytes each: 9,000 to free, 90 may be left out.
    got_offs, _c, n, nbytes = plan_recompute._program_buffers(live, offs, chains, 5_000, earlier_runs=2)
    assert (n, nbytes) == (3, 60) and [o.buffer for o in got_offs] == [2, 3]
    assert plan_recompute._program_buffers(live, offs, chains, 10_000) == (offs, chains, 0, 0)
    assert plan_recompute._program_buffers(live, offs, chains, 9_999)[2:] == (0, 0)  # 1 byte: 0.01 may go


@pytest.mark.skipif(not plan_recompute.have_solver(), reason="highspy is not installed")
def test_a_program_infeasible_without_the_small_buffers_is_solved_with_them(mlp, monkeypatch):
    """With a share so large that an 8 KiB buffer the budget needs is left out, both programs
    are infeasible without it and are solved again with every buffer: the plan is the one the
    full programs give."""
    live, costs = analyze(mlp, SLOW_LINK)
    budget = int(0.75 * live.peak_bytes)
    full = plan_recompute.plan_joint(mlp, live, costs, budget, "auto", 0)
    assert "kept out of the programs" not in full.recompute.solver_status
    monkeypatch.setattr(plan_recompute, "PROGRAM_SMALL_SHARE", 0.6)
    joint = plan_recompute.plan_joint(mlp, live, costs, budget, "auto", 0)
    status = joint.recompute.solver_status
    assert status.startswith("1 smallest buffers (8192 bytes) kept out of the programs"), status
    assert "recompute only: Infeasible; recompute only, every buffer: Optimal" in status, status
    assert "solver: Infeasible; solver, every buffer: Optimal" in status, status
    assert joint.plan.feasible and joint.recompute.chosen == full.recompute.chosen
    assert decisions(joint) == decisions(full)


def ln_mlp(w1, w2, x):
    h = F.layer_norm(x @ w1, (D,))
    h = F.gelu(h) @ w2
    return F.layer_norm(h, (D,)).sin().sum()


def test_a_node_on_several_chains_counts_once_in_the_records():
    """LayerNorm's output, mean and rstd are three saved buffers whose chains share the
    ``native_layer_norm`` node, and two chains share ``gelu``: the rewrite recomputes each once,
    so the records' FLOPs and seconds sum over the distinct nodes (a fresh-user trial's report
    counted each block's projection twice)."""
    torch.manual_seed(0)
    w1, w2 = ((torch.randn(D, D) * 0.3).requires_grad_(True) for _ in range(2))
    pair = capture_pair(ln_mlp, w1, w2, torch.randn(N, D), static=(0, 1))
    live, costs = analyze(pair, SLOW_LINK)
    chains = recompute_chains.analyze(pair, live, costs).chains
    distinct = {live.step_at(n) for c in chains for n in c.node_refs}
    assert sum(len(c.nodes) for c in chains) > len(distinct)  # nodes are shared
    records = plan_recompute._records(live, costs, chains)
    assert sum(r.flops for r in records) == sum(costs.step_flops[i] for i in distinct) > 0
    assert sum(r.seconds for r in records) == pytest.approx(sum(costs.step_seconds[i] for i in distinct), rel=1e-12)
    assert sum(r.seconds for r in records) < sum(c.seconds for c in chains)
    # The first record of a shared node carries it; a chain alone keeps its own figures.
    assert records[0].flops == chains[0].flops and records[0].seconds == chains[0].seconds
