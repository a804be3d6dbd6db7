"""HostPool: bucket sizes, reuse, exclusivity of live blocks, the limit, trimming, stats, threads."""

import gc
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from offload_compiler.runtime.pool import HostPool, HostPoolExhausted, bucket_size, live_pool_blocks

KiB = 1024
MiB = 2**20

# ---------------------------------------------------------------------------------- buckets


@pytest.mark.parametrize(
    "nbytes,expected",
    [
        (0, 4096),
        (1, 4096),
        (4095, 4096),
        (4096, 4096),
        (4097, 5120),
        (5120, 5120),
        (5121, 6144),
        (6144, 6144),
        (6145, 7168),
        (7168, 7168),
        (7169, 8192),
        (8192, 8192),
        (8193, 10240),
        (100_000, 114_688),  # 2**16 * 1.75
        (131_072, 131_072),
        (131_073, 163_840),  # 2**17 * 1.25
        (1_000_000, 1_048_576),  # 2**19 * 1.75 = 917_504 is too small
        (MiB, MiB),
        (MiB + 1, 1_310_720),
        (3 * MiB, 3 * MiB),  # 2**21 * 1.5
        (3 * MiB + 1, 3_670_016),  # 2**21 * 1.75
        (2**40 + 1, 5 * 2**38),
    ],
)
def test_bucket_size_table(nbytes, expected):
    assert bucket_size(nbytes) == expected


