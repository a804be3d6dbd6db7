"""Model-state offloading (option ``offload``): parameters, gradients and optimizer state in host
memory, parameters fetched around their uses, the optimizer step on the CPU.

Every case compares with the same model compiled with ``aot_eager`` (the reference of
``inner="eager"``) and PyTorch's own optimizer on the device, bit for bit.
"""

import copy
import io
import time

import pytest
import torch

import offload_compiler
from offload_compiler import CPUOptimizer, materialized, measure_peak_device_bytes
from offload_compiler.ir.ops import GRAD_TO_HOST, PARAM_FETCH, PARAM_RELEASE
from offload_compiler.models import GPTConfig
from offload_compiler.param_offload import HostMemoryError

from .models import GPTLoss

SMALL = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)


def batch(cfg=SMALL, b=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (b, cfg.block_size), generator=g)
    return idx, torch.randint(0, cfg.vocab_size, (b, cfg.block_size), generator=g)


def pair(mode, cfg=SMALL, **options):
    torch.manual_seed(0)
    ref = GPTLoss(cfg)
    model = copy.deepcopy(ref)
    cref = torch.compile(ref, backend="aot_eager")
    opts = {"inner": "eager", "offload": mode, "memory_budget": None, **options}
    return ref, cref, model, torch.compile(model, backend="trinity", options=opts)


def storage_bytes(model):
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def test_activations_params_gradients_and_updates_bit_identical():
    ref, cref, model, cm = pair("activations+params")
    ids_before = [id(p) for p in model.parameters()]
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # the user's own optimizer, on the device
    for step in range(4):
        idx, t = batch(seed=step)
        l_ref, loss = cref(idx, t), cm(idx, t)
        l_ref.backward()
        loss.backward()
        assert torch.equal(l_ref, loss), f"step {step}: loss differs"
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.requires_grad
            assert torch.equal(p.grad, q.grad), f"step {step}: grad of {name} differs"
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    # Between steps parameters are resident and current: state_dict shows the real values.
    assert [id(p) for p in model.parameters()] == ids_before
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name
    report = offload_compiler.last_report()
    assert report.param_offload["mode"] == "activations+params"
    assert report.param_offload["num_params"] > 0
    assert report.param_offload["peak_bytes"] == report.peak_bytes_planned
    assert report.param_offload["peak_bytes"] < report.param_offload["peak_bytes_resident_params"]
    assert "params     offload=activations+params" in report.summary()


def test_activations_params_releases_parameters_inside_the_step():
    """Inside the step, after the forward, offloaded parameters hold no device storage; the
    measured peak of forward+backward is lower than with parameters resident."""
    cfg = GPTConfig(vocab_size=512, block_size=32, n_layer=4, n_head=2, n_embd=128)
    peaks = {}
    for mode in ("activations", "activations+params"):
        torch._dynamo.reset()
        ref, cref, model, cm = pair(mode, cfg)
        idx, t = batch(cfg)
        cm(idx, t).backward()  # compile, first step
        total = sum(p.numel() * 4 for p in model.parameters())
        seen = {}

        def step(model=model, cm=cm, idx=idx, t=t, seen=seen):
            for p in model.parameters():
                p.grad = None
            loss = cm(idx, t)
            seen["after_forward"] = storage_bytes(model)
            loss.backward()

        # Parameters the step re-allocates (released in the forward, fetched in the backward)
        # are allocated by the warmup step, under the trace; the others are resident.
        offloaded = [
            p for p in model.parameters() if getattr(p, "_trinity_slot", None) and p._trinity_slot.num_releases
        ]
        resident = [p for p in model.parameters() if all(p is not q for q in offloaded)]
        m = measure_peak_device_bytes(step, resident=resident, device="cpu", warmup=step)
        peaks[mode] = m.peak_bytes
        if mode == "activations+params":
            # Only parameters without a backward reader stay resident (the position table and
            # the biases, whose gradients need no parameter value): under 10% of the bytes.
            assert offloaded
            assert seen["after_forward"] < total // 10, (seen, total)
            # After the backward all are back, for the user's optimizer.
            assert storage_bytes(model) == total
        else:
            assert seen["after_forward"] == total
    assert peaks["activations+params"] < peaks["activations"] - total // 4, (peaks, total)


