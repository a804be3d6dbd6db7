"""The adaptive PowerSGD hook: stable rank and rank rule, error feedback, and DDP on 2 processes."""

import datetime
import gc
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from offload_compiler.comm import AdaptivePowerSGDState, adaptive_powersgd_hook, choose_rank, rank_cap, stable_rank

ROOT = Path(__file__).resolve().parents[1]


def _low_rank(n, m, singular_values, seed=0):
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(n, len(singular_values), generator=g))
    v, _ = torch.linalg.qr(torch.randn(m, len(singular_values), generator=g))
    return u @ torch.diag(torch.tensor(singular_values)) @ v.T


def test_stable_rank_of_matrices_of_known_spectrum():
    g = torch.Generator().manual_seed(1)
    assert stable_rank(_low_rank(64, 48, [2.0, 2.0, 2.0]), 4, g) == pytest.approx(3.0, rel=1e-4)
    # ||G||_F^2 / ||G||_2^2 = (16 + 4 + 1) / 16 once the power iteration has converged.
    assert stable_rank(_low_rank(64, 48, [4.0, 2.0, 1.0]), 12, g) == pytest.approx(21 / 16, rel=1e-3)
    # Few iterations underestimate ||G||_2, so the estimate errs high, never low.
    assert stable_rank(_low_rank(64, 48, [4.0, 3.9, 1.0], seed=3), 1, g) >= (16 + 3.9**2 + 1) / 16 - 1e-6
    assert stable_rank(torch.zeros(5, 5)) == 0.0
    with pytest.raises(ValueError, match="2-D"):
        stable_rank(torch.zeros(5))


def test_rank_rule_caps_the_compressed_size_at_half():
    assert rank_cap(128, 512) == 51  # (128 + 512) * 51 * 2 <= 128 * 512
    assert (128 + 512) * rank_cap(128, 512) * 2 <= 128 * 512 < (128 + 512) * (rank_cap(128, 512) + 1) * 2
    assert choose_rank(3.2, 128, 512) == 4
    assert choose_rank(100.0, 128, 512) == 51
    assert choose_rank(3.2, 128, 512, rank_scale=2.0) == 7
    assert choose_rank(0.2, 128, 512, min_rank=2) == 2
    assert choose_rank(30.0, 128, 512, max_rank=8) == 8
    assert choose_rank(1.0, 2, 2) == 0  # no rank fits under half of 4 elements: send it whole


class _Bucket:
    """Duck-typed stand-in for DDP's GradBucket: index, flat buffer, parameters, is_last."""

    def __init__(self, index, params, last):
        self._index, self._params, self._last = index, params, last
        self._buf = torch.zeros(sum(p.numel() for p in params))

    def index(self):
        return self._index

    def buffer(self):
        return self._buf

    def parameters(self):
        return self._params

    def is_last(self):
        return self._last


@pytest.fixture
def single_group():
    """A one-rank gloo group, shut down and collected when the test ends. A gloo group still alive
    at interpreter exit aborts the process ("terminate called without an active exception": its
    worker threads drop tensors with Python references after finalization; pytorch/pytorch#179291).
    That abort ended a whole-suite CI run after every test had passed."""
    pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=60))
    yield pg
    pg.shutdown()
    del pg
    gc.collect()


