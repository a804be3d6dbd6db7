"""Asynchronous parameter copies (``offload="activations+params"`` / ``"all"``).

``param_fetch`` issues the host-to-device copy and ``param_fetch_wait`` (before the first reader)
waits for it; ``grad_to_host`` issues the gradient's device-to-host copy (into a staging block
when accumulating) and ``grad_to_host_wait`` keeps the device gradient alive until it is done.
On the CPU the copies are synchronous, except under ``fault_injection``, where each is deferred
to its wait: the parity tests of ``test_model_state`` run again in that mode, and a missing wait
shows as wrong values.
"""

import functools

import pytest
import torch

from offload_compiler.devices import KNOWN_DEVICES
from offload_compiler.ir.ops import (
    GRAD_TO_HOST,
    GRAD_TO_HOST_WAIT,
    PARAM_FETCH,
    PARAM_FETCH_WAIT,
    PARAM_RELEASE,
)
from offload_compiler.passes import cost_model, liveness, param_residency
from offload_compiler.passes.simulate import simulate
from offload_compiler.runtime.model_state import ParamSlot
from offload_compiler.runtime.pool import HostPool
from offload_compiler.runtime.transfer import FaultInjection, TransferRuntime

from . import test_model_state as tms
from .graphs import mlp_pair
from .test_model_state import SMALL, batch, pair

ops = torch.ops.trinity


def runtime(early=0.0, seed=0):
    """A CPU runtime whose copies are deferred to their waits (never earlier with ``early=0``)."""
    return TransferRuntime(torch.device("cpu"), 1 << 24, FaultInjection(seed=seed, early_probability=early))


def released_slot(shape=(64, 32), host_grad=False):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(*shape))
    value = p.detach().clone()
    slot = ParamSlot(p, HostPool(1 << 24), keep_resident=False)
    if host_grad:
        slot.enable_host_grad()
    slot.release(write_back=False)
    assert p.untyped_storage().nbytes() == 0
    return p, slot, value


# ------------------------------------------------------------------ the ops, one by one


def test_fetch_issues_and_its_wait_completes_the_copy():
    rt = runtime()
    p, slot, value = released_slot()
    with torch.no_grad():
        ops.param_fetch(p, slot.id, rt.id)
        early = p.detach().clone()  # a reader before the wait: the copy has not landed
        ops.param_fetch_wait(p, slot.id, rt.id)
    assert torch.isnan(early).all()
    assert torch.equal(p.detach(), value)
    assert rt.stats().pending_copies == 0
    # Resident: a second fetch issues nothing and its wait is a no-op.
    with torch.no_grad():
        ops.param_fetch(p, slot.id, rt.id)
        assert rt.stats().pending_copies == 0
        ops.param_fetch_wait(p, slot.id, rt.id)
    assert torch.equal(p.detach(), value) and slot.num_fetches == 1


def test_release_with_write_back_copies_before_freeing():
    rt = runtime(early=0.5)
    p, slot, value = released_slot()
    with torch.no_grad():
        ops.param_fetch(p, slot.id, rt.id)
        ops.param_fetch_wait(p, slot.id, rt.id)
        p.mul_(3)  # the user's optimizer stepped the device copy
        ops.param_release(p, slot.id, True, rt.id)
    assert p.untyped_storage().nbytes() == 0
    assert torch.equal(slot.master, value * 3)
    assert rt.stats().pending_copies == 0


def test_parameter_and_activation_copies_share_a_runtime_without_colliding():
    rt = runtime()
    p, slot, value = released_slot()
    x = torch.randn(64, 32)
    with torch.no_grad():
        host = ops.evict(x, rt.id)
        ops.param_fetch(p, slot.id, rt.id)
        ops.evict_wait(host, x, rt.id)
        dev = ops.prefetch(host, torch.device("cpu"), rt.id)
        ops.param_fetch_wait(p, slot.id, rt.id)
        ops.prefetch_wait(dev, rt.id)
    assert torch.equal(dev, x) and torch.equal(p.detach(), value)
    assert rt.stats().pending_copies == 0


