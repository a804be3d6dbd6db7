"""Per-graph-pair reports: what the planner decided and what it predicts.

:func:`last_report` returns the report of the most recently compiled forward/backward pair,
:func:`reports` all of this process's, oldest first. The log is append-only and thread-safe.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from .host_load import BUSY_FRACTION
from .options import format_bytes
from .runtime.transfer import TransferStats, _registry

if TYPE_CHECKING:
    from .options import TrinityOptions
    from .pipeline import PairPlan

__all__ = [
    "TrinityReport",
    "MeasuredCorrection",
    "last_report",
    "reports",
    "record_report",
    "replace_report",
    "next_graph_id",
]


@dataclass(frozen=True)
class MeasuredCorrection:
    """How the runtime check of the first steps (``step_check.py``) corrected a plan.

    Attributes:
        first_measured_peak_bytes: the peak measured in the step of the plan made before any
            measurement that led to the first replan (its first step, or under Inductor the step
            after it: the first backward compiles the backward graph) (bytes).
        first_planned_peak_bytes: that plan's predicted peak (bytes).
        margins: ``(graph:node, op, bytes)``: per node, the workspace measured on this machine
            beyond what the plan modelled for it (``passes/liveness.py``'s table), which the
            current plan adds at that node.
        total_margin_bytes: the sum of :attr:`margins`' bytes.
        replans: how many times the pair was planned again (1 or 2).
        method: how the steps were measured (``"cpu-allocator-trace"``, ``"cuda-allocator-trace"``).
        reuse_count: the runs of the pair alive at once in one step that the measured step showed
            and the current plan covers (1: the pair runs once at a time; see
            :class:`~offload_compiler.step_budget.StepReuse`).
        reserve_bytes: bytes the current plan reserves at every node for what a measured step held
            beyond the plan with the measured workspace and no op explains (0: none).
    """

    first_measured_peak_bytes: int
    first_planned_peak_bytes: int
    margins: tuple[tuple[str, str, int], ...]
    total_margin_bytes: int
    replans: int
    method: str
    reuse_count: int = 1
    reserve_bytes: int = 0


@dataclass(frozen=True)
class TrinityReport:
    """What trinity did to one compiled forward/backward pair (bytes, seconds).

    Attributes:
        graph_id: this process's sequence number of the pair (also its dump folder name).
        device: the compute device.
        inner: the inner compiler (``"inductor"`` or ``"eager"``).
        budget_request: the budget as asked for (e.g. ``"50% of the unplanned peak"``).
        budget_bytes: the budget resolved for this pair (``None``: no limit).
        peak_bytes_unplanned: simulated peak of the pair without offloading.
        peak_bytes_planned: simulated peak with the plan (re-measured by the verifier when on).
        lowest_reachable_peak_bytes: the peak with every offload candidate evicted at its
            tightest window, given this plan's recomputation. For an infeasible budget the plan
            is the lowest-peak plan, so this is the lowest any plan reaches; with
            ``strategy="offload"`` too. Where this plan recomputes at a feasible budget, another
            recomputation may reach lower (the summary says "with this recomputation").
        evicted_bytes: device bytes of the evicted saved activations.
        copy_bytes: bytes copied to the host (and back) per step.
        num_evicted: evicted buffers.
        num_candidates: saved activations that could have been evicted.
        num_saved: tensors saved for the backward.
        predicted_step_seconds: simulated forward+backward time with the plan.
        exposed_transfer_seconds: simulated copy time not hidden under compute.
        compute_seconds: simulated compute time alone.
        feasible: whether the plan meets the budget.
        fallback_reason: why nothing was offloaded despite a budget, if so.
        pass_seconds: wall time of each pass.
        dump_dir: where this pair's dumps are (``None`` without ``dump_dir``).
        runtime_id: id of the pair's transfer runtime.
        device_name: the device figures the cost model used.
        op_times: how the cost model timed the nodes: ``"roofline"``, or (``op_times="measured"``)
            ``"measured: N calls on DEVICE, M left to the roofline"``.
        op_times_not_timed: with ``op_times="measured"``, ``(op name, why, distinct calls)`` of
            the calls left to the roofline.
        size_bounds: with dynamic shapes and a budget, ``(size symbol, largest size)`` pairs the
            plan is guarded to (a larger size recompiles and plans again); empty otherwise.
        param_offload: with ``offload`` other than ``"activations"``: the mode, parameters
            offloaded, host bytes, the predicted peak with parameter residency (``peak_bytes``, the
            same as ``peak_bytes_planned``) and with parameters resident throughout
            (``peak_bytes_resident_params``), the working window (``max_window_steps`` nodes,
            ``window_seconds``), and the simulated step with the parameter copies as well as the
            activation copies, each issued and waited for where the graphs do
            (``predicted_step_seconds``, ``exposed_transfer_seconds``; the top-level figures
            count the activation copies only); with ``"all"`` that step includes the optimizer
            update (steady state of a training loop: ``update_seconds`` per step,
            ``exposed_update_seconds`` of it waited for, ``update`` what was assumed) and
            ``optimizer_on_device`` the share the plan keeps on the device (parameters, bytes,
            state bytes, the shares tried); under DDP with ``"all"`` also ``grad_sync``: the
            :class:`~offload_compiler.runtime.grad_sync.GradSync` id, ``world_size``, how many
            gradients are all-reduced (``num_reduced``), of them in place (``num_inplace``), in how
            many buckets (``num_buckets``, one all-reduce each; ``bucket_bytes``, DDP's
            ``bucket_caps``, the ``link`` assumed), and in the step the buckets' all-reduce
            seconds (``allreduce_seconds``) and the part of them exposed
            (``exposed_allreduce_seconds``); else ``None``.
        not_offloaded: saved activations kept on the device because trinity cannot move them
            (``(forward node, reason)``: a tensor subclass, a collective's buffer, ...).
        streams: with ``num_streams`` > 1 and ``inner="eager"``: per graph, ``(graph, streams
            used, events, simulated seconds, simulated seconds on one stream)`` of the applied
            stream plan (``passes/assign_streams.py``); empty when the pass did not run or was undone.
        measured_peak_bytes: the peak device bytes measured in this plan's first measured step
            on this machine (the pair's parameters and inputs, plus what its forward and backward
            allocated; ``runtime_check``, ``step_check.py``); ``None`` until measured or
            with ``runtime_check="off"``.
        correction: when the measured peak of an earlier plan of this pair was above the budget
            and the pair was planned again with the measured workspace: what changed
            (:class:`MeasuredCorrection`); else ``None``.

    A report is a snapshot: the runtime check replaces the pair's report in :func:`reports` (same
    ``graph_id``) when it measures or replans; :func:`last_report` and :func:`reports` return the
    current one.
        strategy: the ``strategy`` option (``"auto"``, ``"offload"``, ``"recompute"``).
        recompute: the joint keep/offload/recompute planner's summary
            (:func:`offload_compiler.passes.plan_recompute.summary`: the candidate chosen, the
            solver and whether its greedy fallback was used, buffers recomputed, their bytes,
            FLOPs and seconds); ``None`` when it did not run.
        decisions: per saved activation ``(forward node, bytes, "keep" | "offload" | "recompute")``.
        fits_without_plan: the budget is at or above the unplanned peak: nothing was planned or
            rewritten.
        peak_step_planned: the joint-schedule step (forward nodes, then backward nodes, as
            planned before the rewrite) where the planned peak is.
        reuse_count: the runs of this pair alive at once in one training step that the plan
            covers: N for a block graph run by N blocks (``F1 .. FN BN .. B1``), predicted at the
            compile (the first block's call) from the module structure where it can be
            (``reuse_predicted``), and measured by the runtime check of the first step, which
            plans the pair again where the count differs; 1 where neither has shown more runs
            yet. The budget then covers the N runs:
            ``peak_bytes_planned`` is the last run's own peak plus what the earlier runs and the
            rest of the step hold.
        reuse_predicted: where ``reuse_count`` was predicted at the compile from the module
            structure (identical blocks compiled alike,
            :func:`offload_compiler.step_budget.predict_runs`) and not measured yet, the reason;
            ``None`` otherwise. The first step's check measures the count and plans the pair
            again where it differs.
        reuse_measured: the reuse count the runtime check measured (``None``: not measured yet,
            or ``runtime_check="off"``); above ``reuse_count`` where the pair was not planned
            again (``runtime_check="measure"``, parameter offload).
        reuse_held_bytes: the saved activations the ``reuse_count - 1`` earlier runs keep on the
            device while the last run runs, under this plan.
        held_bytes: what the rest of the step holds while this pair runs, as planned: the step
            ledger's holdings (:mod:`offload_compiler.step_budget`) and, with ``reuse_count`` >
            1, the earlier runs' inputs and parameters and the other pairs' runs beside it
            (``reuse_held_bytes`` not included).
        accumulated_grad_bytes: the part of ``held_bytes`` that is the gradients of the pair's
            own parameters left by an earlier backward when its forward runs (gradient
            accumulation: DDP's ``no_sync()``, ``zero_grad(set_to_none=False)``); seen at the
            compile or by the runtime check at a later call, which plans the pair again for them.
    """

    graph_id: int
    device: str
    inner: str
    budget_request: str
    budget_bytes: int | None
    peak_bytes_unplanned: int
    peak_bytes_planned: int
    lowest_reachable_peak_bytes: int
    evicted_bytes: int
    copy_bytes: int
    num_evicted: int
    num_candidates: int
    num_saved: int
    predicted_step_seconds: float
    exposed_transfer_seconds: float
    compute_seconds: float
    feasible: bool
    fallback_reason: str | None
    pass_seconds: tuple[tuple[str, float], ...]
    dump_dir: str | None
    runtime_id: int
    device_name: str
    size_bounds: tuple[tuple[str, int], ...] = ()
    param_offload: dict | None = None
    not_offloaded: tuple[tuple[str, str], ...] = ()
    streams: tuple[tuple[str, int, int, float, float], ...] = ()
    measured_peak_bytes: int | None = None
    correction: MeasuredCorrection | None = None
    strategy: str = "auto"
    recompute: dict | None = None
    op_times: str = "roofline"
    op_times_not_timed: tuple[tuple[str, str, int], ...] = ()
    decisions: tuple[tuple[str, int, str], ...] = ()
    fits_without_plan: bool = False
    peak_step_planned: int | None = None
    reuse_count: int = 1
    reuse_measured: int | None = None
    reuse_held_bytes: int = 0
    held_bytes: int = 0
    reuse_predicted: str | None = None
    accumulated_grad_bytes: int = 0

    @classmethod
    def from_plan(
        cls,
        plan: PairPlan,
        *,
        graph_id: int,
        device: str,
        options: TrinityOptions,
        runtime_id: int,
        pass_seconds: tuple[tuple[str, float], ...] = (),
        fallback_reason: str | None = None,
        size_bounds: tuple[tuple[str, int], ...] = (),
        dump_dir: str | None = None,
        **fields,
    ) -> TrinityReport:
        """The report of one pair from its final :class:`~offload_compiler.pipeline.PairPlan`
        (after the rewrite passes and the verifier). ``peak_bytes_planned`` is the verifier's
        re-measured peak when it ran, else the plan's; the other figures are the plan's.
        ``fields``: further fields as they are (e.g. the joint planner's ``strategy``,
        ``recompute``, ``decisions``, ``fits_without_plan``)."""
        act, pred, live = plan.activations, plan.predictions, plan.activation_liveness
        extra = plan.model_state.resident_bytes + plan.reuse_held_bytes
        planned = plan.verified_peak_bytes + extra if plan.verified_peak_bytes is not None else pred.planned_peak_bytes
        residency = plan.residency
        return cls(
            graph_id=graph_id,
            device=device,
            inner=options.inner,
            budget_request=options.memory_budget.describe(),
            budget_bytes=plan.step_budget_bytes,
            peak_bytes_unplanned=pred.unplanned_peak_bytes,
            peak_bytes_planned=planned,
            lowest_reachable_peak_bytes=pred.lowest_reachable_peak_bytes,
            evicted_bytes=act.evicted_bytes,
            copy_bytes=act.copy_bytes,
            num_evicted=len(act.evictions),
            num_candidates=act.num_candidates,
            num_saved=len(live.saved),
            predicted_step_seconds=act.predicted_step_seconds,
            exposed_transfer_seconds=act.exposed_transfer_seconds,
            compute_seconds=act.compute_seconds,
            feasible=act.feasible,
            fallback_reason=fallback_reason,
            pass_seconds=pass_seconds,
            dump_dir=dump_dir,
            runtime_id=runtime_id,
            device_name=plan.costs.device.name,
            op_times=_op_times_text(plan.costs.device.op_times),
            op_times_not_timed=plan.costs.device.op_times.skipped if plan.costs.device.op_times is not None else (),
            size_bounds=size_bounds,
            peak_step_planned=act.peak_step_planned,
            reuse_count=plan.model_state.reuse_count,
            reuse_held_bytes=plan.reuse_held_bytes,
            held_bytes=plan.model_state.held_bytes,
            streams=tuple(
                (name, p.used_streams, p.num_events, p.seconds, p.single_stream_seconds)
                for name, p in plan.stream_plans.items()
            ),
            param_offload=(
                {
                    "mode": residency.mode,
                    "num_params": len(residency.params),
                    "host_bytes": residency.host_bytes,
                    "peak_bytes": residency.peak_bytes,
                    "peak_bytes_resident_params": residency.peak_bytes_resident_params,
                    "max_window_steps": residency.max_window_steps,
                    "window_seconds": residency.window_seconds,
                    "predicted_step_seconds": pred.step_seconds,
                    "exposed_transfer_seconds": pred.exposed_transfer_seconds,
                    "update_seconds": pred.update_seconds,
                    "exposed_update_seconds": pred.exposed_update_seconds,
                    "allreduce_seconds": pred.allreduce_seconds,
                    "exposed_allreduce_seconds": pred.exposed_allreduce_seconds,
                    "update": plan.update.description if plan.update is not None else None,
                    "optimizer_on_device": (
                        {
                            "request": plan.split.request,
                            "num_params": len(plan.split.positions),
                            "param_bytes": plan.split.device_param_bytes,
                            "state_bytes": plan.split.device_state_bytes,
                            "share": plan.split.share,
                            "candidates": plan.split.candidates,
                        }
                        if plan.split is not None
                        else None
                    ),
                    **({"grad_sync": plan.grad_sync} if plan.grad_sync is not None else {}),
                }
                if residency is not None
                else None
            ),
            not_offloaded=tuple(
                (st.fw_node, st.reason)
                for st in live.saved
                if not st.evictable and not st.reason.startswith("aliases a")
            ),
            **fields,
        )

    def runtime_stats(self) -> TransferStats | None:
        """Live counters of this pair's transfer runtime (host pool included), or ``None`` once
        the compiled code is gone."""
        runtime = _registry.get(self.runtime_id)
        return runtime.stats() if runtime is not None else None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def _lowest_qualifier(self) -> str:
        """ " with this recomputation" where :attr:`lowest_reachable_peak_bytes` depends on this
        plan's recompute choice (it recomputes, at a feasible budget), else ``""``."""
        rc = self.recompute or {}
        if self.feasible and (rc.get("num_recomputed") or rc.get("strategy") == "recompute"):
            return " with this recomputation"
        return ""

    def summary(self) -> str:
        """A few human-readable lines."""
        lines = [
            f"trinity graph {self.graph_id} on {self.device} (inner={self.inner}, figures: {self.device_name}; "
            f"node times: {self.op_times})",
            f"  budget     {self.budget_request} -> {format_bytes(self.budget_bytes)}",
            f"  peak       {format_bytes(self.peak_bytes_unplanned)} unplanned -> "
            f"{format_bytes(self.peak_bytes_planned)} planned (lowest reachable"
            f"{self._lowest_qualifier()} {format_bytes(self.lowest_reachable_peak_bytes)})",
            f"  evicted    {self.num_evicted} of {self.num_candidates} candidate buffers "
            f"({self.num_saved} saved tensors), {format_bytes(self.evicted_bytes)}; "
            f"{format_bytes(self.copy_bytes)} copied each way",
            f"  predicted  {self.predicted_step_seconds * 1e3:.3f} ms per step, "
            f"{self.exposed_transfer_seconds * 1e3:.3f} ms of it exposed copies "
            f"(compute {self.compute_seconds * 1e3:.3f} ms"
            + ("; one compute stream, see streams below)" if self.streams else ")"),
        ]
        if self.fits_without_plan:
            if self.budget_bytes is None:
                why = "no budget"
            elif self.budget_bytes >= self.peak_bytes_unplanned:
                why = "the budget is at or above the unplanned peak"
            else:  # (the step's earlier pairs' plans lowered what they hold while this one runs)
                why = "the budget is at or above its peak with what the rest of the step holds under their plans"
            lines.insert(3, f"  plan       fits without a plan ({why})")
        rc = self.recompute
        if rc and rc.get("num_recomputed"):
            solver = rc["solver"] + (" (greedy fallback: " + rc["solver_status"] + ")" if rc["fallback_used"] else "")
            lines.append(
                f"  recompute  {rc['num_recomputed']} of {rc['num_recomputable']} recomputable buffers, "
                f"{format_bytes(rc['recomputed_bytes'])}; "
                + (
                    f"{rc['recompute_flops'] / 1e9:.3g} GFLOP, "
                    if rc["recompute_flops"]
                    else "no matmul FLOPs (memory-bound ops, timed by their bytes), "
                )
                + f"{rc['recompute_seconds'] * 1e3:.3f} ms in the backward (strategy {rc['strategy']}, "
                f"chosen: {rc['chosen']}, solver {solver})"
            )
        elif rc and rc.get("strategy") != "offload" and not self.fits_without_plan and rc.get("fallback_used"):
            lines.append(f"  recompute  none (greedy fallback: {rc['solver_status']})")
        if rc and rc.get("note") and not self.fits_without_plan:
            lines.append(f"  note       {rc['note']}")
        for op, why, n in self.op_times_not_timed:
            lines.append(f"  not timed  {op} ({n} call{'s' if n != 1 else ''}): {why}; the roofline times it")
        if self.compute_seconds > 0 and self.exposed_transfer_seconds > 0.05 * self.compute_seconds:
            lines.append(
                (
                    f"  note       the budget is met only with {self.exposed_transfer_seconds * 1e3:.3f} ms of copies "
                    if self.feasible
                    else f"  note       the lowest-peak plan has {self.exposed_transfer_seconds * 1e3:.3f} ms of copies "
                )
                + f"not hidden under compute ({100 * self.exposed_transfer_seconds / self.compute_seconds:.0f}% of "
                "compute); a larger budget or a faster host link hides them"
            )
        if self.param_offload:
            po = self.param_offload
            lines.append(
                f"  params     offload={po['mode']}: {po['num_params']} parameters, host "
                f"{format_bytes(po['host_bytes'])}, peak with parameter residency "
                f"{format_bytes(po['peak_bytes'])} (resident: {format_bytes(po['peak_bytes_resident_params'])}), "
                f"window up to {po['max_window_steps']} nodes"
            )
            if "predicted_step_seconds" in po:
                lines.append(
                    f"             with parameter copies: {po['predicted_step_seconds'] * 1e3:.3f} ms per step, "
                    f"{po['exposed_transfer_seconds'] * 1e3:.3f} ms of it exposed copies"
                    + (
                        f", {po['exposed_update_seconds'] * 1e3:.3f} ms exposed optimizer update"
                        if po.get("update_seconds")
                        else ""
                    )
                )
            if po.get("update_seconds"):
                lines.append(f"  update     {po['update_seconds'] * 1e3:.3f} ms per step ({po['update']})")
            split = po.get("optimizer_on_device")
            if split and split["num_params"]:
                lines.append(
                    f"  on device  {split['num_params']} parameters ({100 * split['share']:.0f}% of the bytes, "
                    f"{format_bytes(split['param_bytes'])}) with their optimizer state "
                    f"({format_bytes(split['state_bytes'])}), updated on the device "
                    f"(optimizer_on_device={split['request']!r})"
                )
            if "grad_sync" in po:
                gs = po["grad_sync"]
                lines.append(
                    f"  ddp        gradients of {gs['num_reduced']} parameters averaged over {gs['world_size']} ranks "
                    f"(all-reduce on the device before the copy to host, {gs['num_inplace']} in place) in "
                    f"{gs.get('num_buckets', gs['num_reduced'])} bucket all-reduces"
                )
                if "allreduce_seconds" in po:
                    lines.append(
                        f"  allreduce  {po['allreduce_seconds'] * 1e3:.3f} ms per step on {gs.get('link')}, "
                        f"{po['exposed_allreduce_seconds'] * 1e3:.3f} ms of it exposed (in the step above)"
                    )
        if self.streams:
            parts = [
                f"{g} {used} stream{'s' if used != 1 else ''}, {events} event{'s' if events != 1 else ''} "
                f"({t * 1e3:.3f} ms simulated, {t1 * 1e3:.3f} ms on one)"
                for g, used, events, t, t1 in self.streams
            ]
            lines.append(f"  streams    {'; '.join(parts)}")
        if self.not_offloaded:
            kept = "; ".join(f"{node!r}: {why}" for node, why in self.not_offloaded)
            lines.append(f"  kept       {len(self.not_offloaded)} saved tensors on the device: {kept}")
        runs = max(self.reuse_count, self.reuse_measured or 1)
        if self.reuse_predicted and self.reuse_measured is not None and self.reuse_measured < self.reuse_count:
            # Predicted more runs than the first step showed, and not planned again (measure only).
            lines.append(
                f"  reuse      run {self.reuse_measured} time(s) per step (measured in the first step); the plan "
                f"covers the {self.reuse_count} runs {self.reuse_predicted}; not planned again"
            )
        elif runs > 1:
            if self.reuse_count == runs:
                covers = (
                    f"the budget covers the {runs} runs: the {runs - 1} earlier runs keep "
                    f"{format_bytes(self.reuse_held_bytes)} of saved activations while the last runs, the rest of "
                    f"the step holds {format_bytes(self.held_bytes)}"
                )
            else:
                covers = f"the plan covers {self.reuse_count} run(s) at a time; not planned again"
            source = (
                self.reuse_predicted
                if self.reuse_predicted and self.reuse_measured is None
                else "measured in the first step"
            )
            lines.append(f"  reuse      run {runs} times per step ({source}); {covers}")
        if self.accumulated_grad_bytes:
            lines.append(
                f"  gradients  {format_bytes(self.accumulated_grad_bytes)} of its parameters' gradients from an earlier "
                "backward (gradient accumulation) are held through the step and counted in the plan"
            )
        if self.measured_peak_bytes is not None:
            # The measurement is of the pair's own run: its share is what the rest leaves.
            share = None if self.budget_bytes is None else self.budget_bytes - self.held_bytes - self.reuse_held_bytes
            over = share is not None and self.measured_peak_bytes > share
            # After a replan the measurement is of the new plan's first step; the first step of
            # the first plan is the correction line's (a fresh-user trial read the two as one).
            which = "this plan's first step" if self.correction is not None else "the first measured step"
            lines.append(
                f"  measured   {format_bytes(self.measured_peak_bytes)} peak in {which} "
                f"(planned {format_bytes(self.peak_bytes_planned - self.held_bytes - self.reuse_held_bytes)} for "
                "its own run)"
                + (
                    "; above the budget less what the rest of the step is predicted to hold while it runs "
                    "(offload_compiler.step_report(model) judges the whole step)"
                    if over
                    else ""
                )
            )
        if self.correction is not None:
            c = self.correction
            top = sorted(c.margins, key=lambda m: -m[2])[:3]
            where = ", ".join(f"{node} ({op}) +{format_bytes(b)}" for node, op, b in top)
            lines.append(
                f"  corrected  replanned {c.replans}x after measuring {format_bytes(c.first_measured_peak_bytes)} "
                f"in the first plan's measured step (planned {format_bytes(c.first_planned_peak_bytes)}): "
                + (f"{c.reuse_count} runs per step, " if c.reuse_count > 1 else "")
                + f"workspace margins at {len(c.margins)} nodes, {format_bytes(c.total_margin_bytes)} in all"
                + (f" ({where})" if where else "")
                + (
                    f", and {format_bytes(c.reserve_bytes)} reserved at every node for allocations no op explains"
                    if c.reserve_bytes
                    else ""
                )
            )
        if self.fallback_reason:
            lines.append(f"  fallback   {self.fallback_reason}")
        if self.dump_dir:
            lines.append(f"  dumps      {self.dump_dir}")
        return "\n".join(lines)


class _ReportLog:
    def __init__(self):
        self._lock = threading.Lock()
        self._reports: list[TrinityReport] = []
        self._next_id = 0
        self._last_failed = False

    def next_id(self) -> int:
        with self._lock:
            self._next_id += 1
            return self._next_id

    def append(self, report: TrinityReport) -> None:
        with self._lock:
            self._reports.append(report)
            self._last_failed = False

    def replace(self, old: TrinityReport, new: TrinityReport, drop: TrinityReport | None = None) -> None:
        with self._lock:
            if drop is not None:
                self._reports = [r for r in self._reports if r is not drop]
            for i, r in enumerate(self._reports):
                if r is old:
                    self._reports[i] = new
                    return
            self._reports.append(new)

    def fail(self) -> None:
        with self._lock:
            self._last_failed = True

    def last(self) -> TrinityReport | None:
        with self._lock:
            return None if self._last_failed or not self._reports else self._reports[-1]

    def all(self) -> tuple[TrinityReport, ...]:
        with self._lock:
            return tuple(self._reports)


_LOG = _ReportLog()


def next_graph_id() -> int:
    return _LOG.next_id()


def record_report(report: TrinityReport) -> None:
    _LOG.append(report)


def replace_report(old: TrinityReport, new: TrinityReport, drop: TrinityReport | None = None) -> None:
    """Put ``new`` where ``old`` is in the log (appended if ``old`` is not there), first taking
    out ``drop`` (the report a replanning compile recorded, which ``new`` stands for)."""
    _LOG.replace(old, new, drop)


def record_failure() -> None:
    """Note that the most recent compile failed (:func:`last_report` then returns ``None``)."""
    _LOG.fail()


def last_report() -> TrinityReport | None:
    """The report of the most recently compiled forward/backward pair; ``None`` when nothing was
    compiled yet or when the most recent trinity compile failed (its error was raised; earlier
    reports stay in :func:`reports`)."""
    return _LOG.last()


def reports() -> tuple[TrinityReport, ...]:
    """Every report of this process, oldest first."""
    return _LOG.all()


def _op_times_text(times) -> str:
    """The report's ``op_times`` line for a spec's :class:`~.passes.op_timing.OpTimes` (or ``None``)."""
    if times is None:
        return "roofline"
    left = len(times.not_timed)
    text = f"measured: {len(times)} calls on {times.device}, {left} left to the roofline"
    if times.device == "cpu" and times.other_load is not None and times.other_load >= BUSY_FRACTION:
        text += (
            f"; other processes used {times.other_load:.0%} of the CPU while they were timed, so they may be far off"
        )
    return text
