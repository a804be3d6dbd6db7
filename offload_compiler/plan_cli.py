"""``python -m offload_compiler plan``: will this model's training step fit, and how fast?

Traces the training step on fake tensors (nothing real is allocated: a 7B model plans on a
laptop), runs the same passes as the backend (reorder, liveness, cost model, planner) for each
budget against a device's figures, and prints a table: parameters, the peak without offloading,
the planned peak, the predicted step time and the copy time left exposed. Optimizer state
(``adamw``: two tensors per parameter; ``sgd``: one momentum tensor; ``none``) is resident device
memory and counts in every peak, except with ``--offload all``. ``--offload`` plans model-state
offloading as the backend's option does: with ``activations+params`` or ``all`` the parameters
are fetched around their uses (:mod:`.passes.param_residency`), with ``all`` gradients and
optimizer state live in host memory; the host bytes are reported and the parameter copies are
part of the simulated step. With ``all`` the host optimizer update is part of it too (the same
:func:`~.passes.param_residency.step_timeline` and :mod:`.passes.optimizer_split` as the backend:
``--cpu-optimizer``, ``--overlap`` and ``--optimizer-on-device`` as ``CPUOptimizer`` and the
option say; ``--host-bandwidth`` states the host's memory bandwidth), and the host-update seconds
per step are printed. ``--strategy`` chooses how saved activations meet a budget, as the backend's
option does: ``auto`` (keep, offload or recompute, the joint planner of
:mod:`.passes.plan_recompute`), ``offload`` or ``recompute``; the ``recompute`` column shows what is
recomputed in the backward and its predicted seconds. It draws the memory/time frontier over the
budgets as a PNG and names the smallest budget whose predicted step is within 5% of the step
without offloading.

This is the "impossible trinity" made explicit: a larger model, a faster step or a cheaper GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .devices import KNOWN_DEVICES, DeviceSpec, lookup_device
from .graph_pair import fill_tuple_vals
from .options import MemoryBudget, format_bytes, parse_size
from .passes import cost_model, liveness, optimizer_split, param_residency, plan_recompute, plan_window, reorder
from .passes.simulate import simulate

__all__ = ["PlanRow", "plan_model", "main"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}


@dataclass(frozen=True)
class PlanRow:
    """One budget's plan (bytes include the optimizer state; seconds are predictions)."""

    budget: str
    budget_bytes: int
    planned_peak_bytes: int
    lowest_reachable_bytes: int
    feasible: bool
    predicted_step_seconds: float
    exposed_seconds: float
    evicted_bytes: int
    num_evicted: int
    fits_device: bool
    update_seconds: float = 0.0
    exposed_update_seconds: float = 0.0
    device_share: float = 0.0
    recomputed_bytes: int = 0
    num_recomputed: int = 0
    recompute_seconds: float = 0.0
    recompute_flops: int = 0
    chosen: str = ""


@dataclass(frozen=True)
class PlanResult:
    model: str
    device: DeviceSpec
    num_params: int
    param_bytes: int
    optimizer_state_bytes: int
    unplanned_peak_bytes: int
    compute_seconds: float
    rows: tuple[PlanRow, ...]
    trace_seconds: float
    plan_seconds: float
    offload: str = "activations"
    host_model_state_bytes: int = 0
    strategy: str = "offload"
    update: str = ""

    def within_5_percent(self) -> PlanRow | None:
        """The feasible row with the smallest budget whose step is within 5% of no offloading."""
        ok = [r for r in self.rows if r.feasible and r.predicted_step_seconds <= 1.05 * self.compute_seconds]
        return min(ok, key=lambda r: r.budget_bytes) if ok else None