def test_cpu_optimizer_update_waits_for_the_fetch_copy_reading_the_master():
    """Hazard (a): the CPU optimizer must not write a master while a copy from it is in flight.
    The worker's host-side wait (``sync_master_copies``) completes the copy first; without it the
    device would get the updated value in the middle of the step."""
    for sync in (True, False):
        rt = runtime()
        p, slot, value = released_slot()
        with torch.no_grad():
            ops.param_fetch(p, slot.id, rt.id)
            if sync:
                slot.sync_master_copies()
            slot.master.add_(1.0)  # the update (on the worker thread in CPUOptimizer)
            ops.param_fetch_wait(p, slot.id, rt.id)
        assert torch.equal(p.detach(), value if sync else value + 1.0), sync


def test_staged_gradient_accumulation_is_exact_and_frees_its_staging():
    rt = runtime(early=0.3)
    p, slot, _ = released_slot((8, 16), host_grad=True)
    torch.manual_seed(1)
    # A transposed first gradient (layout unlike the host gradient's) goes through staging too.
    gs = [torch.randn(16, 8).t(), torch.randn(8, 16), torch.randn(8, 16), torch.randn(8, 16)]
    expected = gs[0].clone()
    for g in gs[1:]:
        expected.add_(g)
    for g in gs:
        ops.grad_to_host(g, slot.id, rt.id)
        ops.grad_to_host_wait(g, slot.id, rt.id)
    assert slot.num_grads == 4 and slot.grad_valid
    slot.finish_grad()
    assert torch.equal(slot.grad, expected)
    # Staged adds are reaped as their copies complete: no staging block stays in use.
    assert rt.pool.stats().in_use_bytes == 0
    assert rt.stats().pending_copies == 0


def test_gradient_freed_before_its_copy_shows_nan():
    rt = runtime()
    p, slot, _ = released_slot((8, 16), host_grad=True)
    g = torch.randn(8, 16)
    ops.grad_to_host(g, slot.id, rt.id)
    del g  # no grad_to_host_wait kept it alive: the copy reads freed memory
    slot.finish_grad()
    assert torch.isnan(slot.grad).all()


# ------------------------------------------------------------------ planner and simulation


def _plans(depth=4, width=512):
    pair_ = mlp_pair(batch=64, width=width, depth=depth)
    live = liveness.analyze(pair_)
    costs = cost_model.estimate(pair_, live, KNOWN_DEVICES["a100-80gb"])
    chosen = {i: (100 + i, 0) for i in pair_.static_input_indices}
    plans = {
        w: param_residency.plan(pair_, live, costs, chosen, "all", live.live_bytes(), None, use_windows=w)
        for w in (True, False)
    }
    return pair_, live, costs, plans


def test_plan_places_waits_at_first_readers_and_grad_waits_after_the_copy_time():
    pair_, live, costs, plans = _plans()
    windowed, tight = plans[True], plans[False]
    assert windowed.max_window_steps > 0
    for p in windowed.params:
        buf = live.buffers[p.buffer]
        assert p.fw_wait_before == min(s for s in buf.use_steps if s < live.num_fw_steps)
        assert p.fw_fetch_before <= p.fw_wait_before
        if p.bw_fetch_before is not None:
            assert p.bw_fetch_before <= p.bw_wait_before
        assert p.grad_to_host_after <= p.grad_wait_after <= live.num_steps - 2
    assert any(p.grad_wait_after > p.grad_to_host_after for p in windowed.params)
    assert all(p.grad_wait_after == p.grad_to_host_after for p in tight.params)
    # The gradient's device memory counts until its wait, in the view the activation planner
    # plans on and in the plan's own predicted peak.
    view = param_residency.activation_view(live, windowed)
    for p in windowed.params:
        assert view.buffers[p.grad_buffer].last_step == p.grad_wait_after
    assert windowed.peak_bytes == int(view.live_bytes().max())