def _train_all(steps=20, save_at=10, micro=4, clip=1.0, cfg=None):
    """The issue's parity case: GPT with tied embeddings, AdamW, grad accumulation over ``micro``
    micro-steps, clipping, a save/load round trip at ``save_at``."""
    cfg = cfg or GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32, tie_weights=True)
    ref, cref, model, cm = pair("all", cfg)
    assert ref.gpt.head.weight is ref.gpt.tok.weight and model.gpt.head.weight is model.gpt.tok.weight
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    opt = CPUOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-3, weight_decay=0.1, chunk_bytes=16 * 1024)
    ids = [id(p) for p in model.parameters()]
    for step in range(steps):
        for k in range(micro):
            idx, t = batch(cfg, b=2, seed=step * micro + k)
            l_ref, loss = cref(idx, t) / micro, cm(idx, t) / micro
            assert torch.equal(l_ref, loss), f"step {step}.{k}: loss differs"
            l_ref.backward()
            loss.backward()
        n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        n = opt.clip_grad_norm_(clip)
        assert torch.equal(n_ref, n), f"step {step}: grad norm differs"
        for (name, p), g in zip(ref.named_parameters(), opt.host_grads()):
            assert torch.equal(p.grad, g), f"step {step}: grad of {name} differs"
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        if step == save_at:
            buf = io.BytesIO()
            with materialized(model.parameters()):
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
            # Spoil parameters and optimizer state, then restore them from the checkpoint.
            with materialized(model.parameters()), torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            for st in opt.state_dict()["state"].values():
                st["exp_avg"].zero_()
            buf.seek(0)
            ckpt = torch.load(buf, weights_only=True)
            with materialized(model.parameters()):
                model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
    assert [id(p) for p in model.parameters()] == ids
    assert all(p.requires_grad for p in model.parameters())
    return ref, model, opt_ref, opt


def test_all_parity_gpt_adamw_accumulation_clipping_checkpoint():
    ref, model, opt_ref, opt = _train_all()
    # Between steps the device holds none of the parameters ...
    assert storage_bytes(model) == 0
    # ... and materialized() shows their real, current values, equal to eager AdamW's.
    with materialized(model.parameters()):
        for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
            assert torch.equal(a, b), f"parameter {name} differs after 20 steps"
    assert storage_bytes(model) == 0
    sd, sd_ref = opt.state_dict(), opt_ref.state_dict()
    assert sd["state"].keys() == sd_ref["state"].keys()
    for i in sd_ref["state"]:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sd["state"][i][key], sd_ref["state"][i][key]), (i, key)
    assert sd["param_groups"][0]["lr"] == sd_ref["param_groups"][0]["lr"]


