"""Data-stack headroom for generated graph code (``frame_headroom.py``): a frame that ends just
short of a chunk's end makes each of its calls map and unmap a chunk (page faults per call); a
frame given the headroom never does, wherever its caller sits on the stack."""

import resource
import sys
import types

import pytest
import torch
import torch.fx as fx

from offload_compiler import frame_headroom

pytestmark = pytest.mark.skipif(not frame_headroom.applies(), reason="no chunked data stack (CPython >= 3.11)")


def _callee():
    return None


def _loop(n):
    for _ in range(n):
        _callee()


def _enter(n):
    return _loop(n)


def _with_stack(fn, words: int, globals_=None):
    """``fn`` with ``words`` more evaluation-stack slots in its frame (never used)."""
    code = fn.__code__.replace(co_stacksize=fn.__code__.co_stacksize + words)
    return types.FunctionType(code, fn.__globals__ if globals_ is None else globals_)


def faults_per_call(outer_words: int, inner_words: int, calls: int = 64) -> float:
    """Minor page faults per call of ``_callee`` from a ``_loop`` frame of ``inner_words``
    extra words, entered from an ``_enter`` frame of ``outer_words`` extra words (which moves
    where the loop's frame sits in its chunk)."""
    inner = _with_stack(_loop, inner_words)
    outer = _with_stack(_enter, outer_words, dict(_enter.__globals__, _loop=inner))
    outer(2)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    outer(calls)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def test_a_frame_at_a_chunk_end_faults_per_call_and_the_headroom_never_does():
    # The caller's frame at every offset of the current chunk, in steps the callee's frame (about
    # 10 words) cannot step over. An ``_enter`` frame of up to 3000 extra words fits in the
    # current chunk or opens one of at most 32 KiB (its words plus CPython's 1000 to spare,
    # rounded up to a power of two), as a caller's chunk is in practice.
    offsets = range(0, 3000, 4)
    small = frame_headroom.frame_words(_loop.__code__)
    if sys.version_info < (3, 13):
        # The interpreter's own behaviour: some offset puts the loop's frame at a chunk's end.
        worst = max(faults_per_call(o, 0) for o in offsets)
        assert worst >= 1.0, f"no offset made calls cross a chunk boundary (worst {worst} faults per call)"
    pad = frame_headroom.MIN_FRAME_WORDS - small
    with_headroom = max(faults_per_call(o, pad) for o in offsets)
    assert with_headroom < 0.25, f"{with_headroom} faults per call with the headroom"


def _graph_module(nodes: int) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    for _ in range(nodes):
        x = g.call_function(torch.ops.aten.add.Tensor, (x, 1))
    g.output(x)
    return fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("lazy", [False, True])
def test_add_headroom_enlarges_the_generated_forward_and_keeps_its_result(lazy):
    from torch.fx._lazy_graph_module import _LazyGraphModule

    gm = _graph_module(20)
    if lazy:
        gm = _LazyGraphModule.from_graphmodule(gm)
    forward = gm.forward  # what a compiled caller holds (boxed_nop keeps the bound method)
    added = frame_headroom.add_headroom(gm)
    code = type(gm).forward.__code__
    assert added > 0 and frame_headroom.frame_words(code) == frame_headroom.MIN_FRAME_WORDS
    assert frame_headroom.add_headroom(gm) == 0  # once is enough
    x = torch.arange(3.0)
    assert torch.equal(forward(x), x + 20) and torch.equal(gm(x), x + 20)
    # A frame already that large is left as it is.
    big = _graph_module(frame_headroom.MIN_FRAME_WORDS + 10)
    assert frame_headroom.add_headroom(big) == 0


def test_the_eager_backend_gives_its_graphs_the_headroom(monkeypatch):
    from . import models

    seen = []
    real = frame_headroom.add_headroom

    def spy(gm):
        seen.append(gm)
        return real(gm)

    monkeypatch.setattr(frame_headroom, "add_headroom", spy)
    torch.manual_seed(0)
    compiled = torch.compile(models.MLP(), backend="trinity", options={"inner": "eager", "memory_budget": None})
    compiled(*models.mlp_batch(64)).backward()
    assert len(seen) == 2  # the forward and the backward graph
    for gm in seen:
        assert frame_headroom.frame_words(type(gm).forward.__code__) >= frame_headroom.MIN_FRAME_WORDS


def test_pad_function_takes_a_bound_method_and_leaves_non_python_callables():
    class Runner:
        def call(self, args):
            return sum(args)

    r = Runner()
    assert frame_headroom.pad_function(r.call) > 0
    assert frame_headroom.frame_words(Runner.call.__code__) == frame_headroom.MIN_FRAME_WORDS
    assert r.call([1, 2]) == 3
    assert frame_headroom.pad_function(len) == 0  # a C function has no frame
