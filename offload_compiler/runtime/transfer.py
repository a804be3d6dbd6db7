"""The transfer runtime of one compiled graph pair: host pool, copy streams, pending copies.

A :class:`TransferRuntime` belongs to the compiled artifact (the backend keeps a strong reference
next to the compiled function). The ``trinity::*`` ops find it through an integer id baked into
the graph; :func:`get_runtime` maps ids to live runtimes through a weak registry, so a runtime
lives exactly as long as the compiled code that uses it.

Copies move raw bytes: the host copy has the same size, stride and dtype as the device tensor, and
the bytes spanned by the view (from its first to its last element) are copied as one block. So a
non-contiguous view (``logits[:, :-1]``, a transpose) round-trips with its exact layout and no
temporary, and a view never drags the rest of its storage along.
"""

from __future__ import annotations

import itertools
import random
import threading
import weakref
from dataclasses import dataclass

import torch

from ..ir.alias import span_bytes
from .pool import HostPool, HostPoolStats
from .streams import ComputeStreams, CopyStreams

__all__ = ["FaultInjection", "TransferRuntime", "TransferStats", "get_runtime", "span_bytes", "flat_bytes"]

_ids = itertools.count(1)
_registry: weakref.WeakValueDictionary[int, TransferRuntime] = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of the bytes ``t`` spans, starting at its first element."""
    n = span_bytes(tuple(t.shape), tuple(t.stride()), t.element_size())
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    flat.set_(t.untyped_storage(), t.storage_offset() * t.element_size(), (n,), (1,))
    return flat


@dataclass(frozen=True)
class FaultInjection:
    """A test mode that makes ordering bugs show as wrong values on a CPU.

    * every copy is deferred: it happens at its wait, or, with ``early_probability``, at some
      later trinity op before that (a copy that "completes" at a random point);
    * fresh host buffers and freshly allocated prefetch destinations are filled with NaN (all bits
      set: NaN for floats, -1 for integers) before the copy that should fill them;
    * the host pool hands out free blocks in a random order.

    A missing wait, a reader before its wait, a prefetch before its eviction completed, or a host
    block reused while still needed then reads NaN or another tensor's bytes.
    """

    seed: int = 0
    early_probability: float = 0.25


@dataclass(frozen=True)
class TransferStats:
    """Counters of one runtime since it was created (bytes are view bytes, not block bytes;
    ``bytes_d2h``/``bytes_h2d`` include the parameter copies of parameter offload, the copy
    counts do not; ``pending_copies`` counts both)."""

    num_evicts: int
    num_prefetches: int
    bytes_d2h: int
    bytes_h2d: int
    pending_copies: int
    host_pool: HostPoolStats


class _Pending:
    """A copy issued and not yet waited for: its completion event and the storages that must
    outlive it (the copy's source and destination), so that an exception that drops the graph's
    references cannot free memory a copy still reads or writes."""

    __slots__ = ("event", "keepalive")

    def __init__(self, event, keepalive: tuple):
        self.event = event
        self.keepalive = keepalive


class _Deferred:
    """Fault injection: a copy that has not happened yet (of bytes, or element by element between
    two layouts). It holds its source and destination weakly: a source freed before the copy runs leaves the destination poisoned, as a real copy
    from freed memory would leave it wrong. ``query()`` makes it usable as a pool block's event;
    ``synchronize()`` (a host-side wait, as on a CUDA event) runs it. Thread-safe: the CPU
    optimizer's worker may complete a parameter copy while the graph's thread waits for it."""

    __slots__ = ("src", "src_offset", "src_nbytes", "dst", "dst_offset", "nbytes", "layouts", "done", "lock")

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, nbytes: int, elementwise: bool = False):
        self.src = weakref.ref(src.untyped_storage())
        self.src_offset = src.storage_offset() * src.element_size()
        self.dst = weakref.ref(dst.untyped_storage())
        self.dst_offset = dst.storage_offset() * dst.element_size()
        # An element-wise copy between two layouts (an evict into strides other than the
        # source's): (dtype, size, source strides, destination strides); else a byte copy.
        self.layouts = (src.dtype, tuple(src.shape), tuple(src.stride()), tuple(dst.stride())) if elementwise else None
        self.nbytes = nbytes  # the destination's span; the source's, for a byte copy
        self.src_nbytes = (
            span_bytes(tuple(src.shape), tuple(src.stride()), src.element_size()) if elementwise else nbytes
        )
        self.done = False
        self.lock = threading.Lock()

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.run()

    def orphaned(self, pool: HostPool) -> bool:
        """Whether nothing can ever read this copy's result: its source or destination is gone,
        or its destination is a host block no tensor views any more (an exception dropped the
        evicted copy while the pool keeps the block)."""
        src, dst = self.src(), self.dst()
        return src is None or dst is None or pool.is_unused_block(dst)

    def run(self) -> None:
        with self.lock:
            if self.done:
                return
            self.done = True
            src, dst = self.src(), self.dst()
            if src is None or dst is None:
                return
            end = self.nbytes
            if src.nbytes() < self.src_offset + self.src_nbytes or dst.nbytes() < self.dst_offset + end:
                # A storage resized to 0 since (a parameter released before the wait of its
                # fetch): a real copy would have read or written freed memory; nothing is copied.
                return
            if self.layouts is not None:
                dtype, size, src_stride, dst_stride = self.layouts
                view = lambda storage, offset, stride: torch.empty(0, dtype=dtype).set_(  # noqa: E731
                    storage, offset // dtype.itemsize, size, stride
                )
                view(dst, self.dst_offset, dst_stride).copy_(view(src, self.src_offset, src_stride))
                return
            flat = lambda storage, offset: torch.empty(0, dtype=torch.uint8).set_(storage, offset, (end,), (1,))  # noqa: E731
            flat(dst, self.dst_offset).copy_(flat(src, self.src_offset))


class TransferRuntime:
    """Host pool, copy streams and pending-copy events for one compiled graph pair.

    Every copy in flight is recorded with the storages it reads and writes until its wait; an
    exception that unwinds the graph between a copy and its wait leaves the entry behind, and
    the next trinity op (or :meth:`purge`) drops it once its copy has completed. So no memory a
    copy still touches is freed early, and nothing stays pending after the next step.

    Args:
        device: the compute device of the graphs.
        host_pool_limit_bytes: the host pool's limit (bytes).
        faults: a :class:`FaultInjection` test mode (CPU only), or ``None``.
        on_pool_full: ``"fallback"`` (host memory outside the pool, with a one-time warning) or
            ``"error"`` when the pool's limit is reached.
    """

    def __init__(
        self,
        device: torch.device,
        host_pool_limit_bytes: int,
        faults: FaultInjection | None = None,
        on_pool_full: str = "fallback",
    ):
        self.device = torch.device(device)
        self.streams = CopyStreams(self.device)
        # The compute streams and events of multi-stream graphs (passes/assign_streams.py).
        self.compute_streams = ComputeStreams(self.device)
        self.faults = faults
        self._rng = random.Random(faults.seed) if faults is not None else None
        self.pool = HostPool(
            host_pool_limit_bytes,
            pin_memory=self.streams.enabled,
            shuffle_seed=faults.seed if faults else None,
            on_full=on_pool_full,
        )
        self._pending: dict[int, _Pending] = {}
        self._deferred: dict[int, _Deferred] = {}
        self._staged: list = []  # parameter slots with a gradient copy into a staging block
        self._lock = threading.Lock()
        self._evicts = 0
        self._prefetches = 0
        self._bytes_d2h = 0
        self._bytes_h2d = 0
        with _registry_lock:
            self.id = next(_ids)
            _registry[self.id] = self

    # ------------------------------------------------------------------ the four operations
    def evict(self, src: torch.Tensor, stride: tuple[int, ...] | None = None) -> torch.Tensor:
        """Start the D2H copy of ``src`` into a pooled host tensor; return it.

        The host tensor has ``src``'s size and dtype and the strides ``stride`` (default ``src``'s
        own). With ``src``'s strides the copy moves the bytes ``src`` spans; with others it copies
        element by element (``Tensor.copy_``; on CUDA through a device tensor in the host
        tensor's layout, made on the copy stream and held to the wait: device memory the plan
        does not count), so the host tensor is in the layout the graph declares whichever layout
        the inner compiler gave ``src``.

        ``src`` must stay alive until :meth:`evict_wait` (the graph passes it there)."""
        self.purge()
        stride = tuple(src.stride()) if stride is None else tuple(int(s) for s in stride)
        host = self.pool.empty_strided(tuple(src.shape), stride, src.dtype)
        nbytes = span_bytes(tuple(src.shape), stride, src.element_size())
        same_layout = stride == tuple(src.stride())
        if self.faults is not None:
            flat_bytes(host).fill_(0xFF)
            if nbytes:
                self._defer(host, src, host, nbytes, elementwise=not same_layout)
        elif nbytes:
            staged = src
            with self.streams.start_on(self.streams.d2h):
                if not same_layout and self.streams.enabled:
                    # A D2H copy between layouts is not a memcpy (torch would stage it through
                    # pageable memory, synchronously): re-lay the source out on the device, on
                    # the copy stream, and copy those bytes. The staging tensor lives until the
                    # wait, as the source does.
                    staged = torch.empty_strided(tuple(src.shape), stride, dtype=src.dtype, device=src.device)
                    staged.copy_(src)
                if same_layout or self.streams.enabled:
                    flat_bytes(host).copy_(flat_bytes(staged), non_blocking=self.streams.enabled)
                else:
                    host.copy_(src)
            event = self.streams.record(self.streams.d2h)
            if event is not None:
                # The copy writes the host block: no reuse before it is done, even if an
                # exception drops the host tensor first.
                self.pool.mark_busy(host, event)
                with self._lock:
                    self._pending[host.untyped_storage().data_ptr()] = _Pending(
                        event, (src.untyped_storage(), staged.untyped_storage(), host.untyped_storage())
                    )
        with self._lock:
            self._evicts += 1
            self._bytes_d2h += nbytes
        return host

    def evict_wait(self, host: torch.Tensor, src: torch.Tensor) -> None:
        """Make the compute stream wait for ``host``'s D2H copy; after this ``src`` may be freed."""
        self._wait(host)

    def prefetch(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Allocate a device tensor with ``host``'s layout and start the H2D copy into it."""
        self.purge()
        dev = torch.empty_strided(tuple(host.shape), tuple(host.stride()), dtype=host.dtype, device=device)
        nbytes = span_bytes(tuple(host.shape), tuple(host.stride()), host.element_size())
        if self.faults is not None:
            flat_bytes(dev).fill_(0xFF)
            if nbytes:
                self._defer(dev, host, dev, nbytes)
        elif nbytes:
            with self.streams.start_on(self.streams.h2d):
                flat_bytes(dev).copy_(flat_bytes(host), non_blocking=self.streams.enabled)
            event = self.streams.record(self.streams.h2d)
            if event is not None:
                # The host block may be dropped right after this call; keep it from reuse until
                # the copy that reads it is done.
                self.pool.mark_busy(host, event)
                with self._lock:
                    self._pending[dev.untyped_storage().data_ptr()] = _Pending(
                        event, (host.untyped_storage(), dev.untyped_storage())
                    )
        with self._lock:
            self._prefetches += 1
            self._bytes_h2d += nbytes
        return dev

    def prefetch_wait(self, dev: torch.Tensor) -> None:
        """Make the compute stream wait for ``dev``'s H2D copy."""
        self._wait(dev)

    def _wait(self, dst: torch.Tensor) -> None:
        """The compute stream waits for the copy into ``dst`` (keyed by its storage); under
        fault injection, that deferred copy runs now."""
        self.wait_key(dst.untyped_storage().data_ptr())

    def wait_key(self, key) -> None:
        """The compute stream waits for the copy registered under ``key`` (a storage's address
        for activation copies, a ``(kind, slot id)`` tuple for parameter copies); under fault
        injection that deferred copy runs now. Non-blocking for the host; a no-op when nothing is
        pending under ``key``."""
        if self.faults is not None:
            self._complete(key)
            self._fault_tick()
        with self._lock:
            pending = self._pending.pop(key, None)
        if pending is not None:
            self.streams.wait(pending.event)

    def purge(self) -> int:
        """Drop pending entries whose copy has completed but whose wait never came (an exception
        between them); returns how many. Waits that do come find nothing left to wait for."""
        with self._lock:
            done = [k for k, p in self._pending.items() if p.event.query()]
            for k in done:
                del self._pending[k]
            if self.faults is not None:
                gone = [k for k, d in self._deferred.items() if d.orphaned(self.pool)]
                for k in gone:
                    self._deferred.pop(k).done = True
                done += gone
        return len(done)

    def synchronize(self) -> None:
        """Block until every copy in flight is done, then drop what is pending."""
        self.streams.synchronize()
        self.purge()

    # ------------------------------------------------------------------ parameter copies
    @property
    def async_copies(self) -> bool:
        """Whether :meth:`copy_async` really defers copies (CUDA copy streams, or fault
        injection); otherwise it copies synchronously and returns ``None``."""
        return self.streams.enabled or self.faults is not None

    def copy_async(self, key: tuple, src: torch.Tensor, dst: torch.Tensor, direction: str, host_block=None):
        """Issue the copy of ``src``'s bytes into ``dst`` (uint8 tensors of the same length, as
        :func:`flat_bytes` gives) for parameter offloading, registered under ``key`` (a
        ``(kind, slot id)`` tuple: never equal to an activation copy's integer key) until
        :meth:`wait_key`.

        On CUDA the copy runs on the ``direction`` (``"h2d"`` or ``"d2h"``) copy stream after all
        work queued so far on the compute stream (``start_on``, as :meth:`prefetch`), and the
        returned handle is its CUDA event (``synchronize()`` is the host-side wait). Under fault
        injection ``dst`` is poisoned and the copy deferred to its wait (or a random earlier
        trinity op); the handle is the deferred copy (``synchronize()`` runs it). Otherwise the
        copy is synchronous and the handle ``None``.

        ``host_block``: a block of this runtime's pool the copy reads or writes (a gradient's
        staging block), kept from reuse until the copy is done.

        Raises:
            ValueError: for another ``direction`` or ``src``/``dst`` of different lengths.
        """
        if direction not in ("h2d", "d2h"):
            raise ValueError(f"copy_async: direction must be 'h2d' or 'd2h', got {direction!r}")
        if src.numel() != dst.numel():
            raise ValueError(f"copy_async: source has {src.numel()} bytes, destination {dst.numel()}")
        self.purge()
        nbytes = src.numel()
        handle = None
        if self.faults is not None:
            dst.fill_(0xFF)
            if nbytes:
                handle = self._defer_keyed(key, src, dst, nbytes, host_block)
        elif self.streams.enabled:
            stream = self.streams.h2d if direction == "h2d" else self.streams.d2h
            with self.streams.start_on(stream):
                dst.copy_(src, non_blocking=True)
            handle = self.streams.record(stream)
            if host_block is not None:
                self.pool.mark_busy(host_block, handle)
            with self._lock:
                self._pending[key] = _Pending(handle, (src.untyped_storage(), dst.untyped_storage()))
        else:
            dst.copy_(src)
        with self._lock:
            if direction == "h2d":
                self._bytes_h2d += nbytes
            else:
                self._bytes_d2h += nbytes
        return handle

    def adopt(self, key: tuple, handle, keepalive: tuple = ()) -> None:
        """Register a copy issued through another runtime (``handle`` from its
        :meth:`copy_async`) under ``key`` here, so that this runtime's :meth:`wait_key` waits
        for it. For a parameter fetched by one compiled graph whose wait never ran (an exception
        between them) and then fetched, already resident, by another."""
        if handle is None:
            return
        with self._lock:
            if isinstance(handle, _Deferred):
                self._deferred[key] = handle
            else:
                self._pending[key] = _Pending(handle, keepalive)

    def staging(self, like: torch.Tensor) -> torch.Tensor:
        """A host tensor from this runtime's pool with ``like``'s size, stride and dtype (the
        staging block of a gradient copied to host to be added there).

        Raises:
            offload_compiler.runtime.pool.HostPoolExhausted: as :meth:`HostPool.empty_strided`.
        """
        return self.pool.empty_strided(tuple(like.shape), tuple(like.stride()), like.dtype)

    def note_staged(self, slot) -> None:
        """Remember a parameter slot whose gradient copy went to a staging block, so that
        :meth:`reap_staged` adds it into the host gradient once the copy is done."""
        with self._lock:
            self._staged.append(slot)

    def reap_staged(self) -> None:
        """Add the staged gradients whose copies have completed into their host gradients
        (``slot.finish_grad(block=False)``; never blocks the host), so that their staging blocks
        go back to the pool: staging holds only copies in flight, not a second set of gradients."""
        with self._lock:
            staged, self._staged = self._staged, []
        keep = [s for s in staged if not s.finish_grad(block=False)]
        if keep:
            with self._lock:
                self._staged = keep + self._staged

    # ------------------------------------------------------------------ fault injection
    def _defer(
        self, key_tensor: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, nbytes: int, elementwise: bool = False
    ) -> None:
        # A host block a deferred copy reads or writes is not handed out again before it runs.
        host = dst if self.pool.owns(dst) else src
        self._defer_keyed(key_tensor.untyped_storage().data_ptr(), src, dst, nbytes, host, elementwise)

    def _defer_keyed(
        self, key, src: torch.Tensor, dst: torch.Tensor, nbytes: int, host_block, elementwise: bool = False
    ) -> _Deferred:
        deferred = _Deferred(src, dst, nbytes, elementwise)
        if host_block is not None:
            self.pool.mark_busy(host_block, deferred)
        with self._lock:
            self._deferred[key] = deferred
        self._fault_tick()
        return deferred

    def _complete(self, key: int) -> None:
        with self._lock:
            deferred = self._deferred.pop(key, None)
        if deferred is not None:
            deferred.run()

    def _fault_tick(self) -> None:
        """At a trinity op: let some other deferred copies complete now (random timing)."""
        with self._lock:
            keys = [k for k in self._deferred if self._rng.random() < self.faults.early_probability]
        for k in keys:
            self._complete(k)

    # ------------------------------------------------------------------ introspection
    def stats(self) -> TransferStats:
        with self._lock:
            return TransferStats(
                num_evicts=self._evicts,
                num_prefetches=self._prefetches,
                bytes_d2h=self._bytes_d2h,
                bytes_h2d=self._bytes_h2d,
                pending_copies=len(self._pending) + len(self._deferred),
                host_pool=self.pool.stats(),
            )


def get_runtime(runtime_id: int) -> TransferRuntime:
    """The live runtime with this id.

    Raises:
        RuntimeError: when the compiled code that owned it has been freed.
    """
    runtime = _registry.get(runtime_id)
    if runtime is None:
        raise RuntimeError(
            f"trinity transfer runtime {runtime_id} no longer exists: the compiled graph that owned "
            "it was freed while code using it still ran"
        )
    return runtime
