"""assign_streams, the happens-before check and the interleaving executor on hand-built graphs."""

import copy
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from offload_compiler.ir.ops import RECORD_EVENT, SET_STREAM, WAIT_EVENT
from offload_compiler.passes import assign_streams as A
from offload_compiler.passes.happens_before import check_streams, has_streams
from offload_compiler.passes.simulate import ProgramStep, simulate, simulate_program
from offload_compiler.runtime.streams import ComputeStreams
from offload_compiler.testing.interleave import run_interleaved

from ._pass_helpers import ROUND
from .graphs import mlp_pair

RT = 0  # runtime id baked into the stream ops; the CPU never looks it up in these tests


def diamond(x, w1, w2, w3):
    a = x @ w1
    b = a @ w2
    c = a @ w3
    return b + c


def chain(x, w1, w2, w3):
    return torch.tanh(torch.tanh(x @ w1) @ w2) @ w3


def inputs(n=4, size=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, size, generator=g) for _ in range(n)]


def traced(fn, args):
    return make_fx(fn, tracing_mode="fake")(*args)


def scheduled(fn, num_streams=2, spec=ROUND, event_seconds=A.EVENT_OVERHEAD_S, args=None):
    gm = traced(fn, args or inputs())
    secs, copies = A.graph_seconds(gm, spec)
    plan = A.plan(gm, num_streams, secs, copies, event_seconds)
    A.apply(gm, plan, RT)
    return gm, plan


def event_nodes(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def without_event(gm, event):
    g = copy.deepcopy(gm)
    for n in list(g.graph.nodes):
        if n.op == "call_function" and n.target in (RECORD_EVENT, WAIT_EVENT) and n.args[2] == event:
            g.graph.erase_node(n)
    g.recompile()
    return g


def without_node(gm, index, target):
    g = copy.deepcopy(gm)
    g.graph.erase_node(event_nodes(g, target)[index])
    g.recompile()
    return g


# ------------------------------------------------------------------------------ the pass
def test_diamond_gets_two_streams_and_exactly_two_events():
    gm, plan = scheduled(diamond)
    streams = {n.name: n.meta[A.STREAM_KEY] for n in gm.graph.nodes}
    # The two independent matmuls are on different streams; the join is on stream 0.
    assert {streams["mm_1"], streams["mm_2"]} == {0, 1}
    assert streams["mm"] == 0 and streams["add"] == 0
    assert plan.num_events == 2 and plan.used_streams == 2
    assert len(event_nodes(gm, RECORD_EVENT)) == 2
    assert len(event_nodes(gm, WAIT_EVENT)) == 2
    assert check_streams(gm) == []
    # Simulated: the side matmul overlaps the other one (ROUND: 64x64x64 fp32 mm = 0.524 ms + 1 us).
    mm = 2 * 64**3 / 1e9 + 1e-6
    assert plan.single_stream_seconds == pytest.approx(3 * mm + (3 * 64 * 64 * 4) / 1e9 + 1e-6, rel=1e-6)
    assert plan.seconds < plan.single_stream_seconds - mm / 2


def test_the_keep_alive_wait_takes_the_buffer_the_side_stream_reads():
    gm, _ = scheduled(diamond)
    (join,) = [w for w in event_nodes(gm, WAIT_EVENT) if w.args[3] == 0]
    side_mm = next(n for n in gm.graph.nodes if n.meta.get(A.STREAM_KEY) == 1 and n.target is torch.ops.aten.mm.default)
    kept = {n.name for n in join.args[0]}
    # The side matmul's inputs were allocated on (or enter through) stream 0 and are last read
    # on stream 1: the wait on stream 0 holds them, so FX frees them only after it.
    assert kept == {m.name for m in side_mm.all_input_nodes}
    order = list(gm.graph.nodes)
    assert order.index(join) == order.index(side_mm) + 2  # right after the side node's record


def test_chain_stays_on_one_stream_without_events():
    gm, plan = scheduled(chain)
    assert plan.num_events == 0 and plan.used_streams == 1
    assert all(n.meta[A.STREAM_KEY] == 0 for n in gm.graph.nodes)
    assert not has_streams(gm)
    assert not any(
        n.op == "call_function" and n.target in (RECORD_EVENT, WAIT_EVENT, SET_STREAM) for n in gm.graph.nodes
    )
    assert plan.seconds == plan.single_stream_seconds


def test_one_stream_turns_the_pass_off():
    gm, plan = scheduled(diamond, num_streams=1)
    assert plan.num_events == 0 and not has_streams(gm)


def test_overhead_larger_than_the_gain_keeps_one_stream():
    # A 0.5 ms overlap is not worth a 1 s event.
    _, plan = scheduled(diamond, event_seconds=1.0)
    assert plan.num_events == 0
    # Tiny ops on a fast device: the matmuls take under a microsecond, less than the events.
    fast = dataclasses.replace(ROUND, flops_fp32=1e15, hbm_bytes_per_s=1e13, launch_overhead_s=0.0)
    _, plan = scheduled(diamond, spec=fast, args=inputs(size=8))
    assert plan.num_events == 0


def test_invalid_num_streams_and_double_application_are_rejected():
    gm = traced(diamond, inputs())
    secs, copies = A.graph_seconds(gm, ROUND)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="num_streams"):
            A.plan(gm, bad, secs, copies)
    A.apply(gm, A.plan(gm, 2, secs, copies), RT)
    with pytest.raises(ValueError, match="already has stream ops"):
        A.plan(gm, 2, secs, copies)
    assert A.remove(gm) == 2 + 2 + 2  # two records, two waits, two switches
    assert not has_streams(gm)


