"""Whole training steps of the model-state benchmark (``bench/model_state.py``'s GPT: width 128,
4 heads, sequence 64, batch 4, vocabulary 256, tied embeddings) with ``offload="all"`` and a
24 MiB device budget, ``CPUOptimizer(AdamW)``: the measured step time next to the predicted one.

The prediction is the backend's own (the report's ``param_offload["predicted_step_seconds"]``:
compute, the parameter and activation copies, and the optimizer update in the steady state of the
training loop), with this machine's figures measured first by ``calibrate`` in the same run and
passed as the ``calibration`` option, and the cost model timing nodes by the roofline on those
figures (``op_times="roofline"``) or by each aten call timed at the compile
(``op_times="measured"``): one row each. Here the device is the CPU: the update runs on the
cores that run the compute, so the plan counts all of it as exposed. Measured: the time between
consecutive ``step()`` returns over ``--steps`` steps after three warm-up steps. ``--rounds``
repeats calibration and every row; a row's figures are the medians over its rounds (see
``method`` in the results).

``python -m bench.model_state_steps [--depths 4,16] [--threads 1] [--rounds 3]`` writes
``bench/results/model_state_steps_cpu.json``.
"""

from __future__ import annotations

import argparse
import itertools
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


def measure(
    cfg, batch: int, budget: int, calibration: Path, steps: int, implementation: str, op_times: str = "roofline"
) -> dict:
    """Measured and predicted step seconds of one depth, the cost model timing nodes by
    ``op_times`` (``"roofline"`` or ``"measured"``)."""
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
        "op_times": op_times,
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
        "op_times": op_times,
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
    parser.add_argument("--op-times", default="roofline,measured", help="the cost model's node times, per row")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of calibration and every row, one after the other"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    budget = int(args.budget_mib * 2**20)
    configs = [
        (depth, impl, op_times)
        for depth in (int(d) for d in args.depths.split(","))
        for impl, op_times in itertools.product(args.implementations.split(","), args.op_times.split(","))
    ]
    # This machine's speed moves by up to a third for seconds at a time (other virtual machines
    # on its host): every round calibrates again and runs every row once, so that each row's
    # figures and steps are taken at several moments, and the rows side by side.
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    calibrations = []
    for rnd in range(args.rounds):
        figures = calibrate("cpu")
        calibrations.append({k: v for k, v in figures.items() if not isinstance(v, dict)})
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(figures, f)
        for depth, impl, op_times in configs:
            with OtherLoad() as load:
                row = measure(_config(depth, 128, 64, 256), 4, budget, Path(f.name), args.steps, impl, op_times)
            row["other_load"] = load.fraction
            runs[(depth, impl, op_times)].append(row)
            print(
                f"round {rnd} depth {depth:3d} {impl:8s} {op_times:9s}: measured "
                f"{row['measured_step_seconds'] * 1e3:8.1f} ms, predicted {row['predicted_step_seconds'] * 1e3:8.1f} ms "
                f"({row['predicted_over_measured']:.2f}x; update {row['predicted_update_seconds'] * 1e3:.1f} ms)",
                flush=True,
            )
    rows = []
    for (depth, impl, op_times), done in runs.items():
        samples = [t for r in done for t in r["measured_samples"]]
        measured = statistics.median(samples)
        predicted = statistics.median(r["predicted_step_seconds"] for r in done)
        rows.append(
            {
                "depth": depth,
                "params": done[0]["params"],
                "implementation": done[0]["implementation"],
                "op_times": op_times,
                "measured_step_seconds": measured,
                "predicted_step_seconds": predicted,
                "predicted_over_measured": predicted / measured,
                "per_round_predicted_over_measured": [r["predicted_over_measured"] for r in done],
                "rounds": done,
            }
        )
        print(
            f"depth {depth:3d} {impl:8s} {op_times:9s}: measured {measured * 1e3:8.1f} ms (median of "
            f"{len(samples)} steps), predicted {predicted * 1e3:8.1f} ms (median of {len(done)}): "
            f"{predicted / measured:.2f}x",
            flush=True,
        )
    payload = {
        "threads": args.threads,
        "budget_bytes": budget,
        "rounds": args.rounds,
        "model": {"width": 128, "seq": 64, "batch": 4, "vocab": 256, "tie_weights": True},
        "calibrations": calibrations,
        "other_load": "per row: the fraction of the machine's CPU other processes used while it was measured",
        "rows": rows,
        "method": (
            "per row: measured = median of every round's steps; predicted = median of the rounds' predictions "
            "(each with that round's calibration; op_times='measured' also times each aten call at the compile)"
        ),
        "target": "predicted within 25% of measured",
    }
    path = write_result("model_state_steps_cpu", payload, torch.device("cpu"))
    print(f"written {path}")
    return payload


if __name__ == "__main__":
    main()
