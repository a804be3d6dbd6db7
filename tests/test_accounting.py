"""measure_peak_device_bytes on the CPU: the peak is exactly the largest sum of storages alive at
once (plus the declared resident bytes), views add nothing, and host-pool blocks are not device
memory."""

import pytest
import torch

from offload_compiler import measure_peak_device_bytes
from offload_compiler.runtime.accounting import resident_bytes
from offload_compiler.runtime.pool import HostPool

MB = 10**6


def measure(fn, **kwargs):
    return measure_peak_device_bytes(fn, device="cpu", **kwargs)


def test_peak_is_the_largest_sum_alive_at_once():
    def step():
        a = torch.empty(1 * MB, dtype=torch.uint8)
        b = torch.empty(2 * MB, dtype=torch.uint8)  # a + b = 3 MB
        del a
        c = torch.empty(3 * MB, dtype=torch.uint8)  # b + c = 5 MB: the peak
        del b, c
        d = torch.empty(4 * MB, dtype=torch.uint8)  # alone: 4 MB
        return d.numel()

    m = measure(step)
    assert m.peak_bytes == 5 * MB
    assert m.resident_bytes == 0
    assert m.allocated_delta_bytes == 0
    assert m.host_pool_bytes == 0
    assert m.method == "cpu-allocator-trace"
    assert m.result == 4 * MB


def test_resident_bytes_are_added_once_per_storage():
    w = torch.empty(250_000, dtype=torch.float32)  # 1 MB
    g = torch.empty(1000, 500, dtype=torch.float32)  # 2 MB
    resident = [w, w.view(500, 500), w[10:], g, g.t(), None]

    def step():
        x = torch.empty(3 * MB, dtype=torch.uint8)
        return x.numel()

    assert resident_bytes(resident) == 3 * MB
    m = measure(step, resident=resident)
    assert m.resident_bytes == 3 * MB
    assert m.peak_bytes == 3 * MB + 3 * MB


def test_views_count_once():
    def step():
        x = torch.empty(1000, 1000, dtype=torch.float32)  # 4 MB
        views = [x.t(), x[1:], x.view(-1), x.as_strided((10, 10), (1, 1000)), x.unsqueeze(0), x.detach()]
        y = torch.empty(MB, dtype=torch.uint8)
        return len(views) + y.numel()

    m = measure(step)
    assert m.peak_bytes == 5 * MB


def test_bytes_still_alive_after_the_call():
    def step():
        keep = torch.empty(2 * MB, dtype=torch.uint8)
        tmp = torch.empty(3 * MB, dtype=torch.uint8)
        del tmp
        return keep

    m = measure(step)
    assert m.peak_bytes == 5 * MB
    assert m.allocated_delta_bytes == 2 * MB
    assert isinstance(m.result, torch.Tensor) and m.result.numel() == 2 * MB


def test_in_place_ops_and_outputs_of_ops_are_counted():
    def step():
        a = torch.ones(250_000)  # 1 MB
        a.mul_(3)  # in place: no new storage
        b = a + 1  # 1 MB
        c = torch.cat([a, b])  # 2 MB: 4 MB alive
        del a, b
        return c.sum().item()

    m = measure(step)
    assert m.peak_bytes == 4 * MB
    assert m.result == 250_000 * 7


def test_host_pool_blocks_are_not_device_memory():
    pool = HostPool(64 * 2**20)

    def step():
        host = pool.empty_strided((2**20,), (1,), torch.float32)  # a 4 MiB pool block
        host.fill_(1.0)
        a = torch.empty(MB, dtype=torch.uint8)
        b = torch.empty(MB, dtype=torch.uint8)
        return host, a.numel() + b.numel()

    m = measure(step)
    assert m.peak_bytes == 2 * MB
    assert m.host_pool_bytes == 4 * 2**20
    assert m.allocated_delta_bytes == 0
    assert pool.owns(m.result[0])


def test_a_reused_pool_block_is_not_counted_either():
    pool = HostPool(64 * 2**20)
    warm = pool.empty_strided((2**20,), (1,), torch.float32)
    del warm  # the block is free and will be reused inside the call

    def step():
        host = pool.empty_strided((2**20,), (1,), torch.float32)
        x = torch.empty(3 * MB, dtype=torch.uint8)
        return host.numel() + x.numel()

    m = measure(step)
    assert m.peak_bytes == 3 * MB
    assert m.host_pool_bytes == 0  # nothing new was allocated by the pool
    assert pool.stats().num_reuses == 1


def test_result_is_returned():
    m = measure(lambda: "done")
    assert m.result == "done"
    assert m.peak_bytes == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU measurement only")
def test_default_device_without_cuda_is_the_cpu():
    m = measure_peak_device_bytes(lambda: torch.empty(MB, dtype=torch.uint8).numel())
    assert m.method == "cpu-allocator-trace"
    assert m.peak_bytes == MB


def test_warmup_allocations_count_until_the_measured_call_frees_them():
    from offload_compiler import measure_peak_device_bytes

    mib = 1 << 20
    holder = {}

    def warm():
        holder["x"] = torch.empty(mib, dtype=torch.uint8)
        # A transient warmup peak is not part of the measurement.
        torch.empty(8 * mib, dtype=torch.uint8).fill_(1)

    def fn():
        del holder["x"]  # freed by the measured call: counted until here, then not
        y = torch.empty(mib // 2, dtype=torch.uint8)
        return int(y.fill_(1)[0])

    m = measure_peak_device_bytes(fn, device="cpu", warmup=warm)
    assert mib <= m.peak_bytes < mib + mib // 2, m
    # Without the warmup, the CPU allocator cannot report the free of a block it did not see.
    holder["x"] = torch.empty(mib, dtype=torch.uint8)
    m = measure_peak_device_bytes(fn, device="cpu")
    assert mib // 2 <= m.peak_bytes < mib, m


@pytest.mark.parametrize(
    "events, resident, start, measured, end",
    [
        # 10, then +20 alive (30), free 10, +5 -> 25: the peak is 30, 25 left.
        ([(1, 0xA, 10), (2, 0xB, 20), (3, 0xA, -10), (4, 0xC, 5)], {}, None, 30, 25),
        # An address handed out again without its free seen: the first block is gone (not 10 + 10).
        ([(1, 0xA, 10), (2, 0xA, 10)], {}, None, 10, 10),
        # A resident storage (100 bytes) released by trinity::param_release (None) at the time of an
        # allocation of 40: the release sorts first, so the step peaks at its start (100), not 140.
        ([(1, 0xF, 40), (1, 0xD, None)], {0xD: 100}, None, 100, 40),
        # The allocator's free of that storage after its release call stops counting it once; the
        # 30 allocated afterwards stay below the 100 of the start.
        ([(1, 0xD, None), (2, 0xD, -100), (3, 0xE, 30), (4, 0xF, 60)], {0xD: 100}, None, 100, 90),
        # A warmup before start_ns is replayed, not measured: what it leaves alive (50) counts.
        ([(1, 0xA, 50), (2, 0xB, 70), (3, 0xB, -70), (10, 0xC, 20)], {}, 5, 70, 70),
    ],
)
def test_replay_allocations_hand_computed(events, resident, start, measured, end):
    """The one replay behind every CPU measurement (measure_peak_device_bytes, the first steps'
    check and bench/memory.py), on hand-computed event lists."""
    from offload_compiler.runtime.accounting import ResidentStorages, replay_allocations

    r = replay_allocations(events, ResidentStorages(dict(resident)), start)
    assert sum(resident.values()) + r.peak_bytes == measured
    assert r.end_bytes == end
