"""The pass pipeline: partition, prepare, plan (one spine), rewrite, verify, report, dump.

:class:`TrinityPartitioner` is the one hook that sees both the forward and the backward graph
before AOTAutograd does its saved-tensor bookkeeping (see TORCH_NOTES.md). It calls
:func:`partition` (PyTorch's min-cut partitioner with AOTAutograd's arguments), then:

0. ``reorder``       :func:`prepare`: compute nodes early where that frees memory (node order only)
1. :func:`plan_pair`, the planning spine (pure; the backend, the inference rewrite and the
   ``plan`` command all call it): ``liveness`` (buffers and live ranges over the joint
   schedule, with the workspace margins the runtime check measured), ``cost_model`` (seconds per
   node and per transfer), the budget (:func:`resolve_budget`), ``optimizer_split`` (with
   ``offload="all"``: the share of the optimizer update kept on the device),
   ``param_residency`` (with parameter offload: where each parameter is fetched and released) and
   ``plan_recompute`` / ``plan_window`` (keep, offload or recompute each saved activation, and
   where the copies go), with their predictions, as one frozen :class:`PairPlan`
2. the declared rewrite passes, :data:`REWRITE_PASSES`, run by :func:`run_rewrites` in order:
   ``insert_recompute`` (the chains the joint keep/offload/recompute planner,
   :mod:`.passes.plan_recompute`, recomputes in the backward), ``insert_transfers`` (the
   ``trinity::*`` activation copy nodes), ``assign_streams`` (side
   streams and events: ``num_streams > 1``, ``inner="eager"``), ``param_residency`` (parameter
   fetch, release and gradient nodes); each is timed and, with ``dump_dir``, its graphs are
   written right after it runs
3. ``verify``        last, after every rewrite: invariants, happens-before, parameter residency
   and the re-measured peak against the budget (when ``verify`` is on)

The report is :meth:`~offload_compiler.report.TrinityReport.from_plan` of the final plan.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from . import host_load
from .devices import DeviceSpec, detect_device_spec
from .dump import GraphDumper
from .graph_pair import GraphPair, fill_tuple_vals
from .ir.meta import TARGET_DEVICE_KEY
from .ir.refs import plain_dict
from .options import TrinityOptions, format_bytes
from .passes import (
    assign_streams,
    cost_model,
    grad_sync,
    inline_pointwise,
    insert_recompute,
    insert_transfers,
    liveness,
    op_timing,
    pair_timeline,
    param_residency,
    plan_recompute,
    plan_window,
    reorder,
    size_guard,
    split_addmm,
    verify,
)
from .passes.margins import WorkspaceMargins
from .report import TrinityReport, next_graph_id, record_report
from .runtime.transfer import TransferRuntime
from .step_budget import input_bytes as _input_bytes
from .step_budget import kept_saved_bytes

__all__ = [
    "TrinityPartitioner",
    "CompileSession",
    "InfeasibleBudgetError",
    "ModelState",
    "PairAnalysis",
    "PairPlan",
    "Predictions",
    "RewritePass",
    "REWRITE_PASSES",
    "analyze_pair",
    "partition",
    "plan_pair",
    "prepare",
    "resolve_budget",
    "run_rewrites",
]

log = logging.getLogger("offload_compiler")


class InfeasibleBudgetError(ValueError):
    """No plan reaches the requested memory budget; the message names the budget, the lowest
    reachable peak and what dominates it."""


_OFFLOAD_MODES = ("activations",) + param_residency.MODES


@dataclass(frozen=True)
class ModelState:
    """The step's model state as the planner sees it: what is offloaded and what else the step
    holds on the device besides the graph pair's own tensors.

    Attributes:
        offload: ``"activations"``, ``"activations+params"`` or ``"all"`` (the option's meaning).
        params: forward input position -> ``(slot id, host bytes)`` of each parameter to offload
            (host bytes: its master copy, plus its host gradient with ``"all"``); empty with
            ``"activations"``.
        optimizer_state_bytes: device bytes of optimizer state that a device optimizer would
            hold for the whole step (the ``plan`` command's AdamW moments). They count in every
            peak and come off the budget, except with ``offload="all"``, where the state lives
            in host memory (counted in :attr:`host_bytes`). The backend passes 0: it does not see
            the user's optimizer, and an ``"auto"`` budget is the free memory after it.
        host_grad: send gradients to host; ``None``: with ``offload="all"``.
        update: with ``offload="all"``, the model of the optimizer update
            (:class:`~.passes.cost_model.HostUpdate`; the backend's comes from the live
            ``CPUOptimizer``, ``plan``'s from its flags); ``None``: the device's default
            (:func:`~.passes.cost_model.host_update_model`).
        held_bytes: device bytes the training step holds outside this pair while it runs, under
            the other pairs' plans (the step ledger, :mod:`offload_compiler.step_budget`): they
            come off the pair's budget and count in its planned peak. 0: the pair is the step.
        held_unplanned_bytes: the same with nothing offloaded (counts in the unplanned peak, the
            base of a percentage budget).
        step_unplanned_peak_bytes: the largest unplanned step peak of the step's other pairs
            compiled so far (a percentage budget is of the larger of it and this pair's;
            :meth:`~offload_compiler.step_budget.StepLedger.holdings`).
        reuse_count: runs of this pair alive at once in one step (N: a block graph run by N
            blocks, ``F1 .. FN BN .. B1``; measured by the runtime check of the first step,
            :class:`~offload_compiler.step_budget.StepReuse`). The N - 1 earlier runs keep the
            saved activations the plan keeps on the device while the last run runs, so the plan
            meets own peak + (N - 1) x kept + :attr:`held_bytes` <= budget
            (:func:`plan_pair`); what else the earlier runs hold (inputs, parameters) is in
            :attr:`held_bytes`. A percentage budget's base adds N - 1 runs' unplanned kept bytes.
        kept_cap_bytes: at most this many bytes of the pair's boundary-crossing saved activations
            stay on the device from the end of its forward to its backward (not offloaded, not
            recomputed): a later pair of the step asked for it to fit beside them
            (:meth:`~offload_compiler.step_budget.StepLedger.set_caps`). A planning constraint
            (``kept_cap`` of :func:`~.passes.plan_recompute.plan_joint` and
            :func:`~.passes.plan_window.plan`); ``None``: no cap. Planned with
            ``offload="activations"`` and a budget only (:func:`plan_pair` raises otherwise).
        grad_sync: under DDP with ``offload="all"``, the gradients' all-reduce
            (:class:`~.passes.grad_sync.GradSyncModel`): the plan buckets the reduced gradients,
            holds each until its bucket's all-reduce (counted in the peaks) and predicts the
            step with the all-reduces; ``None``: no gradient averaging.
    """

    offload: str = "activations"
    params: Mapping[int, tuple[int, int]] = field(default_factory=dict)
    optimizer_state_bytes: int = 0
    host_grad: bool | None = None
    update: Any = None
    held_bytes: int = 0
    held_unplanned_bytes: int = 0
    step_unplanned_peak_bytes: int = 0
    reuse_count: int = 1
    kept_cap_bytes: int | None = None
    grad_sync: Any = None

    def __post_init__(self):
        if self.offload not in _OFFLOAD_MODES:
            raise ValueError(f"ModelState.offload: {self.offload!r}; one of {', '.join(_OFFLOAD_MODES)}")
        if self.params and self.offload == "activations":
            raise ValueError("ModelState: parameters to offload need offload='activations+params' or 'all'")
        for name in ("optimizer_state_bytes", "held_bytes", "held_unplanned_bytes", "step_unplanned_peak_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"ModelState.{name} must be >= 0, got {getattr(self, name)}")
        if self.reuse_count < 1:
            raise ValueError(f"ModelState.reuse_count must be >= 1, got {self.reuse_count}")
        if self.kept_cap_bytes is not None and (isinstance(self.kept_cap_bytes, bool) or self.kept_cap_bytes < 0):
            raise ValueError(f"ModelState.kept_cap_bytes must be None or >= 0 bytes, got {self.kept_cap_bytes!r}")
        if self.grad_sync is not None and self.offload != "all":
            raise ValueError(
                f"ModelState.grad_sync: trinity averages gradients itself with offload='all' only, got "
                f"offload={self.offload!r}"
            )

    @property
    def resident_bytes(self) -> int:
        """Device bytes held outside the pair throughout the step."""
        return (0 if self.offload == "all" else self.optimizer_state_bytes) + self.held_bytes

    @property
    def host_bytes(self) -> int:
        """Host bytes of the offloaded model state (master copies, host gradients, and with
        ``"all"`` the optimizer state)."""
        return sum(h for _, h in self.params.values()) + (self.optimizer_state_bytes if self.offload == "all" else 0)


@dataclass(frozen=True)
class PairAnalysis:
    """The analyses of one (unrewritten) graph pair, which do not depend on the budget.

    Attributes:
        liveness: :func:`~.passes.liveness.analyze` of the pair.
        costs: :func:`~.passes.cost_model.estimate` on the device figures.
        seconds: wall time of each analysis.
    """

    liveness: liveness.Liveness
    costs: cost_model.Costs
    seconds: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class Predictions:
    """What a :class:`PairPlan` predicts for the step (bytes include
    :attr:`ModelState.resident_bytes` and, with :attr:`ModelState.reuse_count` N > 1, the N - 1
    earlier runs' kept saved activations; seconds are the simulator's, on the cost model's figures).

    Attributes:
        unplanned_peak_bytes: peak with nothing offloaded (every parameter resident; the
            optimizer state on the device).
        planned_peak_bytes: peak with the plan (parameter residency and evictions).
        lowest_reachable_peak_bytes: the lowest peak any activation plan reaches with this
            parameter residency.
        feasible: whether the planned peak is within the budget.
        step_seconds / exposed_transfer_seconds: the step with every copy the rewritten graphs
            issue (saved activations and parameters), issued and waited for where they are.
        compute_seconds: compute alone.
        host_bytes: host memory of the offloaded model state (:attr:`ModelState.host_bytes`).
        peak_bytes_resident_params: with parameter offload, the peak the same evictions would
            give with parameters resident throughout; else ``None``.
        update_seconds / exposed_update_seconds: with ``offload="all"``, the optimizer update's
            seconds per step and the part of it the step waits for (the simulator's update
            channel); else 0.
        allreduce_seconds / exposed_allreduce_seconds: under DDP with ``offload="all"``
            (:attr:`ModelState.grad_sync`), the gradient buckets' all-reduces per step (each the
            ring model's, :meth:`~.passes.grad_sync.GradSyncModel.seconds`, on the simulator's
            ``"allreduce"`` channel) and the part of them the step waits for (included in
            ``step_seconds``, not in ``exposed_transfer_seconds``); else 0.
    """

    unplanned_peak_bytes: int
    planned_peak_bytes: int
    lowest_reachable_peak_bytes: int
    feasible: bool
    step_seconds: float
    exposed_transfer_seconds: float
    compute_seconds: float
    host_bytes: int
    peak_bytes_resident_params: int | None = None
    update_seconds: float = 0.0
    exposed_update_seconds: float = 0.0
    allreduce_seconds: float = 0.0
    exposed_allreduce_seconds: float = 0.0


@dataclass(frozen=True)
class PairPlan:
    """The whole plan of one graph pair: what :func:`plan_pair` decided, and what the rewrite
    passes added (stream plans, the verifier's re-measured peak).

    Attributes:
        model_state: the :class:`ModelState` planned for.
        liveness: liveness of the pair as planned (before any rewrite; parameters resident).
        activation_liveness: what the activation planner saw: ``liveness`` with the parameter
            residency applied (:func:`~.passes.param_residency.activation_view`), else the same.
        costs: the cost model.
        step_budget_bytes: the step's budget (:func:`resolve_budget`; ``None``: no limit).
        budget_bytes: the pair's own budget: the step's less :attr:`ModelState.resident_bytes`
            (a pair run N times per step meets it with :attr:`reuse_held_bytes` added to its peak).
        residency: the parameter residency plan (``None`` without parameter offload).
        activations: the activation plan (:class:`~.passes.plan_window.Plan`; pair bytes).
        predictions: :class:`Predictions`.
        stream_plans: graph name -> the applied stream plan (set by the ``assign_streams`` pass).
        verified_peak_bytes: the peak the verifier re-measured on the rewritten graphs.
        pass_seconds: wall time of each planning step.
        joint: the keep/offload/recompute planner's result
            (:class:`~.passes.plan_recompute.JointPlan`; offload-only with parameter offload).
            With recomputation, :attr:`liveness` is that of the graphs before it
            (``joint.source_liveness``) and :attr:`activation_liveness` that of the graphs with it
            applied, to which the activation plan's steps refer.
        split: with ``offload="all"``, the optimizer split
            (:class:`~.passes.optimizer_split.OptimizerSplit`), else ``None``.
        update: the optimizer update model the predictions used (``None`` without ``"all"``).
        margins: the measured workspace margins planned with (``None``: none yet).
        grad_sync: under DDP with ``offload="all"``, what the ``grad_sync`` pass reduces (set by it).
        reuse_held_bytes: with :attr:`ModelState.reuse_count` N > 1, the saved activations the
            N - 1 earlier runs keep on the device under this plan (N - 1 times the plan's kept
            bytes, ``activations.reuse_held_bytes``): held beside the last run, like
            :attr:`ModelState.held_bytes`; 0 with one run.
        reuse_held_unplanned_bytes: the same with nothing offloaded.
        budget_base_bytes: for a percentage budget, the bytes it is a fraction of
            (:func:`budget_base`: :attr:`step_budget_bytes` is that fraction of them); else ``None``.
    """

    model_state: ModelState
    liveness: liveness.Liveness
    activation_liveness: liveness.Liveness
    costs: cost_model.Costs
    step_budget_bytes: int | None
    budget_bytes: int | None
    residency: param_residency.ResidencyPlan | None
    activations: plan_window.Plan
    predictions: Predictions
    stream_plans: Mapping[str, assign_streams.StreamPlan] = field(default_factory=dict)
    verified_peak_bytes: int | None = None
    pass_seconds: tuple[tuple[str, float], ...] = ()
    joint: Any = None
    split: Any = None
    update: Any = None
    margins: WorkspaceMargins | None = None
    grad_sync: dict | None = None
    reuse_held_bytes: int = 0
    reuse_held_unplanned_bytes: int = 0
    budget_base_bytes: int | None = None


def budget_base(live: liveness.Liveness, model_state: ModelState, own_peak_bytes: int | None = None) -> int:
    """The bytes a percentage ``memory_budget`` is a fraction of (:func:`resolve_budget`): the
    step's peak without offloading as this pair sees it."""
    own = (
        (live.peak_bytes if own_peak_bytes is None else own_peak_bytes)
        + model_state.optimizer_state_bytes
        + model_state.held_unplanned_bytes
        + (model_state.reuse_count - 1) * kept_saved_bytes(live, set())
    )
    return max(own, model_state.step_unplanned_peak_bytes)


def resolve_budget(
    options: TrinityOptions, live: liveness.Liveness, model_state: ModelState, own_peak_bytes: int | None = None
) -> int | None:
    """The step's memory budget in bytes (``None``: no limit), for a pair with liveness ``live``.

    The one place a budget is resolved (the backend, the inference rewrite and ``plan`` reach
    it through :func:`plan_pair`):

    * bytes: as given;
    * a fraction: of the step's peak without offloading (:func:`budget_base`), the pair's
      (``own_peak_bytes``, default ``live.peak_bytes``) plus ``model_state.optimizer_state_bytes``, what the step's other
      pairs hold unplanned (``held_unplanned_bytes``) and, with ``reuse_count`` N > 1, N - 1
      runs' saved activations kept across the forward/backward boundary, or the other pairs'
      largest (``step_unplanned_peak_bytes``);
    * ``"auto"``: on CUDA, the device's free memory now, plus what the pair's parameters and
      inputs already hold (they are part of its peak), less ``budget_reserve_bytes``; without
      CUDA, no limit;
    * ``"none"``: no limit.
    """
    budget = options.memory_budget
    if budget.kind == "bytes":
        return int(budget.value)
    if budget.kind == "fraction":
        return int(budget.value * budget_base(live, model_state, own_peak_bytes))
    if budget.kind == "none":
        return None
    device = torch.device(live.device)
    if device.type == "cuda" and torch.cuda.is_available():
        resident = sum(
            b.size_bytes
            for b in live.buffers
            if b.on_device and b.kind in (liveness.BufferKind.PARAMETER, liveness.BufferKind.INPUT)
        )
        free, _total = torch.cuda.mem_get_info(device)
        return max(0, int(free) + resident - options.budget_reserve_bytes)
    return None


def prepare(pair: GraphPair, inner: str = "eager") -> int:
    """The rewrite every caller runs before planning: ``meta["val"]`` for tuple-valued nodes
    (:func:`~.graph_pair.fill_tuple_vals`), :func:`~.passes.reorder.hoist_frees` on both graphs
    and, with ``inner="inductor"``, :func:`~.passes.split_addmm.split_late_addmm` then
    :func:`~.passes.inline_pointwise.inline_reused_pointwise` on both (for the device in the
    forward's :data:`~offload_compiler.ir.meta.TARGET_DEVICE_KEY` where set).
    Returns how many nodes were moved, fenced or inserted. Mutates the graphs; runs once per pair (it marks
    the forward's ``meta["trinity_prepared"]``; a second call does nothing and returns 0).

    Raises:
        ValueError: for ``inner`` other than ``"eager"`` or ``"inductor"``.
    """
    if inner not in ("eager", "inductor"):
        raise ValueError(f"prepare: inner must be 'eager' or 'inductor', got {inner!r}")
    if pair.forward.meta.get("trinity_prepared"):
        return 0
    fill_tuple_vals(pair.forward)
    fill_tuple_vals(pair.backward)
    moved = reorder.hoist_frees(pair.forward) + reorder.hoist_frees(pair.backward)
    if inner == "inductor":
        target = pair.forward.meta.get(TARGET_DEVICE_KEY)
        moved += split_addmm.split_late_addmm(pair.forward, target)
        moved += split_addmm.split_late_addmm(pair.backward, target)
        moved += inline_pointwise.inline_reused_pointwise(pair.forward, target)
        moved += inline_pointwise.inline_reused_pointwise(pair.backward, target)
    pair.forward.meta["trinity_prepared"] = True
    return moved


def analyze_pair(
    pair: GraphPair, options: TrinityOptions, spec: DeviceSpec | None = None, margins: WorkspaceMargins | None = None
) -> PairAnalysis:
    """Liveness (with fusion assumed under ``inner="inductor"``, and the measured per-op workspace
    ``margins`` where given) and the cost model of ``pair`` on ``spec`` (default: the detected
    device or ``options.device``), with the options' figure overrides applied."""
    t0 = time.perf_counter()
    live = liveness.analyze(pair, assume_fusion=options.inner == "inductor", margins=margins)
    t1 = time.perf_counter()
    spec = cost_model.apply_overrides(spec or detect_device_spec(torch.device(live.device), options.device), options)
    seconds = [("liveness", t1 - t0)]
    if options.op_times == "measured":
        spec = replace(spec, op_times=measured_op_times(pair, live.device, spec.host_is_device))
        seconds.append(("op_timing", time.perf_counter() - t1))
    t2 = time.perf_counter()
    costs = cost_model.estimate(pair, live, spec)
    return PairAnalysis(live, costs, (*seconds, ("cost_model", time.perf_counter() - t2)))


def measured_op_times(pair: GraphPair, device: str, host_is_device: bool) -> op_timing.OpTimes:
    """The measured times of ``pair``'s aten calls on ``device`` (:func:`.passes.op_timing.measure`),
    kept in ``pair.forward.meta["trinity_op_times"]`` so that a later analysis of the same graphs
    (a replan, the rewritten graphs' recomputed and moved calls) measures only calls it has not
    timed. Reads and writes that meta key.

    Warns when the host is the device and other processes used at least
    :data:`~.host_load.BUSY_FRACTION` of its cores while new calls were timed (their OpenMP
    threads wait for descheduled workers, so the times, and the plan made from them, can be far
    off); the report's ``op_times`` line says so too."""
    known = pair.forward.meta.get("trinity_op_times")
    nodes = [*pair.forward.graph.nodes, *pair.backward.graph.nodes]
    times = op_timing.measure(nodes, device, host_is_device=host_is_device, known=known)
    pair.forward.meta["trinity_op_times"] = times
    new = len(times) + len(times.not_timed) - (len(known) + len(known.not_timed) if known is not None else 0)
    load = times.other_load
    if host_is_device and new and load is not None and load >= host_load.BUSY_FRACTION:
        cores = os.cpu_count() or 1
        warnings.warn(
            f"trinity op_times='measured': while this graph's ops were timed, other processes used "
            f"{load:.0%} of this machine's {cores} CPU core{'s' if cores != 1 else ''}. A CPU kernel runs on "
            f"{times.threads} thread{'s' if times.threads != 1 else ''} and waits for any that is descheduled, so "
            "the times, and the plan made from them, can be far off (on a 2-core machine beside two test runs "
            "a 1 MiB mul took 5-12 ms instead of 0.035 ms). Compile on an idle machine, or use "
            "op_times='roofline'.",
            stacklevel=2,
        )
    return times


def plan_pair(
    pair: GraphPair,
    options: TrinityOptions,
    model_state: ModelState | None = None,
    *,
    spec: DeviceSpec | None = None,
    analysis: PairAnalysis | None = None,
    margins: WorkspaceMargins | None = None,
) -> PairPlan:
    """Plan ``pair`` (after :func:`prepare`) without changing it: the planning spine.

    The budget is :func:`resolve_budget`'s; the pair plans against it less the model state's
    resident bytes. With parameters to offload, their residency is planned first
    (:mod:`.passes.param_residency`, working windows on); the activation planner then sees device
    memory with that residency (:func:`~.passes.param_residency.activation_view`); if the windows
    make the budget unreachable, both are planned again without windows. The predictions simulate
    the step with every copy.

    Args:
        pair: the partitioned, prepared graphs.
        options: validated options (budget, ``inner``, ``min_offload_bytes``, figure overrides).
        model_state: what is offloaded and held outside the pair (default: activations only).
        spec: device figures (default: detected, or ``options.device``).
        analysis: :func:`analyze_pair` of this very pair (to plan several budgets on one
            analysis); computed when ``None``.
        margins: per-op workspace measured by the runtime check of the first steps
            (:mod:`.step_check`): liveness counts it, and the budget is the one the
            first plan resolved (``margins.budget_bytes``); a percentage is resolved again from
            the first plan's unplanned peak without the margins (``margins.unplanned_peak_bytes``,
            where given) and this model state, whose reuse count the check may have raised;
            100% from the unplanned peak with the margins (it fits without a plan).

    Without parameter offload the joint planner (:func:`~.passes.plan_recompute.plan_joint`)
    chooses keep, offload or recompute per saved activation (``options.strategy``). With
    ``offload="all"`` the optimizer split (:mod:`.passes.optimizer_split`, option
    ``optimizer_on_device``) is chosen first, and the predictions include the optimizer update
    (:func:`~.passes.param_residency.step_timeline`).

    A pair run N times per step (``model_state.reuse_count`` N > 1, a reused block graph) is
    planned with the N - 1 earlier runs' kept saved activations in the budget: the joint planner
    (``earlier_runs``, :mod:`.passes.plan_recompute`, :mod:`.passes.plan_window`) meets own peak +
    (N - 1) x kept + held <= budget, where evicting or recomputing a saved activation lowers every
    step by N - 1 times its size. Parameter offload is not planned for several runs.

    Returns:
        A :class:`PairPlan`.

    A cap on the kept saved activations (``model_state.kept_cap_bytes``, an earlier pair of a
    step replanned so that a later one fits) is one more constraint of the joint planner.

    Raises:
        ValueError: ``model_state.reuse_count`` > 1 or ``model_state.kept_cap_bytes`` with
            parameters to offload; ``kept_cap_bytes`` without a budget.
    """
    ms = model_state if model_state is not None else ModelState()
    runs = ms.reuse_count
    if runs > 1 and ms.params:
        raise ValueError(
            f"plan_pair: a pair run {runs} times per step is planned for its runs with offload='activations' only; "
            f"got offload={ms.offload!r} with {len(ms.params)} parameters to offload"
        )
    if ms.kept_cap_bytes is not None and ms.params:
        raise ValueError(
            f"plan_pair: a cap on the kept saved activations ({ms.kept_cap_bytes} bytes) is planned with "
            f"offload='activations' only; got offload={ms.offload!r} with {len(ms.params)} parameters to offload"
        )
    analysis = analysis or analyze_pair(pair, options, spec, margins)
    live, costs = analysis.liveness, analysis.costs
    seconds = dict(analysis.seconds)
    base = None
    if margins is None:
        step_budget = resolve_budget(options, live, ms)
        if options.memory_budget.kind == "fraction":
            base = budget_base(live, ms)
    elif options.memory_budget.kind == "fraction" and (
        options.memory_budget.value >= 1.0 or margins.unplanned_peak_bytes is not None
    ):
        # A fraction is of the unplanned peak without the margins (a margin must not raise the
        # budget it is meant to respect), except 100%: the step as measured, margins included,
        # fits without a plan. (A fresh-user trial's MLP at 100% measured 12 bytes above its
        # modelled peak, and the replan against the old figure moved 8 MiB out and back each step.)
        own = None if options.memory_budget.value >= 1.0 else margins.unplanned_peak_bytes
        step_budget = resolve_budget(options, live, ms, own_peak_bytes=own)
        base = budget_base(live, ms, own)
    else:
        step_budget = margins.budget_bytes
    budget = None if step_budget is None else step_budget - ms.resident_bytes
    if ms.kept_cap_bytes is not None and budget is None:
        raise ValueError(f"plan_pair: a cap on the kept saved activations ({ms.kept_cap_bytes} bytes) needs a budget")
    residency = split = update = None
    view = live
    joint = None
    update_s = exposed_update_s = allreduce_s = exposed_allreduce_s = 0.0
    device_state = 0
    t0 = time.perf_counter()
    if ms.params:
        if ms.offload == "all" and ms.host_grad is not False:  # (host_grad=False: the inference rewrite)
            from .passes import optimizer_split

            update = ms.update if ms.update is not None else cost_model.host_update_model(costs.device)
            split, residency, view, act = optimizer_split.plan(
                pair,
                live,
                costs,
                ms.params,
                budget,
                options.min_offload_bytes,
                update,
                options.optimizer_on_device,
                grad_sync=ms.grad_sync,
            )
            device_state = split.device_state_bytes
            seconds["param_residency"] = time.perf_counter() - t0
        else:
            residency, view, act, plan_s = param_residency.plan_with_activations(
                pair, live, costs, ms.params, ms.offload, budget, options.min_offload_bytes, ms.host_grad
            )
            seconds["param_residency"] = plan_s
            seconds["plan_window"] = time.perf_counter() - t0 - plan_s
        resident_peak = int(plan_window.planned_live_bytes(live, act.evictions).max()) if live.num_steps else 0
        residency = replace(residency, peak_bytes=act.peak_bytes_planned, peak_bytes_resident_params=resident_peak)
        timeline = param_residency.step_timeline(
            residency,
            costs,
            plan_window.copy_tasks(act.evictions, costs),
            update,
            split.device_param_bytes if split is not None else 0,
        )
        allreduce = [c for c in timeline.copies if c.direction == "allreduce"]
        allreduce_s = float(sum(c.end - c.start for c in allreduce))
        exposed_allreduce_s = float(sum(c.stall for c in allreduce))
        step_s, exposed_s = timeline.step_seconds, timeline.exposed_seconds - exposed_allreduce_s
        if update is not None:
            update_s, exposed_update_s = timeline.update_seconds, timeline.exposed_update_seconds
        joint = plan_recompute.JointPlan(
            plan_recompute.RecomputePlan("offload", "offload only"), (), view, view, costs, act
        )
    else:
        joint = plan_recompute.plan_joint(
            pair,
            live,
            costs,
            budget,
            options.strategy,
            options.min_offload_bytes,
            rng_replay=options.inner == "eager",
            assume_fusion=options.inner == "inductor",
            margins=margins,
            earlier_runs=runs - 1,
            kept_cap=ms.kept_cap_bytes,
            time_limit_s=options.solver_time_limit,
        )
        seconds["plan_window"] = time.perf_counter() - t0  # the joint planner, plan_window included
        act, view, costs = joint.plan, joint.liveness, joint.costs
        step_s, exposed_s = act.predicted_step_seconds, act.exposed_transfer_seconds
        resident_peak = None
    if device_state:
        budget = None if budget is None else budget - device_state
    extra = ms.resident_bytes + device_state
    reuse_unplanned = (runs - 1) * kept_saved_bytes(live, set())
    predictions = Predictions(
        unplanned_peak_bytes=live.peak_bytes + ms.optimizer_state_bytes + ms.held_unplanned_bytes + reuse_unplanned,
        planned_peak_bytes=act.peak_bytes_planned + extra + act.reuse_held_bytes,
        lowest_reachable_peak_bytes=act.lowest_reachable_peak_bytes + extra,
        feasible=act.feasible,
        step_seconds=step_s,
        exposed_transfer_seconds=exposed_s,
        compute_seconds=costs.compute_seconds,
        host_bytes=ms.host_bytes,
        peak_bytes_resident_params=None if resident_peak is None else resident_peak + extra,
        update_seconds=update_s,
        exposed_update_seconds=exposed_update_s,
        allreduce_seconds=allreduce_s,
        exposed_allreduce_seconds=exposed_allreduce_s,
    )
    return PairPlan(
        model_state=ms,
        liveness=live,
        activation_liveness=view,
        costs=costs,
        step_budget_bytes=step_budget,
        budget_bytes=budget,
        budget_base_bytes=base,
        residency=residency,
        activations=act,
        predictions=predictions,
        pass_seconds=tuple(seconds.items()),
        joint=joint,
        split=split,
        update=update,
        margins=margins,
        reuse_held_bytes=act.reuse_held_bytes,
        reuse_held_unplanned_bytes=reuse_unplanned,
    )


# ---------------------------------------------------------------------------------- rewrites


@dataclass
class RewriteContext:
    """What the rewrite passes of one pair share (mutable: the graphs change under it).

    Attributes:
        pair: the graphs being rewritten.
        session: the compile session (options, runtime id, residency plans).
        step_nodes: the joint schedule's nodes as planned (forward then backward): the plan's
            step indices refer to them, so inserted nodes shift nothing.
        dumper: writes the dumps (``None`` without ``dump_dir``).
        seconds: pass name -> wall seconds, in run order.
        run_order: ``(pass name, dump stage or None)`` of each pass that ran, in order.
    """

    pair: GraphPair
    session: CompileSession
    step_nodes: list
    dumper: GraphDumper | None = None
    seconds: dict = field(default_factory=dict)
    run_order: list = field(default_factory=list)


@dataclass(frozen=True)
class RewritePass:
    """One entry of the declared rewrite list.

    Attributes:
        name: the timing key (``TrinityReport.pass_seconds``).
        dump: the dump stage its graphs are written as (``<dump>.forward.py``, ...).
        run: ``run(ctx, plan)`` mutates ``ctx.pair`` and returns the plan with what the pass
            decided, or ``None`` when it changed nothing (then no dump is written).
    """

    name: str
    dump: str
    run: Callable[[RewriteContext, PairPlan], PairPlan | None]


def _insert_recompute(ctx: RewriteContext, plan: PairPlan) -> PairPlan | None:
    joint = plan.joint
    if joint is None or not joint.chains:
        return None
    insert_recompute.apply(ctx.pair, joint.source_liveness, joint.chains, pin=joint.pin)
    fw, bw = ctx.pair.forward.graph.nodes, ctx.pair.backward.graph.nodes
    if (tuple(n.name for n in fw), tuple(n.name for n in bw)) != joint.rewritten_names:
        raise RuntimeError(
            "trinity internal error: the recomputation rewrote the graphs differently from the copy it was planned on"
        )
    # The activation plan's steps refer to the graphs with the recomputation.
    ctx.step_nodes = list(fw) + list(bw)
    # Its liveness was computed on the planner's copy of these graphs: its node references move
    # to the real graphs, step for step (checked equal above; ``Liveness.rebind``).
    live = plan.activation_liveness.rebind(ctx.step_nodes)
    return replace(plan, activation_liveness=live, joint=replace(joint, liveness=live))


def _insert_transfers(ctx: RewriteContext, plan: PairPlan) -> PairPlan | None:
    if not plan.activations.evictions:
        return None
    opts = ctx.session.options
    insert_transfers.apply(
        ctx.pair,
        plan.activation_liveness,
        plan.activations,
        ctx.session.runtime.id,
        fence_readers=opts.inner == "inductor",
        inductor_layouts=opts.inner == "inductor",
    )
    return plan


def _assign_streams(ctx: RewriteContext, plan: PairPlan) -> PairPlan | None:
    opts = ctx.session.options
    if opts.compute_streams <= 1:
        return None
    if plan.residency is not None:
        # Not combined yet: a side stream's read of a parameter is not ordered before the
        # parameter's release (README, "Limits today").
        warnings.warn(
            f"trinity: num_streams={opts.num_streams} is ignored with offload={opts.offload!r}: parameter "
            "offload and several compute streams are not combined yet (README, 'Limits today'); the graphs "
            "run on one compute stream. Use num_streams=1 to silence this warning.",
            stacklevel=5,
        )
        return None
    stream_plans = ctx.session._assign_streams(ctx.pair, plan.costs, plan.activations.peak_bytes_planned)
    if not stream_plans:
        return None
    if ctx.dumper:
        ctx.dumper.json("streams.json", {k: plain_dict(v) for k, v in stream_plans.items()})
    return replace(plan, stream_plans=stream_plans)


def _apply_param_residency(ctx: RewriteContext, plan: PairPlan) -> PairPlan | None:
    if plan.residency is None:
        return None
    param_residency.apply(ctx.pair, plan.residency, ctx.step_nodes, ctx.session.runtime.id)
    ctx.session.residency_plans.append(plan.residency)
    log.info("%s", plan.residency.summary())
    if ctx.dumper:
        ctx.dumper.text("residency.json", plan.residency.to_json())
    return plan


def _grad_sync(ctx: RewriteContext, plan: PairPlan) -> PairPlan | None:
    """Under DDP with ``offload="all"``: each gradient all-reduced on the device before its copy
    to the host (:mod:`.passes.grad_sync`)."""
    sync = ctx.session.grad_sync
    if sync is None or plan.residency is None:
        return None
    buckets = plan.residency.grad_buckets
    synced = grad_sync.apply(ctx.pair, sync, [b.slots for b in buckets])
    model = plan.model_state.grad_sync
    info = {
        "id": sync.id,
        "world_size": sync.world_size,
        "num_reduced": synced.num_reduced,
        "num_inplace": synced.num_inplace,
        "num_buckets": synced.num_buckets,
        "bucket_bytes": [b.nbytes for b in buckets],
        "bucket_caps": list(model.bucket_caps) if model is not None else None,
        "link": model.link.name if model is not None else None,
    }
    return replace(plan, grad_sync=info)


REWRITE_PASSES: tuple[RewritePass, ...] = (
    RewritePass("insert_recompute", "07_insert_recompute", _insert_recompute),
    RewritePass("insert_transfers", "10_insert_transfers", _insert_transfers),
    RewritePass("assign_streams", "20_assign_streams", _assign_streams),
    RewritePass("param_residency_apply", "30_param_residency", _apply_param_residency),
    RewritePass("grad_sync", "35_grad_sync", _grad_sync),
)
"""The rewrite passes, in the order they run (after planning, before the verifier)."""


def _verify(ctx: RewriteContext, plan: PairPlan) -> PairPlan:
    """The verifier, after every rewrite: parameter residency first (structure), then the
    activation transfers, happens-before and the re-measured peak against the pair's budget
    (every mode; the budget of an infeasible plan that runs anyway is not checked)."""
    opts = ctx.session.options
    if plan.residency is not None:
        errors = verify.check_residency(ctx.pair, plan.residency)
        if errors:
            raise verify.VerificationError(
                "trinity verification of parameter residency failed:\n  - " + "\n  - ".join(errors)
            )
    own_budget = None if plan.budget_bytes is None else plan.budget_bytes - plan.reuse_held_bytes
    peak = verify.verify(
        ctx.pair,
        own_budget if plan.activations.feasible else None,
        expected_peak_bytes=plan.activations.peak_bytes_planned,
        assume_fusion=opts.inner == "inductor",
        margins=plan.margins,
    )
    return replace(plan, verified_peak_bytes=peak)


def run_rewrites(ctx: RewriteContext, plan: PairPlan, passes: tuple[RewritePass, ...] = REWRITE_PASSES) -> PairPlan:
    """Run ``passes`` in order on ``ctx.pair``, then the verifier (when ``verify`` is on).

    Each pass that applies (returns a plan) is timed into ``ctx.seconds``; a pass with nothing to
    do (returns ``None``, e.g. ``insert_recompute`` without chains) is neither timed nor dumped.
    With a dumper, the graphs are written as the pass's dump stage right after it changed them, so
    consecutive dumps differ exactly by what one pass did, and ``passes.json`` lists the passes in
    run order. Returns the final plan.

    Raises:
        offload_compiler.passes.verify.VerificationError: when the verifier finds a violation.
    """
    for p in passes:
        t0 = time.perf_counter()
        out = p.run(ctx, plan)
        if out is None:
            continue
        ctx.seconds[p.name] = time.perf_counter() - t0
        plan = out
        ctx.run_order.append((p.name, p.dump))
        if ctx.dumper:
            ctx.dumper.graphs(p.dump, ctx.pair.forward, ctx.pair.backward)
    if ctx.session.options.verify:
        t0 = time.perf_counter()
        plan = _verify(ctx, plan)
        ctx.seconds["verify"] = time.perf_counter() - t0
        ctx.run_order.append(("verify", None))
    if ctx.dumper:
        ctx.dumper.json(
            "passes.json",
            [{"pass": name, "dump": dump, "seconds": ctx.seconds[name]} for name, dump in ctx.run_order],
        )
    return plan


def _liveness_json(live: liveness.Liveness, costs: cost_model.Costs) -> dict[str, Any]:
    ce = [0.0]
    for s in costs.step_seconds:
        ce.append(ce[-1] + s)
    steps = live.steps

    def where(step: int | None) -> str | None:
        return None if step is None else f"{steps[step].graph}:{steps[step].node}"

    return {
        "num_forward_steps": live.num_fw_steps,
        "num_steps": live.num_steps,
        "peak_bytes": live.peak_bytes,
        "peak_at": where(live.peak_step),
        "buffers": [
            {
                "id": b.id,
                "kind": b.kind.value,
                "bytes": b.size_bytes,
                "bytes_expr": str(b.size_expr),
                "device": b.device,
                "defined": where(b.def_step),
                "last_use": where(b.last_step),
                "live_steps": [b.def_step, b.last_step],
                "idle_gap_steps": b.idle_gap_steps,
                "idle_gap_seconds": (
                    ce[b.first_bw_use] - ce[b.last_fw_use + 1]
                    if b.last_fw_use is not None and b.first_bw_use is not None
                    else 0.0
                ),
                "nodes": list(b.nodes),
            }
            for b in live.buffers
        ],
        "saved": [plain_dict(s) for s in live.saved],
    }


def _held_plus(held: tuple[int, int, int], planned: int, unplanned: int) -> tuple[int, int, int]:
    """``held`` (bytes held outside a pair under the plans, all kept, and the step's unplanned
    peak so far) with ``planned`` / ``unplanned`` bytes more held beside the pair."""
    return (held[0] + planned, held[1] + unplanned, held[2])


def _step_reach(step) -> str:
    """The sentence of the training step's infeasible-budget message that names the lowest budget
    that runs: the step's predicted peak under the plans it has (each pair above the budget at its
    lowest-peak plan), as the ``memory_budget`` percentage of the step's unplanned peak that
    resolves to at least it (:func:`~.passes.plan_window.lowest_budget_percent`, the helper the
    per-pair message uses) and in bytes.

    ``step``: the step's :class:`~.step_budget.StepReport` (a percentage budget, so every pair's
    unplanned and predicted step peak is known)."""
    lowest, unplanned = step.predicted_peak_bytes, step.unplanned_peak_bytes
    if lowest >= unplanned:
        return (
            f"Offloading cannot lower the training step's peak: its lowest step peak is {lowest} bytes, the "
            f"lowest budget that runs is memory_budget='100%' of its peak without offloading ({unplanned} bytes) "
            f"or memory_budget={lowest} (bytes)."
        )
    return (
        f"The step's lowest peak under these plans is {lowest} bytes, so the lowest budget that runs is "
        f"memory_budget='{plan_window.lowest_budget_percent(lowest, unplanned)}' of the training step's peak "
        f"without offloading ({unplanned} bytes), or memory_budget={lowest} (bytes)."
    )


def _replanned_for_later_inputs(ledger, step, budget: int):
    """``step`` (the ledger's :class:`~.step_budget.StepReport`) with each pair that a later
    pair's inputs, there from the step's start, put above ``budget`` after it was planned
    (:attr:`~.step_budget.PairHolding.later_inputs_due`) at the plan its runtime check will make
    at its next call (:meth:`~.step_budget.StepLedger.can_replan`): its own peak at most what
    the budget leaves beside what the others hold, and at least its lowest-peak plan's. The
    step's check judges the step by those plans, not by the one made before the later pair's
    inputs were known."""
    pairs = []
    changed = False
    for k, p in zip(ledger.keys(), step.pairs):
        if (
            p.later_inputs_due
            and p.step_peak_bytes > budget
            and p.own_lowest_peak_bytes is not None
            and ledger.can_replan(k)
        ):
            own = max(p.own_lowest_peak_bytes, budget - p.held_bytes)
            if own < p.own_planned_peak_bytes:
                p = replace(p, own_planned_peak_bytes=own)
                changed = True
        pairs.append(p)
    if not changed:
        return step
    return replace(step, pairs=tuple(pairs), predicted_peak_bytes=max(p.step_peak_bytes for p in pairs))


class CompileSession:
    """State of one backend invocation: options, device, the transfer runtime, reports.

    Args:
        options: validated options.
        device: the compute device of the graph.
        runtime: the transfer runtime the rewritten graphs will call.
    """

    def __init__(self, options: TrinityOptions, device: torch.device, runtime: TransferRuntime):
        self.options = options
        self.device = device
        self.runtime = runtime
        self.reports: list[TrinityReport] = []
        # offload="activations+params"/"all": forward input position -> ParamSlot (set by the backend)
        self.param_slots: dict = {}
        self.residency_plans: list = []
        # Set by the runtime check of the first steps (step_check.py) when it replans:
        # the measured workspace, an input of plan_pair; and what it reads back after the rewrite.
        self.margins: WorkspaceMargins | None = None
        self.planned_steps = None
        # offload="all" under DDP: the gradients' all-reduce (runtime.grad_sync.GradSync; set by the backend)
        self.grad_sync = None
        # The training step this pair is one of (step_budget.StepPair; set by the backend) and
        # what the step held outside the pair when it was planned (StepLedger.holdings).
        self.step = None
        self.step_held: tuple[int, int, int] = (0, 0, 0)
        # The part of step_held[0] that is the earlier pairs' kept saved activations, and the cap
        # on this pair's own that the ledger gave its plan (StepLedger.set_caps; None: none).
        self.step_held_kept = 0
        self.kept_cap_bytes: int | None = None
        # The smallest percentage budget this pair's first compile ran within (its lowest step
        # peak then, over the step's unplanned peak as far as the compile saw it). A replan's
        # refusal, which sees more of the step, names no less: a fresh start compiles the pair
        # first, before the rest of the step, and would refuse a smaller one (a sixth fresh-user
        # trial: a block graph found run twice at its first step named 50.1%, refused there).
        self.compile_floor_percent: str | None = None
        # Whether this session is the runtime check's replan of a pair compiled before (set by the backend).
        self.replan_of_compile = False
        # What the step holds outside the pair as its ledger entry records it (for the step report,
        # step_budget.StepReport): step_held with a bytes or percentage budget; with "auto" or none,
        # which are not planned against the ledger, the ledger's holdings all the same. And its part
        # that is the earlier pairs' kept saved activations.
        self.step_ledger_held: tuple[int, int, int] = (0, 0, 0)
        self.step_ledger_held_kept = 0
        # The parts of both that are later pairs' inputs there from the step's start and their
        # outputs the caller held at this pair's backward (StepLedger.later_input_bytes,
        # later_output_bytes): a later pair's compile or the runtime check can raise them; the
        # runtime check then plans this pair again (step_check.CheckedCompile).
        self.step_later_parts: tuple[int, int] = (0, 0)
        # How often the pair runs at once in one step and what runs beside it, as the runtime
        # check measured the first step (step_budget.StepReuse; set by the backend's recompile).
        self.reuse = None
        # Device bytes of the pair's own parameters' gradients that exist when its forward runs
        # (gradient accumulation: DDP's no_sync(), zero_grad(set_to_none=False)): held through
        # the pair, counted like what the rest of the step holds. Seen at the compile, or at a
        # later call by the runtime check, which plans the pair again for them (step_check.py).
        # Set by the backend; 0 with an "auto" budget (the free memory, which they have taken).
        self.accumulated_grad_bytes = 0
        # With an "auto" budget or none: those gradients as the compile saw them, counted in the
        # step ledger's entry (the step report) only.
        self.reported_grad_bytes = 0
        # Read by the runtime check after the plan: the forward positions of the parameter
        # inputs (set by the backend), and per run the saved activations the plan keeps on the
        # device across the forward/backward boundary, unplanned, and the non-parameter inputs
        # (bytes); the pair's own unplanned peak (bytes, without margins on the first plan).
        self.param_positions: tuple[int, ...] = ()
        self.run_bytes: tuple[int, int, int] = (0, 0, 0)
        self.own_unplanned_peak_bytes: int | None = None
        # The ledger entry this session recorded (step_budget.PairHolding), if any.
        self.step_holding = None
        # Set by the backend: the pair is a module compiled on its own (module.compile(), FSDP2's
        # per-block compile), which identical blocks may run several times per step. A
        # percentage it cannot reach for one run then waits for the first step (the message).
        self.may_be_reused = False
        self.provisional: str | None = None
        # A copy of the prepared pair before the rewrites (insert_recompute.copy_pair), kept for a
        # pair of a step that a later pair may cap: probe_cap plans it again on it (run sets it).
        self.cap_probe_pair: GraphPair | None = None

    @property
    def step_later_bytes(self) -> int:
        """The bytes of :attr:`step_later_parts` together: what the plan counts of later pairs."""
        return sum(self.step_later_parts)

    def model_state(self, pair: GraphPair) -> ModelState:
        """The :class:`ModelState` of ``pair``: its parameter inputs that have slots
        (``offload`` other than ``"activations"``), with their slots' host bytes, what the
        training step holds outside it (:mod:`.step_budget`; not with ``memory_budget="auto"`` or
        none, where it is only recorded for the step report, :attr:`step_ledger_held`), the
        gradients its own parameters hold from an earlier backward (:attr:`accumulated_grad_bytes`)
        and, once the runtime check measured the pair running N times per step or its compile
        predicted it (:attr:`reuse`), the reuse count and what the earlier runs and other pairs'
        runs hold besides their kept saved activations. Its cap on the kept saved activations is
        the ledger's (:meth:`~.step_budget.StepLedger.set_caps`) and, where the pair is planned
        again after later pairs of the step compiled, at most what they have room for
        (:meth:`~.step_budget.StepLedger.later_room`); :attr:`kept_cap_bytes` is the ledger's."""
        held = ledger = (0, 0, 0)
        ledger_kept = 0
        cap = planning_cap = None
        self.step_held_kept = 0
        if self.step is not None:
            if self.step.split is None:  # (DDP splits pass their outputs on: step_budget)
                self.step.ledger.set_pair_outputs(self.step.key, liveness.loss_output_bytes(pair))
            ledger = self.step.holdings(self.options.offload)
            ledger_kept = self.step.ledger.earlier_kept(self.step.key)
            self.step_later_parts = (
                self.step.ledger.later_input_bytes(self.step.key),
                self.step.ledger.later_output_bytes(self.step.key),
            )
            if self.options.memory_budget.kind in ("bytes", "fraction"):
                held, self.step_held_kept = ledger, ledger_kept
                if self.options.offload == "activations":
                    cap = self.step.ledger.kept_cap(self.step.key)
                    # Planned again after later pairs compiled: keep no more than they have room for.
                    room = self.step.ledger.later_room(self.step.key)
                    if room is not None:
                        planning_cap = room if cap is None else min(cap, room)
        self.kept_cap_bytes = cap
        if self.reuse is None:
            self.reuse = self._predicted_reuse(pair)
        reuse = self.reuse
        g = self.accumulated_grad_bytes
        extra = (reuse.held_bytes + g, reuse.held_unplanned_bytes + g) if reuse is not None else (g, g)
        held = _held_plus(held, *extra)
        self.step_held = held
        g = 0 if self.accumulated_grad_bytes else self.reported_grad_bytes
        self.step_ledger_held = _held_plus(ledger, extra[0] + g, extra[1] + g)
        self.step_ledger_held_kept = ledger_kept
        static = set(pair.static_input_indices)
        params = {i: (s.id, s.host_bytes) for i, s in self.param_slots.items() if i in static}
        update = None
        if params and self.options.offload == "all":
            owner = next((s.owner() for s in self.param_slots.values() if s.owner()), None)
            if owner is not None:
                spec = cost_model.apply_overrides(detect_device_spec(self.device, self.options.device), self.options)
                update = cost_model.host_update_from_optimizer(spec, owner)
        sync = None
        if params and self.grad_sync is not None:
            sync = self._grad_sync_model()
        return ModelState(
            offload=self.options.offload,
            params=params,
            update=update,
            grad_sync=sync,
            held_bytes=held[0],
            held_unplanned_bytes=held[1],
            step_unplanned_peak_bytes=held[2],
            reuse_count=reuse.runs if reuse is not None else 1,
            kept_cap_bytes=cap if planning_cap is None else planning_cap,
        )

    def _grad_sync_model(self):
        """The :class:`~.passes.grad_sync.GradSyncModel` of :attr:`grad_sync`: its world size and
        slots, DDP's bucket caps (:func:`~offload_compiler.distributed.ddp_bucket_caps`) and the
        ``interconnect`` option's link (:func:`~offload_compiler.distributed.resolve_interconnect`)."""
        from .distributed import ddp_bucket_caps, resolve_interconnect

        sync = self.grad_sync
        ddp = sync.ddp_ref()
        if ddp is None:
            raise RuntimeError("trinity: the DDP module this graph was compiled in no longer exists")
        return grad_sync.GradSyncModel(
            world_size=sync.world_size,
            bucket_caps=ddp_bucket_caps(ddp),
            link=resolve_interconnect(self.options.interconnect),
            slot_ids=sync.slot_ids,
        )

    def _predicted_reuse(self, pair: GraphPair):
        """The :class:`~offload_compiler.step_budget.StepReuse` that the module structure predicts
        for this pair at its compile (``StepPair.predicted_runs``, :func:`.step_budget.predict_runs`:
        a block graph that N identical blocks compiled alike will run), or ``None``: N runs, the
        N - 1 earlier runs holding their inputs (the forward's inputs other than parameters and
        buffers, on the device) besides their kept saved activations, which the plan decides.
        Only with ``offload="activations"`` (parameter offload is planned for one run)."""
        step = self.step
        if step is None or step.predicted_runs < 2 or self.options.offload != "activations" or self.param_slots:
            return None
        from .step_budget import StepReuse

        static = set(pair.static_input_indices)
        inputs = 0
        for i, n in enumerate(pair.forward.graph.find_nodes(op="placeholder")):
            val = n.meta.get("val")
            if i in static or not isinstance(val, torch.Tensor) or val.device != self.device:
                continue
            try:
                inputs += int(val.numel()) * val.element_size()
            except Exception:  # noqa: BLE001  (a size without a hint: left to the first step's check)
                continue
        runs = step.predicted_runs
        held = (runs - 1) * inputs
        return StepReuse(runs, held, held, predicted=step.predicted_why)

    def _assign_streams(
        self, pair: GraphPair, costs: cost_model.Costs, planned_peak: int
    ) -> dict[str, assign_streams.StreamPlan]:
        """Run ``assign_streams`` on both graphs (``inner="eager"`` only); undo it if it would
        raise the planned peak. Returns the plans that were applied (by graph name)."""
        opts = self.options
        if opts.inner != "eager":
            warnings.warn(_INDUCTOR_STREAMS_WARNING, stacklevel=5)
            return {}
        plans = {}
        offset = 0  # the two graphs share the runtime's events: disjoint ids
        for name, gm in (("forward", pair.forward), ("backward", pair.backward)):
            secs, copies = assign_streams.graph_seconds(gm, costs.device, costs.pinned)
            plans[name] = assign_streams.plan(gm, opts.compute_streams, secs, copies)
            assign_streams.apply(gm, plans[name], self.runtime.id, event_offset=offset)
            offset += plans[name].num_events
        if any(p.records for p in plans.values()):
            peak = liveness.analyze(pair, assume_fusion=False, margins=self.margins).peak_bytes
            if peak > planned_peak:
                log.info(
                    "assign_streams: keep-alive would raise the peak to %d bytes (planned %d); one stream",
                    peak,
                    planned_peak,
                )
                for gm in (pair.forward, pair.backward):
                    assign_streams.remove(gm)
                return {}
        for name, p in plans.items():
            log.info(
                "assign_streams %s: %d streams used, %d events, simulated %.3g s (one stream %.3g s)",
                name, p.used_streams, p.num_events, p.seconds, p.single_stream_seconds,
            )  # fmt: skip
        return plans

    def _keep_on_device(self, split) -> None:
        """The optimizer split's parameters stay on the device: their slots (host master copy and
        gradient) are dropped and the parameters marked (``ON_DEVICE_ATTR``), so the graphs leave
        them resident with their gradients in ``.grad``, the ``CPUOptimizer`` updates them on the
        device and later compiles do not offload them."""
        from .runtime.model_state import ON_DEVICE_ATTR, SLOT_ATTR

        for pos in split.positions:
            slot = self.param_slots.pop(pos, None)
            if slot is None:
                continue
            p = slot.param_ref()
            if p is not None and getattr(p, SLOT_ATTR, None) is slot:
                delattr(p, SLOT_ATTR)
                setattr(p, ON_DEVICE_ATTR, True)
            for i, other in list(self.param_slots.items()):
                if other is slot:  # the same parameter at several inputs
                    del self.param_slots[i]

    def _reuse_defers(self) -> bool:
        """Whether an infeasible plan waits for the first step's check: a percentage budget for a
        module compiled on its own (``module.compile()``, FSDP2's per-block compile: a block graph
        that identical blocks may run several times per step, :attr:`may_be_reused`) before the
        check measured how many runs share the step (the percentage is of their unplanned peak),
        where the check can plan again (``runtime_check="replan"``, ``offload="activations"``)."""
        opts = self.options
        return (
            self.may_be_reused
            and self.reuse is None
            and opts.memory_budget.kind == "fraction"
            and opts.runtime_check == "replan"
            and opts.offload == "activations"
            and opts.fault_injection is None
        )

    def _step_defers(self) -> bool:
        """Whether an infeasible plan waits for the step's check: a percentage budget while more
        pairs of the step are to compile (the step's unplanned peak is not known yet). A pair
        planned again after they compiled (a runtime replan: held gradients, caps, measured
        workspace) does not wait: no later compile would check it."""
        return (
            self.step is not None
            and self.options.memory_budget.kind == "fraction"
            and self.step.more_coming
            and not self.step.ledger.has_later(self.step.key)
        )

    # The attributes model_state sets: probe_cap puts them back (a probe changes nothing).
    _MODEL_STATE_ATTRS = (
        "step_held",
        "step_held_kept",
        "kept_cap_bytes",
        "step_ledger_held",
        "step_ledger_held_kept",
        "step_later_parts",
        "reuse",
    )

    def probe_cap(self, cap_bytes: int) -> tuple[int, int] | None:
        """What a cap of ``cap_bytes`` on this pair's kept saved activations would give when its
        runtime check plans it again at its next call (``step_check.CheckedCompile``, with
        ``on_infeasible="warn"``): ``(kept bytes, own planned peak bytes)`` of that plan, planned
        now by :func:`plan_pair` on a copy of the prepared pair (:attr:`cap_probe_pair`) with what
        the step holds now, the cap and this pair's margins. Where no plan meets the cap and the
        pair's own budget, that is its lowest-peak plan, which keeps more than the cap: under
        ``strategy="recompute"`` a recomputed saved activation keeps its chain's leaves and raises
        the backward's peak, which the offload floor a cap is planned against does not show. The
        step's check (:meth:`~.step_budget.StepLedger.set_caps`) counts these figures in place of
        the cap. Changes nothing: the session's planning state is put back.

        Returns ``None`` where no copy was kept (a pair no later pair can cap).

        Raises:
            ValueError: ``cap_bytes`` < 0.
        """
        if cap_bytes < 0:
            raise ValueError(f"probe_cap: the cap must be >= 0 bytes, got {cap_bytes}")
        pair = self.cap_probe_pair
        if pair is None:
            return None
        saved = {a: getattr(self, a) for a in self._MODEL_STATE_ATTRS}
        try:
            ms = replace(self.model_state(pair), kept_cap_bytes=cap_bytes)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                probe = plan_pair(pair, replace(self.options, on_infeasible="warn"), ms, margins=self.margins)
        finally:
            for a, v in saved.items():
                setattr(self, a, v)
        act, view = probe.activations, probe.activation_liveness
        own = int(plan_window.planned_live_bytes(view, act.evictions).max()) if view.num_steps else 0
        return kept_saved_bytes(view, {e.buffer for e in act.evictions}), own

    def _can_cap(self) -> bool:
        """Whether earlier pairs of the step may be planned again to keep less for this one
        (:meth:`~offload_compiler.step_budget.StepLedger.plan_caps`: only those whose runtime
        check can recompile them are capped)."""
        opts = self.options
        return (
            self.step is not None
            and opts.offload == "activations"
            and opts.runtime_check == "replan"
            and opts.fault_injection is None
            and opts.memory_budget.kind in ("bytes", "fraction")
        )

    def _cap_earlier(self, pair: GraphPair, the_plan: PairPlan) -> tuple[PairPlan, str]:
        """This pair cannot fit beside what the step's earlier pairs keep: cap their kept saved
        activations so that its lowest-peak plan fits (latest pair first,
        :meth:`~offload_compiler.step_budget.StepLedger.plan_caps`), and plan it again against
        the capped holdings. The capped pairs are planned again with their caps at their next
        call (the next step's start: their runtime check's recompile); this step runs with their
        old plans. With ``on_infeasible="error"`` the caps are entered only when they make the
        pair fit. Returns ``(plan, text for the infeasible message)``."""
        ledger, key = self.step.ledger, self.step.key
        if not self._can_cap():
            return (
                the_plan,
                " (earlier pairs are replanned to keep less only with runtime_check='replan' and offload='activations')",
            )
        before = ledger.caps()
        original = the_plan
        first_lowest = the_plan.predictions.lowest_reachable_peak_bytes
        for _ in range(3):  # the lowest peak with recomputation is an estimate: a few rounds
            excess = the_plan.predictions.lowest_reachable_peak_bytes - the_plan.step_budget_bytes
            caps, missing = ledger.plan_caps(key, excess, probed=True)
            if not caps:
                break
            ledger.set_caps(caps, self.step.label, probe=True)
            the_plan = plan_pair(pair, self.options, self.model_state(pair), margins=self.margins)
            if the_plan.activations.feasible or missing:
                break
        if the_plan.activations.feasible:
            log.info(
                "trinity: %s fits the step's budget only if earlier pairs keep less: %s; they are planned again at "
                "their next call (this step runs above the budget)",
                self.step.label,
                ", ".join(
                    f"{e.label} at most {ledger.kept_cap(k)} bytes"
                    for k, e in zip(ledger.keys(), ledger.entries)
                    if ledger.kept_cap(k) is not None
                ),
            )
            return the_plan, ""
        others = ledger.earlier(key)
        # Caps that do not lower the step's peak buy nothing (copies for no memory): the step's
        # peak is then an earlier pair's own (its plan above the budget already), not this one's.
        earlier_peak = max((e.step_peak_bytes for _k, e in others), default=0)
        if max(earlier_peak, the_plan.predictions.lowest_reachable_peak_bytes) >= max(earlier_peak, first_lowest):
            ledger.restore_caps(before)
            return original, (
                f" (earlier pairs are not replanned to keep less: the step's peak is an earlier pair's own, "
                f"{earlier_peak} bytes, which that would not lower)"
            )
        floor = sum(e.kept_floor_bytes * e.runs for _k, e in others)
        kept = sum(e.kept_bytes * e.runs for _k, e in others)
        capped = ledger.earlier_kept(key)
        strategy = self.options.strategy
        if strategy == "offload" and capped <= floor:
            how = f"to keep only the saved activations that cannot be offloaded ({capped} of the {kept} bytes they keep now"
        else:
            # Their probes' plans (StepLedger.set_caps): what they keep under the caps.
            by = {
                "offload": "offloading",
                "recompute": "recomputing (strategy='recompute' offloads none; a recomputed chain keeps its leaves)",
            }.get(strategy, "offloading or recomputing")
            how = f"to keep as little as their plans can within their own budgets, {by} ({capped} of the {kept} bytes they keep now"
        note = (
            f", with the earlier pairs planned again {how}; their caps are kept only where they make this pair fit): "
            f"its lowest step peak is then {the_plan.predictions.lowest_reachable_peak_bytes} bytes (before, "
            f"{first_lowest}), above the step's budget {the_plan.step_budget_bytes} bytes"
        )
        if self.options.on_infeasible == "error":
            ledger.restore_caps(before)
        return the_plan, note

    def _record_step(self, the_plan: PairPlan) -> None:
        """Record the pair in its step's ledger; at the step's last pair (of several) under a
        percentage budget, check every pair's predicted step peak against the step's final
        budget. A pair above it because of what earlier pairs keep gets caps on theirs
        (:meth:`_cap_earlier`'s rule; it keeps its own plan, its lowest-peak one); the step is
        refused (``on_infeasible="error"``) or warned about only when the caps cannot make it
        fit."""
        self.step_holding = self.step.record(
            the_plan,
            self.step_ledger_held,
            self.step_ledger_held_kept,
            self.options.min_offload_bytes,
            self.step_later_parts,
        )
        opts = self.options
        ledger = self.step.ledger
        step = ledger.report()
        if opts.memory_budget.kind != "fraction" or len(step.pairs) < 2:
            return
        if self.step.more_coming and not ledger.has_later(self.step.key):
            return  # checked at the step's last pair
        budget = int(opts.memory_budget.value * step.unplanned_peak_bytes)

        def report():
            return _replanned_for_later_inputs(ledger, ledger.report(), budget)

        step = report()
        over = [p for p in step.pairs if p.step_peak_bytes > budget]
        if not over:
            return
        before = ledger.caps()
        if self._can_cap():
            uncapped_peak = step.predicted_peak_bytes
            for k in ledger.keys():
                p = dict(zip(ledger.keys(), report().pairs))[k]
                if p.step_peak_bytes > budget:
                    caps, _missing = ledger.plan_caps(k, p.step_peak_bytes - budget, probed=True)
                    ledger.set_caps(caps, p.label, probe=True)
            step = report()
            over = [p for p in step.pairs if p.step_peak_bytes > budget]
            if not over:
                return
            if step.predicted_peak_bytes >= uncapped_peak:
                # The caps would not lower the step's peak (a pair's own plan is above the budget
                # already): copies for no memory.
                ledger.restore_caps(before)
                step = report()
                over = [p for p in step.pairs if p.step_peak_bytes > budget]
        worst = max(over, key=lambda p: p.step_peak_bytes)
        message = (
            f"trinity: memory_budget {opts.memory_budget.value * 100:g}% of the training step's unplanned peak "
            f"{step.unplanned_peak_bytes} bytes is {budget} bytes; {len(over)} of its {len(step.pairs)} graph "
            f"pairs cannot stay within it, the worst {worst.label} at {worst.step_peak_bytes} bytes "
            f"({worst.own_planned_peak_bytes} its own, {worst.held_bytes} held by the rest of the step"
            + (", with the earlier pairs capped to keep as little as their plans can" if self._can_cap() else "")
            + "). "
            + _step_reach(step)
            + "\n"
            + step.summary()
        )
        if opts.on_infeasible == "error":
            ledger.restore_caps(before)
        if opts.on_infeasible == "error":
            raise InfeasibleBudgetError(message)
        warnings.warn(message + " (on_infeasible='warn': running the lowest-peak plans)", stacklevel=2)

    def run(self, pair: GraphPair) -> PairPlan:
        """Prepare, plan (:func:`plan_pair`), rewrite (:data:`REWRITE_PASSES`) and verify one
        partitioned pair in place, then record its report. Returns the final plan. (It runs
        inside the backend's call, which notes a failure in the report log.)

        Raises:
            InfeasibleBudgetError: when no plan reaches the budget and ``on_infeasible="error"``.
            offload_compiler.passes.verify.VerificationError: when the verifier refuses the
                rewritten graphs.
        """
        opts = self.options
        graph_id = next_graph_id()
        dumper = GraphDumper(opts.dump_dir, graph_id) if opts.dump_dir is not None else None
        if dumper:
            dumper.graphs("00_partitioned", pair.forward, pair.backward)
        t0 = time.perf_counter()
        moved = prepare(pair, opts.inner)
        seconds = {"reorder": time.perf_counter() - t0}
        if dumper and moved:
            dumper.graphs("05_reorder", pair.forward, pair.backward)
        if self.step is not None and self.step.more_coming and self._can_cap():
            # A later pair of the step may cap this one: its compile asks probe_cap what that costs.
            self.cap_probe_pair = insert_recompute.copy_pair(pair)
        the_plan = plan_pair(pair, opts, self.model_state(pair), margins=self.margins)
        if the_plan.split is not None:
            self._keep_on_device(the_plan.split)
        runs = the_plan.model_state.reuse_count
        if runs > 1:
            # The earlier runs' kept saved activations, as the plan decided them, are held too.
            kept = (the_plan.reuse_held_bytes, the_plan.reuse_held_unplanned_bytes)
            self.step_held = _held_plus(self.step_held, *kept)
            self.step_ledger_held = _held_plus(self.step_ledger_held, *kept)
        seconds.update(the_plan.pass_seconds)
        act, view, joint = the_plan.activations, the_plan.activation_liveness, the_plan.joint
        if dumper:
            dumper.json("liveness.json", _liveness_json(view, the_plan.costs))
            dumper.json(
                "recompute.json",
                {
                    **json.loads(joint.recompute.to_json()),
                    "decisions": [
                        {"saved": n, "bytes": b, "decision": d} for n, b, d in plan_recompute.decisions(joint)
                    ],
                },
            )
        fallback = None
        cap_note = " (earlier pairs are not replanned to keep less)"
        if (
            not act.feasible
            and runs == 1
            and self.step is not None
            and self.step_held_kept
            and not self._step_defers()
            and not self._reuse_defers()
        ):
            # Earlier pairs keep saved activations this pair cannot fit beside: cap them.
            the_plan, cap_note = self._cap_earlier(pair, the_plan)
            act, view, joint = the_plan.activations, the_plan.activation_liveness, the_plan.joint
        if not self.reports and not self.replan_of_compile and self.compile_floor_percent is None:
            self.compile_floor_percent = plan_window.lowest_budget_percent(
                the_plan.predictions.lowest_reachable_peak_bytes,
                max(the_plan.predictions.unplanned_peak_bytes, self.step_held[2]),
            )
        if not act.feasible:
            # A percentage budget is a fraction of the peak resolve_budget saw (with parameter
            # offload, the one with every parameter resident).
            reach = None
            in_step = (self.step is not None and self.step_held[0]) or runs > 1
            if in_step:
                # The budget is the step's: the lowest budget that runs is stated as a fraction
                # of the step's unplanned peak, the value to pass back as memory_budget.
                lowest = the_plan.predictions.lowest_reachable_peak_bytes
                step_unplanned = max(the_plan.predictions.unplanned_peak_bytes, self.step_held[2])
                if runs > 1:
                    predicted = self.reuse.predicted if self.reuse is not None else None
                    source = (
                        f"{predicted}; the first step's check corrects a wrong count"
                        if predicted
                        else "measured in the first step"
                    )
                    held_text = (
                        f"This graph runs {runs} times per step ({source}): while its last run "
                        f"runs, its {runs - 1} earlier runs keep {the_plan.reuse_held_bytes} bytes of saved "
                        f"activations under the lowest-peak plan, and the rest of the step (the earlier runs' inputs "
                        f"and parameters, other graph pairs) holds {the_plan.model_state.held_bytes} bytes"
                    )
                else:
                    grads = self.accumulated_grad_bytes
                    others = self.step_held[0] - grads
                    grads_text = (
                        f"this pair's parameters hold {grads} bytes of gradients from an earlier backward (gradient "
                        "accumulation: no_sync(), zero_grad(set_to_none=False); zero_grad() between steps frees them)"
                    )
                    if not grads:
                        held_text = (
                            f"The training step's other graph pairs hold {self.step_held[0]} bytes while this one runs"
                            + cap_note
                        )
                    elif others:
                        held_text = (
                            f"The training step's other graph pairs hold {others} bytes{cap_note} and {grads_text} "
                            "while this one runs"
                        )
                    else:
                        held_text = grads_text[0].upper() + grads_text[1:] + " while it runs"

                # An earlier pair above the budget is at its lowest-peak plan (its provisional
                # budget was at most this one): the step runs only at a budget it fits too.
                earlier_peak = (
                    max((e.step_peak_bytes for _k, e in self.step.ledger.earlier(self.step.key)), default=0)
                    if self.step is not None
                    else 0
                )
                if earlier_peak > lowest:
                    held_text += (
                        f"; this pair's lowest step peak is {lowest} bytes, and an earlier pair's step peak is "
                        f"{earlier_peak} bytes"
                    )
                    lowest = earlier_peak
                percent = plan_window.lowest_budget_percent(lowest, step_unplanned)
                # (Only for a graph found run more than once: a seventh fresh-user trial's
                # gradient accumulation got a floor its fresh start did not need, unexplained.)
                floor = self.compile_floor_percent if self.replan_of_compile and runs > 1 else None
                of_step = f"of the step's peak without offloading ({step_unplanned} bytes so far)"
                if floor is not None and float(floor[:-1]) > float(percent[:-1]):
                    of_step += (
                        f" ({percent} would be, but a fresh start compiles this graph before it sees the rest "
                        f"of the step, and its compile needs {floor})"
                    )
                    percent = floor
                bytes_note = (
                    "" if self.replan_of_compile else " for the graph pairs compiled so far (later ones may add to it)"
                )
                reach = (
                    f"{held_text}, so the lowest budget that runs is memory_budget='{percent}' {of_step},"
                    f" or memory_budget={lowest} (bytes){bytes_note}."
                )
            described = act
            # What the rest of the step holds while this pair runs (the earlier runs' kept bytes,
            # the other pairs', the gradients held from an earlier backward).
            outside_bytes = the_plan.predictions.lowest_reachable_peak_bytes - act.lowest_reachable_peak_bytes
            if in_step:
                # The step's budget and the lowest step peak, those holdings included: the
                # planner's own budget is what they leave.
                grads = min(self.accumulated_grad_bytes, outside_bytes)
                outside = (
                    ("gradients held from an earlier backward", grads),
                    ("held by the rest of the step", outside_bytes - grads),
                )
                described = replace(
                    act,
                    peak_breakdown=tuple(
                        sorted(act.peak_breakdown + tuple(kv for kv in outside if kv[1]), key=lambda kv: -kv[1])
                    ),
                    budget_bytes=the_plan.step_budget_bytes,
                    lowest_reachable_peak_bytes=the_plan.predictions.lowest_reachable_peak_bytes,
                    peak_bytes_unplanned=the_plan.predictions.unplanned_peak_bytes,
                )
            # A percentage names the bytes it is a fraction of (with held gradients or other
            # pairs, the step's, not this graph's own unplanned peak).
            request = opts.memory_budget.describe()
            base = the_plan.budget_base_bytes
            if base is not None:
                margins_base = self.margins.unplanned_peak_bytes if self.margins is not None else None
                whose = "the training step's unplanned peak"
                if not in_step and base == the_plan.liveness.peak_bytes:
                    whose = "this graph's unplanned peak"
                elif not in_step and base == margins_base:
                    whose = "this graph's unplanned peak without the measured op workspace"
                request = f"{opts.memory_budget.value * 100:g}% of {whose} {format_bytes(base)} ({base} bytes)"
            message = plan_window.describe_infeasible(
                described,
                view,
                request,
                opts.min_offload_bytes,
                opts.on_infeasible,
                # The base a percentage is of (with measured workspace margins, the peak without
                # them: a fresh-user trial was told '61.2%' of 108.01 MiB for a budget of 65% of
                # 100.01 MiB, and '61.2%' was refused).
                unplanned_peak_bytes=base if base is not None else the_plan.liveness.peak_bytes,
                reach_override=reach,
                strategy=opts.strategy,
                base_label=(
                    f"the {format_bytes(base)} ({base} bytes) a percentage budget is of"
                    if base is not None and base != the_plan.liveness.peak_bytes
                    else None
                ),
            )
            message += plan_recompute.infeasible_note(joint.recompute, outside_bytes if in_step else 0)
            if in_step and self.step is not None and any(k != self.step.key for k in self.step.ledger.keys()):
                # This pair's new plan is not in the ledger yet: the summary lists the step's
                # earlier pairs (and, planned again after the step compiled, this pair's old plan).
                before = self.step.ledger.report()
                head = (
                    "The step as planned before this replan"
                    if self.step.ledger.has_later(self.step.key)
                    else "The step's pairs compiled before this one"
                )
                if (
                    base is not None
                    and before.budget_bytes is not None
                    and before.budget_bytes != the_plan.step_budget_bytes
                ):
                    # The same percentage of the smaller step that the summary describes (without
                    # what this pair holds now, such as gradients from an earlier backward).
                    pct = f"{opts.memory_budget.value * 100:g}%"
                    then = (
                        f"{pct} of the step's unplanned peak as it was then, {before.unplanned_peak_bytes} bytes, = "
                        if int(opts.memory_budget.value * before.unplanned_peak_bytes) == before.budget_bytes
                        else ""
                    )
                    head += (
                        f" (its budget then: {then}{before.budget_bytes} bytes; now {pct} of {base} bytes = "
                        f"{the_plan.step_budget_bytes} bytes)"
                    )
                message += "\n" + head + ": " + before.summary()
            if self._reuse_defers():
                # A block graph's percentage is provisional until the first step shows its runs.
                log.info("%s (provisional: the first step's check counts the graph's runs per step)", message)
                self.provisional = message
                fallback = (
                    "budget infeasible for one run; the first step's check counts the graph's runs per step and "
                    "plans again"
                )
            else:
                if self._step_defers():
                    # A DDP split's percentage budget is provisional until the last split compiles.
                    log.info("%s (provisional: checked when the step's last graph pair compiles)", message)
                    fallback = "budget infeasible for now; checked against the step's budget at its last graph pair"
                elif opts.on_infeasible == "error":
                    if dumper:
                        dumper.text("error.txt", message)
                    raise InfeasibleBudgetError(message)
                else:
                    warnings.warn(message + " (on_infeasible='warn': using the lowest-peak plan)", stacklevel=2)
                    fallback = "budget infeasible; running the lowest-peak plan"
        size_guards = size_guard.guard_planned_sizes(pair, view, the_plan.budget_bytes)
        if (
            the_plan.budget_bytes is not None
            and the_plan.liveness.peak_bytes > the_plan.budget_bytes
            and not act.evictions
            and not joint.chains
        ):
            fallback = "budget below the unplanned peak but nothing can be offloaded"
        step_nodes = list(pair.forward.graph.nodes) + list(pair.backward.graph.nodes)
        ctx = RewriteContext(pair, self, step_nodes, dumper, seconds)
        the_plan = run_rewrites(ctx, the_plan)
        self.run_bytes = (
            kept_saved_bytes(view, {e.buffer for e in act.evictions}),
            kept_saved_bytes(the_plan.liveness, set()),
            _input_bytes(the_plan.liveness),
        )
        if self.margins is None:
            self.own_unplanned_peak_bytes = the_plan.liveness.peak_bytes
        if self.step is not None:
            self._record_step(the_plan)
        if opts.runtime_check != "off" and opts.fault_injection is None:
            from .step_check import PlannedSteps

            try:
                self.planned_steps = PlannedSteps.of(pair, opts.inner == "inductor", self.margins)
            except Exception as exc:  # the check is optional; it never fails a compile
                log.warning("runtime_check: no per-node accounting of the rewritten pair (%s); not checked", exc)
        if dumper:
            dumper.text("plan.json", act.to_json())
            after = plan_window.planned_live_bytes(view, act.evictions)
            dumper.memory_plot(view.live_bytes(), after, the_plan.budget_bytes, view.num_fw_steps)
            t0 = time.perf_counter()
            timeline = pair_timeline.simulate_pair(
                pair, the_plan.costs.device, assume_fusion=opts.inner == "inductor", pinned=the_plan.costs.pinned
            )
            dumper.json("timeline.json", timeline.chrome_trace())
            seconds["simulate"] = time.perf_counter() - t0
        report = TrinityReport.from_plan(
            the_plan,
            graph_id=graph_id,
            device=str(self.device),
            options=opts,
            runtime_id=self.runtime.id,
            pass_seconds=tuple(seconds.items()),
            fallback_reason=fallback,
            size_bounds=size_guards.bounds,
            dump_dir=str(dumper.dir) if dumper else None,
            strategy=opts.strategy,
            recompute=plan_recompute.summary(joint.recompute),
            decisions=plan_recompute.decisions(joint),
            fits_without_plan=joint.recompute.fits_without_plan,
            accumulated_grad_bytes=self.accumulated_grad_bytes,
            reuse_predicted=(self.reuse.predicted if self.reuse is not None and runs > 1 else None),
        )
        if dumper:
            dumper.text("report.json", report.to_json())
        record_report(report)
        self.reports.append(report)
        log.info("%s", report.summary())
        return the_plan


_INDUCTOR_STREAMS_WARNING = (
    "trinity: num_streams > 1 is ignored with inner='inductor' (multi-stream compute is off). "
    "Inductor (torch 2.13) places nodes on streams only from node.meta['custom']['stream'] indices into "
    "Dynamo's registry of user stream objects, with torch.ops.streams events; a backend pass cannot "
    "register new streams there, and torch 2.11 has no such support. Use inner='eager' for "
    "multi-stream compute, or num_streams=1 to silence this warning."
)


def partition(joint: fx.GraphModule, joint_inputs, **kwargs) -> GraphPair:
    """The partition entry every caller uses: PyTorch's min-cut partitioner on AOTAutograd's
    joint graph, with AOTAutograd's keyword arguments passed through unchanged.

    ``kwargs`` are what AOTAutograd (or Inductor's ``partition_fn``) hands a partition function:
    ``num_fwd_outputs``, ``static_lifetime_input_indices`` (the parameters and buffers: the
    partitioner saves a static input itself instead of a view of it, since it costs no memory)
    and, under Inductor, ``compiler="inductor"``. The backend (:class:`TrinityPartitioner`), the
    ``plan`` command's fake trace (:mod:`offload_compiler.trace`) and the per-pass tests call this
    one function, so they see the same graphs.

    Returns:
        The :class:`~offload_compiler.graph_pair.GraphPair`; its ``static_input_indices`` are the
        ``static_lifetime_input_indices`` given.
    """
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    return GraphPair(fw, bw, kwargs["num_fwd_outputs"], tuple(kwargs.get("static_lifetime_input_indices") or ()))


class TrinityPartitioner(CustomPartitionerFn):
    """AOTAutograd partition function: PyTorch's min-cut partitioner, then trinity's passes.

    Usable both as Inductor's ``custom_partitioner_fn`` and as ``aot_autograd(partition_fn=...)``.
    """

    def __init__(self, session: CompileSession):
        super().__init__()
        self.session = session

    def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs) -> tuple[fx.GraphModule, fx.GraphModule]:
        pair = partition(gm, joint_inputs, **kwargs)
        self.session.run(pair)
        return pair.forward, pair.backward

    def uuid(self) -> Any:
        # Caches are disabled while trinity compiles (the plan depends on options and on this
        # runtime); the uuid still differs per session so nothing can be shared by mistake.
        return f"trinity-partitioner-{self.session.runtime.id}"

    def __deepcopy__(self, memo):
        # Inductor deep-copies its config (this object included) to hash it; the copy must
        # still reach this session.
        return self

    def __reduce__(self):
        raise TypeError("TrinityPartitioner holds a live runtime and cannot be pickled")
