"""plan --world: the alpha-beta model, layout enumeration and scoring on hand-computed cases, the
whole search on a real (tiny) model, and the layout scripts it prints, run under torchrun."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload_compiler import world_plan as wp
from offload_compiler.collectives import LINKS, Cluster, Group, collective_seconds, load_link
from offload_compiler.devices import KNOWN_DEVICES

GiB = 2**30
H100 = KNOWN_DEVICES["h100-sxm"]
ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------
# The alpha-beta model


def test_ring_collectives_follow_the_alpha_beta_formulas():
    nv = LINKS["nvlink"]
    one_node = Cluster(8, 1, nv)
    g8 = Group(8, 8)
    n = 1e9
    # all-reduce: base + 2(p-1) steps + 2(p-1)/p n / B
    expect = nv.base_s + 14 * nv.alpha_s + 2 * 7 / 8 * n / nv.bytes_per_s
    assert collective_seconds("all_reduce", n, g8, one_node) == pytest.approx(expect, rel=1e-12)
    # all-gather and reduce-scatter: half the steps and half the bytes of an all-reduce
    ag = nv.base_s + 7 * nv.alpha_s + 7 / 8 * n / nv.bytes_per_s
    assert collective_seconds("all_gather", n, g8, one_node) == pytest.approx(ag, rel=1e-12)
    assert collective_seconds("reduce_scatter", n, g8, one_node) == pytest.approx(ag, rel=1e-12)
    assert collective_seconds("send_recv", n, Group(2, 2), one_node) == pytest.approx(
        nv.base_s + nv.alpha_s + n / nv.bytes_per_s
    )
    assert collective_seconds("all_reduce", n, Group(1, 1), one_node) == 0.0
    with pytest.raises(ValueError, match="unknown collective"):
        collective_seconds("broadcast", n, g8, one_node)


def test_a_node_network_is_shared_by_the_groups_that_cross_it():
    eth, nv = LINKS["eth-25g"], LINKS["nvlink"]
    two = Cluster(8, 2, nv, eth)
    # One 16-rank group: the node's single NIC carries its ring (2 inter-node steps of 30).
    flat = Group(16, 8)
    assert two.group_bandwidth(flat) == eth.bytes_per_s
    expect = nv.base_s + 28 * nv.alpha_s + 2 * eth.alpha_s + 2 * 15 / 16 * 1e9 / eth.bytes_per_s
    assert collective_seconds("all_reduce", 1e9, flat, two) == pytest.approx(expect, rel=1e-12)
    # Eight 2-rank groups (one rank per node each, as data parallel over tp=8): 1/8 of the NIC.
    assert two.group_bandwidth(Group(2, 1)) == pytest.approx(eth.bytes_per_s / 8)
    # InfiniBand here is one NIC per GPU: eight groups get one NIC each.
    ib = Cluster(8, 2, nv, LINKS["ib-200g"])
    assert ib.group_bandwidth(Group(2, 1)) == pytest.approx(LINKS["ib-200g"].bytes_per_s)
    # A group inside a node never touches the network.
    assert two.group_bandwidth(Group(8, 8)) == nv.bytes_per_s


# ------------------------------------------------------------------------------------------
# Enumeration


def test_enumeration_covers_the_engines_and_respects_the_degrees():
    lays = wp.enumerate_layouts(8, 8, 4, 8, lambda tp: tp in (1, 2, 4))
    assert all(lay.dp * lay.tp * lay.pp == 8 for lay in lays)
    assert {lay.tp for lay in lays} == {1, 2, 4}  # tp=8 refused by tp_ok
    assert max(lay.pp for lay in lays) == 4  # no more stages than blocks
    kinds = {(lay.dp, lay.tp, lay.pp, lay.dp_kind) for lay in lays if lay.pp == 1}
    assert {(8, 1, 1, k) for k in ("ddp", "ddp+powersgd", "fsdp", "fsdp-keep")} <= kinds
    assert (4, 2, 1, "fsdp") in kinds and (4, 2, 1, "ddp") not in kinds  # DDP has no DTensor support
    assert not any(lay.dp_kind == "hsdp" for lay in lays)  # one node: nothing to replicate across
    pipes = [lay for lay in lays if lay.pp > 1]
    assert pipes and all(lay.microbatches >= lay.pp and (8 // lay.dp) % lay.microbatches == 0 for lay in pipes)
    assert {lay.schedule for lay in pipes} == {"gpipe", "1f1b"}
    assert all(lay.dp_kind not in ("fsdp", "ddp+powersgd") for lay in pipes)
    one_f = next(lay for lay in pipes if lay.schedule == "1f1b" and lay.microbatches > lay.pp)
    gpipe = next(lay for lay in pipes if lay.schedule == "gpipe")
    assert one_f.inflight == one_f.pp and gpipe.inflight == gpipe.microbatches
    # Two nodes of four: HSDP shards inside a node (4) and replicates across (2).
    hsdp = [lay for lay in wp.enumerate_layouts(8, 4, 4, 8, lambda tp: True) if lay.dp_kind == "hsdp"]
    assert any(lay.dp == 8 and lay.replicate == 2 and lay.shard == 4 for lay in hsdp)
    # A batch no data-parallel degree divides leaves only model parallelism.
    assert all(lay.dp == 1 for lay in wp.enumerate_layouts(8, 8, 8, 1, lambda tp: True))


# ------------------------------------------------------------------------------------------
# Scoring, on hand-made stage profiles


def _profile(tp, batch, block_param, block_work, block_seconds, shapes=(), fixed_param=0, fixed_work=0):
    return wp.StageProfile(
        tp=tp,
        batch=batch,
        seq_len=1024,
        hidden=1024,
        elem_bytes=2,
        fixed_param_bytes=fixed_param,
        block_param_bytes=block_param,
        fixed_work_bytes=fixed_work,
        block_work_bytes=block_work,
        fixed_seconds=0.0,
        block_seconds=block_seconds,
        optimizer_factor=2.0,
        block_shapes=shapes,
        fixed_shapes=(),
    )


def test_scores_hand_computed_memory_does_not_fit_8way_fsdp_but_fits_with_tp2():
    # Two blocks of 30 GiB each (bf16, AdamW: state 2x the parameters); 80 GiB per GPU.
    p1 = _profile(1, 1, 30 * GiB, 1 * GiB, 0.1)
    p2 = _profile(2, 2, 15 * GiB, 1 * GiB, 0.1)  # a tp=2 rank: half of every block, batch 8 / dp 4
    cluster = Cluster(8, 1, LINKS["nvlink"])
    fsdp8 = wp.score_layout(wp.Layout(8, 1, 1, "fsdp"), p1, 2, 8, cluster, H100)
    # (params + grads + state) / 8 + two unsharded blocks + working memory
    assert fsdp8.engine_bytes == (60 + 60 + 120) * GiB // 8 + 2 * 30 * GiB
    assert fsdp8.peak_bytes == fsdp8.engine_bytes + 2 * GiB and not fsdp8.fits  # 92 GiB
    keep8 = wp.score_layout(wp.Layout(8, 1, 1, "fsdp-keep"), p1, 2, 8, cluster, H100)
    assert keep8.peak_bytes == 30 * GiB + 60 * GiB + 2 * GiB and not keep8.fits
    ddp8 = wp.score_layout(wp.Layout(8, 1, 1, "ddp"), p1, 2, 8, cluster, H100)
    assert ddp8.peak_bytes == 60 * GiB + 120 * GiB + 2 * GiB
    tp2 = wp.score_layout(wp.Layout(4, 2, 1, "fsdp"), p2, 2, 8, cluster, H100)
    assert tp2.engine_bytes == (30 + 30 + 60) * GiB // 4 + 2 * 15 * GiB
    assert tp2.peak_bytes == 62 * GiB and tp2.fits


def test_plan_world_picks_tp2_when_8way_fsdp_does_not_fit(monkeypatch):
    def fake_profile(base, tp, batch, seq_len, device, dtype, optimizer):
        return _profile(tp, batch, 30 * GiB // tp, batch * GiB // 2, 0.05 * batch / tp)

    monkeypatch.setattr(wp, "profile_stage", fake_profile)
    monkeypatch.setattr(wp, "_offload_rows", lambda *a, **k: {})
    monkeypatch.setattr(wp, "_base_preset", lambda name: _FakePreset(2))
    monkeypatch.setattr(wp, "tp_divisor_error", lambda fam, cfg, tp: None if tp in (1, 2) else "no")
    plan = wp.plan_world("fake", 8, batch=8, device=H100)
    by = {s.layout: s for s in plan.scores}
    assert not by[wp.Layout(8, 1, 1, "fsdp")].fits
    assert plan.best is not None and plan.best.layout.tp == 2 and plan.best.fits
    assert all(not s.fits for s in plan.scores if s.layout.tp == 1 and s.layout.pp == 1)
    assert plan.to_json()["best"]["layout"]["tp"] == 2


class _FakeCfg:
    n_head = 8
    n_embd = 1024


class _FakePreset:
    """Stands in for a preset in the hand-computed search (only its depth and config are read)."""

    family = "gpt"
    max_seq_len = None

    def __init__(self, n_layer):
        self.n_layer = n_layer

    def build(self, seq_len):
        m = torch.nn.Module()
        m.blocks = torch.nn.ModuleList(torch.nn.Identity() for _ in range(self.n_layer))
        m.cfg = _FakeCfg()
        return m


def test_a_slow_interconnect_makes_compression_pay(monkeypatch):
    # 4 blocks of one 4096x4096 bf16 matrix (32 MiB) and 10 ms of compute each, one GPU per node.
    shapes = ((4096, 4096),)

    def fake_profile(base, tp, batch, *a):
        return _profile(tp, batch, 4096 * 4096 * 2, 0, 0.010 * batch, shapes=shapes)

    monkeypatch.setattr(wp, "profile_stage", fake_profile)
    monkeypatch.setattr(wp, "_offload_rows", lambda *a, **k: {})
    monkeypatch.setattr(wp, "_base_preset", lambda name: _FakePreset(4))
    monkeypatch.setattr(wp, "tp_divisor_error", lambda fam, cfg, tp: None if tp == 1 else "no")
    slow = wp.plan_world("fake", 2, nodes=2, interconnect="eth-25g", batch=2, device=H100, compression_rank=4)
    fast = wp.plan_world("fake", 2, nodes=1, interconnect="nvlink", batch=2, device=H100, compression_rank=4)
    assert slow.compression["pays"] and slow.best.layout.dp_kind == "ddp+powersgd"
    assert not fast.compression["pays"] and fast.best.layout.dp_kind != "ddp+powersgd"
    # Hand-computed: each block's plain all-reduce over eth-25g (2 ranks, one NIC per node).
    eth = LINKS["eth-25g"]
    ar = LINKS["nvlink"].base_s + 2 * eth.alpha_s + (4096 * 4096 * 2) / eth.bytes_per_s
    assert ar > 0.010  # slower than a block's compute: DDP cannot hide it
    ddp = next(s for s in slow.scores if s.layout.dp_kind == "ddp")
    # The last block's all-reduce starts after the backward; the four queue on one channel.
    assert ddp.step_seconds == pytest.approx(4 * 0.010 / 3 + 2 * 0.010 / 3 + 4 * ar, rel=1e-6)
    comp = next(s for s in slow.scores if s.layout.dp_kind == "ddp+powersgd")
    assert comp.comm_bytes < 0.01 * ddp.comm_bytes
    assert wp.compressed_numel((4096, 4096), 4) == ((4096 + 4096) * 4, True)
    assert wp.compressed_numel((128, 128), 40) == (128 * 128, False)  # over the half-size cap
    assert wp.compressed_numel((512,), 4) == (512, False)


def test_bad_worlds_and_interconnects_are_refused_clearly(capsys):
    assert wp.main(["--world", "3", "--nodes", "2", "--model", "demo"]) == 2
    assert "does not split evenly" in capsys.readouterr().out
    assert wp.main(["--world", "2", "--interconnect", "ib-200g", "--model", "demo"]) == 2
    assert "joins nodes" in capsys.readouterr().out
    assert wp.main(["--world", "4", "--nodes", "2", "--interconnect", "pcie", "--model", "demo"]) == 2
    assert "network between nodes" in capsys.readouterr().out
    assert wp.main(["--world", "2", "--model", "hf:gpt2"]) == 2
    assert "presets" in capsys.readouterr().out


def test_an_infeasible_world_says_what_does_not_fit(monkeypatch, capsys):
    monkeypatch.setattr(wp, "profile_stage", lambda base, tp, batch, *a: _profile(tp, batch, 40 * GiB, GiB, 0.1))
    monkeypatch.setattr(wp, "_offload_rows", lambda *a, **k: {})
    monkeypatch.setattr(wp, "_base_preset", lambda name: _FakePreset(2))
    monkeypatch.setattr(wp, "tp_divisor_error", lambda fam, cfg, tp: None if tp == 1 else "no")
    assert wp.main(["--world", "2", "--model", "fake", "--batch", "2", "--png", ""]) == 1
    out = capsys.readouterr().out
    assert "no layout of 2 x NVIDIA H100 SXM" in out and "parameters, gradients and optimizer state" in out


# ------------------------------------------------------------------------------------------
# The real planning function on the demo model, and the scripts under torchrun


@pytest.fixture(scope="module")
def demo_plan():
    return wp.plan_world(
        "demo", 2, device=KNOWN_DEVICES["cpu"], batch=4, seq_len=64, dtype=torch.float32, optimizer="adamw"
    )


def test_stage_profiles_match_plan_model_on_the_whole_stage(demo_plan):
    from offload_compiler.models.presets import get_preset
    from offload_compiler.plan_cli import plan_model

    prof = demo_plan.profiles[(1, 2)]
    whole = plan_model(get_preset("demo"), KNOWN_DEVICES["cpu"], ["100%"], 2, 64, torch.float32, "adamw")
    assert prof.param_bytes(4) == whole.param_bytes
    assert prof.work_bytes(4) == whole.unplanned_peak_bytes - whole.param_bytes - whole.optimizer_state_bytes
    assert prof.seconds(4) == pytest.approx(whole.compute_seconds, rel=1e-9)
    # A tp=2 rank holds half of each block's parallel linears and all of the rest.
    tp2 = demo_plan.profiles[(2, 4)]
    assert tp2.fixed_param_bytes == prof.fixed_param_bytes
    # qkv, proj, fc, out weights halve, and the column-parallel biases (qkv 384, fc 512).
    halved = (384 * 128 + 128 * 128 + 512 * 128 + 128 * 512 + 384 + 512) // 2
    assert prof.block_param_bytes - tp2.block_param_bytes == halved * 4


def test_demo_plan_ranks_the_layouts(demo_plan, tmp_path):
    assert demo_plan.best is not None and demo_plan.best.fits
    labels = {s.layout.dp_kind for s in demo_plan.scores}
    assert {"ddp", "fsdp", "fsdp-keep", "ddp+powersgd", "none"} <= labels
    steps = [s.step_seconds for s in demo_plan.scores if s.fits]
    assert steps == sorted(steps) and demo_plan.best.step_seconds == steps[0]
    png = wp.frontier_png(demo_plan, tmp_path / "f.png")
    assert png.stat().st_size > 10_000
    data = json.loads(json.dumps(demo_plan.to_json()))
    assert data["layouts"][0]["label"] == demo_plan.best.label() and "message" in data["compression"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(script: Path, out: Path, steps: int, timeout: int = 150) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(script), "--steps", str(steps), "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _single_process_losses(batches_per_rank):
    """The loss of the unsharded demo model (seed 0) on each rank's first batch."""
    import torch.nn.functional as F

    from offload_compiler.demo import Batches, load_corpus
    from offload_compiler.models.presets import get_preset

    torch.manual_seed(0)
    model = get_preset("demo").build(64)
    corpus = load_corpus()
    out = []
    for seed, batch in batches_per_rank:
        x, y = Batches(corpus, batch, 64, seed=seed).batch(0, torch.device("cpu"))
        out.append(F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).item())
    return out


