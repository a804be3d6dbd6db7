"""Every DDP setting that ``offload="all"`` cannot honour is refused at the first call, naming the
setting (``offload_compiler.distributed.check_combination``), and the same settings with
``offload="activations"`` run. The communication hook and FSDP2 refusals run under ``torchrun`` in
``tests/test_distributed.py``; these need no second rank, so they run in this process on a
one-rank gloo group (loopback, a ``HashStore``), destroyed after the module."""

import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from offload_compiler.distributed import Engine, UnsupportedCombinationError, check_combination
from offload_compiler.options import TrinityOptions

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
    pytest.mark.xdist_group("process_group"),  # one default process group per process
]


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a default process group exists already")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class MLP(nn.Module):
    """A module of the test's own: Dynamo compiles its frame under DDP's forward (a top-level
    ``nn.Sequential`` frame, torch's own code, it would not)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.last = nn.Linear(32, 1)

    def forward(self, x):
        return self.last(torch.tanh(self.first(x)))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


X = torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16).sin()


def first_call(ddp: nn.Module, offload: str) -> Exception | None:
    """Compile ``ddp`` with trinity and run one training step; the backend's error (unwrapped
    from Dynamo's) or ``None``."""
    torch._dynamo.reset()
    compiled = torch.compile(ddp, backend="trinity", options={"inner": "eager", "offload": offload})
    try:
        compiled(X).sum().backward()
    except Exception as exc:  # noqa: BLE001  (Dynamo wraps the backend's error)
        return getattr(exc, "inner_exception", exc)
    return None


def _mixed_precision():
    from torch.nn.parallel.distributed import _MixedPrecision

    m = mlp()
    return m, {"mixed_precision": _MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.bfloat16)}


def _delayed_some():
    m = mlp()
    first = [(n, p) for n, p in m.named_parameters() if n.startswith("first.")]
    return m, {"delay_all_reduce_named_params": first, "param_to_hook_all_reduce": m.last.bias}


SETTINGS = {
    "mixed_precision": (_mixed_precision, "DDP's mixed_precision"),
    "find_unused_parameters": (lambda: (mlp(), {"find_unused_parameters": True}), "find_unused_parameters=True"),
    "static_graph": (lambda: (mlp(), {"static_graph": True}), "static_graph=True"),
    "delay_some": (_delayed_some, "delay_all_reduce_named_params"),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_ddp_setting_with_offload_all_is_refused_naming_it(setting):
    from torch.nn.parallel import DistributedDataParallel as DDP

    build, named = SETTINGS[setting]
    model, kwargs = build()
    ddp = DDP(model, **kwargs)
    if setting == "mixed_precision":
        # DDP's mixed precision runs on CUDA only (its forward records CUDA events): the check
        # the backend runs at compile time, on the engine it would detect.
        err = None
        try:
            check_combination(
                Engine("ddp", weakref.ref(ddp), 1),
                TrinityOptions.from_user({"offload": "all", "inner": "eager"}, env={}),
            )
        except UnsupportedCombinationError as exc:
            err = exc
    else:
        err = first_call(ddp, "all")
    assert isinstance(err, UnsupportedCombinationError), repr(err)
    msg = str(err)
    assert named in msg and "offload='all'" in msg and "offload='activations+params'" in msg, msg


@pytest.mark.parametrize("setting", ["find_unused_parameters", "static_graph"])
def test_the_same_setting_with_activation_offload_runs(setting):
    """The refusal is for offload='all' only: with activation offload DDP's reducer reduces as
    usual, and the gradients equal DDP's without trinity."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    build, _ = SETTINGS[setting]
    model, kwargs = build()
    ref_model, _ = build()
    assert first_call(DDP(model, **kwargs), "activations") is None
    ref = DDP(ref_model, **kwargs)  # alive through the backward (its hooks hold it weakly)
    ref(X).sum().backward()
    for p, r in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)


def test_python_reducer_with_offload_all_is_refused():
    from torch.nn.parallel import DistributedDataParallel as DDP

    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):  # (monkeypatch would delete the key)
        err = first_call(DDP(mlp()), "all")
    assert isinstance(err, UnsupportedCombinationError), repr(err)
    assert "Python reducer" in str(err), str(err)


def test_offload_all_keeps_ddps_reducer_idle_and_reduces_an_uncompiled_step():
    """With offload='all' trinity reduces the gradients itself and registers its comm hook on
    the DDP module: DDP's reducer returns every bucket of a compiled backward without
    communicating. A backward of the module run uncompiled (parameters materialized) is not
    trinity's: the hook reduces that bucket as DDP would (one rank: the gradient itself)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from offload_compiler import CPUOptimizer, materialized
    from offload_compiler.runtime.grad_sync import idle_comm_hook

    torch._dynamo.reset()
    model, ref_model = mlp(), mlp()
    ddp = DDP(model)
    compiled = torch.compile(ddp, backend="trinity", options={"inner": "eager", "offload": "all"})
    opt = CPUOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    for _ in range(2):
        compiled(X).sum().backward()
        # The idle buckets DDP's reducer writes back into p.grad (zeros) are dropped at the end
        # of the backward: no device memory held until zero_grad, nothing for a torch.optim
        # optimizer to step on the released parameters.
        assert all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad()
        ref_model(X).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    [(hook, state)] = ddp._comm_hooks
    assert hook is idle_comm_hook
    buckets = len(ddp.reducer._get_zeros_like_grad_buckets())
    assert (state.idle_buckets, state.reduced_buckets) == (2 * buckets, 0)
    with materialized(model.parameters()):
        for p, r in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, r, rtol=1e-6, atol=0)
        ddp(X).sum().backward()
        ref_model(X).sum().backward()
        assert (state.idle_buckets, state.reduced_buckets) == (2 * buckets, buckets)
        for p, r in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=0)
    # On exit the averaged gradients of that uncompiled step went to the host gradients, and
    # the CPU optimizer steps with them (a fresh-user trial: they were dropped silently).
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    opt.zero_grad()
    ref_opt.step()
    ref_opt.zero_grad()
    with materialized(model.parameters()):
        for p, r in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, r, rtol=1e-6, atol=0)


def test_offload_all_under_ddp_with_a_torch_optimizer_fails_with_trinitys_error():
    """offload='all' under DDP with a torch.optim optimizer instead of CPUOptimizer: the step
    updates nothing (p.grad stays None) and the next forward raises trinity's error naming the
    parameter (a fresh-user trial: DDP's zero p.grad made AdamW step the released parameters
    and both ranks died with SIGSEGV)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    model = mlp()
    ddp = DDP(model)
    compiled = torch.compile(ddp, backend="trinity", options={"inner": "eager", "offload": "all"})
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    compiled(X).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    with pytest.raises(RuntimeError, match=r"no offload_compiler.CPUOptimizer owns this parameter"):
        compiled(X).sum().backward()
