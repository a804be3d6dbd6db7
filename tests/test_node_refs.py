"""The analyses carry ``torch.fx.Node`` references, and the rewrite passes use them.

Liveness (:class:`Step`, :class:`Buffer`, :class:`SavedTensor`), the recompute chains and the
joint planner's :class:`Recompute`, the stream plan (:class:`StreamPlan`, its events) and the
parameter residency plan hold the nodes they are about, as nodes of the very graphs analysed; the
names stay for reports, dumps and JSON, and equality still compares the names only (two traces of
one model give equal results). A plan made on the planner's copy of the graphs is moved to the
real graphs by ``Liveness.rebind`` (step for step) after the pipeline repeats the recomputation,
and no rewrite pass builds a map from node names to nodes.
"""

from __future__ import annotations

import copy
import inspect
import json
import re
from dataclasses import asdict, replace

import pytest
import torch

from offload_compiler import pipeline
from offload_compiler.devices import KNOWN_DEVICES
from offload_compiler.ir.refs import plain_dict
from offload_compiler.options import TrinityOptions
from offload_compiler.passes import (
    assign_streams,
    cost_model,
    insert_recompute,
    insert_transfers,
    liveness,
    param_residency,
    plan_recompute,
    plan_window,
    recompute_chains,
    verify,
)

from ._pass_helpers import analyze, mlp4_pair, spec
from .graphs import capture_pair, mlp_pair
from .test_plan_recompute import SLOW_LINK, D, L, N, gelu_mlp


def gelu_pair():
    torch.manual_seed(0)
    ws = [(torch.randn(D, D) * 0.3).requires_grad_(True) for _ in range(L)]
    return capture_pair(gelu_mlp, *ws, torch.randn(N, D), static=tuple(range(L)))


def tag(node, pair) -> str:
    """Liveness's display name of ``node`` (``"forward:name"`` / ``"backward:name"``)."""
    return ("forward:" if node.graph is pair.forward.graph else "backward:") + node.name


def assert_refs_in(live: liveness.Liveness, pair) -> None:
    """Every node reference of ``live`` is a node of ``pair``'s graphs and agrees with its name."""
    fw, bw = pair.forward.graph, pair.backward.graph
    schedule = list(fw.nodes) + list(bw.nodes)
    assert [s.ref for s in live.steps] == schedule
    assert all(s.ref.name == s.node for s in live.steps)
    assert live.node_step == {n: i for i, n in enumerate(schedule)}
    present = set(schedule)
    for b in live.buffers:
        assert all(h in present for h in b.holders), b
        assert [tag(h, pair) for h in b.holders] == list(b.nodes)
    for s in live.saved:
        assert s.fw_ref.graph is fw and s.fw_ref.name == s.fw_node and s.fw_ref in present
        if s.bw_node is None:
            assert s.bw_ref is None
        else:
            assert s.bw_ref.graph is bw and s.bw_ref.op == "placeholder" and s.bw_ref.name == s.bw_node


def test_liveness_holds_the_nodes_of_the_pair_and_compares_by_name():
    pair = mlp4_pair()
    live = liveness.analyze(pair)
    assert_refs_in(live, pair)
    assert any(len(b.holders) > 1 for b in live.buffers)  # aliases: several holders per buffer
    assert any(s.bw_ref is not None for s in live.saved)
    # A second trace gives other node objects but an equal liveness (references are not compared).
    other_pair = mlp4_pair()
    other = liveness.analyze(other_pair)
    assert other.buffers[0].holders[0] is not live.buffers[0].holders[0]
    assert other.buffers == live.buffers and other.saved == live.saved and other.steps == live.steps
    assert "holders" not in repr(live.buffers[0]) and "fw_ref" not in repr(live.saved[0])
    # JSON leaves them out, and is otherwise asdict's.
    saved = plain_dict(live.saved[0])
    assert "fw_ref" not in saved and "bw_ref" not in saved and saved["fw_node"] == live.saved[0].fw_node
    json.dumps(saved, default=str)
    with pytest.raises(TypeError, match="node_ref"):
        plain_dict({"node": live.steps[0].ref})


