"""Optimizer split (option ``optimizer_on_device``, ``offload="all"``): which parameters keep
their optimizer state on the device and are updated there.

With ``offload="all"`` every parameter's update runs on the host, after its gradient has been
copied there; when the host update is slower than the backward it overlaps, it sets the step time
(ZeRO-Offload on Llama-2-7B: a 4 s CPU update against a 2 s backward). ZeRO-Offload++'s
Twin-Flow keeps a fixed fraction of the update on the GPU instead. Here the share is chosen by
the cost model: a prefix of the parameters in the order the forward uses them (their gradients
come last in the backward, so their host updates would be the last to finish, and the next
forward needs them first) stays resident on the device, with its gradient and optimizer state
(``HostUpdate.state_factor`` times its bytes), and is updated there on the compute stream at
``step()``; the rest is offloaded as before.

``request`` ``"auto"``: the shares 0, 1/16, ..., 1 of the parameter bytes are each planned
(residency, activation plan under the budget less the share's optimizer state, the simulated
step with the update, :func:`~.param_residency.step_timeline`), and the feasible one with the
shortest predicted step wins (ties: the smaller share). A number: the largest prefix within that
share of the bytes. This is a pure function of liveness, costs and options; it writes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..graph_pair import GraphPair
from . import param_residency, plan_window
from .cost_model import Costs, HostUpdate, host_update_seconds
from .liveness import Liveness

__all__ = ["OptimizerSplit", "plan", "AUTO_SHARES"]

AUTO_SHARES = tuple(i / 16 for i in range(17))


@dataclass(frozen=True)
class OptimizerSplit:
    """The chosen split (bytes, seconds).

    Attributes:
        request: the option's value (``"auto"`` or a share).
        positions: forward input positions of the parameters kept on the device.
        slots: their slot ids.
        device_param_bytes: their parameter bytes.
        device_state_bytes: device bytes of their optimizer state.
        total_param_bytes: bytes of every parameter that could be offloaded.
        predicted_step_seconds: the simulated step with this split (update included).
        host_update_seconds: the host update of the offloaded parameters, per step.
        exposed_update_seconds: update time the step waits for (host stalls plus the device's share).
        candidates: ``(share of the bytes, predicted step seconds, feasible)`` of every share tried.
    """

    request: float | str
    positions: tuple[int, ...]
    slots: tuple[int, ...]
    device_param_bytes: int
    device_state_bytes: int
    total_param_bytes: int
    predicted_step_seconds: float
    host_update_seconds: float
    exposed_update_seconds: float
    candidates: tuple[tuple[float, float, bool], ...]

    @property
    def share(self) -> float:
        """The share of the parameter bytes kept on the device."""
        return self.device_param_bytes / self.total_param_bytes if self.total_param_bytes else 0.0


def _plan_rest(pair, live, costs, chosen, budget, min_offload_bytes, grad_sync=None):
    """Residency and activation plans of the offloaded parameters ``chosen`` under ``budget``
    (:func:`~.param_residency.plan_with_activations`, the planning spine's loop)."""
    residency, view, act, _ = param_residency.plan_with_activations(
        pair, live, costs, chosen, "all", budget, min_offload_bytes, grad_sync=grad_sync
    )
    return residency, view, act


def plan(
    pair: GraphPair,
    live: Liveness,
    costs: Costs,
    chosen: Mapping[int, tuple[int, int]],
    budget: int | None,
    min_offload_bytes: int,
    update: HostUpdate,
    request: float | str = 0.0,
    shares: tuple[float, ...] = AUTO_SHARES,
    grad_sync=None,
):
    """Choose the split and plan the rest (see the module docstring).

    Args:
        pair, live, costs: the (unrewritten) graph pair, its liveness and cost model.
        chosen: forward input position -> ``(slot id, host bytes)`` of the parameters to offload.
        budget: the device budget in bytes (``None``: no limit).
        min_offload_bytes: the activation planner's threshold.
        update: the optimizer update's model.
        request: ``optimizer_on_device``: ``"auto"`` or a share in 0.0..1.0.
        shares: the shares ``"auto"`` tries.
        grad_sync: under DDP, the :class:`~.grad_sync.GradSyncModel` (the offloaded gradients'
            all-reduce buckets, in the plans and their simulated steps).

    Returns:
        ``(split, residency plan, activation view of the liveness, activation plan)``; with
        ``request`` 0.0, exactly the plans without a split.

    Raises:
        ValueError: for a ``request`` that is neither ``"auto"`` nor in 0.0..1.0.
    """
    if request != "auto" and not (isinstance(request, (int, float)) and 0.0 <= request <= 1.0):
        raise ValueError(f"optimizer_on_device: got {request!r}; expected 'auto' or a number from 0.0 to 1.0")
    full = param_residency.plan(pair, live, costs, chosen, "all", live.live_bytes(), budget, grad_sync=grad_sync)
    position = {ph: i for i, ph in enumerate(pair.forward.graph.find_nodes(op="placeholder"))}
    n = live.num_steps

    def first_use(p) -> int:
        return next((x for x in (p.fw_fetch_before, p.bw_fetch_before) if x is not None), n)

    order = [(position[p.placeholder_ref], p.slot, p.nbytes) for p in sorted(full.params, key=first_use)]
    total = sum(b for _, _, b in order)
    prefixes: list[int] = []  # number of parameters kept on the device, per share tried
    for share in shares if request == "auto" else (float(request),):
        k, acc = 0, 0
        while k < len(order) and acc + order[k][2] <= share * total * (1 + 1e-12):
            acc += order[k][2]
            k += 1
        if k not in prefixes:
            prefixes.append(k)
    best = None
    candidates = []
    for k in prefixes + ([0] if 0 not in prefixes else []):
        if k == 0 and best is not None and 0 not in prefixes:
            break  # the fallback (no share on the device) only when no requested share fits at all
        kept = order[:k]
        kept_bytes = sum(b for _, _, b in kept)
        state = update.state_factor * kept_bytes
        rest_budget = None if budget is None else budget - state
        rest = {pos: v for pos, v in chosen.items() if pos not in {q for q, _, _ in kept}}
        if rest_budget is not None and rest_budget < 0 and k:
            candidates.append((kept_bytes / total if total else 0.0, float("inf"), False))
            continue
        residency, view, act = _plan_rest(pair, live, costs, rest, rest_budget, min_offload_bytes, grad_sync)
        timeline = param_residency.step_timeline(
            residency, costs, plan_window.copy_tasks(act.evictions, costs), update, kept_bytes
        )
        share = kept_bytes / total if total else 0.0
        candidates.append((share, timeline.step_seconds, act.feasible))
        entry = (k, kept, kept_bytes, state, timeline, residency, view, act)
        if best is None or (act.feasible and (not best[-1].feasible or timeline.step_seconds < best[4].step_seconds)):
            best = entry
    k, kept, kept_bytes, state, timeline, residency, view, act = best
    split = OptimizerSplit(
        request=request,
        positions=tuple(q for q, _, _ in kept),
        slots=tuple(s for _, s, _ in kept),
        device_param_bytes=kept_bytes,
        device_state_bytes=state,
        total_param_bytes=total,
        predicted_step_seconds=timeline.step_seconds,
        host_update_seconds=timeline.update_seconds - host_update_seconds(kept_bytes, update, on_device=True),
        exposed_update_seconds=timeline.exposed_update_seconds,
        candidates=tuple(candidates),
    )
    return split, residency, view, act