def test_predicted_time_equals_the_simulation_of_the_rewritten_graph():
    graphs = [scheduled(fn, num_streams=3) for fn in (diamond, chain)]
    bw = mlp_pair(batch=64, width=64, depth=3).backward
    secs, copies = A.graph_seconds(bw, ROUND)
    plan = A.plan(bw, 3, secs, copies)
    A.apply(bw, plan, RT)
    assert plan.num_events > 0 and any(w.keep for w in plan.waits)
    graphs.append((bw, plan))
    for gm, plan in graphs:
        secs, copies = A.graph_seconds(gm, ROUND)
        sim = simulate_program(A.program_steps(gm, secs, copies), A.EVENT_OVERHEAD_S)
        assert sim.step_seconds == pytest.approx(plan.seconds, rel=1e-12)


def test_one_stream_program_equals_the_copy_simulator():
    steps = [1.0, 2.0, 0.5, 3.0]
    # copy 0 issued before step 1, waited before step 3; copy 1 issued at 2, waited at 4 (end).
    ref = simulate(steps, [A_copy(0, "d2h", 4.0, 1, 3), A_copy(1, "h2d", 1.0, 2, 4)])
    program = [
        ProgramStep("compute", 0, 1.0),
        ProgramStep("copy", 0, 4.0, 0, "d2h"),
        ProgramStep("compute", 0, 2.0),
        ProgramStep("copy", 0, 1.0, 1, "h2d"),
        ProgramStep("compute", 0, 0.5),
        ProgramStep("copy_wait", 0, key=0),
        ProgramStep("compute", 0, 3.0),
        ProgramStep("copy_wait", 0, key=1),
    ]
    got = simulate_program(program)
    assert got.step_seconds == ref.step_seconds == 8.0
    assert got.exposed_seconds == ref.exposed_seconds == 1.5


def A_copy(i, direction, seconds, issue, wait):
    from offload_compiler.passes.simulate import CopyTask

    return CopyTask(i, direction, seconds, issue, wait)


