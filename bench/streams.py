"""Simulated backward step time of the demo GPT with 2 (and 3) compute streams against 1.

Traces the demo's training step (``python -m offload_compiler demo`` defaults: 4 layers, width
128, 4 heads, sequence 128, batch 16, vocab 256, fp32) on fake tensors, runs ``assign_streams``
on the backward graph against a GPU's figures from the device table (no offloading, so that the
number is the streams' alone) and reports the simulated backward time of each stream count and
the ratio to one stream. Nothing runs on a device: this is the cost model's prediction (see
``offload_compiler/passes/assign_streams.py`` for the event cost it assumes). Seconds.

    python -m bench.streams [--devices h100-sxm a100-80gb l4] [--layers 4] [--batch 16]
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


def backward_seconds(device: str, layers: int, width: int, seq: int, batch: int) -> dict:
    """Simulated backward seconds with 1, 2 and 3 streams on ``device``'s figures."""
    spec = lookup_device(device)
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", nargs="+", default=["h100-sxm", "a100-80gb", "l4"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    rows = [backward_seconds(d, args.layers, args.width, args.seq_len, args.batch) for d in args.devices]
    payload = {
        "what": "simulated backward time of the demo GPT (no offloading), num_streams 1/2/3, on device-table figures",
        "model": {"layers": args.layers, "width": args.width, "heads": 4, "seq_len": args.seq_len, "batch": args.batch},
        "event_overhead_s": assign_streams.EVENT_OVERHEAD_S,
        "rows": rows,
    }
    path = write_result("streams_cpu", payload, torch.device("cpu"))
    for r in rows:
        print(
            f"{r['device']:>10}: 1 stream {r['streams_1']['seconds'] * 1e3:.3f} ms, 2 streams "
            f"{r['streams_2']['seconds'] * 1e3:.3f} ms (ratio {r['ratio_2_vs_1']:.3f}, "
            f"{r['streams_2']['events']} events), 3 streams ratio {r['ratio_3_vs_1']:.3f}"
        )
    print(f"written {path}")


if __name__ == "__main__":
    main()
