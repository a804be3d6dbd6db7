"""Dumps: readable graphs before and after each pass, the plan, the report, memory plots.

Layout of ``<dump_dir>/graph_<id>/``::

    00_partitioned.forward.py   the graphs as AOTAutograd's partitioner made them
    00_partitioned.backward.py
    05_reorder.forward.py        after the reorder and the addmm split (when they changed anything)
    05_reorder.backward.py
    07_insert_recompute.forward.py   after the recomputation (when the plan recomputes)
    07_insert_recompute.backward.py
    10_insert_transfers.forward.py   after trinity's rewrite (one pair per mutating pass)
    10_insert_transfers.backward.py
    recompute.json               the joint planner's choice: per saved activation keep/offload/
                                 recompute, the chains recomputed with their FLOPs and seconds,
                                 the solver, every candidate it scored
    liveness.json                every buffer: kind, bytes, live range, idle gap (after the
                                 recomputation, which memory.png's "without offloading" includes)
    plan.json                    the plan (evictions, copy placement, predictions)
    report.json                  the report (as offload_compiler.last_report() returns it)
    memory.png                   live device bytes over the joint schedule, before and after
    timeline.json                the simulated schedule as a Chrome trace (Perfetto, chrome://tracing)

Each graph is ``GraphModule.print_readable`` with shapes, strides and devices; nodes trinity
inserted or changed carry a ``# trinity: ...`` comment above them, and with multi-stream compute
every node carries its stream (``# trinity_stream: 1``; 0 is the caller's stream). Views
(``t``, ``view``, ``getitem``...) launch no kernel: they show the stream of the buffer they view,
which may differ from the stream of the node that reads them (a ``t(weight)`` read on stream 1
shows stream 0, where the weight was written).

    20_assign_streams.forward.py   after assign_streams (num_streams > 1): streams and events
    streams.json                 the stream plans (assignment, events, simulated times)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch.fx as fx

from .ir.meta import NOTE_KEY, STREAM_KEY
from .ir.refs import plain_dict

__all__ = ["GraphDumper"]


def readable(gm: fx.GraphModule) -> str:
    """``print_readable`` text with trinity's ``node.meta["trinity"]`` notes as comments."""
    try:
        return gm.print_readable(
            print_output=False, include_stride=True, include_device=True, additional_meta=[NOTE_KEY, STREAM_KEY]
        )
    except TypeError:  # torch without additional_meta
        text = gm.print_readable(print_output=False, include_stride=True, include_device=True)
        notes = [f"#   {n.name}: {n.meta[NOTE_KEY]}" for n in gm.graph.nodes if NOTE_KEY in n.meta]
        notes += [f"#   {n.name}: stream {n.meta[STREAM_KEY]}" for n in gm.graph.nodes if STREAM_KEY in n.meta]
        return text + ("\n# trinity notes:\n" + "\n".join(notes) + "\n" if notes else "")


class GraphDumper:
    """Writes one graph pair's dumps under ``root / f"graph_{graph_id:03d}"``."""

    def __init__(self, root: Path, graph_id: int):
        self.dir = Path(root) / f"graph_{graph_id:03d}"
        self.dir.mkdir(parents=True, exist_ok=True)

    def graphs(self, stage: str, forward: fx.GraphModule, backward: fx.GraphModule) -> None:
        (self.dir / f"{stage}.forward.py").write_text(readable(forward))
        (self.dir / f"{stage}.backward.py").write_text(readable(backward))

    def json(self, name: str, obj) -> None:
        if hasattr(obj, "__dataclass_fields__"):
            obj = plain_dict(obj)
        (self.dir / name).write_text(json.dumps(obj, indent=1, default=str))

    def text(self, name: str, text: str) -> None:
        (self.dir / name).write_text(text)

    def memory_plot(
        self,
        before: np.ndarray,
        after: np.ndarray,
        budget: int | None,
        num_fw_steps: int,
        name: str = "memory.png",
    ) -> Path:
        """Plot live device bytes per step before and after the plan (PNG)."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        mib = 2**20
        fig, ax = plt.subplots(figsize=(10, 4), dpi=110)
        steps = np.arange(len(before))
        ax.plot(steps, before / mib, label=f"without offloading (peak {before.max() / mib:.1f} MiB)", color="#999999")
        ax.plot(steps, after / mib, label=f"with the plan (peak {after.max() / mib:.1f} MiB)", color="#1f77b4")
        if budget is not None:
            ax.axhline(budget / mib, color="#d62728", linestyle="--", label=f"budget {budget / mib:.1f} MiB")
        ax.axvline(num_fw_steps - 0.5, color="#444444", linewidth=0.8)
        ax.text(num_fw_steps, ax.get_ylim()[1] * 0.97, " backward", va="top", fontsize=8)
        ax.set_xlabel("step of the joint forward→backward schedule")
        ax.set_ylabel("live device memory (MiB)")
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = self.dir / name
        fig.savefig(path)
        plt.close(fig)
        return path