# The chosen layout (DDP or FSDP2 here) and tensor parallel (its qkv interleaving); FSDP2 both
# ways and the pipeline schedules run in bench/world_check.py (each torchrun costs ~20-50 s here).
@pytest.mark.parametrize("which", ["chosen", "tp"])
def test_printed_layout_scripts_run_under_torchrun_and_train(demo_plan, tmp_path, which):
    if which == "chosen":
        score = demo_plan.best
    else:
        score = next(s for s in demo_plan.scores if s.layout.tp == 2)
    script = tmp_path / "layout.py"
    script.write_text(wp.layout_script(demo_plan, score))
    compile(script.read_text(), str(script), "exec")
    res = _torchrun(script, tmp_path / "out.json", steps=6)
    losses = res["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses  # it trains
    lay = score.layout
    # Step 0 is the unsharded model's loss on the same batches: the layout computes the same thing.
    per_rank = [(r, 4 // lay.dp) for r in range(lay.dp)]
    expect = sum(_single_process_losses(per_rank)) / lay.dp
    assert losses[0] == pytest.approx(expect, rel=1e-4)


def test_load_link_reads_a_collectives_calibration(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"link": {"name": "loop", "alpha_s": 1e-4, "bytes_per_s": 1e9}}))
    link = load_link(path)
    assert link.alpha_s == 1e-4 and link.bytes_per_s == 1e9 and "calibrate" in link.source
    cluster = wp._cluster(2, 1, str(path), "nvlink")
    assert cluster.intra == link
    path.write_text(json.dumps({"link": {"alpha_s": 1e-4, "bytes_per_s": -1}}))
    with pytest.raises(ValueError, match="bytes_per_s must be > 0"):
        load_link(path)
    path.write_text("{}")
    with pytest.raises(ValueError, match="no 'link'"):
        load_link(path)


def test_stage_preset_refuses_what_cannot_split():
    from offload_compiler.models.presets import get_preset

    with pytest.raises(ValueError, match="do not divide by tp=3"):
        wp.stage_preset(get_preset("demo"), 2, 3)
    with pytest.raises(ValueError, match="the model has 4"):
        wp.stage_preset(get_preset("demo"), 5, 1)


def test_compression_verdict_pairs_ddp_layouts_that_fit_at_different_offload_budgets():
    # The hook's buffers raise the peak, so plain DDP and DDP + PowerSGD of the same degrees may fit
    # only at different offload plans; the verdict must still compare them (it once said "no DDP
    # layout fits" next to a table of fitting DDP layouts).
    from types import SimpleNamespace

    def score(kind, budget, seconds, comm, fits=True):
        return SimpleNamespace(
            layout=wp.Layout(dp=2, tp=1, pp=1, dp_kind=kind),
            fits=fits,
            step_seconds=seconds,
            comm_bytes=comm,
            offload_budget_bytes=budget,
        )

    scores = [
        score("ddp", None, 0.50, 1000),
        score("ddp", 2**30, 0.40, 1000),  # the fastest plain DDP
        score("ddp+powersgd", 2**29, 0.45, 100),
        score("ddp+powersgd", None, 0.30, 100, fits=False),  # does not fit: ignored
        score("fsdp", None, 0.20, 800),
    ]
    out = wp._compression_verdict(scores, scores[-1], rank=4)
    assert not out["applies"] and not out["pays"]
    assert out["step_plain_seconds"] == 0.40 and out["step_compressed_seconds"] == 0.45
    assert "no DDP layout fits" not in out["message"] and "does not pay" in out["message"]
    out = wp._compression_verdict(scores, scores[1], rank=4)
    assert out["applies"] and not out["pays"] and out["comm_bytes_compressed"] == 100
    scores[2].step_seconds = 0.35
    out = wp._compression_verdict(scores, scores[2], rank=4)
    assert out["applies"] and out["pays"] and "compression pays" in out["message"]
