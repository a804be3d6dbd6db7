"""The transfer runtime through the ``torch.ops.trinity.*`` ops: round trips preserve values,
sizes, strides and dtypes; host copies live in the runtime's pool; counters count view bytes;
a dropped runtime is an error that names it; the fake implementations give the right metadata."""

import gc

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import offload_compiler  # noqa: F401  (registers the ops)
from offload_compiler.runtime.transfer import TransferRuntime, get_runtime, span_bytes

ops = torch.ops.trinity
CPU = torch.device("cpu")


def _int_view():
    return torch.arange(24, dtype=torch.int64).reshape(4, 6)[:, 1::2]


# (name, builder, expected span bytes: from the first element to the end of the last, by hand)
CASES = [
    ("contiguous", lambda: torch.randn(5, 7), 5 * 7 * 4),
    # (6, 4).t(): size (4, 6), stride (1, 4): 1 + 3*1 + 5*4 = 24 elements
    ("transpose", lambda: torch.randn(6, 4).t(), 24 * 4),
    # logits[:, :-1] of (2, 5, 7): size (2, 4, 7), stride (35, 7, 1): 1 + 35 + 21 + 6 = 63
    ("logits_shift", lambda: torch.randn(2, 5, 7)[:, :-1], 63 * 4),
    # (10, 8)[3:, 2:6]: offset 26, size (7, 4), stride (8, 1): 1 + 48 + 3 = 52
    ("offset_view", lambda: torch.randn(10, 8)[3:, 2:6], 52 * 4),
    # (1, 3).expand(4, 3): stride (0, 1): 3 elements
    ("expanded", lambda: torch.randn(1, 3).expand(4, 3), 3 * 4),
    ("empty", lambda: torch.empty(0, 5), 0),
    ("empty_offset_view", lambda: torch.randn(3, 4)[:, 4:], 0),
    ("scalar", lambda: torch.tensor(3.5), 4),
    # bf16 (8, 3).t(): size (3, 8), stride (1, 3): 1 + 2 + 21 = 24 elements of 2 bytes
    ("bf16_transpose", lambda: torch.randn(8, 3).to(torch.bfloat16).t(), 24 * 2),
    # int64 [:, 1::2] of (4, 6): offset 1, size (4, 3), stride (6, 2): 1 + 18 + 4 = 23 elements
    ("int64_strided", _int_view, 23 * 8),
    ("bool", lambda: torch.tensor([True, False, True, True, False]), 5),
    ("int8_3d", lambda: torch.randint(-100, 100, (3, 4, 5), dtype=torch.int8).permute(2, 0, 1), 60),
]


@pytest.fixture
def runtime():
    return TransferRuntime(CPU, 64 * 2**20)


