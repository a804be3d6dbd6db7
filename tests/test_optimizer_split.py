"""Option ``optimizer_on_device`` (``passes/optimizer_split.py``): which parameters keep their
optimizer state on the device, chosen by the cost model, and the mechanism end to end.

On this CPU-only machine "the device" is the CPU: the mechanism (parameters kept resident with
``.grad``, updated by the same torch optimizer there, the others offloaded) is checked bit for
bit against eager; the choice is checked on a hand-built graph with update costs set by hand.
"""

import copy

import pytest
import torch

import offload_compiler
from offload_compiler import CPUOptimizer
from offload_compiler.devices import KNOWN_DEVICES
from offload_compiler.models import GPTConfig
from offload_compiler.passes import cost_model, liveness, optimizer_split, param_residency
from offload_compiler.passes.cost_model import HostUpdate
from offload_compiler.runtime.model_state import ON_DEVICE_ATTR, slot_of

from .graphs import mlp_pair
from .models import GPTLoss

MiB = 2**20


def setup(depth=4, width=512):
    pair = mlp_pair(batch=64, width=width, depth=depth)
    live = liveness.analyze(pair)
    costs = cost_model.estimate(pair, live, KNOWN_DEVICES["a100-80gb"])
    chosen = {i: (100 + i, 0) for i in pair.static_input_indices}
    return pair, live, costs, chosen


def update_costing(costs, host_times_backward, device_seconds_per_byte=0.0, overlap="backward"):
    """A HostUpdate whose host update of all parameters takes ``host_times_backward`` times the
    backward's compute (4 weights of 1 MiB)."""
    backward = sum(costs.step_seconds[len(costs.step_seconds) // 2 :])
    per_byte = host_times_backward * backward / (4 * MiB)
    return HostUpdate(per_byte, device_seconds_per_byte, overlap=overlap, chunk_bytes=1, state_factor=2)


def test_a_costly_device_update_keeps_everything_on_the_host():
    """Keeping a parameter on the device saves its copies but costs its update on the compute
    stream: when that update is dear (here 100 x the copies of the parameter), none stays."""
    pair, live, costs, chosen = setup()
    copy_per_byte = 1 / KNOWN_DEVICES["a100-80gb"].h2d_bytes_per_s
    update = update_costing(costs, 0.01, device_seconds_per_byte=100 * copy_per_byte)
    split, residency, _view, act = optimizer_split.plan(pair, live, costs, chosen, None, 0, update, "auto")
    assert split.positions == () and split.share == 0.0
    assert len(residency.params) == 4
    steps = [t for _, t, ok in split.candidates]
    assert split.predicted_step_seconds == min(steps) and steps == sorted(steps)


def test_a_slow_host_moves_the_update_to_the_device_in_forward_order():
    pair, live, costs, chosen = setup()
    update = update_costing(costs, 10.0, device_seconds_per_byte=0.0)
    split, residency, _view, act = optimizer_split.plan(pair, live, costs, chosen, None, 0, update, "auto")
    # With an idle device update, everything on the device is fastest: the step is its compute.
    assert split.share == 1.0 and split.positions == (0, 1, 2, 3)
    assert residency.params == ()
    assert split.predicted_step_seconds == pytest.approx(costs.compute_seconds)
    assert split.device_state_bytes == 2 * 4 * MiB
    # The candidates: the more on the device, the shorter the predicted step.
    steps = [t for _, t, ok in split.candidates]
    assert steps == sorted(steps, reverse=True) and steps[0] > 2 * steps[-1]


def test_a_share_is_a_prefix_of_the_parameters_in_forward_order():
    pair, live, costs, chosen = setup()
    update = update_costing(costs, 1.0)
    split, residency, _view, _act = optimizer_split.plan(pair, live, costs, chosen, None, 0, update, 0.5)
    assert split.positions == (0, 1)  # the first two weights: the forward reads w_0 first
    assert {p.placeholder for p in residency.params} == {
        n.name for i, n in enumerate(pair.forward.graph.find_nodes(op="placeholder")) if i in (2, 3)
    }
    assert split.candidates == ((0.5, split.predicted_step_seconds, True),)
    # The same prediction as the one function the backend reports with.
    tl = param_residency.step_timeline(residency, costs, [], update, split.device_param_bytes)
    assert tl.step_seconds == split.predicted_step_seconds
    # Share 0: exactly the plans without a split.
    none, res0, _, act0 = optimizer_split.plan(pair, live, costs, chosen, None, 0, update, 0.0)
    assert none.positions == () and res0 == param_residency.plan(
        pair, live, costs, chosen, "all", live.live_bytes(), None
    )


def test_the_budget_caps_the_share_with_its_optimizer_state():
    """Slow host, so every byte moved to the device shortens the step, but the device must also
    hold the share's optimizer state (2 x its bytes): the largest share that fits wins."""
    pair, live, costs, chosen = setup()
    update = update_costing(costs, 10.0)
    base, res0, view0, act0 = optimizer_split.plan(pair, live, costs, chosen, None, 0, update, 0.0)
    peak0 = act0.peak_bytes_planned
    # Room for about one weight kept with its state (1 MiB resident + 2 MiB state) and a bit.
    budget = peak0 + 3 * MiB + MiB // 2
    split, residency, _view, act = optimizer_split.plan(pair, live, costs, chosen, budget, 0, update, "auto")
    assert act.feasible
    assert act.peak_bytes_planned + split.device_state_bytes <= budget
    feasible = [s for s, _, ok in split.candidates if ok]
    assert split.share == max(feasible) and 0.0 < split.share < 1.0
    assert any(not ok for _, _, ok in split.candidates)  # larger shares do not fit


def test_bad_requests_are_refused():
    pair, live, costs, chosen = setup(depth=2, width=32)
    update = update_costing(costs, 1.0)
    with pytest.raises(ValueError, match="optimizer_on_device: got 2.0; expected 'auto' or a number"):
        optimizer_split.plan(pair, live, costs, chosen, None, 0, update, 2.0)


# ------------------------------------------------------------------ end to end (the device is the CPU)
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32, tie_weights=True)


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g)
    return idx, torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g)


