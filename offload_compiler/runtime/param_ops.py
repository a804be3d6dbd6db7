"""The kernels of the ``trinity::param_*`` ops of parameter offloading (``offload`` option).

The schemas, fake implementations and op handles are the IR's (:mod:`offload_compiler.ir.ops`);
this module registers the kernels. What each does (``slot`` is the id of a :class:`~offload_compiler.runtime.model_state.ParamSlot`, ``rt``
the id of the compiled graph pair's :class:`~offload_compiler.runtime.transfer.TransferRuntime`,
whose copy streams and pending-copy table the copies use):

* ``trinity::param_fetch(Tensor(a!) p, int slot, int rt) -> ()``: make the storage of ``p`` (the
  parameter or any view of it) hold the parameter's current value: wait (host) for a pending CPU
  optimizer update, re-allocate the storage on the compute stream and **issue** the copy of the
  host master into it on the H2D copy stream (after the compute stream's work so far). A no-op
  when the storage is resident (then its wait is one too). Raises ``RuntimeError`` when the
  parameter's gradients reached the host but no ``CPUOptimizer`` owns it
  (``ParamSlot.check_owner``).
* ``trinity::param_fetch_wait(Tensor(a!) p, int slot, int rt) -> ()``: the compute stream waits
  for that copy (non-blocking for the host). It comes right before the first reader of ``p``;
  between the fetch and this wait nothing reads the storage (the verifier checks it).
* ``trinity::param_release(Tensor(a!) p, int slot, bool write_back, int rt) -> ()``: free the
  storage of ``p`` (``untyped_storage().resize_(0)``); with ``write_back`` first copy it into
  the master on the D2H copy stream, and make the compute stream wait for that copy before the
  free (no ``record_stream``; non-blocking for the host, but the copy is exposed on the device).
* ``trinity::grad_to_host(Tensor g, int slot, int rt) -> ()``: issue the copy of the gradient
  ``g`` to the host on the D2H copy stream: into the parameter's host gradient (first micro-step
  after ``zero_grad``) or into a staging block, added into the host gradient on the host once the
  copy is done (before anything reads the host gradient).
* ``trinity::grad_to_host_wait(Tensor g, int slot, int rt) -> ()``: the compute stream waits
  for that copy. It takes ``g``, so ``g`` stays alive (FX frees it after its last use) until the
  copy that reads it is done: keep-alive through the IR.

On the CPU the copies are synchronous and the waits no-ops, except under the ``fault_injection``
test mode, where each copy is deferred to its wait (or a random earlier trinity op), so a missing
or misplaced wait shows as wrong values.

They act on storages, not on values: every view of the parameter (the saved ``t(weight)`` of a
linear layer) is fetched and released with it. ``p`` is declared written so that no reader can be
ordered across them. All have side effects (kept by FX dead-code elimination). They are for
plain FX code (``inner="eager"``): Inductor must not see storages resized under it.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..ir import ops as _ir_ops  # noqa: F401  (defines the trinity::* schemas first)
from .model_state import get_slot, grad_key
from .transfer import get_runtime

__all__: list[str] = []


def _checked_slot(p: torch.Tensor, slot_id: int):
    """The slot, after checking that ``p`` (what the graph was called with) is its parameter.

    Dynamo reuses compiled code for a second instance of the same module class (parameters are
    graph inputs); the parameter slots belong to the first instance, so running on another
    one would fetch, release and accumulate into the wrong model. That is refused here.

    Raises:
        RuntimeError: naming the slot, when ``p`` is not the slot's parameter.
    """
    slot = get_slot(slot_id)
    param = slot.param_ref()
    if param is None or StorageWeakRef(param.untyped_storage()) != StorageWeakRef(p.untyped_storage()):
        raise RuntimeError(
            f"trinity: parameter slot {slot_id} belongs to another module instance than the one this "
            "compiled code was called with. Dynamo reuses compiled code for a second instance of the "
            "same class without recompiling, but trinity's host copies of parameters (offload="
            "'activations+params' or 'all') are per instance: call torch._dynamo.reset() before "
            "compiling another instance of the model, or train one instance per process."
        )
    return slot


def _param_fetch(p: torch.Tensor, slot: int, rt: int) -> None:
    s = _checked_slot(p, slot)
    s.check_owner()  # gradients on the host but no CPUOptimizer: refuse (model_state)
    s.fetch(get_runtime(rt))


def _param_fetch_wait(p: torch.Tensor, slot: int, rt: int) -> None:
    _checked_slot(p, slot).fetch_wait(get_runtime(rt))


def _param_release(p: torch.Tensor, slot: int, write_back: bool, rt: int) -> None:
    _checked_slot(p, slot).release(write_back, get_runtime(rt))


def _grad_to_host(g: torch.Tensor, slot: int, rt: int) -> None:
    get_slot(slot).add_grad(g, get_runtime(rt))


def _grad_to_host_wait(g: torch.Tensor, slot: int, rt: int) -> None:
    runtime = get_runtime(rt)
    runtime.wait_key(grad_key(slot))
    runtime.reap_staged()


_lib = torch.library.Library("trinity", "IMPL")
for _name, _fn in (
    ("param_fetch", _param_fetch),
    ("param_fetch_wait", _param_fetch_wait),
    ("param_release", _param_release),
    ("grad_to_host", _grad_to_host),
    ("grad_to_host_wait", _grad_to_host_wait),
):
    _lib.impl(_name, _fn, "CompositeExplicitAutograd")
