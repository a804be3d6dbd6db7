"""Cost model: per-node roofline times and transfer times on a device with round numbers.

``tanh_mm`` (w: 3x5, x: 2x3, fp32; schedule in test_liveness.py) costs, by hand, with 1 GFLOP/s,
1 GB/s and 1 us launch overhead:

* mm (x @ w): 2*2*3*5 = 60 FLOPs; reads 24 + 60 B, writes 40 B = 124 B -> 124 ns + 1 us.
* tanh: no FLOP formula; 40 B in + 40 B out -> 80 ns + 1 us.
* sum: 40 B in + 4 B out -> 44 ns + 1 us.
* tanh_backward(expand, detach_1): the expanded scalar spans one element (4 B) + 40 + 40 B out.
* mm_1 (x.t() @ g): 60 FLOPs; x.t() spans 24 B, g 40 B, the 3x5 gradient 60 B -> 124 B.
* views (detach, t, expand), placeholders and outputs: nothing.
"""

import pytest
import torch

from offload_compiler.ir.ops import TRANSFER_OPS
from offload_compiler.options import TrinityOptions
from offload_compiler.passes import cost_model, insert_transfers, liveness, plan_window

from ._pass_helpers import ROUND, mlp4_pair, spec, tanh_mm, tanh_mm_pair
from .graphs import capture_pair

US = 1e-6


def by_node(pair, live, costs):
    return {
        (s.graph, s.node): (costs.step_flops[s.index], costs.step_bytes[s.index], costs.step_seconds[s.index])
        for s in live.steps
    }


def test_roofline_by_hand_bandwidth_bound():
    pair = tanh_mm_pair()
    live = liveness.analyze(pair)
    costs = cost_model.estimate(pair, live, ROUND)
    got = by_node(pair, live, costs)
    expected = {
        ("forward", "mm"): (60, 124, 124e-9 + US),
        ("forward", "tanh"): (0, 80, 80e-9 + US),
        ("forward", "sum_1"): (0, 44, 44e-9 + US),
        ("backward", "tanh_backward"): (0, 84, 84e-9 + US),
        ("backward", "mm_1"): (60, 124, 124e-9 + US),
    }
    for key, (flops, nbytes, seconds) in expected.items():
        assert got[key][:2] == (flops, nbytes), key
        assert got[key][2] == pytest.approx(seconds, rel=1e-12), key
    for key, value in got.items():
        if key not in expected:
            assert value == (0, 0, 0.0), key
    assert len(costs.step_seconds) == live.num_steps
    assert costs.compute_seconds == pytest.approx((124 + 80 + 44 + 84 + 124) * 1e-9 + 5 * US, rel=1e-12)
    assert costs.device is ROUND


def test_roofline_by_hand_flop_bound():
    fast_memory = spec(hbm_bytes_per_s=1e15)
    pair = tanh_mm_pair()
    live = liveness.analyze(pair)
    got = by_node(pair, live, cost_model.estimate(pair, live, fast_memory))
    assert got[("forward", "mm")][2] == pytest.approx(60 / 1e9 + US, rel=1e-12)
    assert got[("backward", "mm_1")][2] == pytest.approx(60 / 1e9 + US, rel=1e-12)
    assert got[("forward", "tanh")][2] == pytest.approx(80 / 1e15 + US, rel=1e-12)


def test_launch_overhead_is_added_once_per_kernel():
    pair = tanh_mm_pair()
    live = liveness.analyze(pair)
    a = cost_model.estimate(pair, live, spec(launch_overhead_s=0.0))
    b = cost_model.estimate(pair, live, spec(launch_overhead_s=1.0))
    kernels = sum(1 for s in a.step_bytes if s)
    assert kernels == 5
    assert b.compute_seconds - a.compute_seconds == pytest.approx(5.0, rel=1e-12)


def _scale_shift_sum(w, x):
    return ((x @ w) * 2 + 1).sum()