def test_events_are_a_transitive_reduction():
    """No wait is implied by the others: dropping any single wait (its record kept) breaks the
    happens-before check. Checked on the diamond and on an MLP's backward with three streams."""
    pair = mlp_pair(batch=64, width=64, depth=3)
    bw = pair.backward
    secs, copies = A.graph_seconds(bw, ROUND)
    plan = A.plan(bw, 3, secs, copies)
    A.apply(bw, plan, RT)
    assert plan.num_events > 0 and check_streams(bw) == []
    for gm in (scheduled(diamond)[0], bw):
        waits = event_nodes(gm, WAIT_EVENT)
        assert waits
        for i in range(len(waits)):
            assert check_streams(without_node(gm, i, WAIT_EVENT)), f"wait {i} is implied by the others"


@pytest.mark.parametrize("event", [0, 1])
def test_removing_any_event_fails_the_check(event):
    gm, _ = scheduled(diamond)
    errors = check_streams(without_event(gm, event))
    assert errors
    assert all("event" in e or "freed" in e or "stream" in e for e in errors)


def test_check_rejects_a_wait_before_its_record_and_a_missing_exit():
    gm, _ = scheduled(diamond)
    g = copy.deepcopy(gm)
    rec = event_nodes(g, RECORD_EVENT)[1]
    wait = next(w for w in event_nodes(g, WAIT_EVENT) if w.args[2] == rec.args[2])
    wait.append(rec)  # the record moves after its wait
    g.graph.lint()
    assert any("no earlier node records" in e for e in check_streams(g))
    # A side node after the last join: the output is not ordered after it.
    g = copy.deepcopy(gm)
    add = next(n for n in g.graph.nodes if n.name == "add")
    add.meta[A.STREAM_KEY] = 1
    assert any("output is not ordered" in e or "reads" in e for e in check_streams(g))


# ------------------------------------------------------------------------------ the executor
def sequential(fn, args):
    return fn(*args)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1))
def test_interleaved_execution_of_a_correct_graph_is_exact(seed):
    gm, _ = scheduled(diamond, num_streams=2)
    args = inputs(seed=3)
    out = run_interleaved(gm, list(args), seed)
    assert torch.equal(out, diamond(*args))


def test_removing_an_event_shows_wrong_values_for_some_seed():
    gm, _ = scheduled(diamond)
    args = inputs(seed=3)
    expected = diamond(*args)
    for event in (0, 1):
        broken = without_event(gm, event)
        wrong = [s for s in range(200) if not torch.equal(run_interleaved(broken, list(args), s), expected)]
        assert wrong, f"dropping event {event} was never caught"
        # ... and the same seeds are exact with the event in place.
        assert all(torch.equal(run_interleaved(gm, list(args), s), expected) for s in wrong[:5])


def fan(x, w1, w2, w3):
    a = x @ w1  # put on stream 1 by hand below: the last reader of w1
    b = x @ w2  # stream 0: allocates right after w1 was freed (could reuse its memory)
    return a + b


def hand_plan(gm, keep_alive: bool) -> A.StreamPlan:
    """``fan`` (traced as ``gm``) with ``mm`` on stream 1: entry event 0, event 1 after ``mm``. With
    ``keep_alive`` stream 0 waits for event 1 right after ``mm`` holding ``w1``; without, only
    before ``add``. The plan carries ``gm``'s nodes, as :func:`assign_streams.plan` makes it."""
    node = {n.name: n for n in gm.graph.nodes}  # the test names the nodes it places by hand
    streams = (("x_1", 0), ("w1_1", 0), ("w2_1", 0), ("w3_1", 0), ("mm", 1), ("mm_1", 0), ("add", 0), ("output", 0))
    records = (A.EventRecord(0, "w3_1", 0, node["w3_1"]), A.EventRecord(1, "mm", 1, node["mm"]))
    waits = [A.EventWait(0, 1, "mm", "before", anchor_ref=node["mm"])]
    if keep_alive:
        waits.append(A.EventWait(1, 0, "mm", "after", ("w1_1",), node["mm"], (node["w1_1"],)))
    else:
        waits.append(A.EventWait(1, 0, "add", "before", anchor_ref=node["add"]))
    nodes = tuple(node[name] for name, _ in streams)
    return A.StreamPlan(2, streams, records, tuple(waits), 1.0, 1.0, nodes)


