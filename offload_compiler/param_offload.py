"""Backend glue of parameter offloading (option ``offload``): slots, the training pair's
residency rewrite, and the inference graph's.

* :func:`make_slots` (compile time): a host master copy for every ``nn.Parameter`` among the
  graph's inputs (and a host gradient with ``offload="all"``), after checking that the host has
  room for them: a run that would exceed ``host_pool_limit_bytes`` fails here, naming the bytes
  needed. It then finds the modules that own those parameters (:func:`owning_roots`) and
  installs :func:`~.runtime.model_state.install_module_hooks` on them, so that ``state_dict()``,
  ``load_state_dict()`` and eager forwards work or fail clearly between steps.
* the training pair's residency is planned in :func:`offload_compiler.pipeline.plan_pair` and
  applied by the compile session (:mod:`.passes.param_residency`).
* :func:`release_planned` (end of the compile, ``offload="all"``): the parameters the compiled
  graphs fetch leave the device before the first step, as they do between steps.
* :func:`rewrite_inference`: the same on a forward-only graph (``torch.no_grad()`` steps): fetch
  before first use; with ``"all"`` release after last use. It is planned by the same
  :func:`~offload_compiler.pipeline.plan_pair` (and budget) as the training pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from .distributed import dynamo_source_resolver
from .graph_pair import GraphPair
from .options import TrinityOptions, format_bytes
from .passes import param_residency
from .runtime import param_ops as _param_ops  # noqa: F401  (registers trinity::param_*)
from .runtime.model_state import ON_DEVICE_ATTR, ParamSlot, ensure_slot, install_module_hooks, slot_of
from .runtime.pool import HostPool

__all__ = ["HostMemoryError", "make_slots", "owning_roots", "real_parameters", "release_planned", "rewrite_inference"]


class HostMemoryError(ValueError):
    """The model state to offload does not fit the host memory trinity may use."""


def owning_roots(gm: fx.GraphModule, positions: Sequence[int]) -> list[torch.nn.Module]:
    """The outermost ``nn.Module`` on the path from the compiled frame to each parameter input.

    Dynamo records, per graph input, where the frame found it (``node.meta["grapharg"].source``:
    ``L['self']._modules['gpt']._modules['tok']._parameters['weight']``, a chain of sources
    whose base is a frame local or global). Walking each chain from its base, the first value
    that is an ``nn.Module`` (resolved with the Dynamo output graph's
    ``resolve_source_value``, i.e. in the frame being compiled) is returned: for
    ``torch.compile(model)`` the model, for a compiled function using a global module that
    module. Inputs reached otherwise (a list of tensors passed in) give nothing.

    Returns ``[]`` when called outside a Dynamo compile (no current instruction translator) or
    with a Dynamo that lacks this machinery: the hooks are a convenience, reads of released
    parameters still fail clearly (see :mod:`.runtime.model_state`).
    """
    resolve = dynamo_source_resolver()
    if resolve is None:
        return []

    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    roots: dict[int, torch.nn.Module] = {}
    for i in positions:
        if i >= len(placeholders):
            continue
        source = getattr(placeholders[i].meta.get("grapharg"), "source", None)
        chain = []
        while source is not None:
            chain.append(source)
            source = getattr(source, "base", None)
        for src in reversed(chain):  # from the frame's local or global outwards
            try:
                value = resolve(src)
            except Exception:  # noqa: BLE001  (a source kind that cannot be evaluated here)
                continue
            if isinstance(value, torch.nn.Module):
                roots.setdefault(id(value), value)
                break
    return list(roots.values())


def real_parameters(example_inputs: Sequence[Any], gm: fx.GraphModule | None = None) -> dict[int, torch.nn.Parameter]:
    """The real ``nn.Parameter`` behind each parameter input of the graph (input position ->
    parameter).

    Dynamo hands the backend the real parameters, but DDP's graph splitter
    (``torch/_dynamo/backends/distributed.py``) converts every example input of a split to a
    FakeTensor. For a fake input the placeholder's Dynamo record (``node.meta["grapharg"]``) still
    holds the real value it was traced from (``GraphArg.example``, a weak reference); it is used
    when it is a real ``nn.Parameter`` of the same shape and dtype.
    """
    from torch._subclasses.fake_tensor import is_fake

    placeholders = list(gm.graph.find_nodes(op="placeholder")) if gm is not None else []
    found: dict[int, torch.nn.Parameter] = {}
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            continue
        if isinstance(x, torch.nn.Parameter) and not is_fake(x):
            found[i] = x
            continue
        if not is_fake(x) or len(placeholders) != len(example_inputs):
            continue
        grapharg = placeholders[i].meta.get("grapharg")
        try:
            real = grapharg.example if grapharg is not None else None
        except Exception:  # noqa: BLE001  (an example that cannot be read back)
            real = None
        if (
            isinstance(real, torch.nn.Parameter)
            and not is_fake(real)
            and tuple(real.shape) == tuple(x.shape)
            and real.dtype == x.dtype
        ):
            found[i] = real
    return found


def _hook_owners(gm: fx.GraphModule | None, slots: dict[int, ParamSlot]) -> None:
    """Name the slots and install the module hooks on the modules owning offloaded parameters."""
    if gm is None or not slots:
        return
    for root in owning_roots(gm, sorted(slots)):
        for name, p in root.named_parameters(remove_duplicate=False):
            slot = slot_of(p)
            # The first name found, or a more qualified one of the same path (a graph after a
            # graph break may be compiled from a submodule's frame first).
            if slot is not None and (slot.name is None or name.endswith("." + slot.name)):
                slot.name = name
        for mod in root.modules():
            if any(slot_of(p) is not None for p in mod._parameters.values() if p is not None):
                install_module_hooks(mod)


def make_slots(
    example_inputs: Sequence[Any], options: TrinityOptions, host_limit: int, gm: fx.GraphModule | None = None
) -> dict[int, ParamSlot]:
    """Slots for the parameters among ``example_inputs`` (graph input position -> slot).

    With ``gm`` (the Dynamo graph being compiled), the modules owning these parameters get
    :func:`~.runtime.model_state.install_module_hooks` (see :func:`owning_roots`) and the slots
    their parameter names.

    Fake example inputs (DDP's graph splits) are mapped back to the real parameters with
    :func:`real_parameters`.

    Raises:
        HostMemoryError: when the master copies (and host gradients with ``"all"``) of the
            parameters not yet offloaded need more than ``host_limit`` bytes.
        ValueError: when a parameter is already offloaded with the other mode.
    """
    mode = options.offload
    keep_resident = mode == "activations+params"
    # A parameter the plan keeps on the device (optimizer_on_device) stays a plain parameter.
    params = {i: p for i, p in real_parameters(example_inputs, gm).items() if not getattr(p, ON_DEVICE_ATTR, False)}
    need = 0
    seen = set()
    for p in params.values():
        if id(p) in seen or getattr(p, "_trinity_slot", None) is not None:
            continue
        seen.add(id(p))
        n = p.untyped_storage().nbytes()
        need += n * (2 if mode == "all" and p.requires_grad else 1)
    if need > host_limit:
        raise HostMemoryError(
            f"trinity offload={mode!r}: the parameters' host copies"
            + (" and host gradients" if mode == "all" else "")
            + f" need {format_bytes(need)} ({need} bytes) of host memory, over host_pool_limit_bytes "
            f"{format_bytes(host_limit)} ({host_limit} bytes); raise host_pool_limit_bytes or offload less"
        )
    pool = HostPool(max(host_limit, 1), pin_memory=torch.cuda.is_available(), on_full="error")
    slots = {}
    for i, p in params.items():
        slot = ensure_slot(p, pool, keep_resident)
        if mode == "all" and p.requires_grad:
            slot.enable_host_grad()
        slots[i] = slot
    _hook_owners(gm, slots)
    return slots


def release_planned(slots: dict[int, ParamSlot], plans: Sequence[param_residency.ResidencyPlan]) -> int:
    """Free the device storage of the ``offload="all"`` parameters that ``plans`` fetch; returns
    the bytes freed.

    With ``"all"`` a parameter lives in host memory between steps, and the plan counts it on the
    device only from its fetch inside the step. A parameter still on the device when its graph is
    compiled (the model was built or loaded there; Dynamo compiles inside the first call) would
    stay there until the first step's release of it: that step would hold it from its start,
    above the plan and possibly the budget. Its master copy is current (copied from the device
    when the slot was made; ``materialized`` and ``load_state_dict`` write back), so it is freed
    without a write-back. Parameters no plan fetches (a parameter that is a user output of the
    forward stays resident), ``"activations+params"`` slots (resident between steps) and slots
    already released are left alone.
    """
    fetched = {p.slot for plan in plans if plan.mode == "all" for p in plan.params}
    freed = 0
    for slot in {s.id: s for s in slots.values()}.values():
        if slot.id in fetched and slot.resident and not slot.keep_resident:
            freed += slot.nbytes
            slot.release(write_back=False)
    return freed


def rewrite_inference(
    gm: fx.GraphModule, slots: dict[int, ParamSlot], options: TrinityOptions, rt: int
) -> param_residency.ResidencyPlan | None:
    """Fetch each offloaded parameter ahead of its first use in the forward-only graph ``gm``
    (``param_fetch`` by the working window, ``param_fetch_wait`` right before the reader) and,
    with ``offload="all"``, release it after its last use. ``rt`` is the id of the transfer
    runtime whose copy streams the copies use. Mutates ``gm``.

    Planned by :func:`~offload_compiler.pipeline.plan_pair` on the forward with an empty
    backward, every parameter read fetched (``ModelState(offload="all")``, no host gradients):
    with ``"activations+params"`` a parameter is released only after a training forward whose
    backward never ran, and the fetch restores it. The windows shrink when they would exceed the
    budget, as in training.

    Raises:
        offload_compiler.passes.verify.VerificationError: when ``options.verify`` is on and the
            rewritten graph breaks a residency invariant (:func:`.passes.verify.check_residency`).
    """
    if not slots:
        return None
    empty = fx.Graph()
    empty.output(())
    outputs = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    n_out = len(outputs) if isinstance(outputs, (tuple, list)) else 1
    from .pipeline import ModelState, plan_pair

    pair = GraphPair(gm, fx.GraphModule({}, empty), n_out, tuple(sorted(slots)))
    step_nodes = list(gm.graph.nodes) + list(pair.backward.graph.nodes)
    chosen = {i: (s.id, s.host_bytes) for i, s in slots.items()}
    the_plan = plan_pair(pair, options, ModelState(offload="all", params=chosen, host_grad=False)).residency
    param_residency.apply(pair, the_plan, step_nodes, rt, release=options.offload == "all", backward=False)
    if options.verify:
        from .passes.verify import VerificationError, check_residency

        errors = check_residency(pair, the_plan)
        if errors:
            raise VerificationError(
                "trinity verification of parameter residency (inference graph) failed:\n  - " + "\n  - ".join(errors)
            )
    return the_plan