def test_copy_tasks_follow_the_window():
    pair_, live, costs, plans = _plans()
    exposed = {}
    for w, the_plan in plans.items():
        tasks = param_residency.copy_tasks(the_plan, costs)
        assert len(tasks) == sum(
            1 + (p.bw_fetch_before is not None) + (p.grad_to_host_after is not None) for p in the_plan.params
        )
        exposed[w] = simulate(costs.step_seconds, tasks).exposed_seconds
    # Issued a window ahead, the copies hide (in part) under compute; fetched at the reader and
    # waited for right after the gradient, they are all exposed.
    assert 0 <= exposed[True] < exposed[False]


# ------------------------------------------------------------------ end to end


PARITY_TESTS = [
    tms.test_activations_params_gradients_and_updates_bit_identical,
    tms.test_all_parity_gpt_adamw_accumulation_clipping_checkpoint,
    tms.test_overlap_backward_updates_start_during_the_backward_and_match,
    tms.test_all_eval_under_no_grad_between_steps,
    tms.test_all_with_activation_budget_parity_and_measured_peak,
    tms.test_state_dict_hooks_between_steps_without_materialized,
]


@pytest.mark.parametrize("test", PARITY_TESTS, ids=lambda t: t.__name__)
def test_parity_tests_under_fault_injection(test, monkeypatch):
    """The parity tests, unchanged, with every parameter copy deferred to its wait (or a random
    earlier trinity op): bit-identical to eager AdamW with "all" (gradient accumulation over 4
    micro-steps through staging blocks, clipping, a checkpoint round trip), to the user's own
    AdamW with "activations+params", and with overlap="backward"."""
    torch._dynamo.reset()
    monkeypatch.setenv("TRINITY_FAULT_INJECTION", "7")
    test()
    torch._dynamo.reset()


def _drop_first(target, graph_name):
    """``param_residency.apply`` followed by erasing the first inserted node with ``target``
    from one graph (a planner bug that forgot one wait)."""
    real = param_residency.apply

    @functools.wraps(real)
    def apply(pair_, plan, step_nodes, rt, **kwargs):
        real(pair_, plan, step_nodes, rt, **kwargs)
        gm = getattr(pair_, graph_name)
        node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is target)
        gm.graph.erase_node(node)
        gm.recompile()

    return apply


@pytest.fixture
def no_early_completion(monkeypatch):
    """Fault injection whose deferred copies complete only at their waits (never at random
    earlier points), so a missing wait gives wrong values every time."""
    import offload_compiler.backend as backend

    monkeypatch.setattr(backend, "FaultInjection", functools.partial(FaultInjection, early_probability=0.0))


def test_a_missing_param_fetch_wait_is_refused_by_the_verifier(monkeypatch):
    monkeypatch.setattr(param_residency, "apply", _drop_first(PARAM_FETCH_WAIT, "forward"))
    torch._dynamo.reset()
    ref, cref, model, cm = pair("all")
    with pytest.raises(
        Exception,
        match=r"parameter residency failed:[\s\S]*reads parameter primals_\d+ .* before the wait of its fetch",
    ) as info:
        cm(*batch())
    assert "releases parameter" in str(info.value)  # ... and frees it before the copy is waited for


def test_a_missing_param_fetch_wait_gives_wrong_values_under_fault_injection(monkeypatch, no_early_completion):
    """The same graph with the verifier off: the reader sees the poisoned storage. With the wait
    in place the same run is bit-identical (the control)."""
    results = {}
    for broken in (False, True):
        with monkeypatch.context() as m:
            if broken:
                m.setattr(param_residency, "apply", _drop_first(PARAM_FETCH_WAIT, "forward"))
            torch._dynamo.reset()
            ref, cref, model, cm = pair("all", verify=False, fault_injection=3)
            opt = tms.CPUOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)  # owns the host gradients
            same = []
            for step in range(3):  # the compile leaves them in host memory: every step fetches them
                idx, t = batch(seed=step)
                l_ref, loss = cref(idx, t), cm(idx, t)
                same.append(torch.equal(l_ref, loss))
                l_ref.backward()
                loss.backward()
                opt.zero_grad()  # no step: the parameters stay as eager's
            results[broken] = same
    torch._dynamo.reset()
    assert results[False] == [True, True, True]
    assert not any(results[True]), results


