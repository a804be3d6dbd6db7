"""The backend as a user meets it: found by name, options and their errors, infeasible budgets,
reports, dumps. (Parity of losses and gradients across models is tests/test_e2e.py's job; here
the models are tiny and the inner compiler is plain FX code.)"""

import copy
import gc
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from dataclasses import asdict

import pytest
import torch
from torch import nn

import offload_compiler
from offload_compiler.pipeline import InfeasibleBudgetError

from . import models
from .test_e2e import assert_same

EAGER = {"inner": "eager", "min_offload_bytes": 0}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def backend_error(excinfo) -> BaseException:
    """The backend's own exception inside Dynamo's BackendCompilerFailed."""
    exc = excinfo.value
    assert isinstance(exc, torch._dynamo.exc.BackendCompilerFailed), type(exc)
    inner = getattr(exc, "inner_exception", None) or exc.__cause__
    assert inner is not None
    return inner


def compile_mlp(budget, n=1024, **options):
    torch.manual_seed(0)
    model = models.MLP()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="trinity", options={**EAGER, "memory_budget": budget, **options})
    return model, ref, compiled, models.mlp_batch(n)


def grads_match(model, ref):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(
            p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"grad of {name}: {m}"
        )


# ---------------------------------------------------------------------------------- found by name

_TRAIN_SCRIPT = textwrap.dedent(
    """
    import copy, json, sys
    import torch
    import torch.nn.functional as F
    {preamble}
    torch.manual_seed(0)

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.Linear(64 if i == 0 else 128, 128) for i in range(6))
            self.head = torch.nn.Linear(128, 16)

        def forward(self, x, y):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return F.cross_entropy(self.head(x), y)

    model = MLP()
    ref = copy.deepcopy(model)
    x, y = torch.randn(1024, 64), torch.randint(0, 16, (1024,))
    imported_before = "offload_compiler" in sys.modules
    compiled = torch.compile(model, backend="trinity",
                             options={{"inner": "eager", "memory_budget": "70%", "min_offload_bytes": 0}})
    losses = []
    for _ in range(3):
        loss = compiled(x, y)
        loss.backward()
        ref_loss = ref(x, y)
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
            with torch.no_grad():
                p -= 0.5 * p.grad
                q -= 0.5 * q.grad
            p.grad = q.grad = None
        losses.append(loss.item())
    import offload_compiler
    report = offload_compiler.last_report()
    backend = torch._dynamo.lookup_backend("trinity")
    print("RESULT " + json.dumps({{
        "imported_before": imported_before,
        "losses": losses,
        "num_evicted": report.num_evicted,
        "backend": backend.__module__ + "." + backend.__name__,
    }}))
    """
)


def _clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRINITY_")}
    env["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
    return env


def test_backend_is_found_by_name_with_and_without_importing_the_package(tmp_path):
    scripts = {
        "no_import": _TRAIN_SCRIPT.format(preamble=""),
        # Importing the package (and the backend module) first must not register the name a second
        # time when Dynamo loads the entry point ("duplicate name: trinity").
        "import_first": _TRAIN_SCRIPT.format(preamble="import offload_compiler, offload_compiler.backend"),
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", script],
            cwd=tmp_path,
            env=_clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, script in scripts.items()
    }
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name} failed:\n{err[-4000:]}"
        line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert line, out
        results[name] = json.loads(line[-1][len("RESULT ") :])
    assert results["no_import"]["imported_before"] is False
    assert results["import_first"]["imported_before"] is True
    for name, r in results.items():
        assert r["backend"] == "offload_compiler.backend.trinity", name
        assert r["num_evicted"] > 0, name
        assert r["losses"][2] < r["losses"][0], f"{name} did not train: {r['losses']}"


