"""The parameter-offload defects found by the new-user trial (README, "Limits today"), each
fixed or made loud:

1. reading an offloaded parameter between steps: ``state_dict``/``load_state_dict`` work without
   ``materialized`` (hooks the backend installs), an eager forward raises naming the parameter,
   released storages are marked where torch can (CUDA builds);
2. a plain ``torch.optim`` optimizer with ``offload="all"`` (it would train nothing) is refused
   at the next forward;
3. ``CPUOptimizer(overlap="backward")`` with the wrong ``accumulation_steps`` raises; a parameter
   read by two compiled graphs no longer updates early;
4. ``CPUOptimizer.load_state_dict`` before the first step: resuming from a checkpoint matches an
   uninterrupted run bit for bit;
5. a compile on the main thread while the worker updates does not change the update.
"""

import copy
import io
import threading
import time
import weakref

import pytest
import torch
import torch.nn as nn

import offload_compiler
from offload_compiler import CPUOptimizer, materialized
from offload_compiler.models import GPTConfig
from offload_compiler.runtime import model_state

from .models import GPTLoss
from .test_model_state import SMALL, batch, pair, storage_bytes


def full_bytes(t):
    return t.numel() * t.element_size()


def train_steps(cm, opt, seeds, cfg=SMALL, micro=1):
    for seed in seeds:
        for k in range(micro):
            idx, t = batch(cfg, b=2, seed=seed * micro + k)
            (cm(idx, t) / micro).backward()
        opt.step()
        opt.zero_grad()


def reference_steps(cref, opt_ref, seeds, cfg=SMALL, micro=1):
    train_steps(cref, opt_ref, seeds, cfg, micro)


# ----------------------------------------------------------------------------- 1: reads between steps


def test_state_dict_save_and_load_between_steps_without_materialized():
    """No install_state_dict_hooks, no materialized(): the backend hooked the model's modules, so
    state_dict() of the model, of the compiled wrapper and of a submodule give the current values
    (not 0-byte storages), torch.save/torch.load round-trips them, and load_state_dict() loads."""
    ref, cref, model, cm = pair("all")
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), lr=1e-2), CPUOptimizer(model.parameters(), lr=1e-2)
    reference_steps(cref, opt_ref, range(2))
    train_steps(cm, opt, range(2))  # the last update may still run on the worker
    assert storage_bytes(model) == 0
    sd, sd_ref = model.state_dict(), ref.state_dict()
    assert sd.keys() == sd_ref.keys()
    for k, v in sd.items():
        assert v.untyped_storage().nbytes() >= full_bytes(v), f"{k}: empty storage in the state dict"
        assert torch.equal(v, sd_ref[k]), k
    assert [p._trinity_slot.name for p in model.parameters()] == [n for n, _ in model.named_parameters()]
    wrapped = cm.state_dict()  # the OptimizedModule: keys under _orig_mod.
    assert wrapped.keys() == {"_orig_mod." + k for k in sd_ref}
    for k, v in sd_ref.items():
        assert torch.equal(wrapped["_orig_mod." + k], v), k
    block = model.gpt.blocks[1].state_dict()
    for k, v in ref.gpt.blocks[1].state_dict().items():
        assert torch.equal(block[k], v), k
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    for k, v in sd_ref.items():
        assert torch.equal(loaded[k], v), k
    # load_state_dict between steps: fetched, loaded, written back into the master copies, released.
    halved = {k: v * 0.5 for k, v in loaded.items()}
    model.load_state_dict(halved)
    ref.load_state_dict(halved)
    assert storage_bytes(model) == 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, halved[k]), k
    idx, t = batch(b=2, seed=9)
    assert torch.equal(cm(idx, t), cref(idx, t))
    # keep_vars=True leaves the parameter objects in the dict.
    kept = model.state_dict(keep_vars=True)
    assert all(kept[name] is p for name, p in model.named_parameters())
    with pytest.raises(RuntimeError, match="assign=True"):
        model.load_state_dict(halved, assign=True)


