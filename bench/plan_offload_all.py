"""Plan Llama-2 7B and 13B (batch 1 x 2048 tokens) and 70B (batch 1 x 4096) with
``offload="all"`` (parameters, gradients and AdamW state in host memory) on an RTX 4090's (24 GB)
and an H100 SXM's (80 GB) figures, through the ``plan`` command's path, which is the backend's
planning spine (``pipeline.plan_pair``). Per model: the budgets' planned peak, lowest reachable
peak, predicted step and exposed copy time, host bytes, and the planner's own cost on this
machine (wall and CPU seconds, peak RSS). Written to ``bench/results/plan_offload_all.json``.

Targets (issue 11): 13B fits 24 GB; planning llama-70b takes under 120 s and 8 GiB of RSS on the
2-core machine. GPU figures are the cost model's predictions, not measurements."""

from __future__ import annotations

import argparse
import resource
import time

import torch

from offload_compiler.devices import KNOWN_DEVICES
from offload_compiler.plan_cli import model_builder, plan_step
from offload_compiler.trace import trace_training_step

from .common import OtherLoad, write_result

CASES = (("llama-7b", 2048), ("llama-13b", 2048), ("llama-70b", 4096))
DEVICES = ("rtx4090", "h100-sxm")
BUDGETS = ["device", "16GiB", "8GiB", "4GiB"]


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def plan_one(model: str, seq_len: int) -> dict:
    """Trace ``model`` once and plan it on each device (bytes, seconds)."""
    wall0, cpu0 = time.perf_counter(), _cpu_seconds()
    with OtherLoad() as load:
        build, vocab = model_builder(model, seq_len, {})
        traced = trace_training_step(build, 1, seq_len, vocab, torch.bfloat16, inner="eager")
        trace_wall = time.perf_counter() - wall0
        per_device = {}
        for name in DEVICES:
            res = plan_step(
                traced, KNOWN_DEVICES[name], BUDGETS, model=model, optimizer="adamw", offload="all", inner="eager"
            )
            per_device[name] = res.to_json()
    return {
        "model": model,
        "batch": 1,
        "seq_len": seq_len,
        "dtype": "bfloat16",
        "optimizer": "adamw",
        "offload": "all",
        "num_params": traced.num_params,
        "param_bytes": traced.param_bytes,
        "trace_wall_seconds": trace_wall,
        "planner_wall_seconds": time.perf_counter() - wall0,
        "planner_cpu_seconds": _cpu_seconds() - cpu0,
        "max_rss_bytes_so_far": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "other_load": load.fraction,
        "devices": per_device,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=[m for m, _ in CASES], help="a subset of the cases")
    args = parser.parse_args(argv)
    rows = [plan_one(m, s) for m, s in CASES if m in args.models]
    payload = {
        "budgets": BUDGETS,
        "rows": rows,
        "targets": "13B fits 24 GB (rtx4090 'device' row fits); llama-70b planned in under 120 s and 8 GiB RSS",
        "note": "GPU figures are predicted by the cost model and simulator (devices.py datasheet figures); "
        "not measured on a GPU. max_rss_bytes_so_far is the process's peak RSS after that model (models run "
        "in the order listed). planner_cpu_seconds is this process's CPU time for the model (other_load: the "
        "share of the machine other processes used meanwhile).",
    }
    path = write_result("plan_offload_all", payload, torch.device("cpu"))
    for row in rows:
        for dev, res in row["devices"].items():
            for r in res["rows"]:
                step = r["predicted_step_seconds"]
                print(
                    f"{row['model']:>9} seq {row['seq_len']} {dev:>8} {r['budget']:>6}: peak "
                    f"{r['planned_peak_bytes'] / 2**30:6.2f} GiB (lowest {r['lowest_reachable_bytes'] / 2**30:.2f}) "
                    f"fits={r['fits']} step {'-' if step is None else f'{step * 1e3:.0f} ms'}"
                )
        print(
            f"{row['model']}: planned in {row['planner_wall_seconds']:.1f} s wall, {row['planner_cpu_seconds']:.1f} s "
            f"CPU, peak RSS {row['max_rss_bytes_so_far'] / 2**30:.2f} GiB"
        )
    print(f"written {path}")


if __name__ == "__main__":
    main()
