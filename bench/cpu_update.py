"""The host optimizer update against the memory-bandwidth limit, side by side in one run.

For 50M and 200M fp32 parameters (16 tensors each, gradients set, AdamW ``lr=1e-3``): one update
with ``torch.optim.AdamW`` (for-loop, ``foreach=True``, ``fused=True``), with trinity's
``CPUOptimizer`` (default ``implementation="exact"``: torch's for-loop in cache-sized pieces;
``implementation="fastest"``: torch's fused kernel; master copies and gradients in host memory as
with ``offload="all"``, timed from ``step()`` until the worker is done), and with DeepSpeed's
``DeepSpeedCPUAdam`` when ``--deepspeed-python`` names an interpreter where it builds.

For each: seconds (median over ``--rounds`` rounds of ``--reps`` steps, variants interleaved per
round so load drifts hit all alike; each on a fresh thread with the process's intra-op thread
count, as ``CPUOptimizer``'s worker), parameters per second, and the fraction of the bandwidth
floor: ``28 bytes/param x parameters / host bandwidth``, the host bandwidth the best that
:func:`offload_compiler.calibrate.stream_bytes_per_s` measured in the run (STREAM's kernels and
DAXPY over arrays of 4 x the last-level cache, write-allocate counted, best of ``--reps`` runs
each; measured at the start of each round at every thread count up to the process's, as
``calibrate`` does). The best, not the median: the floor is what the memory system can deliver,
and on a shared machine the median of a probe falls with the load (the committed 50M and 200M
results of 2026-12-01 took the median of 12-byte triads under a load average of 14 and put the
fused AdamW and CPUOptimizer updates at 1.4-2.9x "of the floor"). The machine may be shared: the result records the load.

``python -m bench.cpu_update`` writes ``bench/results/cpu_update.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from offload_compiler.calibrate import (
    _in_thread,
    host_update_seconds,
    stream_kernels_bytes_per_s,
    stream_numel,
    thread_counts,
)
from offload_compiler.devices import ADAMW_BYTES_PER_PARAM

from .common import write_result

TENSORS = 16

_DS_SCRIPT = r"""
import json, statistics, sys, time, torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
numel, reps, tensors = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
ps = [torch.nn.Parameter(torch.randn(numel // tensors)) for _ in range(tensors)]
for p in ps:
    p.grad = torch.randn_like(p)
opt = DeepSpeedCPUAdam(ps, lr=1e-3, adamw_mode=True)
samples = []
def body():
    for i in range(reps + 1):
        t0 = time.perf_counter(); opt.step(); dt = time.perf_counter() - t0
        if i:
            samples.append(dt)
import threading
t = threading.Thread(target=body); t.start(); t.join()  # on a fresh thread, as every variant here
print(json.dumps(samples))
"""


def _torch_step(numel: int, reps: int, **kw) -> list[float]:
    ps = [torch.nn.Parameter(torch.randn(numel // TENSORS)) for _ in range(TENSORS)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(ps, lr=1e-3, **kw)
    samples = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        opt.step()
        dt = time.perf_counter() - t0
        if i:
            samples.append(dt)
    return samples


def _trinity_step(numel: int, reps: int, implementation: str) -> list[float]:
    return host_update_seconds(numel, implementation, reps=reps, num_tensors=TENSORS, all_samples=True)


def _deepspeed_step(python: str, numel: int, reps: int) -> list[float] | str:
    out = subprocess.run(
        [python, "-c", _DS_SCRIPT, str(numel), str(reps), str(TENSORS)], capture_output=True, text=True, timeout=1800
    )
    if out.returncode:
        return out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="50e6,200e6", help="parameter counts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--deepspeed-python", default=None, help="a Python where deepspeed's CPU Adam builds")
    parser.add_argument("--deepspeed-note", default="not run", help="why DeepSpeedCPUAdam is missing, if it is")
    parser.add_argument("--name", default="cpu_update", help="result file name (bench/results/NAME.json)")
    args = parser.parse_args(argv)
    variants = {
        "torch AdamW for-loop (default)": lambda n: _torch_step(n, args.reps),
        "torch AdamW foreach=True": lambda n: _torch_step(n, args.reps, foreach=True),
        "torch AdamW fused=True": lambda n: _torch_step(n, args.reps, fused=True),
        "trinity CPUOptimizer (exact, default)": lambda n: _trinity_step(n, args.reps, "exact"),
        "trinity CPUOptimizer(implementation='fastest')": lambda n: _trinity_step(n, args.reps, "fastest"),
    }
    if args.deepspeed_python:
        variants["DeepSpeedCPUAdam (adamw_mode)"] = lambda n: _deepspeed_step(args.deepspeed_python, n, args.reps)
    results = []
    load_before = os.getloadavg()
    for size in (int(float(s)) for s in args.sizes.split(",")):
        samples: dict[str, list[float]] = {k: [] for k in variants}
        errors: dict[str, str] = {}
        bandwidth = []
        kernels = []
        for rnd in range(args.rounds):
            for t in thread_counts(torch.get_num_threads()):
                by_kernel = stream_kernels_bytes_per_s(stream_numel(), max(2, args.reps), t)
                kernels.append({"threads": t, **by_kernel})
                bandwidth.append(max(by_kernel.values()))
                gc.collect()
            for name, fn in variants.items():
                if name in errors:
                    continue
                # Every variant on a fresh thread with the process's intra-op thread count (as
                # CPUOptimizer's worker): on this machine torch's OpenMP team of the main thread
                # ran element-wise ops up to 100x slower under load than the same team on a new thread.
                got = (
                    fn(size)
                    if name.startswith("DeepSpeed")
                    else _in_thread(lambda fn=fn, size=size: fn(size), torch.get_num_threads())
                )
                if isinstance(got, str):
                    errors[name] = got
                else:
                    samples[name].extend(got)
                gc.collect()
                print(
                    f"  {size / 1e6:.0f}M round {rnd}: {name}: {statistics.median(got) * 1e3 if not isinstance(got, str) else got}",
                    flush=True,
                )
        bw = max(bandwidth)
        floor = ADAMW_BYTES_PER_PARAM * size / bw
        for name in variants:
            if name in errors:
                results.append({"params": size, "variant": name, "error": errors[name]})
                continue
            sec = statistics.median(samples[name])
            results.append(
                {
                    "params": size,
                    "variant": name,
                    "seconds": sec,
                    "params_per_s": size / sec,
                    "fraction_of_floor": floor / sec,
                    "samples": samples[name],
                }
            )
            print(
                f"{size / 1e6:5.0f}M {name:48s} {sec * 1e3:8.1f} ms {size / sec / 1e6:7.0f} M/s {floor / sec:6.1%} of floor"
            )
        results.append(
            {
                "params": size,
                "bandwidth_bytes_per_s": bw,
                "bandwidth_samples": bandwidth,
                "bandwidth_by_kernel": kernels,
                "stream_array_bytes": 4 * stream_numel(),
                "floor_seconds": floor,
            }
        )
    payload = {
        "threads": torch.get_num_threads(),
        "tensors": TENSORS,
        "floor": (
            f"{ADAMW_BYTES_PER_PARAM} bytes/param / the best host bandwidth measured in this run "
            "(calibrate.stream_bytes_per_s: STREAM copy/scale/add/triad with write-allocate, and DAXPY)"
        ),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "shared_machine": "other developers' jobs ran on this 2-core machine during the measurement",
        "deepspeed": args.deepspeed_note if not args.deepspeed_python else f"run with {args.deepspeed_python}",
        "results": results,
    }
    path = write_result(args.name, payload, torch.device("cpu"))
    print(f"written {path}")
    return payload


if __name__ == "__main__":
    sys.exit(main() and 0)