def test_eager_forward_between_steps_raises_naming_the_parameter():
    reports = len(offload_compiler.reports())
    ref, cref, model, cm = pair("all")
    opt = CPUOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    reference_steps(cref, opt_ref, range(2))
    train_steps(cm, opt, range(2))
    idx, t = batch(b=2, seed=5)  # the size the steps used: no recompilation for another size
    with pytest.raises(
        RuntimeError,
        match=r"eager forward of Embedding: trinity: parameter 'gpt\.tok\.weight' \(shape \[64, 32\], "
        r"torch\.float32\) is offloaded to host memory \(offload='all'\) and holds no device memory between steps",
    ):
        model(idx, t)
    with pytest.raises(RuntimeError, match=r"parameter 'gpt\.blocks\.0\.fc\.weight'.*materialized"):
        model.gpt.blocks[0].fc(torch.randn(2, 32))
    # Inside materialized() the eager forward runs on the real values (equal to eager on ref).
    with materialized(model.parameters()), torch.no_grad():
        assert torch.equal(model(idx, t), ref(idx, t))
    # The compiled model is unaffected by the hooks (installed while it compiled): one compile
    # of the training step for all the steps, the same values as eager.
    assert torch.equal(cm(idx, t), cref(idx, t))
    assert len(offload_compiler.reports()) == reports + 1
    with torch.no_grad():
        assert torch.equal(cm(idx, t), cref(idx, t))
    assert storage_bytes(model) == 0


