"""Keep, offload or recompute: every method's memory/time frontier, side by side, in one run.

Methods (the same model and budgets for each):

* trinity ``strategy="auto"`` (keep, offload or recompute per saved activation), ``"offload"``
  (offload only) and ``"recompute"`` (recompute only), at 100, 75, 50, 35 and 25% of the unplanned
  peak, on the cost model's default figures (on the CPU the device table's nominal ``cpu`` entry:
  50 GFLOP/s, 10 GB/s, 5 GB/s copies, guesses that are not this machine's);
* on the CPU also trinity ``strategy="auto"`` with ``op_times="measured"`` (family "trinity auto,
  measured op times", keys ``trinity-auto-measured-<b>%``): the same planner with each distinct
  aten call of the graph timed on this machine at compile (:mod:`offload_compiler.passes.op_timing`),
  the plan made for the machine it runs on;
* PyTorch's selective recompute: the min-cut partitioner with
  ``torch._functorch.config.activation_memory_budget`` swept over fractions, each trinity budget
  compared with the point whose peak is nearest;
* per-block ``torch.utils.checkpoint`` (non-reentrant; under ``torch.compile`` the partitioner
  recomputes what it prefers to, ``CheckpointPolicy.PREFER_RECOMPUTE``);
* full recompute: every block checkpointed with a policy that recomputes every op of the block
  (``CheckpointPolicy.MUST_RECOMPUTE``; torchtitan's "full" activation checkpointing).

Part 1, **measured on this machine** (``--cpu``): the demo GPT and the Llama preset
(``bench.models`` "cpu" sizes), Inductor as every compiled method's compiler. Per method the exact
peak of one training step (``measure_peak``: the CPU allocator's trace), and the step time against
plain ``torch.compile`` (Inductor), stepped alternately in ABBA order as :mod:`bench.step_ratio`
does (median of paired ratios).

Part 2, **predictions** from the cost model and simulator on GPU figures (``--gpu``; H100 SXM,
A100 80GB, RTX 4090; no GPU was used): the demo GPT and the Llama preset (``bench.models`` "gpu"
sizes), llama-1b and llama-7b, traced on fake tensors; trinity through ``plan_model`` (the ``plan``
command's function), the PyTorch methods by tracing with their partitioning (selective recompute:
the budget; checkpointing: the nodes of each block tagged with the policy, as Dynamo tags them for
``torch.utils.checkpoint``) and predicting their step as their compute on the same figures (they
copy nothing). Peaks include AdamW's state (two tensors per parameter), as ``plan`` counts it.

``python -m bench.frontier [--cpu] [--gpu] [--rounds 6]`` writes ``bench/results/recompute_frontier.json``
(both parts; ``recompute_frontier_cpu.json`` / ``recompute_frontier_gpu_predicted.json`` for one)
with device, torch, command and commit, and one PNG per model and device; issue 14's targets are
judged in the JSON's ``cpu_targets`` and ``gpu_targets``. ``--cpu --only KEYS`` measures just those
methods again (a point's run-to-run spread) into ``recompute_frontier_cpu_repeat.json``;
``--repeats N`` measures them N times, each from a fresh compile, and the JSON's
``repeat_summary`` gives each key's ratios and their median.

Run it alone: with torch's intra-op threads on every core (the default), another busy process
leaves one OpenMP worker descheduled at each parallel region, and a 1 MiB ``mul`` that takes
0.035 ms on a quiet 2-core machine took 5 to 8 ms beside two pytest runs (measured 2026-12-06).
Such slowdowns are not proportional to the work, so the paired ratio does not cancel them; each
row records ``other_load`` (the other processes' share of the CPU while it was timed) and the
ratio checks carry it.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import offload_compiler

from .common import RESULTS, OtherLoad, write_result
from .memory import measure_peak
from .methods import CheckpointBlock, Prepared, fresh_copy, inductor_with_functorch_config
from .models import get_model
from .runner import train_step

BUDGETS = (1.0, 0.75, 0.5, 0.35, 0.25)
STRATEGIES = ("auto", "offload", "recompute")
SAC_FRACTIONS = (1.0, 0.7, 0.5, 0.3, 0.1, 0.0)
GPU_DEVICES = ("h100-sxm", "a100-80gb", "rtx4090")
PEAK_SLACK_BYTES = 64 * 1024  # allocator granularity and tensors outside the graph (as tests/test_e2e.py)


# ------------------------------------------------------------------------------------ methods
def _must_recompute(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_RECOMPUTE


class FullRecomputeBlock(nn.Module):
    """Runs ``block`` under non-reentrant checkpointing that recomputes every op."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        ctx = functools.partial(create_selective_checkpoint_contexts, _must_recompute)
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=ctx, **kwargs)


