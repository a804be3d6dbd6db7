"""Planner time for the demo GPT at 12 and 48 layers (target: under 2 s at 48 layers).

Compiles one training step with ``backend="trinity"`` (``inner="eager"``, so the time measured is
trinity's, not Inductor's) at a 50% budget and reads each pass's wall time from the report. The
planner is the ``plan_window`` pass: the joint keep/offload/recompute planner
(``strategy="auto"``: chains, the HiGHS program, scoring, the exact plan on the rewritten copy)
with the working-window planner inside; ``--device`` plans on a GPU's figures (``h100-sxm``), where
recomputation is chosen, instead of this machine's.

Each configuration is compiled ``--repeats`` times (after one 4-layer warm-up compile, so that
lazy imports and first-call caches are not timed) and the median and the lowest are reported,
with the planner's CPU seconds (the report's ``plan_cpu_seconds``: the compiling thread's
``time.thread_time`` over the joint planner; what the machine's speed gives, without what its
other work takes) and, on Linux, the share of CPU time the hypervisor took from this virtual machine while it ran
(``steal`` in ``/proc/stat``; a shared cloud machine can lose half its CPU to it, which wall time
counts and the planner cannot help).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import offload_compiler
from offload_compiler.models import GPT, GPTConfig

from .common import write_result


def _steal() -> tuple[int, int] | None:
    """``(steal ticks, all ticks)`` of every CPU so far (``/proc/stat``), or ``None`` off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    ticks = [int(v) for v in fields[1:]]
    return (ticks[7] if len(ticks) > 7 else 0), sum(ticks)


def planner_seconds(n_layer: int, width: int = 128, seq: int = 128, batch: int = 8, device: str | None = None) -> dict:
    """One compile of the demo GPT with ``n_layer`` layers at a 50% budget: the report's pass
    seconds (wall), the planner's CPU seconds and the plan's figures."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=seq, n_layer=n_layer, n_head=4, n_embd=width))
    x = torch.randint(0, 256, (batch, seq))
    options = {"memory_budget": "50%", "inner": "eager", "min_offload_bytes": 0}
    if device is not None:
        options["device"] = device
    compiled = torch.compile(model, backend="trinity", options=options)
    F.cross_entropy(compiled(x).flatten(0, 1), x.flatten()).backward()
    r = offload_compiler.last_report()
    seconds = dict(r.pass_seconds)
    return {
        "layers": n_layer,
        "pass_seconds": seconds,
        "plan_window_seconds": seconds["plan_window"],
        "planner_cpu_seconds": r.recompute["plan_cpu_seconds"],
        "all_passes_seconds": sum(seconds.values()),
        "num_candidates": r.num_candidates,
        "num_evicted": r.num_evicted,
        "predicted_step_seconds": r.predicted_step_seconds,
        "device_figures": r.device_name,
        "recompute": r.recompute,
    }


def measure(n_layer: int, device: str | None, repeats: int) -> dict:
    """``repeats`` compiles (:func:`planner_seconds`): the last one's figures, with the median and
    lowest ``plan_window`` wall and CPU seconds over all of them and the steal share."""
    before = _steal()
    runs = [planner_seconds(n_layer, device=device) for _ in range(repeats)]
    after = _steal()
    row = dict(runs[-1])
    walls = [r["plan_window_seconds"] for r in runs]
    cpus = [r["planner_cpu_seconds"] for r in runs]
    row.update(
        repeats=repeats,
        plan_window_seconds=statistics.median(walls),
        plan_window_seconds_min=min(walls),
        plan_window_seconds_all=walls,
        planner_cpu_seconds=statistics.median(cpus),
        planner_cpu_seconds_all=cpus,
        all_passes_seconds=statistics.median(r["all_passes_seconds"] for r in runs),
        plans=sorted({(r["num_evicted"], r["num_candidates"], r["recompute"]["chosen"]) for r in runs}),
        steal_share=(
            (after[0] - before[0]) / max(1, after[1] - before[1]) if before is not None and after is not None else None
        ),
    )
    return row


def run(layers=(12, 48), devices=(None, "h100-sxm"), repeats: int = 3) -> dict:
    planner_seconds(4)  # warm-up: lazy imports, first-call caches
    rows = [measure(n, d, repeats) for d in devices for n in layers]
    return {
        "rows": rows,
        "repeats": repeats,
        "target": "plan_window (the joint planner) under 2 s at 48 layers (median of the repeats)",
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 48])
    parser.add_argument("--devices", nargs="+", default=["host", "h100-sxm"], help="'host' or device table keys")
    parser.add_argument("--repeats", type=int, default=3, help="compiles per configuration (default 3)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    result = run(tuple(args.layers), tuple(None if d == "host" else d for d in args.devices), args.repeats)
    path = write_result("planner_time", result, torch.device("cpu"))
    for row in result["rows"]:
        rc = row["recompute"] or {}
        steal = "" if row["steal_share"] is None else f", {100 * row['steal_share']:.0f}% stolen"
        print(
            f"{row['layers']:3d} layers on {row['device_figures']}: plan_window median {row['plan_window_seconds']:.3f} s "
            f"of {row['repeats']} (lowest {row['plan_window_seconds_min']:.3f} s; CPU {row['planner_cpu_seconds']:.3f} s"
            f"{steal}; solver {rc.get('solver')} {rc.get('solver_seconds', 0):.3f} s, "
            f"{rc.get('num_recomputed', 0)} recomputed), all passes {row['all_passes_seconds']:.3f} s "
            f"({row['num_evicted']} of {row['num_candidates']} evicted; plans seen: {len(row['plans'])})"
        )
    print(f"written {path}")


if __name__ == "__main__":
    main()
