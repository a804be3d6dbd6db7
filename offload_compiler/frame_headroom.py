"""Headroom on CPython's data stack for the generated code of ``inner="eager"`` graphs.

Since CPython 3.11 the frames of Python functions live on a per-thread data stack made of
chunks (16 KiB by default, larger for a frame that needs more, always with 1000 words to spare
after the frame that opened the chunk). A call whose frame does not fit in the current chunk
opens a new chunk (``mmap``) and its return frees it (``munmap``). When a function's frame ends
just short of a chunk's end, *every* Python call it makes crosses the boundary: an ``mmap``, a
``munmap`` and page faults per call (CPython issue gh-142183, "Calls across stack chunks perform
badly"; one cached chunk per thread fixes it in 3.13 and 3.14 patch releases; 3.11 and 3.12 keep
it).

An FX graph's generated ``forward`` has one local per node, so a graph of a few hundred to a
few thousand nodes has a frame of a few to tens of KiB, and each of its calls (every aten op goes
through ``OpOverload.__call__``, every ``trinity::`` op into its Python kernel) is a Python
call. Whether a graph hits it depends on where its frame lands, i.e. on the whole process. In
one process layout (a 12-block GPT with ``offload="all"``, 2 cores, Python 3.11.7, torch 2.13)
the forward's frame did: 4308 page faults per step and 131 ms, 4 and 84 ms with the headroom
below. ``bench/frame_headroom.py`` (80 caller depths) found no other layout where it mattered
beyond noise.

:func:`add_headroom` enlarges the frame that a graph module's ``forward`` declares (its
``co_stacksize``: slots of the evaluation stack, never written beyond what the code uses) to at
least :data:`MIN_FRAME_WORDS` words. Such a frame never fits in a default chunk, so each call of
the graph opens a fresh chunk with about 32 KiB to spare for the calls it makes: one ``mmap`` per
graph call instead of one per op. The unused words are reserved, not touched.
"""

from __future__ import annotations

import sys

import torch.fx as fx

__all__ = [
    "MIN_FRAME_WORDS",
    "add_headroom",
    "applies",
    "frame_words",
    "pad_function",
    "with_headroom",
]

# A chunk is 16 KiB (2045 words less its header), or, for a frame that needs more, the next
# power of two at or above the frame plus CPython's 1000-word MINIMUM_OVERHEAD (Python/pystate.c,
# push_chunk). A frame of 4100 words fits in no chunk of 32 KiB or less, so it opens a 64 KiB
# chunk with about 4090 words (32 KiB) to spare. (2304 words, more than a default chunk, were
# not enough: under pytest the caller's chunk was a 32 KiB one, and the frame landed at its end.)
MIN_FRAME_WORDS = 4100


def applies() -> bool:
    """Whether the interpreter has the chunked data stack (CPython 3.11 and later)."""
    return sys.implementation.name == "cpython" and sys.version_info >= (3, 11)


def frame_words(code) -> int:
    """Words a frame of ``code`` takes on the data stack, less CPython's few fixed words:
    its locals, cells and free variables, and its evaluation stack."""
    return len(code.co_varnames) + len(code.co_cellvars) + len(code.co_freevars) + code.co_stacksize


def pad_function(fn) -> int:
    """Give the frame of the Python function ``fn`` at least :data:`MIN_FRAME_WORDS` words, in
    place (its code is replaced by one with a larger ``co_stacksize``; the function object keeps
    its identity). Returns the words added (0 where nothing was done: no chunked data stack,
    not a Python function, or a frame that large already)."""
    fn = getattr(fn, "__func__", fn)  # a bound method: its function
    code = getattr(fn, "__code__", None)
    if not applies() or code is None:
        return 0
    extra = MIN_FRAME_WORDS - frame_words(code)
    if extra <= 0:
        return 0
    fn.__code__ = code.replace(co_stacksize=code.co_stacksize + extra)
    return extra


def add_headroom(gm: fx.GraphModule) -> int:
    """Give the frame of ``gm``'s generated ``forward`` at least :data:`MIN_FRAME_WORDS` words
    (see the module docstring; :func:`pad_function`). Call it after the last recompile of ``gm``
    (``boxed_nop`` recompiles with the boxed calling convention). A lazily compiled module is
    compiled first. Returns the words added."""
    if not applies():
        return 0
    from torch.fx._lazy_graph_module import _LazyGraphModule

    _LazyGraphModule.force_recompile(gm)
    return pad_function(type(gm).forward)


def with_headroom(compiler):
    """An AOTAutograd compiler (``(gm, example_inputs) -> callable``) that runs ``compiler``,
    then :func:`add_headroom` on the graph module."""

    def compile_with_headroom(gm: fx.GraphModule, example_inputs):
        compiled = compiler(gm, example_inputs)
        add_headroom(gm)
        return compiled

    return compile_with_headroom
