"""Changes to Inductor's CPU code generation for trinity's graphs, scoped to trinity's own compiles.

Two today, both for the CPU (C++) code generator: kernel functions split where buffers die, so
that they are freed where the plan frees them, and a bug fix.

**Kernel functions split where buffers die.** ``CppScheduling`` (``torch/_inductor/codegen/cpp.py``)
adds every scheduled loop node to one kernel group, and ``Scheduler.codegen`` emits the group as
one ``cpp_fused_*`` function (one call from the wrapper) only when the backend is
``ready_to_flush`` (past 500 kernel arguments) or at an extern or fallback kernel (``mm``, any
``trinity::`` op), a template or a device change. The group's outputs are all allocated before
the call, and the buffers whose last reader is in it are freed after it: a LayerNorm/GELU MLP's
backward ran each layer's LayerNorm and GELU backward as one function that kept the prefetched
saved LayerNorm input (2 MiB) and a 2 MiB product alive to the layer's input gradient, and the
first step measured 22,095,880 bytes against a plan of 19,980,300 and a budget of 20,190,009
(:func:`~offload_compiler.passes.liveness.analyze` frees a buffer after its last reader's kernel,
as on a GPU, where each fused node is a kernel launch of its own). While trinity compiles a CPU
graph, ``CppScheduling.ready_to_flush`` also answers True once the buffers whose last reader the
group has run would free at least :data:`FREE_AT_ONCE_BYTES` (64 KiB, the verifier's allocator
slack), so ``Scheduler.codegen`` emits the group there and frees them (the path it takes past 500
arguments): no more than that is held past the plan's free, and the groups stay long where
nothing large dies (a group per fused node cost the Llama preset's step 3% more on this 2-core
CPU: 125 kernel calls against 48; this way 82, no difference measured). The loops in each
function are the ones the group would hold, so values are unchanged.

The bug fix, for the CPU (C++) code generator of torch 2.13 (and the versions before the
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
plain Inductor's (and :data:`KERNEL_SPLIT_TAG` those of the kernel-group split).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "KERNEL_SPLIT_TAG",
    "TILE2D_ATOMIC_ADD_TAG",
    "cpu_codegen_fixes",
    "kernel_split_available",
    "tile2d_atomic_add_needs_fix",
    "with_cpu_codegen_fixes",
]

# Appended to torch.compiler.config.cache_key_tag while the fix is installed.
TILE2D_ATOMIC_ADD_TAG = "trinity-tile2d-atomic-add-fix"
# Appended while CppScheduling emits a kernel group wherever it frees 64 KiB or more.
KERNEL_SPLIT_TAG = "trinity-cpp-kernel-split"


@functools.cache
def kernel_split_available() -> bool:
    """Whether this torch's C++ scheduling has the ``ready_to_flush`` hook that
    ``Scheduler.codegen`` asks after each node (module docstring), which the change answers, and a
    ``Scheduler.free_buffers`` whose filtering :func:`_pending_free_bytes` mirrors.

    The mirror is of private Inductor code (torch 2.13's ``free_buffers``: pending names less
    ``V.graph.removed_buffers`` and ``V.graph.wrapper_code.freed``; scheduler buffers that
    ``can_free()``; graph inputs). A torch whose ``free_buffers`` no longer reads those names gets
    plain Inductor's kernel groups (False) rather than a count that may be wrong."""
    try:
        from torch._inductor.codegen import cpp
        from torch._inductor.scheduler import Scheduler
    except ImportError:
        return False
    if not callable(getattr(cpp.CppScheduling, "ready_to_flush", None)):
        return False
    try:
        codegen = inspect.getsource(Scheduler.codegen)
        if "ready_to_flush()" not in codegen:
            codegen = inspect.getsource(Scheduler._codegen)
        free_buffers = inspect.getsource(Scheduler.free_buffers)
    except (OSError, TypeError, AttributeError):
        return False
    mirrored = ("buffer_names_to_free", "removed_buffers", "wrapper_code.freed", "can_free()", "graph_inputs")
    return "ready_to_flush()" in codegen and all(name in free_buffers for name in mirrored)


