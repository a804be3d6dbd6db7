"""``CPUOptimizer(shard_group=...)``: ZeRO-Offload's partitioned CPU optimizer, in real processes
(two ranks, gloo over a file store, no network). Each rank updates its share of the parameters
and holds only their state; after the exchange both ranks hold the bits of the torch optimizer run
unsharded on the same tensors."""

import json
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from offload_compiler import CPUOptimizer
from offload_compiler.runtime.cpu_optim import shard_owners

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_cpu_optim import give, offload, params, set_grads, value  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

SHAPES = [(37, 29), (1000,), (5,), (3, 7, 11), (64, 48), (48,)]
MATRICES = [(37, 29), (16, 24), (64, 48), (12, 12)]
CASES = {
    "AdamW": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), {}, SHAPES),
    "AdamW-fastest": (torch.optim.AdamW, dict(lr=1e-2), {"implementation": "fastest"}, SHAPES),
    "SGD-pieces": (torch.optim.SGD, dict(lr=0.1, momentum=0.9), {"piece_bytes": 1024}, SHAPES),
    "Muon": (torch.optim.Muon, dict(lr=0.02), {}, MATRICES),
}


@pytest.mark.parametrize(
    "nbytes, world, owners",
    [
        ([4, 4, 4, 4], 2, [0, 0, 1, 1]),
        ([100, 1, 1, 1], 2, [0, 1, 1, 1]),  # the middle byte of the first is in rank 0's half
        ([1, 1, 100], 2, [0, 0, 1]),
        ([10, 10, 10], 4, [0, 2, 3]),  # middles 5, 15, 25 of 30 bytes: rank 1 owns nothing
        ([5], 3, [1]),
        ([0, 0], 2, [0, 0]),
        ([7, 7, 7], 1, [0, 0, 0]),
    ],
)
def test_shard_owners_are_contiguous_and_balanced_by_bytes(nbytes, world, owners):
    assert shard_owners(nbytes, world) == owners


def test_shard_owners_refuses_bad_input():
    with pytest.raises(ValueError, match="world must be >= 1, got 0"):
        shard_owners([1], 0)
    with pytest.raises(ValueError, match="sizes must be >= 0 bytes"):
        shard_owners([1, -1], 2)


def test_shard_group_needs_a_process_group():
    with pytest.raises(ValueError, match="shard_group needs an initialized torch.distributed process group"):
        CPUOptimizer(params(), shard_group=object())


def _worker(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = {}
    try:
        try:
            CPUOptimizer(params(), shard_group=dist.group.WORLD)
        except ValueError as exc:
            results["default_group_refused"] = str(exc)
        group = dist.new_group(backend="gloo")
        for name, (cls, kwargs, extra, shapes) in CASES.items():
            ref, ps = params(shapes=shapes), params(shapes=shapes)
            offload(ps)
            opt_ref = cls(ref, **kwargs)
            opt = CPUOptimizer(ps, cls, **kwargs, **extra, shard_group=group)
            if extra.get("implementation") == "fastest":
                opt_ref = cls(ref, **kwargs, fused=True)
            norms = []
            for step in range(4):
                grads = set_grads(ref, step)
                for p, g in zip(ref, grads):
                    p.grad = g.clone()
                give(ps, grads)
                if name == "AdamW":  # clipping by total norm sees every gradient on every rank
                    norms.append((torch.nn.utils.clip_grad_norm_(ref, 1.0).item(), opt.clip_grad_norm_(1.0).item()))
                opt_ref.step()
                opt.step()
                opt.synchronize()
            results[name] = {
                "bit_equal": all(torch.equal(value(p), r.detach()) for p, r in zip(ps, ref)),
                "state": sorted(opt.state_dict()["state"]),
                "shard": opt.shard,
                "norms_equal": all(a == b for a, b in norms),
                "exchange_seconds": opt.exchange_seconds,
            }
    finally:
        dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)


def test_two_ranks_each_update_their_share_with_the_unsharded_bits(tmp_path):
    out = str(tmp_path / "out")
    mp.start_processes(_worker, args=(2, str(tmp_path / "store"), out), nprocs=2, join=True, start_method="spawn")
    r0, r1 = (json.loads(open(f"{out}.{r}").read()) for r in (0, 1))
    assert "must be a group of its own" in r0["default_group_refused"]
    for name, (_, _, _, shapes) in CASES.items():
        for r in (r0, r1):
            assert r[name]["bit_equal"], (name, r[name])
        # The state is partitioned: every parameter's state on exactly one rank, contiguous runs.
        owners = shard_owners([torch.Size(s).numel() * 4 for s in shapes], 2)
        assert r0[name]["state"] == [i for i, o in enumerate(owners) if o == 0], name
        assert r1[name]["state"] == [i for i, o in enumerate(owners) if o == 1], name
        assert r0[name]["state"] and r1[name]["state"]
        assert r0[name]["shard"].startswith("sharded: rank 0 of 2 updates")
        assert r0[name]["exchange_seconds"] > 0 and r1[name]["exchange_seconds"] > 0
    assert r0["AdamW"]["norms_equal"] and r1["AdamW"]["norms_equal"]
