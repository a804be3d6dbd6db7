"""Reliability: faults in the middle of a compiled step, cases that broke other offloaders, long
runs, threads, and what trinity does not support.

Exceptions are raised from inside the compiled graphs by a custom op (``reltest::boom`` in the
forward, ``reltest::boom_bw`` in its backward) that counts its calls: the k-th call raises. Dynamo
and AOTAutograd see an opaque op, so the count is read at run time, never guarded on.
"""

from __future__ import annotations

import copy
import gc
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import offload_compiler
from offload_compiler import measure_peak_device_bytes
from offload_compiler.runtime.pool import HostPool, HostPoolExhausted
from offload_compiler.runtime.transfer import FaultInjection, TransferRuntime, _registry

from . import models
from .test_e2e import PEAK_SLACK_BYTES, SideBySide, assert_same, sgd_

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
    from offload_compiler.ir.ops import PREFETCH, PREFETCH_WAIT
    from offload_compiler.passes import verify

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


@pytest.mark.parametrize("case, fault_injection", [("gpt_block", None), ("gpt_block", 1234), ("cnn_batchnorm", 1234)])
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
    # MLP on 4096 rows: its evicted activations are 2 MiB each (a 2 MiB block each); two fit.
    limit = 5 * 2**20
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
    rt.pool.limit_bytes = 64 * 2**20
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


# ---------------------------------------------------------------------- unsupported inputs


class MyParameter(nn.Parameter):
    """A ``Parameter`` subclass (as some libraries use to tag parameters)."""


def _assert_trains_like_aot_eager(make_model, batch, budget="60%", steps=2):
    sbs = SideBySide(make_model, "eager", budget=budget)
    for _ in range(steps):
        sbs.sync()
        ref = sbs.ref(*batch)
        ref.backward()
        loss = sbs.compiled(*batch)
        loss.backward()
        assert type(loss) is type(ref)
        assert torch.equal(loss.detach(), ref.detach()) if type(loss) is torch.Tensor else torch.equal(loss.a, ref.a)
        for (name, p), q in zip(sbs.model.named_parameters(), sbs.ref_model.parameters()):
            assert type(p) is type(q) and type(p.grad) is type(q.grad), name
            assert torch.equal(p.grad, q.grad), f"grad of {name}"
        sgd_(sbs.model)
        sgd_(sbs.ref_model)
        sbs.model.zero_grad(set_to_none=True)
        sbs.ref_model.zero_grad(set_to_none=True)
    (r,) = sbs.reports()
    return r


def test_parameter_subclass_trains_and_offloads():
    def make():
        torch.manual_seed(0)
        m = BoomMLP(depth=6)
        for lin in m.lins:
            lin.weight = MyParameter(lin.weight.detach().clone())
        return m

    r = _assert_trains_like_aot_eager(make, boom_batch(2048))
    assert r.num_evicted > 0 and r.not_offloaded == ()


def test_wrapper_subclass_input_and_parameters_are_offloaded_as_their_plain_parts():
    """A traceable ``__torch_dispatch__`` wrapper subclass (``TwoTensor``) is flattened by
    AOTAutograd before trinity sees the graph: its activations are plain tensors, offloaded like
    any other, with bit-equal results."""
    from torch.testing._internal.two_tensor import TwoTensor

    x, y = boom_batch(2048)
    r = _assert_trains_like_aot_eager(BoomMLP, (TwoTensor(x, 2 * x), y))
    assert r.num_evicted > 0

    def make():
        torch.manual_seed(0)
        m = BoomMLP(depth=6)
        for lin in m.lins:
            w = lin.weight.detach()
            lin.weight = nn.Parameter(TwoTensor(w.clone(), w.clone()))
        return m

    torch._dynamo.reset()
    r = _assert_trains_like_aot_eager(make, (x, y))
    assert r.num_evicted > 0


