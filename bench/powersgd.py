"""Gradient compression on 2 processes (gloo, this machine): plain DDP, torch's PowerSGD at a
fixed rank, and trinity's adaptive PowerSGD hook, each training the demo GPT for the same steps
from the same weights on the same batches, one after another in the same two processes.

Reports, per method: bytes all-reduced per step (counted where the hooks call the collectives),
the final training loss (mean of the last 10 steps over both ranks), a held-out loss (8 fixed
batches), the median step time, and the loss curves (PNG). Targets: the adaptive hook sends at
most 25% of plain DDP's bytes and its losses are within 2% of plain DDP's.

torch's PowerSGD runs with one bucket (``bucket_cap_mb=64``): with several it can hang on gloo
(TORCH_NOTES). The adaptive hook runs with several (``bucket_cap_mb=1``: 4 buckets here),
which is what its collective ordering is for.

``python -m bench.powersgd [--steps 200]``
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .common import RESULTS, OtherLoad, write_result

METHODS = ("ddp", "powersgd-fixed", "adaptive")
TARGETS = {"bytes_ratio_max": 0.25, "loss_rel_diff_max": 0.02}


def _worker(args) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from offload_compiler.comm import AdaptivePowerSGDState, adaptive_powersgd_hook
    from offload_compiler.demo import Batches, load_corpus
    from offload_compiler.models import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    counted = {"bytes": 0}
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *a, **kw):
        counted["bytes"] += tensor.numel() * tensor.element_size()
        return real_all_reduce(tensor, *a, **kw)

    # torch's hooks (default_hooks.allreduce_hook, powerSGD_hook) all-reduce through
    # dist.all_reduce: count the bytes there. The adaptive hook counts its own.
    dist.all_reduce = counting_all_reduce
    corpus = load_corpus()
    cfg = GPTConfig(vocab_size=256, block_size=args.seq_len, n_layer=4, n_head=4, n_embd=128)
    results = {}
    for method in args.methods.split(","):
        torch.manual_seed(0)
        model = GPT(cfg)
        state = None
        if method == "ddp":
            ddp = DDP(model)
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        elif method == "powersgd-fixed":
            ddp = DDP(model, bucket_cap_mb=64)
            state = psgd.PowerSGDState(None, matrix_approximation_rank=args.fixed_rank, start_powerSGD_iter=args.warmup)
            ddp.register_comm_hook(state, psgd.powerSGD_hook)
        elif method == "adaptive":
            ddp = DDP(model, bucket_cap_mb=1)
            state = AdaptivePowerSGDState(
                None,
                warmup_steps=args.warmup,
                reevaluate_every=args.reevaluate_every,
                rank_scale=args.rank_scale,
                min_rank=args.min_rank,
            )
            ddp.register_comm_hook(state, adaptive_powersgd_hook)
        else:
            raise SystemExit(f"unknown method {method!r}; one of {', '.join(METHODS)}")
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        data = Batches(corpus, args.batch, args.seq_len, seed=rank + 1)
        losses, times, step_bytes = [], [], []
        for step in range(args.steps):
            x, y = data.batch(step, torch.device("cpu"))
            before = counted["bytes"]
            t0 = time.perf_counter()
            loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            step_bytes.append(counted["bytes"] - before)
            mean = torch.tensor([loss.item()], dtype=torch.float64)
            real_all_reduce(mean)
            losses.append(mean.item() / dist.get_world_size())
        if method == "adaptive":
            step_bytes = list(state.bytes_per_step)  # its own collectives bypass dist.all_reduce
        held_out = Batches(corpus, args.batch, args.seq_len, seed=10_000)
        with torch.no_grad():
            ev = [F.cross_entropy(model(xx).flatten(0, 1), yy.flatten()).item() for xx, yy in
                  (held_out.batch(i, torch.device("cpu")) for i in range(8))]  # fmt: skip
        w = torch.cat([p.detach().flatten() for p in model.parameters()])
        ws = [torch.empty_like(w) for _ in range(dist.get_world_size())]
        dist.all_gather(ws, w)
        results[method] = {
            "losses": losses,
            "step_seconds": times,
            "bytes_per_step": step_bytes,
            "eval_loss": statistics.mean(ev),
            "replicas_identical": all(torch.equal(ws[0], o) for o in ws[1:]),
            "ranks": {str(k): v for k, v in state.ranks.items()} if method == "adaptive" else None,
            "stable_ranks": {
                str(k): [round(x, 2) if x == x else None for x in v] for k, v in state.stable_ranks.items()
            }
            if method == "adaptive"
            else None,
            "buckets": len(state.ranks) if method == "adaptive" else None,
        }
        del ddp
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _png(results: dict, path: Path, steps: int) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    names = {"ddp": "plain DDP", "powersgd-fixed": "torch PowerSGD (fixed rank)", "adaptive": "adaptive PowerSGD"}
    for method, r in results.items():
        ax.plot(
            range(len(r["losses"])), r["losses"], lw=1, label=f"{names[method]} ({r['bytes_ratio']:.1%} of DDP bytes)"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean of 2 ranks)")
    ax.set_title(f"demo GPT, 2 processes (gloo), {steps} steps")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.powersgd", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20, help="full-rank steps first (both PowerSGD hooks)")
    p.add_argument("--fixed-rank", type=int, default=4)
    p.add_argument("--reevaluate-every", type=int, default=50)
    p.add_argument("--rank-scale", type=float, default=4.0)
    p.add_argument("--min-rank", type=int, default=2)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--timeout", type=int, default=1200, help="seconds before the run is killed (a hang fails)")
    p.add_argument("--no-write", action="store_true", help="print only; do not write bench/results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        forward = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--no-write"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(port), "-m", "bench.powersgd", "--worker", "--out", str(out), *forward]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = str(RESULTS.parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
        t0 = time.perf_counter()
        with OtherLoad() as load:
            subprocess.run(cmd, env=env, check=True, timeout=args.timeout, cwd=RESULTS.parent.parent)
        wall = time.perf_counter() - t0
        results = json.loads(out.read_text())
    ddp = results.get("ddp")
    summary = {}
    for method, r in results.items():
        warm = r["step_seconds"][5:] or r["step_seconds"]
        r["median_step_seconds"] = statistics.median(warm)
        r["mean_bytes_per_step"] = statistics.mean(r["bytes_per_step"])
        r["final_loss"] = statistics.mean(r["losses"][-10:])
        if ddp is not None:
            r["bytes_ratio"] = sum(r["bytes_per_step"]) / sum(ddp["bytes_per_step"])
            r["final_loss_rel_diff"] = r["final_loss"] / statistics.mean(ddp["losses"][-10:]) - 1
            r["eval_loss_rel_diff"] = r["eval_loss"] / ddp["eval_loss"] - 1
        summary[method] = {k: r[k] for k in r if k not in ("losses", "step_seconds", "bytes_per_step")}
    verdict = None
    if ddp is not None and "adaptive" in results:
        a = results["adaptive"]
        verdict = {
            "bytes_ratio": a["bytes_ratio"],
            "bytes_ratio_met": a["bytes_ratio"] <= TARGETS["bytes_ratio_max"],
            "final_loss_rel_diff": a["final_loss_rel_diff"],
            "eval_loss_rel_diff": a["eval_loss_rel_diff"],
            "loss_met": abs(a["final_loss_rel_diff"]) <= TARGETS["loss_rel_diff_max"]
            and abs(a["eval_loss_rel_diff"]) <= TARGETS["loss_rel_diff_max"],
        }
    print(f"{'method':16s} {'bytes/step':>12s} {'vs DDP':>8s} {'final loss':>10s} {'held-out':>9s} {'step':>9s}")
    for method, r in results.items():
        print(
            f"{method:16s} {r['mean_bytes_per_step']:12.0f} {r.get('bytes_ratio', 1):8.1%} {r['final_loss']:10.4f} "
            f"{r['eval_loss']:9.4f} {r['median_step_seconds'] * 1e3:7.1f}ms"
        )
    if verdict:
        print(f"adaptive: {verdict}")
    if args.no_write:
        return 0
    payload = {
        "command": " ".join(["python -m bench.powersgd", *(argv if argv is not None else sys.argv[1:])]),
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "out", "no_write")},
        "model": "demo GPT (4 layers, width 128, byte vocabulary)",
        "processes": 2,
        "backend": "gloo over 127.0.0.1, OMP_NUM_THREADS=1 per process",
        "machine_note": "2-core machine shared with other developers: step times are noisy; bytes and losses are not",
        "other_load_fraction": load.fraction,
        "wall_seconds": wall,
        "targets": TARGETS,
        "verdict": verdict,
        "summary": summary,
        "curves": {m: {"losses": r["losses"], "bytes_per_step": r["bytes_per_step"]} for m, r in results.items()},
    }
    path = write_result("powersgd_cpu", payload, torch.device("cpu"))
    png = _png(results, RESULTS / "powersgd_loss_cpu.png", args.steps)
    print(f"written {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
