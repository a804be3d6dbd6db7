"""Plan llama-7b (batch 1, sequence 4096, bf16, AdamW) on a 24 GB GPU (RTX 4090 figures) with
``offload="all"``: parameters, gradients and optimizer state in host memory. Records each
budget's planned peak, predicted step time and exposed copy time, and the host bytes
(``bench/results/plan_llama7b_offload_all.json``). With ``offload="activations"`` the same step
needs at least parameters + gradients + AdamW state (~50 GiB): it cannot fit 24 GB at all."""

from __future__ import annotations

import time

import torch

from offload_compiler.devices import KNOWN_DEVICES
from offload_compiler.plan_cli import plan_model

from .common import write_result


def main(argv=None) -> None:
    t0 = time.perf_counter()
    device = KNOWN_DEVICES["rtx4090"]
    result = plan_model(
        "llama-7b",
        device,
        ["device", "20GiB", "16GiB"],
        batch=1,
        seq_len=4096,
        dtype=torch.bfloat16,
        optimizer="adamw",
        offload="all",
    )
    wall = time.perf_counter() - t0
    payload = {
        "model": "llama-7b",
        "batch": 1,
        "seq_len": 4096,
        "dtype": "bfloat16",
        "optimizer": "adamw",
        "offload": "all",
        "device_figures": result.device.name,
        "device_memory_bytes": device.memory_bytes,
        "num_params": result.num_params,
        "param_bytes": result.param_bytes,
        "optimizer_state_bytes": result.optimizer_state_bytes,
        "host_model_state_bytes": result.host_model_state_bytes,
        "unplanned_peak_bytes": result.unplanned_peak_bytes,
        "compute_seconds": result.compute_seconds,
        "wall_seconds": wall,
        "rows": [r.__dict__ for r in result.rows],
        "note": "predicted by the cost model and simulator with the planner's working window and copy waits "
        "(the runtime issues parameter copies asynchronously on the copy streams); not measured on a GPU",
    }
    path = write_result("plan_llama7b_offload_all", payload, torch.device("cpu"))
    for r in result.rows:
        print(
            f"{r.budget:>7}: peak {r.planned_peak_bytes / 2**30:.2f} GiB fits={r.fits_device and r.feasible} "
            f"step {r.predicted_step_seconds * 1e3:.1f} ms exposed {r.exposed_seconds * 1e3:.1f} ms"
        )
    print(f"written {path}")


if __name__ == "__main__":
    main()
