"""Measured op times (``op_times="measured"``, ``passes/op_timing.py``): what is timed, what is
not, how the cost model uses the times, and a compiled model that plans with them."""

import copy
import dataclasses
import math
import os
import subprocess
import sys
import time
import warnings
from types import MappingProxyType

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

import offload_compiler
from offload_compiler import host_load
from offload_compiler.passes import cost_model, liveness, op_timing

from . import models
from ._pass_helpers import ROUND, tanh_mm_pair

CPU_HOST = dataclasses.replace(ROUND, host_is_device=True)


def graph_nodes(pair):
    return [*pair.forward.graph.nodes, *pair.backward.graph.nodes]


def test_each_distinct_aten_call_is_timed_once_and_views_only_on_the_host(monkeypatch):
    pair = tanh_mm_pair()
    nodes = graph_nodes(pair)
    calls = []
    real = op_timing._time_call
    monkeypatch.setattr(op_timing, "_time_call", lambda fn, *a: calls.append(fn) or real(fn, *a))
    times = op_timing.measure(nodes, "cpu", host_is_device=True)
    aten = [n for n in nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
    keys = {op_timing.timing_key(n) for n in aten}
    assert None not in keys
    assert set(times.seconds) == keys and len(calls) == len(keys) and times.skipped == ()
    assert dict(times.not_timed) == {}
    assert all(math.isfinite(s) and s > 0 for s in times.seconds.values())
    assert times.device == "cpu" and times.threads == torch.get_num_threads()
    for n in aten:
        assert times.seconds_of(n) == times.seconds[op_timing.timing_key(n)]
    # Placeholders, getitem and outputs have no call to time.
    assert all(times.seconds_of(n) is None for n in nodes if n not in aten)
    # Known calls are not timed again.
    calls.clear()
    again = op_timing.measure(nodes, "cpu", host_is_device=True, known=times)
    assert calls == [] and dict(again.seconds) == dict(times.seconds)
    # Off the host the views' dispatch overlaps the device's work: they are not timed.
    off_host = op_timing.measure(nodes, "cpu", host_is_device=False)
    views = {op_timing.timing_key(n) for n in aten if op_timing._is_view(n)}
    assert views and set(off_host.seconds) == keys - views


def fake_graph(build):
    """An FX graph built by ``build(graph, fake_mode)`` whose nodes carry fake ``meta["val"]``."""
    g = fx.Graph()
    with FakeTensorMode() as mode:
        build(g, mode)
    return list(g.nodes)


def test_bigger_calls_measure_longer():
    def build(g, mode):
        for n in (8, 384):
            a = g.placeholder(f"a{n}")
            a.meta["val"] = torch.empty(n, n)
            mm = g.call_function(torch.ops.aten.mm.default, (a, a))
            mm.meta["val"] = torch.empty(n, n)

    nodes = fake_graph(build)
    times = op_timing.measure(nodes, "cpu", host_is_device=True)
    small, large = (times.seconds_of(n) for n in nodes if n.op == "call_function")
    # 2*384^3 = 113 MFLOP against 1 kFLOP: at any CPU's rate far longer, not only by its call's cost.
    assert large > 20 * small > 0


def test_calls_it_cannot_time_are_left_to_the_roofline_with_the_reason():
    def build(g, mode):
        x = g.placeholder("x")
        x.meta["val"] = torch.empty(4, 3)
        nz = g.call_function(torch.ops.aten.nonzero.default, (x,))
        nz.meta["val"] = torch.empty(2, 2, dtype=torch.long)
        # Shapes that do not multiply (a graph the method cannot rebuild): the call raises.
        z = g.placeholder("z")
        z.meta["val"] = torch.empty(5, 3)
        for a in (x, z):  # two distinct calls
            bad = g.call_function(torch.ops.aten.mm.default, (a, a))
            bad.meta["val"] = torch.empty(a.meta["val"].shape[0], 3)
        other = g.call_function(torch.ops.trinity.fence.default, (x,))  # not aten: the copy formula's
        other.meta["val"] = torch.empty(4, 3)

    nodes = fake_graph(build)
    times = op_timing.measure(nodes, "cpu", host_is_device=True)
    assert len(times) == 0
    calls = {}
    for op, why, n in times.skipped:
        calls[op] = calls.get(op, 0) + n
        if op == "aten::mm.default":
            assert why.startswith("RuntimeError: mat1 and mat2 shapes cannot be multiplied"), why
        else:  # nonzero of the built (random normal) input: all 12 elements; the graph says 2.
            assert why == "its output shape depends on the data (on built inputs [(12, 2)], in the graph [(2, 2)])"
    assert calls == {"aten::mm.default": 2, "aten::nonzero.default": 1}
    assert len(times.not_timed) == 3
    assert op_timing.timing_key(nodes[-1]) is None
    # Known calls that could not be timed are not tried again.
    again = op_timing.measure(nodes, "cpu", host_is_device=True, known=times)
    assert dict(again.not_timed) == dict(times.not_timed)


def test_index_with_integer_lists_and_integer_division_are_timed():
    def build(g, mode):
        x = g.placeholder("x")
        x.meta["val"] = torch.empty(8, 6)
        i = g.placeholder("i")
        i.meta["val"] = torch.empty(3, dtype=torch.long)
        # torch tags index.Tensor dynamic_output_shape (a bool mask would make it so); with
        # integer indices its output has the graph's shape and is timed.
        ix = g.call_function(torch.ops.aten.index.Tensor, (x, [None, i]))
        ix.meta["val"] = torch.empty(8, 3)
        # Zeros would divide by zero: ones are tried next.
        d = g.call_function(torch.ops.aten.floor_divide.default, (i, i))
        d.meta["val"] = torch.empty(3, dtype=torch.long)

    nodes = fake_graph(build)
    times = op_timing.measure(nodes, "cpu", host_is_device=True)
    assert times.skipped == () and len(times) == 2


def test_timing_random_ops_leaves_the_random_numbers_of_the_training_unchanged():
    def build(g, mode):
        x = g.placeholder("x")
        x.meta["val"] = torch.empty(64, 64)
        d = g.call_function(torch.ops.aten.native_dropout.default, (x, 0.5, True))
        d.meta["val"] = (torch.empty(64, 64), torch.empty(64, 64, dtype=torch.bool))

    nodes = fake_graph(build)
    torch.manual_seed(3)
    expected = torch.rand(8)
    torch.manual_seed(3)
    times = op_timing.measure(nodes, "cpu", host_is_device=True)
    assert len(times) == 1  # the dropout was timed (it drew numbers) ...
    assert torch.equal(torch.rand(8), expected)  # ... and the generator is where it was


def test_the_cost_model_uses_the_measured_seconds_where_it_has_them():
    pair = tanh_mm_pair()
    live = liveness.analyze(pair)
    nodes = graph_nodes(pair)
    mm = next(n for n in nodes if n.name == "mm")
    tanh = next(n for n in nodes if n.name == "tanh")
    times = op_timing.OpTimes(MappingProxyType({op_timing.timing_key(mm): 0.25}))
    rough = cost_model.estimate(pair, live, ROUND)
    measured = cost_model.estimate(pair, live, dataclasses.replace(ROUND, op_times=times))
    i_mm, i_tanh = nodes.index(mm), nodes.index(tanh)
    assert measured.step_seconds[i_mm] == 0.25
    # FLOPs and bytes are still counted; a call not measured keeps its roofline time.
    assert measured.step_flops[i_mm] == rough.step_flops[i_mm] == 60
    assert measured.step_seconds[i_tanh] == rough.step_seconds[i_tanh]
    assert measured.compute_seconds == pytest.approx(rough.compute_seconds - rough.step_seconds[i_mm] + 0.25)
    # The times are not part of the figures' identity.
    assert dataclasses.replace(ROUND, op_times=times) == ROUND


@pytest.mark.parametrize(("inner", "dynamic"), [("eager", False), ("eager", True), ("inductor", False)])
def test_a_model_planned_with_measured_times_trains_like_eager(inner, dynamic):
    torch.manual_seed(0)
    ref = models.MLP()
    model = copy.deepcopy(ref)
    before = len(offload_compiler.reports())
    compiled = torch.compile(
        model,
        backend="trinity",
        dynamic=dynamic,
        options={"memory_budget": "50%", "inner": inner, "min_offload_bytes": 0, "op_times": "measured"},
    )
    ref_c = torch.compile(ref, backend={"eager": "aot_eager", "inductor": "inductor"}[inner], dynamic=dynamic)
    for n in (4096, 2048) if dynamic else (4096, 4096):
        x, y = models.mlp_batch(n)
        for m in (compiled, ref_c):
            m(x, y).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            if inner == "eager":
                assert torch.equal(p.grad, q.grad)
            else:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
            p.grad = q.grad = None
    (r,) = offload_compiler.reports()[before:]
    assert r.num_evicted > 0 and r.peak_bytes_planned <= r.budget_bytes
    # (A busy host adds a note to the line: test_busy_host_is_warned_about.)
    assert r.op_times.startswith("measured: ") and " calls on cpu, 0 left to the roofline" in r.op_times
    assert int(r.op_times.split()[1]) > 0 and r.op_times_not_timed == ()
    assert dict(r.pass_seconds)["op_timing"] > 0
    assert "node times: measured" in r.summary()


@pytest.mark.parametrize("op_times", ["roofline", "measured"])
def test_data_dependent_shapes_compile_and_match_eager(op_times):
    # capture_dynamic_output_shape_ops puts h[h > 0] in the graph with an unbacked size and an
    # aten._assert_scalar check, which returns nothing (liveness once refused it for having no
    # meta["val"]; found by the fresh-user trial).
    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(50, 16)
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, idx):
            h = self.lin(self.emb(idx))
            return h[:, [0, 2, 3]].sum() + h[h > 0].sum()

    torch.manual_seed(0)
    ref = Masked()
    model = copy.deepcopy(ref)
    opts = {"memory_budget": "50%", "inner": "eager", "min_offload_bytes": 0, "on_infeasible": "warn"}
    compiled = torch.compile(model, backend="trinity", options={**opts, "op_times": op_times})
    ref_c = torch.compile(ref, backend="aot_eager")
    idx = torch.randint(0, 50, (4, 8))
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        with pytest.warns(UserWarning):
            compiled(idx).backward()
        ref_c(idx).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