def test_owning_modules_found_through_a_compiled_function_or_hooked_by_hand():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ref = copy.deepcopy(net)

    def step(model, x):
        return model(x).square().mean()

    cstep = torch.compile(step, backend="trinity", options={"offload": "all", "inner": "eager"})
    cref = torch.compile(step, backend="aot_eager")
    opt, opt_ref = CPUOptimizer(net.parameters(), torch.optim.SGD, lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    for o, m, c in ((opt, net, cstep), (opt_ref, ref, cref)):
        c(m, x).backward()
        o.step()
    assert [p._trinity_slot.name for p in net.parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    sd, sd_ref = net.state_dict(), ref.state_dict()
    for k, v in sd_ref.items():
        assert torch.equal(sd[k], v), k
    with pytest.raises(RuntimeError, match=r"eager forward of Linear: trinity: parameter '0\.weight'"):
        net(x)

    # Parameters handed to the compiled function in a list: no module is reachable from the
    # frame, so no hooks (README, "Limits today") until install_state_dict_hooks is called.
    holder = nn.Module()
    holder.w = nn.Parameter(torch.randn(8, 3))

    def project(ws, x):
        return (x @ ws[0]).square().mean()

    cproject = torch.compile(project, backend="trinity", options={"offload": "all", "inner": "eager"})
    popt = CPUOptimizer(holder.parameters(), torch.optim.SGD, lr=0.1)
    want = holder.w.detach().clone()
    cproject([holder.w], x).backward()
    assert holder.w._trinity_slot.name is None and holder.w.untyped_storage().nbytes() == 0
    assert holder.state_dict()["w"].untyped_storage().nbytes() == 0  # the documented limit
    offload_compiler.install_state_dict_hooks(holder)
    assert torch.equal(holder.state_dict()["w"], want)
    popt.zero_grad()


def test_released_storages_are_marked_for_the_named_parameter(monkeypatch):
    """Where torch can (CUDA builds: torch._C._set/_clear_storage_data_ptr_access_error_msg), a
    released parameter's storage makes any data access raise our message. The CPU build lacks
    those functions; here they are recorded to check that release marks and fetch unmarks."""
    marked = {}
    monkeypatch.setattr(model_state, "_MARK_RELEASED", lambda cdata, msg: marked.__setitem__(cdata, msg))
    monkeypatch.setattr(model_state, "_UNMARK_RELEASED", lambda cdata: marked.pop(cdata, None))
    ref, cref, model, cm = pair("all")
    opt = CPUOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    train_steps(cm, opt, range(1))
    opt.synchronize()
    named = dict(model.named_parameters())
    assert set(marked) == {p.untyped_storage()._cdata for p in named.values()}
    for name, p in named.items():
        msg = marked[p.untyped_storage()._cdata]
        assert f"parameter {name!r} (shape {list(p.shape)}, torch.float32)" in msg
        assert "offload='all'" in msg and "materialized" in msg
    with materialized(model.parameters()):
        assert marked == {}
    assert set(marked) == {p.untyped_storage()._cdata for p in named.values()}


@pytest.mark.skipif(
    model_state._MARK_RELEASED is None, reason="this torch build cannot mark a storage (CPU builds of torch)"
)
def test_reading_a_released_parameter_raises_where_torch_can_mark_storages():
    ref, cref, model, cm = pair("all")
    opt = CPUOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    train_steps(cm, opt, range(1))
    w = model.gpt.blocks[0].fc.weight
    for read in (lambda: w.sum(), lambda: repr(w), lambda: copy.deepcopy(model)):
        with pytest.raises(RuntimeError, match=r"parameter 'gpt\.blocks\.0\.fc\.weight'.*offload='all'"):
            read()
    with materialized(model.parameters()):
        assert torch.isfinite(w.sum())


# ----------------------------------------------------------------------------- 2: plain optimizer


def test_plain_torch_optimizer_with_offload_all_is_refused_at_the_next_forward():
    ref, cref, model, cm = pair("all")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx, t = batch()
    with torch.no_grad():
        cm(idx, t)  # eval before any backward: nothing to refuse
    cm(idx, t).backward()
    opt.step()  # sees p.grad None everywhere: a silent no-op
    opt.zero_grad()
    with pytest.raises(
        RuntimeError,
        match=r"gradients of parameter '[\w.]+' .* reached host memory \(offload='all'\), but no "
        r"offload_compiler\.CPUOptimizer owns this parameter",
    ):
        cm(idx, t)
    with pytest.raises(RuntimeError, match="no offload_compiler.CPUOptimizer owns"), torch.no_grad():
        cm(idx, t)


def test_owner_check_allows_accumulation_and_eval_and_names_a_missing_parameter():
    ref, cref, model, cm = pair("all")
    opt = CPUOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):
        for k in range(3):  # accumulation: forwards with host gradients pending, owned
            idx, t = batch(seed=10 * step + k)
            (cm(idx, t) / 3).backward()
            (cref(idx, t) / 3).backward()
            with torch.no_grad():  # an eval between micro-steps
                assert torch.equal(cm(idx, t), cref(idx, t))
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    with materialized(model.parameters()):
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(a, b), name
    # The optimizer is gone (replaced by nothing): the next forward after a backward refuses.
    idx, t = batch(seed=3)
    cm(idx, t).backward()
    del opt
    with pytest.raises(RuntimeError, match="no offload_compiler.CPUOptimizer owns"):
        cm(idx, t)


def test_an_optimizer_dropped_with_updates_pending_finishes_them():
    """The worker keeps a CPUOptimizer alive while it has queued updates (only then): dropping it
    right after step() neither loses nor hangs the pending updates."""
    import gc

    from .test_model_state import SlowAdamW

    ref, cref, model, cm = pair("all")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = CPUOptimizer(model.parameters(), SlowAdamW, lr=1e-2, chunk_bytes=1)  # one chunk per parameter
    idx, t = batch()
    cref(idx, t).backward()
    cm(idx, t).backward()
    opt_ref.step()
    opt.step()
    opt.zero_grad()
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    assert torch.equal(cm(idx, t), cref(idx, t))  # waits for every update, no owner needed
    gc.collect()
    assert gone() is None  # collected once idle


def test_a_parameter_left_out_of_the_cpu_optimizer_is_named():
    ref, cref, model, cm = pair("all")
    opt = CPUOptimizer([p for n, p in model.named_parameters() if n != "gpt.ln_f.weight"], lr=1e-2)
    idx, t = batch()
    cm(idx, t).backward()
    opt.step()
    opt.zero_grad()
    with pytest.raises(RuntimeError, match=r"gradients of parameter 'gpt\.ln_f\.weight' \(shape \[32\]"):
        cm(idx, t)


# ----------------------------------------------------------------------------- 3: accumulation_steps


def masters(model):
    with materialized(model.parameters()):
        return [p.detach().clone() for p in model.parameters()]


def backward_pair(cfg=None):
    cfg = cfg or GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    ref, cref, model, cm = pair("all", cfg)
    return cfg, ref, cref, model, cm


def test_overlap_backward_fewer_backwards_than_accumulation_steps_raises_before_any_update():
    cfg, ref, cref, model, cm = backward_pair()
    opt = CPUOptimizer(
        model.parameters(), torch.optim.AdamW, lr=1e-2, chunk_bytes=1, overlap="backward", accumulation_steps=3
    )
    before = masters(model)
    for k in range(2):
        (cm(*batch(cfg, b=2, seed=k)) / 3).backward()
    with pytest.raises(
        RuntimeError,
        match=r"accumulation_steps=3\)\.step\(\): 2 backwards since the last step\(\)/zero_grad\(\), not 3;.*"
        r"No update of this step was started",
    ):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(masters(model), before))
    opt.zero_grad()
    # A correct step confirms the count (early starts from now on), then a short step again.
    train_steps(cm, opt, range(1), cfg, micro=3)
    after_good = masters(model)
    assert not torch.equal(after_good[0], before[0])
    (cm(*batch(cfg, b=2, seed=7)) / 3).backward()
    assert not any(c.enqueued for c in opt._chunks)  # nothing starts before the 3rd backward
    with pytest.raises(RuntimeError, match=r"1 backward since the last step\(\)/zero_grad\(\), not 3"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(masters(model), after_good))


