"""Reliability: faults in the middle of a compiled step, cases that broke other offloaders, long
runs, threads, and what trinity does not support.

Exceptions are raised from inside the compiled graphs by a custom op (``reltest::boom`` in the
forward, ``reltest::boom_bw`` in its backward) that counts its calls: the k-th call raises. Dynamo
and AOTAutograd see an opaque op, so the count is read at run time, never guarded on.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from offload_compiler.runtime.transfer import TransferRuntime, _registry

from .test_e2e import SideBySide

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
