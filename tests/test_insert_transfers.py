"""The rewrite: exactly the planned trinity ops, in the planned places, and the rewritten graphs
compute bit-identical results on real tensors with a real TransferRuntime."""

import operator

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from offload_compiler.ir.ops import EVICT, EVICT_WAIT, FENCE, PREFETCH, PREFETCH_WAIT, TRANSFER_OPS
from offload_compiler.passes import insert_transfers, liveness
from offload_compiler.passes.liveness import BufferKind
from offload_compiler.runtime.transfer import TransferRuntime

from ._pass_helpers import (
    EVERY,
    gram_inputs,
    gram_pair,
    make_plan,
    mlp4_inputs,
    mlp4_pair,
    nodes_with_target,
    qkv_inputs,
    qkv_pair,
    run_pair,
    tanh2_inputs,
    tanh2_pair,
    tanh_mm_inputs,
    tanh_mm_pair,
)
from .graphs import dynamo_pair

# name: (pair maker taking a device, inputs maker, budget)
CASES = {
    "tanh_mm": (tanh_mm_pair, tanh_mm_inputs, EVERY),
    "mlp4_one": (mlp4_pair, mlp4_inputs, 1700),
    "mlp4_all": (mlp4_pair, mlp4_inputs, EVERY),
    "qkv_span": (qkv_pair, qkv_inputs, EVERY),
    "gram_span": (gram_pair, gram_inputs, EVERY),
    "same_view_twice": (tanh2_pair, tanh2_inputs, EVERY),
}
IDS = list(CASES)


def rewrite(name, device="cpu", fence_readers=False):
    make, _, budget = CASES[name]
    pair = make(device=device)
    live, _costs, plan = make_plan(pair, budget)
    assert plan.evictions, name
    rt = TransferRuntime(torch.device("cpu"), 1 << 30)
    counts = insert_transfers.apply(pair, live, plan, rt.id, fence_readers=fence_readers)
    return pair, live, plan, rt, counts


def groups(plan):
    return [(ev, g) for ev in plan.evictions for g in ev.groups]


def position(gm):
    return {n: i for i, n in enumerate(gm.graph.nodes)}


@pytest.mark.parametrize("name", IDS)
def test_exactly_the_planned_ops(name):
    pair, _live, plan, rt, counts = rewrite(name)
    n = len(groups(plan))
    assert counts == {"evict": n, "evict_wait": n, "prefetch": n, "prefetch_wait": n}
    assert len(nodes_with_target(pair.forward, EVICT)) == n
    assert len(nodes_with_target(pair.forward, EVICT_WAIT)) == n
    assert len(nodes_with_target(pair.backward, PREFETCH)) == n
    assert len(nodes_with_target(pair.backward, PREFETCH_WAIT)) == n
    for gm, absent in ((pair.forward, (PREFETCH, PREFETCH_WAIT, FENCE)), (pair.backward, (EVICT, EVICT_WAIT, FENCE))):
        for target in absent:
            assert nodes_with_target(gm, target) == []
    # Every op carries the runtime id.
    for node in nodes_with_target(pair.forward, EVICT):
        assert node.args[1] == rt.id
    for node in nodes_with_target(pair.forward, EVICT_WAIT):
        assert node.args[2] == rt.id
    for node in nodes_with_target(pair.backward, PREFETCH):
        assert node.args[2] == rt.id and node.args[1] == torch.device("cpu")
    for node in nodes_with_target(pair.backward, PREFETCH_WAIT):
        assert node.args[1] == rt.id


@pytest.mark.parametrize("name", IDS)
def test_host_copy_replaces_the_saved_output(name):
    pair, live, plan, _rt, _counts = rewrite(name)
    outputs = pair.fw_outputs()
    fw_nodes = {n.name: n for n in pair.forward.graph.nodes}
    for ev, g in groups(plan):
        evicts = {outputs[live.saved[i].fw_output_index] for i in g.saved}
        assert len(evicts) == 1
        (host,) = evicts
        assert host.op == "call_function" and host.target is EVICT
        # The copy reads the node it was planned after (through as_strided for a span or a view
        # taken from the first holder), and is inserted right after it.
        source = fw_nodes[live.steps[g.issue_after].node]
        src = host.args[0]
        if g.layout == "span":
            assert src.target is torch.ops.aten.as_strided.default
            assert src.args == (source, [g.span_numel], [1], g.span_offset)
            assert src.prev is source and host.prev is src
        else:
            assert src is source or (src.target is torch.ops.aten.as_strided.default and src.args[0] is source)
        # The evict_wait on it keeps the source alive and comes after the planned step.
        (wait,) = [u for u in host.users if u.op == "call_function" and u.target is EVICT_WAIT]
        assert wait.args[1] is src
        pos = position(pair.forward)
        assert pos[wait] > pos[fw_nodes[live.steps[ev.wait_after].node]]
    # Nothing of the evicted buffers is returned as a device tensor any more.
    evicted = {StorageWeakRef(h.args[0].meta["val"].untyped_storage()) for h in nodes_with_target(pair.forward, EVICT)}
    for out in outputs[pair.num_fwd_outputs :]:
        if out.target is not EVICT:
            assert StorageWeakRef(out.meta["val"].untyped_storage()) not in evicted, out.name


