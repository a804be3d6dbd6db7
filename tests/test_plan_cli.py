"""The plan command: fake tracing, planning over budgets, the table, the frontier and errors."""

import dataclasses
import resource

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from offload_compiler.devices import KNOWN_DEVICES
from offload_compiler.models.presets import PRESETS, get_preset
from offload_compiler.passes import cost_model, liveness, plan_window, reorder
from offload_compiler.plan_cli import main, plan_model
from offload_compiler.trace import trace_training_step

A100 = KNOWN_DEVICES["a100-80gb"]


def test_presets_have_the_published_parameter_counts():
    # Published sizes: GPT-2 124M/355M/774M/1.5B, Llama 2 7B 6.74B, Llama 3 8B 8.03B.
    expected = {
        "gpt2-small": 124.4e6,
        "gpt2-medium": 354.8e6,
        "gpt2-large": 774.0e6,
        "gpt2-xl": 1557.6e6,
        "llama-7b": 6738.4e6,
        "llama3-8b": 8030.3e6,
        "llama-13b": 13015.9e6,
        "llama-1b": 1235.8e6,
    }
    for name, count in expected.items():
        with torch.device("meta"):
            model = PRESETS[name].build(1024)
        assert sum(p.numel() for p in model.parameters()) == pytest.approx(count, rel=1e-3), name


def test_fake_trace_allocates_nothing_real():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    traced = trace_training_step(lambda: get_preset("gpt2-medium").build(1024), 8, 1024, 50257, torch.bfloat16)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert traced.num_params == pytest.approx(354.8e6, rel=1e-3)
    assert traced.param_bytes == 2 * traced.num_params
    # 355M bf16 parameters alone would be 710 MB if they were real.
    assert grown_mib < 400
    for node in traced.pair.forward.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            assert isinstance(val, FakeTensor), node.name


def test_plan_rows_respect_their_budgets():
    r = plan_model(
        "demo",
        A100,
        ["100%", "75%", "50%", "1KiB", "device"],
        batch=16,
        seq_len=128,
        dtype=torch.float32,
        optimizer="adamw",
        min_offload_bytes=0,
    )
    by = {row.budget: row for row in r.rows}
    state = 2 * r.param_bytes
    assert r.optimizer_state_bytes == state
    assert by["100%"].planned_peak_bytes == r.unplanned_peak_bytes and by["100%"].num_evicted == 0
    for name in ("75%", "50%"):
        row = by[name]
        assert row.feasible and row.planned_peak_bytes <= row.budget_bytes
        assert row.num_evicted > 0 and row.evicted_bytes > 0
        # The optimizer state is resident: no plan goes below parameters + state.
        assert row.planned_peak_bytes > state + r.param_bytes
    assert by["75%"].planned_peak_bytes >= by["50%"].planned_peak_bytes
    assert not by["1KiB"].feasible and by["1KiB"].lowest_reachable_bytes == by["50%"].lowest_reachable_bytes
    assert by["device"].budget_bytes == A100.memory_bytes and by["device"].fits_device
    best = r.within_5_percent()
    assert best is not None and best.predicted_step_seconds <= 1.05 * r.compute_seconds


@pytest.fixture(scope="module")
def demo_step():
    traced = trace_training_step(lambda: get_preset("demo").build(128), 16, 128, 256, torch.float32)
    pair = traced.pair
    reorder.hoist_frees(pair.forward)
    reorder.hoist_frees(pair.backward)
    return pair, liveness.analyze(pair, assume_fusion=True)