class _Load:
    """Stands for :class:`~offload_compiler.host_load.OtherLoad` with a set ``fraction``."""

    fraction = 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


@pytest.mark.parametrize("fraction", [0.6, 0.05])
def test_busy_host_is_warned_about(monkeypatch, fraction):
    """Op times measured while other processes held the CPU are suspect (descheduled OpenMP
    workers: a 1 MiB mul at 5-12 ms instead of 0.035 ms): the compile warns and the report's
    op_times line says so; below host_load.BUSY_FRACTION nothing is said."""
    load = type("Load", (_Load,), {"fraction": fraction})
    monkeypatch.setattr(op_timing, "OtherLoad", load)
    times = op_timing.measure(graph_nodes(tanh_mm_pair()), "cpu", host_is_device=True)
    assert times.other_load == fraction
    # Merged with earlier times: the larger of the two loads, kept where nothing new is timed.
    again = op_timing.measure(graph_nodes(tanh_mm_pair()), "cpu", host_is_device=True, known=times)
    assert again.other_load == fraction
    torch._dynamo.reset()
    before = len(offload_compiler.reports())
    model = models.MLP()
    compiled = torch.compile(
        model,
        backend="trinity",
        options={"memory_budget": "50%", "inner": "eager", "min_offload_bytes": 0, "op_times": "measured"},
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compiled(*models.mlp_batch(1024)).backward()
    busy = [str(w.message) for w in seen if "other processes used" in str(w.message)]
    (r,) = offload_compiler.reports()[before:]
    if fraction >= host_load.BUSY_FRACTION:
        (text,) = busy
        assert f"other processes used {fraction:.0%} of this machine's {os.cpu_count()} CPU core" in text
        assert "op_times='roofline'" in text and "idle machine" in text
        assert r.op_times.endswith(
            f"; other processes used {fraction:.0%} of the CPU while they were timed, so they may be far off"
        )
    else:
        assert busy == [] and "other processes" not in r.op_times


def test_other_load_counts_processes_outside_this_one():
    """A busy process that is not this one's descendant counts as other load (this process's own
    work and its children's, such as Inductor's compile workers, are left out by construction)."""
    if host_load.busy_seconds() is None:
        pytest.skip("no /proc here")
    # A spinning process reparented away from this one (its shell parent exits at once).
    spin = "import time; end = time.time() + 1.5\nwhile time.time() < end: pass"
    subprocess.run(["sh", "-c", f"{sys.executable} -c '{spin}' >/dev/null 2>&1 &"], check=True)
    time.sleep(0.2)
    with host_load.OtherLoad() as other:
        time.sleep(1.0)
    cores = os.cpu_count() or 1
    assert other.fraction is not None
    # At least most of one core of others (more where other work shares the machine).
    assert 0.7 / cores <= other.fraction <= 1.0