@pytest.mark.parametrize("name", IDS)
def test_backward_placeholder_becomes_a_host_tensor(name):
    # Captured on the meta device so that "host" (cpu) differs from the compute device.
    make, _, budget = CASES[name]
    pair = make(device="meta")
    live, _costs, plan = make_plan(pair, budget)
    fw_vals = {}
    phs = {n.name: n for n in pair.backward.graph.find_nodes(op="placeholder")}
    for _ev, g in groups(plan):
        for i in g.saved:
            fw_vals[i] = phs[live.saved[i].bw_node].meta["val"]
    insert_transfers.apply(pair, live, plan, runtime_id=999)
    for _ev, g in groups(plan):
        first = live.saved[g.saved[0]]
        ph = phs[first.bw_node]
        val = ph.meta["val"]
        assert val.device == torch.device("cpu")
        assert val.dtype == fw_vals[g.saved[0]].dtype
        if g.layout == "span":
            assert tuple(val.shape) == (g.span_numel,)
        else:
            assert (tuple(val.shape), tuple(val.stride())) == (first.shape, first.stride)
        assert StorageWeakRef(val.untyped_storage()) != StorageWeakRef(fw_vals[g.saved[0]].untyped_storage())
        assert tuple(ph.meta["tensor_meta"].shape) == tuple(val.shape)
        # The prefetched tensor is back on the compute device.
        (pf,) = [u for u in ph.users if u.target is PREFETCH]
        assert pf.meta["val"].device == torch.device("meta")
        for i in g.saved[1:]:
            assert phs[live.saved[i].bw_node].meta["val"] is val
    # Liveness of the rewritten pair counts the host copies as host memory.
    live2 = liveness.analyze(pair)
    host = [b for b in live2.buffers if b.kind is BufferKind.HOST]
    assert host and all(not b.on_device for b in host)
    host_nodes = {x for b in host for x in b.nodes}
    for _ev, g in groups(plan):
        assert f"backward:{live.saved[g.saved[0]].bw_node}" in host_nodes


@pytest.mark.parametrize("name", IDS)
def test_prefetch_precedes_wait_precedes_readers(name):
    pair, live, plan, _rt, _counts = rewrite(name)
    bw = pair.backward
    pos = position(bw)
    originals = {n.name: n for n in bw.graph.nodes if not (n.op == "call_function" and n.target in TRANSFER_OPS)}
    phs = {n.name: n for n in bw.graph.find_nodes(op="placeholder")}
    for ev, g in groups(plan):
        ph = phs[live.saved[g.saved[0]].bw_node]
        (pf,) = list(ph.users)
        assert pf.target is PREFETCH
        (wait,) = [u for u in pf.users if u.target is PREFETCH_WAIT]
        readers = [u for u in pf.users if u is not wait]
        if g.layout == "span":
            # Each saved view is rebuilt from the prefetched span after the wait.
            assert len(readers) == len(g.saved)
            assert all(r.target is torch.ops.aten.as_strided.default for r in readers)
            readers = [u for r in readers for u in r.users]
        assert readers
        assert pos[pf] < pos[wait] < min(pos[r] for r in readers)
        # The prefetch is issued right before the planned step, the wait right before the first
        # reader the plan named (transfer ops at the same gap aside).
        planned_issue = originals[live.steps[ev.prefetch_before].node]
        planned_wait = originals[live.steps[g.wait_before].node]
        assert pos[pf] < pos[planned_issue]
        inserted = set(TRANSFER_OPS) | {torch.ops.aten.as_strided.default}  # as_strided: rebuilt span views
        assert all(n.target in inserted for n in list(bw.graph.nodes)[pos[pf] + 1 : pos[planned_issue]])
        assert pos[wait] < pos[planned_wait]
        assert all(n.target in inserted for n in list(bw.graph.nodes)[pos[wait] + 1 : pos[planned_wait]])
        # Nobody reads the host placeholder except the prefetch.
        for i in g.saved:
            assert all(u.target is PREFETCH for u in phs[live.saved[i].bw_node].users)


