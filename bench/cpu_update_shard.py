"""The host optimizer update under data parallelism: every rank updating every parameter, against
``CPUOptimizer(shard_group=...)`` (each rank its share, then the exchange), side by side in one run.

Two ranks (processes on this machine, gloo over a file store), each with the same ``--params``
fp32 parameters in 16 tensors, offloaded as with ``offload="all"`` (master copies and host
gradients in a host pool), the same gradients on both ranks (what DDP's averaging leaves). Per
round, interleaved so drifts of the machine hit both alike: one ``step()`` + ``synchronize()`` of
``CPUOptimizer(AdamW)`` unsharded and one sharded over a gloo group of its own. Reported per
variant: seconds (median over rounds, slowest rank of each step), the exchange's share
(``CPUOptimizer.exchange_seconds``), the optimizer state bytes each rank holds, and whether the
two variants' parameters are bit-equal after the run.

Each rank's update runs on ``--threads`` intra-op threads (default 1: two ranks on this 2-core
machine; on a real node each rank has its own cores, so the sharded update's share is what
shrinks with more ranks, and the exchange is the cost added).

``python -m bench.cpu_update_shard [--params 50e6] [--rounds 5]`` writes
``bench/results/cpu_update_shard.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from offload_compiler import CPUOptimizer
from offload_compiler.runtime.model_state import ensure_slot, slot_of
from offload_compiler.runtime.pool import HostPool

from .common import write_result

TENSORS = 16


def _offloaded(numel: int, pool: HostPool) -> list[torch.nn.Parameter]:
    """``TENSORS`` parameters of ``numel`` elements in all (the same values on every rank), with host
    master copies and host gradients as ``offload="all"`` makes them."""
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(numel // TENSORS, generator=g)) for _ in range(TENSORS)]
    for p in ps:
        slot = ensure_slot(p, pool, keep_resident=False)
        slot.enable_host_grad()
        slot.release(write_back=False)
    return ps


def _give_grads(ps, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in ps:
        s = slot_of(p)
        s.grad.copy_(torch.randn(s.grad.shape, generator=g))
        s.grad_valid = True


def _state_bytes(opt: CPUOptimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for st in opt.state_dict()["state"].values()
        for v in st.values()
        if isinstance(v, torch.Tensor)
    )


def _worker(rank: int, world: int, store: str, numel: int, rounds: int, threads: int, out: str) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        group = dist.new_group(backend="gloo")
        pool = HostPool(4 * numel * 4 + (1 << 26), pin_memory=False, on_full="error")
        variants = {
            "unsharded": (
                ps := _offloaded(numel, pool),
                CPUOptimizer(ps, torch.optim.AdamW, lr=1e-3, num_threads=threads),
            ),
            "sharded": (
                qs := _offloaded(numel, pool),
                CPUOptimizer(qs, torch.optim.AdamW, lr=1e-3, num_threads=threads, shard_group=group),
            ),
        }
        seconds: dict[str, list[float]] = {k: [] for k in variants}
        exchange: list[float] = []
        for step in range(rounds + 1):  # the first step builds the optimizers (not timed)
            for name, (params, opt) in variants.items():
                _give_grads(params, step)
                dist.barrier()
                t0 = time.perf_counter()
                opt.step()
                opt.synchronize()
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the step waits for the slowest rank
                if step:
                    seconds[name].append(dt.item())
                    if name == "sharded":
                        exchange.append(opt.exchange_seconds)
        equal = all(
            torch.equal(slot_of(p).master, slot_of(q).master)
            for p, q in zip(variants["unsharded"][0], variants["sharded"][0])
        )
        result = {
            "rank": rank,
            "seconds": seconds,
            "exchange_seconds": exchange,
            "state_bytes": {name: _state_bytes(opt) for name, (_, opt) in variants.items()},
            "bit_equal": equal,
            "shard": variants["sharded"][1].shard,
        }
    finally:
        dist.destroy_process_group()
    Path(f"{out}.{rank}").write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_update_shard", description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="50e6", help="parameters per rank (fp32)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--world", type=int, default=2, help="ranks (processes)")
    parser.add_argument("--name", default="cpu_update_shard", help="result file name (bench/results/NAME.json)")
    args = parser.parse_args(argv)
    numel = int(float(args.params))
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out")
        mp.start_processes(
            _worker,
            args=(args.world, str(Path(tmp) / "store"), numel, args.rounds, args.threads, out),
            nprocs=args.world,
            join=True,
            start_method="spawn",
        )
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(args.world)]
    rows = {}
    for name in ("unsharded", "sharded"):
        sec = statistics.median(ranks[0]["seconds"][name])
        rows[name] = {
            "seconds": sec,
            "params_per_s_per_rank": numel / sec,
            "state_bytes_per_rank": [r["state_bytes"][name] for r in ranks],
            "samples": ranks[0]["seconds"][name],
        }
        print(
            f"{name:9s} {sec * 1e3:8.1f} ms per step, optimizer state per rank "
            f"{[round(b / 2**20, 1) for b in rows[name]['state_bytes_per_rank']]} MiB"
        )
    rows["sharded"]["exchange_seconds_per_rank"] = [statistics.median(r["exchange_seconds"]) for r in ranks]
    print(f"sharded exchange per rank: {[round(x * 1e3, 1) for x in rows['sharded']['exchange_seconds_per_rank']]} ms")
    payload = {
        "params": numel,
        "tensors": TENSORS,
        "world": args.world,
        "threads_per_rank": args.threads,
        "optimizer": "torch.optim.AdamW(lr=1e-3), CPUOptimizer implementation='exact' (for-loop in 512 KiB pieces)",
        "results": rows,
        "speedup": rows["unsharded"]["seconds"] / rows["sharded"]["seconds"],
        "bit_equal_on_every_rank": all(r["bit_equal"] for r in ranks),
        "shard": [r["shard"] for r in ranks],
        "note": __doc__,
    }
    print(f"speedup {payload['speedup']:.2f}x, bit-equal: {payload['bit_equal_on_every_rank']}")
    path = write_result(args.name, payload, torch.device("cpu"))
    print(f"written {path}")
    return payload


if __name__ == "__main__":
    main()
