"""The ``trinity::*`` custom ops that the rewritten graphs call.

Schemas (``rt`` is the id of the owning :class:`~offload_compiler.runtime.transfer.TransferRuntime`):

* ``trinity::evict(Tensor src, int rt) -> Tensor``: start the device-to-host copy of ``src``;
  returns the host tensor (same size, stride, dtype; pooled, pinned on CUDA).
* ``trinity::evict_wait(Tensor(a!) host, Tensor src, int rt, Tensor(b!)? after=None) -> ()``: the
  compute stream waits for that copy. ``src`` is an argument so that it stays alive up to here (keep-alive through the IR,
  no ``record_stream``); ``host`` is marked as written so that every later reader is ordered after.
* ``trinity::prefetch(Tensor host, Device device, int rt, Tensor? after=None) -> Tensor``: allocate
  the device tensor and start the host-to-device copy into it.
* ``trinity::prefetch_wait(Tensor(a!) dev, int rt, Tensor? after=None) -> ()``: the compute stream
  waits for that copy; readers of ``dev`` come after it.

Every ``after`` argument is unread and unwritten at run time: it is the output of the node the op
must follow, a data edge that keeps a scheduler (Inductor's) from moving the op earlier than
planned (a hoisted prefetch holds its memory early; a hoisted wait exposes its copy). On
``evict_wait`` it is declared written, so the readers of that node also stay after the wait: the
wait cannot sink later either, where it would keep the evicted storage alive.
* ``trinity::fence(Tensor(a!)[] hosts, Tensor reader) -> ()``: does nothing at run time. It orders
  a forward reader of an evicted activation before that activation's ``evict_wait`` (both write
  ``hosts``) and makes Inductor materialise the reader there, instead of inlining it into a later
  kernel that would read the evicted storage after the point where the plan frees it.

Stream ops (multi-stream compute, inserted by ``passes/assign_streams.py``; ``stream`` is an index
into the runtime's :class:`~offload_compiler.runtime.streams.ComputeStreams`, 0 = the stream that
was current when the graph started):

* ``trinity::set_stream(int rt, int stream) -> ()``: make ``stream`` the current stream; the
  kernels of the following nodes run (and allocate) there.
* ``trinity::record_event(Tensor[] after, int rt, int event, int stream) -> ()``: record event
  ``event`` on ``stream``: it completes when all work queued on ``stream`` so far has.
  ``after`` holds the producer's output: a data edge that keeps the record after it.
* ``trinity::wait_event(Tensor[] keep, int rt, int event, int stream) -> ()``: ``stream`` waits
  for event ``event``'s last record. ``keep`` holds tensors that must stay alive up to here: a
  buffer allocated on ``stream`` and read on another is freed only after this wait (keep-alive
  through the IR, no ``record_stream``).

``torch.library.custom_op`` cannot express these (it forbids mutated-and-returned aliasing
patterns and cannot mark the keep-alive), so they are defined with ``torch.library.Library`` and
given fake (meta) implementations for FakeTensor tracing and Inductor.
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from .transfer import get_runtime

__all__ = [
    "EVICT",
    "EVICT_WAIT",
    "FENCE",
    "PREFETCH",
    "PREFETCH_WAIT",
    "TRANSFER_OPS",
    "SET_STREAM",
    "RECORD_EVENT",
    "WAIT_EVENT",
    "STREAM_OPS",
]

_lib = torch.library.Library("trinity", "DEF")
_lib.define("evict(Tensor src, int rt) -> Tensor")
_lib.define("evict_wait(Tensor(a!) host, Tensor src, int rt, Tensor(b!)? after=None) -> ()")
_lib.define("prefetch(Tensor host, Device device, int rt, Tensor? after=None) -> Tensor")
_lib.define("prefetch_wait(Tensor(a!) dev, int rt, Tensor? after=None) -> ()")
_lib.define("fence(Tensor(a!)[] hosts, Tensor reader) -> ()")
_lib.define("set_stream(int rt, int stream) -> ()")
_lib.define("record_event(Tensor[] after, int rt, int event, int stream) -> ()")
_lib.define("wait_event(Tensor[] keep, int rt, int event, int stream) -> ()")


def _evict(src: torch.Tensor, rt: int) -> torch.Tensor:
    return get_runtime(rt).evict(src)


def _evict_wait(host: torch.Tensor, src: torch.Tensor, rt: int, after: torch.Tensor | None = None) -> None:
    get_runtime(rt).evict_wait(host, src)


def _prefetch(host: torch.Tensor, device: torch.device, rt: int, after: torch.Tensor | None = None) -> torch.Tensor:
    return get_runtime(rt).prefetch(host, device)


def _prefetch_wait(dev: torch.Tensor, rt: int, after: torch.Tensor | None = None) -> None:
    get_runtime(rt).prefetch_wait(dev)


def _fence(hosts: list[torch.Tensor], reader: torch.Tensor) -> None:
    return None


def _set_stream(rt: int, stream: int) -> None:
    get_runtime(rt).compute_streams.set_stream(stream)


def _record_event(after: list[torch.Tensor], rt: int, event: int, stream: int) -> None:
    get_runtime(rt).compute_streams.record(event, stream)


def _wait_event(keep: list[torch.Tensor], rt: int, event: int, stream: int) -> None:
    get_runtime(rt).compute_streams.wait(event, stream)


for _name, _fn in (
    ("set_stream", _set_stream),
    ("record_event", _record_event),
    ("wait_event", _wait_event),
    ("fence", _fence),
    ("evict", _evict),
    ("evict_wait", _evict_wait),
    ("prefetch", _prefetch),
    ("prefetch_wait", _prefetch_wait),
):
    _lib.impl(_name, _fn, "CompositeExplicitAutograd")


@torch.library.register_fake("trinity::evict", lib=_lib)
def _evict_fake(src: torch.Tensor, rt: int) -> torch.Tensor:
    return torch.empty_strided(src.size(), src.stride(), dtype=src.dtype, device="cpu")


@torch.library.register_fake("trinity::evict_wait", lib=_lib)
def _evict_wait_fake(host: torch.Tensor, src: torch.Tensor, rt: int, after: torch.Tensor | None = None) -> None:
    return None


@torch.library.register_fake("trinity::prefetch", lib=_lib)
def _prefetch_fake(
    host: torch.Tensor, device: torch.device, rt: int, after: torch.Tensor | None = None
) -> torch.Tensor:
    return torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=device)


@torch.library.register_fake("trinity::fence", lib=_lib)
def _fence_fake(hosts: list[torch.Tensor], reader: torch.Tensor) -> None:
    return None


@torch.library.register_fake("trinity::prefetch_wait", lib=_lib)
def _prefetch_wait_fake(dev: torch.Tensor, rt: int, after: torch.Tensor | None = None) -> None:
    return None


@torch.library.register_fake("trinity::set_stream", lib=_lib)
def _set_stream_fake(rt: int, stream: int) -> None:
    return None


@torch.library.register_fake("trinity::record_event", lib=_lib)
def _record_event_fake(after: list[torch.Tensor], rt: int, event: int, stream: int) -> None:
    return None


@torch.library.register_fake("trinity::wait_event", lib=_lib)
def _wait_event_fake(keep: list[torch.Tensor], rt: int, event: int, stream: int) -> None:
    return None


EVICT = torch.ops.trinity.evict.default
EVICT_WAIT = torch.ops.trinity.evict_wait.default
PREFETCH = torch.ops.trinity.prefetch.default
PREFETCH_WAIT = torch.ops.trinity.prefetch_wait.default
FENCE = torch.ops.trinity.fence.default
TRANSFER_OPS = (EVICT, EVICT_WAIT, PREFETCH, PREFETCH_WAIT, FENCE)
SET_STREAM = torch.ops.trinity.set_stream.default
RECORD_EVENT = torch.ops.trinity.record_event.default
WAIT_EVENT = torch.ops.trinity.wait_event.default
STREAM_OPS = (SET_STREAM, RECORD_EVENT, WAIT_EVENT)

# Keep FX dead-code elimination away from the waits even where nothing reads their result.
for _op in (EVICT_WAIT, PREFETCH_WAIT, FENCE, SET_STREAM, RECORD_EVENT, WAIT_EVENT):
    has_side_effect(_op)
