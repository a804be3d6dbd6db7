"""The training step's budget across graph pairs (``offload_compiler.step_budget``), on this
machine: a model with a graph break (two graph pairs: 6 linear+tanh layers, the break, 6 more
and the loss; width 64, batch 512), trained with ``inner="eager"`` at several budgets. Per
budget: the step's measured peak (CPU allocator trace, parameters and input resident), the
step's budget as resolved, the ledger's predicted and unplanned step peaks, and per pair what it
holds; the same step compiled with ``aot_eager`` (nothing offloaded) for the unplanned measure.

Second, a block graph run 4 times per step: 4 identical blocks (3 linear+tanh layers with a
residual, width 128, 2048 rows), each compiled on its own with ``block.compile``, so all four run
one compiled graph (``F1 .. F4 B4 .. B1``). The compile predicts the 4 runs from the module
structure (``step_budget.predict_runs``). Per budget, the first step's measured peak (the compile
included) and a later step's, with ``runtime_check="measure"`` (it measures and never plans
again: the compile's plan) and with the default check, which counts the runs in the first step
it measures and plans the graph again where they differ from the prediction.

Target: the measured step peak within the step's budget wherever the ledger predicts the plan
is (64 KiB of allocator slack, as in the tests). The multi-process DDP and FSDP2 figures are
measured by ``tests/test_distributed.py`` (README "Distributed").

``python -m bench.step_budget``
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .common import write_result

BUDGETS = ("60%", "75%", 1_800_000, 2_000_000)
REUSE_BUDGETS = (12_000_000, "60%", "75%")
SLACK = 64 * 1024
REUSE_WIDTH, REUSE_ROWS = 128, 2048


class Broken(nn.Module):
    """Six linear+tanh layers, a graph break, six more and the loss: two graph pairs."""

    def __init__(self, d=64, n=6):
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.b = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        for lin in self.a:
            x = torch.tanh(lin(x))
        torch._dynamo.graph_break()
        for lin in self.b:
            x = torch.tanh(lin(x))
        return x.pow(2).mean()


class Block(nn.Module):
    """Three linear+tanh layers and a residual: the block of the reused-graph measurement."""

    def __init__(self, d=REUSE_WIDTH, depth=3):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))

    def forward(self, x):
        h = x
        for lin in self.lins:
            h = torch.tanh(lin(h))
        return x + h


class Blocks(nn.Module):
    """``n`` identical :class:`Block` and a sum as the loss."""

    def __init__(self, n=4, d=REUSE_WIDTH):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.sum()


def measure_reuse(budget, backend="trinity", runtime_check="replan") -> dict:
    """The reused block graph's step (module docstring), after three unmeasured steps."""
    from offload_compiler import measure_peak_device_bytes, reports, step_report

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Blocks()
    before = len(reports())
    for b in model.blocks:
        if backend == "trinity":
            opts = {"inner": "eager", "memory_budget": budget, "min_offload_bytes": 0, "on_infeasible": "warn"}
            b.compile(backend="trinity", options={**opts, "runtime_check": runtime_check})
        else:
            b.compile(backend=backend)
    x = torch.randn(REUSE_ROWS, REUSE_WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=True)
    resident = list(model.parameters()) + [x]
    # The first step (the compile included): the runtime check does not measure it (a profiler is
    # on), it measures the next one.
    first = measure_peak_device_bytes(lambda: model(x).backward(), resident=resident, device="cpu")
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        model(x).backward()
    model.zero_grad(set_to_none=True)
    m = measure_peak_device_bytes(lambda: model(x).backward(), resident=resident, device="cpu")
    row = {
        "budget": budget,
        "backend": backend,
        "first_step_measured_peak_bytes": first.peak_bytes,
        "measured_peak_bytes": m.peak_bytes,
    }
    if backend != "trinity":
        return row
    (r,) = reports()[before:]
    report = step_report(model)
    row.update(
        runtime_check=runtime_check,
        reuse_count=r.reuse_count,
        reuse_measured=r.reuse_measured,
        reuse_predicted=r.reuse_predicted,
        step_budget_bytes=r.budget_bytes,
        planned_peak_bytes=r.peak_bytes_planned,
        unplanned_peak_bytes=r.peak_bytes_unplanned,
        predicted_step_peak_bytes=report.predicted_peak_bytes,
        evicted=r.num_evicted,
        feasible=r.feasible,
        within_budget_measured=m.peak_bytes <= r.budget_bytes + SLACK,
        first_step_within_budget_measured=first.peak_bytes <= r.budget_bytes + SLACK,
    )
    return row


