"""The rewrite runner and the verifier after every rewrite (issue 11).

* The dumps come out in run order, and each differs from the one before it exactly by the nodes
  its pass inserted.
* With ``offload="all"`` the verifier runs after the parameter rewrite and re-measures the peak
  against the budget: within it on every e2e model (gradients bit-identical to ``aot_eager``),
  and a rewrite that breaks it is refused.
* Parameter residency is robust to any partition: with a partition that saves views of the
  weights after the loss, parameters are still released after their last real reader and no
  view op runs on a released parameter.
"""

from __future__ import annotations

import copy
import json
import re
from collections import Counter

import pytest
import torch

import offload_compiler
from offload_compiler import CPUOptimizer, measure_peak_device_bytes
from offload_compiler.ir.ops import PARAM_FETCH, PARAM_RELEASE
from offload_compiler.passes import liveness, param_residency, verify

from . import models
from .graphs import partition_unaware_of_parameters
from .test_e2e import CASES, PEAK_SLACK_BYTES

SLOW = {"peak_flops": 1e9, "hbm_bytes_per_s": 1e10}  # tiny kernels worth a side stream
STREAM_OPS = {"set_stream", "record_event", "wait_event"}
PARAM_OPS = {"param_fetch", "param_fetch_wait", "param_release", "grad_to_host", "grad_to_host_wait"}
TRANSFER_OPS = {"evict", "evict_wait", "prefetch", "prefetch_wait"}


def _ops(path) -> list[str]:
    """The op of every node line of a dumped graph, in order (``aten.mm``, ``trinity.evict``)."""
    return re.findall(r"= torch\.ops\.(\w+\.\w+)\.\w+\(|^\s+torch\.ops\.(\w+\.\w+)\.\w+\(", path.read_text(), re.M)


def _op_names(path) -> list[str]:
    return [a or b for a, b in _ops(path)]


def _without(ops, names):
    return [o for o in ops if o.split(".")[1] not in names]


def _trinity(ops) -> Counter:
    return Counter(o.split(".")[1] for o in ops if o.startswith("trinity."))


