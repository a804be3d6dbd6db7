"""CPUOptimizer's update paths, without compiling: which implementation runs, parameters in
cache-sized pieces (bit-identical to torch's own optimizer on whole tensors), the state per
parameter, threads, matrix optimizers, parameters kept on the device.

The host slots are made by hand here (what ``offload="all"`` does at compile time), and the
host gradients written directly; the end-to-end cases through the backend are in
``test_model_state.py`` and at the bottom of this file.
"""

import copy
import threading

import pytest
import torch

from offload_compiler import CPUOptimizer
from offload_compiler.runtime.cpu_optim import ELEMENTWISE, fused_cpu_kernel, set_thread_num_threads
from offload_compiler.runtime.model_state import ON_DEVICE_ATTR, ensure_slot, slot_of
from offload_compiler.runtime.pool import HostPool

OPTIONS = {
    torch.optim.SGD: dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
    torch.optim.Adam: dict(lr=1e-2, amsgrad=True),
    torch.optim.AdamW: dict(lr=1e-2, weight_decay=0.1),
    torch.optim.Adamax: dict(lr=1e-2),
    torch.optim.Adagrad: dict(lr=1e-2, lr_decay=0.01),
    torch.optim.RMSprop: dict(lr=1e-2, momentum=0.9, centered=True),
    torch.optim.NAdam: dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1),
    torch.optim.RAdam: dict(lr=1e-2),
    torch.optim.ASGD: dict(lr=1e-2),
    torch.optim.Rprop: dict(lr=1e-2),
    torch.optim.Adadelta: dict(lr=1.0),
}
SHAPES = [(37, 29), (1000,), (5,), (3, 7, 11)]  # sizes around and off the 64-element pieces


