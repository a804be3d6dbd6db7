"""Simulated backward step time of the demo GPT with 2 (and 3) compute streams against 1.

Traces the demo's training step (``python -m offload_compiler demo`` defaults: 4 layers, width
128, 4 heads, sequence 128, batch 16, vocab 256, fp32) on fake tensors, runs ``assign_streams``
on the backward graph against a GPU's figures from the device table (no offloading, so that the
number is the streams' alone) and reports the simulated backward time of each stream count and
the ratio to one stream. Nothing runs on a device: this is the cost model's prediction (see
``offload_compiler/passes/assign_streams.py`` for the event cost it assumes). Seconds.

    python -m bench.streams [--devices h100-sxm a100-80gb l4] [--layers 4] [--batch 16]
    python -m bench.streams --measure [--steps 20]   # also time real steps (CUDA when present)

``--measure`` also runs real training steps of the same model with ``backend="trinity"``
(``inner="eager"``, no budget, ``num_streams`` 1, 2, 3) on CUDA when it is there, else on the
CPU (where streams are ordered no-ops: the times then only show the stream ops' own overhead),
and records the median step time next to the prediction for the detected device. Results go to
``bench/results/streams_<device type>.json``.
"""

from __future__ import annotations

import argparse
import copy

import torch

from offload_compiler.devices import lookup_device
from offload_compiler.models import GPT, GPTConfig
from offload_compiler.passes import assign_streams, reorder
from offload_compiler.trace import trace_training_step

from .common import write_result


def backward_seconds(device, layers: int, width: int, seq: int, batch: int) -> dict:
    """Simulated backward seconds with 1, 2 and 3 streams on ``device``'s figures (a device-table
    name or a :class:`~offload_compiler.devices.DeviceSpec`)."""
    spec = lookup_device(device) if isinstance(device, str) else device
    device = device if isinstance(device, str) else spec.name
    cfg = GPTConfig(vocab_size=256, block_size=seq, n_layer=layers, n_head=4, n_embd=width)
    traced = trace_training_step(lambda: GPT(cfg), batch, seq, 256, torch.float32)
    bw = traced.pair.backward
    reorder.hoist_frees(bw)
    row: dict = {"device": device, "device_figures": spec.name}
    for n in (1, 2, 3):
        gm = copy.deepcopy(bw)
        secs, copies = assign_streams.graph_seconds(gm, spec)
        plan = assign_streams.plan(gm, n, secs, copies)
        row[f"streams_{n}"] = {
            "seconds": plan.seconds,
            "streams_used": plan.used_streams,
            "events": plan.num_events,
            "side_stream_nodes": sum(1 for _, s in plan.streams if s != 0),
        }
    one = row["streams_1"]["seconds"]
    row["ratio_2_vs_1"] = row["streams_2"]["seconds"] / one
    row["ratio_3_vs_1"] = row["streams_3"]["seconds"] / one
    return row


def measure_steps(layers: int, width: int, seq: int, batch: int, steps: int) -> dict:
    """Median seconds of a real forward+backward step per ``num_streams`` (1, 2, 3)."""
    import statistics
    import time

    import torch.nn.functional as F

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = GPTConfig(vocab_size=256, block_size=seq, n_layer=layers, n_head=4, n_embd=width)
    out = {"device_type": device.type}
    for n in (1, 2, 3):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        x = torch.randint(0, 256, (batch, seq), device=device)
        compiled = torch.compile(
            model, backend="trinity", options={"memory_budget": None, "inner": "eager", "num_streams": n}
        )
        times = []
        for i in range(steps + 2):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            F.cross_entropy(compiled(x).flatten(0, 1), x.flatten()).backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 2:  # the first steps compile and warm up
                times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
        out[f"streams_{n}_median_step_seconds"] = statistics.median(times)
    out["ratio_2_vs_1"] = out["streams_2_median_step_seconds"] / out["streams_1_median_step_seconds"]
    out["ratio_3_vs_1"] = out["streams_3_median_step_seconds"] / out["streams_1_median_step_seconds"]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", nargs="+", default=["h100-sxm", "a100-80gb", "l4"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--measure", action="store_true", help="also time real steps (see the module docstring)")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per stream count (with --measure)")
    args = parser.parse_args(argv)
    rows = [backward_seconds(d, args.layers, args.width, args.seq_len, args.batch) for d in args.devices]
    payload = {
        "what": "simulated backward time of the demo GPT (no offloading), num_streams 1/2/3, on device-table figures",
        "model": {"layers": args.layers, "width": args.width, "heads": 4, "seq_len": args.seq_len, "batch": args.batch},
        "event_overhead_s": assign_streams.EVENT_OVERHEAD_S,
        "rows": rows,
    }
    device = torch.device("cuda" if args.measure and torch.cuda.is_available() else "cpu")
    if args.measure:
        payload["measured"] = measure_steps(args.layers, args.width, args.seq_len, args.batch, args.steps)
        if device.type == "cuda":
            from offload_compiler.devices import detect_device_spec

            spec = detect_device_spec(device, None)
            payload["measured"]["predicted_for_this_device"] = backward_seconds(
                spec, args.layers, args.width, args.seq_len, args.batch
            )
        print(
            f"measured ({payload['measured']['device_type']}): 2 vs 1 streams {payload['measured']['ratio_2_vs_1']:.3f}, "
            f"3 vs 1 {payload['measured']['ratio_3_vs_1']:.3f}"
        )
    path = write_result(f"streams_{device.type}", payload, device)
    for r in rows:
        print(
            f"{r['device']:>10}: 1 stream {r['streams_1']['seconds'] * 1e3:.3f} ms, 2 streams "
            f"{r['streams_2']['seconds'] * 1e3:.3f} ms (ratio {r['ratio_2_vs_1']:.3f}, "
            f"{r['streams_2']['events']} events), 3 streams ratio {r['ratio_3_vs_1']:.3f}"
        )
    print(f"written {path}")


if __name__ == "__main__":
    main()
