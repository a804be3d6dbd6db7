"""Per-graph-pair reports: what the planner decided and what it predicts.

:func:`last_report` returns the report of the most recently compiled forward/backward pair,
:func:`reports` all of this process's, oldest first. The log is append-only and thread-safe.
"""

from __future__ import annotations

import json
import threading
from dataclasses import asdict, dataclass

from .options import format_bytes
from .runtime.transfer import TransferStats, _registry

__all__ = ["TrinityReport", "last_report", "reports", "record_report", "next_graph_id"]


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
        lowest_reachable_peak_bytes: the lowest peak any plan reaches.
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
        size_bounds: with dynamic shapes and a budget, ``(size symbol, largest size)`` pairs the
            plan is guarded to (a larger size recompiles and plans again); empty otherwise.
        param_offload: with ``offload`` other than ``"activations"``: the mode, parameters
            offloaded, host bytes, the predicted peak with parameter residency (``peak_bytes``, the
            same as ``peak_bytes_planned``) and with parameters resident throughout
            (``peak_bytes_resident_params``), the working window (``max_window_steps`` nodes,
            ``window_seconds``), and the simulated step with the parameter copies as well as the
            activation copies, each issued and waited for where the graphs do
            (``predicted_step_seconds``, ``exposed_transfer_seconds``; the top-level figures
            count the activation copies only); under DDP with ``"all"`` also ``grad_sync``: the
            :class:`~offload_compiler.runtime.grad_sync.GradSync` id, ``world_size``, and how many
            gradients are all-reduced (``num_reduced``), of them in place (``num_inplace``); else
            ``None``.
        not_offloaded: saved activations kept on the device because trinity cannot move them
            (``(forward node, reason)``: a tensor subclass, a collective's buffer, ...).
        streams: with ``num_streams`` > 1 and ``inner="eager"``: per graph, ``(graph, streams
            used, events, simulated seconds, simulated seconds on one stream)`` of the applied
            stream plan (``passes/assign_streams.py``); empty when the pass did not run or was undone.
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

    def runtime_stats(self) -> TransferStats | None:
        """Live counters of this pair's transfer runtime (host pool included), or ``None`` once
        the compiled code is gone."""
        runtime = _registry.get(self.runtime_id)
        return runtime.stats() if runtime is not None else None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    def summary(self) -> str:
        """A few human-readable lines."""
        lines = [
            f"trinity graph {self.graph_id} on {self.device} (inner={self.inner}, figures: {self.device_name})",
            f"  budget     {self.budget_request} -> {format_bytes(self.budget_bytes)}",
            f"  peak       {format_bytes(self.peak_bytes_unplanned)} unplanned -> "
            f"{format_bytes(self.peak_bytes_planned)} planned (lowest reachable "
            f"{format_bytes(self.lowest_reachable_peak_bytes)})",
            f"  evicted    {self.num_evicted} of {self.num_candidates} candidate buffers "
            f"({self.num_saved} saved tensors), {format_bytes(self.evicted_bytes)}; "
            f"{format_bytes(self.copy_bytes)} copied each way",
            f"  predicted  {self.predicted_step_seconds * 1e3:.3f} ms per step, "
            f"{self.exposed_transfer_seconds * 1e3:.3f} ms of it exposed copies "
            f"(compute {self.compute_seconds * 1e3:.3f} ms"
            + ("; one compute stream, see streams below)" if self.streams else ")"),
        ]
        if self.compute_seconds > 0 and self.exposed_transfer_seconds > 0.05 * self.compute_seconds:
            lines.append(
                f"  note       the budget is met only with {self.exposed_transfer_seconds * 1e3:.3f} ms of copies "
                f"not hidden under compute ({100 * self.exposed_transfer_seconds / self.compute_seconds:.0f}% of "
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
                )
            if "grad_sync" in po:
                gs = po["grad_sync"]
                lines.append(
                    f"  ddp        gradients of {gs['num_reduced']} parameters averaged over {gs['world_size']} ranks "
                    f"(all-reduce on the device before the copy to host, {gs['num_inplace']} in place)"
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