def test_a_free_without_keep_alive_fails_the_check_and_shows_nan():
    args = inputs(seed=4)
    expected = fan(*args)
    good = traced(fan, args)
    A.apply(good, hand_plan(good, keep_alive=True), RT)
    assert check_streams(good) == []
    (join,) = [w for w in event_nodes(good, WAIT_EVENT) if w.args[3] == 0]
    assert [n.name for n in join.args[0]] == ["w1_1"]
    assert all(torch.equal(run_interleaved(good, list(args), s), expected) for s in range(100))

    bad = traced(fan, args)
    A.apply(bad, hand_plan(bad, keep_alive=False), RT)
    errors = check_streams(bad)
    assert len(errors) == 1 and "freed" in errors[0] and "'mm'" in errors[0] and "'mm_1'" in errors[0]
    outs = [run_interleaved(bad, list(args), s) for s in range(100)]
    assert any(torch.isnan(o).any() for o in outs), "the early free was never caught"
    assert any(torch.equal(o, expected) for o in outs)  # and some interleavings are still fine


def test_the_scheduler_holds_what_a_side_stream_reads_last():
    """Every wait the scheduler adds after a last use keeps exactly buffers that another stream
    read; the MLP backward under three streams has some, and passes the check."""
    pair = mlp_pair(batch=64, width=64, depth=3)
    bw = pair.backward
    secs, copies = A.graph_seconds(bw, ROUND)
    plan = A.plan(bw, 3, secs, copies)
    keeps = [w for w in plan.waits if w.keep]
    assert keeps and all(w.where == "after" for w in keeps)
    A.apply(bw, plan, RT)
    assert check_streams(bw) == []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), num_streams=st.sampled_from([2, 3]))
def test_mlp_backward_under_interleaving_matches_sequential(seed, num_streams):
    pair = mlp_pair(batch=64, width=64, depth=3)
    ref_bw = copy.deepcopy(pair.backward)
    bw = pair.backward
    secs, copies = A.graph_seconds(bw, ROUND)
    plan = A.plan(bw, num_streams, secs, copies)
    A.apply(bw, plan, RT)
    assert plan.num_events > 0 and check_streams(bw) == []
    g = torch.Generator().manual_seed(11)
    phs = [n for n in bw.graph.nodes if n.op == "placeholder"]
    args = []
    for ph in phs:
        v = ph.meta["val"]
        args.append(torch.randn(tuple(v.shape), generator=g).as_strided(tuple(v.shape), tuple(v.stride())).clone())
    expected = ref_bw(*[a.clone() for a in args])
    got = run_interleaved(bw, [a.clone() for a in args], seed)
    for e, o in zip(expected, got):
        assert (e is None and o is None) or torch.equal(e, o)


# ------------------------------------------------------------------------------ runtime
def test_compute_streams_are_ordered_no_ops_on_the_cpu():
    cs = ComputeStreams(torch.device("cpu"))
    assert not cs.enabled and cs.stream(0) is None and cs.stream(2) is None
    cs.set_stream(1)
    cs.record(0, 1)
    cs.wait(0, 0)
    assert cs.num_side_streams == 0
    with pytest.raises(ValueError, match="stream index"):
        cs.stream(-1)