@pytest.mark.parametrize("name", IDS)
def test_forward_readers_precede_evict_wait(name):
    pair, live, plan, _rt, _counts = rewrite(name)
    fw = pair.forward
    pos = position(fw)
    for _ev, g in groups(plan):
        host = pair.fw_outputs()[live.saved[g.saved[0]].fw_output_index]
        (wait,) = [u for u in host.users if u.target is EVICT_WAIT]
        storage = StorageWeakRef(host.args[0].meta["val"].untyped_storage())
        for n in fw.graph.nodes:
            if n.op in ("placeholder", "output") or n is wait:
                continue
            reads = any(
                StorageWeakRef(t.untyped_storage()) == storage
                for m in n.all_input_nodes
                for t in ([m.meta["val"]] if isinstance(m.meta.get("val"), torch.Tensor) else [])
            )
            if reads:
                assert pos[n] < pos[wait], f"{n.name} reads the evicted storage after {wait.name}"


@pytest.mark.parametrize("name", IDS)
def test_rewritten_graphs_give_bit_identical_results(name):
    make, inputs, _budget = CASES[name]
    ref = make()
    pair, _live, plan, rt, _counts = rewrite(name)
    primals = inputs()
    ref_user, _, ref_grads = run_pair(ref, primals)
    user, _saved, grads = run_pair(pair, primals)
    assert len(user) == len(ref_user) and len(grads) == len(ref_grads)
    for a, b in zip(user, ref_user):
        assert torch.equal(a, b)
    for a, b in zip(grads, ref_grads):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)
    assert any(g is not None for g in grads)
    # The host copies really went through the runtime.
    stats = rt.stats()
    n = len(groups(plan))
    assert (stats.num_evicts, stats.num_prefetches, stats.pending_copies) == (n, n, 0)
    assert stats.bytes_d2h == stats.bytes_h2d == sum(g.copy_bytes for _, g in groups(plan))


@pytest.mark.parametrize("name", ["mlp4_one", "mlp4_all", "qkv_span"])
def test_fences_follow_forward_readers(name):
    pair, _live, _plan, _rt, counts = rewrite(name, fence_readers=True)
    fences = nodes_with_target(pair.forward, FENCE)
    assert counts["fence"] == len(fences) > 0
    pos = position(pair.forward)
    for f in fences:
        hosts, reader = f.args
        assert all(h.target is EVICT for h in hosts)
        assert pos[reader] < pos[f]
        for h in hosts:
            (wait,) = [u for u in h.users if u.target is EVICT_WAIT]
            assert pos[f] < pos[wait]
    # Still bit-identical.
    make, inputs, _ = CASES[name]
    primals = inputs()
    _, _, ref_grads = run_pair(make(), primals)
    _, _, grads = run_pair(pair, primals)
    for a, b in zip(grads, ref_grads):
        assert (a is None and b is None) or torch.equal(a, b)


def test_same_view_saved_twice_shares_one_copy():
    pair, live, plan, _rt, _counts = rewrite("same_view_twice")
    outputs = pair.fw_outputs()
    (two,) = [g for _, g in groups(plan) if len(g.saved) == 2]
    names = sorted(live.saved[i].fw_node for i in two.saved)
    assert names == ["detach", "tanh"]
    hosts = {outputs[live.saved[i].fw_output_index] for i in two.saved}
    assert len(hosts) == 1 and next(iter(hosts)).target is EVICT
    phs = {n.name: n for n in pair.backward.graph.find_nodes(op="placeholder")}
    (pf,) = [u for n in names for u in phs[n].users]
    # Readers of both placeholders now read the one prefetched tensor.
    assert {u.name for u in pf.users} >= {"t", "detach_3"}