def test_overlap_backward_more_backwards_than_accumulation_steps_raises_in_the_extra_backward():
    cfg, ref, cref, model, cm = backward_pair()
    opt = CPUOptimizer(
        model.parameters(), torch.optim.AdamW, lr=1e-2, chunk_bytes=1, overlap="backward", accumulation_steps=2
    )
    before = masters(model)
    # First step: nothing starts early before a step() confirmed the count, so the 3rd backward
    # is refused with no update done.
    for k in range(2):
        (cm(*batch(cfg, b=2, seed=k)) / 2).backward()
    with pytest.raises(
        RuntimeError, match=r"accumulation_steps=2\): a 3rd backward .*No update of this step has started"
    ):
        cm(*batch(cfg, b=2, seed=2)).backward()
    assert all(torch.equal(a, b) for a, b in zip(masters(model), before))
    opt.zero_grad()
    train_steps(cm, opt, range(1), cfg, micro=2)  # confirms 2
    # Now updates start in the 2nd backward; a 3rd backward says that this step's update is wrong.
    for k in range(2):
        (cm(*batch(cfg, b=2, seed=20 + k)) / 2).backward()
    assert all(c.enqueued for c in opt._chunks)
    with pytest.raises(
        RuntimeError,
        match=r"a 3rd backward .* The updates of \d+ of \d+ parameter chunks already started after the 2nd "
        r"backward, with the gradients of 2 backwards: this step's update is wrong",
    ):
        cm(*batch(cfg, b=2, seed=22)).backward()
    with pytest.raises(RuntimeError, match="3 backwards .* not 2"):
        opt.step()