def test_rewritten_graph_runs_as_plain_fx_code_on_the_cpu():
    from offload_compiler.runtime.transfer import TransferRuntime

    rt = TransferRuntime(torch.device("cpu"), 1 << 20)
    gm = traced(diamond, inputs())
    secs, copies = A.graph_seconds(gm, ROUND)
    A.apply(gm, A.plan(gm, 2, secs, copies), rt.id)
    args = inputs(seed=5)
    assert torch.equal(gm(*args), diamond(*args))
    assert "trinity.set_stream" in gm.code and "trinity.wait_event" in gm.code


def test_the_pipeline_step_gives_forward_and_backward_disjoint_event_ids():
    import re

    from offload_compiler.options import TrinityOptions
    from offload_compiler.passes import cost_model, liveness
    from offload_compiler.pipeline import CompileSession
    from offload_compiler.runtime.transfer import TransferRuntime

    from .graphs import capture_pair

    ws = [torch.randn(64, 64, requires_grad=True) for _ in range(3)]
    pair = capture_pair(lambda w1, w2, w3, x: diamond(x, w1, w2, w3).sum(), *ws, torch.randn(64, 64), static=(0, 1, 2))
    live = liveness.analyze(pair)
    costs = cost_model.estimate(pair, live, ROUND)
    opts = TrinityOptions.from_user({"inner": "eager", "num_streams": 2}, env={})
    session = CompileSession(opts, torch.device("cpu"), TransferRuntime(torch.device("cpu"), 1 << 20))
    plans = session._assign_streams(pair, costs, live.peak_bytes)
    assert plans["forward"].num_events == 2 and plans["backward"].num_events > 0
    ids = {}
    for name, gm in (("forward", pair.forward), ("backward", pair.backward)):
        ids[name] = {int(m) for m in re.findall(r"record_event\.default\(\[[^\]]*\], \d+, (\d+),", gm.code)}
        assert check_streams(gm, name) == []
    assert ids["forward"] == {0, 1}
    assert ids["backward"] == set(range(2, 2 + plans["backward"].num_events))
    # The peak is what it was: the waits allocate nothing and follow the last uses directly.
    assert liveness.analyze(pair).peak_bytes == live.peak_bytes


def test_synchronous_copies_take_their_streams_time():
    """Where the device is the host CPU, a copy runs on its node's stream: the stream pass sees
    its seconds as the node's own and no channel time, so no copy hides under another stream."""
    from offload_compiler.passes import insert_transfers
    from offload_compiler.runtime.transfer import TransferRuntime

    from ._pass_helpers import make_plan, mlp4_pair

    pair = mlp4_pair()
    live, _costs, plan = make_plan(pair, 0, ROUND)  # budget 0: every candidate evicted
    assert plan.evictions
    rt = TransferRuntime(torch.device("cpu"), 1 << 20)
    insert_transfers.apply(pair, live, plan, rt.id)
    gm = pair.forward
    secs, copies = A.graph_seconds(gm, ROUND)
    sync_secs, sync_copies = A.graph_seconds(gm, dataclasses.replace(ROUND, host_is_device=True))
    assert copies and all(c > 0 for c in copies.values())
    assert set(sync_copies) == set(copies) and all(c == 0.0 for c in sync_copies.values())
    views = 0
    for n in gm.graph.nodes:
        if n in copies:
            assert sync_secs[n] == secs[n] + copies[n]
        elif sync_secs[n] != secs[n]:  # a view: its dispatcher call runs on the host's cores
            assert (secs[n], sync_secs[n]) == (0.0, ROUND.launch_overhead_s), n.name
            views += 1
    assert views > 0
    # The copies' runtime calls, calibrated on the CPU, count on its stream too (one formula:
    # Costs.transfer_seconds).
    calls = dataclasses.replace(ROUND, host_is_device=True, d2h_overhead_s=7e-6)
    with_calls, _ = A.graph_seconds(gm, calls)
    evicts = [n for n in copies if n.target is torch.ops.trinity.evict.default]
    assert evicts
    for n in evicts:
        assert with_calls[n] == pytest.approx(sync_secs[n] + 7e-6, rel=1e-12)