def _wrap(containers, wrapper) -> None:
    for container in containers:
        for name, child in list(container.named_children()):
            setattr(container, name, wrapper(child))


def _trinity_method(key: str, family: str, budget: float, options: dict) -> dict:
    return {
        "key": key,
        "family": family,
        "budget": budget,
        "prepare": functools.partial(lambda m, o: Prepared(torch.compile(m, backend="trinity", options=o)), o=options),
    }


def cpu_methods(spec) -> list[dict]:
    """Every measured method: key, family, its parameter, ``prepare(model) -> Prepared``."""
    out = []
    for strategy in STRATEGIES:
        for b in BUDGETS:
            options = {
                "memory_budget": f"{round(b * 100)}%",
                "inner": "inductor",
                "on_infeasible": "warn",
                "strategy": strategy,
                "min_offload_bytes": 0,
            }
            out.append(_trinity_method(f"trinity-{strategy}-{round(b * 100)}%", f"trinity {strategy}", b, options))
            if strategy == "auto":
                out.append(
                    _trinity_method(
                        f"trinity-auto-measured-{round(b * 100)}%",
                        "trinity auto, measured op times",
                        b,
                        {**options, "op_times": "measured"},
                    )
                )
    for f in SAC_FRACTIONS:
        out.append(
            {
                "key": f"sac-{f:g}",
                "family": "selective recompute (activation_memory_budget)",
                "budget": f,
                "prepare": functools.partial(
                    lambda m, f: Prepared(
                        torch.compile(m, backend=inductor_with_functorch_config(activation_memory_budget=f))
                    ),
                    f=f,
                ),
            }
        )

    def blocks(wrapper):
        def prepare(m):
            _wrap(spec.block_containers(m), wrapper)
            return Prepared(torch.compile(m, backend="inductor"))

        return prepare

    out.append(
        {"key": "checkpoint", "family": "per-block checkpoint", "budget": None, "prepare": blocks(CheckpointBlock)}
    )
    out.append(
        {"key": "full-recompute", "family": "full recompute", "budget": None, "prepare": blocks(FullRecomputeBlock)}
    )
    return out


def _peak_of(prepared, model, x, y) -> int:
    def fwd_bwd():
        with prepared.context():
            loss = prepared.fn(x, y)
            loss.backward()
        return loss

    resident = list(model.parameters()) + list(model.buffers()) + [x, y]
    m = measure_peak(fwd_bwd, resident=resident, device=torch.device("cpu"), host_copies=False)
    model.zero_grad(set_to_none=True)
    return m.peak_bytes