def test_a_missing_grad_to_host_wait_is_refused_and_gives_wrong_gradients(monkeypatch, no_early_completion):
    monkeypatch.setattr(param_residency, "apply", _drop_first(GRAD_TO_HOST_WAIT, "backward"))
    torch._dynamo.reset()
    ref, cref, model, cm = pair("all")
    with pytest.raises(Exception, match=r"parameter residency failed:[\s\S]*has no grad_to_host_wait"):
        cm(*batch()).backward()
    torch._dynamo.reset()
    ref, cref, model, cm = pair("all", verify=False, fault_injection=3)
    opt = tms.CPUOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    idx, t = batch()
    cref(idx, t).backward()
    cm(idx, t).backward()
    # The device gradient was freed after grad_to_host; its deferred copy found nothing to read.
    wrong = [not torch.equal(p.grad, g) for p, g in zip(ref.parameters(), opt.host_grads())]
    assert sum(wrong) == 1, wrong
    assert any(torch.isnan(g).any() for g in opt.host_grads())
    torch._dynamo.reset()


def test_dumps_show_issue_and_wait_nodes(tmp_path):
    ref, cref, model, cm = pair("all", dump_dir=str(tmp_path))
    idx, t = batch()
    cm(idx, t).backward()
    (graph_dir,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    name = {op: f"torch.ops.trinity.{op._schema.name.split('::')[1]}.default(" for op in PARAM_OPS_ALL}
    n_params = len(list(model.parameters()))
    n_fetches = 0
    for graph in ("forward", "backward"):
        text = (graph_dir / f"30_param_residency.{graph}.py").read_text()  # the parameter rewrite's dump
        lines = text.splitlines()
        fetches = [i for i, line in enumerate(lines) if name[PARAM_FETCH] in line]
        waits = [i for i, line in enumerate(lines) if name[PARAM_FETCH_WAIT] in line]
        assert len(fetches) == len(waits) > 0
        n_fetches += len(fetches)
        assert text.count("# trinity: H2D of parameter") == len(waits)
        if graph == "forward":
            assert len(fetches) == n_params
        else:
            assert text.count(name[GRAD_TO_HOST]) == text.count(name[GRAD_TO_HOST_WAIT]) == n_params
            assert "the device gradient is freed after this" in text
        # Each wait comes after the fetch of the same slot.
        for w in waits:
            slot_args = lines[w].split(name[PARAM_FETCH_WAIT])[1].split(")")[0]
            issued = [f for f in fetches if lines[f].split(name[PARAM_FETCH])[1].split(")")[0] == slot_args]
            assert len(issued) == 1 and issued[0] < w, lines[w]
    assert text.count(name[PARAM_RELEASE]) > 0
    # The simulated step has the parameter copies on the copy tracks, and the report their time.
    import json

    trace = json.loads((graph_dir / "timeline.json").read_text())["traceEvents"]
    copies = [e["name"] for e in trace if e["ph"] == "X" and e.get("tid") in (2, 3)]
    assert sum(c.startswith("param_fetch ") for c in copies) == n_fetches  # all copy with "all"
    assert sum(c.startswith("grad_to_host ") for c in copies) == n_params
    po = tms.offload_compiler.last_report().param_offload
    assert po["predicted_step_seconds"] >= tms.offload_compiler.last_report().compute_seconds
    assert 0 <= po["exposed_transfer_seconds"] <= po["predicted_step_seconds"]


PARAM_OPS_ALL = (PARAM_FETCH, PARAM_FETCH_WAIT, PARAM_RELEASE, GRAD_TO_HOST, GRAD_TO_HOST_WAIT)


def test_staging_blocks_do_not_pile_up_over_accumulation(monkeypatch):
    """Accumulating over micro-steps copies each later gradient into a staging block; the adds
    are done as the copies complete, so no staging block stays in use after the backward and
    the host gradients equal eager's."""
    torch._dynamo.reset()
    ref, cref, model, cm = pair("all", SMALL, fault_injection=5)
    opt = tms.CPUOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    for k in range(3):
        idx, t = batch(seed=k)
        cref(idx, t).backward()
        cm(idx, t).backward()
        report = tms.offload_compiler.last_report()
        assert report.runtime_stats().host_pool.in_use_bytes == 0, k
    for p, g in zip(ref.parameters(), opt.host_grads()):
        assert torch.equal(p.grad, g)
    assert report.runtime_stats().host_pool.num_allocations > 0  # staging was used
    torch._dynamo.reset()


def test_an_exception_between_a_fetch_and_its_wait_leaves_the_next_step_correct(monkeypatch):
    """The forward fails right after a parameter's fetch was issued (its wait never runs); the
    copy stays registered, and the next step's fetch (a no-op: the storage is allocated) and wait
    complete it before the reader."""
    from offload_compiler.runtime.model_state import ParamSlot as Slot

    torch._dynamo.reset()
    ref, cref, model, cm = pair("all", fault_injection=11)
    opt = tms.CPUOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)  # owns the host gradients
    idx, t = batch()
    cref(idx, t).backward()
    cm(idx, t).backward()  # compiles; parameters released after it
    real_wait = Slot.fetch_wait
    calls = []

    def failing_wait(self, rt):
        calls.append(self.id)
        raise RuntimeError("boom between fetch and wait")

    monkeypatch.setattr(Slot, "fetch_wait", failing_wait)
    with pytest.raises(RuntimeError, match="boom between fetch and wait"):
        cm(idx, t)
    monkeypatch.setattr(Slot, "fetch_wait", real_wait)
    (slot_id,) = calls
    slot = next(p._trinity_slot for p in model.parameters() if p._trinity_slot.id == slot_id)
    assert slot.resident and slot.unwaited_fetch is not None
    for p in ref.parameters():
        p.grad = None
    opt.zero_grad()
    l_ref, loss = cref(idx, t), cm(idx, t)
    assert torch.equal(l_ref, loss)
    l_ref.backward()
    loss.backward()
    for p, g in zip(ref.parameters(), opt.host_grads()):
        assert torch.equal(p.grad, g)
    assert slot.unwaited_fetch is None
    torch._dynamo.reset()


