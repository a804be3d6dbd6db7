"""Backend glue of parameter offloading (option ``offload``): slots, the training pair's
residency rewrite, and the inference graph's.

* :func:`make_slots` (compile time): a host master copy for every ``nn.Parameter`` among the
  graph's inputs (and a host gradient with ``offload="all"``), after checking that the host has
  room for them: a run that would exceed ``host_pool_limit_bytes`` fails here, naming the bytes
  needed.
* the training pair's residency is planned in :func:`offload_compiler.pipeline.plan_pair` and
  applied by the compile session (:mod:`.passes.param_residency`).
* :func:`rewrite_inference`: the same on a forward-only graph (``torch.no_grad()`` steps): fetch
  before first use; with ``"all"`` release after last use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from .devices import detect_device_spec
from .graph_pair import GraphPair
from .options import TrinityOptions, format_bytes
from .passes import cost_model, liveness, param_residency
from .runtime import param_ops as _param_ops  # noqa: F401  (registers trinity::param_*)
from .runtime.model_state import ParamSlot, ensure_slot
from .runtime.pool import HostPool

__all__ = ["HostMemoryError", "make_slots", "rewrite_inference"]


class HostMemoryError(ValueError):
    """The model state to offload does not fit the host memory trinity may use."""


def make_slots(example_inputs: Sequence[Any], options: TrinityOptions, host_limit: int) -> dict[int, ParamSlot]:
    """Slots for the parameters among ``example_inputs`` (graph input position -> slot).

    Raises:
        HostMemoryError: when the master copies (and host gradients with ``"all"``) of the
            parameters not yet offloaded need more than ``host_limit`` bytes.
        ValueError: when a parameter is already offloaded with the other mode.
    """
    mode = options.offload
    keep_resident = mode == "activations+params"
    params = {i: x for i, x in enumerate(example_inputs) if isinstance(x, torch.nn.Parameter)}
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
    return slots


def rewrite_inference(
    gm: fx.GraphModule, slots: dict[int, ParamSlot], options: TrinityOptions, rt: int
) -> param_residency.ResidencyPlan | None:
    """Fetch each offloaded parameter ahead of its first use in the forward-only graph ``gm``
    (``param_fetch`` by the working window, ``param_fetch_wait`` right before the reader) and,
    with ``offload="all"``, release it after its last use. ``rt`` is the id of the transfer
    runtime whose copy streams the copies use. Mutates ``gm``.

    Raises:
        offload_compiler.passes.verify.VerificationError: when ``options.verify`` is on and the
            rewritten graph breaks a residency invariant (:func:`.passes.param_residency.check`).
    """
    if not slots:
        return None
    empty = fx.Graph()
    empty.output(())
    outputs = next(iter(gm.graph.find_nodes(op="output"))).args[0]
    n_out = len(outputs) if isinstance(outputs, (tuple, list)) else 1
    pair = GraphPair(gm, fx.GraphModule({}, empty), n_out, tuple(sorted(slots)))
    step_nodes = list(gm.graph.nodes) + list(pair.backward.graph.nodes)
    live = liveness.analyze(pair)
    spec = cost_model.apply_overrides(detect_device_spec(torch.device(live.device), options.device), options)
    costs = cost_model.estimate(pair, live, spec)
    chosen = {i: (s.id, s.host_bytes) for i, s in slots.items()}
    # Forward-only: every parameter read is fetched (with "activations+params" a parameter is
    # released only after a training forward whose backward never ran; the fetch restores it).
    the_plan = param_residency.plan(pair, live, costs, chosen, "all", live.live_bytes(), None, host_grad=False)
    param_residency.apply(pair, the_plan, step_nodes, rt, release=options.offload == "all", backward=False)
    if options.verify:
        from .passes.verify import VerificationError

        errors = param_residency.check(pair, the_plan)
        if errors:
            raise VerificationError(
                "trinity verification of parameter residency (inference graph) failed:\n  - " + "\n  - ".join(errors)
            )
    return the_plan
