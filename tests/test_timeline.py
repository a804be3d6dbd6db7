"""The simulator on rewritten graph pairs, and its Chrome trace."""

import json

import torch

from offload_compiler.devices import KNOWN_DEVICES
from offload_compiler.ir.ops import EVICT, PREFETCH
from offload_compiler.passes import cost_model, insert_transfers, liveness, plan_window
from offload_compiler.passes.pair_timeline import simulate_pair
from offload_compiler.runtime.transfer import TransferRuntime

from .graphs import capture_pair

L4 = KNOWN_DEVICES["l4"]


def _mlp_pair(depth=6, batch=256, width=128):
    torch.manual_seed(0)
    ws = [torch.randn(width, width, requires_grad=True) for _ in range(depth)]
    x = torch.randn(batch, width)

    def fn(*args):
        *weights, h = args
        for w in weights:
            h = torch.tanh(h @ w)
        return h.sum()

    return capture_pair(fn, *ws, x, static=tuple(range(depth)))


def _rewritten(budget_fraction=0.5, spec=L4):
    pair = _mlp_pair()
    live = liveness.analyze(pair)
    costs = cost_model.estimate(pair, live, spec)
    plan = plan_window.plan(live, costs, int(budget_fraction * live.peak_bytes), 0)
    runtime = TransferRuntime(torch.device("cpu"), 1 << 28)
    insert_transfers.apply(pair, live, plan, runtime.id)
    return pair, plan, runtime


def test_simulated_rewrite_matches_the_plans_prediction():
    pair, plan, _rt = _rewritten()
    assert plan.evictions
    tl = simulate_pair(pair, L4)
    assert tl.step_time == plan.predicted_step_seconds
    assert tl.exposed_seconds == plan.exposed_transfer_seconds
    assert tl.peak_bytes == plan.peak_bytes_planned


def test_copies_come_from_the_trinity_nodes():
    pair, plan, _rt = _rewritten()
    tl = simulate_pair(pair, L4)
    n_evict = sum(1 for n in pair.forward.graph.nodes if n.target is EVICT)
    n_prefetch = sum(1 for n in pair.backward.graph.nodes if n.target is PREFETCH)
    directions = [c.direction for c in tl.timeline.copies]
    assert directions.count("d2h") == n_evict and directions.count("h2d") == n_prefetch
    total = sum(g.copy_bytes for ev in plan.evictions for g in ev.groups)
    d2h_seconds = sum(c.end - c.start for c in tl.timeline.copies if c.direction == "d2h")
    assert abs(d2h_seconds - total / L4.d2h_bytes_per_s) < 1e-12


def test_slow_link_exposes_copies_and_the_bound_holds():
    import dataclasses

    slow = dataclasses.replace(L4, h2d_bytes_per_s=1e7, d2h_bytes_per_s=1e7)
    pair, plan, _rt = _rewritten(spec=slow)
    tl = simulate_pair(pair, slow)
    copies = tl.timeline.copies
    d2h = sum(c.end - c.start for c in copies if c.direction == "d2h")
    h2d = sum(c.end - c.start for c in copies if c.direction == "h2d")
    assert tl.exposed_seconds > 0
    assert tl.step_time >= max(tl.timeline.compute_seconds, d2h, h2d)
    assert abs(tl.step_time - (tl.timeline.compute_seconds + tl.exposed_seconds)) < 1e-12


def test_chrome_trace_is_valid_and_complete(tmp_path):
    pair, plan, _rt = _rewritten()
    tl = simulate_pair(pair, L4)
    trace = tl.chrome_trace()
    path = tmp_path / "timeline.json"
    path.write_text(json.dumps(trace))
    events = json.loads(path.read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    assert tracks == {"compute stream", "D2H copies (device to host)", "H2D copies (host to device)"}
    spans = [e for e in events if e["ph"] == "X"]
    copies = [e for e in spans if e["tid"] in (2, 3)]
    assert len(copies) == len(tl.timeline.copies)
    for e in spans:
        assert e["ts"] >= 0 and e["dur"] > 0
    counters = [e for e in events if e["ph"] == "C"]
    assert max(e["args"]["bytes"] for e in counters) == tl.peak_bytes
    # Compute spans are back to back on their track, in schedule order.
    compute = [e for e in spans if e["tid"] == 1]
    for a, b in zip(compute, compute[1:]):
        assert b["ts"] >= a["ts"] + a["dur"] - 1e-6