def same_layout(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert a.stride() == b.stride()
    assert a.dtype == b.dtype


@pytest.mark.parametrize("name,make,nbytes", CASES, ids=[c[0] for c in CASES])
def test_round_trip(runtime, name, make, nbytes):
    src = make()
    expected = src.clone()
    storage_before = src.untyped_storage().tolist() if src.untyped_storage().nbytes() else []

    host = ops.evict(src, runtime.id)
    assert host.device == CPU
    same_layout(host, src)
    assert host.storage_offset() == 0
    assert runtime.pool.owns(host)
    assert host.untyped_storage().data_ptr() != src.untyped_storage().data_ptr() or src.numel() == 0
    assert torch.equal(host, expected)

    assert ops.evict_wait(host, src, runtime.id) is None
    dev = ops.prefetch(host, CPU, runtime.id)
    assert ops.prefetch_wait(dev, runtime.id) is None
    same_layout(dev, src)
    assert dev.device == src.device
    assert torch.equal(dev, expected)
    assert not runtime.pool.owns(dev)

    # The source (and the bytes of its storage outside the view) were not touched.
    assert src.untyped_storage().tolist() == storage_before
    # The device copy is independent of the source and of the host block.
    if src.numel():
        src.untyped_storage().fill_(0)
        host.untyped_storage().fill_(0)
        assert torch.equal(dev, expected)

    assert span_bytes(tuple(src.shape), tuple(src.stride()), src.element_size()) == nbytes
    s = runtime.stats()
    assert (s.num_evicts, s.num_prefetches) == (1, 1)
    assert s.bytes_d2h == nbytes and s.bytes_h2d == nbytes
    assert s.pending_copies == 0
    assert s.host_pool.num_blocks == 1 and s.host_pool.in_use_bytes == 4096


def test_source_storage_may_be_freed_after_evict_wait(runtime):
    base = torch.randn(16, 32)
    src = base[:, 3:20]
    expected = src.clone()
    host = ops.evict(src, runtime.id)
    ops.evict_wait(host, src, runtime.id)
    base.untyped_storage().resize_(0)  # what the plan does to the device storage
    del base, src
    dev = ops.prefetch(host, CPU, runtime.id)
    ops.prefetch_wait(dev, runtime.id)
    assert torch.equal(dev, expected)
    assert dev.stride() == (32, 1)


def test_stats_accumulate_and_the_host_block_returns_to_the_pool(runtime):
    a = torch.randn(100, 100)  # 40000 bytes -> 40960 block (2**15 * 1.25)
    b = torch.randn(50, 10)[:, :5]  # size (50, 5) stride (10, 1): 1 + 490 + 4 = 495 elements
    ha = ops.evict(a, runtime.id)
    hb = ops.evict(b, runtime.id)
    ops.evict_wait(ha, a, runtime.id)
    ops.evict_wait(hb, b, runtime.id)
    s = runtime.stats()
    assert s.num_evicts == 2 and s.bytes_d2h == 40000 + 495 * 4
    assert s.host_pool.held_bytes == 40960 + 4096 and s.host_pool.in_use_bytes == 40960 + 4096
    block = ha.untyped_storage().data_ptr()
    da = ops.prefetch(ha, CPU, runtime.id)
    ops.prefetch_wait(da, runtime.id)
    del ha  # the backward dropped its host copy
    assert runtime.stats().host_pool.in_use_bytes == 4096
    again = ops.evict(a, runtime.id)  # the next step reuses the block
    assert again.untyped_storage().data_ptr() == block
    s = runtime.stats()
    assert (s.num_evicts, s.num_prefetches) == (3, 1)
    assert s.bytes_h2d == 40000 and s.bytes_d2h == 2 * 40000 + 495 * 4
    assert s.host_pool.num_reuses == 1 and s.host_pool.num_allocations == 2
    del hb, again


def test_each_runtime_has_its_own_pool():
    r1 = TransferRuntime(CPU, 2**20)
    r2 = TransferRuntime(CPU, 2**20)
    assert r1.id != r2.id
    x = torch.randn(10)
    h1 = ops.evict(x, r1.id)
    assert r1.pool.owns(h1) and not r2.pool.owns(h1)
    assert r2.stats().num_evicts == 0


def test_pool_limit_reaches_the_caller():
    from offload_compiler.runtime.pool import HostPoolExhausted

    rt = TransferRuntime(CPU, 8192, on_pool_full="error")
    x = torch.randn(2000)  # 8000 bytes -> 8192 block
    keep = ops.evict(x, rt.id)
    with pytest.raises(HostPoolExhausted, match="8000 bytes"):
        ops.evict(x, rt.id)
    del keep


def test_pool_limit_falls_back_to_unpooled_memory_warning_once():
    rt = TransferRuntime(CPU, 8192)  # default: on_pool_full="fallback"
    x = torch.randn(2000)
    keep = ops.evict(x, rt.id)
    with pytest.warns(UserWarning, match="falling back to unpooled host memory"):
        extra = ops.evict(x * 2, rt.id)
    torch.testing.assert_close(extra, x * 2, rtol=0, atol=0)
    stats = rt.pool.stats()
    assert stats.num_overflow_allocations == 1 and stats.overflow_bytes == 8192
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second overflow does not warn again
        more = ops.evict(x * 3, rt.id)
    torch.testing.assert_close(more, x * 3, rtol=0, atol=0)
    assert rt.pool.stats().num_overflow_allocations == 2
    del extra, more
    ops.evict(x, rt.id)  # the next allocation gives the unused overflow memory back
    assert rt.pool.stats().overflow_bytes == 8192  # only the new overflow block is held
    del keep


# ---------------------------------------------------------------------------------- registry


def test_get_runtime_of_a_live_runtime(runtime):
    assert get_runtime(runtime.id) is runtime


def test_dropped_runtime_raises_naming_its_id():
    rt = TransferRuntime(CPU, 2**20)
    rid = rt.id
    del rt
    gc.collect()
    with pytest.raises(RuntimeError, match=rf"runtime {rid} no longer exists"):
        get_runtime(rid)
    with pytest.raises(RuntimeError, match=rf"runtime {rid} "):
        ops.evict(torch.randn(3), rid)
    with pytest.raises(RuntimeError, match=rf"runtime {rid} "):
        ops.prefetch(torch.randn(3), CPU, rid)


# ---------------------------------------------------------------------------------- fake impls


def test_fake_implementations_give_metadata_without_a_runtime():
    missing = 10**9  # no runtime has this id: fake kernels must not look it up
    with FakeTensorMode():
        src = torch.empty_strided((4, 6), (1, 4), dtype=torch.bfloat16, device="cuda")
        host = ops.evict(src, missing)
        assert isinstance(host, FakeTensor)
        assert host.device == CPU
        assert (host.shape, host.stride(), host.dtype) == ((4, 6), (1, 4), torch.bfloat16)
        assert ops.evict_wait(host, src, missing) is None
        dev = ops.prefetch(host, torch.device("cuda", 0), missing)
        assert dev.device == torch.device("cuda", 0)
        assert (dev.shape, dev.stride(), dev.dtype) == ((4, 6), (1, 4), torch.bfloat16)
        assert ops.prefetch_wait(dev, missing) is None
        assert ops.prefetch_wait(dev, missing, host) is None
        assert ops.fence([host], src) is None

        view = torch.empty(2, 5, 7)[:, :-1]
        h2 = ops.evict(view, missing)
        assert (h2.shape, h2.stride(), h2.device) == ((2, 4, 7), (35, 7, 1), CPU)
        d2 = ops.prefetch(h2, torch.device("meta"), missing, view)
        assert (d2.shape, d2.stride(), d2.device) == ((2, 4, 7), (35, 7, 1), torch.device("meta"))


@pytest.mark.parametrize("which", ["evict", "evict_wait", "prefetch", "prefetch_wait", "fence"])
def test_opcheck(runtime, which):
    src = torch.randn(6, 4).t()
    host = ops.evict(src, runtime.id)
    dev = ops.prefetch(host, CPU, runtime.id)
    args = {
        "evict": (src, runtime.id),
        "evict_wait": (host, src, runtime.id),
        "prefetch": (host, CPU, runtime.id),
        "prefetch_wait": (dev, runtime.id),
        "fence": ([host], src),
    }[which]
    result = torch.library.opcheck(getattr(ops, which).default, args, test_utils=("test_schema", "test_faketensor"))
    assert result == {"test_schema": "SUCCESS", "test_faketensor": "SUCCESS"}


def test_waits_and_fences_survive_dead_code_elimination():
    g = fx.Graph()
    x = g.placeholder("x")
    host = g.call_function(ops.evict.default, (x, 1))
    g.call_function(ops.evict_wait.default, (host, x, 1))
    dev = g.call_function(ops.prefetch.default, (host, CPU, 1))
    g.call_function(ops.prefetch_wait.default, (dev, 1))
    g.call_function(ops.fence.default, ([host], x))
    g.output(None)
    g.eliminate_dead_code()
    targets = [n.target for n in g.nodes if n.op == "call_function"]
    for op in (ops.evict_wait.default, ops.prefetch_wait.default, ops.fence.default):
        assert op in targets


@pytest.mark.parametrize("faults", [None, 7], ids=["plain", "fault_injection"])
def test_evict_into_declared_strides(faults):
    """``evict(src, rt, stride)`` makes the host tensor in ``stride`` whatever ``src``'s layout
    (the strides the graph declares, where Inductor laid ``src`` out otherwise): the values
    survive the round trip, the host block is the pool's, and under fault injection the copy
    still waits for ``evict_wait`` (the host block is poisoned until then)."""
    from offload_compiler.runtime.transfer import FaultInjection

    rt = TransferRuntime(CPU, 1 << 24, FaultInjection(seed=faults, early_probability=0.0) if faults else None)
    src = torch.randn(2, 5, 3, 4)  # contiguous; declared channels-last
    expected = src.clone()
    declared = torch.empty(2, 5, 3, 4).to(memory_format=torch.channels_last).stride()
    host = ops.evict(src, rt.id, list(declared))
    assert host.stride() == declared and host.shape == src.shape
    assert rt.pool.owns(host)
    if faults:
        assert torch.isnan(host).all()  # 0xFF bytes: the deferred copy has not run
    ops.evict_wait(host, src, rt.id)
    assert torch.equal(host, expected)
    dev = ops.prefetch(host, CPU, rt.id)
    ops.prefetch_wait(dev, rt.id)
    assert dev.stride() == declared and torch.equal(dev, expected)
    with FakeTensorMode():
        fake = ops.evict(torch.empty(2, 5, 3, 4), rt.id, list(declared))
    assert fake.stride() == declared
