"""Planner time for the demo GPT at 12 and 48 layers (target: under 2 s at 48 layers).

Compiles one training step with ``backend="trinity"`` (``inner="eager"``, so the time measured is
trinity's, not Inductor's) at a 50% budget and reads each pass's wall time from the report. The
planner is the ``plan_window`` pass: the joint keep/offload/recompute planner
(``strategy="auto"``: chains, the HiGHS program, scoring, the exact plan on the rewritten copy)
with the working-window planner inside; ``--device`` plans on a GPU's figures (``h100-sxm``), where
recomputation is chosen, instead of this machine's.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import offload_compiler
from offload_compiler.models import GPT, GPTConfig

from .common import write_result


def planner_seconds(n_layer: int, width: int = 128, seq: int = 128, batch: int = 8, device: str | None = None) -> dict:
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
        "all_passes_seconds": sum(seconds.values()),
        "num_candidates": r.num_candidates,
        "num_evicted": r.num_evicted,
        "predicted_step_seconds": r.predicted_step_seconds,
        "device_figures": r.device_name,
        "recompute": r.recompute,
    }


def run(layers=(12, 48), devices=(None, "h100-sxm")) -> dict:
    rows = [planner_seconds(n, device=d) for d in devices for n in layers]
    return {"rows": rows, "target": "plan_window (the joint planner) under 2 s at 48 layers"}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 48])
    parser.add_argument("--devices", nargs="+", default=["host", "h100-sxm"], help="'host' or device table keys")
    args = parser.parse_args(argv)
    result = run(tuple(args.layers), tuple(None if d == "host" else d for d in args.devices))
    path = write_result("planner_time", result, torch.device("cpu"))
    for row in result["rows"]:
        rc = row["recompute"] or {}
        print(
            f"{row['layers']:3d} layers on {row['device_figures']}: plan_window {row['plan_window_seconds']:.3f} s "
            f"(solver {rc.get('solver')} {rc.get('solver_seconds', 0):.3f} s, {rc.get('num_recomputed', 0)} recomputed), "
            f"all passes {row['all_passes_seconds']:.3f} s ({row['num_evicted']} of {row['num_candidates']} evicted)"
        )
    print(f"written {path}")


if __name__ == "__main__":
    main()