def test_backend_in_this_process():
    assert torch._dynamo.lookup_backend("trinity") is offload_compiler.trinity
    from offload_compiler.backend import trinity

    assert offload_compiler.trinity is trinity

    def f(x, w):
        return torch.tanh(x @ w).sum()

    x, w = torch.randn(8, 8), torch.randn(8, 8, requires_grad=True)
    out = torch.compile(f, backend="trinity", options={"inner": "eager", "memory_budget": None})(x, w)
    out.backward()
    w2 = w.detach().clone().requires_grad_()
    f(x, w2).backward()
    torch.testing.assert_close(out, f(x, w2))
    torch.testing.assert_close(w.grad, w2.grad)


# ---------------------------------------------------------------------------------- errors


def test_unknown_option_reaches_the_user():
    f = torch.compile(lambda x: (x * 2).sum(), backend="trinity", options={"inner": "eager", "memroy_budget": "50%"})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        f(torch.randn(4, requires_grad=True))
    assert "'memroy_budget'" in str(info.value)
    assert "memory_budget" in str(info.value)  # the allowed ones are listed
    assert isinstance(backend_error(info), ValueError)


def test_bad_option_value_reaches_the_user():
    f = torch.compile(lambda x: (x * 2).sum(), backend="trinity", options={"inner": "eager", "memory_budget": "150%"})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        f(torch.randn(4, requires_grad=True))
    assert "'memory_budget'" in str(info.value) and "'150%'" in str(info.value)


def test_mode_with_eager_inner_is_rejected(monkeypatch):
    monkeypatch.setenv("TRINITY_INNER", "eager")
    f = torch.compile(lambda x: (x * 2).sum(), backend="trinity", mode="max-autotune")
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        f(torch.randn(4, requires_grad=True))
    assert "max-autotune" in str(info.value)
    assert isinstance(backend_error(info), ValueError)


def test_unexpected_backend_keyword():
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(ValueError, match="unexpected arguments.*'bogus'"):
        offload_compiler.trinity(gm, [torch.randn(2)], bogus=1)