@given(st.integers(min_value=4097, max_value=2**50))
def test_bucket_size_is_the_smallest_quarter_step_that_fits(n):
    b = bucket_size(n)
    assert b >= n
    assert b * 4 <= 5 * n + 4 * 4  # at most 25% waste (rounding slack of a few bytes)
    candidates = sorted({q * 2**k // 4 for k in range(12, 52) for q in (4, 5, 6, 7)})
    assert b in candidates
    assert max(c for c in candidates if c < b) < n


# ---------------------------------------------------------------------------------- reuse


def ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_empty_strided_layout_and_bucket():
    pool = HostPool(64 * MiB)
    t = pool.empty_strided((3, 5), (1, 3), torch.float32)
    assert t.shape == (3, 5) and t.stride() == (1, 3) and t.dtype == torch.float32
    assert t.device.type == "cpu" and t.storage_offset() == 0
    assert t.untyped_storage().nbytes() == 4096
    t.copy_(torch.arange(15.0).reshape(5, 3).t())
    assert torch.equal(t, torch.arange(15.0).reshape(5, 3).t())
    assert pool.owns(t)
    assert not pool.owns(torch.empty(15))
    s = pool.stats()
    assert (s.held_bytes, s.in_use_bytes, s.num_blocks, s.num_allocations) == (4096, 4096, 1, 1)


def test_freed_block_is_reused():
    pool = HostPool(64 * MiB)
    a = pool.empty_strided((1000,), (1,), torch.float32)  # 4000 bytes -> 4096 block
    first = ptr(a)
    del a
    b = pool.empty_strided((10, 100), (100, 1), torch.int32)  # same bucket, other dtype and shape
    assert ptr(b) == first
    s = pool.stats()
    assert (s.num_allocations, s.num_reuses, s.num_blocks, s.held_bytes) == (1, 1, 1, 4096)
    del b
    c = pool.empty_strided((4096,), (1,), torch.uint8)
    assert ptr(c) == first
    assert pool.stats().num_reuses == 2


def test_a_block_in_use_is_not_handed_out_twice():
    pool = HostPool(64 * MiB)
    a = pool.empty_strided((1000,), (1,), torch.float32)
    b = pool.empty_strided((1000,), (1,), torch.float32)
    assert ptr(a) != ptr(b)
    a.fill_(1.0)
    b.fill_(2.0)
    assert torch.all(a == 1.0)
    s = pool.stats()
    assert (s.num_allocations, s.num_reuses, s.in_use_bytes) == (2, 0, 8192)


def test_a_view_keeps_its_block_in_use():
    pool = HostPool(64 * MiB)
    a = pool.empty_strided((1000,), (1,), torch.float32)
    view = a[10:20]
    first = ptr(a)
    del a
    gc.collect()
    b = pool.empty_strided((1000,), (1,), torch.float32)
    assert ptr(b) != first
    assert pool.stats().in_use_bytes == 8192
    del view, b
    assert pool.stats().in_use_bytes == 0
    c = pool.empty_strided((1000,), (1,), torch.float32)
    assert pool.owns(c)
    assert pool.stats().num_reuses == 1 and pool.stats().num_allocations == 2


def test_zero_size_tensor():
    pool = HostPool(64 * MiB)
    t = pool.empty_strided((0, 7), (7, 1), torch.float32)
    assert t.shape == (0, 7) and t.stride() == (7, 1) and t.numel() == 0
    assert pool.owns(t)


def test_blocks_of_other_buckets_are_not_used():
    pool = HostPool(64 * MiB)
    a = pool.empty_strided((4096,), (1,), torch.uint8)
    first = ptr(a)
    del a
    b = pool.empty_strided((5000,), (1,), torch.uint8)  # bucket 5120, not the free 4096 block
    assert ptr(b) != first
    s = pool.stats()
    assert (s.num_allocations, s.num_reuses, s.held_bytes) == (2, 0, 4096 + 5120)


# ---------------------------------------------------------------------------------- the limit


def test_limit_raises_with_asked_and_held_bytes():
    pool = HostPool(8192)
    a = pool.empty_strided((5000,), (1,), torch.uint8)  # one 5120-byte block
    with pytest.raises(HostPoolExhausted) as info:
        pool.empty_strided((5000,), (1,), torch.uint8)
    err = info.value
    assert isinstance(err, MemoryError)
    msg = str(err)
    assert "5000 bytes" in msg  # what was asked
    assert "5.00 KiB" in msg  # what the pool holds (5120 bytes)
    assert "5120 bytes in use" in msg
    assert "8.00 KiB" in msg  # the limit
    assert "host_pool_limit_bytes" in msg
    assert (err.requested_bytes, err.held_bytes, err.in_use_bytes, err.limit_bytes) == (5000, 5120, 5120, 8192)
    # The failed request left nothing behind.
    s = pool.stats()
    assert (s.held_bytes, s.num_blocks, s.num_allocations, s.in_use_bytes) == (5120, 1, 1, 5120)
    del a
    b = pool.empty_strided((5000,), (1,), torch.uint8)  # now the free block serves it
    assert pool.stats().num_reuses == 1
    del b


def test_a_request_larger_than_the_limit():
    pool = HostPool(MiB)
    with pytest.raises(HostPoolExhausted, match=r"\(2097152 bytes\)"):
        pool.empty_strided((2 * MiB,), (1,), torch.uint8)
    s = pool.stats()
    assert (s.held_bytes, s.num_blocks, s.num_allocations, s.peak_held_bytes) == (0, 0, 0, 0)


def test_failed_allocation_keeps_nothing():
    # Pinned memory cannot be had on a CPU-only build: the allocation itself fails.
    if torch.cuda.is_available():
        pytest.skip("pinned allocation succeeds with CUDA")
    pool = HostPool(64 * MiB, pin_memory=True)
    with pytest.raises(HostPoolExhausted) as info:
        pool.empty_strided((100,), (1,), torch.float32)
    assert "400 bytes" in str(info.value)
    assert "the allocation failed" in str(info.value)
    s = pool.stats()
    assert (s.held_bytes, s.num_blocks, s.num_allocations, s.in_use_bytes) == (0, 0, 0, 0)
    assert s.pinned


def test_free_blocks_of_other_sizes_are_trimmed_to_make_room():
    pool = HostPool(12 * KiB)
    a = pool.empty_strided((5000,), (1,), torch.uint8)  # 5120
    b = pool.empty_strided((4000,), (1,), torch.uint8)  # 4096 -> 9216 held
    del a, b
    assert pool.stats().held_bytes == 9216
    c = pool.empty_strided((8000,), (1,), torch.uint8)  # 8192: 9216 + 8192 > 12288
    s = pool.stats()
    # Freeing the 5120 block (largest first) is enough: 4096 + 8192 = 12288.
    assert s.held_bytes == 4096 + 8192
    assert (s.num_releases, s.num_blocks, s.num_allocations) == (1, 2, 3)
    assert s.peak_held_bytes == 12288
    assert pool.owns(c)
    del c


def test_blocks_in_use_are_never_trimmed():
    pool = HostPool(12 * KiB)
    a = pool.empty_strided((5000,), (1,), torch.uint8)
    b = pool.empty_strided((4000,), (1,), torch.uint8)
    a.fill_(7)
    with pytest.raises(HostPoolExhausted):
        pool.empty_strided((8000,), (1,), torch.uint8)
    assert torch.all(a == 7)
    s = pool.stats()
    assert (s.held_bytes, s.num_releases, s.num_blocks) == (9216, 0, 2)
    del b


def test_release_free():
    pool = HostPool(64 * MiB)
    keep = pool.empty_strided((5000,), (1,), torch.uint8)
    free1 = pool.empty_strided((4000,), (1,), torch.uint8)
    free2 = pool.empty_strided((MiB,), (1,), torch.uint8)
    del free1, free2
    assert pool.release_free() == 4096 + MiB
    s = pool.stats()
    assert (s.held_bytes, s.num_blocks, s.num_releases, s.in_use_bytes) == (5120, 1, 2, 5120)
    assert s.peak_held_bytes == 5120 + 4096 + MiB
    assert pool.block_ranges() == [(ptr(keep), 5120)]


def test_stats_snapshot():
    pool = HostPool(10 * MiB)
    ts = [pool.empty_strided((n,), (1,), torch.uint8) for n in (10, 5000, 5000, 100_000)]
    s = pool.stats()
    assert s.held_bytes == 4096 + 5120 + 5120 + 114_688
    assert s.in_use_bytes == s.held_bytes
    assert s.num_blocks == 4 and s.num_allocations == 4 and s.num_reuses == 0 and s.num_releases == 0
    assert s.limit_bytes == 10 * MiB and s.pinned is False
    del ts[1]
    s2 = pool.stats()
    assert s2.in_use_bytes == s.held_bytes - 5120
    assert s2.held_bytes == s.held_bytes and s2.peak_held_bytes == s.held_bytes
    assert sorted(size for _, size in pool.block_ranges()) == [4096, 5120, 5120, 114_688]


def test_live_pool_blocks_lists_every_live_pool():
    p1, p2 = HostPool(MiB), HostPool(MiB)
    a = p1.empty_strided((10,), (1,), torch.uint8)
    b = p2.empty_strided((5000,), (1,), torch.uint8)
    blocks = live_pool_blocks()
    assert (ptr(a), 4096) in blocks and (ptr(b), 5120) in blocks
    gone = ptr(b)
    del b, p2
    gc.collect()
    assert (gone, 5120) not in live_pool_blocks()
    del a


def test_limit_must_be_positive():
    with pytest.raises(ValueError):
        HostPool(0)


# ---------------------------------------------------------------------------------- threads


def test_concurrent_threads_never_share_a_live_block():
    pool = HostPool(256 * MiB)
    live: dict[int, int] = {}
    lock = threading.Lock()
    errors: list[str] = []
    barrier = threading.Barrier(8)

    def worker(tid: int) -> None:
        barrier.wait()
        for i in range(200):
            n = (1000, 1200, 1400)[(tid + i) % 3]  # three buckets, many reuses
            t = pool.empty_strided((n,), (1,), torch.int32)
            p = ptr(t)
            with lock:
                if p in live:
                    errors.append(f"thread {tid} got block {p:#x} held by thread {live[p]}")
                live[p] = tid
            t.fill_(tid)
            torch.cos(torch.ones(64))  # give other threads a chance to run
            if not bool(torch.all(t == tid)):
                errors.append(f"thread {tid}'s block was written by someone else")
            with lock:
                del live[p]
            del t

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:5]
    s = pool.stats()
    assert s.in_use_bytes == 0
    assert s.num_allocations + s.num_reuses == 8 * 200
    assert s.num_reuses > 0
    # At most 8 blocks can be live at once per bucket size.
    assert s.num_blocks <= 8 * 3


class _StubEvent:
    """Stands in for a CUDA event of an in-flight copy: done once ``done`` is set."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_block_read_by_an_in_flight_copy_is_not_reused_until_the_copy_completes():
    pool = HostPool(64 * MiB)
    a = pool.empty_strided((1000,), (1,), torch.float32)
    first = ptr(a)
    event = _StubEvent()
    pool.mark_read_by(a, event)
    del a  # dropped right after the prefetch was issued, while its copy still reads the block
    b = pool.empty_strided((1000,), (1,), torch.float32)
    assert ptr(b) != first
    assert pool.stats().num_reuses == 0
    # Not trimmed either while the copy reads it.
    assert pool.release_free() == 0
    event.done = True
    c = pool.empty_strided((1000,), (1,), torch.float32)
    assert ptr(c) == first
    assert pool.stats().num_reuses == 1
    del b, c
