"""Measuring peak device memory, with or without a GPU.

On CUDA the caching allocator's own peak (``torch.cuda.max_memory_allocated``) is the answer.

On a machine without a GPU the CPU plays the device, so host memory and "device" memory are the
same RAM. :func:`measure_peak_device_bytes` then records every allocation and free made by the
CPU allocator while the callable runs (``torch.profiler`` with ``profile_memory=True``: the
allocator reports each one with its address, so Inductor's own buffers are seen too, not only
tensors that pass through the dispatcher) and replays them in time order. Blocks owned by a trinity
host pool are host memory and are left out, so an evicted activation really disappears from the
"device" count once its device storage is freed.

Storages alive before the trace (the ``resident`` tensors: parameters, inputs) are counted from
the start. The CPU allocator reports no free of a block it did not see allocated, so when the
measured call frees one of them (``offload="activations+params"`` releases every offloaded
parameter after its last forward reader and fetches it back, a new allocation, for the backward)
the trace alone would count that parameter twice from its backward fetch on. The free is found
instead from the ``trinity::param_release`` call that makes it (:func:`param_release_call`: the
profiler records the data pointer of the storage it is handed), and its bytes stop counting there
(:class:`ResidentStorages`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..ir.ops import PARAM_RELEASE
from .pool import live_pool_blocks

# Below this many bytes an allocation is the allocator's small bookkeeping (a wrapped scalar, a
# shape buffer, a loss scalar's storage), which no plan counts: the runtime check leaves transients
# this small out of its margins (step_check.MIN_TRANSIENT_BYTES), the step ledger does not count
# held outputs this small (step_budget.MIN_HELD_OUTPUT_BYTES), and the step report takes a measured
# peak above the budget by less than this as within it.
SMALL_ALLOCATION_BYTES = 4096

__all__ = [
    "SMALL_ALLOCATION_BYTES",
    "MemoryMeasurement",
    "ResidentStorages",
    "measure_peak_device_bytes",
    "param_release_call",
    "replay_allocations",
    "resident_bytes",
    "resident_storages",
]

# The profiler's name of a trinity::param_release call (a TorchOp event).
_PARAM_RELEASE_NAME = PARAM_RELEASE._schema.name


@dataclass(frozen=True)
class MemoryMeasurement:
    """Result of :func:`measure_peak_device_bytes`.

    Attributes:
        peak_bytes: peak device bytes while the callable ran, including ``resident_bytes`` (less
            those of resident storages freed by then).
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


