"""Run methods on a model: the same initial weights, the same batches, the same optimizer.

:func:`run_model` builds the model once under a fixed seed, makes the batches once, then for each
method deep-copies the initial model, lets the method prepare it, trains ``steps`` steps (AdamW),
and measures one more forward and backward's peak device bytes. Every result is a dict in the
results schema (:func:`run_method`'s docstring), written to
``bench/results/runs/<device type>/<model>/<method>.json`` as soon as it is known.

Timing: step time is the wall time of forward, backward, optimizer step and ``zero_grad`` (CUDA
synchronised before and after); the median is over the steps after ``warmup``. Compile time is the
first step's wall time less that median. Inductor's FX-graph and AOTAutograd caches are off during
a run, so every compile traces, partitions (trinity plans) and generates code; its on-disk kernel
build cache is left as found.
"""

from __future__ import annotations

import gc
import math
import os
import re
import statistics
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

import offload_compiler

from . import common
from .memory import measure_peak
from .methods import Method, fresh_copy, get_method
from .models import ModelSpec

__all__ = ["RunConfig", "run_method", "run_model", "PEAK_COUNTS", "slug"]

PEAK_COUNTS = (
    "one forward and backward after training: parameters, buffers and the batch, plus everything the step "
    "allocates on the device (activations, temporaries, gradients); host copies (trinity's pool, save_on_cpu's "
    "copies) not counted; the optimizer's state and step left out (the same for every method)"
)

Progress = Callable[[int, str], None]


@dataclass(frozen=True)
class RunConfig:
    """How every method is run.

    Attributes:
        steps: training steps; the loss reported is the ``steps``-th step's.
        warmup: first steps left out of the step-time median (the first one compiles).
        lr: AdamW's learning rate (weight decay 0).
        seed: seeds the initial weights and the batches.
        device: ``"cpu"`` or ``"cuda"``.
        size: the model size preset (``bench.models.SIZES``).
    """

    steps: int = 8
    warmup: int = 2
    lr: float = 1e-3
    seed: int = 0
    device: str = "cpu"
    size: str = "cpu"

    def __post_init__(self):
        if self.steps < self.warmup + 1 or self.warmup < 1:
            raise ValueError(f"RunConfig: need warmup >= 1 and steps > warmup, got {self.steps=} {self.warmup=}")


