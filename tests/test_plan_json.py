"""``plan --json FILE`` and the 30B/70B presets."""

import json
import math

import pytest
import torch

from offload_compiler.models.presets import PRESETS
from offload_compiler.plan_cli import main

ROW_KEYS = {
    "budget",
    "budget_bytes",
    "planned_peak_bytes",
    "lowest_reachable_bytes",
    "predicted_step_seconds",
    "exposed_copy_seconds",
    "host_bytes",
    "fits",
}


def test_json_rows(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["--model", "demo", "--batch", "2", "--seq-len", "64", "--dtype", "float32", "--optimizer", "adamw",
            "--device", "rtx4090", "--offload", "all", "--budgets", "100%,40%,1KiB", "--min-offload-bytes", "0",
            "--png", "", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert f"rows: {out}" in capsys.readouterr().out.replace("\n", "")
    data = json.loads(out.read_text())
    assert data["model"] == "demo" and data["offload"] == "all" and data["inner"] == "eager"
    assert data["device"] == "NVIDIA GeForce RTX 4090" and data["command"].endswith("--json " + str(out))
    assert data["torch"] == torch.__version__
    rows = {r["budget"]: r for r in data["rows"]}
    assert list(rows) == ["100%", "40%", "1KiB"]
    for r in rows.values():
        assert ROW_KEYS <= r.keys()
        assert r["lowest_reachable_bytes"] <= r["planned_peak_bytes"]
        # Master copies, host gradients and AdamW's two moments: four times the parameters.
        assert r["host_bytes"] == data["host_model_state_bytes"] == 4 * data["param_bytes"]
    full, forty, tiny = rows["100%"], rows["40%"], rows["1KiB"]
    assert full["budget_bytes"] == data["unplanned_peak_bytes"]
    assert forty["budget_bytes"] == int(0.4 * data["unplanned_peak_bytes"])
    for r in (full, forty):
        assert r["fits"] and r["planned_peak_bytes"] <= r["budget_bytes"]
        assert r["predicted_step_seconds"] >= data["compute_seconds"] > 0 and r["exposed_copy_seconds"] >= 0
        assert math.isfinite(r["predicted_step_seconds"])
    assert not tiny["fits"] and not tiny["feasible"] and tiny["predicted_step_seconds"] is None
    assert tiny["lowest_reachable_bytes"] > tiny["budget_bytes"] == 1024


@pytest.mark.parametrize("name, count", [("llama-30b", 32.529e9), ("llama-70b", 68.977e9)])
def test_large_presets_have_the_published_parameter_counts(name, count):
    with torch.device("meta"):
        model = PRESETS[name].build(4096)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(count, rel=1e-3)
    if name == "llama-70b":  # grouped-query attention: 8 key/value heads of 128
        attn = model.blocks[0].attn
        assert attn.n_head == 64 and attn.n_kv_head == 8 and attn.k.weight.shape == (1024, 8192)
