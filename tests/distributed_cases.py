"""Data-parallel cases run by ``torchrun --nproc-per-node 2`` (gloo on the CPU, 127.0.0.1).

``tests/test_distributed.py`` launches this script once with the cases to run and reads the JSON
that rank 0 writes (``--out``); each case is also checked here, on every rank, so a wrong
result fails even if the JSON were not read:

* losses and final parameters equal to the same run without trinity (1e-6 relative), and the
  final parameters identical on both ranks;
* the training step's measured peak (``measure_peak_device_bytes``: the CPU allocator's trace,
  what was resident before the step declared) within the step's budget wherever the step's
  ledger (``offload_compiler.step_report``) predicts the plan is.

The memory budget is the step's (``offload_compiler.step_budget``): under DDP the splits share it;
under FSDP2 the block graph that the blocks run (``F1 .. F4 B4 .. B1``) is planned, after the
first step's check counted its runs, for all of them at once, beside the first block's own graph
(its input needs no gradient, so Dynamo compiles it apart). The cases plan with
``on_infeasible="warn"`` (a step the ledger cannot fit runs its lowest-peak plans, and its measured
peak is checked against the step peak the ledger predicts for them), except ``ddp_split_bytes``,
which must fit.

A case that raises is reported with its traceback and the others still run. Models are tiny:
the whole set runs in CI time on two cores.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import hashlib
import json
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import offload_compiler
from offload_compiler import CPUOptimizer, materialized, measure_peak_device_bytes
from offload_compiler.models import GPT, GPTConfig
from offload_compiler.models.gpt import Block

# Allocator granularity and bookkeeping outside the graphs (the loss scalar, autograd's small
# buffers): as in tests/test_e2e.py.
PEAK_SLACK_BYTES = 64 * 1024
RTOL = 1e-6
STEPS = 3
# DDP's first bucket (and DDP's graph splitter's) is 1 MiB by default; the tiny model gets 4
# splits with buckets of this size (the splitter asserts first bucket <= bucket cap).
BUCKET_CAP_MB = 0.055

# torch's own first-bucket size, restored for the case that runs with DDP's default bucket cap.
TORCH_FIRST_BUCKET_BYTES = dist._DEFAULT_FIRST_BUCKET_BYTES

# Between the lowest step peak the ledger reaches for the tiny GPT under DDP and its unplanned peak.
STEP_BUDGET_BYTES = 5_000_000

GPT_CFG = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=2, n_embd=32, tie_weights=False)


class GPTLoss(nn.Module):
    def __init__(self, cfg=GPT_CFG):
        super().__init__()
        self.gpt = GPT(cfg)

    def forward(self, idx, targets):
        return F.cross_entropy(self.gpt(idx).flatten(0, 1), targets.flatten())


def batch(step: int, rank: int, b: int = 16, cfg=GPT_CFG):
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, cfg.vocab_size, (b, cfg.block_size), generator=g)
    return idx, torch.randint(0, cfg.vocab_size, (b, cfg.block_size), generator=g)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def check_ranks_identical(params) -> float:
    """Largest difference between the ranks' parameters (all-gathered flat copies)."""
    flat = torch.cat([full(p).detach().reshape(-1) for p in params])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return max((g - gathered[0]).abs().max().item() for g in gathered)


def finish(result: dict, model_params, ref_params, losses, ref_losses, measured, report) -> dict:
    loss_err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    param_err = max(rel(full(a).detach(), full(b).detach()) for a, b in zip(model_params, ref_params))
    rank_diff = check_ranks_identical(model_params)
    result.update(
        loss_rel_err=loss_err,
        param_rel_err=param_err,
        rank_max_diff=rank_diff,
        measured_peak_bytes=measured,
        budget_bytes=report.budget_bytes if report else None,
        predicted_peak_bytes=report.predicted_peak_bytes if report else None,
        unplanned_peak_bytes=report.unplanned_peak_bytes if report else None,
        num_pairs=len(report.pairs) if report else 0,
        step_summary=report.summary() if report else None,
        within_budget=report.within_budget if report else None,
    )
    assert loss_err <= RTOL, f"losses differ from the run without trinity: {loss_err}"
    assert param_err <= RTOL, f"final parameters differ from the run without trinity: {param_err}"
    assert rank_diff == 0.0, f"ranks' parameters differ: {rank_diff}"
    if report is not None and report.budget_bytes is not None:
        # Within the budget where the ledger predicts the plan is; else (on_infeasible="warn":
        # the lowest-peak plans run) within the step peak it predicts for them.
        bound = report.budget_bytes if report.within_budget else report.predicted_peak_bytes
        assert measured <= bound + PEAK_SLACK_BYTES, (
            f"measured peak {measured} over the step's {'budget' if report.within_budget else 'predicted peak'} "
            f"{bound}\n{report.summary()}"
        )
    return result