def test_non_plain_saved_tensors_are_kept_with_a_reason():
    """A saved tensor liveness cannot account as plain strided memory (a subclass or sparse value
    that reaches the partitioned graph) is never a candidate, and says why."""
    from offload_compiler.passes import liveness

    from .graphs import capture_pair

    torch.manual_seed(0)
    w = torch.randn(32, 32, requires_grad=True)
    pair = capture_pair(lambda w, x: torch.tanh(x @ w).sum(), w, torch.randn(64, 32), static=(0,))
    (before,) = [st for st in liveness.analyze(pair).saved if st.evictable]
    (node,) = [n for n in pair.forward.graph.nodes if n.name == before.fw_node]
    node.meta["val"] = _as_sparse_meta(node.meta["val"])
    live = liveness.analyze(pair)
    (st,) = [s for s in live.saved if s.fw_node == before.fw_node]
    assert not st.evictable and st.reason == "not a plain strided tensor (subclass or sparse)"
    assert not [b for b in live.candidates() if before.index in b.saved]


def _as_sparse_meta(val):
    with val.fake_mode if hasattr(val, "fake_mode") else torch._subclasses.FakeTensorMode():
        return torch.empty(val.shape, dtype=val.dtype).to_sparse()


@pytest.fixture
def gloo_world():

    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    # An in-process store: no TCP port that a concurrent job could already hold.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
        gc.collect()  # no gloo group may outlive the test: one alive at exit aborts the process


class AllReduceMLP(nn.Module):
    def __init__(self, d=128, depth=6):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))

    def forward(self, x, y):
        import torch.distributed._functional_collectives as fc

        h = x
        for i, lin in enumerate(self.lins):
            h = torch.tanh(lin(h))
            if i == 2:
                h = fc.all_reduce(h, "sum", torch.distributed.group.WORLD)
        return F.mse_loss(h, y)


def test_buffers_of_a_collective_are_not_offloaded_and_the_report_says_why(gloo_world):
    """A functional all-reduce traces on CPU (gloo, one process). Its input and output storages
    stay on the device (the collective's stream is not ordered with trinity's copies); the rest
    is offloaded and the gradients are bit-equal."""
    r = _assert_trains_like_aot_eager(AllReduceMLP, boom_batch(2048), budget="75%")
    assert r.num_evicted > 0
    kept = dict(r.not_offloaded)
    assert len(kept) == 2, kept
    assert all("collective" in why and "_c10d_functional" in why for why in kept.values())
    assert any("all_reduce" in why for why in kept.values()) and any("wait_tensor" in why for why in kept.values())
    assert "kept       2 saved tensors on the device" in r.summary()


# ---------------------------------------------------------------------- long runs, threads


def counting_trinity(options):
    """A backend that counts its compilations (``.calls``) and otherwise is trinity."""
    from offload_compiler.backend import trinity

    def backend(gm, example_inputs):
        backend.calls += 1
        return trinity(gm, example_inputs, options=options)

    backend.calls = 0
    return backend


def test_a_hundred_demo_steps_flat_pool_flat_peak_one_compile():
    from offload_compiler.demo import Batches, _LossModel, load_corpus
    from offload_compiler.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
    batches = Batches(load_corpus(1 << 16), batch_size=16, seq_len=32)
    torch.manual_seed(0)
    ref_model = _LossModel(GPT(cfg))
    model = copy.deepcopy(ref_model)
    backend = counting_trinity({"memory_budget": "50%", "inner": "eager", "min_offload_bytes": 0})
    before = len(offload_compiler.reports())
    compiled = torch.compile(model, backend=backend)
    ref = torch.compile(ref_model, backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=3e-3)
    cpu = torch.device("cpu")
    peaks, held, allocations = {}, [], []
    for step in range(100):
        x, y = batches.batch(step, cpu)
        if step in (2, 50, 99):
            resident = list(model.parameters()) + [x, y]
            m = measure_peak_device_bytes(lambda x=x, y=y: compiled(x, y).backward(), resident=resident, device="cpu")
            peaks[step] = m.peak_bytes
            # The measured step's gradients are discarded; recompute the step to stay in lockstep.
            opt.zero_grad(set_to_none=True)
        loss = compiled(x, y)
        loss.backward()
        ref_loss = ref(x, y)
        ref_loss.backward()
        assert torch.equal(loss.detach(), ref_loss.detach()), f"step {step}"
        for opt_ in (opt, ref_opt):
            opt_.step()
            opt_.zero_grad(set_to_none=True)
        (r,) = offload_compiler.reports()[before:]
        stats = r.runtime_stats()
        held.append(stats.host_pool.held_bytes)
        allocations.append(stats.host_pool.num_allocations)
        assert stats.pending_copies == 0
    assert backend.calls == 1 and len(offload_compiler.reports()) == before + 1, "recompiled"
    assert r.num_evicted > 0
    assert len(set(held[1:])) == 1 and len(set(allocations[1:])) == 1, "host pool grew after the second step"
    assert len(set(peaks.values())) == 1, f"measured peak drifted: {peaks}"
    assert peaks[99] <= r.budget_bytes + PEAK_SLACK_BYTES
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