def test_all_eval_under_no_grad_between_steps():
    ref, cref, model, cm = pair("all")
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = CPUOptimizer(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    for step in range(3):
        idx, t = batch(seed=step)
        cref(idx, t).backward()
        cm(idx, t).backward()
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        with torch.no_grad():
            e_ref, e = cref(idx, t), cm(idx, t)
        assert torch.equal(e_ref, e), f"eval after step {step} differs"
        assert storage_bytes(model) == 0


class SlowAdamW(torch.optim.AdamW):
    """AdamW whose step takes a while: the next forward must wait for it."""

    def step(self, closure=None):
        time.sleep(0.05)
        return super().step(closure)


def test_step_returns_before_the_update_and_the_forward_waits_for_it():
    ref, cref, model, cm = pair("all")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = CPUOptimizer(model.parameters(), SlowAdamW, lr=1e-2, chunk_bytes=1)  # one chunk per parameter
    n_params = len(list(model.parameters()))
    for step in range(2):
        idx, t = batch(seed=step)
        cref(idx, t).backward()
        cm(idx, t).backward()
        opt_ref.step()
        t0 = time.perf_counter()
        opt.step()
        returned = time.perf_counter() - t0
        opt_ref.zero_grad()
        opt.zero_grad()
        # All updates together take n_params * 50 ms; step() only hands them to the worker.
        assert returned < 0.5 * n_params * 0.05
    idx, t = batch(seed=9)
    assert torch.equal(cref(idx, t), cm(idx, t))


def test_all_mode_rewrites_the_graphs_and_keeps_grads_off_the_device(tmp_path):
    import json

    ref, cref, model, cm = pair("all", dump_dir=str(tmp_path))
    idx, t = batch()
    cm(idx, t).backward()
    assert all(p.grad is None for p in model.parameters())
    n_params = len(list(model.parameters()))
    po = offload_compiler.last_report().param_offload
    assert po["num_params"] == n_params
    assert po["host_bytes"] >= 2 * sum(p.numel() * 4 for p in model.parameters())
    assert po["max_window_steps"] >= 1
    (graph_dir,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    # The parameter rewrite's own dump (it runs after insert_transfers, which has nothing to
    # evict here without a budget).
    fw = (graph_dir / "30_param_residency.forward.py").read_text()
    bw = (graph_dir / "30_param_residency.backward.py").read_text()
    name = {
        op: f"torch.ops.trinity.{op._schema.name.split('::')[1]}.default"
        for op in (PARAM_FETCH, PARAM_RELEASE, GRAD_TO_HOST)
    }
    # One fetch and one release per parameter in the forward; a gradient to host per parameter
    # in the backward, and a fetch/release pair for each parameter the backward reads.
    assert fw.count(name[PARAM_FETCH] + "(") == n_params
    assert fw.count(name[PARAM_RELEASE] + "(") == n_params
    assert bw.count(name[GRAD_TO_HOST] + "(") == n_params
    assert 0 < bw.count(name[PARAM_FETCH] + "(") == bw.count(name[PARAM_RELEASE] + "(") < n_params
    residency = json.loads((graph_dir / "residency.json").read_text())
    assert len(residency["params"]) == n_params
    per_step = residency["resident_param_bytes"]
    assert max(per_step) < sum(p.numel() * 4 for p in model.parameters())
    assert per_step[0] == 0 and per_step[-1] == 0


def test_host_memory_shortage_fails_at_compile_time():
    ref, cref, model, cm = pair("all", host_pool_limit_bytes=4096)
    idx, t = batch()
    with pytest.raises(
        Exception, match=r"need 223.00 KiB \(228352 bytes\) of host memory, over host_pool_limit_bytes"
    ) as info:
        cm(idx, t)
    cause = getattr(info.value, "inner_exception", info.value)
    assert isinstance(cause, HostMemoryError)
    # 2 * 4 bytes per element: the master copy and the host gradient.
    assert 228352 == 8 * sum(p.numel() for p in model.parameters())


def test_offload_params_needs_inner_eager():
    model = GPTLoss(SMALL)
    cm = torch.compile(model, backend="trinity", options={"offload": "all", "inner": "inductor"})
    with pytest.raises(Exception, match="needs inner='eager'"):
        cm(*batch())


def test_cpu_optimizer_rejects_parameters_not_offloaded():
    model = GPTLoss(SMALL)
    opt = CPUOptimizer(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="not offloaded with offload='all'"):
        opt.step()
    with pytest.raises(ValueError, match="closures"):
        opt.step(lambda: 0.0)
    with pytest.raises(ValueError, match="empty"):
        CPUOptimizer([], lr=1e-3)


def test_uncompiled_backward_inside_materialized_reaches_the_cpu_optimizer():
    """offload='all': a step run uncompiled inside materialized() leaves device gradients in
    p.grad; on exit they go to the host gradients (added to those since zero_grad) and
    CPUOptimizer.step() uses them (found by a fresh-user trial: they were dropped silently and
    the parameters drifted from eager by 0.79 of their largest value). The eager model is
    `model` itself, so both paths are bit-identical to the aot_eager reference."""
    ref, cref, model, cm = pair("all")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = CPUOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    for step, how in enumerate(("compiled", "eager", "eager+compiled", "compiled")):
        idx, t = batch(seed=step)
        cref(idx, t).backward()
        if how == "eager+compiled":  # accumulation: an eager micro-step, then a compiled one
            cref(idx, t).backward()
        if how.startswith("eager"):
            with materialized(model.parameters()):
                model(idx, t).backward()
            assert all(p.grad is None for p in model.parameters())
        if how.endswith("compiled"):
            cm(idx, t).backward()
        for (name, r), g in zip(ref.named_parameters(), opt.host_grads()):
            assert torch.equal(r.grad, g), f"step {step} ({how}): grad of {name} differs"
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    with materialized(model.parameters()):
        for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
            assert torch.equal(a, b), f"parameter {name} differs"


def test_cpu_optimizer_refuses_a_device_grad_no_compiled_backward_wrote():
    """An uncompiled micro-step before the model's first compiled call leaves p.grad on the
    device, outside materialized(): the update would silently leave it out (a fresh-user
    trial: 5.8% of the largest parameter off after 3 steps), so step() refuses, naming it."""
    ref, cref, model, cm = pair("all")
    opt = CPUOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    idx, t = batch()
    model(idx, t).backward()  # uncompiled: nothing is offloaded yet
    cm(idx, t).backward()
    with pytest.raises(
        RuntimeError, match=r"CPUOptimizer.step: parameter 'gpt.tok.weight' .* has a device .grad that no compiled"
    ):
        opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    cm(idx, t).backward()
    opt.step()  # a clean step runs


def test_cpu_optimizer_names_an_unused_parameter():
    """A parameter the compiled forward never reads is not the model's offloaded parameter: the
    error says so (a fresh-user trial got 'compile the model and run a step' after both)."""

    class WithUnused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(8, 8)
            self.unused = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.used(x).square().mean()

    model = WithUnused()
    cm = torch.compile(model, backend="trinity", options={"inner": "eager", "offload": "all"})
    opt = CPUOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    cm(torch.randn(4, 8)).backward()
    with pytest.raises(ValueError, match=r"parameter 2 of the optimizer \(shape \[8, 8\].*never reads it"):
        opt.step()


def test_plan_command_accounts_for_parameter_offload():
    from offload_compiler.devices import KNOWN_DEVICES
    from offload_compiler.plan_cli import plan_model

    a100 = KNOWN_DEVICES["a100-80gb"]
    # One inner compiler for both (parameter offload needs "eager"; plan's default for
    # "activations" is the backend's, Inductor, whose fusion changes the unplanned peak).
    common = dict(batch=4, seq_len=64, dtype=torch.float32, optimizer="adamw", min_offload_bytes=0, inner="eager")
    act = plan_model("demo", a100, ["100%", "50%"], **common)
    full = plan_model("demo", a100, ["100%", "50%"], offload="all", **common)
    params = act.param_bytes
    assert act.unplanned_peak_bytes == full.unplanned_peak_bytes
    assert full.host_model_state_bytes == 4 * params  # master copies, gradients, AdamW's two states
    assert act.host_model_state_bytes == 0
    a, f = {r.budget: r for r in act.rows}, {r.budget: r for r in full.rows}
    # Without offloading anything else, "all" saves at least the optimizer state and most of the
    # parameters; its lowest reachable peak is below the parameters + state floor of "activations".
    assert f["100%"].planned_peak_bytes < a["100%"].planned_peak_bytes - 2 * params
    assert f["50%"].lowest_reachable_bytes < 3 * params < a["50%"].lowest_reachable_bytes
    assert f["50%"].feasible and f["50%"].planned_peak_bytes <= f["50%"].budget_bytes
    # The parameter copies are in the simulated step: it is no faster than compute alone.
    assert f["100%"].predicted_step_seconds >= full.compute_seconds
    with pytest.raises(ValueError, match="unknown offload"):
        plan_model("demo", a100, ["100%"], offload="params", **common)


def test_all_with_activation_budget_parity_and_measured_peak():
    """Parameters offloaded and saved activations evicted together, to one budget: values stay
    bit-identical and the measured peak of forward+backward is within the planned one."""
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=4, n_head=2, n_embd=64)
    ref, cref, model, cm = pair("all", cfg, memory_budget="30%", min_offload_bytes=0)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = CPUOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    for step in range(3):
        idx, t = batch(cfg, seed=step)
        l_ref, loss = cref(idx, t), cm(idx, t)
        assert torch.equal(l_ref, loss), f"step {step}: loss differs"
        l_ref.backward()
        loss.backward()
        for (name, p), g in zip(ref.named_parameters(), opt.host_grads()):
            assert torch.equal(p.grad, g), f"step {step}: grad of {name} differs"
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    report = offload_compiler.last_report()
    assert report.num_evicted > 0 and report.feasible
    assert report.peak_bytes_planned <= report.budget_bytes
    opt.synchronize()
    idx, t = batch(cfg, seed=7)
    m = measure_peak_device_bytes(lambda: cm(idx, t).backward(), resident=[], device="cpu")
    assert m.peak_bytes <= report.peak_bytes_planned + 64 * 1024, (m.peak_bytes, report.peak_bytes_planned)
    assert m.peak_bytes < 0.5 * report.param_offload["peak_bytes_resident_params"]


def test_verifier_catches_a_parameter_read_after_its_release(monkeypatch):
    """A residency plan that releases each parameter right where it is fetched (before its
    readers) is refused at compile time, naming the reader."""
    import dataclasses

    from offload_compiler.passes import param_residency

    real_plan = param_residency.plan

    def broken(*args, **kwargs):
        p = real_plan(*args, **kwargs)
        params = tuple(
            dataclasses.replace(q, fw_release_after=q.fw_fetch_before) if q.fw_fetch_before is not None else q
            for q in p.params
        )
        return dataclasses.replace(p, params=params)

    monkeypatch.setattr(param_residency, "plan", broken)
    ref, cref, model, cm = pair("all")
    with pytest.raises(
        Exception, match=r"parameter residency failed:[\s\S]*reads parameter primals_\d+ .* while it is released"
    ):
        cm(*batch())


def test_all_dynamic_batch_one_compile():
    torch.manual_seed(0)
    ref = GPTLoss(SMALL)
    model = copy.deepcopy(ref)
    before = len(offload_compiler.reports())
    cref = torch.compile(ref, backend="aot_eager", dynamic=True)
    options = {"inner": "eager", "offload": "all", "memory_budget": "50%", "min_offload_bytes": 0}
    cm = torch.compile(model, backend="trinity", options=options, dynamic=True)
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), CPUOptimizer(model.parameters(), lr=1e-2)
    # Largest first: a plan is guarded to the sizes it was planned at (a larger one plans again).
    for step, b in enumerate((5, 3, 2)):
        idx, t = batch(b=b, seed=step)
        l_ref, loss = cref(idx, t), cm(idx, t)
        assert torch.equal(l_ref, loss), f"batch {b}: loss differs"
        l_ref.backward()
        loss.backward()
        for (name, p), g in zip(ref.named_parameters(), opt.host_grads()):
            assert torch.equal(p.grad, g), f"batch {b}: grad of {name} differs"
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    assert len(offload_compiler.reports()) == before + 1
    with materialized(model.parameters()):
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(a, b), name


