"""Measure this machine's device figures for the cost model and write them as JSON.

``python -m offload_compiler calibrate [--out calibration.json]`` measures, on the current device
(CUDA when available, else the CPU playing the device):

* matmul FLOP/s for FP32 (TF32 off), TF32 and BF16 (square matmuls, ``2 n^3`` FLOPs each);
* elementwise bandwidth: ``c = a + b`` on large tensors (3 tensors' bytes per call);
* copy bandwidth between host and device, pinned and pageable, each direction (on the CPU: a
  memory-to-memory copy, bytes copied per second);
* launch overhead: the time per node of an AOTAutograd-compiled forward and backward of tiny
  ops (4x4 matmuls, tanh, transposes, their gradients), run as trinity's compiled graphs run:
  FX-generated Python calling aten ops through the dispatcher, under AOTAutograd's runtime
  wrapper; views count as nodes (the cost model charges them where the host is the device);
* copy overhead: the time of one trinity copy's runtime calls beyond its bytes, per direction (a
  parameter's fetch, wait and release; a gradient's copy and wait) through the dispatcher
  (slot and pending-copy bookkeeping, the storage re-allocation); measured, and counted by the
  cost model, only where copies are synchronous (the CPU as the device: on a GPU the calls run
  on the host beside the copy streams);
* the host update's fixed cost per parameter tensor: ``CPUOptimizer`` stepping many small
  tensors against few large ones of the same total (the per-call work of torch's optimizer and of
  the worker's bookkeeping);
* the host (the CPU, also when a GPU is there): its sustained memory bandwidth, the best rate
  of STREAM's four kernels (copy, scale, add, triad) and STREAM2's in-place DAXPY over fp32
  arrays of at least 4 times the last-level cache, each the best of several runs, with the
  bytes STREAM counts plus the write-allocate read of each line stored without being read
  (:func:`stream_bytes_per_s`), per thread count; and the real throughput of the host
  optimizer update: ``CPUOptimizer`` stepping AdamW over fp32 parameters (host master copies and
  gradients, its worker thread), per thread count, with torch's fused CPU kernel
  (``implementation="fastest"``) and with its default for-loop in cache-sized pieces. The cost
  model gets seconds per parameter at the most threads (``host_update_seconds_per_param``,
  ``host_update_loop_seconds_per_param``) and the per-thread figures
  (``host_update_params_per_s``, ``host_bytes_per_s_by_threads``), from which it takes the one
  at an optimizer's own thread count (``CPUOptimizer(num_threads=...)``; the largest measured
  count not above it, :meth:`~offload_compiler.devices.DeviceSpec.host_update_figure`).

Each figure is the median of several timed repetitions after warm-up (CUDA events on a GPU,
``time.perf_counter`` on the CPU). Pass the file to the backend with
``options={"calibration": "calibration.json"}``; figures in it replace the device table's, and
explicit options still win.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "calibrate",
    "calibrate_collectives",
    "load_calibration",
    "CALIBRATION_FIELDS",
    "main",
    "stream_bytes_per_s",
    "stream_kernels_bytes_per_s",
    "stream_numel",
    "last_level_cache_bytes",
    "STREAM_KERNELS",
    "host_update_seconds",
    "copy_overhead_seconds",
    "graph_node_seconds",
    "update_seconds_per_tensor",
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
    "h2d_overhead_s",
    "d2h_overhead_s",
    "host_update_seconds_per_tensor",
    "host_update_loop_seconds_per_tensor",
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


def graph_node_seconds(device: torch.device, reps: int = 10, layers: int = 50) -> float:
    """Seconds per node of a compiled training step made of tiny ops on ``device``: ``layers``
    repetitions of ``x = tanh(x @ w).t()`` over 4x4 fp32 tensors, summed, its forward and
    backward captured by AOTAutograd (``torch._functorch.aot_autograd.aot_function``, the graphs
    run as they are, boxed, with the data-stack headroom trinity gives its graphs,
    :mod:`offload_compiler.frame_headroom`) and stepped (forward and backward) ``reps`` times after warm-up; the
    median step over the number of ``call_function`` nodes of the two graphs. The kernels are
    so small that this is the per-op cost of the path a compiled graph takes: the FX-generated
    Python, the dispatcher, autograd's node for the graph (the launch itself on a GPU)."""
    from torch._functorch.aot_autograd import aot_function, make_boxed_func

    from .frame_headroom import add_headroom

    nodes = [0]

    def compiler(gm, example_inputs):
        nodes[0] += sum(1 for n in gm.graph.nodes if n.op == "call_function")
        run = make_boxed_func(gm.forward)
        add_headroom(gm)
        return run

    def layers_of(x, ws):
        for w in ws:
            x = torch.tanh(x @ w).t()
        return x.sum()

    ws = [torch.randn(4, 4, device=device, requires_grad=True) for _ in range(layers)]
    x = torch.randn(4, 4, device=device)
    step = aot_function(layers_of, fw_compiler=compiler, bw_compiler=compiler)
    seconds = _timer(device)(lambda: step(x, ws).backward(), reps)
    return seconds / nodes[0]


