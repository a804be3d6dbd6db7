"""Measured peak device bytes of the demo GPT's training step against eager and the same inner
compiler without trinity, at budgets 25%, 50% and 75%.

On CPU the peak is trinity's allocator-trace accounting (host pool excluded); on CUDA the caching
allocator's peak. One forward and backward per measurement, after two warm-up steps.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

import offload_compiler
from offload_compiler import measure_peak_device_bytes
from offload_compiler.models import GPT, GPTConfig

from .common import write_result


class LossModel(torch.nn.Module):
    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, x, y):
        return F.cross_entropy(self.gpt(x).flatten(0, 1), y.flatten())


def measure(name, model, fn, x, y, device, steps=5) -> dict:
    for _ in range(2):
        fn(x, y).backward()
        model.zero_grad(set_to_none=True)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(x, y).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    m = measure_peak_device_bytes(
        lambda: fn(x, y).backward(), resident=list(model.parameters()) + [x, y], device=device
    )
    model.zero_grad(set_to_none=True)
    return {"method": name, "peak_bytes": m.peak_bytes, "median_step_seconds": statistics.median(times)}


def run(
    inner: str = "inductor", budgets=("25%", "50%", "75%"), layers=4, width=128, seq=128, batch=16, device=None
) -> dict:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    base = LossModel(GPT(GPTConfig(vocab_size=256, block_size=seq, n_layer=layers, n_head=4, n_embd=width))).to(device)
    x = torch.randint(0, 256, (batch, seq), device=device)
    y = torch.randint(0, 256, (batch, seq), device=device)
    rows = []
    torch._dynamo.reset()
    m = copy.deepcopy(base)
    rows.append(measure("eager", m, m, x, y, device))
    reference = "aot_eager" if inner == "eager" else "inductor"
    torch._dynamo.reset()
    m = copy.deepcopy(base)
    rows.append(measure(f"torch.compile({reference})", m, torch.compile(m, backend=reference), x, y, device))
    for budget in budgets:
        torch._dynamo.reset()
        m = copy.deepcopy(base)
        before = len(offload_compiler.reports())
        with warnings.catch_warnings(record=True):
            compiled = torch.compile(
                m,
                backend="trinity",
                options={"memory_budget": budget, "inner": inner, "on_infeasible": "warn"},
            )
            row = measure(f"trinity {budget}", m, compiled, x, y, device)
        r = offload_compiler.reports()[before]
        row.update(
            budget=budget,
            budget_bytes=r.budget_bytes,
            planned_peak_bytes=r.peak_bytes_planned,
            feasible=r.feasible,
            evicted_bytes=r.evicted_bytes,
            within_budget=row["peak_bytes"] <= r.budget_bytes,
        )
        rows.append(row)
    eager_peak = rows[0]["peak_bytes"]
    for row in rows:
        row["peak_vs_eager"] = row["peak_bytes"] / eager_peak
    return {
        "model": {"layers": layers, "width": width, "seq": seq, "batch": batch},
        "inner": inner,
        "rows": rows,
        "note": "on CPU, step times include synchronous host copies (memcpy) and say nothing about overlap",
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inner", choices=["inductor", "eager"], default="inductor")
    args = parser.parse_args(argv)
    result = run(args.inner)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = write_result(f"peak_vs_budget_{args.inner}_{device.type}", result, device)
    print(f"{'method':28s} {'peak':>12s} {'vs eager':>9s} {'budget':>12s} {'step':>9s}")
    for row in result["rows"]:
        budget = f"{row['budget_bytes'] / 2**20:.2f} MiB" if row.get("budget_bytes") else ""
        print(
            f"{row['method']:28s} {row['peak_bytes'] / 2**20:9.2f} MiB {row['peak_vs_eager']:9.2f} {budget:>12s} "
            f"{row['median_step_seconds'] * 1e3:7.1f} ms"
        )
    print(f"written {path}")


if __name__ == "__main__":
    main()