def test_activations_params_forward_without_backward_then_eval():
    """A training forward whose backward never runs leaves parameters released; the next eval
    (compiled, under no_grad), eager reads inside materialized() and the next step still see
    the real values."""
    ref, cref, model, cm = pair("activations+params")
    idx, t = batch()
    cm(idx, t).backward()
    cref(idx, t).backward()
    cm(idx, t)  # no backward
    assert storage_bytes(model) < sum(p.numel() * 4 for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(cm(idx, t), cref(idx, t))
    with materialized(model.parameters()):
        for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
            assert torch.equal(a, b), name
    for p in model.parameters():
        p.grad = None
    for p in ref.parameters():
        p.grad = None
    cm(idx, t).backward()
    cref(idx, t).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_state_dict_hooks_between_steps_without_materialized():
    from offload_compiler import install_state_dict_hooks

    ref, cref, model, cm = pair("all")
    install_state_dict_hooks(model)
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), CPUOptimizer(model.parameters(), lr=1e-2)
    for step in range(2):
        idx, t = batch(seed=step)
        cref(idx, t).backward()
        cm(idx, t).backward()
        opt_ref.step()
        opt.step()  # still running on the worker: state_dict waits for it
        sd, sd_ref = model.state_dict(), ref.state_dict()
        assert sd.keys() == sd_ref.keys()  # tied weights appear under both names, as in eager
        for k in sd_ref:
            assert torch.equal(sd[k], sd_ref[k]), f"step {step}: {k}"
        opt_ref.zero_grad()
        opt.zero_grad()
    assert storage_bytes(model) == 0
    buf = io.BytesIO()
    torch.save({k: v * 0.5 for k, v in model.state_dict().items()}, buf)
    buf.seek(0)
    halved = torch.load(buf, weights_only=True)
    model.load_state_dict(halved)
    ref.load_state_dict(halved)
    assert storage_bytes(model) == 0
    idx, t = batch(seed=5)
    assert torch.equal(cm(idx, t), cref(idx, t))


