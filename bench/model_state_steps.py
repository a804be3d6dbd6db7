"""Whole training steps of the model-state benchmark (``bench/model_state.py``'s GPT: width 128,
4 heads, sequence 64, batch 4, vocabulary 256, tied embeddings) with ``offload="all"`` and a
24 MiB device budget, ``CPUOptimizer(AdamW)``: the measured step time next to the predicted one.

The prediction is the backend's own (the report's ``param_offload["predicted_step_seconds"]``:
compute, the parameter and activation copies, and the optimizer update in the steady state of the
training loop), with this machine's figures measured first by ``calibrate`` in the same run and
passed as the ``calibration`` option. Here the device is the CPU: the update runs on the cores
that run the compute, so the plan counts all of it as exposed. Measured: the median time between
consecutive ``step()`` returns over ``--steps`` steps after three warm-up steps.

``python -m bench.model_state_steps [--depths 4,16] [--threads 1]`` writes
``bench/results/model_state_steps_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

import offload_compiler
from offload_compiler import CPUOptimizer
from offload_compiler.calibrate import calibrate

from .common import OtherLoad, write_result
from .model_state import _batch, _config, _loss


def measure(cfg, batch: int, budget: int, calibration: Path, steps: int, implementation: str) -> dict:
    """Measured and predicted step seconds of one depth."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    from offload_compiler.models import GPT

    model = GPT(cfg)
    options = {
        "inner": "eager",
        "offload": "all",
        "memory_budget": budget,
        "on_infeasible": "warn",
        "min_offload_bytes": 0,
        "verify": False,
        "calibration": str(calibration),
    }
    compiled = torch.compile(model, backend="trinity", options=options)
    opt = CPUOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, implementation=implementation)
    batches = [_batch(cfg, batch, s) for s in range(4)]
    times = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        last = None
        for step in range(steps + 3):
            idx, t = batches[step % 4]
            _loss(compiled, idx, t).backward()
            opt.step()
            opt.zero_grad()
            now = time.perf_counter()
            if last is not None and step >= 3:
                times.append(now - last)
            last = now
    opt.synchronize()
    po = offload_compiler.last_report().param_offload
    measured = statistics.median(times)
    return {
        "depth": cfg.n_layer,
        "params": sum(p.numel() for p in model.parameters()),
        "implementation": opt.implementation,
        "measured_step_seconds": measured,
        "measured_samples": times,
        "predicted_step_seconds": po["predicted_step_seconds"],
        "predicted_update_seconds": po["update_seconds"],
        "predicted_exposed_copy_seconds": po["exposed_transfer_seconds"],
        "update_model": po["update"],
        "predicted_over_measured": po["predicted_step_seconds"] / measured,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depths", default="4,16")
    parser.add_argument("--budget-mib", type=float, default=24.0)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: steady on a shared machine)")
    parser.add_argument("--implementations", default="exact,fastest")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    figures = calibrate("cpu")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(figures, f)
    calibration = Path(f.name)
    rows = []
    for depth in (int(d) for d in args.depths.split(",")):
        for impl in args.implementations.split(","):
            with OtherLoad() as load:
                row = measure(
                    _config(depth, 128, 64, 256), 4, int(args.budget_mib * 2**20), calibration, args.steps, impl
                )
            row["other_load"] = load.fraction
            rows.append(row)
            print(
                f"depth {depth:3d} {impl:8s}: measured {row['measured_step_seconds'] * 1e3:8.1f} ms, predicted "
                f"{row['predicted_step_seconds'] * 1e3:8.1f} ms ({row['predicted_over_measured']:.2f}x; update "
                f"{row['predicted_update_seconds'] * 1e3:.1f} ms)",
                flush=True,
            )
    payload = {
        "threads": args.threads,
        "budget_bytes": int(args.budget_mib * 2**20),
        "model": {"width": 128, "seq": 64, "batch": 4, "vocab": 256, "tie_weights": True},
        "calibration": {k: v for k, v in figures.items() if not isinstance(v, dict)},
        "other_load": "per row: the fraction of the machine's CPU other processes used while it was measured",
        "rows": rows,
        "target": "predicted within 25% of measured",
    }
    path = write_result("model_state_steps_cpu", payload, torch.device("cpu"))
    print(f"written {path}")
    return payload


if __name__ == "__main__":
    main()
