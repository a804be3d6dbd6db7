"""Measured peak device bytes of the demo GPT's training step against eager and the same inner
compiler without trinity, at budgets 25%, 50% and 75%.

Folded into the suite: ``python -m bench`` writes ``peak_vs_budget_<inner>_<device>.json`` from its
GPT runs (:func:`write_from_runs`); ``python -m bench.peak_vs_budget --inner eager`` runs just these
methods through the same runner. On CPU the peak is trinity's allocator-trace accounting (host pool
excluded); on CUDA the caching allocator's peak.
"""

from __future__ import annotations

import argparse
import json

import torch

from .common import write_result
from .models import SIZES, get_model
from .runner import RunConfig, run_model

__all__ = ["methods_for", "write_from_runs", "main"]

BUDGETS = ("25%", "50%", "75%")


def methods_for(inner: str) -> list[str]:
    """The method keys of this bench for trinity's ``inner`` compiler."""
    if inner == "eager":
        return ["eager", "aot_eager"] + [f"trinity-eager-{b}" for b in BUDGETS]
    return ["eager", "inductor"] + [f"trinity-{b}" for b in BUDGETS]


def _rows(runs: list[dict], inner: str) -> list[dict] | None:
    by_key = {r["method"]["key"]: r for r in runs}
    keys = methods_for(inner)
    if not all(k in by_key and by_key[k].get("ok") for k in keys):
        return None
    rows = []
    eager_peak = by_key["eager"]["peak_bytes"]
    for k in keys:
        r = by_key[k]
        name = {"eager": "eager", "inductor": "torch.compile(inductor)", "aot_eager": "torch.compile(aot_eager)"}.get(k)
        row = {
            "method": name or f"trinity {r['method']['budget']}",
            "peak_bytes": r["peak_bytes"],
            "median_step_seconds": r["median_step_seconds"],
        }
        t = r.get("trinity")
        if t:
            row.update(
                budget=r["method"]["budget"],
                budget_bytes=t.get("budget_bytes"),
                planned_peak_bytes=t.get("planned_peak_bytes"),
                feasible=t.get("feasible"),
                evicted_bytes=t.get("evicted_bytes"),
                within_budget=t.get("within_budget"),
            )
        row["peak_vs_eager"] = r["peak_bytes"] / eager_peak
        rows.append(row)
    return rows


def write_from_runs(runs: list[dict], device: torch.device) -> list:
    """Write ``peak_vs_budget_<inner>_<device>.json`` for each inner compiler whose rows are all in
    ``runs`` (the suite's GPT results); returns the paths written."""
    paths = []
    if not runs:
        return paths
    size = runs[0]["config"]["size"]
    g = SIZES[size]["gpt"]
    for inner in ("inductor", "eager"):
        rows = _rows(runs, inner)
        if rows is None:
            continue
        payload = {
            "model": {"layers": g["n_layer"], "width": g["n_embd"], "seq": g["seq"], "batch": g["batch"]},
            "inner": inner,
            "rows": rows,
            "steps": runs[0]["config"]["steps"],
            "optimizer": runs[0]["optimizer"],
            "note": "written from the suite's GPT runs (bench/results/runs/); on CPU, step times include "
            "synchronous host copies (memcpy) and say nothing about overlap",
        }
        paths.append(write_result(f"peak_vs_budget_{inner}_{device.type}", payload, device))
    return paths


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inner", choices=["inductor", "eager"], default="inductor")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = "gpu" if device.type == "cuda" else "cpu"
    runs = run_model(
        get_model("gpt", size),
        methods_for(args.inner),
        RunConfig(steps=args.steps, device=device.type, size=size),
        write=False,  # the suite's per-run files stay the suite's
    )
    for row in runs:
        if not row.get("ok"):
            print(f"{row['method']['key']} failed: {row['error']}")
    for path in write_from_runs(runs, device):
        print(f"written {path}")
        for row in json.loads(path.read_text())["rows"]:
            budget = f"{row['budget_bytes'] / 2**20:.2f} MiB" if row.get("budget_bytes") else ""
            print(
                f"{row['method']:28s} {row['peak_bytes'] / 2**20:9.2f} MiB {row['peak_vs_eager']:9.2f} {budget:>12s} "
                f"{row['median_step_seconds'] * 1e3:7.1f} ms"
            )


if __name__ == "__main__":
    main()