class Twice(nn.Module):
    """``lin`` is read on both sides of a graph break: two compiled graphs, two gradients of its
    parameters in one backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        torch._dynamo.graph_break()
        h = torch.tanh(self.lin(h))
        return self.out(h).square().mean()


def test_overlap_backward_parameter_read_by_two_graphs_is_not_updated_early():
    torch.manual_seed(0)
    ref = Twice()
    model = copy.deepcopy(ref)
    cref = torch.compile(ref, backend="aot_eager")
    cm = torch.compile(model, backend="trinity", options={"offload": "all", "inner": "eager"})
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = CPUOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, chunk_bytes=1, overlap="backward")
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(8, 16, generator=g)
        cref(x).backward()
        cm(x).backward()
        if step > 0:  # after the confirming first step: 'out' starts early, 'lin' waits for step()
            started = {n for n, p in model.named_parameters() if opt._chunk_of[p._trinity_slot.id].enqueued}
            assert started == {"out.weight", "out.bias"}, started
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    with materialized(model.parameters()):
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(a, b), name


# ----------------------------------------------------------------------------- 4: resume


RESUME_CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)


def fresh(seed):
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = GPTLoss(RESUME_CFG)
    cm = torch.compile(model, backend="trinity", options={"offload": "all", "inner": "eager", "memory_budget": None})
    return model, cm


def make_opt(model):
    return CPUOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-3, weight_decay=0.1, chunk_bytes=8 * 1024)


def run(cm, opt, steps, losses):
    for step in steps:
        for k in range(2):
            idx, t = batch(RESUME_CFG, b=2, seed=2 * step + k)
            loss = cm(idx, t) / 2
            losses.append(loss.detach())
            loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("load_at", ["before_compile", "after_first_forward"])
def test_resume_from_checkpoint_matches_an_uninterrupted_run(load_at):
    model, cm = fresh(0)
    opt = make_opt(model)
    losses = []
    run(cm, opt, range(6), losses)
    uninterrupted = (masters(model), opt.state_dict(), losses)

    model, cm = fresh(0)
    opt = make_opt(model)
    losses = []
    run(cm, opt, range(3), losses)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)  # no materialized()
    del model, cm, opt
    losses = []

    model, cm = fresh(123)  # other initial values: everything must come from the checkpoint
    opt = make_opt(model)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    if load_at == "after_first_forward":
        with torch.no_grad():
            cm(*batch(RESUME_CFG, b=2, seed=99))  # compiles: parameters are offloaded now
        assert storage_bytes(model) == 0
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])  # before any step()
    assert opt.state_dict()["state"].keys() == ckpt["opt"]["state"].keys()
    run(cm, opt, range(3, 6), losses)

    want_params, want_state, want_losses = uninterrupted
    assert len(losses) == len(want_losses) - 6 == 6
    for i, (a, b) in enumerate(zip(losses, want_losses[6:])):
        assert torch.equal(a, b), f"loss {i} after the resume differs"
    for (name, _), a, b in zip(model.named_parameters(), masters(model), want_params):
        assert torch.equal(a, b), name
    state = opt.state_dict()
    assert state["state"].keys() == want_state["state"].keys()
    for i, st in want_state["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state["state"][i][key], st[key]), (i, key)


def test_load_state_dict_before_any_step_checks_the_groups():
    model = GPTLoss(SMALL)
    opt = make_opt(model)
    assert opt.state_dict()["state"] == {}
    n = len(list(model.parameters()))
    with pytest.raises(ValueError, match="parameter groups do not match"):
        opt.load_state_dict({"state": {}, "param_groups": [{"lr": 1.0, "params": list(range(n - 1))}]})
    with pytest.raises(ValueError, match=f"names parameter {n}"):
        opt.load_state_dict({"state": {n: {}}, "param_groups": [{**opt.param_groups[0], "params": list(range(n))}]})


# ----------------------------------------------------------------------------- 5: compile meanwhile


class GatedAdamW(torch.optim.AdamW):
    """AdamW whose update waits (at most 2 s) until a compile is in progress somewhere in the
    process: without the fix, it then runs while torch.compiler.is_compiling() is set."""

    def step(self, closure=None):
        deadline = time.monotonic() + 2.0
        while not torch.compiler.is_compiling() and time.monotonic() < deadline:
            time.sleep(0.001)
        return super().step(closure)


def test_a_compile_on_the_main_thread_does_not_change_the_update():
    ref, cref, model, cm = pair("all")
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = CPUOptimizer(model.parameters(), GatedAdamW, lr=1e-2)  # one chunk
    idx, t = batch()
    cref(idx, t).backward()
    cm(idx, t).backward()
    opt_ref.step()
    updated = threading.Event()

    def backend(gm, example_inputs):
        # The compile is in progress here; give the worker's update (at most 2 s) to finish.
        deadline = time.monotonic() + 2.0
        while not all(p._trinity_slot.ready.is_set() for p in model.parameters()) and time.monotonic() < deadline:
            time.sleep(0.001)
        updated.set()
        return gm.forward

    def unrelated(x):
        return torch.sin(x) * 2

    opt.step()  # returns at once; the worker waits for a compile to start
    assert torch.equal(torch.compile(unrelated, backend=backend)(torch.ones(3)), torch.sin(torch.ones(3)) * 2)
    assert updated.is_set()
    with materialized(model.parameters()):
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(a, b), f"{name}: the update differs from eager AdamW's"