def copy_overhead_seconds(
    device: torch.device, h2d_bytes_per_s: float, d2h_bytes_per_s: float, reps: int = 10
) -> dict[str, float]:
    """Seconds of one copy's runtime calls beyond its bytes on ``device``, per direction, called
    through the dispatcher as the rewritten graph calls them, on a 4 KiB parameter; the median
    over ``reps`` rounds of 50 cycles, less 4 KiB at the direction's bandwidth (bytes/s), per
    cycle, at least 1 ns:

    * ``"h2d"``: ``trinity::param_fetch`` + ``param_fetch_wait`` + ``param_release`` (the slot
      and pending-copy bookkeeping, the storage re-allocation and free);
    * ``"d2h"``: ``trinity::grad_to_host`` + ``grad_to_host_wait`` (accumulated into the host
      gradient).
    """
    from .ir import ops as ir_ops  # noqa: F401  (the trinity::* schemas)
    from .runtime import param_ops  # noqa: F401  (their kernels)
    from .runtime.model_state import ensure_slot
    from .runtime.transfer import TransferRuntime

    runtime = TransferRuntime(device, 1 << 20)
    param = torch.nn.Parameter(torch.randn(1024, device=device))
    slot = ensure_slot(param, runtime.pool, keep_resident=False)
    slot.release(write_back=False)
    grad = torch.randn(1024, device=device)
    nbytes = param.numel() * param.element_size()
    ops = torch.ops.trinity
    cycles = 50

    def fetch_cycle():
        for _ in range(cycles):
            ops.param_fetch(param, slot.id, runtime.id)
            ops.param_fetch_wait(param, slot.id, runtime.id)
            ops.param_release(param, slot.id, False, runtime.id)

    def grad_cycle():
        for _ in range(cycles):
            ops.grad_to_host(grad, slot.id, runtime.id)
            ops.grad_to_host_wait(grad, slot.id, runtime.id)

    time_it = _timer(device)
    h2d = time_it(fetch_cycle, reps) / cycles - nbytes / h2d_bytes_per_s
    slot.enable_host_grad()  # after the fetches: a host gradient without an optimizer refuses them
    d2h = time_it(grad_cycle, reps) / cycles - nbytes / d2h_bytes_per_s
    return {"h2d": max(1e-9, h2d), "d2h": max(1e-9, d2h)}


def update_seconds_per_tensor(
    per_param: float, implementation: str, num_threads: int, reps: int = 3, numel: int = 1 << 18
) -> float:
    """Fixed seconds per parameter tensor of one ``CPUOptimizer`` step: ``numel`` fp32 parameters
    (default 256 Ki) in 128 tensors, less their ``numel * per_param`` (seconds per parameter, as
    measured on large tensors), over 128; at least 1 ns."""
    many = host_update_seconds(numel, implementation, num_threads, reps=reps, num_tensors=128)
    return max(1e-9, (many - numel * per_param) / 128)


