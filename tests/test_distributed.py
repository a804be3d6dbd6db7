"""Trinity under DDP and FSDP2, with real processes: ``torchrun --nproc-per-node 2``, gloo on
the CPU, loopback only. One launch runs every case of ``tests/distributed_cases.py`` (which
checks losses and final parameters against the same run without trinity, 1e-6 relative, the
ranks identical, and the step's measured peak against the step's budget, on every rank); each
test here reads its case's result. A hang fails: the launch is killed after
``TRINITY_DIST_TIMEOUT`` seconds (default 300: the launch takes about 80 s here, and the cases are to stay under 4 minutes together), and every collective times out after 60 s."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

ROOT = Path(__file__).resolve().parent.parent
CASES = [
    "ddp_split",
    "ddp_split_bytes",
    "ddp_no_sync",
    "ddp_powersgd",
    "ddp_params",
    "ddp_all",
    "ddp_all_no_sync",
    "ddp_all_mixed_uncompiled",
    "ddp_all_default_buckets",
    "ddp_all_sharded",
    "ddp_all_hook_refused",
    "fsdp_blocks",
    "fsdp_cpu_offload",
    "fsdp_all_refused",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "results.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TORCHINDUCTOR_FX_GRAPH_CACHE="0")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        str(ROOT / "tests" / "distributed_cases.py"), "--out", str(out), *CASES,
    ]  # fmt: skip
    timeout = float(os.environ.get("TRINITY_DIST_TIMEOUT", "300"))
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the distributed cases did not finish in {timeout:.0f} s (a hang?):\n{(exc.stderr or '')[-4000:]}")
    assert proc.returncode == 0 and out.exists(), f"torchrun failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def ok(results, name):
    r = results[name]
    assert r["ok"], f"case {name} failed:\n{r.get('error')}"
    return r


PEAK_SLACK_BYTES = 64 * 1024  # as in distributed_cases.py


def within_step_budget(r):
    """The step's budget covers DDP's splits: one ledger of ``splits`` pairs, the predicted
    step peak within the budget and the measured one too."""
    assert r["num_pairs"] == r["splits"] and r["within_budget"], r["step_summary"]
    assert r["predicted_peak_bytes"] <= r["budget_bytes"]
    assert r["measured_peak_bytes"] <= r["budget_bytes"] + PEAK_SLACK_BYTES, r["step_summary"]


def test_ddp_with_split_graphs_matches_ddp(results):
    r = ok(results, "ddp_split")
    assert r["splits"] >= 4
    assert r["loss_rel_err"] <= 1e-6 and r["param_rel_err"] <= 1e-6 and r["rank_max_diff"] == 0
    # "60%" is of the whole step's unplanned peak (4 splits), not of each split's.
    assert r["budget_bytes"] == int(0.6 * r["unplanned_peak_bytes"])
    within_step_budget(r)
    assert r["ddp_hook_buckets"] is None  # DDP reduces itself: trinity registers no hook


def test_ddp_split_graphs_share_an_absolute_step_budget(results):
    r = ok(results, "ddp_split_bytes")
    assert r["splits"] >= 4 and r["budget_bytes"] == 5_000_000
    # Planned one split at a time against 5 MB each, the step would not fit.
    assert r["unplanned_peak_bytes"] > r["budget_bytes"]
    assert r["param_rel_err"] <= 1e-6 and r["rank_max_diff"] == 0
    within_step_budget(r)


def test_ddp_no_sync_accumulation(results):
    r = ok(results, "ddp_no_sync")
    assert r["splits"] >= 4 and r["param_rel_err"] <= 1e-6
    within_step_budget(r)
    # The second micro-step holds the first one's gradients: each split is planned again with its
    # own (the step ran 58,886 bytes above the budget before they were counted).
    assert r["measured_peak_bytes"] <= r["budget_bytes"] + 16 * 1024, r["step_summary"]


def test_ddp_powersgd_hook(results):
    r = ok(results, "ddp_powersgd")
    assert r["param_rel_err"] <= 1e-6


def test_ddp_activations_and_params(results):
    r = ok(results, "ddp_params")
    assert r["splits"] >= 4 and r["param_rel_err"] <= 1e-6
    within_step_budget(r)


BUCKET_CAP_BYTES = int(0.055 * 2**20)  # distributed_cases.BUCKET_CAP_MB


def test_ddp_offload_all_averages_gradients_like_ddp(results):
    r = ok(results, "ddp_all")
    assert r["splits"] >= 4
    # The gradients are all-reduced by trinity in DDP's buckets: one collective per bucket and
    # synced backward, as planned. DDP's small cap (57,671 bytes, every split's first bucket as
    # large) gives several buckets over the 4 splits, far fewer than the parameters.
    n = r["planned_buckets"]
    assert r["all_reduces_per_step"] == [n] * 3
    assert r["splits"] <= n < r["params_needing_grad"] // 2, (n, r["params_needing_grad"])
    assert all(caps == [BUCKET_CAP_BYTES] for caps in r["bucket_caps"]), r["bucket_caps"]
    assert all(0 < b <= BUCKET_CAP_BYTES for b in r["bucket_bytes"]) and len(r["bucket_bytes"]) == n
    assert all(s > 0 for s in r["allreduce_seconds"]) and len(r["allreduce_seconds"]) == r["splits"]
    assert r["loss_rel_err"] <= 1e-6 and r["param_rel_err"] <= 1e-6 and r["rank_max_diff"] == 0
    within_step_budget(r)
    ddp_reducer_stays_idle(r, synced_backwards=3)


def ddp_reducer_stays_idle(r, synced_backwards):
    """One synced backward per step here (``ddp_buckets``: DDP's buckets in each step's)."""
    # DDP's own reducer fires for every bucket of every synced backward; trinity's comm hook
    # returns each without communicating (every gradient in it was reduced by trinity), so no
    # bucket is all-reduced twice (all_reduces_per_step counts the hook's collectives too).
    idle, reduced = r["ddp_hook_buckets"]
    assert len(r["ddp_buckets"]) == synced_backwards
    assert reduced == 0 and idle == sum(r["ddp_buckets"]), (r["ddp_hook_buckets"], r["ddp_buckets"])


def test_ddp_offload_all_with_default_buckets_reduces_once_per_step(results):
    r = ok(results, "ddp_all_default_buckets")
    # DDP's default: 25 MiB buckets after a first bucket of 1 MiB; the tiny model (one graph,
    # about 220 kB of gradients) fits the first bucket: one all-reduce per step.
    assert r["splits"] == 1 and r["bucket_caps"] == [[2**20, 25 * 2**20]]
    assert r["planned_buckets"] == 1 and r["all_reduces_per_step"] == [1] * 3
    assert r["loss_rel_err"] <= 1e-6 and r["param_rel_err"] <= 1e-6 and r["rank_max_diff"] == 0
    ddp_reducer_stays_idle(r, synced_backwards=3)


def test_ddp_offload_all_with_a_sharded_cpu_optimizer(results):
    r = ok(results, "ddp_all_sharded")
    # Each rank holds the optimizer state of its own share only, and the shares cover every
    # parameter once; the exchanged masters give the unsharded bits on both ranks.
    per_rank = r["optimizer_state_params_per_rank"]
    assert len(per_rank) == 2 and all(0 < n < r["params_needing_grad"] for n in per_rank)
    assert sum(per_rank) == r["params_needing_grad"], per_rank
    assert r["loss_rel_err"] <= 1e-6 and r["param_rel_err"] <= 1e-6 and r["rank_max_diff"] == 0
    assert "sharded: rank" in r["shard"]
    assert r["param_digest"] == ok(results, "ddp_all")["param_digest"]  # the unsharded optimizer's bits
    within_step_budget(r)
    ddp_reducer_stays_idle(r, synced_backwards=3)


def test_ddp_offload_all_respects_no_sync(results):
    r = ok(results, "ddp_all_no_sync")
    # Two micro-steps per step, the first under no_sync: one all-reduce per bucket, not two.
    n = r["planned_buckets"]
    assert r["all_reduces_per_step"] == [n] * 3 and r["splits"] <= n < r["params_needing_grad"] // 2
    assert r["param_rel_err"] <= 1e-6 and r["rank_max_diff"] == 0
    ddp_reducer_stays_idle(r, synced_backwards=3)  # the no_sync micro-steps fire no DDP hook


def test_ddp_offload_all_mixes_compiled_and_uncompiled_micro_steps(results):
    r = ok(results, "ddp_all_mixed_uncompiled")
    # The uncompiled synced backwards (steps 0 and 1) are averaged by trinity's hook as DDP
    # would, with the host gradients of the earlier micro-steps in them.
    assert r["param_rel_err"] <= 1e-6 and r["rank_max_diff"] == 0, r
    assert r["ddp_hook_buckets"][1] > 0, r


def test_ddp_comm_hook_with_offload_all_is_refused(results):
    r = ok(results, "ddp_all_hook_refused")
    assert r["error_type"] == "UnsupportedCombinationError"
    assert "offload='all'" in r["message"] and "allreduce_hook" in r["message"]


def test_fsdp2_per_block_compile_matches_fsdp2(results):
    r = ok(results, "fsdp_blocks")
    assert r["loss_rel_err"] <= 1e-6 and r["param_rel_err"] <= 1e-6 and r["rank_max_diff"] == 0
    # The first block compiles its own graph (its input needs no gradient); the other three run
    # one block graph, whose 3 runs per step its compile predicted from the module structure (the
    # 4 FSDP2 blocks compiled alike, from the second on) and the first step's check confirmed:
    # planned for them from the first step on, not planned again.
    assert r["runs"] == [1, 3], r["step_summary"]
    assert [x["reuse_measured"] for x in r["reports"]] == [1, 3]
    first, block = r["reports"]
    assert first["reuse_predicted"] is None
    assert "4 FSDPBlock modules" in block["reuse_predicted"] and "the last 3 run this graph" in block["reuse_predicted"]
    assert not block["replanned"]
    # "50%" is of the whole step's unplanned peak (the block graph's 3 runs and the first block's
    # beside them), and the step's measured peak is within it.
    assert r["budget_bytes"] == max(x["budget_bytes"] for x in r["reports"])
    assert r["within_budget"] and r["predicted_peak_bytes"] <= r["budget_bytes"], r["step_summary"]
    assert r["measured_peak_bytes"] <= r["budget_bytes"] + PEAK_SLACK_BYTES, r["step_summary"]


def test_fsdp2_cpu_offload_policy_with_activation_offload(results):
    r = ok(results, "fsdp_cpu_offload")
    assert r["param_rel_err"] <= 1e-6


def test_fsdp2_with_offload_all_is_refused(results):
    r = ok(results, "fsdp_all_refused")
    assert r["error_type"] == "UnsupportedCombinationError"
    assert "FSDP2" in r["message"] and "CPUOffloadPolicy" in r["message"]