def test_overlap_backward_updates_start_during_the_backward_and_match():
    """overlap="backward": chunks are updated while the backward still runs (before step()), with
    gradient accumulation; values stay bit-identical to eager AdamW."""
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)
    ref, cref, model, cm = pair("all", cfg)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    opt = CPUOptimizer(model.parameters(), SlowAdamW, lr=3e-3, chunk_bytes=1, overlap="backward", accumulation_steps=2)
    started_early = []
    for step in range(4):
        for k in range(2):
            idx, t = batch(cfg, b=2, seed=10 * step + k)
            l_ref, loss = cref(idx, t) / 2, cm(idx, t) / 2
            assert torch.equal(l_ref, loss), f"step {step}.{k}: loss differs"
            l_ref.backward()
            loss.backward()
        if opt._chunks is not None:
            started_early.append(sum(c.enqueued for c in opt._chunks))
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    # From the second step on (chunks exist), every chunk with gradients started in the backward.
    assert started_early and all(n == len(opt._chunks) for n in started_early), started_early
    with materialized(model.parameters()):
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="overlap='backward'"):
        opt.clip_grad_norm_(1.0)
    with pytest.raises(ValueError, match="overlap"):
        CPUOptimizer(model.parameters(), overlap="sideways")
    with pytest.raises(ValueError, match="accumulation_steps"):
        CPUOptimizer(model.parameters(), overlap="backward", accumulation_steps=0)


