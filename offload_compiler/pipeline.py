"""The pass pipeline: partition, analyse, plan, rewrite, verify, report, dump.

:class:`TrinityPartitioner` is the one hook that sees both the forward and the backward graph
before AOTAutograd does its saved-tensor bookkeeping (see TORCH_NOTES.md). It runs PyTorch's own
min-cut partitioner (the one Inductor and ``aot_eager`` use), then the passes, in order:

0. ``reorder``       compute nodes early where that frees memory (mutates node order only)
1. ``liveness``      buffers and live ranges over the joint schedule (analysis)
2. ``cost_model``    seconds per node and per transfer (analysis)
3. ``plan_window``   which saved activations to evict and where the copies go (pure function)
4. ``insert_transfers``  the ``trinity::*`` nodes (mutates the graphs)
5. ``verify``        invariants and the re-measured peak (when ``verify`` is on)

Each pass is timed; with ``dump_dir`` the graphs are written before and after the rewrite.
"""

from __future__ import annotations

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
from .graph_pair import GraphPair
from .options import MemoryBudget, TrinityOptions
from .passes import cost_model, insert_transfers, liveness, plan_window, reorder, simulate, verify
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
    pair: GraphPair, options: TrinityOptions, spec: DeviceSpec | None = None
) -> tuple[liveness.Liveness, cost_model.Costs, int | None, plan_window.Plan, dict[str, float]]:
    """Run the analyses and the planner on ``pair`` without changing it.

    Returns ``(liveness, costs, budget_bytes, plan, pass_seconds)``.
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

    def run(
        self, forward: fx.GraphModule, backward: fx.GraphModule, num_fwd_outputs: int, static_input_indices
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Plan and rewrite one partitioned pair in place; returns it."""
        opts = self.options
        graph_id = next_graph_id()
        pair = GraphPair(forward, backward, num_fwd_outputs, tuple(static_input_indices or ()))
        dumper = GraphDumper(opts.dump_dir, graph_id) if opts.dump_dir is not None else None
        if dumper:
            dumper.graphs("00_partitioned", forward, backward)
        t0 = time.perf_counter()
        moved = reorder.hoist_frees(forward) + reorder.hoist_frees(backward)
        reorder_seconds = time.perf_counter() - t0
        if dumper and moved:
            dumper.graphs("05_reorder", forward, backward)
        live, costs, budget, the_plan, seconds = plan_pair(pair, opts)
        seconds = {"reorder": reorder_seconds, **seconds}
        if dumper:
            dumper.json("liveness.json", _liveness_json(live, costs))
        fallback = None
        if not the_plan.feasible:
            message = plan_window.describe_infeasible(
                the_plan, live, opts.memory_budget.describe(), opts.min_offload_bytes
            )
            if opts.on_infeasible == "error":
                if dumper:
                    dumper.text("error.txt", message)
                raise InfeasibleBudgetError(message)
            warnings.warn(message + " (on_infeasible='warn': using the lowest-peak plan)", stacklevel=2)
            fallback = "budget infeasible; running the lowest-peak plan"
        if budget is not None and the_plan.peak_bytes_unplanned > budget and not the_plan.evictions:
            fallback = "budget below the unplanned peak but nothing can be offloaded"
        t0 = time.perf_counter()
        if the_plan.evictions:
            insert_transfers.apply(pair, live, the_plan, self.runtime.id, fence_readers=opts.inner == "inductor")
        seconds["insert_transfers"] = time.perf_counter() - t0
        planned_peak = the_plan.peak_bytes_planned
        if opts.verify:
            t0 = time.perf_counter()
            planned_peak = verify.verify(
                pair,
                budget if the_plan.feasible else None,
                expected_peak_bytes=the_plan.peak_bytes_planned,
                assume_fusion=opts.inner == "inductor",
            )
            seconds["verify"] = time.perf_counter() - t0
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
