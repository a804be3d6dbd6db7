"""Reliability: faults in the middle of a compiled step, cases that broke other offloaders, long
runs, threads, and what trinity does not support.

Exceptions are raised from inside the compiled graphs by a custom op (``reltest::boom`` in the
forward, ``reltest::boom_bw`` in its backward) that counts its calls: the k-th call raises. Dynamo
and AOTAutograd see an opaque op, so the count is read at run time, never guarded on.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import offload_compiler
from offload_compiler.runtime.pool import HostPool, HostPoolExhausted
from offload_compiler.runtime.transfer import FaultInjection, TransferRuntime, _registry

from . import models
from .test_e2e import SideBySide, assert_same, sgd_

ops = torch.ops.trinity

# ---------------------------------------------------------------------------------- fault ops

# Calls left before the forward (``fw``) or backward (``bw``) op raises; -1: never. ``runtime``:
# the transfer runtime whose pending copies are recorded at the moment of the exception.
_BOOM = {"fw": -1, "bw": -1, "runtime": None, "at_raise": []}


@torch.library.custom_op("reltest::boom", mutates_args=())
def boom(x: torch.Tensor) -> torch.Tensor:
    if _BOOM["fw"] == 0:
        _record_raise()
        raise RuntimeError("injected forward failure")
    if _BOOM["fw"] > 0:
        _BOOM["fw"] -= 1
    return x.clone()


@boom.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("reltest::boom_bw", mutates_args=())
def boom_bw(g: torch.Tensor) -> torch.Tensor:
    if _BOOM["bw"] == 0:
        _record_raise()
        raise RuntimeError("injected backward failure")
    if _BOOM["bw"] > 0:
        _BOOM["bw"] -= 1
    return g.clone()


@boom_bw.register_fake
def _(g):
    return torch.empty_like(g)


boom.register_autograd(lambda ctx, g: boom_bw(g))


def _record_raise():
    rt = _BOOM["runtime"]
    if rt is not None:
        s = rt.stats()
        _BOOM["at_raise"].append((s.num_evicts, s.num_prefetches, s.pending_copies))


@pytest.fixture(autouse=True)
def _reset_boom():
    _BOOM.update(fw=-1, bw=-1, runtime=None, at_raise=[])
    yield
    _BOOM.update(fw=-1, bw=-1, runtime=None, at_raise=[])


class BoomMLP(nn.Module):
    """A tanh MLP with ``reltest::boom`` after every layer (so the fault can be put anywhere)."""

    def __init__(self, d=128, depth=8):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))

    def forward(self, x, y):
        h = x
        for lin in self.lins:
            h = boom(torch.tanh(lin(h)))
        return F.mse_loss(h, y)


def boom_batch(n=1024, d=128):
    return torch.randn(n, d), torch.randn(n, d)


def runtime_of(sbs: SideBySide) -> TransferRuntime:
    (r,) = sbs.reports()
    return _registry[r.runtime_id]


def _drop_exception_state():
    # pytest.raises keeps the traceback (and with it the graph's frames and their tensors) only
    # inside the ``with``; a cycle may still hold frames until collected.
    gc.collect()


FAULT_MODES = [None, 1234]


@pytest.mark.parametrize("fault_injection", FAULT_MODES)
def test_exception_in_forward_after_evictions_leaves_nothing_behind(fault_injection):
    sbs = SideBySide(BoomMLP, "eager", fault_injection=fault_injection)
    batch = boom_batch()
    sbs.step(batch)
    rt = runtime_of(sbs)
    held = rt.stats().host_pool.held_bytes
    _BOOM["runtime"] = rt
    evicts_per_step = rt.stats().num_evicts
    evicted_in_failed_step = []
    for k in range(len(sbs.model.lins)):
        before = rt.stats().num_evicts
        _BOOM["fw"] = k
        with pytest.raises(RuntimeError, match="injected forward failure"):
            sbs.compiled(*batch)
        _BOOM["fw"] = -1
        _drop_exception_state()
        assert rt.stats().host_pool.in_use_bytes == 0, f"raise at layer {k}: a host block is still checked out"
        rt.purge()
        assert rt.stats().pending_copies == 0, f"raise at layer {k}: a copy is still pending after purge"
        evicted_in_failed_step.append(_BOOM["at_raise"][-1][0] - before)
    # The faults came after some evictions (and, with injection, with copies in flight).
    assert evicted_in_failed_step == sorted(evicted_in_failed_step)
    assert 0 < max(evicted_in_failed_step) and min(evicted_in_failed_step) < evicts_per_step, evicted_in_failed_step
    if fault_injection is not None:
        assert any(p > 0 for _, _, p in _BOOM["at_raise"]), "no fault hit a copy in flight"
    # The next steps run, match the reference, and the pool did not grow.
    for _ in range(2):
        sbs.step(batch)
    assert rt.stats().pending_copies == 0
    assert rt.stats().host_pool.held_bytes == held


@pytest.mark.parametrize("fault_injection", FAULT_MODES)
def test_exception_in_backward_after_prefetches_leaves_nothing_behind(fault_injection):
    sbs = SideBySide(BoomMLP, "eager", fault_injection=fault_injection)
    batch = boom_batch()
    sbs.step(batch)
    rt = runtime_of(sbs)
    held = rt.stats().host_pool.held_bytes
    prefetches_per_step = rt.stats().num_prefetches
    _BOOM["runtime"] = rt
    prefetched_in_failed_step = []
    for k in range(len(sbs.model.lins)):
        loss = sbs.compiled(*batch)
        before = rt.stats().num_prefetches
        _BOOM["bw"] = k
        with pytest.raises(RuntimeError, match="injected backward failure"):
            loss.backward()
        _BOOM["bw"] = -1
        del loss
        _drop_exception_state()
        # The failed backward accumulated nothing.
        assert all(p.grad is None for p in sbs.model.parameters())
        assert rt.stats().host_pool.in_use_bytes == 0, f"raise at layer {k}: a host block is still checked out"
        rt.purge()
        assert rt.stats().pending_copies == 0, f"raise at layer {k}: a copy is still pending after purge"
        prefetched_in_failed_step.append(_BOOM["at_raise"][-1][1] - before)
    assert prefetched_in_failed_step == sorted(prefetched_in_failed_step)
    assert 0 < max(prefetched_in_failed_step), prefetched_in_failed_step
    assert min(prefetched_in_failed_step) < prefetches_per_step, prefetched_in_failed_step
    if fault_injection is not None:
        assert any(p > 0 for _, _, p in _BOOM["at_raise"]), "no fault hit a copy in flight"
    for _ in range(2):
        sbs.step(batch)
    assert rt.stats().pending_copies == 0
    assert rt.stats().host_pool.held_bytes == held


def test_after_a_fault_the_next_trinity_op_drops_what_was_left_pending():
    """Without an explicit purge: the first trinity op of the next step drops the copies the
    exception left behind (fault injection, where every copy waits for its wait)."""
    sbs = SideBySide(BoomMLP, "eager", fault_injection=7)
    batch = boom_batch()
    sbs.step(batch)
    rt = runtime_of(sbs)
    _BOOM["runtime"] = rt
    left = []
    for k in range(len(sbs.model.lins)):
        _BOOM["fw"] = k
        with pytest.raises(RuntimeError):
            sbs.compiled(*batch)
        _BOOM["fw"] = -1
        _drop_exception_state()
        stale = list(rt._deferred.values())
        left.append(len(stale))
        # One more evict (as the next step's first trinity op would do) purges first.
        x = torch.randn(8, 8)
        host = ops.evict(x, rt.id)
        assert all(d.done for d in stale)
        assert not any(d in stale for d in rt._deferred.values())
        ops.evict_wait(host, x, rt.id)
        assert torch.equal(host, x)
        assert rt.stats().pending_copies == 0
        del host
    assert any(n > 0 for n in left), "no fault left a copy pending: the test does not exercise the purge"
    sbs.step(batch)


# ------------------------------------------------------------- cases from other offloaders


def _fault_runtime(seed=0, early=0.0, limit=1 << 26):
    return TransferRuntime(torch.device("cpu"), limit, FaultInjection(seed=seed, early_probability=early))


def test_saved_activation_freed_while_its_copy_is_still_running():
    """A D2H copy still running when its source is freed copies garbage. Fault injection defers
    every copy to its wait, so an early free shows as NaN; trinity's graphs keep the source alive
    to the wait, so every copy still in flight at its wait reads live memory."""
    # The detector: free the source before the wait and the host copy is poisoned.
    rt = _fault_runtime()
    x = torch.randn(64, 32)
    host = ops.evict(x, rt.id)
    del x
    gc.collect()
    dev = ops.prefetch(host, torch.device("cpu"), rt.id)
    ops.prefetch_wait(dev, rt.id)
    assert torch.isnan(dev).all()
    # The compiled step: at every evict_wait, is the copy still in flight and its source alive?
    sbs = SideBySide(models.GPTLoss, "eager", fault_injection=11)
    batch = models.gpt_batch()
    sbs.step(batch)
    rt = runtime_of(sbs)
    seen = {"in_flight": 0, "waits": 0}
    original = rt.evict_wait

    def checked_wait(host, src):
        deferred = rt._deferred.get(host.untyped_storage().data_ptr())
        if deferred is not None and not deferred.done:
            seen["in_flight"] += 1
            assert deferred.src() is not None and deferred.src().data_ptr() == src.untyped_storage().data_ptr()
        seen["waits"] += 1
        original(host, src)

    rt.evict_wait = checked_wait
    for _ in range(3):
        sbs.step(batch)
    assert seen["waits"] == 3 * runtime_of(sbs).stats().num_evicts // 4
    assert seen["in_flight"] > 0, "no copy was still in flight at its wait: nothing was tested"


def _pair_with_prefetch_immediately_before_use(rt):
    import dataclasses

    from offload_compiler.passes import cost_model, insert_transfers, liveness, plan_window

    from ._pass_helpers import ROUND
    from .graphs import capture_pair

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
    the_plan = plan_window.plan(live, costs, int(0.6 * live.peak_bytes), 0)
    assert the_plan.evictions
    late = tuple(
        dataclasses.replace(ev, prefetch_before=min(g.wait_before for g in ev.groups)) for ev in the_plan.evictions
    )
    assert late != the_plan.evictions or all(ev.prefetch_before == min(g.wait_before for g in ev.groups) for ev in late)
    the_plan = dataclasses.replace(the_plan, evictions=late)
    original = (copy.deepcopy(pair.forward), copy.deepcopy(pair.backward))
    insert_transfers.apply(pair, live, the_plan, rt.id)
    return pair, original, [w.detach() for w in ws] + [x]


def test_reload_prefetched_immediately_before_use_never_reads_an_unfinished_copy():
    """Prefetches issued right before their first reader (no compute between the H2D copy's
    start and its use): every reader still comes after the wait, and under fault injection
    (copies happen at the wait, or at random earlier ops; fresh buffers are NaN) the gradients
    are bit-equal to the graphs without offloading."""
    from offload_compiler.passes import verify
    from offload_compiler.runtime.ops import PREFETCH, PREFETCH_WAIT

    from .test_faults import _run

    cases = 0
    for early in (0.0, 0.5, 1.0):
        for seed in range(4):
            rt = _fault_runtime(seed=seed, early=early)
            pair, (fw0, bw0), inputs = _pair_with_prefetch_immediately_before_use(rt)
            verify.verify(pair, None)
            nodes = list(pair.backward.graph.nodes)
            order = {n: i for i, n in enumerate(nodes)}
            prefetches = [n for n in nodes if n.target is PREFETCH]
            assert prefetches
            for p in prefetches:
                (wait,) = [u for u in p.users if u.target is PREFETCH_WAIT]
                readers = [u for u in p.users if u is not wait]
                assert readers and all(order[r] > order[wait] for r in readers)
                # Immediately before use: only trinity ops between the prefetch and its wait.
                between = nodes[order[p] + 1 : order[wait]]
                assert all(str(n.target).startswith("trinity.") for n in between), between
            ref = _run(fw0, bw0, inputs, pair.num_fwd_outputs)
            got = _run(pair.forward, pair.backward, inputs, pair.num_fwd_outputs)
            for a, b in zip(ref[1], got[1]):
                assert (a is None and b is None) or torch.equal(a, b)
            assert rt.stats().pending_copies == 0
            cases += 1
    assert cases == 12


@pytest.mark.parametrize("fault_injection", FAULT_MODES)
@pytest.mark.parametrize("case", ["gpt_block", "cnn_batchnorm"])
def test_no_grad_forward_in_training_mode_advances_no_offload_state(case, fault_injection):
    make_model, make_batch = {
        "gpt_block": (models.GPTLoss, models.gpt_batch),
        "cnn_batchnorm": (models.CNN, models.cnn_batch),
    }[case]
    sbs = SideBySide(make_model, "eager", fault_injection=fault_injection)
    batch = make_batch()
    sbs.step(batch)
    sbs.step(batch)
    rt = runtime_of(sbs)
    before = rt.stats()
    n_reports = len(offload_compiler.reports())
    assert sbs.model.training
    with torch.no_grad():
        # Batch norm in training mode updates its running statistics under no_grad too, in both.
        assert_same(sbs.compiled(*batch), sbs.ref(*batch), True, "no_grad loss")
    after = rt.stats()
    assert after == before, f"the no_grad forward touched the offload runtime:\n{before}\n{after}"
    assert len(offload_compiler.reports()) == n_reports, "the no_grad forward was planned as a training graph"
    for p, q in zip(sbs.model.buffers(), sbs.ref_model.buffers()):
        assert torch.equal(p, q)
    for _ in range(2):
        sbs.step(batch)
    s = rt.stats()
    assert s.num_evicts == before.num_evicts + 2 * (before.num_evicts // 2)
    assert s.host_pool.held_bytes == before.host_pool.held_bytes and s.pending_copies == 0
    assert s.host_pool.num_allocations == before.host_pool.num_allocations


def test_huge_host_allocation_fails_cleanly():
    # A request the machine cannot satisfy (2**47 bytes) within a limit that allows it: the
    # allocation itself fails.
    pool = HostPool(1 << 50)
    keep = pool.empty_strided((1000,), (1,), torch.float32)
    keep.fill_(3.0)
    with pytest.raises(HostPoolExhausted) as info:
        pool.empty_strided((1 << 47,), (1,), torch.uint8)
    err = info.value
    assert (err.requested_bytes, err.held_bytes, err.in_use_bytes) == (1 << 47, 4096, 4096)
    assert f"({1 << 47} bytes)" in str(err) and "4.00 KiB" in str(err) and "the allocation failed" in str(err)
    s = pool.stats()
    assert (s.held_bytes, s.num_blocks, s.num_allocations, s.in_use_bytes) == (4096, 1, 1, 4096)
    assert (keep == 3.0).all()
    del keep
    assert pool.release_free() == 4096 and pool.stats().held_bytes == 0


@pytest.mark.parametrize("fault_injection", FAULT_MODES)
def test_host_pool_limit_reached_in_the_middle_of_a_forward(fault_injection):
    """The limit is hit after some evictions of a step: the error names what was asked and what
    the pool holds, the blocks the step took are all free again, and with the limit raised the
    next step is correct."""
    probe = SideBySide(models.MLP, "eager")
    probe.step(models.mlp_batch())
    need = runtime_of(probe).stats().host_pool.held_bytes
    torch._dynamo.reset()
    limit = need // 2
    sbs = SideBySide(
        models.MLP,
        "eager",
        host_pool_limit_bytes=limit,
        on_host_pool_full="error",
        **({"fault_injection": fault_injection} if fault_injection is not None else {}),
    )
    batch = models.mlp_batch()
    with pytest.raises(HostPoolExhausted) as info:
        sbs.compiled(*batch)
    rt = runtime_of(sbs)
    s = rt.stats()
    err = info.value
    asked, held, message = err.requested_bytes, err.held_bytes, str(err)
    assert err.limit_bytes == limit
    # The exception's traceback holds the graph's frames (and their host tensors) while it lives.
    del info, err
    gc.collect()
    assert s.num_evicts > 1, "the limit was hit at the first eviction: nothing taken to give back"
    assert held == rt.stats().host_pool.held_bytes and held + asked > limit
    assert f"({asked} bytes)" in message
    assert rt.stats().host_pool.in_use_bytes == 0
    rt.purge()
    assert rt.stats().pending_copies == 0
    rt.pool.limit_bytes = 4 * need
    for _ in range(2):
        sbs.step(batch)
    assert rt.stats().pending_copies == 0


class PartlyFrozen(nn.Module):
    def __init__(self, d=128, depth=6):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        for p in self.lins[1].parameters():
            p.requires_grad_(False)
        self.lins[3].bias.requires_grad_(False)

    def forward(self, x, y):
        h = x
        for lin in self.lins:
            h = torch.tanh(lin(h))
        return F.mse_loss(h, y)


@pytest.mark.parametrize("fault_injection", FAULT_MODES)
def test_parameters_keep_requires_grad_and_grads_accumulate(fault_injection):
    sbs = SideBySide(PartlyFrozen, "eager", budget="65%", fault_injection=fault_injection)
    params = list(sbs.model.parameters())
    flags = [p.requires_grad for p in params]
    assert not all(flags) and any(flags)
    batches = [boom_batch(2048) for _ in range(3)]
    for _ in range(2):
        sbs.step(batches[0])
    assert sbs.reports()[0].num_evicted > 0
    # Micro-steps accumulating into existing .grad tensors (not zeroed between steps).
    for step in range(2):
        for b in batches:
            (sbs.ref(*b) / 3).backward()
            (sbs.compiled(*b) / 3).backward()
            sbs.check_grads(f"accumulation step {step}")
    for p, q, flag in zip(sbs.model.parameters(), params, flags):
        assert p is q and p.is_leaf and p.requires_grad == flag
        assert (p.grad is None) == (not flag)
    frozen_before = [p.detach().clone() for p in params if not p.requires_grad]
    sgd_(sbs.model)
    sgd_(sbs.ref_model)
    assert all(torch.equal(a, p) for a, p in zip(frozen_before, [p for p in params if not p.requires_grad]))
