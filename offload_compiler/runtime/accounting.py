"""Measuring peak device memory, with or without a GPU.

On CUDA the caching allocator's own peak (``torch.cuda.max_memory_allocated``) is the answer.

On a machine without a GPU the CPU plays the device, so host memory and "device" memory are the
same RAM. :func:`measure_peak_device_bytes` then records every allocation and free made by the
CPU allocator while the callable runs (``torch.profiler`` with ``profile_memory=True``: the
allocator reports each one with its address, so Inductor's own buffers are seen too, not only
tensors that pass through the dispatcher) and replays them in time order. Blocks owned by a trinity
host pool are host memory and are left out, so an evicted activation really disappears from the
"device" count once its device storage is freed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .pool import live_pool_blocks

__all__ = ["MemoryMeasurement", "measure_peak_device_bytes", "resident_bytes"]


@dataclass(frozen=True)
class MemoryMeasurement:
    """Result of :func:`measure_peak_device_bytes`.

    Attributes:
        peak_bytes: peak device bytes while the callable ran, including ``resident_bytes``.
        resident_bytes: device bytes alive before the call that were declared (CPU) or counted by
            the allocator (CUDA).
        allocated_delta_bytes: device bytes allocated during the call and still alive after it.
        host_pool_bytes: bytes allocated by trinity host pools during the call (not counted).
        method: ``"cuda-allocator"`` or ``"cpu-allocator-trace"``.
        result: what the callable returned.
    """

    peak_bytes: int
    resident_bytes: int
    allocated_delta_bytes: int
    host_pool_bytes: int
    method: str
    result: Any = None


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _walk(nodes):
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children)


def measure_peak_device_bytes(
    fn: Callable[[], Any],
    *,
    resident: Iterable[torch.Tensor] = (),
    device: torch.device | str | None = None,
    warmup: Callable[[], Any] | None = None,
) -> MemoryMeasurement:
    """Run ``fn()`` once and measure the peak of live device bytes.

    Args:
        fn: the callable to measure (e.g. one training step).
        resident: on the CPU, tensors alive before the call whose bytes count as device memory
            throughout (parameters, gradients, inputs). Ignored on CUDA, where the allocator
            already counts them.
        device: ``"cuda"`` (or a CUDA device) to use the CUDA allocator; anything else measures
            the CPU allocator. Defaults to CUDA when available.
        warmup: on the CPU, run first under the same trace but not measured: the CPU allocator
            reports the free of a block only if it saw the allocation, so a step that frees
            memory allocated by an earlier step (parameters released by ``offload=
            "activations+params"``) is measured right after a warmup step that allocated it.
            What the warmup leaves allocated counts as resident. Ignored on CUDA.

    Returns:
        A :class:`MemoryMeasurement`; ``result`` holds ``fn()``'s return value.
    """
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        result = fn()
        torch.cuda.synchronize(dev)
        return MemoryMeasurement(
            peak_bytes=int(torch.cuda.max_memory_allocated(dev)),
            resident_bytes=int(before),
            allocated_delta_bytes=int(torch.cuda.memory_allocated(dev) - before),
            host_pool_bytes=0,
            method="cuda-allocator",
            result=result,
        )

    # Kineto prints a line at every profiler start and stop unless told otherwise; it reads this
    # once, when the profiler first starts. A value the user set is left alone.
    os.environ.setdefault("KINETO_LOG_LEVEL", "99")
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    base = resident_bytes(resident)
    marker = "trinity::measure_start"
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        if warmup is not None:
            warmup()
        with torch.profiler.record_function(marker):
            pass
        result = fn()
    events = []
    start_ns = None
    for node in _walk(prof.profiler.kineto_results.experimental_event_tree()):
        if warmup is not None and node.name == marker:
            start_ns = node.start_time_ns
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.ptr, int(fields.alloc_size)))
    events.sort(key=lambda e: e[0])
    pool_ptrs = {ptr for ptr, _ in live_pool_blocks()}
    live: dict[int, int] = {}
    current = peak = pool_bytes = 0
    measuring = start_ns is None
    for t_ns, ptr, size in events:
        if not measuring and t_ns >= start_ns:
            measuring, peak = True, current
        if size > 0:
            if ptr in pool_ptrs:
                if measuring:
                    pool_bytes += size
                continue
            live[ptr] = size
            current += size
            if measuring:
                peak = max(peak, current)
        else:
            # Frees of allocations made before the call are not known here; the memory they held
            # is not in ``resident`` either unless the caller put it there, so ignoring them can
            # only overstate the peak.
            freed = live.pop(ptr, None)
            if freed is not None:
                current -= freed
    if not measuring:
        peak = current
    return MemoryMeasurement(
        peak_bytes=base + peak,
        resident_bytes=base,
        allocated_delta_bytes=current,
        host_pool_bytes=pool_bytes,
        method="cpu-allocator-trace",
        result=result,
    )