# ---------------------------------------------------------------------- DDP


def ddp_run(
    mode: str = "activations",
    budget="60%",
    micro_steps: int = 1,
    no_sync: bool = False,
    hook: str | None = None,
    bucket_cap_mb: float | None = BUCKET_CAP_MB,
    reference: str | None = None,
    on_infeasible: str = "warn",
    shard: bool = False,
    uncompiled: frozenset = frozenset(),
) -> dict:
    """The same DDP training without trinity (uncompiled DDP, or ``reference``: compiled with
    that backend) and compiled with trinity; returns the measurements. ``bucket_cap_mb`` None:
    DDP's defaults (25 MiB buckets, torch's first-bucket size). ``uncompiled``: ``(step,
    micro-step)`` pairs run by the DDP module uncompiled, each inside its own
    ``materialized()`` block (offload="all")."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    # DDP's first bucket as large as the others (one bucket with the default 25 MiB cap).
    dist._DEFAULT_FIRST_BUCKET_BYTES = TORCH_FIRST_BUCKET_BYTES if bucket_cap_mb is None else int(bucket_cap_mb * 2**20)
    cap_kw = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    rank = dist.get_rank()
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref_model = GPTLoss()
    model = copy.deepcopy(ref_model)
    ref_ddp = ref = DDP(ref_model, **cap_kw)
    ddp = DDP(model, **cap_kw)
    if hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        for d in (ref, ddp):
            state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
            d.register_comm_hook(state, powersgd.powerSGD_hook)
    if reference is not None:
        ref = torch.compile(ref_ddp, backend=reference)
    splits = []

    def backend(gm, example_inputs, **kwargs):
        splits.append(len(example_inputs))
        return offload_compiler.trinity(
            gm,
            example_inputs,
            options={
                "inner": "eager",
                "offload": mode,
                "memory_budget": budget,
                "min_offload_bytes": 0,
                "on_infeasible": on_infeasible,
            },
        )

    compiled = torch.compile(ddp, backend=backend)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    if mode == "all":
        shard_group = dist.new_group(backend="gloo") if shard else None
        opt = CPUOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, shard_group=shard_group)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, ref_losses, measured = [], [], 0
    reports_before = len(offload_compiler.reports())
    # All-reduces issued from Python during trinity's steps are trinity's own (offload="all"):
    # ProcessGroup.allreduce (a plain dist.all_reduce) and .allreduce_coalesced (one coalesced
    # collective over several tensors) each count once; DDP's reducer calls the process group
    # from C++, unseen here.
    all_reduces, per_step, ddp_buckets = [0], [], []
    pg_class = torch._C._distributed_c10d.ProcessGroup
    real = {name: getattr(pg_class, name) for name in ("allreduce", "allreduce_coalesced")}

    def counting(name):
        def call(self, *args, **kwargs):
            all_reduces[0] += 1
            return real[name](self, *args, **kwargs)

        return call

    for name in real:
        setattr(pg_class, name, counting(name))
    for step in range(STEPS):
        idx, targets = batch(step, rank)
        chunks = list(zip(idx.chunk(micro_steps), targets.chunk(micro_steps)))
        for k, (x, t) in enumerate(chunks):
            last = k == len(chunks) - 1
            with ref_ddp.no_sync() if no_sync and not last else contextlib.nullcontext():
                loss = ref(x, t)
                loss.backward()
            ref_losses.append(loss.item())
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)

        def train_step(chunks=chunks, step=step):
            out = []
            for k, (x, t) in enumerate(chunks):
                last = k == len(chunks) - 1
                with ddp.no_sync() if no_sync and not last else contextlib.nullcontext():
                    if (step, k) in uncompiled:
                        with materialized(model.parameters()):
                            loss = ddp(x, t)
                            loss.backward()
                    else:
                        loss = compiled(x, t)
                        loss.backward()
                out.append(loss.item())
            return out

        calls_before = all_reduces[0]

        if step == STEPS - 1:
            if mode == "all":
                opt.synchronize()
            buckets = [b.buffer() for b in ddp.reducer._get_zeros_like_grad_buckets()]
            resident = list(model.parameters()) + [idx, targets] + buckets
            m = measure_peak_device_bytes(train_step, resident=resident, device="cpu")
            losses += m.result
            measured = m.peak_bytes
            del buckets
        else:
            losses += train_step()
        per_step.append(all_reduces[0] - calls_before)
        # DDP's buckets in this step's backward (rebuilt in the next forward after the first).
        ddp_buckets.append(len(ddp.reducer._get_zeros_like_grad_buckets()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    for name, fn in real.items():
        setattr(pg_class, name, fn)
    if mode == "all":
        opt.synchronize()
    report = offload_compiler.step_report(ddp)
    # offload="all": trinity's idle_comm_hook on DDP's reducer, which must not communicate.
    idle = [(s.idle_buckets, s.reduced_buckets) for h, s in ddp._comm_hooks if h.__name__ == "idle_comm_hook"]
    # The bucket all-reduces trinity planned per synced backward (offload="all"), over the pairs.
    syncs = [
        r.param_offload["grad_sync"]
        for r in offload_compiler.reports()[reports_before:]
        if r.param_offload and "grad_sync" in r.param_offload
    ]
    result = {
        "splits": len(splits),
        "optimizer_state_params": len(opt.state_dict()["state"]) if mode == "all" else None,
        "shard": opt.shard if mode == "all" else None,
        "all_reduces_per_step": per_step,
        "params_needing_grad": sum(p.requires_grad for p in model.parameters()),
        "ddp_buckets": ddp_buckets,
        "ddp_hook_buckets": list(idle[0]) if idle else None,
        "planned_buckets": sum(g["num_buckets"] for g in syncs),
        "bucket_bytes": [b for g in syncs for b in g["bucket_bytes"]],
        "bucket_caps": [g["bucket_caps"] for g in syncs],
        "allreduce_seconds": [
            r.param_offload["allreduce_seconds"]
            for r in offload_compiler.reports()[reports_before:]
            if r.param_offload and "grad_sync" in r.param_offload
        ],
    }
    with materialized(model.parameters()):
        # The final parameters' bits, to compare runs of different cases (sharded and not).
        result["param_digest"] = hashlib.sha256(
            b"".join(p.detach().clone().numpy().tobytes() for p in model.parameters())
        ).hexdigest()
        return finish(
            result, list(model.parameters()), list(ref_model.parameters()), losses, ref_losses, measured, report
        )


def case_ddp_split_bytes():
    """DDP's 4 splits under one absolute step budget (the ledger plans each split against what
    the others hold)."""
    return ddp_run("activations", STEP_BUDGET_BYTES, on_infeasible="error")


def case_ddp_split():
    """DDP's graph splitting (4 splits) with a step budget of 60%, which must fit: the embedding
    split alone cannot reach 60% of its own peak."""
    return ddp_run("activations", "60%", on_infeasible="error")


def case_ddp_no_sync():
    """Gradient accumulation with no_sync (2 micro-steps, the first not synced)."""
    return ddp_run("activations", "60%", micro_steps=2, no_sync=True)


def case_ddp_powersgd():
    """DDP with the PowerSGD communication hook, one bucket (several can hang on gloo). The
    reference is the same compiled with ``aot_eager``: PowerSGD's result depends on the order of
    the gradients in its bucket, which DDP sets from the order they become ready, and a compiled
    backward (trinity or not) makes them ready in another order than eager autograd."""
    return ddp_run("activations", "60%", hook="powersgd", bucket_cap_mb=25, reference="aot_eager")


def case_ddp_params():
    """offload='activations+params' under DDP (the splits' fake parameters mapped back)."""
    return ddp_run("activations+params", "60%")


def case_ddp_all():
    """offload='all' with CPUOptimizer(AdamW): gradients averaged by trinity."""
    return ddp_run("all", "60%")


def case_ddp_all_default_buckets():
    """offload='all' with DDP's default bucket cap (25 MiB, first bucket 1 MiB): the tiny model
    is one graph whose gradients fit the first bucket, one all-reduce per step."""
    return ddp_run("all", "60%", bucket_cap_mb=None)


def case_ddp_all_sharded():
    """offload='all' with CPUOptimizer(AdamW, shard_group=...): each rank updates its share and
    holds its state; the exchanged masters give every rank the unsharded bits."""
    r = ddp_run("all", "60%", shard=True)
    counts: list = [None] * dist.get_world_size()
    dist.all_gather_object(counts, r["optimizer_state_params"])
    r["optimizer_state_params_per_rank"] = counts
    return r


def case_ddp_all_no_sync():
    """offload='all' with no_sync accumulation: the first micro-step is not reduced."""
    return ddp_run("all", "60%", micro_steps=2, no_sync=True)


def case_ddp_all_mixed_uncompiled():
    """offload='all' with no_sync accumulation mixing compiled and uncompiled micro-steps: step 0
    compiled then uncompiled (synced), step 1 two uncompiled micro-steps in separate
    materialized() blocks, step 2 compiled. A fresh-user trial: the host gradients of the first
    micro-step were never averaged, and the ranks drifted 3% apart."""
    return ddp_run("all", "60%", micro_steps=2, no_sync=True, uncompiled=frozenset({(0, 1), (1, 0), (1, 1)}))


def case_ddp_all_hook_refused():
    """A communication hook with offload='all' is refused at compile time, naming both."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    ddp = DDP(GPTLoss(), bucket_cap_mb=25)
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    compiled = torch.compile(ddp, backend="trinity", options={"inner": "eager", "offload": "all"})
    try:
        compiled(*batch(0, dist.get_rank()))
    except Exception as exc:  # noqa: BLE001  (Dynamo wraps the backend's error)
        inner = getattr(exc, "inner_exception", exc)
        return {"error_type": type(inner).__name__, "message": str(inner)}
    raise AssertionError("offload='all' with a DDP comm hook was not refused")


# ---------------------------------------------------------------------- FSDP2


class Stack(nn.Module):
    """Four GPT blocks (each its own FSDP2 unit, compiled per block) on float inputs."""

    def __init__(self, cfg=GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=2, n_embd=32)):
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(4))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def fsdp_run(budget="50%", cpu_offload: bool = False, mode: str = "activations") -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    rank = dist.get_rank()
    torch._dynamo.reset()

    def build(compiled: bool):
        torch.manual_seed(0)
        m = Stack()
        kw = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if cpu_offload else {}
        for b in m.blocks:
            fully_shard(b, **kw)
        fully_shard(m, **kw)
        if compiled:
            opts = {
                "inner": "eager",
                "memory_budget": budget,
                "min_offload_bytes": 0,
                "offload": mode,
                "on_infeasible": "warn",
            }
            for b in m.blocks:
                b.compile(backend="trinity", options=opts)
        return m

    before = len(offload_compiler.reports())
    ref, model = build(False), build(True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, ref_losses, measured = [], [], 0
    with warnings.catch_warnings(record=True):  # the infeasible-budget warnings of on_infeasible='warn'
        warnings.simplefilter("always")
        for step in range(STEPS):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(16, 32, 32, generator=g)
            loss = ref(x).pow(2).mean()
            loss.backward()
            ref_losses.append(loss.item())
            ref_opt.step()
            ref_opt.zero_grad()

            def train_step(x=x):
                loss = model(x).pow(2).mean()
                loss.backward()
                return loss.item()

            if step == STEPS - 1:
                resident = [p.to_local() for p in model.parameters()] + [x]
                m = measure_peak_device_bytes(train_step, resident=resident, device="cpu")
                losses.append(m.result)
                measured = m.peak_bytes
            else:
                losses.append(train_step())
            opt.step()
            opt.zero_grad()
    # The blocks' ledgers (module docstring): each graph's runs per step, as the first step's
    # check counted them and the plan covers them.
    report = offload_compiler.step_report(model)
    result = {
        "runs": [p.runs for p in report.pairs] if report else [],
        "reports": [
            {
                "reuse_count": r.reuse_count,
                "reuse_measured": r.reuse_measured,
                "reuse_predicted": r.reuse_predicted,
                "replanned": r.correction is not None,
                "budget_bytes": r.budget_bytes,
            }
            for r in offload_compiler.reports()[before:]
        ],
    }
    return finish(result, list(model.parameters()), list(ref.parameters()), losses, ref_losses, measured, report)


def case_fsdp_blocks():
    """FSDP2 per-block compile at 50%: the first block's own graph (its float input needs no
    gradient) and one block graph that the other 3 blocks run per step, planned for its 3 runs."""
    return fsdp_run("50%")


def case_fsdp_cpu_offload():
    """FSDP2's CPUOffloadPolicy (parameters, gradients, optimizer state on the host) with
    trinity's activation offload."""
    return fsdp_run("50%", cpu_offload=True)


def case_fsdp_all_refused():
    """FSDP2 with offload='all' is refused at compile time."""
    try:
        fsdp_run(None, mode="all")
    except Exception as exc:  # noqa: BLE001  (Dynamo wraps the backend's error)
        inner = getattr(exc, "inner_exception", exc)
        return {"error_type": type(inner).__name__, "message": str(inner)}
    raise AssertionError("FSDP2 with offload='all' was not refused")


CASES = {name[len("case_") :]: fn for name, fn in globals().items() if name.startswith("case_")}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("cases", nargs="+", choices=sorted(CASES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results = {}
    for name in args.cases:
        try:
            results[name] = {"ok": True, **CASES[name]()}
        except Exception:  # noqa: BLE001  (reported to the test; the next case still runs)
            results[name] = {"ok": False, "error": traceback.format_exc()}
        dist.barrier()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
