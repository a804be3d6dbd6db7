"""offload_compiler/inductor_fixes.py: torch's CPU 2-D tiled accumulating stores, generated on more
than one thread, scale the inner tile index twice (pytorch/pytorch#191837); trinity's compiles
generate them with the index scaled once, and leave every other compile alone."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.codegen import cpp
from torch._inductor.utils import run_and_get_code

import offload_compiler  # noqa: F401  (the trinity backend)
from offload_compiler.inductor_fixes import (
    KERNEL_SPLIT_TAG,
    TILE2D_ATOMIC_ADD_TAG,
    cpu_codegen_fixes,
    kernel_split_available,
    tile2d_atomic_add_needs_fix,
)

needs_fix = pytest.mark.skipif(not tile2d_atomic_add_needs_fix(), reason="this torch's C++ codegen has no such bug")

# An (8, 32, 4, 16) buffer, rows of 64 floats: out[b, s, 3, d] += 2 * w[b, d, s]. The values are
# read transposed, so Inductor tiles the kernel in 2-D (s and d), and the store accumulates.
B, S, H, D = 8, 32, 4, 16


def _scatter(w, idx):
    vals = (w * 2).transpose(1, 2).unsqueeze(2)
    return torch.ops.aten.index_put.default(torch.zeros(B, S, H, D), [None, None, idx], vals, True)


@pytest.fixture
def two_threads():
    """Inductor takes its thread count when it compiles; the bug is in the parallel path."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False):
        yield
    torch.set_num_threads(before)
    torch._dynamo.reset()


def _atomic_indices(code: str) -> list[str]:
    """The address expressions of the generated ``atomic_add_vec`` stores."""
    return re.findall(r"auto tmp\d+ = ([^;\n]*);\s*\n[^\n]*\n[^\n]*arange\([^\n]*\n\s*atomic_add_vec", code)


def test_installed_only_for_cpu_and_always_restored():
    original, tag = cpp.CppKernelProxy.tile2d_kernel_cls, torch.compiler.config.cache_key_tag
    with cpu_codegen_fixes(torch.device("cuda", 0)) as on:
        assert on is False
        assert cpp.CppKernelProxy.tile2d_kernel_cls is original
        assert torch.compiler.config.cache_key_tag == tag
    with cpu_codegen_fixes(torch.device("cpu")) as on:
        assert on is tile2d_atomic_add_needs_fix()
        if on:
            assert cpp.CppKernelProxy.tile2d_kernel_cls is not original
            assert issubclass(cpp.CppKernelProxy.tile2d_kernel_cls, cpp.CppTile2DKernel)
            assert TILE2D_ATOMIC_ADD_TAG in torch.compiler.config.cache_key_tag
    assert cpp.CppKernelProxy.tile2d_kernel_cls is original
    assert torch.compiler.config.cache_key_tag == tag
    with pytest.raises(RuntimeError, match="compile failed"):
        with cpu_codegen_fixes(torch.device("cpu")):
            raise RuntimeError("compile failed")
    assert cpp.CppKernelProxy.tile2d_kernel_cls is original
    assert torch.compiler.config.cache_key_tag == tag


