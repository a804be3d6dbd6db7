"""The benchmark machinery on tiny models (1-2 steps), so bench/ keeps working.

Inductor-based methods are left out (their compiles take tens of seconds on a small CPU); the
eager-inner ones go through the same runner code. One Inductor check stays: that the
selective-recompute points compile with their budget.
"""

import dataclasses
import json

import pytest
import torch

from bench import common, report, step_ratio
from bench.memory import HOST_SCOPE, measure_peak
from bench.methods import get_method
from bench.models import MODEL_NAMES, get_model
from bench.runner import RunConfig, run_method, run_model, slug
from offload_compiler import measure_peak_device_bytes

CONFIG = RunConfig(steps=2, warmup=1, size="tiny")


def test_methods_on_tiny_gpt_train_identically():
    rows = run_model(
        get_model("gpt", "tiny"),
        ["eager", "checkpoint", "save_on_cpu", "aot_eager", "trinity-eager-50%"],
        CONFIG,
        write=False,
    )
    by_key = {r["method"]["key"]: r for r in rows}
    for key, row in by_key.items():
        assert row["ok"], (key, row.get("error"), row.get("traceback"))
        assert len(row["losses"]) == 2 and row["peak_bytes"] > 0 and row["median_step_seconds"] > 0
    eager = by_key["eager"]
    for key in ("checkpoint", "save_on_cpu", "aot_eager", "trinity-eager-50%"):
        assert by_key[key]["losses"] == eager["losses"], key  # same weights, batches, optimizer
        assert by_key[key]["vs_eager"]["key"] == "eager"
    # Checkpointing and save_on_cpu (host copies counted as host) lower the peak.
    assert by_key["checkpoint"]["peak_bytes"] < eager["peak_bytes"]
    assert by_key["save_on_cpu"]["peak_bytes"] < eager["peak_bytes"]
    assert by_key["save_on_cpu"]["host_bytes"] > 0
    tri = by_key["trinity-eager-50%"]
    assert tri["trinity"]["num_graphs"] >= 1 and tri["trinity"]["budget_bytes"] is not None
    assert tri["vs_reference"]["key"] == "aot_eager"
    assert by_key["aot_eager"]["compile_seconds"] is not None and eager["compile_seconds"] is None