def test_fused_pointwise_chain_costs_one_kernel():
    """With fusion assumed (Inductor), ``mul`` and ``add`` are computed inside ``sum``'s kernel:
    that kernel reads ``mm``'s 40 bytes once and writes the 4-byte sum, with one launch, as
    Inductor's generated code does; unfused, each node reads and writes memory (80 + 80 + 44 bytes,
    three launches)."""
    torch.manual_seed(0)
    pair = capture_pair(_scale_shift_sum, torch.randn(3, 5, requires_grad=True), torch.randn(2, 3), static=(0,))
    unfused = liveness.analyze(pair)
    fused = liveness.analyze(pair, assume_fusion=True)
    assert {n for b in fused.buffers if b.fused for n in b.nodes} == {"forward:mul", "forward:add"}
    a = by_node(pair, unfused, cost_model.estimate(pair, unfused, ROUND))
    b = by_node(pair, fused, cost_model.estimate(pair, fused, ROUND))
    for name, nbytes in (("mul", 80), ("add", 80), ("sum_1", 44)):
        assert a[("forward", name)][1:] == (nbytes, pytest.approx(nbytes * 1e-9 + US, rel=1e-12)), name
    # mul: reads mm (40 B), writes nothing, no launch; add: nothing; sum: writes 4 B, one launch.
    assert b[("forward", "mul")][1:] == (40, pytest.approx(40e-9, rel=1e-12))
    assert b[("forward", "add")] == (0, 0, 0.0)
    assert b[("forward", "sum_1")][1:] == (4, pytest.approx(4e-9 + US, rel=1e-12))
    for key in (("forward", "mm"), ("backward", "mm_1"), ("backward", "mul_1")):
        assert a[key] == b[key], key


def test_tf32_precision_uses_the_tf32_rate():
    fast_memory = spec(hbm_bytes_per_s=1e15)
    pair = tanh_mm_pair()
    live = liveness.analyze(pair)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        got = by_node(pair, live, cost_model.estimate(pair, live, fast_memory))
    finally:
        torch.set_float32_matmul_precision(before)
    assert got[("forward", "mm")][2] == pytest.approx(60 / 4e9 + US, rel=1e-12)


