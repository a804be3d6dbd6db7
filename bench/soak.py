"""Soak: many training steps of the demo GPT under trinity, recording whether anything drifts.

Per sampled step: the host pool's held bytes and allocation count, the transfer runtime's pending
copies, and (at a few steps) the measured peak device bytes of one forward and backward. Counts
how many times the backend compiled (a counting wrapper around trinity). Writes
``bench/results/soak_<device>.json``.

``python -m bench.soak [--steps 1000] [--inner inductor|eager] [--budget 50%]``
"""

from __future__ import annotations

import argparse
import time

import torch

from .common import OtherLoad, write_result

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the soak; returns 1 when the pool, the peak or the compile count drifted."""
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--inner", choices=["inductor", "eager"], default="inductor")
    parser.add_argument("--budget", default="50%")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--sample-every", type=int, default=50)
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)

    import offload_compiler
    from offload_compiler.backend import trinity
    from offload_compiler.demo import Batches, _LossModel, load_corpus
    from offload_compiler.models import GPT, GPTConfig

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = GPTConfig(vocab_size=256, block_size=args.seq_len, n_layer=args.layers, n_head=4, n_embd=args.width)
    batches = Batches(load_corpus(), args.batch_size, args.seq_len)
    torch.manual_seed(0)
    model = _LossModel(GPT(cfg)).to(device)
    options = {"memory_budget": args.budget, "inner": args.inner}
    calls = [0]

    def backend(gm, example_inputs):
        calls[0] += 1
        return trinity(gm, example_inputs, options=options)

    before = len(offload_compiler.reports())
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    measure_at = sorted({1, args.steps // 4, args.steps // 2, 3 * args.steps // 4, args.steps - 1})
    samples, peaks, losses = [], {}, {}
    t_start = time.perf_counter()
    with OtherLoad() as load:
        for step in range(args.steps):
            x, y = batches.batch(step, device)
            if step in measure_at:
                resident = list(model.parameters()) + [x, y]
                m = offload_compiler.measure_peak_device_bytes(
                    lambda x=x, y=y: compiled(x, y).backward(), resident=resident, device=device
                )
                peaks[step] = m.peak_bytes
                opt.zero_grad(set_to_none=True)
            loss = compiled(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % args.sample_every == 0 or step == args.steps - 1:
                reports = offload_compiler.reports()[before:]
                stats = [r.runtime_stats() for r in reports]
                samples.append(
                    {
                        "step": step,
                        "host_pool_held_bytes": sum(s.host_pool.held_bytes for s in stats),
                        "host_pool_allocations": sum(s.host_pool.num_allocations for s in stats),
                        "pending_copies": sum(s.pending_copies for s in stats),
                        "num_evicts": sum(s.num_evicts for s in stats),
                    }
                )
                losses[step] = loss.item()
                print(f"step {step}: {samples[-1]} loss {losses[step]:.4f}", flush=True)
    seconds = time.perf_counter() - t_start
    reports = offload_compiler.reports()[before:]
    after_first = samples[1:]
    pool_flat = (
        len({s["host_pool_held_bytes"] for s in after_first}) <= 1
        and len({s["host_pool_allocations"] for s in after_first}) <= 1
    )
    later_peaks = [v for k, v in peaks.items() if k > 1]
    peak_flat = len(set(later_peaks)) <= 1
    ok = pool_flat and peak_flat and calls[0] == 1 and all(s["pending_copies"] == 0 for s in samples)
    payload = {
        "model": f"GPT {args.layers} layers, width {args.width}, seq {args.seq_len}, batch {args.batch_size}",
        "steps": args.steps,
        "inner": args.inner,
        "budget": args.budget,
        "seconds": round(seconds, 1),
        "other_load": load.fraction,
        "compilations": calls[0],
        "num_reports": len(reports),
        "budget_bytes": [r.budget_bytes for r in reports],
        "num_evicted": [r.num_evicted for r in reports],
        "measured_peak_bytes": {str(k): v for k, v in peaks.items()},
        "samples": samples,
        "losses": {str(k): v for k, v in losses.items()},
        "host_pool_flat_after_first_sample": pool_flat,
        "peak_flat_after_step_1": peak_flat,
        "ok": ok,
    }
    path = write_result(f"soak_{device.type}", payload, device)
    print(
        f"{args.steps} steps in {seconds:.0f} s; compilations {calls[0]}; pool flat {pool_flat}; "
        f"peak flat {peak_flat} ({sorted(set(peaks.values()))}); wrote {path}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    import sys

    sys.exit(main())