def test_one_eviction_by_name():
    """mlp4 at 1700 B evicts tanh: host = evict(tanh) right after tanh, evict_wait after tanh_1,
    prefetch before mm_7, prefetch_wait before t_4 (its first backward reader)."""
    pair, _live, _plan, _rt, _counts = rewrite("mlp4_one")
    fw = [n.name for n in pair.forward.graph.nodes]
    bw_nodes = list(pair.backward.graph.nodes)
    (host,) = nodes_with_target(pair.forward, EVICT)
    (ewait,) = nodes_with_target(pair.forward, EVICT_WAIT)
    assert fw[fw.index("tanh") + 1] == host.name
    assert fw[fw.index("tanh_1") + 1] == ewait.name
    assert pair.fw_outputs()[4] is host  # was tanh (after the loss and the three saved weights)
    (pf,) = nodes_with_target(pair.backward, PREFETCH)
    (pwait,) = nodes_with_target(pair.backward, PREFETCH_WAIT)
    assert pf.next.name == "mm_7"
    assert pwait.next.name == "t_4" and pwait.next.args[0] is pf
    assert pf.args[0].name == "tanh" and pf.args[0].op == "placeholder"
    assert {u.name for u in pf.users} == {pwait.name, "t_4", "detach"}
    assert bw_nodes.index(pf) < bw_nodes.index(pwait)


def test_rejects_graphs_that_do_not_match_the_liveness():
    _pair, _live, plan, rt, _counts = rewrite("tanh_mm")
    other = tanh_mm_pair()
    with pytest.raises(ValueError, match="do not match"):
        insert_transfers.apply(other, liveness.analyze(mlp4_pair()), plan, rt.id)


def _attention(q, k, v, w):
    import torch.nn.functional as F

    return (F.scaled_dot_product_attention(q @ w, k @ w, v @ w, is_causal=True) * 2).sum()


def _checkpointed_dropout(q, k, v, w):
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    def block(h):
        return torch.tanh(F.dropout(h, 0.25) @ w)

    h = torch.tanh(q @ w + k + v)  # saved (tanh's backward) and read by the checkpointed dropout
    return (checkpoint(block, h, use_reentrant=False) * 2).sum()


def _fence_pair(fn):
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    q, k, v = (torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(3))
    pair = dynamo_pair(fn, q, k, v, w)
    live, _costs, plan = make_plan(pair, EVERY)
    assert plan.evictions
    rt = TransferRuntime(torch.device("cpu"), 1 << 30)
    insert_transfers.apply(pair, live, plan, rt.id, fence_readers=True)
    return pair


@pytest.mark.parametrize("fn", [_attention, _checkpointed_dropout], ids=["sdpa", "checkpointed_dropout"])
def test_fences_of_multi_output_ops_verify(fn):
    """SDPA returns its output and the logsumexp (both saved): neither getitem is a reader of the
    other's buffer, so no fence reads an evicted sibling after its wait. Under checkpointing with
    a random op runs inside ``run_and_save_rng_state``, whose RNG-state output (a real tensor under
    Inductor: "Please convert all Tensors to FakeTensors first") no fence may take."""
    from offload_compiler.graph_pair import is_rng_state
    from offload_compiler.passes import verify

    pair = _fence_pair(fn)
    fences = nodes_with_target(pair.forward, FENCE)
    assert fences
    verify.verify(pair, None)  # raised "'fence_..' reads 'getitem_1', an alias of evicted ..." before
    rng = [n for n in pair.forward.graph.nodes if is_rng_state(n)]
    assert (fn is _checkpointed_dropout) == bool(rng)
    # The RNG state is saved for the recomputation; it is bound to its backward placeholder
    # (named rng_state_output_<k>, not after the forward node) and kept on the device.
    for n in rng:
        (link,) = [link for link in pair.saved_links() if link.fw_node is n]
        assert link.bw_placeholder is not None and link.bw_placeholder.name.startswith("rng_state_output")
        assert pair.fw_outputs()[link.fw_output_index] is n
    pos = position(pair.forward)
    for f in fences:
        hosts, reader = f.args
        assert not is_rng_state(reader)
        assert isinstance(reader.meta["val"], torch.Tensor)
        for h in hosts:
            (wait,) = [u for u in h.users if u.target is EVICT_WAIT]
            assert pos[reader] < pos[f] < pos[wait]
            # A fence for an output of a multi-output op never reads that op's other outputs.
            src = h.args[0]
            if src.target is operator.getitem and reader.target is operator.getitem:
                assert reader.args[0] is not src.args[0], f"{f.name} reads sibling {reader.name} of {src.name}"