def _build(model, seq_len: int, hf_overrides: dict):
    from .models.presets import Preset, get_preset

    if isinstance(model, Preset):
        preset = model
    elif model.startswith("hf:"):
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError:
            raise ValueError(f"model {model!r} needs the transformers package (pip install transformers)") from None
        model_type = model[3:]
        try:
            config = AutoConfig.for_model(model_type, **hf_overrides)
        except (ValueError, KeyError) as exc:
            raise ValueError(f"model {model!r}: transformers has no model type {model_type!r} ({exc})") from None

        class _Logits(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = AutoModelForCausalLM.from_config(config)

            def forward(self, idx):
                # transformers skips its data-dependent mask checks only while torch compiles;
                # this trace is symbolic too, so say so while it runs.
                from unittest import mock

                with mock.patch("torch.compiler.is_compiling", lambda: True):
                    return self.inner(input_ids=idx, use_cache=False).logits

        return (lambda: _Logits()), config.vocab_size
    else:
        preset = get_preset(model)
    if preset.max_seq_len is not None and seq_len > preset.max_seq_len:
        raise ValueError(f"model {model!r} takes sequences up to {preset.max_seq_len}, got --seq-len {seq_len}")
    return (lambda: preset.build(seq_len)), preset.vocab_size


def plan_model(
    model,
    device: DeviceSpec,
    budgets: list[str],
    batch: int = 1,
    seq_len: int = 1024,
    dtype: torch.dtype = torch.bfloat16,
    optimizer: str = "adamw",
    min_offload_bytes: int = 1 << 20,
    hf_overrides: dict | None = None,
    offload: str = "activations",
    cpu_optimizer: str = "exact",
    overlap: str = "forward",
    optimizer_on_device: float | str = 0.0,
    strategy: str = "auto",
    traced=None,
) -> PlanResult:
    """Plan ``model``'s training step for each budget on ``device`` (see the module docstring).

    ``model`` is a preset's name, ``hf:<model_type>``, or a :class:`~.models.presets.Preset`
    (a model built by the caller, e.g. one pipeline stage or one tensor-parallel shard of a
    preset: ``plan --world`` plans those). Budgets are sizes (``"24GiB"``), percentages of the
    peak without offloading (``"50%"``) or ``"device"`` (the device's memory). With
    ``offload="all"`` the optimizer update of ``optimizer`` is simulated as
    ``CPUOptimizer(implementation=cpu_optimizer, overlap=overlap)`` runs it on ``device``'s host
    figures, with the ``optimizer_on_device`` share on the device.
    ``strategy``: ``"auto"``, ``"offload"`` or ``"recompute"`` (see the module docstring); with
    parameter offload saved activations are kept or offloaded. ``traced``: a
    :class:`~.trace.TracedStep` of this model to plan instead of tracing it again (its graphs are
    reordered in place, as the backend does, once).

    Raises:
        ValueError: for an unknown model, optimizer, strategy or a malformed budget, naming it;
            for ``strategy="recompute"`` with parameter offload.
    """
    from .trace import trace_training_step

    if optimizer not in _OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; one of {', '.join(_OPTIMIZER_STATES)}")
    if offload not in ("activations",) + param_residency.MODES:
        raise ValueError(f"unknown offload {offload!r}; one of activations, {', '.join(param_residency.MODES)}")
    if not budgets:
        raise ValueError("--budgets: no budget given; e.g. '100%,50%,24GiB,device'")
    if strategy not in plan_recompute.STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(plan_recompute.STRATEGIES)}")
    if strategy == "recompute" and offload != "activations":
        raise ValueError(f"--strategy recompute is not combined with --offload {offload} yet")
    if cpu_optimizer not in ("exact", "fastest"):
        raise ValueError(f"cpu_optimizer {cpu_optimizer!r}: expected 'exact' or 'fastest'")
    parsed = []
    for b in budgets:
        if b == "device":
            parsed.append((b, MemoryBudget("bytes", float(device.memory_bytes))))
        else:
            try:
                mb = MemoryBudget.parse(b, key="--budgets")
            except ValueError:
                mb = None
            if mb is None or mb.kind not in ("bytes", "fraction"):
                raise ValueError(f"--budgets: {b!r} is not a size ('24GiB'), a percentage ('50%') or 'device'")
            parsed.append((b, mb))
    t0 = time.perf_counter()
    if traced is None:
        build, vocab = _build(model, seq_len, hf_overrides or {})
        traced = trace_training_step(build, batch, seq_len, vocab, dtype)
    trace_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    pair = traced.pair
    if not traced.prepared:
        fill_tuple_vals(pair.forward)
        fill_tuple_vals(pair.backward)
        reorder.hoist_frees(pair.forward)
        reorder.hoist_frees(pair.backward)
        traced.prepared = True
    live = liveness.analyze(pair, assume_fusion=True)
    costs = cost_model.estimate(pair, live, device)
    full_state = _OPTIMIZER_STATES[optimizer] * traced.param_bytes
    state = 0 if offload == "all" else full_state
    unplanned = live.peak_bytes + full_state
    host = 0
    chosen: dict[int, tuple[int, int]] = {}
    if offload != "activations":
        chosen = {i: (0, 0) for i in pair.static_input_indices}
        host = traced.param_bytes * (2 if offload == "all" else 1) + (full_state if offload == "all" else 0)

    update = cost_model.host_update_model(
        device, optimizer, implementation="fused" if cpu_optimizer == "fastest" else "loop", overlap=overlap
    )

    def plan_at(graph_budget, share=optimizer_on_device):
        """The activation plan (on the residency view with parameter offload), its predicted
        step and exposed copy seconds, with ``"all"`` the step's timeline and split, and the
        joint planner's choice (``None`` with parameter offload)."""
        if not chosen:
            joint = plan_recompute.plan_joint(
                pair, live, costs, graph_budget, strategy, min_offload_bytes, rng_replay=False, assume_fusion=True
            )
            p = joint.plan
            return p, p.predicted_step_seconds, p.exposed_transfer_seconds, None, joint.recompute
        if offload == "all":
            split, res, _view, p = optimizer_split.plan(
                pair, live, costs, chosen, graph_budget, min_offload_bytes, update, share
            )
            tasks = plan_window.copy_tasks(p.evictions, costs)
            timeline = param_residency.step_timeline(res, costs, tasks, update, split.device_param_bytes)
            return p, timeline.step_seconds, timeline.exposed_seconds, (timeline, split), None
        for use_windows in (True, False):
            res = param_residency.plan(
                pair, live, costs, chosen, offload, live.live_bytes(), graph_budget, use_windows=use_windows
            )
            p = plan_window.plan(param_residency.activation_view(live, res), costs, graph_budget, min_offload_bytes)
            if p.feasible or not res.max_window_steps:
                break
        tasks = plan_window.copy_tasks(p.evictions, costs)
        timeline = simulate(costs.step_seconds, tasks + param_residency.copy_tasks(res, costs, len(tasks)))
        return p, timeline.step_seconds, timeline.exposed_seconds, None

    # The lowest peak any plan reaches: every candidate evicted as tightly as possible.
    lowest = plan_at(0, 0.0)[0].lowest_reachable_peak_bytes + state
    rows = []
    for text, budget in parsed:
        total = int(budget.value * unplanned) if budget.kind == "fraction" else int(budget.value)
        graph_budget = total - state
        if total < lowest:
            rows.append(PlanRow(text, total, lowest, lowest, False, float("nan"), float("nan"), 0, 0, False))
            continue
        p, step_s, exposed_s, extra, rp = plan_at(graph_budget)
        timeline, split = extra if extra is not None else (None, None)
        peak = p.peak_bytes_planned + state + (split.device_state_bytes if split is not None else 0)
        rows.append(
            PlanRow(
                budget=text,
                budget_bytes=total,
                planned_peak_bytes=peak,
                lowest_reachable_bytes=lowest,
                feasible=p.feasible,
                predicted_step_seconds=step_s,
                exposed_seconds=exposed_s,
                evicted_bytes=p.evicted_bytes,
                num_evicted=len(p.evictions),
                fits_device=peak <= device.memory_bytes,
                update_seconds=timeline.update_seconds if timeline is not None else 0.0,
                exposed_update_seconds=timeline.exposed_update_seconds if timeline is not None else 0.0,
                device_share=split.share if split is not None else 0.0,
                recomputed_bytes=rp.recomputed_bytes if rp else 0,
                num_recomputed=len(rp.recomputes) if rp else 0,
                recompute_seconds=rp.recompute_seconds if rp else 0.0,
                recompute_flops=rp.recompute_flops if rp else 0,
                chosen=rp.chosen if rp else "offload only",
            )
        )
    return PlanResult(
        model=getattr(model, "name", model),
        device=device,
        num_params=traced.num_params,
        param_bytes=traced.param_bytes,
        optimizer_state_bytes=full_state,
        unplanned_peak_bytes=unplanned,
        compute_seconds=costs.compute_seconds,
        rows=tuple(rows),
        trace_seconds=trace_seconds,
        plan_seconds=time.perf_counter() - t0,
        offload=offload,
        host_model_state_bytes=host,
        update=update.description if offload == "all" else "",
        strategy=strategy if not chosen else "offload",
    )