@pytest.mark.parametrize("device", ["a100-80gb", "h100-sxm", "l4", "cpu"])
@pytest.mark.parametrize("link_speedup", [1, 2, 2.5, 3, 4, 8])
def test_exposed_copy_small_whenever_copies_fit_under_compute(demo_step, device, link_speedup):
    """Target: on the demo model at 50%, the exposed copy time is under 5% of compute whenever
    the total copy time is under 80% of compute (faster links make that hold on GPU figures).

    One thing no plan can beat is added to the 5%: device-to-host copies run in the forward (the
    storage is freed there, before the peak), so D2H time beyond the forward's compute after the
    first copy starts is exposed whatever the plan does."""
    pair, live = demo_step
    base = KNOWN_DEVICES[device]
    spec = dataclasses.replace(
        base, h2d_bytes_per_s=base.h2d_bytes_per_s * link_speedup, d2h_bytes_per_s=base.d2h_bytes_per_s * link_speedup
    )
    costs = cost_model.estimate(pair, live, spec)
    plan = plan_window.plan(live, costs, int(0.5 * live.peak_bytes), 0)
    assert plan.feasible
    compute = costs.compute_seconds
    d2h = plan.copy_bytes / spec.d2h_bytes_per_s
    h2d = plan.copy_bytes / spec.h2d_bytes_per_s
    starts = [0.0]
    for s in costs.step_seconds:
        starts.append(starts[-1] + s)
    forward_end = starts[live.num_fw_steps - 1]
    first_issue = min(starts[g.issue_after + 1] for ev in plan.evictions for g in ev.groups)
    unavoidable = max(0.0, d2h - (forward_end - first_issue))
    if costs.synchronous_copies:
        # The CPU as the device: its copies are memcpys on the compute cores, exposed in full.
        assert plan.exposed_transfer_seconds == pytest.approx(d2h + h2d, rel=1e-9)
    elif d2h + h2d < 0.8 * compute:
        assert plan.exposed_transfer_seconds < 0.05 * compute + unavoidable
    assert plan.predicted_step_seconds >= max(compute, d2h, h2d)


def test_main_prints_table_and_writes_frontier(tmp_path, capsys):
    png = tmp_path / "frontier.png"
    status = main(
        [
            "--model",
            "demo",
            "--batch",
            "16",
            "--seq-len",
            "128",
            "--dtype",
            "float32",
            "--device",
            "l4",
            "--budgets",
            "100%,60%,10KiB",
            "--min-offload-bytes",
            "0",
            "--png",
            str(png),
        ]
    )
    out = capsys.readouterr().out
    assert status == 0
    assert "parameters" in out and "60%" in out and "infeasible" in out
    # The infeasible 10 KiB row's lowest-peak plan fits the L4 (it said "no" before).
    assert "lowest fits" in out
    # What sets the floor is said, as the backend's refusal says it (a fresh-user trial: llama-1b at
    # 1024 tokens printed only "infeasible: lowest 10.93 GiB" in every row).
    flat = " ".join(out.split())
    assert "rows marked infeasible are below the lowest peak any plan reaches" in flat, out
    assert "the optimizer state" in flat and "stays on the device beside it" in flat, out
    assert "smallest budget within 5% of the no-offload step" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "gpt5"], "unknown model 'gpt5'"),
        (["--budgets", "12XB"], "--budgets: '12XB' is not a size"),
        (["--budgets", "150%"], "got '150%'; a percentage must be in (0%, 100%]"),
        (["--dtype", "int8"], "--dtype 'int8'"),
        (["--optimizer", "lion"], "unknown optimizer 'lion'"),
        (["--device", "tpu-v5"], "unknown device 'tpu-v5'"),
        (["--model", "gpt2-small", "--seq-len", "4096"], "takes sequences up to 1024"),
        (["--device-memory", "lots"], "--device-memory"),
        (["--device-memory", "0"], "--device-memory '0': a device's memory must be more than 0 bytes"),
        (["--budgets", "50%,,75%"], "--budgets '50%,,75%': an empty entry"),
        (["--strategy", "recompute", "--offload", "all"], "--strategy recompute is not combined with --offload all"),
    ],
)
def test_bad_arguments_get_clear_errors(args, message, capsys):
    status = main(args + ["--png", ""])
    assert status == 2
    assert message in capsys.readouterr().out.replace("\n", "")


def test_transformers_causal_lm_from_a_config():
    pytest.importorskip("transformers")
    overrides = {
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
    }
    r = plan_model(
        "hf:llama",
        A100,
        ["100%", "60%"],
        batch=4,
        seq_len=128,
        dtype=torch.float32,
        optimizer="none",
        min_offload_bytes=0,
        hf_overrides=overrides,
    )
    # 2 layers of (q, o: 128x128; k, v: 128x64; gate, up, down: 128x256 each) + 2 norms per layer,
    # the final norm, embeddings and head (1000x128 each, untied).
    per_layer = 2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 256 + 2 * 128
    assert r.num_params == 2 * per_layer + 128 + 2 * 1000 * 128
    assert r.rows[1].feasible and r.rows[1].num_evicted > 0


