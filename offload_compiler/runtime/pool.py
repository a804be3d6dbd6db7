"""A bounded, size-bucketed pool of host memory for evicted tensors.

Blocks are pinned (page-locked) when CUDA is available, pageable otherwise. A block is in use
while any tensor views it: the pool keeps one reference to each block's storage and a block is
free when that is the only one left (PyTorch's storage use count). So a host copy returned by
``evict`` and saved by autograd stays valid for as long as autograd keeps it (a second backward
with ``retain_graph=True`` reads the same bytes), and returns to the pool by itself once it is
dropped. A block that an in-flight host-to-device copy still reads carries that copy's event and
is not handed out again before the event completes.

Sizes are rounded up to a bucket: the next of 1, 1.25, 1.5 or 1.75 times a power of two (at most
25% waste), at least 4 KiB.
"""

from __future__ import annotations

import logging
import random
import threading
import warnings
import weakref
from dataclasses import dataclass

import torch

from ..options import format_bytes

__all__ = ["HostPool", "HostPoolStats", "HostPoolExhausted", "bucket_size", "live_pool_blocks"]

log = logging.getLogger(__name__)

_MIN_BLOCK = 4096
_LIVE_POOLS: weakref.WeakSet[HostPool] = weakref.WeakSet()


def bucket_size(nbytes: int) -> int:
    """The block size (bytes) the pool uses for a request of ``nbytes``: the smallest of
    ``{1, 1.25, 1.5, 1.75} * 2**k`` that is >= ``nbytes`` and >= 4 KiB."""
    if nbytes <= _MIN_BLOCK:
        return _MIN_BLOCK
    k = (nbytes - 1).bit_length() - 1  # 2**k < nbytes <= 2**(k+1)
    base = 1 << k
    for quarter in (5, 6, 7, 8):
        size = base * quarter // 4
        if size >= nbytes:
            return size
    raise AssertionError("unreachable")


class HostPoolExhausted(MemoryError):
    """Raised when a host block cannot be had within the pool's limit.

    Attributes:
        requested_bytes: the request that failed.
        held_bytes: what the pool holds (in use and free) at the time.
        limit_bytes: the pool's limit.
    """

    def __init__(self, requested_bytes: int, held_bytes: int, in_use_bytes: int, limit_bytes: int, cause: str = ""):
        self.requested_bytes = requested_bytes
        self.held_bytes = held_bytes
        self.in_use_bytes = in_use_bytes
        self.limit_bytes = limit_bytes
        msg = (
            f"trinity host pool cannot provide {format_bytes(requested_bytes)} ({requested_bytes} bytes): "
            f"it holds {format_bytes(held_bytes)} ({in_use_bytes} bytes in use) of its limit "
            f"{format_bytes(limit_bytes)}"
        )
        if cause:
            msg += f"; the allocation failed: {cause}"
        msg += ". Raise the option host_pool_limit_bytes, or lower what is offloaded (a larger memory_budget)."
        super().__init__(msg)


@dataclass(frozen=True)
class HostPoolStats:
    """A snapshot of a pool's counters (bytes are block bytes, after bucket rounding)."""

    held_bytes: int
    in_use_bytes: int
    peak_held_bytes: int
    num_blocks: int
    num_allocations: int
    num_reuses: int
    num_releases: int
    limit_bytes: int
    pinned: bool
    overflow_bytes: int = 0
    num_overflow_allocations: int = 0


class _Block:
    __slots__ = ("storage", "size", "event", "ptr")

    def __init__(self, storage: torch.UntypedStorage, size: int):
        self.storage = storage
        self.size = size
        self.event = None  # an in-flight copy reading this block (CUDA event) or None
        self.ptr = storage.data_ptr()

    def in_use(self) -> bool:
        # The pool's own reference is the one use left when no tensor views the block.
        return torch._C._storage_Use_Count(self.storage._cdata) > 1

    def copy_pending(self) -> bool:
        if self.event is None:
            return False
        if self.event.query():
            self.event = None
            return False
        return True