def test_bf16_uses_the_bf16_rate_and_half_the_bytes():
    torch.manual_seed(0)
    w = torch.randn(3, 5, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(2, 3, dtype=torch.bfloat16)
    pair = capture_pair(tanh_mm, w, x, static=(0,))
    live = liveness.analyze(pair)
    got = by_node(pair, live, cost_model.estimate(pair, live, spec(hbm_bytes_per_s=1e15)))
    flops, nbytes, seconds = got[("forward", "mm")]
    assert (flops, nbytes) == (60, 62)
    assert seconds == pytest.approx(60 / 8e9 + US, rel=1e-12)


def test_transfer_seconds_per_direction():
    costs = cost_model.Costs(
        device=spec(h2d_bytes_per_s=1e8, d2h_bytes_per_s=2e8), step_seconds=(), step_flops=(), step_bytes=()
    )
    assert costs.transfer_seconds(1000, "h2d") == pytest.approx(1e-5)
    assert costs.transfer_seconds(1000, "d2h") == pytest.approx(5e-6)
    assert costs.transfer_seconds(0, "d2h") == 0.0


def test_transfer_ops_cost_nothing_and_other_nodes_keep_their_cost():
    pair = mlp4_pair(device="meta")
    live = liveness.analyze(pair)
    before = cost_model.estimate(pair, live, ROUND)
    plan = plan_window.plan(live, before, 0)
    assert plan.evictions
    insert_transfers.apply(pair, live, plan, runtime_id=1)
    live2 = liveness.analyze(pair)
    after = cost_model.estimate(pair, live2, ROUND)
    old = {(s.graph, s.node): before.step_seconds[s.index] for s in live.steps}
    nodes = list(pair.forward.graph.nodes) + list(pair.backward.graph.nodes)
    seen_transfer = 0
    for s, n in zip(live2.steps, nodes):
        if n.op == "call_function" and n.target in TRANSFER_OPS:
            seen_transfer += 1
            assert (after.step_flops[s.index], after.step_bytes[s.index], after.step_seconds[s.index]) == (0, 0, 0.0)
        elif (s.graph, s.node) in old and n.op == "call_function":
            assert after.step_seconds[s.index] == pytest.approx(old[(s.graph, s.node)], rel=1e-12), n.name
    assert seen_transfer == 4 * len(plan.evictions)


def test_estimate_rejects_a_liveness_of_other_graphs():
    pair = tanh_mm_pair()
    other = liveness.analyze(mlp4_pair())
    with pytest.raises(ValueError, match="cost model"):
        cost_model.estimate(pair, other, ROUND)


def test_apply_overrides():
    opts = TrinityOptions(
        peak_flops=7e12, hbm_bytes_per_s=3e11, h2d_bytes_per_s=2e10, d2h_bytes_per_s=1e10, device_memory_bytes=12345
    )
    s = cost_model.apply_overrides(ROUND, opts)
    assert (s.flops_fp32, s.flops_tf32, s.flops_bf16) == (7e12, 7e12, 7e12)
    assert (s.hbm_bytes_per_s, s.h2d_bytes_per_s, s.d2h_bytes_per_s, s.memory_bytes) == (3e11, 2e10, 1e10, 12345)
    assert s.launch_overhead_s == ROUND.launch_overhead_s and s.name == ROUND.name
    assert "overridden by options" in s.source
    # Only what is given changes.
    s2 = cost_model.apply_overrides(ROUND, TrinityOptions(d2h_bytes_per_s=5e9))
    assert s2.d2h_bytes_per_s == 5e9
    assert (s2.h2d_bytes_per_s, s2.flops_fp32, s2.hbm_bytes_per_s) == (
        ROUND.h2d_bytes_per_s,
        ROUND.flops_fp32,
        ROUND.hbm_bytes_per_s,
    )
    # No overrides: the spec itself.
    assert cost_model.apply_overrides(ROUND, TrinityOptions()) is ROUND


def sdpa_cpu(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).sum()


def test_cpu_attention_kernel_counts_torchs_sdpa_flops():
    # torch's registry has the CUDA attention kernels only; on the CPU SDPA runs
    # _scaled_dot_product_flash_attention_for_cpu (and its backward): b=2, h=3, s=8, d=4 gives
    # 4*b*h*s*s*d = 6144 FLOPs forward (QK^T and PV, 2 FLOPs per multiply-add) and 2.5x that
    # (15360: the scores recomputed, then dV, dP, dQ, dK) backward
    # (torch.utils.flop_counter.sdpa_flop_count / sdpa_backward_flop_count).
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4, requires_grad=True) for _ in range(3))
    pair = capture_pair(sdpa_cpu, q, k, v)
    live = liveness.analyze(pair)
    costs = cost_model.estimate(pair, live, spec(hbm_bytes_per_s=1e15))
    nodes = list(pair.forward.graph.nodes) + list(pair.backward.graph.nodes)
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    got = {n.target: costs.step_flops[i] for i, n in enumerate(nodes) if n.target in (fwd, bwd)}
    assert got == {fwd: 6144, bwd: 15360}
    i = next(i for i, n in enumerate(nodes) if n.target == fwd)
    assert costs.step_seconds[i] == pytest.approx(6144 / 1e9 + US, rel=1e-9)


def test_views_cost_a_launch_overhead_only_where_the_host_is_the_device():
    # tanh_mm's views (detach, t, expand) launch no kernel; on the CPU as the device their
    # dispatcher calls run on the cores that compute: one launch overhead each. getitem and
    # placeholders stay free.
    pair = tanh_mm_pair()
    live = liveness.analyze(pair)
    gpu = cost_model.estimate(pair, live, ROUND)
    host = cost_model.estimate(pair, live, spec(host_is_device=True))
    nodes = list(pair.forward.graph.nodes) + list(pair.backward.graph.nodes)
    views = [
        i
        for i, n in enumerate(nodes)
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and not gpu.step_bytes[i]
    ]
    assert len(views) >= 3
    for i in views:
        assert gpu.step_seconds[i] == 0.0, nodes[i].name
        assert host.step_seconds[i] == pytest.approx(US, rel=1e-12), nodes[i].name
    assert host.compute_seconds - gpu.compute_seconds == pytest.approx(len(views) * US, rel=1e-9)