FREE_AT_ONCE_BYTES = 64 * 1024
"""A kernel group is emitted once the buffers whose last reader it has run would free at least
this many bytes (the verifier's allocator slack, ``PEAK_SLACK_BYTES``)."""


def _pending_free_bytes(scheduler) -> int:
    """Bytes the scheduler's pending frees (``Scheduler.buffer_names_to_free``, emitted at its
    next ``free_buffers``) would release: buffers it may free and graph inputs."""
    from torch._inductor.virtualized import V

    pending = scheduler.buffer_names_to_free - V.graph.removed_buffers - V.graph.wrapper_code.freed
    sizevars = V.graph.sizevars
    # torch 2.13 names it optimization_hint; earlier versions size_hint (same fallback keyword).
    hint = getattr(sizevars, "optimization_hint", None) or sizevars.size_hint
    total = 0
    for name in pending:
        buf = scheduler.name_to_buf.get(name)
        if buf is not None:
            if not buf.can_free():
                continue
            node = buf.node
        elif name in V.graph.graph_inputs:
            node = V.graph.graph_inputs[name]
        else:
            continue
        try:
            layout = node.get_layout()
            nbytes = hint(layout.storage_size(), fallback=0) * layout.dtype.itemsize
        except Exception:  # no layout (a symbolic value, a TorchBind object): nothing to free
            continue
        total += int(nbytes)
    return total


def _ready_to_flush_when_freeing(self) -> bool:
    """``CppScheduling.ready_to_flush`` while trinity compiles: Inductor's own condition, or the
    pending frees reach :data:`FREE_AT_ONCE_BYTES`."""
    if self._ready_to_flush:
        return True
    scheduler = getattr(self, "scheduler", None)
    return scheduler is not None and _pending_free_bytes(scheduler) >= FREE_AT_ONCE_BYTES


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
    """Install the changes of this module for the compiles run inside the block (only for a CPU
    ``device``; each where this torch needs or offers it); yields whether the tile-2D fix was
    installed.

    Inductor generates the kernels of a graph inside ``compile_fx`` in the calling thread, so the
    block must contain the whole compile. The previous ``CppKernelProxy.tile2d_kernel_cls``,
    ``CppScheduling.ready_to_flush`` and ``cache_key_tag`` are restored on exit, also when the
    compile raises."""
    fix_tile2d = device.type == "cpu" and tile2d_atomic_add_needs_fix()
    split = device.type == "cpu" and kernel_split_available()
    if not (fix_tile2d or split):
        yield False
        return
    import torch.compiler.config as compiler_config
    from torch._inductor.codegen import cpp

    saved_tile2d = cpp.CppKernelProxy.tile2d_kernel_cls if fix_tile2d else None
    saved_flush = cpp.CppScheduling.__dict__.get("ready_to_flush")
    tags = [t for t in (compiler_config.cache_key_tag,) if t]
    if fix_tile2d:
        cpp.CppKernelProxy.tile2d_kernel_cls = _fixed_tile2d_kernel_cls()
        tags.append(TILE2D_ATOMIC_ADD_TAG)
    if split:
        cpp.CppScheduling.ready_to_flush = _ready_to_flush_when_freeing
        tags.append(KERNEL_SPLIT_TAG)
    try:
        with compiler_config.patch(cache_key_tag="|".join(tags)):
            yield fix_tile2d
    finally:
        if fix_tile2d:
            cpp.CppKernelProxy.tile2d_kernel_cls = saved_tile2d
        if split:
            if saved_flush is None:
                del cpp.CppScheduling.ready_to_flush
            else:
                cpp.CppScheduling.ready_to_flush = saved_flush


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