class Frozen(nn.Module):
    """A 1 MiB frozen weight dominates; activations are 4 KiB."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(512, 512), requires_grad=False)

    def forward(self, x):
        return torch.tanh(x @ self.w).sum()


def _lowest_peak(message: str) -> int:
    m = re.search(r"lowest peak any plan reaches, [^(]*\((\d+) bytes", message)
    assert m, message
    return int(m.group(1))


def test_infeasible_budget_names_budget_lowest_peak_and_dominating_kind(tmp_path):
    f = torch.compile(
        Frozen(), backend="trinity", options={"inner": "eager", "memory_budget": 1024, "dump_dir": tmp_path}
    )
    x = torch.randn(2, 512, requires_grad=True)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        f(x)
    err = backend_error(info)
    assert isinstance(err, InfeasibleBudgetError) and isinstance(err, ValueError)
    msg = str(err)
    assert "1024 bytes" in msg
    assert "lowest peak" in msg
    assert "dominated by parameter" in msg
    # The 512x512 float32 weight (1 MiB) can never leave; the rest is a few 4 KiB tensors.
    assert 2**20 <= _lowest_peak(msg) <= 2**20 + 8 * 4096
    assert "on_infeasible='warn'" in msg
    # With dump_dir the error is also written next to the graphs.
    errors = list(tmp_path.glob("graph_*/error.txt"))
    assert len(errors) == 1 and errors[0].read_text() == msg


class Tanhs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))

    def forward(self, x):
        for lin in self.lins:
            x = torch.tanh(lin(x))
        return x.sum()


def test_infeasible_when_activations_dominate_but_are_too_small_to_offload():
    # strategy="offload": only offloading may lower the peak, and nothing is large enough.
    options = {"inner": "eager", "memory_budget": "4KiB", "min_offload_bytes": "1GiB", "strategy": "offload"}
    f = torch.compile(Tanhs(), backend="trinity", options=options)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        f(torch.randn(2048, 32)).backward()
    msg = str(backend_error(info))
    assert "4096 bytes" in msg and "lowest peak" in msg
    assert "dominated by saved activation" in msg
    assert "recomputable" not in msg
    # Six saved tanh outputs of 2048x32 float32 (256 KiB each) exist; at least the last ones are
    # alive at the backward's peak, and nothing can be offloaded.
    offload_lowest = _lowest_peak(msg)
    assert offload_lowest >= 4 * 256 * 1024
    # The default strategy ("auto") may also recompute them: still infeasible at 4 KiB, but the
    # message says what recomputation did and its lowest peak is no higher.
    torch._dynamo.reset()
    f = torch.compile(Tanhs(), backend="trinity", options={**options, "strategy": "auto"})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        f(torch.randn(2048, 32)).backward()
    msg = str(backend_error(info))
    assert "strategy='auto'" in msg and "recomputable saved buffers recomputed" in msg
    assert 4 * 256 * 1024 <= _lowest_peak(msg) <= offload_lowest


@pytest.mark.parametrize("offload", ["activations", "all"])
def test_infeasible_budget_names_a_percentage_that_runs_when_passed_back(offload):
    """The error names the lowest reachable peak as a memory_budget percentage; compiling again
    with it is feasible (rounded up, never below the lowest peak by a rounding), and its plan
    reaches that peak."""
    opts = {**EAGER, "offload": offload}
    _, _, compiled, batch = compile_mlp("1%", **opts)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        compiled(*batch)
    msg = str(backend_error(info))
    lowest = _lowest_peak(msg)
    m = re.search(r"The lowest budget that runs is memory_budget='([\d.]+)%' of this graph's peak", msg)
    assert m, msg
    assert f"or memory_budget={lowest} (bytes)" in msg
    before = len(offload_compiler.reports())
    torch._dynamo.reset()
    model, ref, compiled, batch = compile_mlp(f"{m.group(1)}%", **opts)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no infeasible-budget warning either
        loss = compiled(*batch)
    loss.backward()
    ref_loss = ref(*batch)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    if offload == "activations":  # (with offload="all" the gradients go to the host optimizer)
        grads_match(model, ref)
    (r,) = offload_compiler.reports()[before:]
    assert r.feasible and r.fallback_reason is None and r.num_evicted > 0
    assert r.budget_request == f"{m.group(1)}% of the unplanned peak"
    assert lowest <= r.budget_bytes < lowest * 1.002 + 1024  # 0.1% steps of the unplanned peak
    if offload == "activations":
        assert r.peak_bytes_planned == r.lowest_reachable_peak_bytes == lowest
    else:
        assert r.param_offload["peak_bytes"] <= r.budget_bytes


def test_on_infeasible_warn_with_nothing_to_offload():
    torch.manual_seed(0)
    model = Frozen()
    f = torch.compile(
        model, backend="trinity", options={"inner": "eager", "memory_budget": 1024, "on_infeasible": "warn"}
    )
    x = torch.randn(2, 512, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    before = len(offload_compiler.reports())
    with pytest.warns(UserWarning, match="lowest peak") as rec:
        out = f(x)
    assert any("dominated by parameter" in str(w.message) for w in rec)
    out.backward()
    ref = model(x_ref)
    ref.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    (r,) = offload_compiler.reports()[before:]
    assert r.feasible is False and r.num_evicted == 0 and r.budget_bytes == 1024
    assert r.fallback_reason is not None


def test_on_infeasible_warn_runs_the_lowest_peak_plan_with_right_gradients():
    before = len(offload_compiler.reports())
    model, ref, compiled, (x, y) = compile_mlp(1024, on_infeasible="warn")
    with pytest.warns(UserWarning, match="lowest peak") as rec:
        loss = compiled(x, y)
    assert any("on_infeasible='warn'" in str(w.message) for w in rec)
    loss.backward()
    ref_loss = ref(x, y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    grads_match(model, ref)
    (r,) = offload_compiler.reports()[before:]
    assert r.feasible is False
    assert r.budget_bytes == 1024
    assert r.fallback_reason and "infeasible" in r.fallback_reason
    # The lowest-peak plan offloads only what lowers the peak (here 7 of the 10 candidates; the
    # planner's tests check that each kept eviction is needed).
    assert 0 < r.num_evicted < r.num_candidates == 10
    assert r.peak_bytes_planned == r.lowest_reachable_peak_bytes < r.peak_bytes_unplanned
    # A second step runs from the same compiled code without warning again.
    model.zero_grad()
    compiled(x, y).backward()
    assert len(offload_compiler.reports()) == before + 1


def test_evicting_the_small_outputs_of_a_multi_output_op(tmp_path):
    # native_layer_norm returns (out, mean, rstd); all three are saved. Evicting mean and rstd used
    # to put an evict_wait between the op's getitems, so the tuple (and the "freed" tensor) lived
    # on and the verifier rejected the plan. The getitems now stay together, before any transfer.
    # (The tail after the ReLU sets the backward's peak while the three are idle, so the lowest-peak
    # plan, which evicts only what lowers the peak, evicts them.)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.LayerNorm(16),
        torch.nn.Linear(16, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 16),
    )
    ref = copy.deepcopy(model)
    x = torch.randn(4096, 16)
    before = len(offload_compiler.reports())
    compiled = torch.compile(
        model,
        backend="trinity",
        options={
            "inner": "eager",
            "memory_budget": "30%",
            "on_infeasible": "warn",
            "min_offload_bytes": 0,
            "dump_dir": tmp_path,
        },
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the 30% budget is infeasible; the lowest-peak plan runs
        compiled(x).sum().backward()
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    (r,) = offload_compiler.reports()[before:]
    assert "verify" in dict(r.pass_seconds)  # the verifier ran and accepted the plan
    (graph_dir,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    live = json.loads((graph_dir / "liveness.json").read_text())
    plan = json.loads((graph_dir / "plan.json").read_text())
    evicted = {n for e in plan["evictions"] for n in live["buffers"][e["buffer"]]["nodes"]}
    getitems = {f"forward:{u}" for u in ("getitem", "getitem_1", "getitem_2")}  # out, mean, rstd
    assert getitems <= evicted and r.num_evicted >= 3


class _CheckpointedAttention(torch.nn.Module):
    """Two linear layers outside and an attention block with dropout inside non-reentrant
    activation checkpointing (what Hugging Face's gradient_checkpointing does). ``out_features``:
    the width of the last layer."""

    def __init__(self, out_features: int = 64):
        super().__init__()
        self.inp = torch.nn.Linear(64, 64)
        self.qkv = torch.nn.Linear(64, 192)
        self.out = torch.nn.Linear(64, out_features)

    def block(self, h):
        q, k, v = self.qkv(h).view(8, 128, 3, 4, 16).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.nn.functional.dropout(a.transpose(1, 2).reshape(8, 128, 64), p=0.1, training=self.training)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = h + torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)
        return torch.tanh(self.out(h)).square().mean()


# The width of the last layer at which its backward sets the peak while saved activations are
# idle, so that the lowest-peak plan evicts them: Inductor's fused kernels hold less at that
# layer's backward (at 256 its peak is the recomputed attention's, as at 64).
_WIDE = {"eager": 256, "inductor": 1024}


@pytest.mark.parametrize("inner", ["eager", "inductor"])
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_activation_checkpointing_inside_the_model(inner, wide):
    # The partitioner emits checkpointing's RNG-state wrappers without meta["val"]; trinity used to
    # stop there ("has no meta['val']"). Now they are planned around like any multi-output op.
    # Parity: with inner="eager" bit for bit with eager; with inner="inductor" against plain
    # Inductor as tests/test_e2e.py judges it (assert_same: its fusions round differently).
    out_features = _WIDE[inner] if wide else 64
    torch.manual_seed(0)
    model = _CheckpointedAttention(out_features)
    ref_model = copy.deepcopy(model)
    ref = ref_model if inner == "eager" else torch.compile(ref_model, backend="inductor")
    x = torch.randn(8, 128, 64)
    before = len(offload_compiler.reports())
    compiled = torch.compile(
        model,
        backend="trinity",
        # Narrow (64): the backward's recomputed attention sets the peak and no plan lowers it, so
        # the lowest-peak plan that "warn" runs evicts nothing (a copy would buy nothing). Wide: the
        # last layer's backward sets it while saved activations are idle, and the lowest-peak plan
        # evicts them.
        options={"inner": inner, "memory_budget": "60%", "min_offload_bytes": 0, "on_infeasible": "warn"},
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="trinity: memory_budget")
        for _ in range(2):
            torch.manual_seed(1)
            loss = compiled(x)
            loss.backward()
            torch.manual_seed(1)
            ref_loss = ref(x)
            ref_loss.backward()
            assert_same(loss.detach(), ref_loss.detach(), inner == "eager", "loss")
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert_same(p.grad, q.grad, inner == "eager", f"grad of {name}")
    (r,) = offload_compiler.reports()[before:]
    assert r.inner == inner and not r.feasible
    # The RNG states are kept on the device, with their reason. Under Inductor the dropout draws
    # from a saved seed tensor (prims.inductor_seeds, an ordinary candidate) instead of a
    # checkpointed RNG state: the attention's is the one left.
    rng_states = {"eager": 2, "inductor": 1}[inner]
    assert r.num_candidates == {"eager": 3, "inductor": 4}[inner]
    assert [reason for _, reason in r.not_offloaded] == [
        "random-number-generator state of a checkpointed random op"
    ] * rng_states
    if not wide:
        assert r.num_evicted == 0 and r.lowest_reachable_peak_bytes == r.peak_bytes_unplanned
    else:
        # The two idle activations (and, under Inductor, the dropout's seed), not the last
        # layer's output, which the backward reads first.
        assert r.num_evicted == {"eager": 2, "inductor": 3}[inner]
        assert r.peak_bytes_planned == r.lowest_reachable_peak_bytes < r.peak_bytes_unplanned


# ---------------------------------------------------------------------------------- reports


def test_last_report_is_none_after_a_failed_compile():
    """A failed compile must not leave last_report() describing the previous model."""
    model, ref, compiled, (x, y) = compile_mlp("50%")
    compiled(x, y).backward()
    good = offload_compiler.last_report()
    assert good is not None
    torch._dynamo.reset()
    f = torch.compile(Frozen(), backend="trinity", options={"inner": "eager", "memory_budget": 1024})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed):
        f(torch.randn(2, 512, requires_grad=True))
    assert offload_compiler.last_report() is None
    assert offload_compiler.reports()[-1] is good  # the earlier report is still listed
    torch._dynamo.reset()
    model, ref, compiled, (x, y) = compile_mlp("50%")
    compiled(x, y).backward()
    assert offload_compiler.last_report() is offload_compiler.reports()[-1] is not good


def test_report_fields_at_a_half_budget():
    before = len(offload_compiler.reports())
    model, ref, compiled, (x, y) = compile_mlp("50%")
    loss = compiled(x, y)
    loss.backward()
    reports = offload_compiler.reports()[before:]
    assert len(reports) == 1
    r = reports[0]
    assert offload_compiler.last_report() is r
    assert r.device == "cpu" and r.inner == "eager"
    assert r.budget_request == "50% of the unplanned peak"
    assert r.budget_bytes == int(0.5 * r.peak_bytes_unplanned)
    assert r.peak_bytes_planned <= r.budget_bytes < r.peak_bytes_unplanned
    assert r.lowest_reachable_peak_bytes <= r.peak_bytes_planned
    assert r.feasible is True and r.fallback_reason is None
    assert 0 < r.num_evicted <= r.num_candidates <= r.num_saved
    # At the unplanned peak at most the evicted bytes are gone, so they cover the reduction.
    assert r.evicted_bytes >= r.peak_bytes_unplanned - r.peak_bytes_planned > 0
    assert r.copy_bytes > 0
    assert r.compute_seconds > 0 and r.exposed_transfer_seconds >= 0
    assert r.predicted_step_seconds == pytest.approx(r.compute_seconds + r.exposed_transfer_seconds, rel=1e-9)
    names = [name for name, _ in r.pass_seconds]
    for name in ("liveness", "cost_model", "plan_window", "insert_transfers", "verify"):
        assert name in names
    assert all(s >= 0 for _, s in r.pass_seconds)
    assert r.dump_dir is None
    assert r.device_name == "CPU (host as device)"
    # The runtime counted what the plan moves: one step copies copy_bytes each way.
    stats = r.runtime_stats()
    assert stats is not None
    assert stats.bytes_d2h == r.copy_bytes and stats.bytes_h2d == r.copy_bytes
    assert stats.num_evicts == stats.num_prefetches >= r.num_evicted
    assert stats.pending_copies == 0
    assert json.loads(r.to_json()) == json.loads(json.dumps(asdict(r)))
    assert "50% of the unplanned peak" in r.summary()
    # And the gradients are right.
    ref(x, y).backward()
    grads_match(model, ref)


@pytest.mark.parametrize("budget,described", [(None, "none"), ("auto", "auto")])
def test_report_without_a_budget_evicts_nothing(budget, described):
    # "auto" is the free device memory less a reserve on CUDA; without CUDA it is no limit.
    before = len(offload_compiler.reports())
    _, _, compiled, (x, y) = compile_mlp(budget)
    compiled(x, y).backward()
    (r,) = offload_compiler.reports()[before:]
    assert r.budget_bytes is None and r.budget_request == described
    assert r.num_evicted == 0 and r.evicted_bytes == 0 and r.copy_bytes == 0
    assert r.peak_bytes_planned == r.peak_bytes_unplanned
    assert r.exposed_transfer_seconds == 0
    assert r.predicted_step_seconds == pytest.approx(r.compute_seconds, rel=1e-9)
    stats = r.runtime_stats()
    assert stats.num_evicts == 0 and stats.host_pool.held_bytes == 0
    # The host pool's default limit is half the machine's physical memory.
    assert stats.host_pool.limit_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def test_host_pool_limit_reaches_the_runtime_and_its_exhaustion_the_user():
    from offload_compiler.runtime.pool import HostPoolExhausted

    before = len(offload_compiler.reports())
    _, _, compiled, (x, y) = compile_mlp("50%", host_pool_limit_bytes=300_000, on_host_pool_full="error")
    with pytest.raises(HostPoolExhausted) as info:
        compiled(x, y)
    # The first evicted activation is a 1024 x 128 float32 tanh output (524288 bytes) or the
    # 1024 x 16 log-softmax (65536 bytes); the first of them does not fit in 300000 bytes
    # only if it is the former.
    assert info.value.requested_bytes == 524288 and info.value.limit_bytes == 300_000
    assert "(524288 bytes)" in str(info.value)
    assert "host_pool_limit_bytes" in str(info.value)
    (r,) = offload_compiler.reports()[before:]
    stats = r.runtime_stats()
    assert stats.host_pool.limit_bytes == 300_000
    assert stats.host_pool.held_bytes == 0


def test_host_pool_limit_falls_back_to_unpooled_memory_with_one_warning():
    before = len(offload_compiler.reports())
    model, ref, compiled, (x, y) = compile_mlp("50%", host_pool_limit_bytes=300_000)
    with pytest.warns(UserWarning, match="falling back to unpooled host memory") as record:
        for _ in range(2):
            model.zero_grad()  # (accumulated gradients would take the step above "50%")
            compiled(x, y).backward()
    assert sum("falling back" in str(w.message) for w in record) == 1
    ref(x, y).backward()
    grads_match(model, ref)
    (r,) = offload_compiler.reports()[before:]
    stats = r.runtime_stats().host_pool
    assert stats.limit_bytes == 300_000 and stats.held_bytes <= 300_000
    assert stats.num_overflow_allocations >= 2  # the 512 KiB activation, each step


def test_budgets_at_several_fractions_are_met():
    before = len(offload_compiler.reports())
    fractions = {"80%": 0.8, "65%": 0.65, "50%": 0.5}
    for budget in fractions:
        torch._dynamo.reset()
        _, _, compiled, (x, y) = compile_mlp(budget)
        compiled(x, y).backward()
    reports = offload_compiler.reports()[before:]
    assert len(reports) == len(fractions)
    unplanned = reports[0].peak_bytes_unplanned
    for r, frac in zip(reports, fractions.values()):
        assert r.peak_bytes_unplanned == unplanned  # the same graph each time
        assert r.budget_bytes == int(frac * unplanned)
        assert r.peak_bytes_planned <= r.budget_bytes
        # At the unplanned peak at most the evicted bytes are gone.
        assert r.evicted_bytes >= unplanned - r.budget_bytes


def test_the_runtime_lives_as_long_as_the_compiled_code():
    _, _, compiled, (x, y) = compile_mlp(None, n=256)
    compiled(x, y).backward()
    r = offload_compiler.last_report()
    assert r.runtime_stats() is not None
    del compiled
    torch._dynamo.reset()
    gc.collect()
    assert r.runtime_stats() is None


# ---------------------------------------------------------------------------------- dumps


def test_dump_dir(tmp_path):
    before = len(offload_compiler.reports())
    _, _, compiled, (x, y) = compile_mlp("50%", dump_dir=str(tmp_path))
    compiled(x, y).backward()
    (r,) = offload_compiler.reports()[before:]
    d = tmp_path / f"graph_{r.graph_id:03d}"
    assert r.dump_dir == str(d)
    for name in (
        "00_partitioned.forward.py",
        "00_partitioned.backward.py",
        "10_insert_transfers.forward.py",
        "10_insert_transfers.backward.py",
        "plan.json",
        "liveness.json",
        "report.json",
        "memory.png",
    ):
        assert (d / name).is_file(), name
    before_fw = (d / "00_partitioned.forward.py").read_text()
    after_fw = (d / "10_insert_transfers.forward.py").read_text()
    after_bw = (d / "10_insert_transfers.backward.py").read_text()
    assert "torch.ops.trinity.evict" not in before_fw
    assert "torch.ops.trinity.evict" in after_fw
    assert "torch.ops.trinity.prefetch" in after_bw
    plan = json.loads((d / "plan.json").read_text())
    assert len(plan["evictions"]) == r.num_evicted
    assert plan["peak_bytes_planned"] <= plan["budget_bytes"] == r.budget_bytes
    liveness = json.loads((d / "liveness.json").read_text())
    assert liveness["buffers"] and liveness["peak_bytes"] == r.peak_bytes_unplanned
    report = json.loads((d / "report.json").read_text())
    assert report == json.loads(r.to_json())
    assert (d / "memory.png").read_bytes()[:8] == PNG_SIGNATURE


def test_dump_dir_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TRINITY_DUMP_DIR", str(tmp_path / "from_env"))
    before = len(offload_compiler.reports())
    _, _, compiled, (x, y) = compile_mlp(None)
    compiled(x, y).backward()
    (r,) = offload_compiler.reports()[before:]
    d = tmp_path / "from_env" / f"graph_{r.graph_id:03d}"
    assert r.dump_dir == str(d)
    assert (d / "report.json").is_file() and (d / "memory.png").read_bytes()[:8] == PNG_SIGNATURE


def test_size_bounds_only_with_dynamic_shapes_and_a_budget():
    before = len(offload_compiler.reports())
    x = torch.randn(512, 32)
    for budget, dynamic in [("75%", False), (None, True), ("75%", True)]:
        torch._dynamo.reset()
        f = torch.compile(
            Tanhs(),
            backend="trinity",
            dynamic=dynamic,
            options={"inner": "eager", "memory_budget": budget, "min_offload_bytes": 0},
        )
        f(x).backward()
    static, unbudgeted, guarded = offload_compiler.reports()[before:]
    assert static.size_bounds == () and unbudgeted.size_bounds == ()
    assert [bound for _, bound in guarded.size_bounds] == [512]