@pytest.mark.parametrize("true_depth,max_depth", [(0, 48), (1, 48), (5, 48), (17, 48), (47, 48), (48, 48), (90, 48)])
def test_bench_largest_depth_search(true_depth, max_depth):
    from bench.model_state import largest_depth

    calls = []

    def measure(d):
        calls.append(d)
        return {"peak_bytes": 100 * d}  # fits the budget up to true_depth

    depth, rows = largest_depth(measure, 100 * true_depth, max_depth, lambda _: None)
    assert depth == min(true_depth, max_depth)
    assert [r["depth"] for r in rows] == sorted(set(calls))
    assert len(calls) == len(set(calls)) <= 2 * max_depth.bit_length() + 2


def test_a_second_instance_reusing_the_compiled_code_is_refused():
    """Dynamo reuses compiled code for another instance of the same class; the parameter slots
    belong to the first instance, so the second must fail loudly instead of accumulating its
    gradients into the first model's host gradients."""
    torch._dynamo.reset()
    torch.manual_seed(0)

    def make():
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    a, b = make(), make()
    options = {"offload": "all", "inner": "eager"}
    ca = torch.compile(a, backend="trinity", options=options)
    cb = torch.compile(b, backend="trinity", options=options)
    opt = CPUOptimizer(a.parameters(), torch.optim.SGD, lr=0.1)
    x = torch.randn(2, 8)
    ca(x).sum().backward()
    before = [g.clone() for g in opt.host_grads()]
    with pytest.raises(RuntimeError, match="belongs to another module instance"):
        cb(x * 100).sum().backward()
    for g, h in zip(before, opt.host_grads()):
        assert torch.equal(g, h)  # nothing of b's went into a's gradients
    opt.step()
    opt.synchronize()
    torch._dynamo.reset()


def test_explicit_num_streams_with_parameter_offload_warns_and_runs_on_one_stream():
    ref, cref, model, compiled = pair("activations+params", num_streams=2)
    x, y = batch()
    with pytest.warns(UserWarning, match=r"num_streams=2 is ignored with offload='activations\+params'"):
        loss = compiled(x, y)
    loss.backward()
    cref(x, y).backward()
    assert offload_compiler.last_report().streams == ()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