def test_rebind_moves_the_references_step_for_step_and_checks_the_schedule():
    pair = mlp4_pair()
    live = liveness.analyze(pair)
    copied = insert_recompute.copy_pair(pair)
    moved = live.rebind(list(copied.forward.graph.nodes) + list(copied.backward.graph.nodes))
    assert_refs_in(moved, copied)
    assert moved == live  # the same liveness, on the other graphs
    assert moved.live_bytes().tolist() == live.live_bytes().tolist()
    with pytest.raises(ValueError, match="not the schedule"):
        live.rebind(list(copied.forward.graph.nodes))
    with pytest.raises(ValueError, match="not the schedule"):
        live.rebind(list(reversed(list(copied.forward.graph.nodes) + list(copied.backward.graph.nodes))))


def test_insert_transfers_refuses_a_liveness_of_other_graphs():
    pair = mlp4_pair()
    live, costs = analyze(pair)
    plan = plan_window.plan(live, costs, int(0.6 * live.peak_bytes), 0)
    assert plan.evictions
    other = mlp4_pair()  # the same graphs, traced again: the plan's nodes are not its nodes
    with pytest.raises(ValueError, match="not a node of these graphs"):
        insert_transfers.apply(other, live, plan, runtime_id=1)
    # On its own graphs it applies; the rewritten graphs still verify.
    insert_transfers.apply(pair, live, plan, runtime_id=1)
    verify.verify(pair, None)


def test_chains_and_recomputes_hold_forward_nodes_and_apply_to_a_copy():
    pair = gelu_pair()
    live, costs = analyze(pair, SLOW_LINK)
    fw, bw = pair.forward.graph, pair.backward.graph
    analysis = recompute_chains.analyze(pair, live, costs)
    assert analysis.chains
    for c in analysis.chains:
        assert [n.name for n in c.node_refs] == list(c.nodes)
        assert all(n.graph is fw for n in c.node_refs)
        for leaf in c.leaves:
            assert leaf.fw_ref.graph is fw and leaf.fw_ref.name == leaf.fw_node
            assert (leaf.bw_ref is None) == (leaf.bw_node is None)
            if leaf.bw_ref is not None:
                assert leaf.bw_ref.graph is bw and leaf.bw_ref.name == leaf.bw_node
    joint = plan_recompute.plan_joint(pair, live, costs, int(0.75 * live.peak_bytes), "recompute", 0)
    assert joint.recompute.recomputes
    for r in joint.recompute.recomputes:
        assert [n.name for n in r.node_refs] == list(r.nodes) and all(n.graph is fw for n in r.node_refs)
        assert [n.name for n in r.saved_refs] == list(r.saved) and all(n.graph is fw for n in r.saved_refs)
        assert "node_refs" not in json.loads(joint.recompute.to_json())["recomputes"][0]
    # The exact stage analysed a copy: its liveness holds the copy's nodes, not the pair's.
    assert all(s.ref.graph is not fw and s.ref.graph is not bw for s in joint.liveness.steps)
    # A plan on the real graphs applies to a copy of them (copy_pair knows which node became which)...
    copied = insert_recompute.copy_pair(pair)
    insert_recompute.apply(copied, live, joint.chains)
    assert (
        tuple(n.name for n in copied.forward.graph.nodes),
        tuple(n.name for n in copied.backward.graph.nodes),
    ) == joint.rewritten_names
    # ... and not to graphs it knows nothing of.
    with pytest.raises(ValueError, match="not in these graphs"):
        insert_recompute.apply(gelu_pair(), live, joint.chains)


def test_the_pipeline_rebinds_the_activation_plan_to_the_real_graphs():
    """With recomputation and offload together, the activation plan was made on the planner's copy;
    after ``insert_recompute`` its buffers' and saved tensors' nodes are the real graphs' nodes."""
    pair = gelu_pair()
    pipeline.prepare(pair)
    opts = TrinityOptions.from_user({"memory_budget": "70%", "strategy": "auto", "min_offload_bytes": 0}, env={})
    # At 30 MB/s the planner recomputes three buffers and offloads one.
    plan = pipeline.plan_pair(pair, opts, spec=spec(h2d_bytes_per_s=3e7, d2h_bytes_per_s=3e7))
    assert plan.joint.chains and plan.activations.evictions and plan.activations.feasible
    assert all(s.ref.graph is not pair.forward.graph for s in plan.activation_liveness.steps)
    ctx = pipeline.RewriteContext(pair, session=None, step_nodes=[])
    after = pipeline._insert_recompute(ctx, plan)
    assert_refs_in(after.activation_liveness, pair)
    assert after.joint.liveness is after.activation_liveness
    assert after.activation_liveness == plan.activation_liveness  # the same plan, moved
    insert_transfers.apply(pair, after.activation_liveness, after.activations, runtime_id=1)
    assert verify.verify(pair, None) == after.activations.peak_bytes_planned


