"""Plan llama-7b and llama-13b (batch 1, sequence 4096, bf16, AdamW) with ``offload="all"`` on
RTX 4090 and H100 SXM figures, with the host optimizer update in the predicted step.

The host is assumed, not measured: 16 cores sustaining ``--host-bandwidth`` bytes/s (default
60 GB/s, a two-channel DDR5 workstation's STREAM triad), the AdamW update at an assumed fraction
of the bandwidth floor for torch's fused CPU kernel (``offload_compiler.devices.FUSED_FRACTION_OF_FLOOR``,
0.9: an assumption, see its comment for what has been measured). Three configurations per device:
``CPUOptimizer()`` defaults (torch's for-loop, update at ``step()``), ``implementation="fastest"``
with ``overlap="backward"``, and the same with ``optimizer_on_device="auto"``. Every figure is a
cost-model prediction, not a GPU measurement.

``python -m bench.plan_offload_update`` writes ``bench/results/plan_offload_update.json``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

from offload_compiler.devices import KNOWN_DEVICES, NOMINAL_HOST
from offload_compiler.plan_cli import plan_model

from .common import write_result

CONFIGS = (
    ("CPUOptimizer() defaults: for-loop, overlap=forward", "exact", "forward", 0.0),
    ("implementation='fastest' (fused), overlap=backward", "fastest", "backward", 0.0),
    ("fastest, overlap=backward, optimizer_on_device='auto'", "fastest", "backward", "auto"),
)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host-bandwidth", type=float, default=NOMINAL_HOST["host_bytes_per_s"])
    parser.add_argument("--models", default="llama-7b,llama-13b")
    parser.add_argument("--devices", default="rtx4090,h100-sxm")
    args = parser.parse_args(argv)
    rows = []
    runs = [
        (model, dev, config)
        for config in CONFIGS  # every model and device in one configuration before the next
        for model in args.models.split(",")
        for dev in args.devices.split(",")
    ]
    for model, dev, (label, impl, overlap, share) in runs:
        if True:
            spec = replace(
                KNOWN_DEVICES[dev],
                host_bytes_per_s=args.host_bandwidth,
                host_update_seconds_per_param=0.0,
                host_update_loop_seconds_per_param=0.0,
            )
            for _ in (0,):
                t0 = time.perf_counter()
                r = plan_model(
                    model,
                    spec,
                    ["device"],
                    batch=1,
                    seq_len=4096,
                    dtype=torch.bfloat16,
                    optimizer="adamw",
                    offload="all",
                    cpu_optimizer=impl,
                    overlap=overlap,
                    optimizer_on_device=share,
                )
                row = r.rows[0]
                rows.append(
                    {
                        "model": model,
                        "device": dev,
                        "config": label,
                        "num_params": r.num_params,
                        "host_model_state_bytes": r.host_model_state_bytes,
                        "compute_seconds": r.compute_seconds,
                        "update": r.update,
                        "wall_seconds": time.perf_counter() - t0,
                        **row.__dict__,
                    }
                )
                print(
                    f"{model} {dev} [{label}]: step {row.predicted_step_seconds * 1e3:.0f} ms (compute "
                    f"{r.compute_seconds * 1e3:.0f} ms, exposed copies {row.exposed_seconds * 1e3:.0f} ms, host update "
                    f"{row.update_seconds * 1e3:.0f} ms, {row.exposed_update_seconds * 1e3:.0f} ms of it exposed, "
                    f"{100 * row.device_share:.0f}% on the device), peak {row.planned_peak_bytes / 2**30:.2f} GiB",
                    flush=True,
                )
                write_result("plan_offload_update", _payload(args, rows), torch.device("cpu"))  # so far
    payload = _payload(args, rows)
    path = write_result("plan_offload_update", payload, torch.device("cpu"))
    print(f"written {path}")
    return payload


def _payload(args, rows) -> dict:
    return {
        "batch": 1,
        "seq_len": 4096,
        "dtype": "bfloat16",
        "optimizer": "adamw",
        "offload": "all",
        "budget": "device",
        "host": {"cores": NOMINAL_HOST["cores"], "host_bytes_per_s": args.host_bandwidth, "assumed": True},
        "rows": rows,
        "note": "predicted by the cost model and simulator (steady state of the training loop, host update "
        "included); the host is assumed; not measured on a GPU",
    }


if __name__ == "__main__":
    main()
