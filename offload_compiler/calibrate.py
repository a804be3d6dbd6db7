"""Measure this machine's device figures for the cost model and write them as JSON.

``python -m offload_compiler calibrate [--out calibration.json]`` measures, on the current device
(CUDA when available, else the CPU playing the device):

* matmul FLOP/s for FP32 (TF32 off), TF32 and BF16 (square matmuls, ``2 n^3`` FLOPs each);
* elementwise bandwidth: ``c = a + b`` on large tensors (3 tensors' bytes per call);
* copy bandwidth between host and device, pinned and pageable, each direction (on the CPU: a
  memory-to-memory copy, bytes copied per second);
* launch overhead: the time of a one-element add;
* the host (the CPU, also when a GPU is there): its sustained memory bandwidth, a STREAM triad
  ``a = b + s * c`` over three buffers much larger than the caches, 12 bytes per element
  (J. McCalpin's STREAM convention), per thread count; and the real throughput of the host
  optimizer update: ``CPUOptimizer`` stepping AdamW over fp32 parameters (host master copies and
  gradients, its worker thread), per thread count, with torch's fused CPU kernel
  (``implementation="fastest"``) and with its default for-loop in cache-sized pieces. The cost
  model gets seconds per parameter at the most threads (``host_update_seconds_per_param``,
  ``host_update_loop_seconds_per_param``); the per-thread figures are in
  ``host_update_params_per_s`` and ``host_bytes_per_s_by_threads``.

Each figure is the median of several timed repetitions after warm-up (CUDA events on a GPU,
``time.perf_counter`` on the CPU). Pass the file to the backend with
``options={"calibration": "calibration.json"}``; figures in it replace the device table's, and
explicit options still win.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = [
    "calibrate",
    "load_calibration",
    "CALIBRATION_FIELDS",
    "main",
    "stream_triad_bytes_per_s",
    "host_update_seconds",
    "thread_counts",
]

CALIBRATION_FIELDS = (
    "flops_fp32",
    "flops_tf32",
    "flops_bf16",
    "hbm_bytes_per_s",
    "h2d_bytes_per_s",
    "d2h_bytes_per_s",
    "pageable_factor",
    "launch_overhead_s",
    "host_bytes_per_s",
    "host_update_seconds_per_param",
    "host_update_loop_seconds_per_param",
)


def thread_counts(most: int | None = None) -> list[int]:
    """1, 2, 4, ... up to ``most`` (default ``torch.get_num_threads()``), and ``most`` itself."""
    most = most or torch.get_num_threads()
    counts = [1]
    while counts[-1] * 2 < most:
        counts.append(counts[-1] * 2)
    if counts[-1] != most:
        counts.append(most)
    return counts


def _in_thread(fn: Callable[[], float], num_threads: int) -> float:
    """Run ``fn`` on a fresh thread whose torch ops use ``num_threads`` intra-op threads (as the
    CPU optimizer's worker does); returns its result."""
    from .runtime.cpu_optim import set_thread_num_threads

    out: list = []

    def body():
        set_thread_num_threads(num_threads)
        out.append(fn())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out[0]


def stream_triad_bytes_per_s(numel: int = 1 << 25, reps: int = 5, num_threads: int | None = None) -> float:
    """Sustained host-memory bandwidth in bytes/s: the median of ``reps`` STREAM triads
    ``a = b + 3 c`` over three fp32 buffers of ``numel`` elements (default 128 MiB each, far
    beyond any cache), counting 12 bytes per element as STREAM does (the write-allocate read of
    ``a`` is not counted). ``num_threads``: intra-op threads (default: the current setting)."""
    a, b, c = torch.empty(numel), torch.rand(numel), torch.rand(numel)

    def measure() -> float:
        return 12 * numel / _timer(torch.device("cpu"))(lambda: torch.add(b, c, alpha=3.0, out=a), reps)

    return _in_thread(measure, num_threads or torch.get_num_threads())


def host_update_seconds(
    numel: int,
    implementation: str = "fastest",
    num_threads: int | None = None,
    reps: int = 3,
    optimizer_class: type | None = None,
    num_tensors: int = 8,
    all_samples: bool = False,
    **options,
) -> float | list[float]:
    """Median seconds of one ``CPUOptimizer`` step (``implementation``, ``num_threads``) of
    ``optimizer_class`` (default AdamW, ``lr=1e-3``) over ``numel`` fp32 parameters in
    ``num_tensors`` tensors, their master copies and gradients in host memory as with
    ``offload="all"``; from ``step()`` until the worker is done, after two warm-up steps
    (``all_samples``: every timed step's seconds instead of the median)."""
    from .runtime.cpu_optim import CPUOptimizer
    from .runtime.model_state import ensure_slot
    from .runtime.pool import HostPool

    optimizer_class = optimizer_class or torch.optim.AdamW
    sizes = [numel // num_tensors + (1 if i < numel % num_tensors else 0) for i in range(num_tensors)]
    pool = HostPool(8 * numel * 4 + (1 << 20), pin_memory=False, on_full="fallback")
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes if n]
    for p in params:
        slot = ensure_slot(p, pool, keep_resident=False)
        slot.enable_host_grad()
        slot.grad.normal_()
        slot.grad_valid = True
        slot.release(write_back=False)
    opt = CPUOptimizer(
        params,
        optimizer_class,
        implementation=implementation,
        num_threads=num_threads,
        **({"lr": 1e-3} | options),
    )
    samples = []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        opt.step()
        opt.synchronize()
        if i >= 2:
            samples.append(time.perf_counter() - t0)
    return samples if all_samples else statistics.median(samples)


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    def time_it(fn: Callable[[], object], reps: int) -> float:
        samples = []
        for _ in range(2):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
        else:
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    return time_it


def calibrate(device: torch.device | str | None = None, quick: bool = False) -> dict:
    """Measure the figures listed in the module docstring on ``device``.

    Args:
        device: ``"cuda"`` or ``"cpu"``; default CUDA when available.
        quick: smaller problems and fewer repetitions (for tests).

    Returns:
        A dict with :data:`CALIBRATION_FIELDS` (FLOP/s, bytes/s, seconds) plus ``device_name``,
        ``torch`` and ``method``.
    """
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    time_it = _timer(dev)
    reps = 3 if quick else 10
    n = (512 if quick else 1024) if not cuda else (2048 if quick else 8192)
    out: dict = {}
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for key, dtype, tf32 in (
            ("flops_fp32", torch.float32, False),
            ("flops_tf32", torch.float32, True),
            ("flops_bf16", torch.bfloat16, False),
        ):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            # CPUs without bf16 matrix units run bf16 matmuls far slower: keep them short there.
            m = n if cuda or dtype != torch.bfloat16 else max(128, n // 4)
            a = torch.randn(m, m, device=dev, dtype=dtype)
            b = torch.randn(m, m, device=dev, dtype=dtype)
            out[key] = 2 * m**3 / time_it(lambda a=a, b=b: a @ b, reps)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    numel = (1 << 22 if quick else 1 << 24) if not cuda else (1 << 24 if quick else 1 << 26)
    a = torch.randn(numel, device=dev)
    b = torch.randn(numel, device=dev)
    c = torch.empty_like(a)
    out["hbm_bytes_per_s"] = 3 * a.numel() * a.element_size() / time_it(lambda: torch.add(a, b, out=c), reps)
    host_pinned = torch.empty(numel, pin_memory=cuda)
    host_pageable = torch.empty(numel)
    nbytes = numel * 4
    if cuda:
        dev_buf = torch.empty(numel, device=dev)
        out["h2d_bytes_per_s"] = nbytes / time_it(lambda: dev_buf.copy_(host_pinned, non_blocking=True), reps)
        out["d2h_bytes_per_s"] = nbytes / time_it(lambda: host_pinned.copy_(dev_buf, non_blocking=True), reps)
        pageable = nbytes / time_it(lambda: dev_buf.copy_(host_pageable), reps)
        out["pageable_factor"] = min(1.0, pageable / out["h2d_bytes_per_s"])
    else:
        out["h2d_bytes_per_s"] = nbytes / time_it(lambda: host_pageable.copy_(host_pinned), reps)
        out["d2h_bytes_per_s"] = nbytes / time_it(lambda: host_pinned.copy_(host_pageable), reps)
        out["pageable_factor"] = 1.0
    one = torch.ones(1, device=dev)
    launches = 100
    out["launch_overhead_s"] = time_it(lambda: [one.add_(0) for _ in range(launches)], reps) / launches
    # The host: memory bandwidth and the optimizer update, per thread count.
    counts = thread_counts()
    triad_numel = 1 << 22 if quick else 1 << 25
    by_threads = {t: stream_triad_bytes_per_s(triad_numel, reps, t) for t in counts}
    out["host_bytes_per_s_by_threads"] = by_threads
    out["host_bytes_per_s"] = max(by_threads.values())
    update_numel = 1 << 21 if quick else 1 << 24
    rates: dict[str, dict[int, float]] = {}
    for impl, key in (("fastest", "fused"), ("exact", "loop")):
        rates[key] = {
            t: update_numel / host_update_seconds(update_numel, impl, t, reps=2 if quick else 3) for t in counts
        }
    out["host_update_params_per_s"] = rates
    out["host_update_seconds_per_param"] = 1 / rates["fused"][counts[-1]]
    out["host_update_loop_seconds_per_param"] = 1 / rates["loop"][counts[-1]]
    out["host_threads"] = counts[-1]
    out["device_name"] = torch.cuda.get_device_name(dev) if cuda else "CPU (host as device)"
    out["torch"] = torch.__version__
    out["method"] = "offload_compiler.calibrate: medians of timed repetitions after warm-up"
    return out


def load_calibration(path: str | Path) -> dict[str, float]:
    """The figures of a calibration file (only :data:`CALIBRATION_FIELDS` present in it).

    Raises:
        ValueError: naming the file when it is missing, not JSON, or holds a non-positive figure.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise ValueError(f"calibration file {str(p)!r} cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"calibration file {str(p)!r} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"calibration file {str(p)!r} must hold a JSON object")
    figures = {}
    for key in CALIBRATION_FIELDS:
        if key in data:
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"calibration file {str(p)!r}: {key} = {value!r} is not a positive number")
            figures[key] = float(value)
    if not figures:
        raise ValueError(f"calibration file {str(p)!r} holds none of {', '.join(CALIBRATION_FIELDS)}")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m offload_compiler calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="calibration.json", help="where to write the figures (JSON)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--quick", action="store_true", help="small problems, few repetitions")
    args = parser.parse_args(argv)
    figures = calibrate(args.device, quick=args.quick)
    Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    for key in CALIBRATION_FIELDS:
        value = figures[key]
        unit = "FLOP/s" if key.startswith("flops") else "bytes/s" if key.endswith("per_s") else ""
        unit = "s/param" if key.endswith("per_param") else unit
        print(f"{key:34s} {value:12.4g} {unit}")
    for impl, by in figures["host_update_params_per_s"].items():
        cells = ", ".join(f"{t} threads {r / 1e6:.0f} M params/s" for t, r in by.items())
        print(f"host update ({impl}): {cells}")
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
