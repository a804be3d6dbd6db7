"""DDP with ``offload="all"``: the gradients' all-reduce buckets and their place in the predicted
step (``passes/grad_sync.py``: :func:`bucket_layout`, :class:`GradSyncModel`; the planner's
buckets in ``passes/param_residency.py``; the ``"allreduce"`` channel of ``passes/simulate.py``;
``plan_pair``'s predictions). The runtime (one collective per bucket, exact averages) is checked
with real processes in ``tests/test_distributed.py``.
"""

import pytest
import torch

from offload_compiler.collectives import Link
from offload_compiler.devices import KNOWN_DEVICES
from offload_compiler.options import TrinityOptions
from offload_compiler.passes.cost_model import HostUpdate
from offload_compiler.passes.grad_sync import GradSyncModel, bucket_layout
from offload_compiler.passes.simulate import CopyTask, simulate
from offload_compiler.pipeline import ModelState, plan_pair, prepare

from .graphs import mlp_pair

MiB = 2**20
F32, BF16 = torch.float32, torch.bfloat16


# ------------------------------------------------------------------------------ bucket layout


def test_buckets_fill_in_order_up_to_the_cap_with_a_first_cap_of_their_own():
    grads = [(k, MiB, F32) for k in "abcdef"]
    # First bucket 1 MiB, then 2 MiB (DDP's [first_bucket_bytes, bucket_bytes_cap]; the last repeats).
    assert bucket_layout(grads, (MiB, 2 * MiB)) == (("a",), ("b", "c"), ("d", "e"), ("f",))
    assert bucket_layout(grads, (3 * MiB,)) == (("a", "b", "c"), ("d", "e", "f"))
    # Never over the cap: 1.5 MiB holds one; a gradient larger than the cap is a bucket of its own.
    assert bucket_layout(grads[:3], (int(1.5 * MiB),)) == (("a",), ("b",), ("c",))
    assert bucket_layout([("x", 5 * MiB, F32), ("y", 10, F32), ("z", 10, F32)], (MiB,)) == (("x",), ("y", "z"))
    assert bucket_layout([], (MiB,)) == ()


def test_a_bucket_holds_one_dtype():
    grads = [("a", 10, F32), ("b", 10, BF16), ("c", 10, BF16), ("d", 10, F32)]
    assert bucket_layout(grads, (MiB,)) == (("a",), ("b", "c"), ("d",))


@pytest.mark.parametrize("caps", [(), (0,), (MiB, -1)])
def test_bad_caps_are_refused(caps):
    with pytest.raises(ValueError, match="caps must be one or more sizes >= 1 byte"):
        bucket_layout([("a", 1, F32)], caps)


def test_a_bad_world_size_is_refused():
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        GradSyncModel(world_size=0, bucket_caps=(MiB,))


# ------------------------------------------------------------------------------ simulator


def test_an_averaged_gradient_copy_waits_for_its_all_reduce_and_the_stall_is_the_all_reduce():
    """Three 1 s steps; an all-reduce of 2.5 s issued after step 0, waited for at the end where
    the averaged gradient's 0.5 s copy is issued after it: the all-reduce ends at 3.5 s (0.5 s
    exposed), the copy at 4.0 s (0.5 s exposed)."""
    for on_compute in (False, True):
        ar = CopyTask(0, "allreduce", 2.5, 1, 3)
        d2h = CopyTask(1, "d2h", 0.5, 3, 3, on_compute=on_compute, after=(0,))
        t = simulate([1.0, 1.0, 1.0], [ar, d2h])
        assert t.step_seconds == pytest.approx(4.0)
        assert (t.copies[0].start, t.copies[0].end, t.copies[0].stall) == pytest.approx((1.0, 3.5, 0.5))
        assert (t.copies[1].start, t.copies[1].end, t.copies[1].stall) == pytest.approx((3.5, 4.0, 0.5))
        assert t.exposed_seconds == pytest.approx(1.0)


def test_a_copy_after_one_not_issued_is_refused():
    with pytest.raises(ValueError, match="issued before the copies"):
        simulate([1.0], [CopyTask(0, "d2h", 0.5, 0, 1, after=(1,)), CopyTask(1, "allreduce", 1.0, 1, 1)])


# ------------------------------------------------------------------------------ the plan


