"""The benchmark suite: every method on every model, then trinity and its inner compiler stepped
alternately (:mod:`bench.step_ratio`, the step-time target), the planner benches, the report.

``python -m bench`` (``make bench``) runs it: on a machine without a GPU the CPU suite
(:data:`CPU_SUITE`, the ``cpu`` size preset, under 15 minutes on 2 cores with a warm kernel
cache); with a GPU the GPU suite (:data:`GPU_SUITE`, the ``gpu`` sizes). Options narrow it down:
``--models gpt,vit``, ``--methods eager,trinity-50%``, ``--steps``, ``--no-planner``, ``--no-step-ratio``,
``--report-only``. Results: ``bench/results/`` (see ``bench/results/README.md``).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from . import common, peak_vs_budget, plan_7b, planner_time, report, step_ratio
from .models import MODEL_NAMES, get_model
from .runner import RunConfig, run_model, session_info

__all__ = ["CPU_SUITE", "GPU_SUITE", "main"]

_PEERS = ["eager", "inductor", "checkpoint", "sac-0.5", "save_on_cpu", "torch-offload"]

# Which methods run on which model. The GPT also carries the inner="eager" rows (against
# aot_eager) and three budgets; the others one budget, to keep the CPU suite in its time.
CPU_SUITE: dict[str, list[str]] = {
    "gpt": _PEERS
    + ["trinity-25%", "trinity-50%", "trinity-75%", "aot_eager", "trinity-eager-25%", "trinity-eager-50%"]
    + ["trinity-eager-75%"],
    "llama": _PEERS + ["trinity-50%"],
    "vit": _PEERS + ["trinity-50%"],
    "resnet": _PEERS + ["trinity-50%"],
}

GPU_SUITE: dict[str, list[str]] = {
    name: ["eager", "inductor", "checkpoint", "sac-0.25", "sac-0.5", "save_on_cpu", "torch-offload"]
    + [f"trinity-{b}%" for b in (10, 25, 50, 75, 90)]
    for name in MODEL_NAMES
}


def _summary(row: dict) -> str:
    name = f"{row['model']['name']:7s} {row['method']['key']:18s}"
    if not row.get("ok"):
        return f"{name} [red]FAILED[/red] {row.get('error', '')[:160]}"
    ve = row.get("vs_eager") or {}
    parts = [
        f"peak {row['peak_bytes'] / 2**20:7.1f} MiB" + (f" ({ve['peak']:.2f}x)" if ve else "        "),
        f"step {row['median_step_seconds'] * 1e3:7.1f} ms" + (f" ({ve['step']:.2f}x)" if ve else "        "),
    ]
    if row.get("compile_seconds") is not None:
        parts.append(f"compile {row['compile_seconds']:5.1f} s")
    parts.append(f"loss {row['final_loss']:.4f}")
    t = row.get("trinity")
    if t and t.get("budget_bytes") is not None:
        ok = t.get("within_budget")
        parts.append(
            f"budget {t['budget_bytes'] / 2**20:.1f} MiB " + ("[green]within[/green]" if ok else "[red]OVER[/red]")
        )
    return f"{name} " + ", ".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Run the suite; returns the exit status (1 if any run failed)."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--size", default=None, help="model size preset: cpu, gpu, tiny (default: by device)")
    parser.add_argument("--models", default=None, help=f"comma-separated subset of {','.join(MODEL_NAMES)}")
    parser.add_argument("--methods", default=None, help="comma-separated method keys, for every model")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (default 8)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps (default 2)")
    parser.add_argument("--no-planner", action="store_true", help="skip the planner_time and plan_7b benches")
    parser.add_argument(
        "--no-step-ratio", action="store_true", help="skip the side-by-side step-time ratios (bench.step_ratio)"
    )
    parser.add_argument("--report-only", action="store_true", help="only regenerate README.md and the PNGs")
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(soft_wrap=True)
    if args.report_only:
        console.print(f"written {report.write_report()}")
        return 0
    t_start = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    size = args.size or ("gpu" if device.type == "cuda" else "cpu")
    suite = GPU_SUITE if device.type == "cuda" else CPU_SUITE
    models = args.models.split(",") if args.models else list(suite)
    plan = {m: (args.methods.split(",") if args.methods else suite[m]) for m in models}
    config = RunConfig(steps=args.steps, warmup=args.warmup, device=device.type, size=size)
    specs = {m: get_model(m, size) for m in models}
    n_runs = sum(len(v) for v in plan.values())
    ratio_models = [m for m in models if "trinity-50%" in plan[m]]
    do_ratio = not args.no_step_ratio and bool(ratio_models)
    total = n_runs * (config.steps + 1) + (0 if args.no_planner else 2) + (1 if do_ratio else 0)
    session = session_info(n_runs)
    console.print(
        f"[bold]trinity bench[/bold]: {n_runs} runs ({', '.join(f'{m}: {len(v)}' for m, v in plan.items())}) on "
        f"{common.device_description(device)}, size preset {size!r}, torch {torch.__version__}"
    )
    for m, spec in specs.items():
        console.print(f"  {m}: {spec.description} [{spec.source}]")
    if device.type == "cpu":
        console.print(
            "[dim]CPU run: offloading copies are memcpy within host memory; step times say nothing about overlap.[/dim]"
        )
    failures = 0
    all_rows: dict[str, list[dict]] = {}
    with Progress(
        TextColumn("{task.description:60s}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        task = progress.add_task("suite", total=total)

        def advance(n: int, text: str) -> None:
            progress.update(task, advance=n, description=text)

        def on_result(row: dict) -> None:
            nonlocal failures
            failures += 0 if row.get("ok") else 1
            progress.console.print(_summary(row))

        for m in models:
            all_rows[m] = run_model(specs[m], plan[m], config, advance, session=session, on_result=on_result)
        suite_seconds = time.perf_counter() - t_start
        if do_ratio:
            advance(0, "step_ratio (trinity 50% and its inner compiler, stepped alternately)")
            step_ratio.main(["--models", ",".join(ratio_models), "--device", device.type, "--size", size])
            advance(1, "step_ratio done")
        if not args.no_planner:
            advance(0, "planner_time (12 and 48 layers)")
            planner_time.main([])
            advance(1, "plan_7b (llama-7b on fake tensors)")
            plan_7b.main([])
            advance(1, "done")
    if "gpt" in all_rows:
        for path in peak_vs_budget.write_from_runs(all_rows["gpt"], device):
            console.print(f"written {path}")
    wall = time.perf_counter() - t_start
    common.write_result(
        f"suite_{device.type}",
        {
            "session": session,
            "wall_seconds": wall,
            "suite_seconds": suite_seconds,
            "size": size,
            "plan": plan,
            "config": vars(args),
            "failures": failures,
            "dirty_paths": common.dirty_paths(),
        },
        device,
    )
    path = report.write_report()
    console.print(f"written {path} and the frontier PNGs; {n_runs} runs, {failures} failed; total {wall / 60:.1f} min")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
