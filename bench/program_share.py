"""The joint planner with and without the smallest buffers left out of its programs, side by side.

:func:`offload_compiler.passes.plan_recompute._program_buffers` keeps the smallest buffers out of
the solver's programs while their bytes total at most
:data:`~offload_compiler.passes.plan_recompute.PROGRAM_SMALL_SHARE` of the bytes the plan must
free. This plans the same traced training step (the ``--gpu`` frontier's models, traced once on
fake tensors for Inductor, bf16, AdamW) with ``strategy="auto"`` through ``plan_model`` (the
``plan`` command's spine) twice per device and budget: with the share at 0 (every buffer in the
programs) and at its default, and records each predicted step (seconds, the cost model and
simulator on the device's figures), the chosen candidate and the planning seconds. Predictions
only: nothing runs on a GPU. The solver's limits are CPU seconds, so another busy process
changes the plans little, but the search is not the same on every machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from .common import write_result

DEVICES = ("h100-sxm", "a100-80gb", "rtx4090")
BUDGETS = ("75%", "50%", "35%")


def compare(model: dict, devices=DEVICES, budgets=BUDGETS) -> list[dict]:
    """One row per device and budget: the predicted step (seconds; ``None`` where infeasible)
    and the chosen candidate with every buffer in the programs (``share 0``) and with the
    default share, and the ratio (default / every buffer)."""
    from offload_compiler.passes import plan_recompute
    from offload_compiler.trace import trace_training_step

    from .frontier import plan_traced

    default = plan_recompute.PROGRAM_SMALL_SHARE
    args = (model["batch"], model["seq"], model["vocab"], torch.bfloat16)
    traced = trace_training_step(model["build"], *args, inner="inductor")
    rows = []
    for dev in devices:
        got = {}
        for share in (0.0, default):
            plan_recompute.PROGRAM_SMALL_SHARE = share
            try:
                t0 = time.perf_counter()
                res = plan_traced(model, dev, budgets, traced)
                got[share] = (res.rows, time.perf_counter() - t0)
            finally:
                plan_recompute.PROGRAM_SMALL_SHARE = default
        for every, pruned in zip(got[0.0][0], got[default][0]):
            a = every.predicted_step_seconds if every.feasible else None
            b = pruned.predicted_step_seconds if pruned.feasible else None
            rows.append(
                {
                    "model": model["name"],
                    "device": dev,
                    "budget": every.budget,
                    "every_buffer_step_seconds": a,
                    "every_buffer_chosen": every.chosen,
                    "default_share_step_seconds": b,
                    "default_share_chosen": pruned.chosen,
                    "ratio": (b / a) if a and b else None,
                    "every_buffer_plan_seconds": got[0.0][1],
                    "default_share_plan_seconds": got[default][1],
                }
            )
    return rows


def main(argv=None) -> None:
    from offload_compiler.passes import plan_recompute

    from .frontier import gpu_models

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="demo,llama", help="names (prefixes) of the --gpu frontier's models")
    args = parser.parse_args(argv)
    wanted = args.models.split(",")
    rows = []
    for model in gpu_models():
        name = model["name"]
        if any(name == w or name.startswith(w + " ") for w in wanted):
            rows.extend(compare(model))
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    path = write_result(
        "program_share",
        {"share": plan_recompute.PROGRAM_SMALL_SHARE, "rows": rows, "budgets": list(BUDGETS)},
        torch.device("cpu"),
    )
    for r in rows:
        a, b = r["every_buffer_step_seconds"], r["default_share_step_seconds"]
        fmt = lambda s: "infeasible" if s is None else f"{s * 1e3:.3f} ms"  # noqa: E731
        print(
            f"{r['model'][:24]:24s} {r['device']:10s} {r['budget']:>4s}: every buffer {fmt(a)} ({r['every_buffer_chosen']}), "
            f"default share {fmt(b)} ({r['default_share_chosen']})"
        )
    if ratios:
        print(
            f"{sum(x < 1 - 1e-9 for x in ratios)} faster, {sum(abs(x - 1) <= 1e-9 for x in ratios)} equal, "
            f"{sum(x > 1 + 1e-9 for x in ratios)} slower with the default share; ratios {min(ratios):.3f} to {max(ratios):.3f}"
        )
    print(f"written {path}")


if __name__ == "__main__":
    main()
