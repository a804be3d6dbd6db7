"""Step time of trinity against the same inner compiler without offloading, measured side by side.

The suite (:mod:`bench.runner`) runs each method on its own, one after the other, and times a few
steps of each: good enough for the table, but on a shared CPU two runs a minute apart can differ by
more than the 30% the CPU target allows (the same configuration has measured 1.06x and 1.42x).
Here both models are compiled in one process and trained **alternately, step by step**, in ABBA
order (trinity, reference, reference, trinity, ...), so slow drifts of the machine (other
processes, frequency, the allocator's state) hit both alike. Reported per pair:

* ``ratio``: median over the timed steps of trinity's step time divided by the reference's step
  time in the same ABBA round (a paired ratio, dimensionless);
* ``ratio_of_medians``: the median trinity step over the median reference step;
* the quartiles of the paired ratios, and both medians in seconds.

Each step is forward, backward and ``AdamW.step`` on the same batch for both models (the same
initial weights and batches as the suite: ``bench.models``); on CUDA each step is synchronized.

``python -m bench.step_ratio [--models gpt,llama,vit,resnet] [--rounds 16] [--budget 50%]``
writes (replaces) ``bench/results/step_ratio_<device type>.json``, the file the report judges the
step target on; ``python -m bench`` runs it for every model after the suite.
"""

from __future__ import annotations

import argparse
import statistics
import warnings

import torch

from .common import OtherLoad, write_result
from .methods import fresh_copy, get_method
from .models import MODEL_NAMES, get_model
from .runner import train_step

__all__ = ["measure_pair", "main"]


def _quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]


def measure_pair(
    model: str, trinity_key: str, rounds: int = 16, warmup: int = 3, device: torch.device | None = None, size=None
) -> dict:
    """Train ``trinity_key`` and its reference method (``Method.reference``) alternately on
    ``model`` for ``warmup + 2 * rounds`` steps each (ABBA), and return the paired step-time ratio.

    Args:
        model: a ``bench.models`` name.
        trinity_key: a ``trinity-...`` method key (``trinity-50%``, ``trinity-eager-50%``).
        rounds: ABBA rounds timed (each gives two paired ratios).
        warmup: untimed first steps of each (the first compiles).
        device: where to train (default CUDA when available, else the CPU).
        size: the ``bench.models`` size preset (default by device).

    Raises:
        ValueError: for a method key with no reference, or ``rounds < 1``.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = get_model(model, size or ("gpu" if device.type == "cuda" else "cpu"))
    tri = get_method(trinity_key, spec.block_containers)
    if tri.reference is None:
        raise ValueError(f"{trinity_key!r} has no reference method (expected a trinity-... key)")
    ref = get_method(tri.reference, spec.block_containers)
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = spec.build()
    steps = warmup + 2 * rounds
    batches = [(x.to(device), y.to(device)) for x, y in spec.make_batches(steps, 0)]
    runs = {}
    for method in (tri, ref):
        m = fresh_copy(base).to(device)
        prepared = method.prepare(m, device)
        runs[method.key] = (prepared, torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.0))

    def step(key: str, i: int) -> float:
        prepared, opt = runs[key]
        return train_step(prepared, opt, *batches[i], device)[0]

    times = {tri.key: [], ref.key: []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(warmup):
            step(tri.key, i)
            step(ref.key, i)
        with OtherLoad() as load:
            for r in range(rounds):
                i = warmup + 2 * r
                for key, j in ((tri.key, i), (ref.key, i), (ref.key, i + 1), (tri.key, i + 1)):
                    times[key].append(step(key, j))
    paired = [a / b for a, b in zip(times[tri.key], times[ref.key])]
    q1, q3 = _quartiles(paired)
    return {
        "model": model,
        "trinity": tri.key,
        "reference": ref.key,
        "rounds": rounds,
        "ratio": statistics.median(paired),
        "ratio_q1": q1,
        "ratio_q3": q3,
        "ratio_of_medians": statistics.median(times[tri.key]) / statistics.median(times[ref.key]),
        "trinity_median_seconds": statistics.median(times[tri.key]),
        "reference_median_seconds": statistics.median(times[ref.key]),
        "other_load": load.fraction,
    }


def main(argv: list[str] | None = None) -> int:
    """Measure every model's pair and write the JSON; returns 0."""
    parser = argparse.ArgumentParser(prog="python -m bench.step_ratio", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODEL_NAMES), help="comma-separated bench.models names")
    parser.add_argument("--budget", default="50%", help="trinity's memory_budget (default 50%%)")
    parser.add_argument("--rounds", type=int, default=16, help="ABBA rounds timed (default 16)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed first steps of each (default 3)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--size", default=None, help="bench.models size preset (default: by device)")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    pairs = [(m, f"trinity-{args.budget}") for m in args.models.split(",")]
    if "gpt" in args.models.split(","):
        pairs.append(("gpt", f"trinity-eager-{args.budget}"))
    rows = []
    for model, key in pairs:
        row = measure_pair(model, key, rounds=args.rounds, warmup=args.warmup, device=device, size=args.size)
        rows.append(row)
        print(
            f"{model:7s} {key:18s} vs {row['reference']:9s}: paired ratio {row['ratio']:.3f} "
            f"(IQR {row['ratio_q1']:.3f}..{row['ratio_q3']:.3f}), medians {row['trinity_median_seconds'] * 1e3:.1f} / "
            f"{row['reference_median_seconds'] * 1e3:.1f} ms",
            flush=True,
        )
        if row["other_load"] > 0.1:
            print(
                f"  busy machine: other processes used {100 * row['other_load']:.0f}% of the CPU while timing; "
                "even paired ratios are noise then (rerun on a quiet machine before recording the result)",
                flush=True,
            )
    path = write_result(f"step_ratio_{device.type}", {"budget": args.budget, "pairs": rows}, device)
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