class HostPool:
    """Host memory for evicted tensors, bounded by ``limit_bytes``.

    Args:
        limit_bytes: the most bytes the pool may hold (blocks in use plus free blocks).
        pin_memory: allocate page-locked memory (only valid when CUDA is available).
        shuffle_seed: fault injection for tests: hand out free blocks in a random order.
        on_full: at the limit, ``"error"`` raises :class:`HostPoolExhausted`; ``"fallback"``
            allocates outside the pool (warning once) and frees that memory as soon as it is no
            longer used.

    Thread-safe. Stats via :meth:`stats`.
    """

    def __init__(
        self, limit_bytes: int, pin_memory: bool = False, shuffle_seed: int | None = None, on_full: str = "error"
    ):
        if limit_bytes <= 0:
            raise ValueError(f"HostPool limit_bytes must be positive, got {limit_bytes}")
        if on_full not in ("error", "fallback"):
            raise ValueError(f"HostPool on_full must be 'error' or 'fallback', got {on_full!r}")
        self.on_full = on_full
        self._overflow: list[_Block] = []  # blocks past the limit (fallback), released once free
        self._overflow_allocations = 0
        self._warned = False
        self.limit_bytes = int(limit_bytes)
        self.pin_memory = bool(pin_memory)
        self._lock = threading.Lock()
        self._blocks: dict[int, list[_Block]] = {}
        self._held = 0
        self._peak_held = 0
        self._allocations = 0
        self._reuses = 0
        self._releases = 0
        # Fault injection (tests): hand out free blocks in a random order, not the first free one.
        self._shuffle = random.Random(shuffle_seed) if shuffle_seed is not None else None
        _LIVE_POOLS.add(self)

    # ------------------------------------------------------------------ allocation
    def empty_strided(self, size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of ``size``/``stride``/``dtype`` backed by a pool block.

        Raises:
            HostPoolExhausted: when the block cannot be had within the limit (or the allocation
                itself fails); the pool keeps nothing of a failed request.
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        span = 1
        for s, st in zip(size, stride):
            if s == 0:
                span = 0
                break
            span += (s - 1) * st
        nbytes = span * itemsize
        with self._lock:
            block = self._acquire_locked(max(nbytes, 1))
            # Viewing the block marks it in use; do it under the lock so no other thread takes it.
            t = torch.empty(0, dtype=dtype)
            t.set_(block.storage, 0, tuple(size), tuple(stride))
        return t

    def _acquire_locked(self, nbytes: int) -> _Block:
        size = bucket_size(nbytes)
        free = (b for b in self._blocks.get(size, ()) if not b.in_use() and not b.copy_pending())
        if self._shuffle is not None:
            choices = list(free)
            free = iter([self._shuffle.choice(choices)] if choices else [])
        for block in free:
            self._reuses += 1
            return block
        self._release_overflow_locked()
        if self._held + size > self.limit_bytes:
            self._trim_locked(self._held + size - self.limit_bytes, keep=size)
        if self._held + size > self.limit_bytes:
            if self.on_full == "error":
                raise HostPoolExhausted(nbytes, self._held, self._in_use_locked(), self.limit_bytes)
            return self._overflow_block_locked(nbytes, size)
        try:
            storage = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory).untyped_storage()
        except (RuntimeError, MemoryError) as exc:
            raise HostPoolExhausted(nbytes, self._held, self._in_use_locked(), self.limit_bytes, str(exc)) from exc
        block = _Block(storage, size)
        self._blocks.setdefault(size, []).append(block)
        self._held += size
        self._peak_held = max(self._peak_held, self._held)
        self._allocations += 1
        return block

    def _overflow_block_locked(self, nbytes: int, size: int) -> _Block:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"trinity host pool reached its limit {format_bytes(self.limit_bytes)} asking for "
                f"{format_bytes(nbytes)}; falling back to unpooled host memory, freed as soon as "
                "unused (warned once; raise host_pool_limit_bytes to keep copies pooled)",
                stacklevel=4,
            )
        try:
            storage = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory).untyped_storage()
        except (RuntimeError, MemoryError) as exc:
            raise HostPoolExhausted(nbytes, self._held, self._in_use_locked(), self.limit_bytes, str(exc)) from exc
        block = _Block(storage, size)
        self._overflow.append(block)
        self._overflow_allocations += 1
        return block

    def _release_overflow_locked(self) -> None:
        self._overflow = [b for b in self._overflow if b.in_use() or b.copy_pending()]

    def _trim_locked(self, need: int, keep: int) -> None:
        """Release free blocks of other sizes until ``need`` bytes are freed."""
        freed = 0
        for size in sorted(self._blocks, reverse=True):
            if size == keep:
                continue
            blocks = self._blocks[size]
            for block in list(blocks):
                if freed >= need:
                    return
                if not block.in_use() and not block.copy_pending():
                    blocks.remove(block)
                    self._held -= size
                    self._releases += 1
                    freed += size

    def mark_busy(self, tensor: torch.Tensor, event) -> None:
        """Record that an in-flight copy (``event``: anything with ``query()``, e.g. a
        ``torch.cuda.Event``) reads or writes ``tensor``'s block, so the block is not handed out
        again before the copy completes."""
        ptr = tensor.untyped_storage().data_ptr()
        with self._lock:
            for blocks in (*self._blocks.values(), self._overflow):
                for block in blocks:
                    if block.ptr == ptr:
                        block.event = event
                        return

    mark_read_by = mark_busy

    def release_free(self) -> int:
        """Give all free blocks back to the system; returns the bytes released."""
        with self._lock:
            before = self._held
            self._trim_locked(self._held, keep=-1)
            return before - self._held

    # ------------------------------------------------------------------ introspection
    def _in_use_locked(self) -> int:
        return sum(b.size for blocks in self._blocks.values() for b in blocks if b.in_use())

    def stats(self) -> HostPoolStats:
        with self._lock:
            return HostPoolStats(
                held_bytes=self._held,
                in_use_bytes=self._in_use_locked(),
                peak_held_bytes=self._peak_held,
                num_blocks=sum(len(b) for b in self._blocks.values()),
                num_allocations=self._allocations,
                num_reuses=self._reuses,
                num_releases=self._releases,
                limit_bytes=self.limit_bytes,
                pinned=self.pin_memory,
                overflow_bytes=sum(b.size for b in self._overflow),
                num_overflow_allocations=self._overflow_allocations,
            )

    def block_ranges(self) -> list[tuple[int, int]]:
        """``(data_ptr, size)`` of every block held, for memory accounting."""
        with self._lock:
            return [(b.ptr, b.size) for blocks in (*self._blocks.values(), self._overflow) for b in blocks]

    def owns(self, tensor: torch.Tensor) -> bool:
        ptr = tensor.untyped_storage().data_ptr()
        return any(p == ptr for p, _ in self.block_ranges())

    def is_unused_block(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` is one of the pool's blocks and no tensor views it any more (the
        pool's own reference is the only one left)."""
        ptr = storage.data_ptr()
        with self._lock:
            for blocks in (*self._blocks.values(), self._overflow):
                for block in blocks:
                    if block.ptr == ptr:
                        return not block.in_use()
        return False


def live_pool_blocks() -> list[tuple[int, int]]:
    """``(data_ptr, size)`` of every block of every live pool in this process (for accounting:
    pool memory is host memory, never device memory)."""
    out: list[tuple[int, int]] = []
    for pool in list(_LIVE_POOLS):
        out.extend(pool.block_ranges())
    return out