def plan_all(grad_sync, width=512, depth=4):
    """plan_pair of a tanh MLP of ``depth`` 1 MiB weights with offload='all' on an A100's figures,
    no budget, an idle host update."""
    pair = mlp_pair(batch=64, width=width, depth=depth)
    prepare(pair)
    options = TrinityOptions.from_user({"memory_budget": None, "inner": "eager", "min_offload_bytes": 0}, env={})
    slots = {i: (100 + i, 0) for i in pair.static_input_indices}
    state = ModelState(
        offload="all",
        params=slots,
        update=HostUpdate(0.0, 0.0, overlap="backward"),
        grad_sync=grad_sync,
    )
    return plan_pair(pair, options, state, spec=KNOWN_DEVICES["a100-80gb"])


def ring_all_reduce_seconds(nbytes, p, link):
    """By hand: ring all-reduce over p ranks, every step on ``link`` (Thakur et al. 2005; NCCL's
    tuning model): base + 2 (p - 1) alpha + 2 (p - 1) / p * bytes / bandwidth."""
    return link.base_s + 2 * (p - 1) * link.alpha_s + 2 * (p - 1) / p * nbytes / link.bytes_per_s


FAST = Link("test-fast", bytes_per_s=400e9, alpha_s=2e-6, base_s=5e-6)
SLOW = Link("test-slow", bytes_per_s=1e8, alpha_s=50e-6, base_s=10e-6)


def test_planned_buckets_and_their_all_reduce_seconds_by_hand():
    model = GradSyncModel(world_size=4, bucket_caps=(MiB, 2 * MiB), link=FAST, slot_ids=frozenset({100, 101, 102, 103}))
    plan = plan_all(model)
    buckets = plan.residency.grad_buckets
    # The backward makes w3's gradient first, w0's last: first bucket (1 MiB) w3, then w2 + w1 (2 MiB), then w0.
    assert [b.slots for b in buckets] == [(103,), (102, 101), (100,)]
    assert [b.nbytes for b in buckets] == [MiB, 2 * MiB, MiB]
    expected = [ring_all_reduce_seconds(n, 4, FAST) for n in (MiB, 2 * MiB, MiB)]
    # 2 MiB over 4 ranks: 5 us + 6 x 2 us + 1.5 x 2 MiB / 400 GB/s = 24.73 us.
    assert expected[1] == pytest.approx(5e-6 + 12e-6 + 1.5 * 2 * MiB / 400e9)
    assert [b.seconds for b in buckets] == pytest.approx(expected)
    assert plan.predictions.allreduce_seconds == pytest.approx(sum(expected))
    assert 0.0 <= plan.predictions.exposed_allreduce_seconds <= plan.predictions.allreduce_seconds
    # Every gradient of a bucket is waited for (its device memory held) no earlier than the
    # bucket's launch, after its last gradient.
    by_slot = {p.slot: p for p in plan.residency.params}
    for b in buckets:
        assert b.launch_after == max(by_slot[s].grad_to_host_after for s in b.slots)
        assert all(by_slot[s].grad_wait_after >= b.launch_after for s in b.slots)
        assert b.wait_after == min(by_slot[s].grad_wait_after for s in b.slots)
    # Without averaging there is no all-reduce in the step.
    alone = plan_all(None)
    assert alone.residency.grad_buckets == () and alone.predictions.allreduce_seconds == 0.0
    assert plan.predictions.step_seconds >= alone.predictions.step_seconds


def test_a_slow_link_lengthens_the_predicted_step_by_the_exposed_all_reduce():
    slots = frozenset({100, 101, 102, 103})
    fast = plan_all(GradSyncModel(4, (MiB, 2 * MiB), FAST, slots)).predictions
    slow = plan_all(GradSyncModel(4, (MiB, 2 * MiB), SLOW, slots)).predictions
    # At 100 MB/s each bucket takes tens of ms, far longer than the MLP's backward (microseconds
    # on an A100): most of it is exposed and the step grows by it.
    last = ring_all_reduce_seconds(MiB, 4, SLOW)
    assert last > 100 * fast.compute_seconds
    assert slow.allreduce_seconds == pytest.approx(
        sum(ring_all_reduce_seconds(n, 4, SLOW) for n in (MiB, 2 * MiB, MiB))
    )
    assert slow.exposed_allreduce_seconds > last
    assert slow.step_seconds > fast.step_seconds + slow.exposed_allreduce_seconds - fast.compute_seconds
    assert slow.step_seconds >= slow.compute_seconds + slow.exposed_allreduce_seconds
    # The exposed copies do not count the all-reduce's stalls.
    assert slow.exposed_transfer_seconds < slow.exposed_allreduce_seconds


def test_grad_sync_needs_offload_all():
    with pytest.raises(ValueError, match="offload='all' only"):
        ModelState(offload="activations+params", grad_sync=GradSyncModel(2, (MiB,)))
