"""Device figures for the cost model: peak FLOP/s, memory bandwidth, memory size, host link.

Where a GPU is present its figures come from ``pynvml`` (name, memory size, PCIe generation and
width) matched against :data:`KNOWN_DEVICES`; without a GPU, from this table by name, or from
explicit options. Every figure is a vendor datasheet number (dense, no sparsity) unless the
comment says it is a measured or practical value.

Practical host-link bandwidth: a pinned ``cudaMemcpyAsync`` over PCIe reaches about 80% of the
link's raw rate (Gen3 x16 ~12 GB/s, Gen4 x16 ~25 GB/s, Gen5 x16 ~50 GB/s; NVIDIA's
``bandwidthTest`` sample, widely reproduced). Pageable copies go through a staging buffer and
reach roughly half of that; trinity's pool is pinned on CUDA, so plans use the pinned figure.

Host figures (the CPU the device is attached to; with ``offload="all"`` it runs the optimizer
update): ``host_bytes_per_s``, the sustained host-memory bandwidth (as
:func:`offload_compiler.calibrate.stream_bytes_per_s` measures it: the best of STREAM's kernels,
J. McCalpin, "STREAM: Sustainable Memory Bandwidth in High Performance Computers", and STREAM2's
in-place DAXPY, over arrays of 4 x the last-level cache, counting the write-allocate read of each
line stored without being read, which STREAM leaves out), and the update's seconds per
parameter. An AdamW update reads master, gradient, m and v and writes master, m and v:
:data:`ADAMW_BYTES_PER_PARAM` = 28 bytes per fp32 parameter (7 bytes per byte of parameter), so
its floor on a host is ``28 / host_bytes_per_s`` seconds per parameter. Unless measured
(``python -m offload_compiler calibrate``), the update times are derived from the bandwidth:
torch's fused CPU kernel at :data:`FUSED_FRACTION_OF_FLOOR` of the floor, its per-parameter
for-loop (``CPUOptimizer``'s default, bit-identical to ``torch.optim``'s default on CPU tensors)
:data:`LOOP_SLOWDOWN` times slower. Both are assumptions, not committed measurements; their
comment says what the committed benchmark results show and what was measured since. The GPU
entries assume :data:`NOMINAL_HOST`: a 16-core host sustaining 60 GB/s (a two-channel DDR5-5600
workstation's STREAM triad is 60-75 GB/s as STREAM reports it, without write-allocate traffic, so
at most 4/3 of that as ``calibrate`` counts it: 60 GB/s is the conservative end), a stated
assumption, not a measurement; pass ``host_bytes_per_s`` (option or ``plan --host-bandwidth``)
for yours.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch

__all__ = [
    "DeviceSpec",
    "KNOWN_DEVICES",
    "PCIE_PRACTICAL_BYTES_PER_S",
    "ADAMW_BYTES_PER_PARAM",
    "NOMINAL_HOST",
    "lookup_device",
    "detect_device_spec",
]

log = logging.getLogger(__name__)

GB = 10**9
TFLOPS = 10**12
GiB = 2**30

# Practical pinned bytes/s per direction for an x16 link, by PCIe generation (see module doc).
# Raw rates: Gen3 15.75 GB/s, Gen4 31.5 GB/s, Gen5 63 GB/s per direction (PCI-SIG).
PCIE_PRACTICAL_BYTES_PER_S = {3: 12 * GB, 4: 25 * GB, 5: 50 * GB}

# AdamW's memory traffic per fp32 parameter: reads master, grad, m, v; writes master, m, v.
ADAMW_BYTES_PER_PARAM = 28
# Assumptions for an uncalibrated host (a stated bandwidth; the GPU entries' NOMINAL_HOST):
# torch's fused CPU AdamW runs at FUSED_FRACTION_OF_FLOOR of the bandwidth floor, and its
# for-loop (torch's default on CPU tensors, run by CPUOptimizer in cache-sized pieces) takes
# LOOP_SLOWDOWN times as long. No committed result supports them (an earlier comment cited a
# cpu_update.json in bench/results, which was never committed). What the committed results show
# (bench/results/cpu_update_50M.json and cpu_update_200M.json, 2026-12-01, 2 threads, load average
# 12-14 on this 2-core machine): no usable fraction of the floor, since their floor was the median
# of a 12-byte triad under that load (1.33 and 1.89 GB/s) and put torch's fused AdamW at 1.38x and
# 1.77x "of the floor", CPUOptimizer(implementation="fastest") at 2.74x and 1.60x, impossible for
# an honest floor; and CPUOptimizer's for-loop in pieces at 0.96x (50M) and 1.10x (200M) the time
# of its fused path, against LOOP_SLOWDOWN's 3x (torch's own for-loop, not in pieces: 9.6x and
# 8.9x). Measured since on the same machine (2026-12-05, not committed; 50M parameters in 16
# tensors, 2 threads, the floor from calibrate.stream_bytes_per_s, interleaved rounds):
# fused AdamW (torch's fused=True, CPUOptimizer(implementation="fastest")) at 0.64-0.68 of the
# floor (medians) with load average 4-5, CPUOptimizer's at 0.88 with 2.3; its for-loop in pieces
# 3.2x its fused time (228 vs 71 ms, 200 vs 63 ms). Committed since (bench/results/cpu_update.json,
# one run of both sizes, 2 threads, that floor): at 200M parameters CPUOptimizer fastest at 0.95
# of the floor and torch's fused AdamW at 0.63; CPUOptimizer's for-loop in pieces 2.8x its fused
# time (721 vs 255 ms).
FUSED_FRACTION_OF_FLOOR = 0.9
LOOP_SLOWDOWN = 3.0
# The host assumed for the GPU entries (see the module docstring): cores, bytes/s.
NOMINAL_HOST = {"cores": 16, "host_bytes_per_s": 60 * GB}


def _threads(n: int) -> str:
    return f"{n} thread" + ("s" if n != 1 else "")


@dataclass(frozen=True)
class DeviceSpec:
    """Figures of one device, in SI units.

    Attributes:
        name: marketing name, e.g. ``"NVIDIA H100 SXM"``.
        flops_fp32: peak dense FP32 (non-tensor-core) FLOP/s.
        flops_tf32: peak dense TF32 tensor-core FLOP/s (FP32 matmuls with TF32 allowed).
        flops_bf16: peak dense BF16/FP16 tensor-core FLOP/s.
        hbm_bytes_per_s: device-memory bandwidth, bytes/s.
        memory_bytes: device memory, bytes.
        h2d_bytes_per_s: pinned host-to-device copy bandwidth, bytes/s.
        d2h_bytes_per_s: pinned device-to-host copy bandwidth, bytes/s.
        pcie_gen, pcie_width: host link (0 when not PCIe, e.g. the CPU host entry).
        launch_overhead_s: fixed cost per kernel, seconds; where the host is the device also per aten
            view (its dispatcher call). ``calibrate`` measures it per node of a compiled graph of
            tiny ops (a file written before 2026-12-04 holds a one-element add's time instead).
        pageable_factor: bandwidth of a copy from or to pageable (not pinned) host memory, as a
            fraction of the pinned figure. 0.5 after NVIDIA's measurements of staged pageable
            copies (M. Harris, "How to Optimize Data Transfers in CUDA C/C++", NVIDIA blog, 2012);
            1.0 where host and device are the same memory.
        source: where the figures come from.
        host_bytes_per_s: sustained bandwidth of the host memory, bytes/s
            (:func:`offload_compiler.calibrate.stream_bytes_per_s`; module docstring).
        host_update_seconds_per_param: seconds per fp32 parameter of the host AdamW update with
            torch's fused CPU kernel on all host threads; 0 derives it from ``host_bytes_per_s``
            (see the module docstring).
        host_update_loop_seconds_per_param: the same with torch's for-loop implementation
            (``CPUOptimizer``'s default); 0 derives it.
        host_is_device: the device is the host CPU itself (the ``cpu`` entry): the host update
            runs on the cores that run the compute, so it cannot overlap it.
        h2d_overhead_s, d2h_overhead_s: host seconds of one copy's runtime calls beyond its
            bytes in that direction (trinity's fetch, wait and release bookkeeping, the storage
            re-allocation); counted where copies are synchronous (``host_is_device``), for the
            activation copies (evict, prefetch) too, whose runtime calls are of the same kind but
            not measured on their own. 0 unless calibrated
            (:func:`offload_compiler.calibrate.copy_overhead_seconds`).
        host_update_seconds_per_tensor: fixed seconds per parameter tensor of the host update
            with the fused kernel (torch's per-call work); 0 unless calibrated.
        host_update_loop_seconds_per_tensor: the same with the for-loop; 0 unless calibrated.
        host_update_params_per_s_by_threads: the measured update throughput per thread count,
            ``((implementation, threads, fp32 parameters/s), ...)`` with ``implementation``
            ``"fused"`` or ``"loop"`` (``calibrate``'s ``host_update_params_per_s``); ``()``
            unless calibrated. See :meth:`host_update_s_per_param`.
        host_bytes_per_s_by_threads: the measured host bandwidth per thread count,
            ``((threads, bytes/s), ...)`` (``calibrate``'s ``host_bytes_per_s_by_threads``); ``()``
            unless calibrated.
        op_times: measured seconds per aten call on this machine
            (:class:`offload_compiler.passes.op_timing.OpTimes`, with ``op_times="measured"``);
            the cost model uses them instead of the roofline where they have the node's call.
            ``None``: the roofline everywhere. Not compared or hashed.
    """

    name: str
    flops_fp32: float
    flops_tf32: float
    flops_bf16: float
    hbm_bytes_per_s: float
    memory_bytes: int
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    pcie_gen: int = 0
    pcie_width: int = 0
    launch_overhead_s: float = 5e-6
    pageable_factor: float = 0.5
    source: str = ""
    host_bytes_per_s: float = NOMINAL_HOST["host_bytes_per_s"]
    host_update_seconds_per_param: float = 0.0
    host_update_loop_seconds_per_param: float = 0.0
    host_is_device: bool = False
    h2d_overhead_s: float = 0.0
    d2h_overhead_s: float = 0.0
    host_update_seconds_per_tensor: float = 0.0
    host_update_loop_seconds_per_tensor: float = 0.0
    host_update_params_per_s_by_threads: tuple[tuple[str, int, float], ...] = ()
    host_bytes_per_s_by_threads: tuple[tuple[int, float], ...] = ()
    op_times: Any = field(default=None, compare=False, repr=False)

    def host_update_s_per_tensor(self, implementation: str = "fused") -> float:
        """Fixed seconds per parameter tensor of the host update, ``"fused"`` or ``"loop"``
        (measured by ``calibrate``; 0 when not calibrated).

        Raises:
            ValueError: for another ``implementation``.
        """
        if implementation not in ("fused", "loop"):
            raise ValueError(f"implementation must be 'fused' or 'loop', got {implementation!r}")
        return (
            self.host_update_seconds_per_tensor
            if implementation == "fused"
            else self.host_update_loop_seconds_per_tensor
        )

    def host_update_s_per_param(self, implementation: str = "fused", threads: int | None = None) -> float:
        """Seconds per fp32 parameter of the host AdamW update: ``"fused"`` (torch's fused CPU
        kernel) or ``"loop"`` (torch's for-loop); measured when calibrated, else derived from
        the host bandwidth (module docstring). The first element of :meth:`host_update_figure`,
        which says the order of the sources and how ``threads`` picks among them.

        Raises:
            ValueError: for another ``implementation``, or ``threads`` < 1.
        """
        return self.host_update_figure(implementation, threads)[0]

    def host_update_figure(self, implementation: str = "fused", threads: int | None = None) -> tuple[float, str]:
        """``(seconds per fp32 parameter, where it comes from in words)`` of the host AdamW update.

        ``threads``: the update's intra-op threads (``CPUOptimizer.num_threads``); ``None``: all
        the host's. Where the calibration measured figures per thread count, the one at the
        largest measured count not above ``threads`` is used (:meth:`host_threads_figure`): an
        update on 3 threads where 2 and 4 were measured is taken at the 2-thread rate, an upper
        bound on its time, never the optimistic 4-thread one. In order, the first that exists:

        1. the measured update rate of ``implementation`` at that count
           (``host_update_params_per_s_by_threads``; only with ``threads`` given);
        2. the measured all-threads figure of ``implementation`` (``host_update_seconds_per_param``,
           ``host_update_loop_seconds_per_param``);
        3. for ``"loop"``: the fused figure (2., else 4.) times :data:`LOOP_SLOWDOWN`;
        4. derived from the bandwidth: ``ADAMW_BYTES_PER_PARAM / bandwidth /
           FUSED_FRACTION_OF_FLOOR``, the bandwidth at that count (``host_bytes_per_s_by_threads``)
           or else ``host_bytes_per_s``.

        A ``threads`` below every measured count falls through to the next source.

        Raises:
            ValueError: for another ``implementation``, or ``threads`` < 1.
        """
        if implementation not in ("fused", "loop"):
            raise ValueError(f"implementation must be 'fused' or 'loop', got {implementation!r}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be None or an int >= 1, got {threads!r}")
        if threads is not None:
            rates = {t: r for impl, t, r in self.host_update_params_per_s_by_threads if impl == implementation}
            at = self.host_threads_count(rates, threads)
            if at is not None:
                return 1.0 / rates[at], f"measured at {_threads(at)}"
        if implementation == "loop" and self.host_update_loop_seconds_per_param:
            return self.host_update_loop_seconds_per_param, "measured at all threads"
        if self.host_update_seconds_per_param:
            fused, source = self.host_update_seconds_per_param, "measured at all threads"
        else:
            by_threads = dict(self.host_bytes_per_s_by_threads)
            at = self.host_threads_count(by_threads, threads) if threads is not None else None
            bandwidth = by_threads[at] if at is not None else self.host_bytes_per_s
            fused = ADAMW_BYTES_PER_PARAM / bandwidth / FUSED_FRACTION_OF_FLOOR
            source = "derived from the host bandwidth" + (f" measured at {_threads(at)}" if at is not None else "")
        if implementation == "fused":
            return fused, source
        return fused * LOOP_SLOWDOWN, f"the fused figure ({source}) x {LOOP_SLOWDOWN:g}"

    @staticmethod
    def host_threads_count(by_threads: dict[int, Any], threads: int) -> int | None:
        """The largest thread count of ``by_threads`` not above ``threads``; ``None`` when every
        count is above it (or there is none)."""
        below = [t for t in by_threads if t <= threads]
        return max(below) if below else None

    def with_host_bandwidth(self, host_bytes_per_s: float) -> DeviceSpec:
        """This spec with a stated host bandwidth (bytes/s) from which the host update's figures
        are derived: the measured update figures (all threads and per thread count) and the
        measured bandwidth per thread count are dropped."""
        return replace(
            self,
            host_bytes_per_s=host_bytes_per_s,
            host_update_seconds_per_param=0.0,
            host_update_loop_seconds_per_param=0.0,
            host_update_params_per_s_by_threads=(),
            host_bytes_per_s_by_threads=(),
        )

    def transfer_bytes_per_s(self, direction: str, pinned: bool = True) -> float:
        """Copy bandwidth (bytes/s) host-to-device (``"h2d"``) or device-to-host (``"d2h"``)."""
        if direction not in ("h2d", "d2h"):
            raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")
        bw = self.h2d_bytes_per_s if direction == "h2d" else self.d2h_bytes_per_s
        return bw if pinned else bw * self.pageable_factor

    def copy_seconds(self, nbytes: int, direction: str, pinned: bool = True) -> float:
        """Seconds of one copy of ``nbytes`` bytes in ``direction`` (``"h2d"``/``"d2h"``): the
        bytes at :meth:`transfer_bytes_per_s`, plus, where copies are synchronous
        (``host_is_device``), the direction's runtime-call overhead (``h2d_overhead_s`` /
        ``d2h_overhead_s``). The one copy formula of the cost model and the stream pass.

        Raises:
            ValueError: for another ``direction``.
        """
        seconds = nbytes / self.transfer_bytes_per_s(direction, pinned)
        if self.host_is_device:
            seconds += self.h2d_overhead_s if direction == "h2d" else self.d2h_overhead_s
        return seconds

    def peak_flops(self, dtype: torch.dtype, allow_tf32: bool = False) -> float:
        """Peak FLOP/s for a matmul-like op in ``dtype``."""
        if dtype in (torch.bfloat16, torch.float16):
            return self.flops_bf16
        if dtype == torch.float32 and allow_tf32:
            return self.flops_tf32
        return self.flops_fp32


def _pcie(gen: int) -> dict:
    bw = PCIE_PRACTICAL_BYTES_PER_S[gen]
    return {"h2d_bytes_per_s": bw, "d2h_bytes_per_s": bw, "pcie_gen": gen, "pcie_width": 16}


KNOWN_DEVICES: dict[str, DeviceSpec] = {
    # NVIDIA Tesla V100 datasheet (SXM2): FP32 15.7 TFLOPS, tensor (FP16) 125 TFLOPS, HBM2 900 GB/s,
    # 32 GB. No TF32/BF16 support: FP32 matmuls run at the FP32 rate.
    "v100-32gb": DeviceSpec(
        "NVIDIA V100 32GB",
        15.7 * TFLOPS,
        15.7 * TFLOPS,
        125 * TFLOPS,
        900 * GB,
        32 * GiB,
        **_pcie(3),
        source="NVIDIA V100 datasheet (SXM2)",
    ),
    # NVIDIA A100 datasheet: FP32 19.5, TF32 156, BF16 312 TFLOPS (dense); 40GB HBM2 1,555 GB/s.
    "a100-40gb": DeviceSpec(
        "NVIDIA A100 40GB",
        19.5 * TFLOPS,
        156 * TFLOPS,
        312 * TFLOPS,
        1555 * GB,
        40 * GiB,
        **_pcie(4),
        source="NVIDIA A100 datasheet (SXM4 40GB)",
    ),
    # Same datasheet: 80GB HBM2e 2,039 GB/s (SXM).
    "a100-80gb": DeviceSpec(
        "NVIDIA A100 80GB",
        19.5 * TFLOPS,
        156 * TFLOPS,
        312 * TFLOPS,
        2039 * GB,
        80 * GiB,
        **_pcie(4),
        source="NVIDIA A100 datasheet (SXM4 80GB)",
    ),
    # NVIDIA H100 datasheet (SXM5): FP32 67, TF32 494.5, BF16 989.5 TFLOPS dense; HBM3 3.35 TB/s; 80GB.
    "h100-sxm": DeviceSpec(
        "NVIDIA H100 SXM",
        67 * TFLOPS,
        494.5 * TFLOPS,
        989.5 * TFLOPS,
        3350 * GB,
        80 * GiB,
        **_pcie(5),
        source="NVIDIA H100 datasheet (SXM5)",
    ),
    # Same datasheet (PCIe): FP32 51, TF32 378, BF16 756 TFLOPS dense; HBM2e 2.0 TB/s; 80GB.
    "h100-pcie": DeviceSpec(
        "NVIDIA H100 PCIe",
        51 * TFLOPS,
        378 * TFLOPS,
        756 * TFLOPS,
        2000 * GB,
        80 * GiB,
        **_pcie(5),
        source="NVIDIA H100 datasheet (PCIe)",
    ),
    # NVIDIA H200 datasheet (SXM): compute as H100 SXM; HBM3e 4.8 TB/s; 141 GB.
    "h200": DeviceSpec(
        "NVIDIA H200",
        67 * TFLOPS,
        494.5 * TFLOPS,
        989.5 * TFLOPS,
        4800 * GB,
        141 * GB,
        **_pcie(5),
        source="NVIDIA H200 datasheet (SXM)",
    ),
    # NVIDIA L4 datasheet: FP32 30.3, TF32 60, BF16 121 TFLOPS dense; GDDR6 300 GB/s; 24GB.
    "l4": DeviceSpec(
        "NVIDIA L4",
        30.3 * TFLOPS,
        60 * TFLOPS,
        121 * TFLOPS,
        300 * GB,
        24 * GiB,
        **_pcie(4),
        source="NVIDIA L4 datasheet",
    ),
    # NVIDIA A10 datasheet (A10G is AWS's variant with the same memory system): FP32 31.2,
    # TF32 62.5, BF16 125 TFLOPS dense; GDDR6 600 GB/s; 24GB.
    "a10g": DeviceSpec(
        "NVIDIA A10G",
        31.2 * TFLOPS,
        62.5 * TFLOPS,
        125 * TFLOPS,
        600 * GB,
        24 * GiB,
        **_pcie(4),
        source="NVIDIA A10 datasheet",
    ),
    # NVIDIA Ada (AD102) whitepaper, GeForce RTX 4090: FP32 82.6 TFLOPS; TF32 82.6 and
    # BF16 165.2 TFLOPS dense with FP32 accumulate; GDDR6X 1,008 GB/s; 24GB.
    "rtx4090": DeviceSpec(
        "NVIDIA GeForce RTX 4090",
        82.6 * TFLOPS,
        82.6 * TFLOPS,
        165.2 * TFLOPS,
        1008 * GB,
        24 * GiB,
        **_pcie(4),
        source="NVIDIA Ada Lovelace architecture whitepaper",
    ),
    # The CPU itself as the "device" (runs without a GPU). Nominal figures for a small x86 server
    # core pair: order-of-magnitude values, not a datasheet; copies are memcpy within host memory.
    # Override with the device options, or measure them (issue: calibrate).
    "cpu": DeviceSpec(
        "CPU (host as device)",
        50e9,
        50e9,
        50e9,
        10 * GB,
        16 * GiB,
        5 * GB,
        5 * GB,
        launch_overhead_s=2e-6,
        source="nominal figures for a small CPU; not measured",
        host_bytes_per_s=10 * GB,
        host_is_device=True,
    ),
}

# Patterns for names as pynvml / torch report them (``"NVIDIA H100 80GB HBM3"``,
# ``"NVIDIA A100-SXM4-40GB"``), first match wins. Whole words only: an L40S is not an L4 and an
# RTX A1000 is not an A10G; such GPUs are unknown and get the fallback with a warning.
_NAME_PATTERNS = [
    (r"\bh200\b", "h200"),
    (r"\bh100\b.*\bpcie\b", "h100-pcie"),
    (r"\bh100\b", "h100-sxm"),
    (r"\ba100\b.*\b40\s*gb\b", "a100-40gb"),
    (r"\ba100\b", "a100-80gb"),
    (r"\bv100\b", "v100-32gb"),
    (r"\ba10g?\b", "a10g"),
    (r"\bl4\b", "l4"),
    (r"\b(rtx\s*)?4090\b", "rtx4090"),
]


def lookup_device(name: str) -> DeviceSpec:
    """The table entry for ``name`` (a key of :data:`KNOWN_DEVICES` or a device name as reported
    by pynvml/torch, matched by whole words).

    Raises:
        ValueError: naming ``name`` and listing the known keys when nothing matches.
    """
    key = name.strip().lower()
    if key in KNOWN_DEVICES:
        return KNOWN_DEVICES[key]
    words = re.sub(r"[-_/]", " ", key)
    for pattern, table_key in _NAME_PATTERNS:
        if re.search(pattern, words):
            return KNOWN_DEVICES[table_key]
    raise ValueError(f"unknown device {name!r}; known: {', '.join(sorted(KNOWN_DEVICES))}")


def _nvml_spec(index: int) -> DeviceSpec | None:
    """Build a spec from pynvml for CUDA device ``index``; ``None`` if pynvml is unusable."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):
                name = name.decode()
            memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
            try:
                gen = int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle))
                width = int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle))
            except pynvml.NVMLError:
                gen, width = 0, 0
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # pynvml raises its own NVMLError subclasses
        log.info("pynvml unavailable (%s); using the device table", exc)
        return None
    try:
        base = lookup_device(name)
    except ValueError:
        log.warning(
            "trinity: GPU %r is not in the device table; using A100 80GB compute figures with its "
            "real memory size and link. Pass the device options (peak_flops, hbm_bytes_per_s) for "
            "a better plan.",
            name,
        )
        base = KNOWN_DEVICES["a100-80gb"]
    fields: dict = {"name": name, "memory_bytes": memory, "source": base.source + "; pynvml"}
    # The idle link may report a lower generation (power saving); only trust widths/gens that do
    # not exceed the table's maximum for the device.
    if gen in PCIE_PRACTICAL_BYTES_PER_S and width > 0 and gen >= base.pcie_gen:
        bw = PCIE_PRACTICAL_BYTES_PER_S[gen] * width / 16
        fields.update(h2d_bytes_per_s=bw, d2h_bytes_per_s=bw, pcie_gen=gen, pcie_width=width)
    return replace(base, **fields)


def detect_device_spec(device: torch.device, name: str | None = None) -> DeviceSpec:
    """Figures for ``device``: the table entry ``name`` when given (option ``device``), else
    pynvml (CUDA), else the table by torch's device name, else the ``cpu`` entry.

    Raises:
        ValueError: when ``name`` is given and is not in the table.
    """
    if name:
        return lookup_device(name)
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        spec = _nvml_spec(index)
        if spec is not None:
            return spec
        name = torch.cuda.get_device_name(index)
        try:
            spec = lookup_device(name)
        except ValueError:
            spec = KNOWN_DEVICES["a100-80gb"]
        return replace(spec, name=name, memory_bytes=torch.cuda.get_device_properties(index).total_memory)
    return KNOWN_DEVICES["cpu"]