def cpu_frontier(model_name: str, rounds: int, warmup: int, only: set[str] | None = None) -> dict:
    """Part 1 for one model (see the module docstring)."""
    spec = get_model(model_name, "cpu")
    torch.manual_seed(0)
    base = spec.build()
    steps = warmup + 2 * rounds + 1
    batches = spec.make_batches(steps, 0)
    torch._dynamo.reset()
    ref_model = fresh_copy(base)
    ref = Prepared(torch.compile(ref_model, backend="inductor"))
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, weight_decay=0.0)
    dev = torch.device("cpu")
    rows = []
    for method in cpu_methods(spec):
        if only and method["key"] not in only:
            continue
        t0 = time.perf_counter()
        before = len(offload_compiler.reports())
        model = fresh_copy(base)
        prepared = method["prepare"](model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        row = {"key": method["key"], "family": method["family"], "budget": method["budget"]}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for i in range(warmup):
                    train_step(prepared, opt, *batches[i], dev)
                    train_step(ref, ref_opt, *batches[i], dev)
                row["peak_bytes"] = _peak_of(prepared, model, *batches[-1])
                times = {"m": [], "r": []}
                with OtherLoad() as load:
                    for r in range(rounds):
                        i = warmup + 2 * r
                        for who, j in (("m", i), ("r", i), ("r", i + 1), ("m", i + 1)):
                            p, o = (prepared, opt) if who == "m" else (ref, ref_opt)
                            times[who].append(train_step(p, o, *batches[j], dev)[0])
            paired = [a / b for a, b in zip(times["m"], times["r"])]
            q = statistics.quantiles(paired, n=4) if len(paired) > 1 else [paired[0]] * 3
            row.update(
                ok=True,
                ratio=statistics.median(paired),
                ratio_q1=q[0],
                ratio_q3=q[2],
                median_seconds=statistics.median(times["m"]),
                reference_median_seconds=statistics.median(times["r"]),
                other_load=load.fraction,
            )
        except Exception as exc:  # a method that fails is a result, not the end of the run
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
        reports = offload_compiler.reports()[before:]
        if reports:
            r = reports[0]
            row["trinity"] = {
                "budget_bytes": r.budget_bytes,
                "unplanned_peak_bytes": r.peak_bytes_unplanned,
                "planned_peak_bytes": r.peak_bytes_planned,
                "feasible": r.feasible,
                "num_evicted": r.num_evicted,
                "evicted_bytes": r.evicted_bytes,
                "recompute": r.recompute,
                "graphs": len(reports),
            }
            budget = sum(x.budget_bytes or 0 for x in reports)
            if row.get("peak_bytes") is not None and all(x.budget_bytes is not None for x in reports):
                row["budget_bytes"] = budget
                if all(x.feasible for x in reports):
                    row["within_budget"] = row["peak_bytes"] <= budget + PEAK_SLACK_BYTES
                else:
                    # Below the lowest reachable peak (on_infeasible="warn"): what runs is the
                    # lowest-peak plan, so the measured peak is judged against that plan's peak.
                    planned = sum(x.peak_bytes_planned for x in reports)
                    row["infeasible"] = True
                    row["planned_lowest_peak_bytes"] = planned
                    row["within_planned_lowest_peak"] = row["peak_bytes"] <= planned + PEAK_SLACK_BYTES
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(
            f"  {model_name} {row['key']:22s} peak {row.get('peak_bytes', 0) / 2**20:7.2f} MiB  "
            f"ratio {row.get('ratio', float('nan')):.3f}  "
            + (f"within budget {row.get('within_budget')}" if "within_budget" in row else "")
            + (
                f"infeasible: within its planned lowest peak {row['within_planned_lowest_peak']}"
                if "within_planned_lowest_peak" in row
                else ""
            )
            + ("" if row.get("ok") else f"  FAILED {row.get('error')}"),
            flush=True,
        )
    _match_sac(rows, "peak_bytes")
    return {"model": model_name, "description": spec.description, "rows": rows}


def _match_sac(rows: list[dict], peak_key: str) -> None:
    """Each trinity row gets the selective-recompute point with the nearest peak."""
    sac = [r for r in rows if r["key"].startswith("sac-") and r.get(peak_key) is not None]
    for r in rows:
        if r["key"].startswith("trinity-") and r.get(peak_key) is not None and sac:
            best = min(sac, key=lambda s: abs(s[peak_key] - r[peak_key]))
            r["nearest_sac"] = best["key"]


# ------------------------------------------------------------------------------------ GPU figures
class _Tagged(nn.Module):
    """Annotates the nodes ``block`` traces to (``torch.fx.traceback.annotate``) with its index."""

    def __init__(self, block: nn.Module, index: int):
        super().__init__()
        self.block = block
        self.index = index

    def forward(self, *args, **kwargs):
        from torch.fx import traceback as fx_traceback

        with fx_traceback.annotate({"trinity_bench_block": self.index}):
            return self.block(*args, **kwargs)


def _checkpoint_pass(policy):
    """A joint-graph pass tagging each block's forward nodes with ``policy`` and the block's
    ``ac_graph_id``, as Dynamo does for ``torch.utils.checkpoint`` regions."""

    def tag(joint: torch.fx.GraphModule) -> None:
        backward = {n for n in joint.graph.find_nodes(op="placeholder") if n.name.startswith("tangents")}
        for n in joint.graph.nodes:
            if n not in backward and any(a in backward for a in n.all_input_nodes):
                backward.add(n)
        for n in joint.graph.nodes:
            block = n.meta.get("custom", {}).get("trinity_bench_block")
            if n.op == "call_function" and n not in backward and block is not None:
                n.meta["recompute"] = policy
                n.meta["ac_graph_id"] = block + 1

    return tag


def gpu_models() -> list[dict]:
    from offload_compiler.models import Llama, LlamaConfig
    from offload_compiler.models.presets import get_preset

    from .models import SIZES

    llama = get_model("llama", "gpu")
    s = SIZES["gpu"]["llama"]
    return [
        {"name": "demo", "build": lambda: get_preset("demo").build(128), "vocab": 256, "batch": 16, "seq": 128},
        {
            "name": "llama (bench preset, gpu size)",
            "build": lambda: Llama(
                LlamaConfig(
                    vocab_size=256,
                    n_layer=s["n_layer"],
                    n_head=s["n_head"],
                    n_kv_head=s["n_kv_head"],
                    n_embd=s["n_embd"],
                    intermediate_size=s["intermediate_size"],
                    max_seq_len=s["seq"],
                )
            ),
            "vocab": 256,
            "batch": s["batch"],
            "seq": s["seq"],
            "description": llama.description,
        },
        {
            "name": "llama-1b",
            "build": lambda: get_preset("llama-1b").build(2048),
            "vocab": 128256,
            "batch": 2,
            "seq": 2048,
        },
        {
            "name": "llama-7b",
            "build": lambda: get_preset("llama-7b").build(4096),
            "vocab": 32000,
            "batch": 1,
            "seq": 4096,
        },
    ]


def _predict_pytorch(traced, device, state_bytes: int) -> dict:
    """Peak (bytes, optimizer state included) and predicted step (seconds: compute only) of a
    traced PyTorch partitioning on ``device``'s figures."""
    from torch._inductor import config as inductor_config

    from offload_compiler.passes import cost_model, liveness
    from offload_compiler.passes.inline_pointwise import inline_reused_pointwise
    from offload_compiler.pipeline import prepare
    from offload_compiler.plan_cli import mark_target_device

    pair = traced.pair
    first = not pair.forward.meta.get("trinity_prepared")
    prepare(pair)  # the planning passes' graph preparation, once per pair (as plan_step runs it)
    mark_target_device(pair, device)  # planned for a GPU, as plan_step marks its pairs
    if first:
        # Plain Inductor computes a reused pointwise value in each reader when it reads at most
        # realize_reads_threshold (4) buffers: the loss's float32 logits-sized temporaries are
        # never allocated. The same copies model that here (not the addmm split: plain Inductor
        # keeps its addmm).
        target = "cpu" if device.host_is_device else "cuda"
        for gm in (pair.forward, pair.backward):
            inline_reused_pointwise(gm, target, max_leaves=inductor_config.realize_reads_threshold)
    live = liveness.analyze(pair, assume_fusion=True)
    costs = cost_model.estimate(pair, live, device)
    return {"peak_bytes": live.peak_bytes + state_bytes, "step_seconds": costs.compute_seconds}


def plan_traced(model: dict, device_name: str, budgets, traced, strategy: str = "auto", dtype=torch.bfloat16, **kwargs):
    """``plan_model`` (the ``plan`` command's spine) on ``traced``, a traced step of ``model`` (an
    entry of :func:`gpu_models`), on ``device_name``'s figures, with AdamW state and no size floor
    on offloads; ``kwargs`` go to ``plan_model`` (e.g. ``solver_time_limit``)."""
    from offload_compiler.devices import KNOWN_DEVICES
    from offload_compiler.plan_cli import plan_model

    return plan_model(
        model["name"],
        KNOWN_DEVICES[device_name],
        list(budgets),
        batch=model["batch"],
        seq_len=model["seq"],
        dtype=dtype,
        optimizer="adamw",
        min_offload_bytes=0,
        strategy=strategy,
        traced=traced,
        **kwargs,
    )


def gpu_frontier(model: dict, devices=GPU_DEVICES, dtype=torch.bfloat16) -> dict:
    """Part 2 for one model (see the module docstring)."""
    from offload_compiler.devices import KNOWN_DEVICES
    from offload_compiler.trace import trace_training_step

    t0 = time.perf_counter()
    args = (model["batch"], model["seq"], model["vocab"], dtype)
    base = trace_training_step(model["build"], *args, inner="inductor")
    state = 2 * base.param_bytes  # AdamW
    variants = {}
    for f in SAC_FRACTIONS:
        with torch._functorch.config.patch(activation_memory_budget=f):
            variants[f"sac-{f:g}"] = trace_training_step(model["build"], *args, inner="inductor")

    def tagged():
        m = model["build"]()
        for i, blk in enumerate(list(m.blocks)):
            m.blocks[i] = _Tagged(blk, i)
        return m

    variants["checkpoint"] = trace_training_step(
        tagged, *args, inner="inductor", joint_pass=_checkpoint_pass(CheckpointPolicy.PREFER_RECOMPUTE)
    )
    variants["full-recompute"] = trace_training_step(
        tagged, *args, inner="inductor", joint_pass=_checkpoint_pass(CheckpointPolicy.MUST_RECOMPUTE)
    )
    trace_seconds = time.perf_counter() - t0
    out = {"model": model["name"], "batch": model["batch"], "seq_len": model["seq"], "dtype": str(dtype), "devices": {}}
    for dev_name in devices:
        device = KNOWN_DEVICES[dev_name]
        pytorch = {k: _predict_pytorch(v, device, state) for k, v in variants.items()}
        ckpt_peak = pytorch["checkpoint"]["peak_bytes"]
        budgets = [f"{round(b * 100)}%" for b in BUDGETS] + [str(int(ckpt_peak)), "1"]
        per_strategy = {}
        for strategy in STRATEGIES:
            t1 = time.perf_counter()
            res = plan_traced(model, dev_name, budgets, base, strategy, dtype)
            rows = []
            for r in res.rows:
                rows.append(
                    {
                        "budget": "checkpoint peak" if r.budget == str(int(ckpt_peak)) else r.budget,
                        "budget_bytes": r.budget_bytes,
                        "feasible": r.feasible,
                        "planned_peak_bytes": r.planned_peak_bytes,
                        "lowest_reachable_bytes": r.lowest_reachable_bytes,
                        "predicted_step_seconds": r.predicted_step_seconds if r.feasible else None,
                        "exposed_seconds": r.exposed_seconds if r.feasible else None,
                        "evicted_bytes": r.evicted_bytes,
                        "num_evicted": r.num_evicted,
                        "recomputed_bytes": r.recomputed_bytes,
                        "num_recomputed": r.num_recomputed,
                        "recompute_seconds": r.recompute_seconds,
                        "chosen": r.chosen,
                    }
                )
            per_strategy[strategy] = {
                "rows": rows,
                "unplanned_peak_bytes": res.unplanned_peak_bytes,
                "compute_seconds": res.compute_seconds,
                "plan_seconds": time.perf_counter() - t1,
            }
        out["devices"][dev_name] = {"trinity": per_strategy, "pytorch": pytorch, "figures": device.name}
        print(f"  {model['name']} on {dev_name}: planned", flush=True)
    out["trace_seconds"] = trace_seconds
    return out


def gpu_bound(model: dict, frontier: dict, limit_s: float, device_name: str = "h100-sxm") -> dict:
    """The 5% target's reach for one model: ``auto`` planned at the per-block checkpoint peak of
    ``frontier`` (this model's entry of a ``--gpu`` run) with the solver given ``limit_s`` seconds
    (``solver_time_limit``), and the joint program's proven lower bound there
    (``RecomputePlan.solver_bound_seconds``): the step no choice of the program beats, against
    95% of full recompute's."""
    from offload_compiler.trace import trace_training_step

    d = frontier["devices"][device_name]
    ckpt = next(r for r in d["trinity"]["auto"]["rows"] if r["budget"] == "checkpoint peak")
    full = d["pytorch"]["full-recompute"]["step_seconds"]
    base = trace_training_step(
        model["build"], model["batch"], model["seq"], model["vocab"], torch.bfloat16, inner="inductor"
    )
    t0 = time.perf_counter()
    res = plan_traced(model, device_name, [str(ckpt["budget_bytes"])], base, solver_time_limit=limit_s)
    row = res.rows[0]
    bound = None if row.solver_bound_seconds is None else res.compute_seconds + row.solver_bound_seconds
    return {
        "model": model["name"],
        "device": device_name,
        "checkpoint_peak_bytes": ckpt["budget_bytes"],
        "solver_time_limit_s": limit_s,
        "plan_seconds": time.perf_counter() - t0,
        "compute_seconds": res.compute_seconds,
        "auto_seconds_default_limit": ckpt["predicted_step_seconds"],
        "auto_seconds": row.predicted_step_seconds if row.feasible else None,
        "program_lower_bound_seconds": bound,
        "full_recompute_seconds": full,
        "target_seconds": 0.95 * full,
        "reachable_within_the_program": None if bound is None else bound <= 0.95 * full,
    }


# ------------------------------------------------------------------------------------ targets
def gpu_targets(results: list[dict]) -> dict:
    """Issue 14's GPU-figure targets, judged per model and device."""
    checks = []
    for res in results:
        for dev, d in res["devices"].items():
            tri = d["trinity"]
            by = {s: {r["budget"]: r for r in tri[s]["rows"]} for s in STRATEGIES}
            for b in [f"{round(x * 100)}%" for x in BUDGETS] + ["checkpoint peak"]:
                auto = by["auto"].get(b)
                singles = [by[s][b] for s in ("offload", "recompute") if by[s].get(b) and by[s][b]["feasible"]]
                if auto is None or not auto["feasible"]:
                    if singles:
                        checks.append(
                            {"model": res["model"], "device": dev, "budget": b, "target": "auto <= best single",
                             "met": False, "why": "auto infeasible where a single strategy is feasible"}
                        )  # fmt: skip
                    continue
                if singles:
                    best = min(x["predicted_step_seconds"] for x in singles)
                    checks.append(
                        {"model": res["model"], "device": dev, "budget": b, "target": "auto <= best single",
                         "auto_seconds": auto["predicted_step_seconds"], "best_single_seconds": best,
                         "met": auto["predicted_step_seconds"] <= best * (1 + 1e-9)}
                    )  # fmt: skip
            lows = {s: min(r["lowest_reachable_bytes"] for r in tri[s]["rows"]) for s in STRATEGIES}
            checks.append(
                {"model": res["model"], "device": dev, "target": "lowest auto <= lowest single", "lowest": lows,
                 "met": lows["auto"] <= min(lows["offload"], lows["recompute"])}
            )  # fmt: skip
            if dev == "h100-sxm":
                at = by["auto"].get("checkpoint peak")
                full = d["pytorch"]["full-recompute"]["step_seconds"]
                ok = bool(at and at["feasible"] and at["predicted_step_seconds"] <= 0.95 * full)
                checks.append(
                    {"model": res["model"], "device": dev, "target": "auto >= 5% faster than full recompute "
                     "at the per-block checkpoint peak", "auto_seconds": at and at["predicted_step_seconds"],
                     "full_recompute_seconds": full, "met": ok}
                )  # fmt: skip
    return {"checks": checks, "all_met": all(c["met"] for c in checks)}


def cpu_targets(results: list[dict]) -> dict:
    checks = []
    for res in results:
        for r in res["rows"]:
            if r["key"].startswith("trinity-") and "within_budget" in r:
                checks.append({"model": res["model"], "key": r["key"], "target": "measured peak within budget",
                               "peak_bytes": r["peak_bytes"], "budget_bytes": r["budget_bytes"],
                               "met": r["within_budget"]})  # fmt: skip
            if r["key"].startswith("trinity-") and "within_planned_lowest_peak" in r:
                checks.append({"model": res["model"], "key": r["key"],
                               "target": "infeasible budget: measured peak within the planned lowest peak",
                               "peak_bytes": r["peak_bytes"], "budget_bytes": r["budget_bytes"],
                               "planned_lowest_peak_bytes": r["planned_lowest_peak_bytes"],
                               "met": r["within_planned_lowest_peak"]})  # fmt: skip
            if r["key"] in ("trinity-auto-50%", "trinity-auto-measured-50%") and r.get("ok"):
                checks.append({"model": res["model"], "key": r["key"], "target": "paired step ratio <= 1.1 at 50%",
                               "ratio": r["ratio"], "other_load": r.get("other_load"), "repeat": res.get("repeat"),
                               "met": r["ratio"] <= 1.1})  # fmt: skip
    return {"checks": checks, "all_met": all(c["met"] for c in checks)}


def repeat_summary(results: list[dict]) -> dict:
    """Per model and method key of ``--only`` runs: every repeat's paired ratio and other load, and
    the median ratio over the repeats."""
    out: dict = {}
    for res in results:
        for r in res["rows"]:
            if r.get("ok"):
                e = out.setdefault(res["model"], {}).setdefault(r["key"], {"ratios": [], "other_load": []})
                e["ratios"].append(r["ratio"])
                e["other_load"].append(r.get("other_load"))
    for per_key in out.values():
        for e in per_key.values():
            e["median_ratio"] = statistics.median(e["ratios"])
    return out


# ------------------------------------------------------------------------------------ plots
def _plot(path: Path, title: str, series: dict[str, list[tuple[float, float]]], xlabel: str, ylabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    for label, pts in series.items():
        pts = sorted(p for p in pts if all(math.isfinite(v) for v in p))
        if not pts:
            continue
        style = "o-" if len(pts) > 1 else "s"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label, markersize=4)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_cpu(res: dict) -> Path:
    series: dict[str, list] = {}
    for r in res["rows"]:
        if r.get("ok") and r.get("peak_bytes") is not None:
            series.setdefault(r["family"], []).append((r["ratio"], r["peak_bytes"] / 2**20))
    path = RESULTS / f"recompute_frontier_cpu_{res['model']}.png"
    _plot(
        path,
        f"{res['model']} on this CPU (measured): peak vs step time against Inductor",
        series,
        "paired step-time ratio to torch.compile (Inductor), ABBA",
        "measured peak (MiB)",
    )
    return path


def plot_gpu(res: dict, dev: str) -> Path:
    d = res["devices"][dev]
    series: dict[str, list] = {}
    for s in STRATEGIES:
        series[f"trinity {s}"] = [
            (r["predicted_step_seconds"] * 1e3, r["planned_peak_bytes"] / 2**30)
            for r in d["trinity"][s]["rows"]
            if r["feasible"] and r["budget"] != "checkpoint peak"
        ]
    series["selective recompute (activation_memory_budget)"] = [
        (v["step_seconds"] * 1e3, v["peak_bytes"] / 2**30) for k, v in d["pytorch"].items() if k.startswith("sac-")
    ]
    for k, label in (("checkpoint", "per-block checkpoint"), ("full-recompute", "full recompute")):
        v = d["pytorch"][k]
        series[label] = [(v["step_seconds"] * 1e3, v["peak_bytes"] / 2**30)]
    slug = res["model"].split(" ")[0]
    path = RESULTS / f"recompute_frontier_{dev}_{slug}.png"
    _plot(
        path,
        f"{res['model']} on {d['figures']} figures (PREDICTED by the cost model, no GPU used)",
        series,
        "predicted step time (ms)",
        "predicted peak incl. AdamW state (GiB)",
    )
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.frontier", description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="part 1: measure on this machine")
    parser.add_argument("--gpu", action="store_true", help="part 2: predictions on GPU figures")
    parser.add_argument("--cpu-models", default="gpt,llama")
    parser.add_argument("--gpu-models", default="demo,llama,llama-1b,llama-7b")
    parser.add_argument(
        "--bound",
        type=float,
        default=None,
        metavar="SECONDS",
        help="instead: for each --gpu-models model, plan at the per-block checkpoint peak of the last --gpu run "
        "(recompute_frontier_gpu_predicted.json) on H100 figures with this solver limit and record the joint "
        "program's proven lower bound (recompute_bound_h100.json)",
    )
    parser.add_argument("--rounds", type=int, default=6, help="ABBA rounds timed per method (default 6)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--only",
        default=None,
        metavar="KEYS",
        help="with --cpu only: measure just these comma-separated method keys (e.g. trinity-auto-50%%) to repeat "
        "points; writes recompute_frontier_cpu_repeat.json (no plots), leaving the full run's file alone",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="with --only: measure the keys this many times, each from a fresh compile (default 1)",
    )
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    if args.repeats < 1 or (args.repeats > 1 and only is None):
        parser.error(f"--repeats must be >= 1 and needs --only, got {args.repeats}")
    if only is not None and (args.gpu or not args.cpu or args.bound is not None):
        parser.error("--only repeats CPU points: use it with --cpu alone")
    if not (args.cpu or args.gpu):
        args.cpu = args.gpu = True
    payload: dict = {"budgets": BUDGETS, "sac_fractions": SAC_FRACTIONS, "note": __doc__}
    if args.bound is not None:
        import json

        last = json.loads((Path(__file__).parent / "results" / "recompute_frontier_gpu_predicted.json").read_text())
        by_name = {r["model"]: r for r in last["gpu_predicted"]}
        rows = []
        for m in gpu_models():
            if m["name"].split(" ")[0] in args.gpu_models.split(",") and m["name"] in by_name:
                print(f"bound at the checkpoint peak: {m['name']}", flush=True)
                rows.append(gpu_bound(m, by_name[m["name"]], args.bound))
                print(f"  {rows[-1]}", flush=True)
        path = write_result(
            "recompute_bound_h100",
            {"rows": rows, "frontier_commit": last["git_commit"], "note": gpu_bound.__doc__.split("\n\n")[0]},
            torch.device("cpu"),
        )
        print(f"written {path}")
        return 0
    if args.gpu:
        wanted = args.gpu_models.split(",")
        results = []
        for m in gpu_models():
            if m["name"].split(" ")[0] in wanted:
                print(f"GPU figures (predictions): {m['name']}", flush=True)
                results.append(gpu_frontier(m))
                for dev in results[-1]["devices"]:
                    plot_gpu(results[-1], dev)
        payload["gpu_predicted"] = results
        payload["gpu_targets"] = gpu_targets(results)
    if args.cpu:
        results = []
        with torch._dynamo.config.patch(cache_size_limit=256, accumulated_cache_size_limit=2048):
            with torch._inductor.config.patch(fx_graph_cache=False):
                with torch._functorch.config.patch(enable_autograd_cache=False):
                    for name in args.cpu_models.split(","):
                        for rep in range(args.repeats):
                            print(
                                f"CPU (measured): {name}" + (f", repeat {rep + 1}" if args.repeats > 1 else ""),
                                flush=True,
                            )
                            results.append(cpu_frontier(name, args.rounds, args.warmup, only))
                            if only is None:
                                plot_cpu(results[-1])
                            else:
                                results[-1]["repeat"] = rep
        payload["cpu_measured"] = results
        if only is not None:
            payload["repeat_summary"] = repeat_summary(results)
        payload["cpu_targets"] = cpu_targets(results)
    name = "recompute_frontier" + ("" if args.cpu and args.gpu else "_cpu" if args.cpu else "_gpu_predicted")
    if only is not None:
        name, payload["only"] = "recompute_frontier_cpu_repeat", sorted(only)
    path = write_result(name, payload, torch.device("cpu"))
    print(f"written {path}")
    for part in ("gpu_targets", "cpu_targets"):
        if part in payload:
            for c in payload[part]["checks"]:
                if not c["met"]:
                    print(f"  target not met: {c}")
            print(f"{part}: {'all met' if payload[part]['all_met'] else 'NOT all met'}")
    for model, per_key in payload.get("repeat_summary", {}).items():
        for key, e in per_key.items():
            print(
                f"  {model} {key}: ratios {', '.join(f'{x:.3f}' for x in e['ratios'])}; median {e['median_ratio']:.3f}"
            )
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