def test_synchronous_copies_add_the_calibrated_copy_overhead():
    fields = dict(h2d_bytes_per_s=1e8, d2h_bytes_per_s=2e8, h2d_overhead_s=3e-5, d2h_overhead_s=1e-5)
    device_copies = cost_model.Costs(device=spec(**fields), step_seconds=(), step_flops=(), step_bytes=())
    host_copies = cost_model.Costs(
        device=spec(host_is_device=True, **fields), step_seconds=(), step_flops=(), step_bytes=()
    )
    # Copy streams (a GPU): the bytes only; the runtime's calls are host time beside the copy.
    assert device_copies.transfer_seconds(1000, "h2d") == pytest.approx(1e-5)
    # The CPU as the device: the copy and its calls on the same cores, one after the other.
    assert host_copies.transfer_seconds(1000, "h2d") == pytest.approx(1e-5 + 3e-5)
    assert host_copies.transfer_seconds(1000, "d2h") == pytest.approx(5e-6 + 1e-5)
    task = host_copies.copy_task(0, "d2h", 1000, 1, 2)
    assert task.seconds == pytest.approx(1.5e-5) and task.on_compute


def test_host_update_seconds_counts_a_fixed_cost_per_tensor():
    s = spec(host_update_seconds_per_param=2e-9, host_update_seconds_per_tensor=1e-5)
    model = cost_model.host_update_model(s, "adamw", implementation="fused")
    assert model.host_seconds_per_tensor == 1e-5
    # 1000 fp32 parameters (4000 bytes) in 4 tensors: 1000 x 2 ns + 4 x 10 us.
    assert cost_model.host_update_seconds(4000, model, num_tensors=4) == pytest.approx(2e-6 + 4e-5)
    assert cost_model.host_update_seconds(4000, model) == pytest.approx(2e-6)
    # The loop's figure is its own (not calibrated here: 0).
    loop = cost_model.host_update_model(s, "adamw", implementation="loop")
    assert loop.host_seconds_per_tensor == 0.0
    # On the device: bytes only.
    assert cost_model.host_update_seconds(4000, model, on_device=True, num_tensors=4) == pytest.approx(
        4000 * model.device_seconds_per_byte
    )


# A host calibrated per thread count (hand-made figures): the update at 1, 2 and 4 threads, the
# all-threads figure (4 threads) and the bandwidth at 1 and 4 threads.
PER_THREAD = dict(
    host_update_seconds_per_param=1 / 3e8,
    host_update_loop_seconds_per_param=1 / 6e7,
    host_update_params_per_s_by_threads=(
        ("fused", 1, 1e8),
        ("fused", 2, 1.8e8),
        ("fused", 4, 3e8),
        ("loop", 1, 2e7),
        ("loop", 4, 6e7),
    ),
    host_bytes_per_s_by_threads=((1, 1e10), (4, 2.5e10)),
    host_bytes_per_s=2.5e10,
)


@pytest.mark.parametrize(
    "impl, threads, per_param, source",
    [
        ("fused", None, 1 / 3e8, "measured at all threads"),  # the optimizer's threads unknown
        ("fused", 1, 1 / 1e8, "measured at 1 thread"),
        ("fused", 2, 1 / 1.8e8, "measured at 2 threads"),
        ("fused", 3, 1 / 1.8e8, "measured at 2 threads"),  # the largest measured count not above 3
        ("fused", 16, 1 / 3e8, "measured at 4 threads"),
        ("loop", 2, 1 / 2e7, "measured at 1 thread"),
        ("loop", 4, 1 / 6e7, "measured at 4 threads"),
    ],
)
def test_host_update_uses_the_figure_at_the_optimizers_thread_count(impl, threads, per_param, source):
    """Before, the prediction took the all-threads figure whatever the optimizer's threads:
    CPUOptimizer(num_threads=1) was predicted 3x faster than this host measured it."""
    model = cost_model.host_update_model(spec(**PER_THREAD), "adamw", implementation=impl, threads=threads)
    assert model.host_seconds_per_byte == pytest.approx(per_param / 4, rel=1e-12)  # 4 bytes per fp32 parameter
    assert f"({source})" in model.description
    # 1M fp32 parameters (4 MB): 10 ms at 1 thread fused, 3.33 ms at 4.
    if (impl, threads) == ("fused", 1):
        assert cost_model.host_update_seconds(4_000_000, model) == pytest.approx(0.01, rel=1e-12)


