"""Plan llama-7b at batch 1, sequence 4096, bf16, for an 80 GB GPU; record wall time and peak host
memory (target: under 60 s and 8 GiB on a 2-core, 24 GiB machine without a GPU)."""

from __future__ import annotations

import resource
import time

import torch

from offload_compiler.devices import KNOWN_DEVICES
from offload_compiler.plan_cli import plan_model

from .common import write_result


def main(argv=None) -> None:
    t0 = time.perf_counter()
    result = plan_model(
        "llama-7b",
        KNOWN_DEVICES["a100-80gb"],
        ["100%", "90%", "75%", "50%", "device"],
        batch=1,
        seq_len=4096,
        dtype=torch.bfloat16,
        optimizer="adamw",
    )
    wall = time.perf_counter() - t0
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    payload = {
        "model": "llama-7b",
        "batch": 1,
        "seq_len": 4096,
        "dtype": "bfloat16",
        "optimizer": "adamw",
        "device_figures": result.device.name,
        "num_params": result.num_params,
        "wall_seconds": wall,
        "trace_seconds": result.trace_seconds,
        "plan_seconds": result.plan_seconds,
        "max_rss_bytes": max_rss,
        "unplanned_peak_bytes": result.unplanned_peak_bytes,
        "rows": [r.__dict__ for r in result.rows],
        "targets": {"wall_seconds": 60, "max_rss_bytes": 8 * 2**30},
    }
    path = write_result("plan_llama7b", payload, torch.device("cpu"))
    print(f"llama-7b planned in {wall:.1f} s (trace {result.trace_seconds:.1f} s), max RSS {max_rss / 2**30:.2f} GiB")
    print(f"written {path}")


if __name__ == "__main__":
    main()
