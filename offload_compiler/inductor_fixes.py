"""Fixes for Inductor code-generation bugs that trinity's graphs meet, scoped to trinity's own compiles.

One fix today, for the CPU (C++) code generator of torch 2.13 (and the versions before the
upstream fix, pytorch/pytorch#191837 / pull request #191861):

**2-D tiled accumulating stores scale the inner tile index twice.** A fused kernel whose reads
are contiguous along two different loop variables is generated as a 2-D tiled loop
(``CppTile2DKernel``: an outer variable ``x1`` stepped by the vector width, an inner loop
``x1_inner``). Its stores go through ``CppTile2DKernel.store``, which rewrites the address with
``transform_indexing`` (``x1 -> x1 + x1_inner``) before delegating to ``CppVecKernel.store``. In
the accumulating mode (``index_put(..., accumulate=True)`` and every op Inductor lowers to it,
such as embedding and advanced-indexing backward) that method, when the kernel runs on more than
one thread, derives the vector of addresses through ``ops.index_expr``, which in a 2-D tiled
kernel is ``CppTile2DOverrides.index_expr``: it applies ``transform_indexing`` a second time. The
emitted ``atomic_add_vec`` then adds to ``64*x1 + 128*x1_inner`` instead of ``64*(x1 + x1_inner)``:
wrong addresses, and past the end of the buffer where the doubled variable has the larger stride
(Hugging Face Falcon's backward under trinity: up to 448 floats past a 64 KiB buffer, heap
corruption). With one thread the non-atomic ``+=`` store is generated, which is correct.

The fix passes the untransformed index to ``CppVecKernel.store`` in exactly that branch
(accumulating store, not transposed, more than one thread or ``cpp.dynamic_threads``), as the
upstream pull request does, so the index is transformed once. Every other store is generated
unchanged. It is installed through the code generator's own customisation point
(``CppKernelProxy.tile2d_kernel_cls``) only while trinity compiles a CPU graph, and a tag in
``torch.compiler.config.cache_key_tag`` keeps those graphs' FX-graph cache entries apart from
plain Inductor's.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["TILE2D_ATOMIC_ADD_TAG", "cpu_codegen_fixes", "tile2d_atomic_add_needs_fix", "with_cpu_codegen_fixes"]

# Appended to torch.compiler.config.cache_key_tag while the fix is installed.
TILE2D_ATOMIC_ADD_TAG = "trinity-tile2d-atomic-add-fix"


@functools.cache
def tile2d_atomic_add_needs_fix() -> bool:
    """Whether this torch's C++ code generator has the double ``transform_indexing`` of 2-D tiled
    accumulating stores (module docstring), and offers the hook the fix uses.

    True when ``CppTile2DOverrides.index_expr`` applies ``transform_indexing`` (the second
    application; the first is in ``CppTile2DKernel.store``), ``CppVecKernel.store`` derives the
    atomic addresses with ``ops.index_expr``, and ``CppKernelProxy.tile2d_kernel_cls`` exists. False
    when any of these does not hold (a torch that changed that code) or the sources are unreadable."""
    try:
        from torch._inductor.codegen import cpp
    except ImportError:
        return False
    needed = ("CppTile2DKernel", "CppTile2DOverrides", "CppVecKernel", "CppKernelProxy")
    if not all(hasattr(cpp, n) for n in needed) or not hasattr(cpp.CppKernelProxy, "tile2d_kernel_cls"):
        return False
    try:
        index_expr = inspect.getsource(cpp.CppTile2DOverrides.index_expr)
        vec_store = inspect.getsource(cpp.CppVecKernel.store)
    except (OSError, TypeError):
        return False
    return "transform_indexing" in index_expr and "ops.index_expr(index" in vec_store


@functools.cache
def _fixed_tile2d_kernel_cls() -> type:
    from torch._inductor import config
    from torch._inductor.codegen.cpp import CppTile2DKernel, CppVecKernel

    class TrinityTile2DKernel(CppTile2DKernel):
        """``CppTile2DKernel`` whose parallel accumulating stores transform their index once."""

        def store(self, name, index, value, mode=None):
            parallel_atomic = mode == "atomic_add" and (config.cpp.dynamic_threads or self.num_threads != 1)
            if parallel_atomic and not self.need_vec_transpose(self.rename_indexing(index)):
                # CppVecKernel.store's atomic branch applies transform_indexing itself, through
                # ops.index_expr (CppTile2DOverrides): hand it the index as it came.
                return CppVecKernel.store(self, name, index, value, mode)
            return super().store(name, index, value, mode)

    return TrinityTile2DKernel


@contextlib.contextmanager
def cpu_codegen_fixes(device: torch.device) -> Iterator[bool]:
    """Install the fixes of this module for the compiles run inside the block; yields whether they
    were installed (only for a CPU ``device`` on a torch that needs them).

    Inductor generates the kernels of a graph inside ``compile_fx`` in the calling thread, so the
    block must contain the whole compile. The previous ``CppKernelProxy.tile2d_kernel_cls`` and
    ``cache_key_tag`` are restored on exit, also when the compile raises."""
    if device.type != "cpu" or not tile2d_atomic_add_needs_fix():
        yield False
        return
    import torch.compiler.config as compiler_config
    from torch._inductor.codegen import cpp

    saved = cpp.CppKernelProxy.tile2d_kernel_cls
    tag = compiler_config.cache_key_tag
    cpp.CppKernelProxy.tile2d_kernel_cls = _fixed_tile2d_kernel_cls()
    try:
        with compiler_config.patch(cache_key_tag=f"{tag}|{TILE2D_ATOMIC_ADD_TAG}" if tag else TILE2D_ATOMIC_ADD_TAG):
            yield True
    finally:
        cpp.CppKernelProxy.tile2d_kernel_cls = saved


def with_cpu_codegen_fixes(device: torch.device, inner_compile: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """``inner_compile`` (default Inductor's ``compile_fx_inner``) run inside
    :func:`cpu_codegen_fixes` for ``device``: pass it as ``compile_fx(..., inner_compile=...)``.

    Each graph (forward, backward, inference) is generated inside the block, including a backward
    that AOTAutograd compiles lazily at its first run, after ``compile_fx`` has returned."""
    if inner_compile is None:
        from torch._inductor.compile_fx import compile_fx_inner as inner_compile

    @functools.wraps(inner_compile)
    def compile_graph(gm, example_inputs, *args, **kwargs):
        with cpu_codegen_fixes(device):
            return inner_compile(gm, example_inputs, *args, **kwargs)

    return compile_graph
