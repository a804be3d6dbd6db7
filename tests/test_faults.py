"""The fault-injection runtime: correct op sequences stay correct; wrong ones show NaN."""

import torch

from offload_compiler.ir.ops import EVICT_WAIT
from offload_compiler.passes import cost_model, insert_transfers, liveness, plan_window, verify
from offload_compiler.runtime.transfer import FaultInjection, TransferRuntime

from ._pass_helpers import ROUND
from .graphs import capture_pair

ops = torch.ops.trinity


def runtime(seed=0, early=0.0):
    return TransferRuntime(torch.device("cpu"), 1 << 26, FaultInjection(seed=seed, early_probability=early))


def test_correct_sequence_round_trips():
    rt = runtime()
    x = torch.randn(64, 32)
    host = ops.evict(x, rt.id)
    ops.evict_wait(host, x, rt.id)
    dev = ops.prefetch(host, torch.device("cpu"), rt.id)
    ops.prefetch_wait(dev, rt.id)
    assert torch.equal(dev, x)
    assert rt.stats().pending_copies == 0


def test_missing_evict_wait_shows_nan():
    rt = runtime()
    x = torch.randn(64, 32)
    host = ops.evict(x, rt.id)  # no evict_wait: the D2H copy never happens
    dev = ops.prefetch(host, torch.device("cpu"), rt.id)
    ops.prefetch_wait(dev, rt.id)
    assert torch.isnan(dev).all()
    assert rt.stats().pending_copies == 1


def test_reader_before_prefetch_wait_shows_nan():
    rt = runtime()
    x = torch.randn(16, 16)
    host = ops.evict(x, rt.id)
    ops.evict_wait(host, x, rt.id)
    dev = ops.prefetch(host, torch.device("cpu"), rt.id)
    early = dev.clone()  # read before the wait
    ops.prefetch_wait(dev, rt.id)
    assert torch.isnan(early).all() and torch.equal(dev, x)


def test_integer_tensors_are_poisoned_too():
    rt = runtime()
    x = torch.arange(100, dtype=torch.int64)
    host = ops.evict(x, rt.id)
    dev = ops.prefetch(host, torch.device("cpu"), rt.id)
    ops.prefetch_wait(dev, rt.id)
    assert (dev == -1).all()


def test_early_completion_keeps_correct_sequences_correct():
    for seed in range(20):
        rt = runtime(seed=seed, early=0.5)
        xs = [torch.randn(8, 8) for _ in range(5)]
        hosts = [ops.evict(x, rt.id) for x in xs]
        for h, x in zip(hosts, xs):
            ops.evict_wait(h, x, rt.id)
        devs = [ops.prefetch(h, torch.device("cpu"), rt.id) for h in hosts]
        for d in devs:
            ops.prefetch_wait(d, rt.id)
        for d, x in zip(devs, xs):
            assert torch.equal(d, x)


def test_pool_hands_out_free_blocks_in_random_order():
    rt = runtime(seed=3)
    xs = [torch.randn(256) for _ in range(6)]
    blocks = [ops.evict(x, rt.id) for x in xs]
    ptrs = [b.untyped_storage().data_ptr() for b in blocks]
    for b, x in zip(blocks, xs):
        ops.evict_wait(b, x, rt.id)
    del blocks, b
    again = [ops.evict(x, rt.id) for x in xs]
    assert {a.untyped_storage().data_ptr() for a in again} == set(ptrs)  # reused, none new
    seen = []
    for seed in range(5):
        rt2 = runtime(seed=seed)
        xs = [torch.randn(256) for _ in range(6)]
        bs = [ops.evict(x, rt2.id) for x in xs]
        for b, x in zip(bs, xs):
            ops.evict_wait(b, x, rt2.id)
        first = [b.untyped_storage().data_ptr() for b in bs]
        del bs, b
        again = ops.evict(torch.randn(256), rt2.id)
        seen.append(first.index(again.untyped_storage().data_ptr()))
    assert len(set(seen)) > 1, "free blocks always handed out in the same order"


def _mlp_rewrite(rt):
    torch.manual_seed(0)
    ws = [torch.randn(32, 32, requires_grad=True) for _ in range(4)]
    x = torch.randn(64, 32)

    def fn(*args):
        *weights, h = args
        for w in weights:
            h = torch.tanh(h @ w)
        return h.sum()

    pair = capture_pair(fn, *ws, x, static=(0, 1, 2, 3))
    live = liveness.analyze(pair)
    costs = cost_model.estimate(pair, live, ROUND)
    plan = plan_window.plan(live, costs, int(0.6 * live.peak_bytes), 0)
    assert plan.evictions
    inputs = [w.detach() for w in ws] + [x]
    import copy

    original = (copy.deepcopy(pair.forward), copy.deepcopy(pair.backward))
    insert_transfers.apply(pair, live, plan, rt.id)
    return pair, original, inputs


def _run(fw, bw, inputs, num_fwd_outputs):
    outs = fw(*inputs)
    saved = list(outs[num_fwd_outputs:])
    return outs[:num_fwd_outputs], bw(*saved, torch.ones(()))


def test_rewritten_graphs_are_exact_under_injection_and_a_dropped_wait_is_caught():
    for early in (0.0, 0.3, 1.0):
        rt = runtime(seed=5, early=early)
        pair, (fw0, bw0), inputs = _mlp_rewrite(rt)
        verify.verify(pair, None)
        ref = _run(fw0, bw0, inputs, pair.num_fwd_outputs)
        got = _run(pair.forward, pair.backward, inputs, pair.num_fwd_outputs)
        for a, b in zip(ref[1], got[1]):
            assert (a is None and b is None) or torch.equal(a, b)
    # Drop one evict_wait (copies complete only at their waits): the copy never happens and the
    # backward sees NaN.
    rt = runtime(seed=5, early=0.0)
    pair, _original, inputs = _mlp_rewrite(rt)
    (wait,) = [n for n in pair.forward.graph.nodes if n.target is EVICT_WAIT][:1]
    pair.forward.graph.erase_node(wait)
    pair.forward.recompile()
    got = _run(pair.forward, pair.backward, inputs, pair.num_fwd_outputs)
    assert any(g is not None and torch.isnan(g).any() for g in got[1])