def measure(budget, backend="trinity") -> dict:
    from offload_compiler import measure_peak_device_bytes, step_report

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Broken()
    x = torch.randn(512, 64)
    if backend == "trinity":
        opts = {"inner": "eager", "memory_budget": budget, "min_offload_bytes": 0, "on_infeasible": "warn"}
        compiled = torch.compile(model, backend="trinity", options=opts)
    else:
        compiled = torch.compile(model, backend=backend)
    for _ in range(2):
        compiled(x).backward()
        model.zero_grad(set_to_none=True)
    m = measure_peak_device_bytes(lambda: compiled(x).backward(), resident=list(model.parameters()) + [x], device="cpu")
    row = {"budget": budget, "backend": backend, "measured_peak_bytes": m.peak_bytes}
    report = step_report(model) if backend == "trinity" else None
    if report is not None:
        row.update(
            step_budget_bytes=report.budget_bytes,
            predicted_peak_bytes=report.predicted_peak_bytes,
            unplanned_peak_bytes=report.unplanned_peak_bytes,
            within_budget_predicted=report.within_budget,
            within_budget_measured=report.budget_bytes is None or m.peak_bytes <= report.budget_bytes + SLACK,
            pairs=[
                {
                    "label": p.label,
                    "own_unplanned_peak_bytes": p.own_unplanned_peak_bytes,
                    "own_planned_peak_bytes": p.own_planned_peak_bytes,
                    "kept_bytes": p.kept_bytes,
                    "input_bytes": p.input_bytes,
                    "held_bytes": p.held_bytes,
                    "step_peak_bytes": p.step_peak_bytes,
                }
                for p in report.pairs
            ],
        )
    return row


def main() -> int:
    import warnings

    torch.set_num_threads(1)
    rows = [measure(None, backend="aot_eager")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # infeasible budgets are recorded, not printed
        rows += [measure(b) for b in BUDGETS]
    for r in rows:
        print(
            f"{r['backend']:>9} budget {str(r['budget']):>9}: measured {r['measured_peak_bytes']:>9}"
            + (
                f"  step budget {r['step_budget_bytes']:>9} predicted {r['predicted_peak_bytes']:>9}"
                f" within (predicted/measured) {r['within_budget_predicted']}/{r['within_budget_measured']}"
                if "step_budget_bytes" in r
                else ""
            )
        )
    reuse = [measure_reuse(None, backend="aot_eager")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for b in REUSE_BUDGETS:
            reuse += [measure_reuse(b, runtime_check="measure"), measure_reuse(b)]
    for r in reuse:
        print(
            f"reused block graph, {r['backend']:>9} budget {str(r['budget']):>9}: measured {r['measured_peak_bytes']:>9}"
            + (
                f"  first step {r['first_step_measured_peak_bytes']:>9}"
                f"  runtime_check={r['runtime_check']:<7} runs planned/measured {r['reuse_count']}/"
                f"{r['reuse_measured']} step budget {r['step_budget_bytes']:>9} planned {r['planned_peak_bytes']:>9}"
                f" feasible {r['feasible']} within (measured) {r['within_budget_measured']}"
                if "step_budget_bytes" in r
                else ""
            )
        )
    path = write_result(
        "step_budget_cpu",
        {
            "model": "graph-break MLP 2x6x64, batch 512",
            "rows": rows,
            "reuse_model": f"4 identical blocks of 3 linear+tanh {REUSE_WIDTH}, residual, {REUSE_ROWS} rows; "
            "block.compile per block (one graph run 4 times per step)",
            "reuse_rows": reuse,
        },
        torch.device("cpu"),
    )
    print(f"wrote {path}")
    ok = all(r.get("within_budget_measured", True) for r in rows if r.get("within_budget_predicted", True))
    ok = ok and all(
        r["within_budget_measured"] and r["first_step_within_budget_measured"] for r in reuse if r.get("feasible")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
