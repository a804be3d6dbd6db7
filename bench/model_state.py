"""Largest GPT depth whose training step fits a fixed device budget: eager AdamW against trinity
with ``offload="all"`` (parameters, gradients, optimizer state in host memory, activations
planned to the same budget, the AdamW step on the CPU).

Measured, not predicted: every depth is built, trained for two steps, and the third step's peak
device bytes are measured (on CPU: trinity's allocator-trace accounting, host pool excluded; on
CUDA: the caching allocator's peak).

* eager: forward + backward + ``torch.optim.AdamW.step()``, with parameters and the optimizer's
  state resident on the device (they are, between steps) and gradients made by the step.
* trinity ``"all"``: forward + backward (nothing resident between steps: parameters are fetched
  around their uses, gradients go to host as produced); ``CPUOptimizer.step()`` runs on the host
  and is not device memory (on this CPU machine its temporaries would be counted as "device", so
  it runs outside the measured region, after the step, as on a GPU machine it runs on the host).

``python -m bench.model_state [--budget-mib 24] [--max-depth 48]`` writes
``bench/results/model_state_<device>.json``.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.nn.functional as F

from offload_compiler import CPUOptimizer, measure_peak_device_bytes
from offload_compiler.models import GPT, GPTConfig

from .common import write_result

__all__ = ["measure_eager", "measure_trinity", "largest_depth", "main"]


def _config(depth: int, width: int, seq: int, vocab: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, block_size=seq, n_layer=depth, n_head=4, n_embd=width, tie_weights=True)


def _batch(cfg: GPTConfig, batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    return idx, torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)


def _loss(model, idx, t):
    return F.cross_entropy(model(idx).flatten(0, 1), t.flatten())


def measure_eager(cfg: GPTConfig, batch: int) -> dict:
    """Peak device bytes (and step seconds) of an eager AdamW training step."""
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(seed):
        idx, t = _batch(cfg, batch, seed)
        opt.zero_grad(set_to_none=True)
        _loss(model, idx, t).backward()
        opt.step()

    for s in range(2):
        step(s)
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    opt.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    m = measure_peak_device_bytes(lambda: step(2), resident=list(model.parameters()) + state)
    return {"peak_bytes": m.peak_bytes, "step_seconds": time.perf_counter() - t0}


def measure_trinity(cfg: GPTConfig, batch: int, budget: int) -> dict:
    """Peak device bytes (and step seconds) of a trinity ``offload="all"`` training step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(cfg)
    options = {
        "inner": "eager",
        "offload": "all",
        "memory_budget": budget,
        "on_infeasible": "warn",
        "min_offload_bytes": 0,
        "verify": False,
    }
    compiled = torch.compile(model, backend="trinity", options=options)
    opt = CPUOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)

    def fwd_bwd(seed):
        idx, t = _batch(cfg, batch, seed)
        _loss(compiled, idx, t).backward()

    t_compile = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(2):
            fwd_bwd(s)
            opt.step()
            opt.zero_grad()
    t_compile = time.perf_counter() - t_compile
    opt.synchronize()
    t0 = time.perf_counter()
    m = measure_peak_device_bytes(lambda: fwd_bwd(2), resident=[])
    opt.step()
    opt.synchronize()
    return {
        "peak_bytes": m.peak_bytes,
        "step_seconds": time.perf_counter() - t0,
        "warmup_seconds": t_compile,
        "host_pool_bytes_during_step": m.host_pool_bytes,
    }


def largest_depth(measure, budget: int, max_depth: int, log) -> tuple[int, list[dict]]:
    """The largest depth in ``1..max_depth`` whose measured peak is within ``budget`` (peaks
    grow with depth: ``max_depth`` first, then doubling and bisection). Returns ``(depth, rows)``;
    depth 0 when none fits, ``max_depth`` when it fits (the true answer may be larger)."""
    rows: list[dict] = []
    cache: dict[int, bool] = {}

    def fits(d: int) -> bool:
        if d not in cache:
            r = measure(d)
            r["depth"] = d
            r["fits"] = r["peak_bytes"] <= budget
            rows.append(r)
            log(f"  depth {d:4d}: peak {r['peak_bytes'] / 2**20:8.2f} MiB {'fits' if r['fits'] else 'over'}")
            cache[d] = r["fits"]
        return cache[d]

    if not fits(1):
        return 0, rows
    if fits(max_depth):  # the search is bounded: the answer is "at least max_depth"
        return max_depth, sorted(rows, key=lambda r: r["depth"])
    lo, hi = 1, 2
    while hi <= max_depth and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, max_depth + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, sorted(rows, key=lambda r: r["depth"])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-mib", type=float, default=24.0, help="device budget (MiB)")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--max-depth", type=int, default=48)
    args = parser.parse_args(argv)
    budget = int(args.budget_mib * 2**20)

    def cfg(d):
        return _config(d, args.width, args.seq, args.vocab)

    print(f"budget {args.budget_mib} MiB; eager AdamW:")
    eager_depth, eager_rows = largest_depth(lambda d: measure_eager(cfg(d), args.batch), budget, args.max_depth, print)
    print('trinity offload="all":')
    trinity_depth, trinity_rows = largest_depth(
        lambda d: measure_trinity(cfg(d), args.batch, budget), budget, args.max_depth, print
    )
    ratio = trinity_depth / eager_depth if eager_depth else None
    print(f"largest depth: eager {eager_depth}, trinity {trinity_depth} ({ratio}x)")
    payload = {
        "budget_bytes": budget,
        "model": {
            "width": args.width,
            "seq": args.seq,
            "batch": args.batch,
            "vocab": args.vocab,
            "tie_weights": True,
            "params_per_layer": 12 * args.width**2 + 13 * args.width,
        },
        "max_depth_searched": args.max_depth,
        "eager": {"largest_depth": eager_depth, "rows": eager_rows},
        "trinity_all": {"largest_depth": trinity_depth, "rows": trinity_rows},
        "depth_ratio": ratio,
        "target_ratio": 6.5,
    }
    path = write_result(f"model_state_{'cuda' if torch.cuda.is_available() else 'cpu'}", payload, torch.device("cpu"))
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
