"""The pass pipeline: partition, analyse, plan, rewrite, verify, report, dump.

:class:`TrinityPartitioner` is the one hook that sees both the forward and the backward graph
before AOTAutograd does its saved-tensor bookkeeping (see TORCH_NOTES.md). It runs PyTorch's own
min-cut partitioner (the one Inductor and ``aot_eager`` use), then the passes, in order:

0. ``reorder``       compute nodes early where that frees memory (mutates node order only)
1. ``liveness``      buffers and live ranges over the joint schedule (analysis)
2. ``cost_model``    seconds per node and per transfer (analysis)
3. ``plan_window``   which saved activations to evict and where the copies go (pure function)
4. ``insert_transfers``  the ``trinity::*`` nodes (mutates the graphs)
5. ``assign_streams``  side streams and events (``num_streams > 1``, ``inner="eager"``)
6. ``verify``        invariants, happens-before and the re-measured peak (when ``verify`` is on)

Each pass is timed; with ``dump_dir`` the graphs are written before and after the rewrite.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from dataclasses import asdict
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from .devices import DeviceSpec, detect_device_spec
from .dump import GraphDumper
from .graph_pair import GraphPair, fill_tuple_vals
from .options import MemoryBudget, TrinityOptions
from .passes import (
    assign_streams,
    cost_model,
    insert_transfers,
    liveness,
    plan_window,
    reorder,
    simulate,
    size_guard,
    verify,
)
from .report import TrinityReport, next_graph_id, record_report
from .runtime.transfer import TransferRuntime

__all__ = ["TrinityPartitioner", "CompileSession", "InfeasibleBudgetError", "resolve_budget", "plan_pair"]

log = logging.getLogger("offload_compiler")


class InfeasibleBudgetError(ValueError):
    """No plan reaches the requested memory budget; the message names the budget, the lowest
    reachable peak and what dominates it."""


def resolve_budget(
    budget: MemoryBudget, unplanned_peak: int, device: torch.device, options: TrinityOptions, resident: int
) -> int | None:
    """The budget in bytes for one graph pair (``None``: no limit).

    ``"auto"`` on CUDA is the device's free memory now, plus what the pair's parameters and inputs
    already hold (they are part of its peak), less ``budget_reserve_bytes``; without CUDA it is no
    limit. A fraction is of ``unplanned_peak``.
    """
    if budget.kind == "bytes":
        return int(budget.value)
    if budget.kind == "fraction":
        return int(budget.value * unplanned_peak)
    if budget.kind == "none":
        return None
    if device.type == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(device)
        return max(0, int(free) + resident - options.budget_reserve_bytes)
    return None


def plan_pair(
    pair: GraphPair, options: TrinityOptions, spec: DeviceSpec | None = None, model_state: dict | None = None
) -> tuple[liveness.Liveness, cost_model.Costs, int | None, plan_window.Plan, dict[str, float]]:
    """Run the analyses and the planner on ``pair`` without changing it.

    ``model_state`` (``offload`` other than ``"activations"``): forward input position ->
    ``(slot id, host bytes)`` of the parameters to offload. Their residency is planned first
    (:mod:`.passes.param_residency`); the activation planner then sees device memory with that
    residency (:func:`~.passes.param_residency.activation_view`); if the working windows make the
    budget unreachable, both are planned again without windows. The residency plan is left in
    ``model_state["plan"]``, the liveness without the view in ``model_state["liveness"]``, and
    the time of both planners in ``pass_seconds["param_residency"]``.

    Returns ``(liveness, costs, budget_bytes, plan, pass_seconds)``; with ``model_state`` the
    liveness returned is the activation view.
    """
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    live = liveness.analyze(pair, assume_fusion=options.inner == "inductor")
    seconds["liveness"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    device = torch.device(live.device)
    spec = cost_model.apply_overrides(spec or detect_device_spec(device, options.device), options)
    costs = cost_model.estimate(pair, live, spec)
    seconds["cost_model"] = time.perf_counter() - t0
    resident = sum(
        b.size_bytes
        for b in live.buffers
        if b.on_device and b.kind in (liveness.BufferKind.PARAMETER, liveness.BufferKind.INPUT)
    )
    budget = resolve_budget(options.memory_budget, live.peak_bytes, device, options, resident)
    t0 = time.perf_counter()
    if model_state:
        from .passes import param_residency

        t0 = time.perf_counter()
        chosen = {i: v for i, v in model_state.items() if isinstance(i, int)}
        model_state["liveness"] = real = live
        for use_windows in (True, False):
            residency = param_residency.plan(
                pair, real, costs, chosen, options.offload, real.live_bytes(), budget, use_windows=use_windows
            )
            live = param_residency.activation_view(real, residency)
            the_plan = plan_window.plan(live, costs, budget, options.min_offload_bytes)
            if the_plan.feasible or not residency.max_window_steps:
                break
        model_state["plan"] = residency
        seconds["param_residency"] = time.perf_counter() - t0
        seconds["plan_window"] = 0.0
        return live, costs, budget, the_plan, seconds
    the_plan = plan_window.plan(live, costs, budget, options.min_offload_bytes)
    seconds["plan_window"] = time.perf_counter() - t0
    return live, costs, budget, the_plan, seconds


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
        "saved": [asdict(s) for s in live.saved],
    }


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
        # offload="all" under DDP: the gradients' all-reduce (runtime.grad_sync.GradSync; set by the backend)
        self.grad_sync = None

    def _assign_streams(
        self, pair: GraphPair, costs: cost_model.Costs, planned_peak: int
    ) -> dict[str, assign_streams.StreamPlan]:
        """Run ``assign_streams`` on both graphs (``inner="eager"`` only); undo it if it would
        raise the planned peak. Returns the plans that were applied (by graph name)."""
        opts = self.options
        if opts.inner != "eager":
            warnings.warn(_INDUCTOR_STREAMS_WARNING, stacklevel=3)
            return {}
        plans = {}
        offset = 0  # the two graphs share the runtime's events: disjoint ids
        for name, gm in (("forward", pair.forward), ("backward", pair.backward)):
            secs, copies = assign_streams.graph_seconds(gm, costs.device, costs.pinned)
            plans[name] = assign_streams.plan(gm, opts.compute_streams, secs, copies)
            assign_streams.apply(gm, plans[name], self.runtime.id, event_offset=offset)
            offset += plans[name].num_events
        if any(p.records for p in plans.values()):
            peak = liveness.analyze(pair, assume_fusion=False).peak_bytes
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

    def run(
        self, forward: fx.GraphModule, backward: fx.GraphModule, num_fwd_outputs: int, static_input_indices
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Plan and rewrite one partitioned pair in place; returns it. (It runs inside the
        backend's call, which notes a failure in the report log.)"""
        opts = self.options
        graph_id = next_graph_id()
        pair = GraphPair(forward, backward, num_fwd_outputs, tuple(static_input_indices or ()))
        dumper = GraphDumper(opts.dump_dir, graph_id) if opts.dump_dir is not None else None
        if dumper:
            dumper.graphs("00_partitioned", forward, backward)
        t0 = time.perf_counter()
        fill_tuple_vals(forward)
        fill_tuple_vals(backward)
        moved = reorder.hoist_frees(forward) + reorder.hoist_frees(backward)
        reorder_seconds = time.perf_counter() - t0
        if dumper and moved:
            dumper.graphs("05_reorder", forward, backward)
        model_state = None
        if self.param_slots:
            static = set(pair.static_input_indices)
            model_state = {i: (s.id, s.host_bytes) for i, s in self.param_slots.items() if i in static}
        live, costs, budget, the_plan, seconds = plan_pair(pair, opts, model_state=model_state)
        step_nodes = list(forward.graph.nodes) + list(backward.graph.nodes)
        seconds = {"reorder": reorder_seconds, **seconds}
        if dumper:
            dumper.json("liveness.json", _liveness_json(live, costs))
        fallback = None
        if not the_plan.feasible:
            message = plan_window.describe_infeasible(
                the_plan, live, opts.memory_budget.describe(), opts.min_offload_bytes, opts.on_infeasible
            )
            if opts.on_infeasible == "error":
                if dumper:
                    dumper.text("error.txt", message)
                raise InfeasibleBudgetError(message)
            warnings.warn(message + " (on_infeasible='warn': using the lowest-peak plan)", stacklevel=2)
            fallback = "budget infeasible; running the lowest-peak plan"
        size_guards = size_guard.guard_planned_sizes(pair, live, budget)
        if budget is not None and the_plan.peak_bytes_unplanned > budget and not the_plan.evictions:
            fallback = "budget below the unplanned peak but nothing can be offloaded"
        t0 = time.perf_counter()
        if the_plan.evictions:
            insert_transfers.apply(pair, live, the_plan, self.runtime.id, fence_readers=opts.inner == "inductor")
        seconds["insert_transfers"] = time.perf_counter() - t0
        stream_plans: dict[str, assign_streams.StreamPlan] = {}
        if opts.compute_streams > 1 and model_state:
            # Not combined yet: a side stream's read of a parameter is not ordered before the
            # parameter's release (README, "Limits today").
            warnings.warn(
                f"trinity: num_streams={opts.num_streams} is ignored with offload={opts.offload!r}: parameter "
                "offload and several compute streams are not combined yet (README, 'Limits today'); the graphs "
                "run on one compute stream. Use num_streams=1 to silence this warning.",
                stacklevel=3,
            )
        elif opts.compute_streams > 1:
            t0 = time.perf_counter()
            stream_plans = self._assign_streams(pair, costs, the_plan.peak_bytes_planned)
            seconds["assign_streams"] = time.perf_counter() - t0
            if dumper and stream_plans:
                dumper.graphs("20_assign_streams", forward, backward)
                dumper.json("streams.json", {k: asdict(v) for k, v in stream_plans.items()})
        planned_peak = the_plan.peak_bytes_planned
        # Before the parameter rewrite the graphs hold every parameter throughout: that is what
        # the verifier re-measures (the budget applies to the peak with parameter residency).
        resident_peak = the_plan.peak_bytes_planned
        if model_state:
            resident_peak = int(plan_window.planned_live_bytes(model_state["liveness"], the_plan.evictions).max())
        if opts.verify:
            t0 = time.perf_counter()
            verified = verify.verify(
                pair,
                budget if the_plan.feasible and not model_state else None,
                expected_peak_bytes=resident_peak,
                assume_fusion=opts.inner == "inductor",
            )
            if not model_state:
                planned_peak = verified
            seconds["verify"] = time.perf_counter() - t0
        residency = None
        synced = None
        if model_state:
            from .passes import param_residency

            t0 = time.perf_counter()
            residency = dataclasses.replace(
                model_state["plan"], peak_bytes=the_plan.peak_bytes_planned, peak_bytes_resident_params=resident_peak
            )
            param_residency.apply(pair, residency, step_nodes, self.runtime.id)
            if opts.verify:
                errors = param_residency.check(pair, residency)
                if errors:
                    raise verify.VerificationError(
                        "trinity verification of parameter residency failed:\n  - " + "\n  - ".join(errors)
                    )
            self.residency_plans.append(residency)
            if self.grad_sync is not None:
                from .passes import grad_sync

                synced = grad_sync.apply(pair, self.grad_sync)
            # The step with the parameter copies too, issued and waited for where the graphs do.
            act_tasks = plan_window.copy_tasks(the_plan.evictions, costs)
            param_timeline = simulate.simulate(
                costs.step_seconds, act_tasks + param_residency.copy_tasks(residency, costs, len(act_tasks))
            )
            seconds["param_residency"] += time.perf_counter() - t0
            log.info("%s", residency.summary())
            if dumper:
                dumper.text("residency.json", residency.to_json())
        if dumper:
            dumper.graphs("10_insert_transfers", forward, backward)
            dumper.text("plan.json", the_plan.to_json())
            after = plan_window.planned_live_bytes(live, the_plan.evictions)
            dumper.memory_plot(live.live_bytes(), after, budget, live.num_fw_steps)
            t0 = time.perf_counter()
            timeline = simulate.simulate_pair(
                pair, costs.device, assume_fusion=opts.inner == "inductor", pinned=costs.pinned
            )
            dumper.json("timeline.json", timeline.chrome_trace())
            seconds["simulate"] = time.perf_counter() - t0
        report = TrinityReport(
            graph_id=graph_id,
            device=str(self.device),
            inner=opts.inner,
            budget_request=opts.memory_budget.describe(),
            budget_bytes=budget,
            peak_bytes_unplanned=the_plan.peak_bytes_unplanned,
            peak_bytes_planned=planned_peak,
            lowest_reachable_peak_bytes=the_plan.lowest_reachable_peak_bytes,
            evicted_bytes=the_plan.evicted_bytes,
            copy_bytes=the_plan.copy_bytes,
            num_evicted=len(the_plan.evictions),
            num_candidates=the_plan.num_candidates,
            num_saved=len(live.saved),
            predicted_step_seconds=the_plan.predicted_step_seconds,
            exposed_transfer_seconds=the_plan.exposed_transfer_seconds,
            compute_seconds=the_plan.compute_seconds,
            feasible=the_plan.feasible,
            fallback_reason=fallback,
            pass_seconds=tuple(seconds.items()),
            dump_dir=str(dumper.dir) if dumper else None,
            runtime_id=self.runtime.id,
            device_name=costs.device.name,
            size_bounds=size_guards.bounds,
            streams=tuple(
                (name, p.used_streams, p.num_events, p.seconds, p.single_stream_seconds)
                for name, p in stream_plans.items()
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
                    "predicted_step_seconds": param_timeline.step_seconds,
                    "exposed_transfer_seconds": param_timeline.exposed_seconds,
                    **(
                        {
                            "grad_sync": {
                                "id": self.grad_sync.id,
                                "world_size": self.grad_sync.world_size,
                                "num_reduced": synced.num_reduced,
                                "num_inplace": synced.num_inplace,
                            }
                        }
                        if synced is not None
                        else {}
                    ),
                }
                if residency is not None
                else None
            ),
            not_offloaded=tuple(
                (st.fw_node, st.reason)
                for st in live.saved
                if not st.evictable and not st.reason.startswith("aliases a")
            ),
        )
        if dumper:
            dumper.text("report.json", report.to_json())
        record_report(report)
        self.reports.append(report)
        log.info("%s", report.summary())
        return forward, backward


_INDUCTOR_STREAMS_WARNING = (
    "trinity: num_streams > 1 is ignored with inner='inductor' (multi-stream compute is off). "
    "Inductor (torch 2.13) places nodes on streams only from node.meta['custom']['stream'] indices into "
    "Dynamo's registry of user stream objects, with torch.ops.streams events; a backend pass cannot "
    "register new streams there, and torch 2.11 has no such support. Use inner='eager' for "
    "multi-stream compute, or num_streams=1 to silence this warning."
)


class TrinityPartitioner(CustomPartitionerFn):
    """AOTAutograd partition function: PyTorch's min-cut partitioner, then trinity's passes.

    Usable both as Inductor's ``custom_partitioner_fn`` and as ``aot_autograd(partition_fn=...)``.
    """

    def __init__(self, session: CompileSession):
        super().__init__()
        self.session = session

    def __call__(self, gm: fx.GraphModule, joint_inputs, **kwargs) -> tuple[fx.GraphModule, fx.GraphModule]:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        return self.session.run(fw, bw, kwargs["num_fwd_outputs"], kwargs.get("static_lifetime_input_indices") or ())

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
