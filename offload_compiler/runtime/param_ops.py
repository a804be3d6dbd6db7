"""The ``trinity::param_*`` custom ops of parameter offloading (``offload`` option).

Schemas (``slot`` is the id of a :class:`~offload_compiler.runtime.model_state.ParamSlot`):

* ``trinity::param_fetch(Tensor(a!) p, int slot) -> ()``: make the storage of ``p`` (the
  parameter or any view of it) hold the parameter's current value: wait for a pending CPU
  optimizer update, re-allocate the storage and copy the host master copy into it. A no-op when
  the storage is resident. Raises ``RuntimeError`` when the parameter's gradients reached the
  host but no ``CPUOptimizer`` owns it (``ParamSlot.check_owner``).
* ``trinity::param_release(Tensor(a!) p, int slot, bool write_back) -> ()``: free the storage of
  ``p`` (``untyped_storage().resize_(0)``); with ``write_back`` copy it into the master first.
* ``trinity::grad_to_host(Tensor g, int slot) -> ()``: add the gradient ``g`` into the
  parameter's host gradient (copy on the first micro-step after ``zero_grad``).

They act on storages, not on values: every view of the parameter (the saved ``t(weight)`` of a
linear layer) is fetched and released with it. ``p`` is declared written so that no reader can be
ordered across them. All three have side effects (kept by FX dead-code elimination). They are for
plain FX code (``inner="eager"``): Inductor must not see storages resized under it.
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect
from torch.multiprocessing.reductions import StorageWeakRef

from .model_state import get_slot

__all__ = ["PARAM_FETCH", "PARAM_RELEASE", "GRAD_TO_HOST", "PARAM_OPS"]

_lib = torch.library.Library("trinity", "FRAGMENT")
_lib.define("param_fetch(Tensor(a!) p, int slot) -> ()")
_lib.define("param_release(Tensor(a!) p, int slot, bool write_back) -> ()")
_lib.define("grad_to_host(Tensor g, int slot) -> ()")


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


def _param_fetch(p: torch.Tensor, slot: int) -> None:
    s = _checked_slot(p, slot)
    s.check_owner()  # gradients on the host but no CPUOptimizer: refuse (model_state)
    s.fetch()


def _param_release(p: torch.Tensor, slot: int, write_back: bool) -> None:
    _checked_slot(p, slot).release(write_back)


def _grad_to_host(g: torch.Tensor, slot: int) -> None:
    get_slot(slot).add_grad(g)


for _name, _fn in (("param_fetch", _param_fetch), ("param_release", _param_release), ("grad_to_host", _grad_to_host)):
    _lib.impl(_name, _fn, "CompositeExplicitAutograd")


@torch.library.register_fake("trinity::param_fetch", lib=_lib)
def _param_fetch_fake(p: torch.Tensor, slot: int) -> None:
    return None


@torch.library.register_fake("trinity::param_release", lib=_lib)
def _param_release_fake(p: torch.Tensor, slot: int, write_back: bool) -> None:
    return None


@torch.library.register_fake("trinity::grad_to_host", lib=_lib)
def _grad_to_host_fake(g: torch.Tensor, slot: int) -> None:
    return None


PARAM_FETCH = torch.ops.trinity.param_fetch.default
PARAM_RELEASE = torch.ops.trinity.param_release.default
GRAD_TO_HOST = torch.ops.trinity.grad_to_host.default
PARAM_OPS = (PARAM_FETCH, PARAM_RELEASE, GRAD_TO_HOST)

for _op in PARAM_OPS:
    has_side_effect(_op)