@pytest.mark.parametrize("request_", [0.5, "auto"])
def test_parameters_kept_on_the_device_train_bit_identically(request_):
    """Part of the parameters stays on the device (the CPU here) with its gradient and AdamW
    state, the rest is offloaded; 5 steps with clipping and a state_dict round trip give eager
    AdamW's bits. "auto" plans with an RTX 4090's figures (device option): a slow host link and a
    host slower than the backward there make it keep a share on the device."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = GPTLoss(CFG)
    model = copy.deepcopy(ref)
    options = {"inner": "eager", "offload": "all", "memory_budget": None, "optimizer_on_device": request_}
    if request_ == "auto":
        options.update(device="rtx4090", host_bytes_per_s=1e9)
    compiled = torch.compile(model, backend="trinity", options=options)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    opt = CPUOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
    for step in range(5):
        idx, t = batch(step)
        l_ref, loss = ref(idx, t), compiled(idx, t)
        assert torch.equal(l_ref, loss), step
        l_ref.backward()
        loss.backward()
        assert torch.equal(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5), opt.clip_grad_norm_(0.5))
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    report = offload_compiler.last_report()
    split = report.param_offload["optimizer_on_device"]
    kept = [p for p in model.parameters() if getattr(p, ON_DEVICE_ATTR, False)]
    assert split["num_params"] == len(kept) > 0
    assert 0.0 < split["share"] < 1.0 if request_ == 0.5 else split["share"] > 0.0
    if request_ == "auto":
        best = min(t for _, t, ok in split["candidates"] if ok)
        assert report.param_offload["predicted_step_seconds"] == best
    # Kept parameters are resident between steps and have no host copy; the others are released.
    for p in model.parameters():
        if getattr(p, ON_DEVICE_ATTR, False):
            assert slot_of(p) is None and p.untyped_storage().nbytes() == p.numel() * 4
        else:
            assert slot_of(p) is not None and p.untyped_storage().nbytes() == 0
    opt.synchronize()
    with offload_compiler.materialized(model.parameters()):
        for (name, a), b in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(a, b), name
    sd, sd_ref = opt.state_dict(), opt_ref.state_dict()
    for i, st in sd_ref["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sd["state"][i][key], st[key]), (i, key)
    assert "on device" in report.summary()
    torch._dynamo.reset()
