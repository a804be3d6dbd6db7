"""Peak device bytes of one forward and backward, the same way for every method.

On CUDA: the caching allocator's peak (``offload_compiler.measure_peak_device_bytes``).

On CPU the CPU plays the device, so host and "device" memory are the same RAM. The count is then
the project's own accounting (``offload_compiler.measure_peak_device_bytes``: every CPU allocation
and free during the call, replayed in order, trinity's host pool left out) plus the tensors declared
resident. One other method keeps host copies of its own: ``save_on_cpu``. Its copies are made
inside a ``torch.profiler.record_function`` range named :data:`HOST_SCOPE`; for such a call
:func:`measure_peak` replays the same allocator trace but counts allocations made inside that range
as host memory, as ``measure_peak_device_bytes`` does for trinity's pool. Calls without the range
get exactly ``measure_peak_device_bytes``'s figure (``tests/test_bench.py`` checks that the two
replays agree).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from offload_compiler import MemoryMeasurement, measure_peak_device_bytes
from offload_compiler.runtime.accounting import ResidentStorages, replay_allocations, resident_bytes
from offload_compiler.runtime.pool import live_pool_blocks

__all__ = ["HOST_SCOPE", "measure_peak", "replay_cpu_trace"]

HOST_SCOPE = "bench::host_copy"


def replay_cpu_trace(prof, host_scope: str | None = HOST_SCOPE) -> tuple[int, int, int]:
    """``(peak, end, host)`` bytes of the CPU allocations in a finished ``torch.profiler`` trace:
    the most live at once, what is still live at the end, and what was allocated inside
    ``host_scope`` (or by a trinity host pool) and so left out of the other two."""
    from torch._C._profiler import _EventType

    events = []
    stack = [(node, False) for node in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, in_host = stack.pop()
        in_host = in_host or (host_scope is not None and node.name == host_scope)
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.ptr, int(fields.alloc_size), in_host))
        stack.extend((child, in_host) for child in node.children)
    pool_ptrs = {ptr for ptr, _ in live_pool_blocks()}
    host = sum(size for _, ptr, size, in_host in events if size > 0 and (in_host or ptr in pool_ptrs))
    # The project's one replay (offload_compiler.runtime.accounting); host blocks' allocations
    # left out (a free inside the host scope may be of a device block: it is kept).
    replay = replay_allocations(
        [(t, ptr, size) for t, ptr, size, in_host in events if size <= 0 or not (in_host or ptr in pool_ptrs)],
        ResidentStorages({}),
    )
    peak, current = replay.peak_bytes, replay.end_bytes
    return peak, current, host


def measure_peak(
    fn: Callable[[], Any],
    *,
    resident: Iterable[torch.Tensor],
    device: torch.device,
    host_copies: bool = False,
) -> MemoryMeasurement:
    """Peak device bytes while ``fn()`` runs (``resident`` counted throughout on CPU).

    ``host_copies``: the call makes host copies inside :data:`HOST_SCOPE` (CPU only; see the
    module's docstring)."""
    if device.type == "cuda" or not host_copies:
        return measure_peak_device_bytes(fn, resident=resident, device=device)
    os.environ.setdefault("KINETO_LOG_LEVEL", "99")
    from torch.profiler import ProfilerActivity, profile

    base = resident_bytes(resident)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        result = fn()
    peak, end, host = replay_cpu_trace(prof)
    return MemoryMeasurement(
        peak_bytes=base + peak,
        resident_bytes=base,
        allocated_delta_bytes=end,
        host_pool_bytes=host,
        method="cpu-allocator-trace (bench host scope)",
        result=result,
    )