# The bandwidth probe's kernels: STREAM's four (J. D. McCalpin, "Memory Bandwidth and Machine
# Balance in Current High Performance Computers", IEEE TCCA Newsletter, Dec. 1995; stream.c,
# https://www.cs.virginia.edu/stream/) and STREAM2's in-place DAXPY (McCalpin, stream2.f, same
# site): name -> (arrays STREAM counts per element: read + written, write-allocate reads per
# element). STREAM counts the arrays a kernel names (copy c = a: 2, scale b = s c: 2, add
# c = a + b: 3, triad a = b + s c: 3) and, as its documentation says, not the write-allocate
# traffic: a store to a line not in cache first reads that line unless the store is a streaming
# (non-temporal) one. torch's CPU element-wise kernels (copy_, mul, add with out=) store with
# ordinary vector stores, so each of those moves one more array per element than STREAM counts
# (measured on the development machine, 2026-12, 1 GiB arrays, 2 threads: copy 9.1 GB/s as
# STREAM counts it, 13.6 GB/s with its write-allocate, against 14.1 GB/s for the in-place DAXPY,
# which only the second agrees with). DAXPY (a = a + s b) stores only lines it has just read,
# nothing to allocate: the access pattern of an in-place optimizer update (AdamW reads master,
# gradient, m, v and writes master, m, v back); here it ran 8-12% faster than the best kernel
# with a write-allocate stream in 4 of 5 probes (3% slower in the fifth).
STREAM_KERNELS = {"copy": (2, 1), "scale": (2, 1), "add": (3, 1), "triad": (3, 1), "daxpy": (3, 0)}
# The probe's clock (a module global, so that a test can replace it for this probe alone).
_probe_clock = time.perf_counter
# Fallback when the OS does not say: a large server part's last-level cache (bytes).
_LLC_FALLBACK_BYTES = 256 * 2**20


def last_level_cache_bytes(root: str | Path = "/sys/devices/system/cpu") -> int | None:
    """The sum of the sizes of every distinct last-level cache of this machine in bytes (the
    highest-level data or unified cache of each CPU, counted once per set of CPUs sharing it),
    read from Linux's ``{root}/cpu*/cache/index*/{type,level,size,shared_cpu_list}``; ``None``
    where that is unreadable."""
    caches: dict[str, int] = {}
    best_level = 0
    for index in Path(root).glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
            shared = (index / "shared_cpu_list").read_text().strip()
        except (OSError, ValueError):
            continue
        if kind == "Instruction" or not size:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1].upper(), 1)
        nbytes = int(size.rstrip("KMGkmg")) * unit
        if level > best_level:
            best_level, caches = level, {}
        if level == best_level:
            caches[shared] = nbytes
    return sum(caches.values()) or None