def test_host_update_from_a_single_threaded_optimizer_uses_the_single_thread_figure():
    from offload_compiler import CPUOptimizer

    ps = [torch.nn.Parameter(torch.zeros(8))]
    s = spec(**PER_THREAD)
    one = cost_model.host_update_from_optimizer(s, CPUOptimizer(ps, implementation="fastest", num_threads=1))
    assert one.host_seconds_per_byte == pytest.approx(1 / 1e8 / 4, rel=1e-12)
    assert "1 threads" in one.description and "(measured at 1 thread)" in one.description
    four = cost_model.host_update_from_optimizer(s, CPUOptimizer(ps, implementation="fastest", num_threads=4))
    assert four.host_seconds_per_byte == pytest.approx(1 / 3e8 / 4, rel=1e-12)
    loop = cost_model.host_update_from_optimizer(s, CPUOptimizer(ps, num_threads=1))  # the default for-loop
    assert loop.host_seconds_per_byte == pytest.approx(1 / 2e7 / 4, rel=1e-12)


def test_host_update_thread_fallbacks():
    """No per-thread update rate: the all-threads measurement; none either: derived from the
    bandwidth at the optimizer's thread count (28 bytes / bandwidth / FUSED_FRACTION_OF_FLOOR);
    a count below every measured one falls through; a stated bandwidth drops every measurement."""
    from offload_compiler.devices import FUSED_FRACTION_OF_FLOOR, LOOP_SLOWDOWN

    measured = spec(**{**PER_THREAD, "host_update_params_per_s_by_threads": ()})
    assert measured.host_update_figure("fused", 1) == (1 / 3e8, "measured at all threads")
    bandwidth_only = spec(host_bytes_per_s=2.5e10, host_bytes_per_s_by_threads=((1, 1e10), (4, 2.5e10)))
    assert bandwidth_only.host_update_figure("fused", 2) == (
        pytest.approx(28 / 1e10 / FUSED_FRACTION_OF_FLOOR, rel=1e-12),
        "derived from the host bandwidth measured at 1 thread",
    )
    assert bandwidth_only.host_update_s_per_param("loop", 4) == pytest.approx(
        28 / 2.5e10 / FUSED_FRACTION_OF_FLOOR * LOOP_SLOWDOWN, rel=1e-12
    )
    above = spec(**{**PER_THREAD, "host_update_params_per_s_by_threads": (("fused", 2, 1.8e8),)})
    assert above.host_update_figure("fused", 1) == (1 / 3e8, "measured at all threads")
    stated = cost_model.apply_overrides(spec(**PER_THREAD), TrinityOptions.from_user({"host_bytes_per_s": 5e9}, env={}))
    assert stated.host_update_params_per_s_by_threads == () and stated.host_bytes_per_s_by_threads == ()
    assert stated.host_update_figure("fused", 1) == (
        pytest.approx(28 / 5e9 / FUSED_FRACTION_OF_FLOOR, rel=1e-12),
        "derived from the host bandwidth",
    )
    with pytest.raises(ValueError, match="threads must be None or an int >= 1, got 0"):
        spec(**PER_THREAD).host_update_s_per_param("fused", 0)
    with pytest.raises(ValueError, match="implementation must be 'fused' or 'loop', got 'foreach'"):
        spec(**PER_THREAD).host_update_s_per_param("foreach", 1)