def _graph_dir(tmp_path):
    (d,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return d


def test_dumps_come_out_in_run_order_with_streams(tmp_path):
    torch.manual_seed(0)
    model = models.MLP()
    opts = {"memory_budget": "50%", "inner": "eager", "min_offload_bytes": 0, "num_streams": 2,
            "dump_dir": str(tmp_path), **SLOW}  # fmt: skip
    torch.compile(model, backend="trinity", options=opts)(*models.mlp_batch()).backward()
    r = offload_compiler.last_report()
    assert r.num_evicted > 0 and r.streams, r.summary()
    d = _graph_dir(tmp_path)
    order = json.loads((d / "passes.json").read_text())
    assert [p["pass"] for p in order] == ["insert_transfers", "assign_streams", "verify"]
    assert [p["dump"] for p in order] == ["10_insert_transfers", "20_assign_streams", None]
    before = "05_reorder" if (d / "05_reorder.forward.py").exists() else "00_partitioned"
    for graph in ("forward", "backward"):
        b, t, s = (
            _op_names(d / f"{stage}.{graph}.py") for stage in (before, "10_insert_transfers", "20_assign_streams")
        )
        # Each dump is the one before it plus exactly its pass's nodes.
        assert _without(t, TRANSFER_OPS) == b
        assert set(_trinity(t)) <= TRANSFER_OPS and _trinity(t)
        assert Counter(_without(s, STREAM_OPS)) == Counter(t)
        assert set(_trinity(s)) - TRANSFER_OPS <= STREAM_OPS
    assert _trinity(_op_names(d / "20_assign_streams.backward.py")).keys() & STREAM_OPS
    times = [
        (d / f"{stage}.forward.py").stat().st_mtime_ns for stage in (before, "10_insert_transfers", "20_assign_streams")
    ]
    assert times == sorted(times)


def test_dumps_in_run_order_with_parameter_offload(tmp_path):
    torch.manual_seed(0)
    cfg = models.GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
    opts = {"memory_budget": "40%", "inner": "eager", "min_offload_bytes": 0, "offload": "all",
            "dump_dir": str(tmp_path)}  # fmt: skip
    torch.compile(models.GPTLoss(cfg), backend="trinity", options=opts)(*models.gpt_batch(8, 32, 64))
    r = offload_compiler.last_report()
    assert r.num_evicted > 0 and r.param_offload is not None
    d = _graph_dir(tmp_path)
    order = [p["pass"] for p in json.loads((d / "passes.json").read_text())]
    assert order == ["insert_transfers", "param_residency_apply", "verify"]
    for graph in ("forward", "backward"):
        t = _op_names(d / f"10_insert_transfers.{graph}.py")
        p = _op_names(d / f"30_param_residency.{graph}.py")
        assert not _trinity(t).keys() & PARAM_OPS  # written before the parameter rewrite ran
        assert Counter(_without(p, PARAM_OPS)) == Counter(t)
        assert _trinity(p).keys() & PARAM_OPS


def _sgd_owner(model):
    return CPUOptimizer(model.parameters(), torch.optim.SGD, lr=0.0)


@pytest.mark.parametrize("case", list(CASES))
def test_all_verifies_the_peak_after_every_rewrite(case):
    """offload="all" at 50% on each e2e model: the verifier ran after the parameter rewrite, its
    re-measured peak is the planned one and within the budget; the measured peak agrees and the
    host gradients are bit-identical to aot_eager's."""
    make_model, make_batch = CASES[case]
    torch.manual_seed(0)
    ref = make_model()
    model = copy.deepcopy(ref)
    cref = torch.compile(ref, backend="aot_eager")
    opts = {"memory_budget": "50%", "inner": "eager", "min_offload_bytes": 0, "offload": "all"}
    cm = torch.compile(model, backend="trinity", options=opts)
    owner = _sgd_owner(model)
    batch = make_batch()
    before = len(offload_compiler.reports())
    cm(*batch).backward()
    cref(*batch).backward()
    reports = offload_compiler.reports()[before:]
    assert reports
    for r in reports:
        names = [n for n, _ in r.pass_seconds]
        assert names.index("param_residency_apply") < names.index("verify")
        assert r.feasible and r.peak_bytes_planned <= r.budget_bytes < r.peak_bytes_unplanned
        assert r.peak_bytes_planned == r.param_offload["peak_bytes"]  # re-measured == planned
    for p, g in zip(ref.parameters(), owner.host_grads()):
        assert torch.equal(p.grad, g)
    owner.zero_grad()
    m = measure_peak_device_bytes(lambda: cm(*batch).backward(), resident=list(batch), device="cpu")
    assert m.peak_bytes <= sum(r.budget_bytes for r in reports) + PEAK_SLACK_BYTES


def test_a_rewrite_that_breaks_the_budget_is_refused_with_parameter_offload(monkeypatch):
    """Dropping the parameter releases keeps every parameter resident: the verifier, now after
    the parameter rewrite, re-measures that peak and refuses it (before, it ran first, without
    the budget)."""
    real = param_residency.apply

    def no_releases(pair, plan, step_nodes, rt, **kwargs):
        real(pair, plan, step_nodes, rt, **kwargs)
        for gm in (pair.forward, pair.backward):
            for n in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is PARAM_RELEASE]:
                gm.graph.erase_node(n)
            gm.recompile()

    monkeypatch.setattr(param_residency, "apply", no_releases)
    torch.manual_seed(0)
    cfg = models.GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
    opts = {"memory_budget": "40%", "inner": "eager", "min_offload_bytes": 0, "offload": "all"}
    with pytest.raises(Exception, match=r"trinity verification failed:[\s\S]*re-measured peak .* exceeds the budget"):
        torch.compile(models.GPTLoss(cfg), backend="trinity", options=opts)(*models.gpt_batch(8, 32, 64))