def test_two_models_trained_in_two_threads_at_once():
    """Two trinity-compiled models (their own runtimes and pools) trained concurrently in two
    threads; each matches its reference trained alone."""
    cases = [(models.GPTLoss, models.gpt_batch()), (models.MLP, models.mlp_batch(2048))]
    torch.manual_seed(0)
    refs = [make() for make, _ in cases]
    mines = [copy.deepcopy(m) for m in refs]
    opts = {"memory_budget": "50%", "inner": "eager", "min_offload_bytes": 0}
    compiled = [torch.compile(m, backend="trinity", options=opts) for m in mines]
    ref_grads = []
    for m, (_, batch) in zip(refs, cases):
        grads = []
        fn = torch.compile(m, backend="aot_eager")
        for _ in range(4):
            fn(*batch).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
            sgd_(m)
            m.zero_grad(set_to_none=True)
        ref_grads.append(grads)
    barrier = threading.Barrier(2)
    results: list = [None, None]

    def train(i):
        try:
            m, fn, (_, batch) = mines[i], compiled[i], cases[i]
            barrier.wait()
            grads = []
            for _ in range(4):
                fn(*batch).backward()
                grads.append([p.grad.clone() for p in m.parameters()])
                sgd_(m)
                m.zero_grad(set_to_none=True)
            results[i] = grads
        except BaseException as exc:  # reported below
            results[i] = exc

    before = len(offload_compiler.reports())
    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for i, res in enumerate(results):
        assert not isinstance(res, BaseException), f"thread {i} raised {res!r}"
        assert res is not None, f"thread {i} did not finish"
        for step, (got, want) in enumerate(zip(res, ref_grads[i])):
            for a, b in zip(got, want):
                assert torch.equal(a, b), f"model {i} step {step}"
    reports = offload_compiler.reports()[before:]
    assert len(reports) == 2 and len({r.runtime_id for r in reports}) == 2
    for r in reports:
        s = r.runtime_stats()
        assert r.num_evicted > 0 and s.num_evicts == 4 * r.num_evicted and s.pending_copies == 0


def test_dynamic_batch_sizes_under_fault_injection_one_compile():
    """``dynamic=True`` (tests/test_e2e.py checks parity and memory at three sizes); here the
    copies of every size go through the fault-injection runtime: one compile, exact gradients."""
    sbs = SideBySide(models.MLP, "eager", dynamic=True, fault_injection=5)
    for n in (3072, 2048, 1024, 3072):  # largest first: plans are guarded to their planned sizes
        sbs.step(models.mlp_batch(n))
    (r,) = sbs.reports()
    s = r.runtime_stats()
    assert s.num_evicts == 4 * r.num_evicted and s.pending_copies == 0


def test_demo_refusal_prints_the_message_and_exits_2(capsys, tmp_path):
    """``demo --budget 25%`` (below what any plan reaches for the demo GPT): the refusal's message
    with the budget that runs, exit status 2, no traceback (a fresh-user trial got 92 lines of
    Dynamo's traceback); a malformed budget fails before the reference run."""
    from offload_compiler.demo import main

    torch._dynamo.reset()
    assert main(["--budget", "25%", "--steps", "1", "--dump-dir", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "trinity refused the budget '25%'" in out and "Traceback" not in out
    assert "The lowest budget that runs is memory_budget=" in " ".join(out.split())
    with pytest.raises(SystemExit) as info:
        main(["--budget", "0.5"])
    assert info.value.code == 2
    assert "(a fraction is written as a percentage: '50%')" in capsys.readouterr().err
