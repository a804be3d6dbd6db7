"""The ``trinity::*`` custom ops: schemas, fake (meta) implementations and op handles.

This module defines the ops; it runs nothing. Their kernels (what each op does at run time) are
registered by the runtime (:mod:`offload_compiler.runtime.ops`, ``.param_ops``, ``.grad_sync``),
which importing the ``offload_compiler`` package loads. Passes build and match graphs with the
handles here, by op target, never by node name.

Transfer ops (``rt`` is the id of the owning
:class:`~offload_compiler.runtime.transfer.TransferRuntime`):

* ``trinity::evict(Tensor src, int rt, SymInt[]? stride=None) -> Tensor``: start the
  device-to-host copy of ``src``; returns the host tensor (same size and dtype, pooled, pinned on
  CUDA), laid out with ``stride`` (default: ``src``'s). The rewrite passes the strides the forward
  must return it in (``passes/insert_transfers.py``: ``src``'s in the graph, or channels-last
  where Inductor's layout optimization requires it): Inductor may lay ``src`` out otherwise
  (contiguous where the graph has a transposed pointwise result), and a host tensor in other
  strides than required is copied into them by a kernel of Inductor's own, which reads the host
  block before the copy into it is done.
* ``trinity::evict_wait(Tensor(a!) host, Tensor src, int rt, Tensor(b!)? after=None) -> ()``: the
  compute stream waits for that copy. ``src`` is an argument so that it stays alive up to here
  (keep-alive through the IR, no ``record_stream``); ``host`` is marked as written so that every
  later reader is ordered after.
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
  kernel that would read the evicted storage after the point where the plan frees it. The same
  op keeps an ``mm`` from Inductor's ``addmm`` pattern (``hosts`` empty: ``passes/split_addmm.py``)
  and keeps a recomputed chain before its reader (``hosts`` its leaves read later:
  ``passes/insert_recompute.py``).

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

Parameter ops (parameter offloading, ``offload`` option; ``slot`` is the id of a
:class:`~offload_compiler.runtime.model_state.ParamSlot`):

* ``trinity::param_fetch(Tensor(a!) p, int slot, int rt) -> ()``: make the storage of ``p`` (the
  parameter or any view of it) hold the parameter's current value: wait (host) for a pending CPU
  optimizer update, re-allocate the storage on the compute stream and **issue** the copy of the
  host master into it on the H2D copy stream. A no-op when the storage is resident.
* ``trinity::param_fetch_wait(Tensor(a!) p, int slot, int rt) -> ()``: the compute stream waits
  for that copy. It comes right before the first reader of ``p``; between the fetch and this
  wait nothing reads the storage (the verifier checks it).
* ``trinity::param_release(Tensor(a!) p, int slot, bool write_back, int rt) -> ()``: free the
  storage of ``p``; with ``write_back`` first copy it into the master.
* ``trinity::grad_to_host(Tensor g, int slot, int rt) -> ()``: issue the copy of the gradient
  ``g`` to the host.
* ``trinity::grad_to_host_wait(Tensor g, int slot, int rt) -> ()``: the compute stream waits
  for that copy; ``g`` stays alive until here (keep-alive through the IR).

They act on storages, not on values: every view of the parameter (the saved ``t(weight)`` of a
linear layer) is fetched and released with it. ``p`` is declared written so that no reader can be
ordered across them. They are for plain FX code (``inner="eager"``): Inductor must not see
storages resized under it.

Gradient-sync ops (DDP with ``offload="all"``; ``sync`` is the id of a
:class:`~offload_compiler.runtime.grad_sync.GradSync`):

* ``trinity::grad_sync_mark(int sync) -> ()``: records whether this forward's backward syncs.
* ``trinity::grad_reduce(Tensor(a!) g, int slot, int rt, int sync, bool inplace, int bucket,
  bool launch) -> ()``: where ``grad_to_host`` was: scale ``g`` for averaging over the ranks and
  add it to its all-reduce bucket ``bucket``; ``launch``: the bucket's last gradient, whose op
  issues the bucket's one all-reduce. Without sync: accumulate locally.
* ``trinity::grad_reduce_wait(Tensor g, int slot, int rt, int sync) -> ()``: where
  ``grad_to_host_wait`` was: wait for the bucket's all-reduce and the averaged gradient's copy to
  the host.

``torch.library.custom_op`` cannot express these (it forbids mutated-and-returned aliasing
patterns and cannot mark the keep-alive), so they are defined with ``torch.library.Library``;
the fake implementations here serve FakeTensor tracing and Inductor. Every op but ``evict`` and
``prefetch`` (whose results are read) is marked side-effecting, which keeps FX dead-code
elimination away from it.
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

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
    "PARAM_FETCH",
    "PARAM_FETCH_WAIT",
    "PARAM_RELEASE",
    "GRAD_TO_HOST",
    "GRAD_TO_HOST_WAIT",
    "PARAM_OPS",
    "GRAD_SYNC_MARK",
    "GRAD_REDUCE",
    "GRAD_REDUCE_WAIT",
    "GRAD_SYNC_OPS",
    "SCHEMAS",
]

#: ``name -> schema`` of every ``trinity::`` op (the namespace ``trinity``).
SCHEMAS = {
    "evict": "evict(Tensor src, int rt, SymInt[]? stride=None) -> Tensor",
    "evict_wait": "evict_wait(Tensor(a!) host, Tensor src, int rt, Tensor(b!)? after=None) -> ()",
    "prefetch": "prefetch(Tensor host, Device device, int rt, Tensor? after=None) -> Tensor",
    "prefetch_wait": "prefetch_wait(Tensor(a!) dev, int rt, Tensor? after=None) -> ()",
    "fence": "fence(Tensor(a!)[] hosts, Tensor reader) -> ()",
    "set_stream": "set_stream(int rt, int stream) -> ()",
    "record_event": "record_event(Tensor[] after, int rt, int event, int stream) -> ()",
    "wait_event": "wait_event(Tensor[] keep, int rt, int event, int stream) -> ()",
    "param_fetch": "param_fetch(Tensor(a!) p, int slot, int rt) -> ()",
    "param_fetch_wait": "param_fetch_wait(Tensor(a!) p, int slot, int rt) -> ()",
    "param_release": "param_release(Tensor(a!) p, int slot, bool write_back, int rt) -> ()",
    "grad_to_host": "grad_to_host(Tensor g, int slot, int rt) -> ()",
    "grad_to_host_wait": "grad_to_host_wait(Tensor g, int slot, int rt) -> ()",
    "grad_sync_mark": "grad_sync_mark(int sync) -> ()",
    "grad_reduce": (
        "grad_reduce(Tensor(a!) g, int slot, int rt, int sync, bool inplace, int bucket, bool launch) -> ()"
    ),
    "grad_reduce_wait": "grad_reduce_wait(Tensor g, int slot, int rt, int sync) -> ()",
}

_lib = torch.library.Library("trinity", "DEF")
for _schema in SCHEMAS.values():
    _lib.define(_schema)


def _returns_nothing(*args, **kwargs) -> None:
    return None


@torch.library.register_fake("trinity::evict", lib=_lib)
def _evict_fake(src: torch.Tensor, rt: int, stride: list[int] | None = None) -> torch.Tensor:
    return torch.empty_strided(src.size(), src.stride() if stride is None else stride, dtype=src.dtype, device="cpu")


@torch.library.register_fake("trinity::prefetch", lib=_lib)
def _prefetch_fake(
    host: torch.Tensor, device: torch.device, rt: int, after: torch.Tensor | None = None
) -> torch.Tensor:
    return torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=device)


for _name in SCHEMAS:
    if _name not in ("evict", "prefetch"):
        torch.library.register_fake(f"trinity::{_name}", _returns_nothing, lib=_lib)


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
PARAM_FETCH = torch.ops.trinity.param_fetch.default
PARAM_FETCH_WAIT = torch.ops.trinity.param_fetch_wait.default
PARAM_RELEASE = torch.ops.trinity.param_release.default
GRAD_TO_HOST = torch.ops.trinity.grad_to_host.default
GRAD_TO_HOST_WAIT = torch.ops.trinity.grad_to_host_wait.default
PARAM_OPS = (PARAM_FETCH, PARAM_FETCH_WAIT, PARAM_RELEASE, GRAD_TO_HOST, GRAD_TO_HOST_WAIT)
GRAD_SYNC_MARK = torch.ops.trinity.grad_sync_mark.default
GRAD_REDUCE = torch.ops.trinity.grad_reduce.default
GRAD_REDUCE_WAIT = torch.ops.trinity.grad_reduce_wait.default
GRAD_SYNC_OPS = (GRAD_SYNC_MARK, GRAD_REDUCE, GRAD_REDUCE_WAIT)

# Keep FX dead-code elimination away from the waits even where nothing reads their result.
for _op in (EVICT_WAIT, PREFETCH_WAIT, FENCE, *STREAM_OPS, *PARAM_OPS, *GRAD_SYNC_OPS):
    has_side_effect(_op)