def params(seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def offload(ps, on_device=()):
    """What offload='all' does to each parameter at compile time: a host master copy and a host
    gradient (or, for the indices in ``on_device``, the plan's "kept on the device" mark)."""
    pool = HostPool(1 << 30, pin_memory=False, on_full="error")
    for i, p in enumerate(ps):
        if i in on_device:
            setattr(p, ON_DEVICE_ATTR, True)
            continue
        slot = ensure_slot(p, pool, keep_resident=False)
        slot.enable_host_grad()
        slot.release(write_back=False)  # between steps the device holds nothing
    return pool


def set_grads(ps, seed):
    """The same gradients for the reference (``.grad``) and the offloaded copies (host gradient,
    or ``.grad`` of a parameter kept on the device)."""
    g = torch.Generator().manual_seed(1000 + seed)
    grads = [torch.randn(p.shape, generator=g) for p in ps]
    return grads


def give(ps, grads):
    for p, gr in zip(ps, grads):
        s = slot_of(p)
        if s is None:
            p.grad = gr.clone()
        else:
            s.grad.copy_(gr)
            s.grad_valid = True


def value(p):
    s = slot_of(p)
    return s.master if s is not None else p.detach()


def run_both(cls, kwargs, steps=4, cpu_kwargs=None, ref_kwargs=None, on_device=(), shapes=SHAPES):
    ref = params(shapes=shapes)
    ps = params(shapes=shapes)
    offload(ps, on_device)
    opt_ref = cls(ref, **kwargs, **(ref_kwargs or {}))
    opt = CPUOptimizer(ps, cls, **kwargs, **(cpu_kwargs or {}))
    for step in range(steps):
        grads = set_grads(ref, step)
        for p, gr in zip(ref, grads):
            p.grad = gr.clone()
        give(ps, grads)
        opt_ref.step()
        opt.step()
        opt.synchronize()
    return ref, ps, opt_ref, opt


@pytest.mark.parametrize("cls", sorted(ELEMENTWISE, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_pieces_are_bit_identical_to_torch_on_whole_tensors(cls):
    """256-byte pieces (64 fp32 elements): every parameter but the 5-element one is split, some
    with a short last piece; four steps give the bits of torch's own for-loop."""
    ref, ps, opt_ref, opt = run_both(cls, OPTIONS[cls], cpu_kwargs={"piece_bytes": 256})
    assert opt.implementation.startswith("for-loop over cache-sized pieces of 256 bytes"), opt.implementation
    counts = [len(pc) for c in opt._chunks for pc in c.pieces]
    assert counts == [17, 16, 1, 4], counts  # ceil(numel / 64) pieces; 5 elements stay whole
    for i, (a, b) in enumerate(zip(ref, ps)):
        assert torch.equal(a.detach(), value(b)), (cls.__name__, i)
    # The state per parameter, shaped like it, equal to torch's.
    sd, sd_ref = opt.state_dict(), opt_ref.state_dict()
    assert sd["state"].keys() == sd_ref["state"].keys()
    for i, st in sd_ref["state"].items():
        assert sd["state"][i].keys() == st.keys(), (i, st.keys())
        for key, v in st.items():
            got = sd["state"][i][key]
            if isinstance(v, torch.Tensor):
                assert got.shape == v.shape and torch.equal(got, v), (cls.__name__, i, key)
            else:
                assert got == v, (cls.__name__, i, key)


def test_state_of_pieces_is_live_and_a_checkpoint_resumes_bit_identically():
    ref, ps, opt_ref, opt = run_both(torch.optim.AdamW, OPTIONS[torch.optim.AdamW], cpu_kwargs={"piece_bytes": 256})
    sd = opt.state_dict()
    # Live: the pieces' state tensors are views of what state_dict returned.
    exp_avg = sd["state"][0]["exp_avg"]
    piece_states = [opt._chunks[0].optimizer.state[q]["exp_avg"] for q in opt._chunks[0].pieces[0]]
    assert all(t.untyped_storage().data_ptr() == exp_avg.untyped_storage().data_ptr() for t in piece_states)
    snapshot = copy.deepcopy(sd)
    # A fresh optimizer over copies of the parameters, loaded from the checkpoint before its first step.
    ps2 = [torch.nn.Parameter(value(p).clone()) for p in ps]
    offload(ps2)
    opt2 = CPUOptimizer(ps2, torch.optim.AdamW, **OPTIONS[torch.optim.AdamW], piece_bytes=256)
    opt2.load_state_dict(snapshot)
    for step in range(4, 7):
        grads = set_grads(ref, step)
        for p, gr in zip(ref, grads):
            p.grad = gr.clone()
        give(ps2, grads)
        opt_ref.step()
        opt2.step()
        opt2.synchronize()
    for a, b in zip(ref, ps2):
        assert torch.equal(a.detach(), value(b))
    for i, st in opt_ref.state_dict()["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt2.state_dict()["state"][i][key], st[key]), (i, key)
    # No two pieces share a step counter (each piece's own tensor, all equal).
    steps = [opt2._chunks[0].optimizer.state[q]["step"] for q in opt2._chunks[0].pieces[0]]
    assert len({id(t) for t in steps}) == len(steps) and all(float(t) == 7.0 for t in steps)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Adagrad])
def test_fastest_runs_torchs_fused_kernel_with_its_bits(cls):
    assert fused_cpu_kernel(cls)
    ref, ps, _, opt = run_both(cls, OPTIONS[cls], cpu_kwargs={"implementation": "fastest"}, ref_kwargs={"fused": True})
    assert opt.implementation == f"fused: torch's fused CPU kernel of {cls.__name__}"
    assert all(len(pc) == 1 for c in opt._chunks for pc in c.pieces)  # one pass: never split
    for a, b in zip(ref, ps):
        assert torch.equal(a.detach(), value(b))
    assert opt.state_dict()["param_groups"][0]["fused"] is True


def test_fastest_without_a_fused_kernel_says_which_path_runs():
    assert not fused_cpu_kernel(torch.optim.RMSprop)
    kwargs = OPTIONS[torch.optim.RMSprop]
    ref, ps, _, opt = run_both(
        torch.optim.RMSprop, kwargs, cpu_kwargs={"implementation": "fastest", "piece_bytes": 256}
    )
    assert "torch has no fused CPU kernel of RMSprop" in opt.implementation
    assert opt.implementation.startswith("for-loop over cache-sized pieces")
    for a, b in zip(ref, ps):  # the bits of torch's default (for-loop) RMSprop
        assert torch.equal(a.detach(), value(b))


def test_exact_keeps_the_options_given():
    kwargs = OPTIONS[torch.optim.AdamW]
    for extra, words in (({"foreach": True}, "foreach: "), ({"fused": True}, "fused: ")):
        ref, ps, _, opt = run_both(torch.optim.AdamW, kwargs, cpu_kwargs=extra, ref_kwargs=extra)
        assert opt.implementation.startswith(words)
        for a, b in zip(ref, ps):
            assert torch.equal(a.detach(), value(b))


def test_bad_arguments_are_refused():
    ps = params()
    with pytest.raises(ValueError, match="implementation must be 'exact' or 'fastest', got 'quick'"):
        CPUOptimizer(ps, implementation="quick")
    with pytest.raises(ValueError, match="implementation='fastest' chooses the implementation itself; drop 'fused'"):
        CPUOptimizer(ps, implementation="fastest", fused=True)
    with pytest.raises(ValueError, match="piece_bytes must be a positive int, got 0"):
        CPUOptimizer(ps, piece_bytes=0)
    with pytest.raises(ValueError, match="num_threads must be None or an int >= 1, got 0"):
        CPUOptimizer(ps, num_threads=0)
    with pytest.raises(ValueError, match="Invalid learning rate"):  # torch's own check, at construction
        CPUOptimizer(ps, torch.optim.AdamW, lr=-1.0)


TORCH_OPTIMIZERS = sorted(
    (
        c
        for c in vars(torch.optim).values()
        if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer
    ),
    key=lambda c: c.__name__,
)
REFUSED = {
    torch.optim.LBFGS: "its step\\(\\) requires a closure",
    torch.optim.SparseAdam: "it accepts only sparse gradients",
}


@pytest.mark.parametrize("cls", TORCH_OPTIMIZERS, ids=lambda c: c.__name__)
def test_every_torch_optim_class_runs_or_is_refused_at_construction(cls):
    """Every optimizer class torch.optim exports either steps with the bits of torch's own run on
    the same tensors (2-D parameters, which Muon needs; two steps, torch's defaults) or is refused
    when the CPUOptimizer is built, naming the class and why (LBFGS's step needs a closure,
    SparseAdam needs sparse gradients): before, LBFGS constructed and its first step failed with
    "an update on the worker thread failed"."""
    assert torch.optim.AdamW in TORCH_OPTIMIZERS and len(TORCH_OPTIMIZERS) >= 15  # the scan found them
    shapes = [(48, 32), (16, 48)]
    if cls in REFUSED:
        with pytest.raises(
            ValueError, match=rf"CPUOptimizer: torch\.optim\.{cls.__name__} cannot be used: {REFUSED[cls]}"
        ):
            CPUOptimizer(params(shapes=shapes), cls)
        return
    ref, ps, _, opt = run_both(cls, {}, steps=2, shapes=shapes)
    for a, b, start in zip(ref, ps, params(shapes=shapes)):
        assert not torch.equal(a.detach(), start.detach())  # the update moved it
        assert torch.equal(a.detach(), value(b))


def test_closure_optimizers_are_refused_sharded_or_not_and_subclasses_too():
    """The refusal comes before anything else is checked (a sharded LBFGS gets the same message,
    not one about the group), and it follows the step's signature, not the class's name."""

    class MyLBFGS(torch.optim.LBFGS):
        pass

    class NeedsClosure(torch.optim.SGD):
        def step(self, closure):
            return super().step(closure)

    class Sparse(torch.optim.SparseAdam):
        pass

    with pytest.raises(ValueError, match=r"torch\.optim\.LBFGS cannot be used: its step\(\) requires a closure"):
        CPUOptimizer(params(), torch.optim.LBFGS, shard_group=object())
    for cls, why in (
        (MyLBFGS, "requires a closure"),
        (NeedsClosure, "requires a closure"),
        (Sparse, "sparse gradients"),
    ):
        with pytest.raises(ValueError, match=rf"CPUOptimizer: \S+\.{cls.__qualname__} cannot be used: .*{why}"):
            CPUOptimizer(params(), cls, lr=0.1)
    with pytest.raises(ValueError, match="optimizer_class must be a torch.optim.Optimizer subclass, got 'adamw'"):
        CPUOptimizer(params(), "adamw")


def test_muon_constructs_and_sees_each_matrix_whole():
    """torch.optim.Muon refuses parameters that are not 2-D: the defaults probe has the first
    parameter's dimensions, and no parameter is cut into flat pieces (the orthogonalisation needs
    the matrix)."""
    shapes = [(48, 32), (16, 48)]
    ref, ps, opt_ref, opt = run_both(
        torch.optim.Muon, {"lr": 0.02}, steps=3, cpu_kwargs={"piece_bytes": 256}, shapes=shapes
    )
    assert "each parameter whole, with its own shape" in opt.implementation
    inner = [q for c in opt._chunks for pc in c.pieces for q in pc]
    assert [tuple(q.shape) for q in inner] == shapes
    for a, b in zip(ref, ps):
        assert torch.equal(a.detach(), value(b))
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        CPUOptimizer([torch.nn.Parameter(torch.zeros(3))], torch.optim.Muon, lr=0.02)


def test_parameters_kept_on_the_device_are_updated_there_with_the_same_bits():
    """Parameters 0 and 2 kept on the device (the plan's optimizer_on_device share; on this machine
    the device is the CPU): the same torch optimizer updates them in place, with .grad; the
    state_dict numbers all parameters in the order given."""
    kwargs = OPTIONS[torch.optim.AdamW]
    ref, ps, opt_ref, opt = run_both(torch.optim.AdamW, kwargs, on_device=(0, 2), cpu_kwargs={"piece_bytes": 256})
    assert opt._device_params == [0, 2]
    assert [slot_of(p) is None for p in ps] == [True, False, True, False]
    for a, b in zip(ref, ps):
        assert torch.equal(a.detach(), value(b))
    sd, sd_ref = opt.state_dict(), opt_ref.state_dict()
    for i, st in sd_ref["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sd["state"][i][key], st[key]), (i, key)
    grads = opt.host_grads()
    assert grads[0] is ps[0].grad and grads[1] is slot_of(ps[1]).grad
    opt.zero_grad()
    assert ps[0].grad is None and ps[2].grad is None
    # Clipping covers both sides, in parameter order.
    for p, gr in zip(ref, set_grads(ref, 9)):
        p.grad = gr.clone()
    give(ps, set_grads(ref, 9))
    assert torch.equal(opt.clip_grad_norm_(0.5), torch.nn.utils.clip_grad_norm_(ref, 0.5))
    for p, g in zip(ref, opt.host_grads()):
        assert torch.equal(p.grad, g)


def test_worker_threads_do_not_change_other_threads():
    main_before = torch.get_num_threads()
    seen = {}

    n = main_before + 1

    def body():
        set_thread_num_threads(n)
        seen["worker"] = torch.get_num_threads()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    later = threading.Thread(target=lambda: seen.__setitem__("later", torch.get_num_threads()))
    later.start()
    later.join()
    assert seen["worker"] == n
    assert torch.get_num_threads() == main_before
    assert seen["later"] == main_before  # a thread started afterwards gets the process's setting


def test_muon_through_offload_all_matches_eager_muon():
    """The issue's case: a 2-layer model compiled with offload='all', torch.optim.Muon in a
    CPUOptimizer, 3 steps: parameters bit-identical to Muon run eagerly on an eager copy."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.Tanh(), torch.nn.Linear(32, 8, bias=False))
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, backend="trinity", options={"offload": "all", "inner": "eager"})
    opt_ref = torch.optim.Muon(ref.parameters(), lr=0.02)
    opt = CPUOptimizer(model.parameters(), torch.optim.Muon, lr=0.02)
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        ref(x).square().mean().backward()
        compiled(x).square().mean().backward()
        for p, g in zip(ref.parameters(), opt.host_grads()):
            assert torch.equal(p.grad, g), step
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    opt.synchronize()
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p.detach(), slot_of(q).master)
    torch._dynamo.reset()


def test_script_ending_right_after_step_exits_cleanly(tmp_path):
    """A training script that ends right after ``opt.step()`` (no ``synchronize()``): the worker
    finishes the queued update and stops at interpreter exit. A fresh-user trial's script
    aborted there ("terminate called without an active exception", exit code 134) 3 times in 3:
    the daemon worker was killed inside a torch kernel."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(
        "import torch, offload_compiler\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))\n"
        "c = torch.compile(model, backend='trinity', options={'inner': 'eager', 'offload': 'all'})\n"
        "opt = offload_compiler.CPUOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)\n"
        "for s in range(2):\n"
        "    c(torch.randn(1024, 64)).square().mean().backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
        "print('done', flush=True)\n"
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "done" in run.stdout, (run.returncode, run.stderr[-2000:])
