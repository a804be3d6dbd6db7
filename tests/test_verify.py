"""The verifier: a correct rewrite passes with the plan's peak; each corruption is caught with a
message that names the problem."""

import pytest
import torch

from offload_compiler.ir.ops import EVICT, EVICT_WAIT, PREFETCH, PREFETCH_WAIT
from offload_compiler.passes import insert_transfers, verify
from offload_compiler.passes.verify import VerificationError

from ._pass_helpers import (
    EVERY,
    analyze,
    gram_pair,
    make_plan,
    mlp4_pair,
    nodes_with_target,
    qkv_pair,
    tanh2_pair,
    tanh_mm_pair,
)

CASES = {
    "tanh_mm": (tanh_mm_pair, EVERY),
    "mlp4_one": (mlp4_pair, 1700),
    "mlp4_all": (mlp4_pair, EVERY),
    "qkv_span": (qkv_pair, EVERY),
    "gram_span": (gram_pair, EVERY),
    "same_view_twice": (tanh2_pair, EVERY),
}


def rewritten(name, assume_fusion=False):
    make, budget = CASES[name]
    pair = make()
    live, _costs, plan = make_plan(pair, budget, assume_fusion=assume_fusion)
    assert plan.evictions
    insert_transfers.apply(pair, live, plan, runtime_id=1)
    return pair, plan


def node(gm, name):
    (n,) = [n for n in gm.graph.nodes if n.name == name]
    return n


def wait_of(host):
    (w,) = [u for u in host.users if u.target is EVICT_WAIT]
    return w


@pytest.mark.parametrize("name", list(CASES))
def test_correct_rewrite_passes_with_the_planned_peak(name):
    pair, plan = rewritten(name)
    budget = plan.budget_bytes if plan.feasible else None
    assert verify.verify(pair, budget, expected_peak_bytes=plan.peak_bytes_planned) == plan.peak_bytes_planned


def test_feasible_plan_peak_by_hand():
    """mlp4 at 1700 B evicts tanh and prefetches it before mm_7, which is then the peak:
    weights 256 + x 256 + sum 4 + tanh (back) 256 + tanh_1 256 + two weight gradients 128 +
    tanh_backward_1 256 + mm_7 256 + the loss's tangent 4 = 1672 B. Measured again on the rewritten
    graphs."""
    make, _ = CASES["mlp4_one"]
    live, _ = analyze(make())
    pair, plan = rewritten("mlp4_one")
    assert plan.peak_bytes_planned == 256 + 256 + 4 + 256 + 256 + 128 + 256 + 256 + 4
    assert live.steps[plan.peak_step_planned].node == "mm_7"
    assert verify.verify(pair, 1700, expected_peak_bytes=1672) == 1672


@pytest.mark.parametrize("name", ["mlp4_one", "mlp4_all", "qkv_span"])
def test_correct_rewrite_with_fusion(name):
    pair, plan = rewritten(name, assume_fusion=True)
    assert verify.verify(pair, None, plan.peak_bytes_planned, assume_fusion=True) == plan.peak_bytes_planned


def test_deleted_evict_wait():
    pair, _plan = rewritten("mlp4_all")
    host = nodes_with_target(pair.forward, EVICT)[1]
    pair.forward.graph.erase_node(wait_of(host))
    with pytest.raises(VerificationError, match=rf"evict '{host.name}' has 0 evict_wait nodes"):
        verify.verify(pair, None)


def test_duplicated_evict_wait():
    pair, _plan = rewritten("mlp4_one")
    (host,) = nodes_with_target(pair.forward, EVICT)
    w = wait_of(host)
    with pair.forward.graph.inserting_after(w):
        pair.forward.graph.call_function(EVICT_WAIT, w.args)
    with pytest.raises(VerificationError, match=rf"evict '{host.name}' has 2 evict_wait nodes"):
        verify.verify(pair, None)


def test_forward_reader_moved_after_its_evict_wait():
    # mlp4_all: tanh_1 is evicted and waited for right after its last forward reader, mm_2.
    pair, _plan = rewritten("mlp4_all")
    fw = pair.forward
    mm_2 = node(fw, "mm_2")
    (host,) = [h for h in nodes_with_target(fw, EVICT) if h.args[0].name == "tanh_1"]
    w = wait_of(host)
    # Drop the wait's ordering edge (it may name the reader itself), then move the reader past it.
    w.args = w.args[:3] + (None,)
    w.append(mm_2)
    fw.graph.lint()
    with pytest.raises(VerificationError) as info:
        verify.verify(pair, None)
    msg = str(info.value)
    assert "'mm_2' reads 'tanh_1'" in msg
    assert f"after its storage was freed at '{w.name}'" in msg