def slug(key: str) -> str:
    """A file name for a method key (``trinity-50%`` -> ``trinity-50pct``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key.replace("%", "pct"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(prepared, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, device: torch.device):
    """One timed training step of a prepared method: forward and backward inside its context,
    ``opt.step()``, ``opt.zero_grad(set_to_none=True)``; synchronized on CUDA. Returns
    ``(seconds, loss)``."""
    _sync(device)
    t0 = time.perf_counter()
    with prepared.context():
        loss = prepared.fn(x, y)
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync(device)
    return time.perf_counter() - t0, loss


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if torch.is_tensor(t))


def _trinity_fields(new_reports, peak_bytes: int | None) -> dict:
    if not new_reports:
        return {"num_graphs": 0, "problem": "trinity compiled no graph"}
    budgets = [r.budget_bytes for r in new_reports]
    budget = sum(budgets) if all(b is not None for b in budgets) else None
    fields = {
        "num_graphs": len(new_reports),
        "budget_request": new_reports[0].budget_request,
        "budget_bytes": budget,
        "unplanned_peak_bytes": sum(r.peak_bytes_unplanned for r in new_reports),
        "planned_peak_bytes": sum(r.peak_bytes_planned for r in new_reports),
        "lowest_reachable_peak_bytes": sum(r.lowest_reachable_peak_bytes for r in new_reports),
        "evicted_bytes": sum(r.evicted_bytes for r in new_reports),
        "num_evicted": sum(r.num_evicted for r in new_reports),
        "num_candidates": sum(r.num_candidates for r in new_reports),
        "feasible": all(r.feasible for r in new_reports),
        "fallback_reason": next((r.fallback_reason for r in new_reports if r.fallback_reason), None),
        "predicted_step_seconds": sum(r.predicted_step_seconds for r in new_reports),
        "exposed_transfer_seconds": sum(r.exposed_transfer_seconds for r in new_reports),
        "device_figures": new_reports[0].device_name,
    }
    # One graph: the measured peak is that graph's. Several (graph breaks): their budgets add up
    # to an upper bound of what may be live at once, so the check is a necessary condition only.
    fields["within_budget"] = None if budget is None or peak_bytes is None else peak_bytes <= budget
    return fields


def _ratio(a, b):
    if a is None or b is None or not b:
        return None
    return a / b


def _compare(row: dict, other: dict | None) -> dict | None:
    if other is None or not other.get("ok") or not row.get("ok"):
        return None
    la, lb = row["final_loss"], other["final_loss"]
    return {
        "key": other["method"]["key"],
        "peak": _ratio(row["peak_bytes"], other["peak_bytes"]),
        "step": _ratio(row["median_step_seconds"], other["median_step_seconds"]),
        "loss_rel_diff": abs(la - lb) / max(abs(lb), 1e-12),
    }


def _numerics_problem(losses: list[float], reference: list[float], method: Method) -> str | None:
    """trinity promises its inner compiler's numerics: with ``inner="eager"`` losses bit-identical
    to ``aot_eager``'s at every step; with Inductor the first step's loss (same weights, before any
    update) within 1e-5 relative. Later Inductor steps may drift further: trinity's Inductor
    settings change fusion, so rounding differs and AdamW amplifies it (as selective recompute's
    does); only a gross difference (over 1e-2) is flagged there."""
    rel = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference)]
    if not rel:
        return None
    if method.inner == "eager" and max(rel) > 0:
        return f"losses differ from aot_eager (up to {max(rel):.1e} relative; expected bit-identical)"
    if rel[0] > 1e-5:
        return f"first-step loss differs from {method.reference} by {rel[0]:.1e} relative (> 1e-5)"
    if max(rel) > 1e-2:
        return f"losses differ from {method.reference} by up to {max(rel):.1e} relative"
    return None


def run_method(
    spec: ModelSpec,
    method: Method,
    base: torch.nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    config: RunConfig,
    progress: Progress | None = None,
) -> dict:
    """Train a copy of ``base`` with ``method``; the result dict (``ok`` False and ``error`` set if
    the method raised). Keys: ``model``, ``method``, ``config``, ``ok``, ``error``, ``peak_bytes``,
    ``peak_counts``, ``peak_accounting``, ``median_step_seconds``, ``step_seconds`` (every step),
    ``first_step_seconds``, ``compile_seconds`` (compiled methods; else ``None``), ``losses``,
    ``final_loss``, ``host_bytes`` (host copies seen while measuring), ``other_cpu_load`` (the
    share of the machine's CPU other processes used during the timed steps, 0..1), ``trinity`` (trinity only:
    budget, planned peak, within_budget, ...), ``warnings``."""
    device = torch.device(config.device)
    progress = progress or (lambda n, text: None)
    row: dict = {
        "model": {
            "name": spec.name,
            "description": spec.description,
            "source": spec.source,
            "num_params": sum(p.numel() for p in base.parameters()),
        },
        "method": {k: v for k, v in asdict(method).items() if k != "prepare"},
        "config": asdict(config),
        "optimizer": f"AdamW(lr={config.lr:g}, weight_decay=0)",
        "ok": False,
        "error": None,
        "peak_counts": PEAK_COUNTS,
    }
    before = len(offload_compiler.reports())
    times: list[float] = []
    losses: list[float] = []
    done = 0
    torch._dynamo.reset()
    model = prepared = opt = None
    caught: list = []
    try:
        with (
            warnings.catch_warnings(record=True) as recorded,
            torch._inductor.config.patch(fx_graph_cache=False),
            torch._functorch.config.patch(enable_autograd_cache=False),
        ):
            caught = recorded
            warnings.simplefilter("always")
            model = fresh_copy(base).to(device)
            prepared = method.prepare(model, device)
            opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
            load = common.OtherLoad()
            for i in range(config.steps):
                if i == config.warmup:
                    load.__enter__()
                x, y = batches[i]
                seconds, loss = train_step(prepared, opt, x, y, device)
                times.append(seconds)
                losses.append(float(loss.detach()))
                done += 1
                progress(1, f"{spec.name}: {method.key} step {i + 1}/{config.steps} loss {losses[-1]:.4f}")
            load.__exit__(None, None, None)
            x, y = batches[config.steps]

            def fwd_bwd(p=prepared, x=x, y=y):
                with p.context():
                    loss = p.fn(x, y)
                    loss.backward()
                return loss

            resident = list(model.parameters()) + list(model.buffers()) + [x, y]
            state = _state_bytes(opt)
            m = measure_peak(fwd_bwd, resident=resident, device=device, host_copies=prepared.host_copies)
            opt.zero_grad(set_to_none=True)
            done += 1
            progress(1, f"{spec.name}: {method.key} measured")
        peak = m.peak_bytes - (state if device.type == "cuda" else 0)
        median = statistics.median(times[config.warmup :])
        row.update(
            ok=True,
            peak_bytes=int(peak),
            peak_accounting=m.method,
            host_bytes=m.host_pool_bytes,
            optimizer_state_bytes=state,
            median_step_seconds=median,
            step_seconds=times,
            first_step_seconds=times[0],
            compile_seconds=(times[0] - median) if method.compiled else None,
            losses=losses,
            final_loss=losses[-1],
            other_cpu_load=load.fraction,
        )
        if not all(math.isfinite(v) for v in losses):
            row["problem"] = "non-finite loss"
    except Exception as exc:  # recorded in the results, never hidden
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["traceback"] = traceback.format_exc(limit=8)[-4000:]
        row["losses"] = losses
        row["step_seconds"] = times
        progress(config.steps + 1 - done, f"{spec.name}: {method.key} FAILED")
    if method.family.startswith("trinity"):
        t = row["trinity"] = _trinity_fields(offload_compiler.reports()[before:], row.get("peak_bytes"))
        if row["ok"] and t["num_graphs"] == 0:
            row["problem"] = "trinity compiled no graph"
        elif row["ok"] and t.get("feasible") and t.get("within_budget") is False:
            row["problem"] = "measured peak over trinity's budget though its plan was feasible"
    seen, messages = set(), []
    for w in caught:
        text = f"{w.category.__name__}: {str(w.message)[:400]}"
        if text not in seen:
            seen.add(text)
            messages.append(text)
    row["warnings"] = messages[:8]
    del model, prepared, opt
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def run_model(
    spec: ModelSpec,
    method_keys: list[str],
    config: RunConfig,
    progress: Progress | None = None,
    write: bool = True,
    session: dict | None = None,
    on_result: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Run every method in ``method_keys`` on ``spec`` (in that order; ``eager`` first when listed,
    so the ratios to it are known as each later run finishes). Writes one JSON per run when
    ``write`` (old results of this model on this device type are removed first); ``on_result`` is
    called with each result as it is known."""
    device = torch.device(config.device)
    torch.manual_seed(config.seed)
    base = spec.build()
    batches = [(x.to(device), y.to(device)) for x, y in spec.make_batches(config.steps + 1, config.seed)]
    methods = [get_method(k, spec.block_containers) for k in method_keys]
    folder = f"runs/{device.type}/{spec.name}"
    if write:
        target = common.RESULTS / folder
        if target.is_dir():
            for old in target.glob("*.json"):
                old.unlink()
    rows: dict[str, dict] = {}
    out = []
    for method in methods:
        row = run_method(spec, method, base, batches, config, progress)
        row["session"] = session or {}
        row["vs_eager"] = _compare(row, rows.get("eager")) if method.key != "eager" else None
        row["vs_reference"] = _compare(row, rows.get(method.reference)) if method.reference else None
        ref = row["vs_reference"]
        if ref and method.inner is not None:
            row_problem = _numerics_problem(row["losses"], rows[method.reference]["losses"], method)
            ref["worst_step_loss_rel_diff"] = max(
                abs(a - b) / max(abs(b), 1e-12) for a, b in zip(row["losses"], rows[method.reference]["losses"])
            )
            if row_problem:
                row["problem"] = row_problem
        rows[method.key] = row
        out.append(row)
        if write:
            common.write_result(f"{folder}/{slug(method.key)}", row, device)
        if on_result is not None:
            on_result(row)
    return out


def session_info(total_methods: int) -> dict:
    """Identifies one suite invocation (ratios are only ever taken within one)."""
    return {"id": f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}", "runs": total_methods}