def test_hook_picks_the_rank_of_synthetic_gradients_and_error_feedback_keeps_the_sum(single_group):
    # Two buckets per step (the second one last), each a 96x64 matrix and a bias.
    shapes = [((96, 64), (64,)), ((80, 72), (72,))]
    true_rank = [3, 5]
    buckets = [_Bucket(i, [torch.empty(*s) for s in sh], i == 1) for i, sh in enumerate(shapes)]
    state = AdaptivePowerSGDState(
        single_group, warmup_steps=2, reevaluate_every=100, rank_scale=1.0, min_rank=1, min_compress_numel=0
    )
    g = torch.Generator().manual_seed(0)
    sent = [torch.zeros(b.buffer().numel()) for b in buckets]
    given = [torch.zeros(b.buffer().numel()) for b in buckets]
    outputs = []
    for step in range(8):
        futs = []
        for b, sh, k in zip(buckets, shapes, true_rank):
            # Gradients of exact rank k with equal singular values (stable rank k), different each step.
            mat = _low_rank(*sh[0], [1.0] * k, seed=100 * step + b.index())
            if step >= 2:  # after the rank is chosen, full-rank noise: compression now drops something
                mat = mat + 0.05 * torch.randn(mat.shape, generator=g)
            grad = torch.cat([mat.flatten(), torch.randn(sh[1], generator=g)])
            b.buffer().copy_(grad)
            given[b.index()] += grad
            futs.append(adaptive_powersgd_hook(state, b))
        for b, f in zip(buckets, futs):
            out = f.wait()
            sent[b.index()] += out
            outputs.append((step, b.index(), out.clone()))
    assert state.ranks == {0: [3, 0], 1: [5, 0]}  # the stable rank of each matrix; biases uncompressed
    assert [round(x) for x in state.stable_ranks[0] if x == x] == [3]
    # Compressed outputs (noisy full-rank inputs) have exactly the chosen rank.
    for step, i, out in outputs:
        n, m = shapes[i][0]
        assert torch.linalg.matrix_rank(out[: n * m].view(n, m)).item() == true_rank[i], (step, i)
    assert state.error_dict[0].abs().max() > 1e-3  # something was left out, and is owed
    # Error feedback: what was sent plus what is still owed equals what was given.
    for i in range(2):
        owed = state.error_dict[i]
        assert torch.allclose(sent[i] + owed, given[i], atol=1e-4)
        n, m = shapes[i][0]
        assert torch.equal(owed[n * m :], torch.zeros(shapes[i][1]))  # biases travel exactly
    # Bytes: P and Q per matrix plus the bias, after the two full-rank warm-up steps.
    full = sum(b.buffer().numel() * 4 for b in buckets)
    assert state.full_bytes_per_step == [full] * 8
    compressed = sum(((n + m) * k + m) * 4 for ((n, m), _), k in zip(shapes, true_rank)) + 2 * 2 * 4
    assert state.bytes_per_step[:2] == [full, full]
    assert state.bytes_per_step[2] == compressed  # the first compressed step also agrees the ranks
    assert state.bytes_per_step[3:] == [compressed - 2 * 2 * 4] * 5


def test_state_rejects_bad_settings():
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 2"):
        AdaptivePowerSGDState(None, warmup_steps=1)
    with pytest.raises(ValueError, match="rank_scale must be > 0"):
        AdaptivePowerSGDState(None, rank_scale=0)
    with pytest.raises(ValueError, match="max_rank"):
        AdaptivePowerSGDState(None, min_rank=4, max_rank=2)


_WORKER = r"""
import gc, json, sys, torch, torch.distributed as dist, torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from offload_compiler.comm import AdaptivePowerSGDState, adaptive_powersgd_hook
from offload_compiler.demo import Batches, load_corpus
from offload_compiler.models import GPT, GPTConfig
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=32))
ddp = DDP(model, bucket_cap_mb=0.05)  # several buckets: the hook must keep the collective order
state = AdaptivePowerSGDState(None, warmup_steps=2, reevaluate_every=4, min_compress_numel=1024)
ddp.register_comm_hook(state, adaptive_powersgd_hook)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
data = Batches(load_corpus(1 << 20), 4, 32, seed=rank)
losses = []
for step in range(10):
    x, y = data.batch(step, torch.device("cpu"))
    loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
w = torch.cat([p.detach().flatten() for p in model.parameters()])
ws = [torch.empty_like(w) for _ in range(2)]
dist.all_gather(ws, w)
ranks = [None, None]
dist.all_gather_object(ranks, state.ranks)
if rank == 0:
    json.dump({"losses": losses, "identical": torch.equal(ws[0], ws[1]), "ranks": [list(r.items()) for r in ranks],
               "buckets": len(state.ranks), "bytes": state.bytes_per_step, "full": state.full_bytes_per_step},
              open(sys.argv[1], "w"))
# Drop DDP and the hook state (they hold the group and its work) before the group is destroyed:
# a gloo group alive at interpreter exit aborts the process (pytorch/pytorch#179291).
del ddp, state
gc.collect()
dist.destroy_process_group()
"""


def test_hook_under_ddp_on_two_gloo_processes_with_several_buckets(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), str(script), str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)  # a hang fails here
    if proc.returncode != 0 and "terminate called without an active exception" in proc.stderr + proc.stdout:
        # Seen twice in loaded whole-suite runs before the worker dropped DDP before destroying
        # its group (a gloo group alive at exit aborts, pytorch/pytorch#179291); kept as one
        # fresh retry, on a new port, in case another path leaves one. A second abort fails.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            cmd[cmd.index("--master-port") + 1] = str(s.getsockname()[1])
        out.unlink(missing_ok=True)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["buckets"] >= 3
    assert res["identical"]  # both replicas applied the same (compressed) gradients
    assert res["ranks"][0] == res["ranks"][1] and any(r for _, rs in res["ranks"][0] for r in rs)
    # Steps 0-1 warm up, steps 5 and 9 re-evaluate (full); the rest are compressed.
    full = res["full"][0]
    for step, b in enumerate(res["bytes"]):
        assert (b == full) if step in (0, 1, 5, 9) else (b < 0.5 * full), (step, b, full)
    assert res["losses"][-1] < res["losses"][0]