def test_kernel_group_split_where_buffers_die_only_inside_trinity_compiles():
    """While trinity compiles a CPU graph, the C++ scheduling emits its kernel group where 64 KiB
    or more would be freed, and frees them there: here the two 256 KiB inputs after the kernel
    that reads them last, before the next kernel's call. Outside, Inductor emits one function."""
    flush = cpp.CppScheduling.ready_to_flush
    tag = torch.compiler.config.cache_key_tag

    def f(x, y):
        a = x.sin() * y
        return a.sum(0).sum() + a.sum(1).sum() + (y.cos() * 3).sum(0).sum()

    x, y = torch.randn(2048, 32), torch.randn(2048, 32)
    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False):
        _, (plain,) = run_and_get_code(torch.compile(f, backend="inductor"), x, y)
        torch._dynamo.reset()
        with cpu_codegen_fixes(torch.device("cpu")):
            assert (cpp.CppScheduling.ready_to_flush is not flush) == kernel_split_available()
            assert (KERNEL_SPLIT_TAG in (torch.compiler.config.cache_key_tag or "")) == kernel_split_available()
            _, (split,) = run_and_get_code(torch.compile(f, backend="inductor"), x, y)
    torch._dynamo.reset()
    assert cpp.CppScheduling.ready_to_flush is flush
    assert torch.compiler.config.cache_key_tag == tag

    def calls(code):
        return [m.start() for m in re.finditer(r"^\s+cpp_fused_\w+\(", code, flags=re.M)]

    assert len(calls(plain)) == 1, plain
    if kernel_split_available():
        first, second = calls(split)
        assert first < split.index("del arg0_1") < second, split
        assert first < split.index("del arg1_1") < second, split


def test_kernel_split_refused_where_free_buffers_changed(monkeypatch):
    """The split counts pending frees by mirroring ``Scheduler.free_buffers``' filtering: a torch
    whose ``free_buffers`` no longer reads the names mirrored gets plain Inductor's groups."""
    from torch._inductor.scheduler import Scheduler

    if not kernel_split_available():
        pytest.skip("this torch's C++ scheduling has no ready_to_flush hook")
    assert kernel_split_available.__wrapped__() is True

    def free_buffers(self):
        """Frees whatever a future torch decides, by other bookkeeping."""
        self.pending_frees.clear()

    monkeypatch.setattr(Scheduler, "free_buffers", free_buffers)
    assert kernel_split_available.__wrapped__() is False


@needs_fix
def test_tile2d_accumulating_store_scales_inner_index_once(two_threads):
    w, idx = torch.randn(B, D, S), torch.tensor([3])
    with cpu_codegen_fixes(torch.device("cpu")):
        out, (code,) = run_and_get_code(torch.compile(_scatter, backend="inductor"), w, idx)
    indices = _atomic_indices(code)
    assert indices, "no parallel 2-D tiled accumulating store was generated:\n" + code
    # s = x1 + x1_inner has stride 64: both terms scaled by 64 (torch 2.13 alone: 64*x1 + 128*x1_inner).
    assert all("64L*x1_inner" in i and "128L*x1_inner" not in i for i in indices), indices
    assert torch.equal(out, _scatter(w, idx))


class _IndexedParam(torch.nn.Module):
    """The backward of ``x[:, :, [3]]`` is an accumulating ``index_put`` of a transposed gradient
    (as in Hugging Face Falcon's fused query/key/value split)."""

    def __init__(self):
        super().__init__()
        self.x = torch.nn.Parameter(torch.randn(B, S, H, D, generator=torch.Generator().manual_seed(0)))

    def forward(self, c):
        return (self.x[:, :, [3]].squeeze(2).transpose(1, 2).sin() * c).sum()


@needs_fix
def test_trinity_backward_with_tiled_index_put_is_exact(two_threads):
    c = torch.randn(B, D, S, generator=torch.Generator().manual_seed(1))
    ref = _IndexedParam()
    ref(c).backward()
    model = _IndexedParam()
    compiled = torch.compile(
        model,
        backend="trinity",
        options={"inner": "inductor", "min_offload_bytes": 0, "memory_budget": "50%", "on_infeasible": "warn"},
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="trinity: memory_budget")  # the "warn" plan of a tiny graph
        _, codes = run_and_get_code(lambda: compiled(c).backward())
    backward = [code for code in codes if "atomic_add_vec" in code]
    assert backward and all("128L*x1_inner" not in i for code in backward for i in _atomic_indices(code)), backward
    # Only row 3 of dim 2 has a gradient: cos(x) * c, transposed back; every other entry is zero.
    torch.testing.assert_close(model.x.grad, ref.x.grad, rtol=1e-6, atol=1e-6)
    assert torch.equal(model.x.grad[:, :, :3], torch.zeros(B, S, 3, D))
