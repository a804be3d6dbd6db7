"""The data-stack headroom of trinity's ``inner="eager"`` graphs (``offload_compiler/frame_headroom.py``),
on and off, side by side: page faults and step time of the model-state GPT with ``offload="all"``.

Each measurement runs in its own process (parameter offload keeps host copies per model instance,
and where a frame lands on CPython's data stack depends on the whole process), alternating
on, off, off, on, ... over ``--rounds``: ``--depth`` blocks (``bench/model_state.py``'s GPT:
width 128, sequence 64, batch 4, vocabulary 256), a 24 MiB budget, ``CPUOptimizer(AdamW,
implementation="fastest")``, 1 thread; after 3 warm-up steps, ``--steps`` steps, each forward,
backward, ``step()`` and ``zero_grad()``, called from under 0, 3, 6, ... 237 extra small frames
(where a graph's frame lands in its chunk depends on how deep its caller is), ``--steps`` timed
steps at each. "Off" replaces ``frame_headroom.add_headroom`` by a no-op in that process.
Reported per process and nesting: minor page faults per step (``getrusage``) and the median step
(seconds); per mode, the worst nesting's faults and step and the median step.

``python -m bench.frame_headroom [--depth 12] [--rounds 2] [--steps 2]`` writes
``bench/results/frame_headroom_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch

from .common import write_result


def child(depth: int, steps: int, headroom: bool, max_nesting: int = 240, nesting_step: int = 3) -> dict:
    """One process's measurement (see the module docstring)."""
    import resource

    import offload_compiler.frame_headroom as fh

    if not headroom:
        fh.add_headroom = lambda gm: 0
    from offload_compiler import CPUOptimizer
    from offload_compiler.models import GPT

    from .model_state import _batch, _config, _loss

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    cfg = _config(depth, 128, 64, 256)
    model = GPT(cfg)
    options = {
        "inner": "eager",
        "offload": "all",
        "memory_budget": 24 * 2**20,
        "on_infeasible": "warn",
        "min_offload_bytes": 0,
        "verify": False,
    }
    compiled = torch.compile(model, backend="trinity", options=options)
    opt = CPUOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, implementation="fastest")
    idx, t = _batch(cfg, 4, 0)

    def step():
        _loss(compiled, idx, t).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    # Where the graph's frame lands in its data-stack chunk depends on how deep the caller is:
    # step from under ``k`` extra small frames, for k over more than a chunk's worth of words.
    rows = []
    for k in range(0, max_nesting, nesting_step):
        _nested(k, step)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            _nested(k, step)
            times.append(time.perf_counter() - t0)
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / steps
        rows.append({"nesting": k, "faults_per_step": faults, "median_step_seconds": statistics.median(times)})
    opt.synchronize()
    worst = max(rows, key=lambda r: r["faults_per_step"])
    return {
        "headroom": headroom,
        "per_nesting": rows,
        "max_faults_per_step": worst["faults_per_step"],
        "median_faults_per_step": statistics.median(r["faults_per_step"] for r in rows),
        "median_step_seconds": statistics.median(r["median_step_seconds"] for r in rows),
        "max_step_seconds": max(r["median_step_seconds"] for r in rows),
    }


def _nested(k: int, fn):
    """``fn()`` called under ``k`` frames of this small function."""
    return fn() if k <= 0 else _nested(k - 1, fn)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per nesting depth")
    parser.add_argument("--child", choices=("on", "off"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.depth, args.steps, args.child == "on")))
        return {}
    runs = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for r in range(args.rounds):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            cmd = [sys.executable, "-m", "bench.frame_headroom", "--child", mode, "--depth", str(args.depth)]
            cmd += ["--steps", str(args.steps)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, timeout=600)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            runs.append(row)
            print(
                f"headroom {mode:3s}: page faults per step {row['median_faults_per_step']:8.1f} (median over "
                f"nestings), {row['max_faults_per_step']:8.1f} (worst); step {row['median_step_seconds'] * 1e3:7.1f} "
                f"ms (median), {row['max_step_seconds'] * 1e3:7.1f} ms (worst nesting)",
                flush=True,
            )
    summary = {}
    for mode in (True, False):
        mine = [r for r in runs if r["headroom"] is mode]
        summary["on" if mode else "off"] = {
            "max_faults_per_step": max(r["max_faults_per_step"] for r in mine),
            "median_step_seconds": statistics.median(r["median_step_seconds"] for r in mine),
            "max_step_seconds": max(r["max_step_seconds"] for r in mine),
        }
    payload = {
        "depth": args.depth,
        "steps": args.steps,
        "python": sys.version.split()[0],
        "runs": runs,
        "summary": summary,
        "off_over_on_worst_step": summary["off"]["max_step_seconds"] / summary["on"]["max_step_seconds"],
    }
    path = write_result("frame_headroom_cpu", payload, torch.device("cpu"))
    print(f"worst nesting's step, off/on: {payload['off_over_on_worst_step']:.2f}x; written {path}")
    return payload


if __name__ == "__main__":
    main()
