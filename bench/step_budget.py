"""The training step's budget across graph pairs (``offload_compiler.step_budget``), on this
machine: a model with a graph break (two graph pairs: 6 linear+tanh layers, the break, 6 more
and the loss; width 64, batch 512), trained with ``inner="eager"`` at several budgets. Per
budget: the step's measured peak (CPU allocator trace, parameters and input resident), the
step's budget as resolved, the ledger's predicted and unplanned step peaks, and per pair what it
holds; the same step compiled with ``aot_eager`` (nothing offloaded) for the unplanned measure.

Target: the measured step peak within the step's budget wherever the ledger predicts the plan
is (64 KiB of allocator slack, as in the tests). The multi-process DDP figures (4 splits) are
measured by ``tests/test_distributed.py`` (README "Distributed").

``python -m bench.step_budget``
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .common import write_result

BUDGETS = ("60%", "75%", 1_800_000, 2_000_000)
SLACK = 64 * 1024


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
    path = write_result(
        "step_budget_cpu", {"model": "graph-break MLP 2x6x64, batch 512", "rows": rows}, torch.device("cpu")
    )
    print(f"wrote {path}")
    ok = all(r.get("within_budget_measured", True) for r in rows if r.get("within_budget_predicted", True))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