def stream_numel(llc_bytes: int | None = None, available_bytes: int | None = None) -> int:
    """Elements per fp32 array of the bandwidth probe: 4 times ``llc_bytes`` (default
    :func:`last_level_cache_bytes`, else 256 MiB), STREAM's rule that each array be at least 4
    times the sum of the last-level caches, and at least 2^25 (128 MiB); at most an eighth of
    ``available_bytes`` (default: Linux's ``MemAvailable``) per array, so the three arrays leave
    most of the memory to others; a multiple of 64.

    Raises:
        ValueError: for a non-positive ``llc_bytes`` or ``available_bytes``.
    """
    if llc_bytes is not None and llc_bytes <= 0:
        raise ValueError(f"stream_numel: llc_bytes must be positive, got {llc_bytes}")
    if available_bytes is not None and available_bytes <= 0:
        raise ValueError(f"stream_numel: available_bytes must be positive, got {available_bytes}")
    llc = llc_bytes or last_level_cache_bytes() or _LLC_FALLBACK_BYTES
    numel = max(1 << 25, 4 * llc // 4)  # 4 x the cache's bytes, 4 bytes per fp32 element
    available = available_bytes or _available_memory_bytes()
    if available:
        numel = min(numel, available // 8 // 4)
    return max(64, numel // 64 * 64)


def _available_memory_bytes() -> int | None:
    """Linux's ``MemAvailable`` in bytes, or ``None``."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def stream_kernels_bytes_per_s(
    numel: int | None = None, reps: int = 5, num_threads: int | None = None
) -> dict[str, float]:
    """Host-memory bandwidth per kernel in bytes/s: ``{"copy", "scale", "add", "triad", "daxpy"}``
    (:data:`STREAM_KERNELS`), each its best (shortest) run of ``reps`` after one warm-up run of
    each (STREAM too reports each kernel's best time, of ``NTIMES`` = 10 runs less the first),
    the kernels interleaved in each repetition as STREAM runs them, so a burst of load elsewhere
    slows one repetition of each rather than every repetition of one. Bytes per element: 4 x (the
    arrays STREAM counts + the write-allocate reads), see :data:`STREAM_KERNELS`. ``numel``:
    elements per fp32 array (default :func:`stream_numel`, at least 4 x the last-level cache);
    ``num_threads``: intra-op threads (default: the current setting).

    Raises:
        ValueError: for ``numel`` or ``reps`` below 1.
    """
    if numel is not None and numel < 1:
        raise ValueError(f"stream_kernels_bytes_per_s: numel must be >= 1, got {numel}")
    if reps < 1:
        raise ValueError(f"stream_kernels_bytes_per_s: reps must be >= 1, got {reps}")
    n = numel or stream_numel()

    def measure() -> dict[str, float]:
        a, b, c = torch.full((n,), 1.0), torch.full((n,), 2.0), torch.zeros(n)
        s = 3.0
        kernels = {
            "copy": lambda: c.copy_(a),
            "scale": lambda: torch.mul(c, s, out=b),
            "add": lambda: torch.add(a, b, out=c),
            "triad": lambda: torch.add(b, c, alpha=s, out=a),
            "daxpy": lambda: a.add_(b, alpha=1e-3),
        }
        best = dict.fromkeys(kernels, math.inf)
        for rep in range(reps + 1):
            for name, kernel in kernels.items():
                t0 = _probe_clock()
                kernel()
                dt = _probe_clock() - t0
                if rep:  # the first repetition warms up (page faults, thread pool)
                    best[name] = min(best[name], dt)
        return {name: 4 * sum(STREAM_KERNELS[name]) * n / best[name] for name in kernels}

    return _in_thread(measure, num_threads or torch.get_num_threads())


def stream_bytes_per_s(numel: int | None = None, reps: int = 5, num_threads: int | None = None) -> float:
    """Sustained host-memory bandwidth in bytes/s: the best of :func:`stream_kernels_bytes_per_s`
    (the fastest of STREAM's four kernels and STREAM2's DAXPY, each the best of ``reps`` runs,
    write-allocate counted) over arrays of at least 4 x the last-level cache. The bandwidth
    floor of an update is its bytes over this figure: an in-place update such as AdamW's moves
    exactly the bytes it names (every line it stores it read first), as DAXPY does.

    Raises:
        ValueError: for ``numel`` or ``reps`` below 1.
    """
    return max(stream_kernels_bytes_per_s(numel, reps, num_threads).values())


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
        A dict with :data:`CALIBRATION_FIELDS` (FLOP/s, bytes/s, seconds; the copy overheads only on the CPU) plus ``device_name``,
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
    out["launch_overhead_s"] = graph_node_seconds(dev, reps)
    if not cuda:  # only synchronous copies (the CPU as the device) count their runtime calls
        overhead = copy_overhead_seconds(dev, out["h2d_bytes_per_s"], out["d2h_bytes_per_s"], reps)
        out["h2d_overhead_s"], out["d2h_overhead_s"] = overhead["h2d"], overhead["d2h"]
    # The host: memory bandwidth and the optimizer update, per thread count.
    counts = thread_counts()
    stream_n = 1 << 22 if quick else stream_numel()  # quick: 16 MiB arrays, within many caches
    kernels = {t: stream_kernels_bytes_per_s(stream_n, reps, t) for t in counts}
    by_threads = {t: max(k.values()) for t, k in kernels.items()}
    out["host_bytes_per_s_by_threads"] = by_threads
    out["host_bytes_per_s"] = max(by_threads.values())
    out["host_stream_kernels_bytes_per_s"] = kernels
    out["host_stream_array_bytes"] = 4 * stream_n
    update_numel = 1 << 21 if quick else 1 << 24
    rates: dict[str, dict[int, float]] = {}
    for impl, key in (("fastest", "fused"), ("exact", "loop")):
        rates[key] = {
            t: update_numel / host_update_seconds(update_numel, impl, t, reps=2 if quick else 3) for t in counts
        }
    out["host_update_params_per_s"] = rates
    out["host_update_seconds_per_param"] = 1 / rates["fused"][counts[-1]]
    out["host_update_loop_seconds_per_param"] = 1 / rates["loop"][counts[-1]]
    out["host_update_seconds_per_tensor"] = update_seconds_per_tensor(
        out["host_update_seconds_per_param"], "fastest", counts[-1], reps=2 if quick else 3
    )
    out["host_update_loop_seconds_per_tensor"] = update_seconds_per_tensor(
        out["host_update_loop_seconds_per_param"], "exact", counts[-1], reps=2 if quick else 3
    )
    out["host_threads"] = counts[-1]
    out["device_name"] = torch.cuda.get_device_name(dev) if cuda else "CPU (host as device)"
    out["torch"] = torch.__version__
    out["method"] = "offload_compiler.calibrate: medians of timed repetitions after warm-up"
    return out


def _positive(p: Path, key: str, value: Any) -> float:
    """``value`` as a float, or ``ValueError`` naming the file, the key and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"calibration file {str(p)!r}: {key} = {value!r} is not a positive finite number")
    return float(value)


def _by_threads(p: Path, key: str, table: Any) -> dict[int, float]:
    """A ``{threads: figure}`` table of a calibration file (JSON keys are strings) as ints and
    floats.

    Raises:
        ValueError: naming the file, the key and the bad entry: not an object, a thread count
            that is not an int >= 1, or a figure that is not positive and finite.
    """
    if not isinstance(table, dict) or not table:
        raise ValueError(f"calibration file {str(p)!r}: {key} must be a non-empty object of thread count -> figure")
    out = {}
    for t, value in table.items():
        try:
            threads = int(t)
        except (TypeError, ValueError):
            threads = 0
        if threads < 1 or str(threads) != str(t).strip():
            raise ValueError(f"calibration file {str(p)!r}: {key} has thread count {t!r}, not an int >= 1")
        out[threads] = _positive(p, f"{key}[{t!r}]", value)
    return out


def load_calibration(path: str | Path) -> dict[str, Any]:
    """The figures of a calibration file: the :data:`CALIBRATION_FIELDS` present in it (floats),
    and the per-thread-count figures as :class:`~offload_compiler.devices.DeviceSpec` holds them:
    ``host_update_params_per_s`` (``{"fused"|"loop": {threads: parameters/s}}``) as
    ``host_update_params_per_s_by_threads`` (``((implementation, threads, parameters/s), ...)``)
    and ``host_bytes_per_s_by_threads`` (``{threads: bytes/s}``) as ``((threads, bytes/s), ...)``.

    Raises:
        ValueError: naming the file when it is missing, not JSON, or holds a non-positive figure;
            naming the key and entry for a malformed per-thread table (an implementation other
            than ``fused``/``loop``, a thread count not an int >= 1, a non-positive figure).
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
    figures: dict[str, Any] = {}
    for key in CALIBRATION_FIELDS:
        if key in data:
            figures[key] = _positive(p, key, data[key])
    if "host_update_params_per_s" in data:
        rates = data["host_update_params_per_s"]
        if not isinstance(rates, dict) or set(rates) - {"fused", "loop"}:
            raise ValueError(
                f"calibration file {str(p)!r}: host_update_params_per_s must map 'fused' and/or 'loop' to "
                f"{{threads: parameters/s}}, got keys {sorted(rates) if isinstance(rates, dict) else rates!r}"
            )
        figures["host_update_params_per_s_by_threads"] = tuple(
            (impl, t, r)
            for impl in sorted(rates)
            for t, r in sorted(_by_threads(p, f"host_update_params_per_s[{impl!r}]", rates[impl]).items())
        )
    if "host_bytes_per_s_by_threads" in data:
        table = _by_threads(p, "host_bytes_per_s_by_threads", data["host_bytes_per_s_by_threads"])
        figures["host_bytes_per_s_by_threads"] = tuple(sorted(table.items()))
    if not figures:
        raise ValueError(f"calibration file {str(p)!r} holds none of {', '.join(CALIBRATION_FIELDS)}")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m offload_compiler calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="calibration.json", help="where to write the figures (JSON)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--quick", action="store_true", help="small problems, few repetitions")
    parser.add_argument(
        "--collectives",
        action="store_true",
        help="instead: time gloo collectives between processes on this machine (loopback) and fit alpha and beta",
    )
    parser.add_argument("--processes", type=int, default=2, help="with --collectives: how many processes")
    args = parser.parse_args(argv)
    if args.collectives:
        return _collectives_main(args)
    figures = calibrate(args.device, quick=args.quick)
    Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    for key in (k for k in CALIBRATION_FIELDS if k in figures):
        value = figures[key]
        unit = "FLOP/s" if key.startswith("flops") else "bytes/s" if key.endswith("per_s") else ""
        unit = "s/param" if key.endswith("per_param") else unit
        unit = "s/tensor" if key.endswith("per_tensor") else unit
        unit = "s" if key.endswith("overhead_s") else unit
        print(f"{key:34s} {value:12.4g} {unit}")
    for t, by in figures["host_stream_kernels_bytes_per_s"].items():
        cells = ", ".join(f"{k} {v / 1e9:.3g}" for k, v in by.items())
        print(f"host bandwidth, {t} threads (GB/s, write-allocate counted): {cells}")
    for impl, by in figures["host_update_params_per_s"].items():
        cells = ", ".join(f"{t} threads {r / 1e6:.0f} M params/s" for t, r in by.items())
        print(f"host update ({impl}): {cells}")
    print(f"written {args.out}")
    return 0


# ------------------------------------------------------------------------------------------
# Collectives between processes (``calibrate --collectives``): alpha and beta of the link.

_COLLECTIVE_SIZES = (1 << 12, 1 << 15, 1 << 18, 1 << 20, 1 << 22, 1 << 24)


def _collectives_worker(rank: int, world: int, port: int, sizes: tuple[int, ...], reps: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = []
        for nbytes in sizes:
            numel = max(world, nbytes // 4 // world * world)
            x = torch.ones(numel)
            chunk = torch.empty(numel // world)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in 2.13
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            ops = {
                "all_reduce": lambda x=x: dist.all_reduce(x),
                "all_gather": lambda x=x, c=chunk, g=gather: g(x, c),
                "reduce_scatter": lambda x=x, c=chunk, r=scatter: r(c, x),
            }
            if world == 2:
                ops["send_recv"] = lambda x=x: dist.send(x, 1) if rank == 0 else dist.recv(x, 0)
            for op, fn in ops.items():
                try:
                    fn()
                except (RuntimeError, NotImplementedError, ValueError) as exc:
                    results.append({"op": op, "bytes": numel * 4, "error": str(exc).split("\n")[0]})
                    continue
                samples = []
                for _ in range(reps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    samples.append(time.perf_counter() - t0)
                t = torch.tensor([statistics.median(samples)], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                results.append({"op": op, "bytes": numel * 4, "seconds": t.item()})
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def calibrate_collectives(processes: int = 2, quick: bool = False) -> dict:
    """Time gloo collectives between ``processes`` processes on this machine (TCP over
    127.0.0.1, one thread each) and fit the alpha-beta model of :mod:`.collectives` to them.

    Each collective (all-reduce, all-gather, reduce-scatter and, for 2 processes, send/recv)
    runs on messages from 4 KiB to 16 MiB (1 MiB with ``quick``); a sample is the slowest
    rank's median over repetitions after a barrier. Least squares over all samples fits
    ``seconds = steps * alpha + ring_bytes / bytes_per_s`` (``steps`` and ``ring_bytes`` as in
    :func:`.collectives.collective_seconds`), weighting each sample by ``1 / seconds`` (relative
    error), for all collectives together (``link``) and for each (``per_collective``).

    Returns:
        ``{"link": {"name", "alpha_s", "bytes_per_s", "base_s"}, "samples": [...],
        "unsupported": [...], "processes", "torch", "method"}``: pass the file to
        ``plan --world --interconnect FILE``.

    Raises:
        ValueError: for fewer than 2 processes. RuntimeError: if the processes fail.
    """
    import socket
    import tempfile

    import numpy as np
    import torch.multiprocessing as mp

    if processes < 2:
        raise ValueError(f"calibrate --collectives needs at least 2 processes, got {processes}")
    sizes = tuple(s for s in _COLLECTIVE_SIZES if not quick or s <= 1 << 20)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "samples.json")
        mp.start_processes(
            _collectives_worker,
            args=(processes, port, sizes, 3 if quick else 10, out),
            nprocs=processes,
            join=True,
            start_method="spawn",
        )
        samples = json.loads(Path(out).read_text())
    p = processes
    rows, times = [], []
    for s in samples:
        if "seconds" not in s:
            continue
        n = s["bytes"]
        steps, volume = {
            "all_reduce": (2 * (p - 1), 2 * (p - 1) / p * n),
            "all_gather": (p - 1, (p - 1) / p * n),
            "reduce_scatter": (p - 1, (p - 1) / p * n),
            "send_recv": (1, n),
        }[s["op"]]
        rows.append((steps, volume))
        times.append(s["seconds"])

    def fit(rows, times):
        """Least squares of the relative error for (alpha, 1/bandwidth), both kept >= 0 (a negative
        one is refitted away): small messages then set alpha, large ones the bandwidth."""
        t = np.array(times)
        a, t = np.array(rows, dtype=float) / t[:, None], np.ones_like(t)
        (alpha, inv_bw), *_ = np.linalg.lstsq(a, t, rcond=None)
        if alpha < 0:
            alpha, inv_bw = 0.0, float(np.linalg.lstsq(a[:, 1:], t, rcond=None)[0][0])
        if inv_bw <= 0:
            alpha, inv_bw = float(np.linalg.lstsq(a[:, :1], t, rcond=None)[0][0]), 0.0
        return max(float(alpha), 0.0), max(float(inv_bw), 0.0)

    alpha, inv_bw = fit(rows, times)
    per_op = {}
    ops = [s["op"] for s in samples if "seconds" in s]
    for op in dict.fromkeys(ops):
        a, b = fit([r for r, o in zip(rows, ops) if o == op], [t for t, o in zip(times, ops) if o == op])
        per_op[op] = {"alpha_s": a, "bytes_per_s": 1.0 / b if b > 0 else None}
    link = {
        "name": f"loopback (gloo, {p} processes on this machine)",
        "alpha_s": max(float(alpha), 0.0),
        "bytes_per_s": 1.0 / inv_bw if inv_bw > 0 else 1e15,
        "base_s": 0.0,
    }
    return {
        "link": link,
        "per_collective": per_op,
        "samples": [s for s in samples if "seconds" in s],
        "unsupported": sorted({s["op"] + ": " + s["error"] for s in samples if "error" in s}),
        "processes": p,
        "torch": torch.__version__,
        "method": "offload_compiler.calibrate.calibrate_collectives: gloo over 127.0.0.1, medians, least squares",
    }


def _collectives_main(args) -> int:
    result = calibrate_collectives(args.processes, quick=args.quick)
    out = args.out if args.out != "calibration.json" else "collectives.json"
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    link = result["link"]
    print(f"alpha_s      {link['alpha_s']:12.4g} s per ring step")
    print(f"bytes_per_s  {link['bytes_per_s']:12.4g} bytes/s")
    for line in result["unsupported"]:
        print(f"unsupported: {line}")
    print(f"written {out} (use: plan --world N --interconnect {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