def frontier_png(result: PlanResult, path: Path) -> Path:
    """Planned peak against predicted step time, one point per budget (PNG)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    gib = 2**30
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    pts = [r for r in result.rows if r.predicted_step_seconds == r.predicted_step_seconds]
    ax.plot(
        [r.predicted_step_seconds * 1e3 for r in pts], [r.planned_peak_bytes / gib for r in pts], "o-", color="#1f77b4"
    )
    for r in pts:
        label = r.budget + ("" if r.feasible else " (infeasible)")
        ax.annotate(
            label,
            (r.predicted_step_seconds * 1e3, r.planned_peak_bytes / gib),
            fontsize=7,
            xytext=(4, 4),
            textcoords="offset points",
        )
    ax.axhline(result.device.memory_bytes / gib, color="#d62728", linestyle="--", label=f"{result.device.name} memory")
    ax.axvline(result.compute_seconds * 1e3, color="#999999", linestyle=":", label="step without offloading")
    ax.set_xlabel("predicted step time (ms)")
    ax.set_ylabel("planned peak device memory (GiB)")
    ax.set_title(f"{result.model}: memory/time frontier")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _count(n: int) -> str:
    """A parameter count for people: 6.74B, 124M, 957K, 512."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--world" or a.startswith("--world=") for a in argv):
        from .world_plan import main as world_main  # plan --world N: layouts for N GPUs

        return world_main(argv)
    parser = argparse.ArgumentParser(
        prog="python -m offload_compiler plan",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default="gpt2-small",
        help="a preset (demo, gpt2-small/medium/large/xl, llama-1b, llama-7b, llama3-8b, llama-13b) or hf:<model_type>",
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 or float16")
    parser.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd (momentum) or none")
    parser.add_argument(
        "--device", default="a100-80gb", help="a device from the table: " + ", ".join(sorted(KNOWN_DEVICES))
    )
    parser.add_argument("--device-memory", default=None, help="override the device's memory, e.g. 24GiB")
    parser.add_argument(
        "--budgets",
        default="100%,90%,75%,60%,50%,40%,30%,25%,device",
        help="comma-separated sizes, percentages or 'device'",
    )
    parser.add_argument("--min-offload-bytes", default="1MiB")
    parser.add_argument(
        "--offload",
        default="activations",
        help="activations, activations+params or all (parameters, gradients, optimizer state on the host)",
    )
    parser.add_argument(
        "--host-bandwidth",
        default=None,
        help="the host's sustained memory bandwidth in bytes/s (e.g. 60e9; default the device table's host)",
    )
    parser.add_argument(
        "--cpu-optimizer", default="exact", help="with --offload all: CPUOptimizer's implementation, exact or fastest"
    )
    parser.add_argument("--overlap", default="forward", help="with --offload all: CPUOptimizer's overlap")
    parser.add_argument(
        "--optimizer-on-device", default="0", help="with --offload all: share on the device, 0.0..1.0 or auto"
    )
    parser.add_argument(
        "--strategy",
        default="auto",
        choices=plan_recompute.STRATEGIES,
        help="how saved activations meet a budget: auto (keep, offload or recompute), offload or recompute",
    )
    parser.add_argument("--png", default="plan_frontier.png", help="where to draw the frontier ('' for none)")
    parser.add_argument(
        "--hf", action="append", default=[], metavar="KEY=VALUE", help="config override for hf: models (repeatable)"
    )
    parser.add_argument(
        "--world", type=int, default=None, help="plan a layout for N GPUs instead (see: plan --world N --help)"
    )
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(160, Console().width))
    try:
        if args.dtype not in _DTYPES:
            raise ValueError(f"--dtype {args.dtype!r} is not one of {', '.join(_DTYPES)}")
        spec = lookup_device(args.device)
        if args.device_memory:
            from dataclasses import replace

            spec = replace(spec, memory_bytes=parse_size("--device-memory", args.device_memory))
        if args.host_bandwidth:
            from dataclasses import replace

            try:
                bandwidth = float(args.host_bandwidth)
            except ValueError:
                bandwidth = -1.0
            if not bandwidth > 0:
                raise ValueError(f"--host-bandwidth {args.host_bandwidth!r} is not a positive number of bytes/s")
            spec = replace(
                spec,
                host_bytes_per_s=bandwidth,
                host_update_seconds_per_param=0.0,
                host_update_loop_seconds_per_param=0.0,
            )
        if args.cpu_optimizer not in ("exact", "fastest"):
            raise ValueError(f"--cpu-optimizer {args.cpu_optimizer!r} is not exact or fastest")
        if args.overlap not in ("forward", "backward"):
            raise ValueError(f"--overlap {args.overlap!r} is not forward or backward")
        from .options import TrinityOptions

        share = TrinityOptions.from_user(
            {"offload": "all", "inner": "eager", "optimizer_on_device": args.optimizer_on_device}, env={}
        ).optimizer_on_device
        overrides = {}
        for item in args.hf:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--hf {item!r}: expected KEY=VALUE")
            overrides[key] = int(value) if value.isdigit() else value
        result = plan_model(
            args.model,
            spec,
            [b.strip() for b in args.budgets.split(",") if b.strip()],
            args.batch,
            args.seq_len,
            _DTYPES[args.dtype],
            args.optimizer,
            parse_size("--min-offload-bytes", args.min_offload_bytes),
            overrides,
            args.offload,
            args.cpu_optimizer,
            args.overlap,
            share,
            strategy=args.strategy,
        )
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2
    console.print(
        f"[bold]{result.model}[/bold]: {_count(result.num_params)} parameters ({format_bytes(result.param_bytes)}), "
        f"batch {args.batch} x {args.seq_len} tokens, {args.dtype}, optimizer {args.optimizer} "
        f"({format_bytes(result.optimizer_state_bytes)} of state"
        + (", on the host" if result.offload == "all" else "")
        + f") on {spec.name} "
        f"({format_bytes(spec.memory_bytes)}, {spec.h2d_bytes_per_s / 1e9:.0f} GB/s host link)"
    )
    console.print(
        f"peak without offloading {format_bytes(result.unplanned_peak_bytes)}; step without offloading "
        f"{result.compute_seconds * 1e3:.1f} ms (predicted); traced in {result.trace_seconds:.1f} s, planned "
        f"{len(result.rows)} budgets in {result.plan_seconds:.1f} s (strategy {result.strategy})"
    )
    if result.offload != "activations":
        console.print(
            f"offload={result.offload}: model state in host memory {format_bytes(result.host_model_state_bytes)} "
            "(parameter master copies" + (", gradients, optimizer state" if result.offload == "all" else "") + ")"
        )
    if result.offload == "all":
        console.print(f"host optimizer update: {result.update}")
    table = Table()
    cols = ["budget", "budget bytes", "planned peak", "fits device", "step (pred.)", "exposed copy", "evicted"]
    cols.append("recompute")
    if result.offload == "all":
        cols += ["host update", "exposed update", "on device"]
    for col in cols:
        table.add_column(col, justify="right", no_wrap=True)
    for r in result.rows:
        if not r.feasible:
            peak = f"[red]infeasible[/red]: lowest {format_bytes(r.lowest_reachable_bytes)}"
        else:
            peak = format_bytes(r.planned_peak_bytes)
        step = f"{r.predicted_step_seconds * 1e3:.1f} ms" if r.feasible else ""
        exposed = f"{r.exposed_seconds * 1e3:.1f} ms" if r.feasible else ""
        table.add_row(
            r.budget,
            format_bytes(r.budget_bytes),
            peak,
            "yes" if r.fits_device and r.feasible else "no",
            step,
            exposed,
            f"{format_bytes(r.evicted_bytes)} ({r.num_evicted})" if r.feasible else "",
            (
                f"{format_bytes(r.recomputed_bytes)} ({r.num_recomputed}), {r.recompute_seconds * 1e3:.1f} ms"
                if r.feasible and r.num_recomputed
                else ("0 B" if r.feasible else "")
            ),
            *(
                (
                    f"{r.update_seconds * 1e3:.1f} ms" if r.feasible else "",
                    f"{r.exposed_update_seconds * 1e3:.1f} ms" if r.feasible else "",
                    f"{100 * r.device_share:.0f}%" if r.feasible else "",
                )
                if result.offload == "all"
                else ()
            ),
        )
    console.print(table)
    best = result.within_5_percent()
    if best is not None:
        console.print(
            f"smallest budget within 5% of the no-offload step: [bold]{best.budget}[/bold] = "
            f"{format_bytes(best.budget_bytes)} (peak {format_bytes(best.planned_peak_bytes)}, step "
            f"{best.predicted_step_seconds * 1e3:.1f} ms)"
        )
    else:
        console.print("no budget in the list keeps the predicted step within 5% of the no-offload step")
    lowest = min(r.lowest_reachable_bytes for r in result.rows)
    if lowest > spec.memory_bytes:
        console.print(
            f"[yellow]even offloading every saved activation, the step needs {format_bytes(lowest)} > "
            f"{format_bytes(spec.memory_bytes)} on {spec.name}: parameters, gradients and optimizer state "
            "dominate" + ("; --offload all moves them to host memory" if result.offload != "all" else "") + "[/yellow]"
        )
    if args.png:
        console.print(f"frontier: {frontier_png(result, Path(args.png))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