def test_removed_prefetch_wait():
    pair, _plan = rewritten("mlp4_all")
    pf = nodes_with_target(pair.backward, PREFETCH)[0]
    (pw,) = [u for u in pf.users if u.target is PREFETCH_WAIT]
    pair.backward.graph.erase_node(pw)
    with pytest.raises(VerificationError, match=rf"prefetch '{pf.name}' has 0 prefetch_wait nodes"):
        verify.verify(pair, None)


def test_backward_reader_before_its_prefetch_wait():
    # mlp4_one: tanh comes back before mm_7 and is waited for right before t_4, its first reader.
    pair, _plan = rewritten("mlp4_one")
    bw = pair.backward
    (pf,) = nodes_with_target(bw, PREFETCH)
    (pw,) = [u for u in pf.users if u.target is PREFETCH_WAIT]
    t_4 = node(bw, "t_4")
    assert pw.next is t_4
    t_4.append(pw)  # the wait now comes after its first reader
    bw.graph.lint()
    with pytest.raises(VerificationError, match=rf"'t_4' reads prefetched '{pf.name}' before its wait '{pw.name}'"):
        verify.verify(pair, None)


def test_host_placeholder_with_a_second_reader():
    pair, _plan = rewritten("mlp4_one")
    bw = pair.backward
    (pf,) = nodes_with_target(bw, PREFETCH)
    host = pf.args[0]
    with bw.graph.inserting_after(pf):
        bw.graph.call_function(torch.ops.aten.clone.default, (host,))
    with pytest.raises(VerificationError, match=rf"host placeholder '{host.name}' has 2 readers"):
        verify.verify(pair, None)


def test_peak_above_budget():
    pair, plan = rewritten("mlp4_one")
    peak = plan.peak_bytes_planned
    with pytest.raises(
        VerificationError, match=rf"re-measured peak .*\({peak} bytes\).* exceeds the budget .*\({peak - 1} bytes\)"
    ):
        verify.verify(pair, peak - 1)
    assert verify.verify(pair, peak) == peak


def test_peak_differs_from_the_plan():
    pair, plan = rewritten("mlp4_one")
    peak = plan.peak_bytes_planned
    with pytest.raises(
        VerificationError,
        match=rf"re-measured peak {peak} bytes differs from the planner's simulated peak {peak + 4} bytes",
    ):
        verify.verify(pair, None, expected_peak_bytes=peak + 4)


def test_evicted_tensor_still_returned_as_device_tensor():
    pair, _plan = rewritten("mlp4_one")
    (host,) = nodes_with_target(pair.forward, EVICT)
    src = host.args[0]
    out = pair.fw_output_node()
    outputs = [src if o is host else o for o in out.args[0]]
    out.args = (tuple(outputs),)
    with pytest.raises(VerificationError) as info:
        verify.verify(pair, None)
    msg = str(info.value)
    assert f"host tensor '{host.name}' is not returned to the backward" in msg
    assert f"evicted '{src.name}' is still returned to the backward as a device tensor" in msg


def test_evict_wait_keeping_the_wrong_tensor_alive():
    # The wait must take the evicted tensor itself (its keep-alive); a wait that takes another
    # tensor is reported, not a crash.
    pair, _plan = rewritten("mlp4_one")
    (host,) = nodes_with_target(pair.forward, EVICT)
    w = wait_of(host)
    other = node(pair.forward, "mm_1")
    w.args = (w.args[0], other) + w.args[2:]
    with pytest.raises(
        VerificationError, match=rf"'{w.name}' waits for '{host.name}' but keeps mm_1 alive, not its source tanh"
    ):
        verify.verify(pair, None)


def test_all_errors_are_listed_together():
    pair, _plan = rewritten("mlp4_all")
    hosts = nodes_with_target(pair.forward, EVICT)
    pair.forward.graph.erase_node(wait_of(hosts[0]))
    pf = nodes_with_target(pair.backward, PREFETCH)[0]
    (pw,) = [u for u in pf.users if u.target is PREFETCH_WAIT]
    pair.backward.graph.erase_node(pw)
    with pytest.raises(VerificationError) as info:
        verify.verify(pair, None)
    msg = str(info.value)
    assert msg.startswith("trinity verification failed:")
    assert f"evict '{hosts[0].name}' has 0 evict_wait nodes" in msg
    assert f"prefetch '{pf.name}' has 0 prefetch_wait nodes" in msg


def test_unrewritten_pair_passes_with_its_own_peak():
    pair = mlp4_pair()
    assert verify.verify(pair, None, expected_peak_bytes=1864) == 1864
    with pytest.raises(VerificationError, match="exceeds the budget"):
        verify.verify(pair, 1863)