def resident_storages(tensors: Iterable[Any], device: torch.device | str | None = None) -> dict[int, int]:
    """The distinct storages behind ``tensors``: data pointer -> bytes (views of one storage count
    once; a traceable wrapper subclass counts as its inner tensors, ``__tensor_flatten__``;
    released storages, of 0 bytes, fake tensors and entries that are no tensor are left out). With ``device``,
    only tensors on that device (``"cpu"`` or ``"cuda:0"``; ``"cuda"`` matches every CUDA
    device)."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    dev = torch.device(device) if device is not None else None
    seen: dict[int, int] = {}
    stack = list(tensors)
    while stack:
        t = stack.pop()
        if not isinstance(t, torch.Tensor) or is_fake(t):  # a fake tensor holds no memory
            continue
        if is_traceable_wrapper_subclass(t):
            stack.extend(getattr(t, name) for name in t.__tensor_flatten__()[0])
            continue
        if dev is not None and (t.device.type != dev.type or (dev.index is not None and t.device.index != dev.index)):
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return seen


def resident_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    return sum(resident_storages(tensors).values())


def param_release_call(node) -> tuple[int, int] | None:
    """``(start time ns, data pointer of the storage released)`` when ``node``, an event of a
    ``torch.profiler`` event tree (``kineto_results.experimental_event_tree()``) recorded with
    ``record_shapes=True``, is a call of ``trinity::param_release``; else ``None``.

    The pointer is the one its first argument's storage had when the call started (the profiler
    records the inputs at entry), i.e. the storage the call frees, if it was resident."""
    from torch._C._profiler import _EventType, _TensorMetadata

    if node.tag != _EventType.TorchOp or node.name != _PARAM_RELEASE_NAME:
        return None
    inputs = node.extra_fields.inputs
    if not inputs or not isinstance(inputs[0], _TensorMetadata):
        return None
    ptr = inputs[0].storage_data_ptr
    return (int(node.start_time_ns), int(ptr)) if ptr else None


class ResidentStorages:
    """The storages alive before a trace that are still alive at a point of its replay.

    Args:
        storages: data pointer -> bytes (:func:`resident_storages`), all counted at the start.

    :meth:`free` is called, in time order, for every free the trace reports of a pointer it did
    not see allocated (CUDA's allocator reports them; the CPU allocator does not) and for every
    ``trinity::param_release`` call (:func:`param_release_call`) on such a pointer; it returns the
    bytes that stop counting there: the storage's the first time, 0 after (the release call and
    the allocator's free of one storage both arrive on CUDA) and for pointers not in ``storages``.
    """

    def __init__(self, storages: dict[int, int]):
        self._live = dict(storages)
        self.freed_bytes = 0

    def free(self, ptr: int) -> int:
        n = self._live.pop(ptr, 0)
        self.freed_bytes += n
        return n


@dataclass(frozen=True)
class Replay:
    """Result of :func:`replay_allocations` (bytes).

    Attributes:
        peak_bytes: the most bytes of the replayed allocations alive at once (from ``start_ns`` on,
            where given), less the resident storages freed by then.
        end_bytes: the replayed allocations still alive at the end (resident frees not subtracted).
    """

    peak_bytes: int
    end_bytes: int


def replay_allocations(
    events: Iterable[tuple[int, int, int | None]], resident: ResidentStorages, start_ns: int | None = None
) -> Replay:
    """Replay allocator events in time order: the one replay behind every CPU peak measurement
    (:func:`measure_peak_device_bytes`, the first steps' check in ``step_check.py`` and the
    benchmarks' ``bench/memory.py``).

    Args:
        events: ``(time ns, data pointer, bytes)``: bytes > 0 an allocation, < 0 a free, ``None``
            a ``trinity::param_release`` call on the pointer (:func:`param_release_call`). The
            caller leaves out what does not count (host-pool blocks, other devices). At one time a
            release call sorts before an allocator event.
        resident: the storages alive before the trace; a free (or release call) of a pointer not
            allocated in the trace stops counting one of them (:meth:`ResidentStorages.free`).
        start_ns: where given, the peak is of the events from this time on (a warmup before it
            is replayed for its allocations, not measured).

    An address handed out again without its free seen drops the earlier block first (the
    allocator reuses an address only after it is freed).
    """
    order = sorted(events, key=lambda e: (e[0], 0 if e[2] is None else 1, e[1]))
    live: dict[int, int] = {}
    current = 0
    measuring = start_ns is None
    peak = 0
    for t_ns, ptr, size in order:
        if not measuring and t_ns >= start_ns:
            measuring, peak = True, current - resident.freed_bytes
        if size is not None and size > 0:
            old = live.pop(ptr, None)
            if old is not None:
                current -= old
            live[ptr] = size
            current += size
            if measuring:
                peak = max(peak, current - resident.freed_bytes)
            continue
        freed = live.pop(ptr, None) if size is not None else None
        if freed is not None:
            current -= freed
        elif ptr not in live:
            # A storage allocated before the trace: counted in ``resident`` up to here if the
            # caller put it there. Frees of others are not known here; ignoring them can only
            # overstate the peak.
            resident.free(ptr)
    if not measuring:
        peak = current - resident.freed_bytes
    return Replay(peak_bytes=int(peak), end_bytes=int(current))


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
            (parameters, gradients, inputs): throughout, or until a ``trinity::param_release``
            in the call (or the warmup) frees their storage (``offload="activations+params"``
            releases parameters inside the step). Ignored on CUDA, where the allocator already
            counts them.
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

    storages = resident_storages(resident)
    held = ResidentStorages(storages)
    base = sum(storages.values())
    marker = "trinity::measure_start"
    # record_shapes: the storage a trinity::param_release call frees (param_release_call).
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        if warmup is not None:
            warmup()
        with torch.profiler.record_function(marker):
            pass
        result = fn()
    events = []  # (time ns, ptr, bytes: > 0 allocated, < 0 freed, None: a param_release call)
    start_ns = None
    for node in _walk(prof.profiler.kineto_results.experimental_event_tree()):
        if warmup is not None and node.name == marker:
            start_ns = node.start_time_ns
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.ptr, int(fields.alloc_size)))
        release = param_release_call(node)
        if release is not None:
            events.append((*release, None))
    pool_ptrs = {ptr for ptr, _ in live_pool_blocks()}
    # Host-pool blocks are host memory: counted apart (those allocated while measuring).
    pool_bytes = sum(
        size
        for t_ns, ptr, size in events
        if size is not None and size > 0 and ptr in pool_ptrs and (start_ns is None or t_ns >= start_ns)
    )
    replay = replay_allocations((e for e in events if e[1] not in pool_ptrs), held, start_ns)
    peak, current = replay.peak_bytes, replay.end_bytes
    return MemoryMeasurement(
        peak_bytes=base + peak,
        resident_bytes=base,
        allocated_delta_bytes=current,
        host_pool_bytes=pool_bytes,
        method="cpu-allocator-trace",
        result=result,
    )