def test_unknown_transformers_model_type():
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="no model type 'nosuchmodel'"):
        plan_model("hf:nosuchmodel", A100, ["100%"])


def test_offload_all_plans_count_the_host_update(capsys):
    """With offload='all' the predicted step includes the host optimizer update: the
    update seconds are the offloaded parameter bytes at the host model's seconds per byte (the
    one formula the backend uses), a slower host makes the step longer, and the CLI prints the
    update per step."""
    spec = KNOWN_DEVICES["rtx4090"]
    slow = dataclasses.replace(spec, host_bytes_per_s=1e9)
    runs = {
        name: plan_model("demo", s, ["device"], seq_len=256, offload="all", cpu_optimizer="fastest")
        for name, s in (("fast", spec), ("slow", slow))
    }
    for name, s in (("fast", spec), ("slow", slow)):
        r, row = runs[name], runs[name].rows[0]
        update = cost_model.host_update_model(s, "adamw", implementation="fused")
        assert row.update_seconds == pytest.approx(r.param_bytes * update.host_seconds_per_byte, rel=1e-9)
        assert row.predicted_step_seconds >= r.compute_seconds + row.exposed_update_seconds
        assert "(fused) on the host" in r.update
    assert runs["slow"].rows[0].predicted_step_seconds > runs["fast"].rows[0].predicted_step_seconds
    assert runs["slow"].rows[0].exposed_update_seconds > 0
    assert main(["--model", "demo", "--seq-len", "256", "--offload", "all", "--budgets", "device", "--png", ""]) == 0
    out = capsys.readouterr().out
    assert "host optimizer update: adamw (loop) on the host" in out and "host update" in out
    # Every offload="all" budget pays the host update, so "within 5%" is of the fastest planned
    # step of that mode, not of the no-offload step (which no row could ever be within).
    r = runs["slow"]
    assert r.reference_step_seconds() == min(x.predicted_step_seconds for x in r.rows if x.feasible)
    assert r.reference_step_seconds() > 1.05 * r.compute_seconds
    assert r.within_5_percent() is r.rows[0]
    assert "within 5% of the fastest planned step with --offload all" in " ".join(out.split())


def test_step_without_offloading_is_the_unplanned_pairs_whatever_the_first_budget():
    """``compute_seconds`` ("step without offloading") is the unrewritten pair's: a recompute plan
    listed first must not lend it its recomputation (it once printed 119.9 ms for llama-1b on an
    H100 with a 13 GiB budget first, 109.7 ms with 100% first)."""
    kw = dict(batch=16, seq_len=128, dtype=torch.float32, optimizer="adamw", min_offload_bytes=0)
    tight = plan_model("demo", A100, ["40%", "100%"], strategy="recompute", **kw)
    rows = {row.budget: row for row in tight.rows}
    assert rows["40%"].num_recomputed > 0 and rows["40%"].recompute_seconds > 0
    assert tight.compute_seconds == pytest.approx(rows["100%"].predicted_step_seconds, rel=1e-12)
    assert rows["40%"].predicted_step_seconds > tight.compute_seconds