def test_results_json_table_and_frontier(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    run_model(get_model("resnet", "tiny"), ["eager", "checkpoint", "trinity-eager-50%"], CONFIG)
    files = sorted((tmp_path / "runs" / "cpu" / "resnet").glob("*.json"))
    assert [f.name for f in files] == ["checkpoint.json", "eager.json", f"{slug('trinity-eager-50%')}.json"]
    record = json.loads(files[0].read_text())
    for field in ("device", "torch", "command", "git_commit", "peak_bytes", "median_step_seconds", "final_loss"):
        assert field in record
    readme = report.write_report(tmp_path).read_text()
    assert "| checkpoint per block (eager, non-reentrant) |" in readme
    assert "say nothing about overlap" in readme and "No GPU run" in readme
    assert (tmp_path / "frontier_cpu_resnet.png").stat().st_size > 0


def test_failure_is_recorded_not_raised():
    def broken(model, device):
        raise RuntimeError("boom")

    spec = get_model("vit", "tiny")
    method = get_method("eager")
    torch.manual_seed(0)
    row = run_method(
        spec, dataclasses.replace(method, prepare=broken), spec.build(), spec.make_batches(3, 0), CONFIG, None
    )
    assert not row["ok"] and "boom" in row["error"]


def test_bench_replay_agrees_with_project_accounting():
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    x = torch.randn(128, 64)

    def step():
        lin(x).sum().backward()
        lin.zero_grad(set_to_none=True)

    step()
    resident = list(lin.parameters()) + [x]
    ours = measure_peak(step, resident=resident, device=torch.device("cpu"), host_copies=True)
    theirs = measure_peak_device_bytes(step, resident=resident, device="cpu")
    assert ours.peak_bytes == theirs.peak_bytes

    def with_host_copy():
        with torch.profiler.record_function(HOST_SCOPE):
            keep = torch.empty(1 << 20, dtype=torch.uint8)
        step()
        return keep

    m = measure_peak(with_host_copy, resident=resident, device=torch.device("cpu"), host_copies=True)
    assert m.host_pool_bytes >= 1 << 20 and m.peak_bytes == theirs.peak_bytes


def test_registry_and_method_keys():
    for name in MODEL_NAMES:
        spec = get_model(name, "tiny")
        assert spec.source and spec.description
    assert "built-in" in get_model("vit", "tiny").source or "timm" in get_model("vit", "tiny").source
    for key in ("eager", "inductor", "sac-0.5", "save_on_cpu", "torch-offload", "trinity-50%", "trinity-eager-1GiB"):
        assert get_method(key, lambda m: []).key == key
    for bad in ("nope", "sac-2", "trinity-lots"):
        with pytest.raises(ValueError):
            get_method(bad)
    assert slug("trinity-50%") == "trinity-50pct"


def _fake(key, family, peak, step, budget_bytes=None, within=None):
    row = {"ok": True, "method": {"key": key, "family": family}, "peak_bytes": peak, "median_step_seconds": step}
    if family == "trinity":
        row["trinity"] = {"budget_bytes": budget_bytes, "within_budget": within}
    return row


def test_targets_from_rows():
    cpu = {
        "gpt": [
            _fake("inductor", "compile", 100, 1.0),
            _fake("trinity-50%", "trinity", 48, 1.2, budget_bytes=50, within=True),
        ]
    }
    (t,) = report.cpu_targets(cpu)
    assert t["within_budget"] and t["step_ok"] and t["step_ratio"] == pytest.approx(1.2)
    # A side-by-side (paired) measurement decides the step target when there is one.
    (t,) = report.cpu_targets(cpu, {"gpt": {"ratio": 1.35, "ratio_q1": 1.3, "ratio_q3": 1.4}})
    assert not t["step_ok"] and t["step_ratio"] == 1.35 and t["sequential_step_ratio"] == pytest.approx(1.2)
    gpu = {
        "gpt": [
            _fake("eager", "eager", 110, 1.1),
            _fake("inductor", "compile", 100, 1.0),
            _fake("checkpoint", "checkpoint", 40, 1.3),
            _fake("sac-0.5", "sac", 70, 1.04),
            _fake("trinity-50%", "trinity", 50, 1.03),
            _fake("trinity-25%", "trinity", 30, 1.2),
        ]
    }
    (g,) = report.gpu_targets(gpu)
    assert g["t1"]["met"] and g["t1"]["trinity"] == "trinity-50%" and g["t1"]["best_other"] == "sac-0.5"
    assert g["t2"]["met"] and g["t2"]["trinity"] == "trinity-25%" and g["t2"]["fastest_other"] == "checkpoint"


def test_step_ratio_pairs_trinity_with_its_inner_compiler(tmp_path, monkeypatch):
    """bench.step_ratio steps trinity and aot_eager alternately; the report judges the step target
    on the paired ratio."""
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    row = step_ratio.measure_pair("gpt", "trinity-eager-50%", rounds=2, warmup=1, size="tiny")
    assert row["reference"] == "aot_eager" and row["rounds"] == 2
    assert row["trinity_median_seconds"] > 0 and row["reference_median_seconds"] > 0
    assert row["ratio_q1"] <= row["ratio"] <= row["ratio_q3"]
    with pytest.raises(ValueError, match="no reference"):
        step_ratio.measure_pair("gpt", "eager", rounds=1, size="tiny")
    step_ratio.main(["--models", "gpt", "--rounds", "1", "--warmup", "1", "--size", "tiny", "--budget", "60%"])
    data = json.loads((tmp_path / "step_ratio_cpu.json").read_text())
    assert data["budget"] == "60%" and [p["trinity"] for p in data["pairs"]] == ["trinity-60%", "trinity-eager-60%"]
    assert ("gpt", "trinity-60%") in report._paired_ratios(tmp_path, "cpu")


def test_gpu_check_dry_run_on_the_cpu(tmp_path):
    """bench/gpu_check.sh without CUDA: every part runs on the CPU, shrunk (TRINITY_GPU_CHECK_QUICK),
    the CUDA-only tests skip themselves, and the JSON records what ran and what was skipped."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from bench.gpu_check import BUDGETS, PARTS

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHON": sys.executable, "TRINITY_GPU_CHECK_QUICK": "1", "TRINITY_COMMIT": "abc1234"}
    p = subprocess.run(
        ["bash", str(root / "bench" / "gpu_check.sh"), "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    d = json.loads(out.read_text())
    assert d["benchmark"] == "gpu_check" and d["dry_run"] and d["quick"] and d["ok"]
    assert d["device_type"] == "cpu" and d["torch"] == torch.__version__ and d["git_commit"] == "abc1234"
    assert d["command"] == "bench/gpu_check.sh --out " + str(out)
    assert list(d["parts"]) == list(PARTS)
    tests = d["parts"]["cuda_tests"]
    assert tests["status"] == "skipped" and tests["tests"]["tests"] == tests["tests"]["skipped"] >= 6
    assert any(s.startswith("cuda_tests:") for s in d["skipped"])
    assert any(s.startswith("demo on CUDA") for s in d["skipped"])
    for name in ("demo", "calibrate", "step_ratio", "predicted_vs_measured"):
        assert d["parts"][name]["status"] == "ok", (name, d["parts"][name])
    assert "bit-identical" in d["parts"]["demo"]["output_tail"]
    assert d["parts"]["calibrate"]["figures"]["flops_fp32"] > 0
    ratio = d["parts"]["step_ratio"]["result"]
    assert ratio["reference"] == "aot_eager" and ratio["ratio"] > 0
    rows = d["parts"]["predicted_vs_measured"]["result"]["rows"]
    assert [r["budget"] for r in rows] == list(BUDGETS)
    for r in rows:
        assert r["num_graphs"] == 1 and r["measured_peak_bytes"] > 0 and r["planned_peak_bytes"] > 0
        assert r["predicted_step_seconds"] > 0 and r["measured_step_seconds_median"] > 0
        assert r["runtime_check_measured_peak_bytes"][0] is not None
        # Timed after the runtime check of the first steps had finished (as the reports say):
        # here it measures the first step and replans nothing, so the second shows it finished.
        assert r["runtime_check_finished_after_steps"] == r["warmup_steps"] == 2, r
        assert r["timed_after_runtime_check"] and r["timed_steps"] == 1, r
        assert len(r["warmup_step_seconds"]) == 2
        assert not r["feasible"] or r["over_budget_bytes"] <= 64 * 1024, r  # test_e2e's slack
    assert rows[0]["num_evicted"] == 0 and rows[1]["num_evicted"] > 0
    assert rows[1]["measured_peak_bytes"] < rows[0]["measured_peak_bytes"]


def test_gpu_check_times_steps_only_after_the_runtime_check_finished():
    """bench/gpu_check.py's warm-up on a pair whose runtime check replans (test_step_check's
    scratch MLP at 50%: the first step's measured peak is over the budget): it ends only after
    the replanned pair's own measured step and one step that changed no report, so the timed
    steps run the final plan, unmeasured. Without the check's measurement it stops at its bound."""
    import offload_compiler
    from bench.gpu_check import check_finished, warm_up_until_checked

    from .test_step_check import ScratchMLP, scratch_batch

    batch = scratch_batch()

    def compiled_steps(**options):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = ScratchMLP(factor=2)
        opts = {"inner": "eager", "memory_budget": "50%", "min_offload_bytes": 0, **options}
        compiled = torch.compile(model, backend="trinity", options=opts)
        before = len(offload_compiler.reports())
        after_each = []

        def reports_now():
            return list(offload_compiler.reports()[before:])

        def one_step(i):
            compiled(*batch).backward()
            model.zero_grad(set_to_none=True)
            after_each.append(reports_now())
            return 0.0

        return one_step, reports_now, after_each

    one_step, reports_now, after_each = compiled_steps()
    seconds, settled = warm_up_until_checked(one_step, reports_now, 1, 10)
    assert settled == len(seconds) == 3
    (first,), (replanned,), (last,) = after_each
    assert first.correction is None and first.measured_peak_bytes > first.budget_bytes  # step 1: measured, over
    assert replanned.correction is not None and replanned.correction.replans == 1  # step 2: replanned, measured
    assert replanned.measured_peak_bytes is not None and replanned.measured_peak_bytes <= replanned.budget_bytes
    assert last is replanned  # step 3: nothing left to check
    now = reports_now()
    one_step(3)
    assert check_finished(now, reports_now())  # a later (timed) step changes no report either
    # A fixed warm-up of one or two steps would have timed the replan's recompile or its profiled step.
    assert not check_finished([], after_each[0]) and not check_finished(after_each[0], after_each[1])

    one_step, reports_now, after_each = compiled_steps(runtime_check="off")
    seconds, settled = warm_up_until_checked(one_step, reports_now, 1, 3)
    assert settled is None and len(seconds) == 3  # never measured: bounded
    assert all(r.measured_peak_bytes is None for (r,) in after_each)
    with pytest.raises(ValueError, match="min_steps=2, max_steps=1"):
        warm_up_until_checked(one_step, reports_now, 2, 1)


def test_frontier_judges_an_infeasible_point_against_its_planned_lowest_peak():
    from bench import frontier

    rows = [
        {
            "key": "trinity-auto-50%",
            "ok": True,
            "ratio": 1.05,
            "peak_bytes": 900,
            "budget_bytes": 1000,
            "within_budget": True,
        },  # fmt: skip
        {
            "key": "trinity-auto-25%",
            "ok": True,
            "ratio": 1.3,
            "peak_bytes": 700,
            "budget_bytes": 500,
            "infeasible": True,
            "planned_lowest_peak_bytes": 690,
            "within_planned_lowest_peak": 700 <= 690 + frontier.PEAK_SLACK_BYTES,
        },  # fmt: skip
    ]
    out = frontier.cpu_targets([{"model": "gpt", "rows": rows}])
    targets = {(c["key"], c["target"]): c["met"] for c in out["checks"]}
    assert targets == {
        ("trinity-auto-50%", "measured peak within budget"): True,
        ("trinity-auto-50%", "paired step ratio <= 1.1 at 50%"): True,
        ("trinity-auto-25%", "infeasible budget: measured peak within the planned lowest peak"): True,
    }
    assert out["all_met"]
    rows[1]["within_planned_lowest_peak"] = False
    assert not frontier.cpu_targets([{"model": "gpt", "rows": rows}])["all_met"]


def test_frontier_repeat_summary_lists_every_repeat_and_their_median():
    from bench import frontier

    def run(rep, ratio, load):
        rows = [{"key": "trinity-auto-50%", "ok": True, "ratio": ratio, "other_load": load},
                {"key": "trinity-offload-50%", "ok": False, "error": "boom"}]  # fmt: skip
        return {"model": "llama", "repeat": rep, "rows": rows}

    results = [run(0, 1.12, 0.01), run(1, 1.04, 0.0), run(2, 1.07, 0.2)]
    out = frontier.repeat_summary(results)
    assert out == {
        "llama": {
            "trinity-auto-50%": {"ratios": [1.12, 1.04, 1.07], "other_load": [0.01, 0.0, 0.2], "median_ratio": 1.07}
        }
    }
    checks = frontier.cpu_targets(results)["checks"]
    assert [(c["repeat"], c["met"], c["other_load"]) for c in checks] == [
        (0, False, 0.01),
        (1, True, 0.0),
        (2, True, 0.2),
    ]
    with pytest.raises(SystemExit):
        frontier.main(["--cpu", "--repeats", "3"])  # --repeats needs --only


def test_selective_recompute_points_compile_with_their_budget():
    """Each activation_memory_budget point compiles with its budget even after plain Inductor
    compiled another instance of the model class (the frontier's reference run): with
    backend="inductor" and the config patched around the calls, Dynamo reused the reference's
    compiled code and every point measured plain Inductor's peak."""
    import copy

    from bench import frontier

    torch._dynamo.reset()
    spec = get_model("gpt", "tiny")
    torch.manual_seed(0)
    base = spec.build()
    x, y = spec.make_batches(1, 0)[0]

    def saved_bytes(fn) -> int:
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(x, y)
        return total[0]

    plain = saved_bytes(torch.compile(copy.deepcopy(base), backend="inductor"))
    methods = {m["key"]: m for m in frontier.cpu_methods(spec)}
    sac = methods["sac-0"]["prepare"](copy.deepcopy(base))
    with sac.context():
        everything_recomputed = saved_bytes(sac.fn)
    assert 0 < everything_recomputed < plain / 2, (everything_recomputed, plain)
    torch._dynamo.reset()


def test_program_share_plans_the_same_trace_both_ways_and_restores_the_share():
    """bench.program_share plans one traced step with every buffer in the programs and with the
    default share: both feasible at 75% on a 2-layer GPT, the ratio is theirs, and the module's
    share is back to its default afterwards."""
    from bench import program_share
    from offload_compiler.models import GPT, GPTConfig
    from offload_compiler.passes import plan_recompute

    default = plan_recompute.PROGRAM_SMALL_SHARE
    model = {
        "name": "tiny",
        "build": lambda: GPT(GPTConfig(vocab_size=64, block_size=64, n_layer=2, n_head=2, n_embd=32)),
        "vocab": 64,
        "batch": 8,
        "seq": 64,
    }
    (row,) = program_share.compare(model, devices=("h100-sxm",), budgets=("75%",))
    assert plan_recompute.PROGRAM_SMALL_SHARE == default
    a, b = row["every_buffer_step_seconds"], row["default_share_step_seconds"]
    assert a is not None and b is not None and a > 0 and b > 0, row
    assert row["ratio"] == pytest.approx(b / a, rel=1e-12)
    assert (row["model"], row["device"], row["budget"]) == ("tiny", "h100-sxm", "75%")