def test_measured_peak_within_the_budget_with_gradients_alive_until_their_waits(tmp_path):
    """The device gradients live until their ``grad_to_host_wait`` (the copy reads them): the
    planner counts them until there, so the measured peak of forward + backward stays within the
    budget (planning them as freed at ``grad_to_host`` would exceed it on this model)."""
    import json

    from offload_compiler import measure_peak_device_bytes
    from offload_compiler.models import GPTConfig

    torch._dynamo.reset()
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=4, n_head=2, n_embd=64)
    ref, cref, model, cm = pair("all", cfg, memory_budget="30%", min_offload_bytes=0, dump_dir=str(tmp_path))
    opt = tms.CPUOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    for step in range(2):
        idx, t = batch(cfg, seed=step)
        cm(idx, t).backward()
        opt.step()
        opt.zero_grad()
    report = tms.offload_compiler.last_report()
    (graph_dir,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    params = json.loads((graph_dir / "residency.json").read_text())["params"]
    assert any(p["grad_wait_after"] > p["grad_to_host_after"] for p in params)
    opt.synchronize()
    idx, t = batch(cfg, seed=7)
    m = measure_peak_device_bytes(lambda: cm(idx, t).backward(), resident=[], device="cpu")
    assert m.peak_bytes <= report.budget_bytes, (m.peak_bytes, report.peak_bytes_planned, report.budget_bytes)
    torch._dynamo.reset()