@pytest.mark.parametrize(
    "args, message",
    [
        # A preset has no transformers config: --hf would be silently ignored.
        (["--model", "demo", "--hf", "n_layer=2"], "overrides apply to hf:<model_type> models only"),
        (["--model", "hf:gpt2", "--hf", "n_layer"], "expected KEY=VALUE"),
        (["--model", "hf:gpt2", "--hf", "n_layer=2", "--hf", "n_layer=3"], "'n_layer' is given twice"),
        # A misspelt field would otherwise be accepted and ignored by transformers.
        (["--model", "hf:gpt2", "--hf", "n_layers=2"], "has no field 'n_layers'; did you mean n_layer"),
        # The config's type check, as one line, not a traceback.
        (["--model", "hf:gpt2", "--hf", "n_layer=abc"], "Field 'n_layer' expected int"),
        # A short hint, not the ~800 model types transformers lists.
        (["--model", "hf:lama"], "no model type 'lama'; closest: llama"),
        # A value starting with "-" reaches the size parser instead of argparse's option lookup.
        (["--model", "demo", "--budgets", "-5GiB"], "--budgets: '-5GiB' is not a size"),
        # Found by a new-user trial: each ended in a traceback, or planned nonsense.
        (["--model", "hf:bert", "--hf", "num_hidden_layers=1"], "takes sequences up to 512 positions"),
        (["--model", "hf:vit"], "transformers has no causal LM for 'vit'"),
        (["--model", "hf:gpt2", "--hf", "n_layer=-1"], "n_layer is a count or size (default 12); it must be >= 0"),
        (["--model", "demo", "--json", "/nonexistent-dir/x.json"], "the folder '/nonexistent-dir' does not exist"),
    ],
)
def test_transformers_and_size_arguments_get_clear_errors(args, message, capsys):
    pytest.importorskip("transformers")
    assert main([*args, "--png", ""]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert message in out, out
    assert "Traceback" not in out
    assert len(out) < 600, out


def test_hf_override_values_are_typed():
    from offload_compiler.plan_cli import parse_hf_overrides

    got = parse_hf_overrides(["a=2", "b=-1", "c=1e-5", "d=true", "e=None", "f=silu"], "hf:llama")
    assert got == {"a": 2, "b": -1, "c": 1e-5, "d": True, "e": None, "f": "silu"}
    assert type(got["a"]) is int and type(got["c"]) is float


def test_inductor_trace_of_a_model_with_dropout():
    # Inductor's random-op joint pass needs the compile's fake mode (it failed with "'NullHandler'
    # object does not support the context manager protocol" on Hugging Face GPT-2, dropout 0.1).
    class Drop(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(64, 32)
            self.head = torch.nn.Linear(32, 64)

        def forward(self, idx):
            return self.head(torch.nn.functional.dropout(self.emb(idx), 0.1, training=True))

    traced = trace_training_step(Drop, 2, 16, 64, inner="inductor")
    targets = {str(n.target) for n in traced.pair.forward.graph.nodes if n.op == "call_function"}
    assert any("rand" in t or "seed" in t for t in targets), targets


@pytest.mark.parametrize("argv", [["--help"], ["--world", "2", "--help"]])
def test_help_states_each_default_once(capsys, argv):
    """``plan --help`` and ``plan --world N --help``: a flag whose help says its default gets no
    second "(default: ...)", and none says "(default: None)"."""
    import re

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "(default: None)" not in text and "(default: [])" not in text
    for block in re.split(r"\n(?=  -)", text):  # one flag's lines
        appended = re.search(r"\(default: [^()]*\)\s*$", block)  # what the formatter adds
        assert appended is None or "default" not in block[: appended.start()], block
    if "--world" not in argv:
        assert "--min-offload-bytes" in text and "(default: 1MiB)" in text


def test_no_png_is_written_unless_asked(tmp_path, monkeypatch, capsys):
    """``--png`` is opt-in: a plain run leaves no file in the working directory."""
    monkeypatch.chdir(tmp_path)
    assert main(["--model", "demo", "--seq-len", "64", "--budgets", "100%"]) == 0
    assert "frontier:" not in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_an_infeasible_rows_breakdown_and_optimizer_state_make_its_peak():
    """The breakdown the table's note prints (by buffer kind at the lowest-peak plan's peak) plus
    the optimizer state on the device is that row's planned peak: the note explains the floor."""
    result = plan_model("demo", KNOWN_DEVICES["l4"], ["10KiB"], batch=4, seq_len=64, dtype=torch.float32)
    (row,) = result.rows
    assert not row.feasible and row.peak_breakdown
    kinds = dict(row.peak_breakdown)
    assert kinds["parameter"] > 0 and kinds["gradient"] > 0, kinds
    assert sum(kinds.values()) + result.optimizer_state_bytes == row.planned_peak_bytes