def test_stream_plans_hold_the_nodes_of_their_graph():
    pair = mlp_pair(batch=64, width=64, depth=3)
    bw = pair.backward
    ref_bw = copy.deepcopy(bw)
    secs, copies = assign_streams.graph_seconds(bw, spec(flops_fp32=1e9, hbm_bytes_per_s=1e10))
    plan = assign_streams.plan(bw, 3, secs, copies)
    assert plan.records and plan.waits
    assert list(plan.nodes) == list(bw.graph.nodes)
    assert [n.name for n in plan.nodes] == [name for name, _ in plan.streams]
    for r in plan.records:
        assert r.after_ref.graph is bw.graph and r.after_ref.name == r.after
    for w in plan.waits:
        assert w.anchor_ref.graph is bw.graph and w.anchor_ref.name == w.anchor
        assert [k.name for k in w.keep_refs] == list(w.keep) and all(k.graph is bw.graph for k in w.keep_refs)
    assert any(w.keep_refs for w in plan.waits)
    dumped = json.loads(json.dumps(plain_dict(plan)))
    assert "nodes" not in dumped and "after_ref" not in dumped["records"][0]
    assert dumped["streams"] == [list(s) for s in plan.streams]
    # The same plan on a copy of the graph (other node objects) is refused.
    with pytest.raises(ValueError, match="not nodes of this graph"):
        assign_streams.apply(ref_bw, plan, 0)
    assign_streams.apply(bw, plan, 0)


def test_residency_plans_hold_the_forward_placeholders():
    pair = mlp4_pair()
    live = liveness.analyze(pair)
    costs = cost_model.estimate(pair, live, KNOWN_DEVICES["a100-80gb"])
    placeholders = list(pair.forward.graph.find_nodes(op="placeholder"))
    slots = {i: (i, 1024) for i in pair.static_input_indices}
    plan = param_residency.plan(pair, live, costs, slots, "all", live.live_bytes(), None)
    assert plan.params
    for p in plan.params:
        assert p.placeholder_ref in placeholders and p.placeholder_ref.name == p.placeholder
    assert "placeholder_ref" not in json.loads(plan.to_json())["params"][0]
    stale = replace(plan, params=(replace(plan.params[0], placeholder_ref=mlp4_pair().forward.graph.find_nodes(
        op="placeholder")[0]),))  # fmt: skip
    step_nodes = list(pair.forward.graph.nodes) + list(pair.backward.graph.nodes)
    with pytest.raises(ValueError, match="not a placeholder of this forward"):
        param_residency.apply(pair, stale, step_nodes, 0)


# Name-keyed node lookups: ``{n.name: n for ...}``, ``by_name``, ``step_named(`` in a pass.
_NAME_LOOKUP = re.compile(r"\{\s*(\w+)\.name\s*:\s*\1\b|by_name|\.step_named\(")


@pytest.mark.parametrize(
    "module",
    [insert_transfers, assign_streams, insert_recompute, param_residency, recompute_chains, verify, plan_recompute],
    ids=lambda m: m.__name__.rsplit(".", 1)[-1],
)
def test_the_rewrite_passes_look_no_node_up_by_name(module):
    source = inspect.getsource(module)
    hits = [line.strip() for line in source.splitlines() if _NAME_LOOKUP.search(line)]
    assert hits == [], f"{module.__name__} looks nodes up by name: {hits}"


def test_plain_dict_is_asdict_without_references():
    pair = mlp4_pair()
    live = liveness.analyze(pair)
    buf = live.buffers[0]
    expected = asdict(replace(buf, holders=()))
    del expected["holders"]
    assert plain_dict(buf) == expected