def test_cnn_with_evictions_between_getitems_of_one_node_compiles_and_matches():
    """Regression (found by the spine test): a 3-layer CNN at 60% (below its lowest reachable
    peak: the tightest plan runs) evicts after one getitem of batch norm and waits after a later
    sibling; both share one anchor."""
    torch.manual_seed(0)
    ref = models.CNN(depth=3)
    model = copy.deepcopy(ref)
    cref = torch.compile(ref, backend="aot_eager")
    opts = {"memory_budget": "60%", "inner": "eager", "min_offload_bytes": 0, "num_streams": 1, "on_infeasible": "warn"}
    cm = torch.compile(model, backend="trinity", options=opts)
    batch = models.cnn_batch()
    with pytest.warns(UserWarning, match="lowest-peak plan"):
        loss = cm(*batch)
    l_ref = cref(*batch)
    loss.backward()
    l_ref.backward()
    assert offload_compiler.last_report().num_evicted > 0
    assert torch.equal(loss, l_ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


# ------------------------------------------------------------------ any partition


@pytest.fixture
def viewing_partition(monkeypatch):
    """The backend's partition entry replaced by one that does not tell the min-cut partitioner
    which inputs are parameters: it saves ``t(t(w))`` views after the loss."""
    from offload_compiler import pipeline
    from offload_compiler.graph_pair import GraphPair

    def partition(joint, joint_inputs, **kwargs):
        fw, bw = partition_unaware_of_parameters(joint, joint_inputs, **kwargs)
        return GraphPair(fw, bw, kwargs["num_fwd_outputs"], tuple(kwargs.get("static_lifetime_input_indices") or ()))

    monkeypatch.setattr(pipeline, "partition", partition)


def test_residency_with_a_partition_that_saves_views_of_the_weights(viewing_partition):
    torch.manual_seed(0)
    cfg = models.GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
    ref = models.GPTLoss(cfg)
    model = copy.deepcopy(ref)
    cref = torch.compile(ref, backend="aot_eager")
    seen = {}
    real_check = verify.check_residency

    def spy_check(pair, plan):
        seen["pair"], seen["plan"] = pair, plan
        return real_check(pair, plan)

    import offload_compiler.pipeline as pipeline

    opts = {"memory_budget": None, "inner": "eager", "offload": "all"}
    cm = torch.compile(model, backend="trinity", options=opts)
    owner = _sgd_owner(model)
    batch = models.gpt_batch(8, 32, 64)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(pipeline.verify, "check_residency", spy_check)
        loss = cm(*batch)
    pair, plan = seen["pair"], seen["plan"]
    assert real_check(pair, plan) == []  # no read, nor view, of a released parameter
    # The partition did save views of weights after the loss (the case this test is about) ...
    moved = [p for p in plan.params if p.fw_save_views]
    assert moved, "the partition saved no late views of parameters"
    fw = list(pair.forward.graph.nodes)
    pos = {n: i for i, n in enumerate(fw)}
    loss_node = pair.fw_outputs()[0]
    for n in fw:
        if n.op == "call_function" and n.target is PARAM_RELEASE:
            # ... yet every parameter is released before the loss is computed (after its last
            # real reader), not at the end of the forward.
            assert pos[n] < pos[loss_node], n
        if n.op == "call_function" and n.target is PARAM_FETCH:
            assert pos[n] < pos[loss_node]
    # Planned with parameters fetched around their readers: well below all of them resident.
    params = sum(p.numel() * 4 for p in model.parameters())
    assert plan.peak_bytes < plan.peak_bytes_resident_params - 0.5 * params
    l_ref = cref(*batch)
    loss.backward()
    l_ref.backward()
    assert torch.equal(loss, l_ref)
    for p, g in zip(ref.parameters(), owner.host_grads()):
        assert torch.equal(p.grad, g)


def test_check_refuses_a_view_of_a_released_parameter():
    """The verifier's residency check counts a view op as a reader."""
    from .graphs import capture_pair

    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)  # its gradient needs t(w)
    pair = capture_pair(lambda w, x: torch.tanh(x @ w).sum(), w, x, static=(0,),
                        partition=partition_unaware_of_parameters)  # fmt: skip
    live = liveness.analyze(pair)
    from offload_compiler.devices import KNOWN_DEVICES
    from offload_compiler.passes import cost_model

    costs = cost_model.estimate(pair, live, KNOWN_DEVICES["a100-80gb"])
    plan = param_residency.plan(pair, live, costs, {0: (0, 256)}, "all", live.live_bytes(), None)
    (p,) = plan.params
    step_nodes = list(pair.forward.graph.nodes) + list(pair.backward.graph.nodes)
    # A plan that does not move the late view: it runs after the release.
    late = [s for s in live.save_only_steps if s > p.fw_release_after]
    assert late, "expected a save-only view of w after its last real reader"
    import dataclasses

    stale = dataclasses.replace(plan, params=(dataclasses.replace(p, fw_save_views=()),))
    param_residency.apply(pair, stale, step_nodes, 0)
    errors = verify.check_residency(pair, stale)
    assert any("view" in e and "while it is released" in e for e in errors), errors
    assert verify.VerificationError  # the backend raises it with these messages
