"""Readable results: ``bench/results/README.md`` (tables, targets) and one frontier PNG per model.

Everything here is generated from the JSON files under ``bench/results/`` (``runs/<device
type>/<model>/<method>.json``, ``suite_<device type>.json``, the planner benches' files), so
``python -m bench.report`` regenerates it without running anything. Runs from a GPU and from a CPU
stay in separate sections, each saying which it is.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from . import common

__all__ = ["load_runs", "write_report", "cpu_targets", "gpu_targets", "main"]

MODEL_ORDER = ("gpt", "llama", "vit", "resnet")
BUSY = 0.10  # other processes' share of the CPU above which a run's times are flagged
HONESTY_CPU = (
    "**CPU runs say nothing about overlap.** Without a GPU the CPU plays the device: an offloading method's "
    "copies (trinity's, `save_on_cpu`'s) are memcpy within the same host memory, synchronous, with nothing to "
    "overlap them with, and PyTorch's in-tree offloading is a no-op (its `device_put(cpu)` of a CPU tensor is the "
    "identity). Step times and the ratios built on them show what each method costs on a CPU, not what it would "
    "cost on a GPU. Peak memory is the project's accounting of device allocations (host copies excluded), "
    "which is meaningful on CPU too."
)


def load_runs(results: Path | None = None) -> list[dict]:
    """Every per-run JSON under ``results/runs`` (default ``bench/results``)."""
    root = (results or common.RESULTS) / "runs"
    runs = []
    for path in sorted(root.glob("*/*/*.json")):
        try:
            run = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        run["_path"] = str(path.relative_to(root.parent))
        runs.append(run)
    return runs


def _mib(n) -> str:
    return "–" if n is None else f"{n / 2**20:.1f} MiB"


def _x(r) -> str:
    return "–" if r is None else f"{r:.2f}x"


def _ms(s) -> str:
    return "–" if s is None else (f"{s * 1e3:.0f} ms" if s >= 0.1 else f"{s * 1e3:.1f} ms")


def _group(runs: list[dict]) -> dict[str, dict[str, list[dict]]]:
    out: dict[str, dict[str, list[dict]]] = {}
    for run in runs:
        out.setdefault(run["device_type"], {}).setdefault(run["model"]["name"], []).append(run)
    order = {"eager": 0, "compile": 1, "checkpoint": 2, "sac": 3, "save_on_cpu": 4, "torch-offload": 5}
    for models in out.values():
        for rows in models.values():
            rows.sort(key=lambda r: (order.get(r["method"]["family"], 6), r["method"]["family"], _budget_key(r)))
    return out


def _budget_key(run: dict) -> float:
    b = run["method"].get("budget") or ""
    try:
        return float(b.rstrip("%"))
    except ValueError:
        return math.inf


def _note(run: dict) -> str:
    if not run.get("ok"):
        return f"**failed**: {run.get('error', '?')[:200]}"
    parts = []
    t = run.get("trinity")
    if t:
        if t.get("num_graphs", 0) == 0:
            parts.append("**trinity compiled no graph**")
        elif not t.get("feasible"):
            parts.append(
                f"budget {_mib(t.get('budget_bytes'))} infeasible (lowest reachable "
                f"{_mib(t.get('lowest_reachable_peak_bytes'))}; on_infeasible='warn' runs the lowest-peak plan): "
                f"measured peak {'within' if t.get('within_budget') else 'over'} the budget"
            )
            parts.append(f"planned {_mib(t.get('planned_peak_bytes'))}, evicted {_mib(t.get('evicted_bytes'))}")
        else:
            within = t.get("within_budget")
            mark = {True: "within", False: "**OVER (a trinity bug)**", None: "?"}[within]
            parts.append(f"budget {_mib(t.get('budget_bytes'))}: measured peak {mark} it")
            parts.append(f"planned {_mib(t.get('planned_peak_bytes'))}, evicted {_mib(t.get('evicted_bytes'))}")
        if t.get("num_graphs", 1) > 1:
            parts.append(f"{t['num_graphs']} graphs")
    ref = run.get("vs_reference")
    if ref:
        parts.append(f"vs {ref['key']}: peak {_x(ref['peak'])}, step {_x(ref['step'])}")
    if run.get("problem"):
        parts.append(f"**{run['problem']}**")
    busy = run.get("other_cpu_load")
    if busy is not None and busy > BUSY:
        parts.append(f"**busy machine: other processes used {busy:.0%} of the CPU during the timed steps**")
    if run["device_type"] == "cpu" and run["method"].get("cpu_note"):
        parts.append(run["method"]["cpu_note"])
    return "; ".join(parts)


def _table(rows: list[dict]) -> list[str]:
    steps = rows[0]["config"]["steps"]
    lines = [
        f"| method | peak memory | vs eager | median step | vs eager | compile | loss after {steps} steps "
        "| vs eager (rel. diff.) | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ve = r.get("vs_eager") or {}
        ok = r.get("ok")
        compile_s = r.get("compile_seconds")
        lines.append(
            "| "
            + " | ".join(
                [
                    r["method"]["label"],
                    _mib(r.get("peak_bytes")) if ok else "–",
                    "1.00x" if r["method"]["key"] == "eager" and ok else _x(ve.get("peak")),
                    _ms(r.get("median_step_seconds")) if ok else "–",
                    "1.00x" if r["method"]["key"] == "eager" and ok else _x(ve.get("step")),
                    "–" if compile_s is None else f"{compile_s:.1f} s",
                    f"{r['final_loss']:.4f}" if ok else "–",
                    "–" if not ve else f"{ve['loss_rel_diff']:.1e}",
                    _note(r).replace("|", "\\|"),
                ]
            )
            + " |"
        )
    return lines


def cpu_targets(models: dict[str, list[dict]], paired: dict[str, dict] | None = None) -> list[dict]:
    """Per model: trinity at 50% (Inductor inside) against plain Inductor. Targets: measured peak
    within the budget; step time within 1.3x.

    ``paired``: per model, the side-by-side measurement of ``bench.step_ratio`` (trinity-50% and
    Inductor stepped alternately); when given, its paired ratio decides the step target
    (``step_ratio``) and the suite's ratio of separately timed runs is kept as
    ``sequential_step_ratio``."""
    paired = paired or {}
    out = []
    for name, rows in models.items():
        by_key = {r["method"]["key"]: r for r in rows}
        tri, ind = by_key.get("trinity-50%"), by_key.get("inductor")
        if not tri or not ind:
            continue
        if not tri.get("ok") or not ind.get("ok"):
            out.append({"model": name, "error": tri.get("error") or ind.get("error")})
            continue
        t = tri.get("trinity") or {}
        sequential = tri["median_step_seconds"] / ind["median_step_seconds"]
        pair = paired.get(name)
        ratio = pair["ratio"] if pair else sequential
        out.append(
            {
                "model": name,
                "peak_bytes": tri["peak_bytes"],
                "budget_bytes": t.get("budget_bytes"),
                "within_budget": t.get("within_budget"),
                "step_ratio": ratio,
                "step_ratio_iqr": (pair["ratio_q1"], pair["ratio_q3"]) if pair else None,
                "sequential_step_ratio": sequential,
                "step_ok": ratio <= 1.3,
            }
        )
    return out


def gpu_targets(models: dict[str, list[dict]], tolerance: float = 0.05) -> list[dict]:
    """Per model, from a GPU run: (1) at the budget where trinity's step is within 5% of Inductor's
    (the lowest-peak such trinity run), its peak is at most that of every other method within 5% of
    Inductor's step; (2) at the lowest peak any other method reaches, the fastest trinity run that
    reaches it is faster than every other method that does."""
    out = []
    for name, rows in models.items():
        ok = [r for r in rows if r.get("ok")]
        ind = next((r for r in ok if r["method"]["key"] == "inductor"), None)
        tri = [r for r in ok if r["method"]["family"] == "trinity"]
        others = [r for r in ok if not r["method"]["family"].startswith("trinity")]
        if ind is None or not tri:
            continue
        limit = ind["median_step_seconds"] * (1 + tolerance)
        fast_tri = sorted((r for r in tri if r["median_step_seconds"] <= limit), key=lambda r: r["peak_bytes"])
        fast_others = [r for r in others if r["median_step_seconds"] <= limit]
        res = {"model": name}
        if fast_tri:
            best = fast_tri[0]
            worst_other = min(fast_others, key=lambda r: r["peak_bytes"]) if fast_others else None
            res["t1"] = {
                "trinity": best["method"]["key"],
                "trinity_peak": best["peak_bytes"],
                "best_other": worst_other["method"]["key"] if worst_other else None,
                "best_other_peak": worst_other["peak_bytes"] if worst_other else None,
                "met": worst_other is None or best["peak_bytes"] <= worst_other["peak_bytes"],
            }
        else:
            res["t1"] = {"met": False, "why": "no trinity budget within 5% of Inductor's step time"}
        if others:
            lowest = min(r["peak_bytes"] for r in others)
            reach_tri = [r for r in tri if r["peak_bytes"] <= lowest]
            reach_other = [r for r in others if r["peak_bytes"] <= lowest]
            if reach_tri:
                t = min(reach_tri, key=lambda r: r["median_step_seconds"])
                o = min(reach_other, key=lambda r: r["median_step_seconds"])
                res["t2"] = {
                    "lowest_peak": lowest,
                    "trinity": t["method"]["key"],
                    "trinity_step": t["median_step_seconds"],
                    "fastest_other": o["method"]["key"],
                    "other_step": o["median_step_seconds"],
                    "met": t["median_step_seconds"] < o["median_step_seconds"],
                }
            else:
                res["t2"] = {"met": False, "lowest_peak": lowest, "why": "no trinity run reaches that peak"}
        out.append(res)
    return out


def frontier_png(device_type: str, model: str, rows: list[dict], path: Path) -> Path | None:
    """Peak memory against median step time, one point per method; trinity's budgets joined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("ok")]
    if not ok:
        return None
    colors = {
        "eager": "black",
        "compile": "tab:gray",
        "checkpoint": "tab:blue",
        "sac": "tab:purple",
        "save_on_cpu": "tab:orange",
        "torch-offload": "tab:brown",
        "trinity": "tab:red",
        "trinity-eager": "tab:pink",
    }
    fig, ax = plt.subplots(figsize=(9, 5.5))
    markers = "osD^vPX*"
    for family in dict.fromkeys(r["method"]["family"] for r in ok):
        pts = sorted(
            (
                (r["median_step_seconds"] * 1e3, r["peak_bytes"] / 2**20, r)
                for r in ok
                if r["method"]["family"] == family
            ),
            key=lambda p: p[1],
        )
        color = colors.get(family, "tab:green")
        if family.startswith("trinity") and len(pts) > 1:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", color=color, alpha=0.6)
        for i, (x, y, r) in enumerate(pts):
            ax.plot(x, y, markers[i % len(markers)], color=color, markersize=8, label=r["method"]["label"])
            if family.startswith("trinity"):
                ax.annotate(r["method"]["budget"], (x, y), textcoords="offset points", xytext=(6, -3), fontsize=7)
    ax.set_xlabel("median step time (ms)" + (" — CPU: no overlap, see README" if device_type == "cpu" else ""))
    ax.set_ylabel("peak device memory, one forward+backward (MiB)")
    dev = ok[0]["device"]
    ax.set_title(f"{model}: memory/speed frontier ({'GPU' if device_type == 'cuda' else 'CPU'} run, {dev})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _suite_meta(device_type: str, results: Path) -> dict | None:
    path = results / f"suite_{device_type}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _planner_section(results: Path) -> list[str]:
    lines = []
    try:
        pt = json.loads((results / "planner_time.json").read_text())
        rows = ", ".join(
            f"{r['layers']} layers ({r.get('device_figures', 'host figures')}): plan_window "
            f"{r['plan_window_seconds']:.3f} s, all passes {r['all_passes_seconds']:.2f} s"
            for r in pt["rows"]
        )
        lines.append(f"- planner time (`planner_time.json`, {pt['device']}, {pt['git_commit']}): {rows}")
    except (OSError, json.JSONDecodeError, KeyError):
        pass
    try:
        p7 = json.loads((results / "plan_llama7b.json").read_text())
        lines.append(
            f"- planning llama-7b, batch 1, seq 4096, bf16 (`plan_llama7b.json`, {p7['device']}, {p7['git_commit']}): "
            f"{p7['wall_seconds']:.1f} s wall, max RSS {p7['max_rss_bytes'] / 2**30:.2f} GiB"
        )
    except (OSError, json.JSONDecodeError, KeyError):
        pass
    return lines


def _paired_ratios(results: Path, device_type: str) -> dict[tuple[str, str], dict]:
    """``bench.step_ratio``'s pairs from ``step_ratio_<device type>.json``, by (model, trinity key);
    empty when the file is missing."""
    path = results / f"step_ratio_{device_type}.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {(p["model"], p["trinity"]): p for p in data.get("pairs", [])}


def write_report(results: Path | None = None) -> Path:
    """Write ``results/README.md`` and the frontier PNGs from the JSON files; returns the README."""
    results = results or common.RESULTS
    runs = load_runs(results)
    grouped = _group(runs)
    out = [
        "# trinity benchmarks",
        "",
        "Generated by `python -m bench` (`make bench`) from the JSON files in this folder; "
        "`python -m bench.report` regenerates it. Each method trains the same model from the same initial weights "
        "on the same batches in one process; ratios are to eager from that same process.",
        "",
    ]
    if not grouped:
        out.append("No suite results yet: run `make bench`.")
    device_order = sorted(grouped, key=lambda d: 0 if d == "cuda" else 1)
    for device_type in device_order:
        models = grouped[device_type]
        meta = _suite_meta(device_type, results)
        any_run = next(iter(next(iter(models.values()))))
        kind = "GPU run" if device_type == "cuda" else "CPU run (no GPU: see the note)"
        out += [f"## {kind}: {any_run['device']}", ""]
        if meta:
            out.append(
                f"Measured on: {meta['device']}, torch {meta['torch']}, Python {meta['python']}, commit "
                f"{meta['git_commit']}, {meta['date']}; command `{meta['command']}`; whole command "
                f"{meta['wall_seconds'] / 60:.1f} min ({meta.get('suite_seconds', 0) / 60:.1f} min of it the "
                "methods × models suite)."
            )
        else:
            out.append(
                f"Measured on: {any_run['device']}, torch {any_run['torch']}, commit {any_run['git_commit']}, "
                f"{any_run['date']}."
            )
        if meta and meta.get("dirty_paths"):
            out.append(f"Uncommitted changes in the measured tree: {', '.join(meta['dirty_paths'])}.")
        loads = [r["other_cpu_load"] for m in models.values() for r in m if r.get("other_cpu_load") is not None]
        if loads:
            out.append(
                f"Other processes' share of the machine's CPU during the timed steps: median {sorted(loads)[len(loads) // 2]:.0%}, "
                f"max {max(loads):.0%} (runs above {BUSY:.0%} are flagged in their notes)."
            )
        sessions = {r.get("session", {}).get("id") for m in models.values() for r in m}
        if len(sessions) > 1:
            out.append(f"These tables mix {len(sessions)} suite invocations (each run's JSON says which).")
        out.append("")
        if device_type == "cpu":
            out += [f"> {HONESTY_CPU}", ""]
        cfg = any_run["config"]
        out += [
            f"Per run: {cfg['steps']} training steps with {any_run['optimizer']}, seed {cfg['seed']}; median step time "
            f"over steps {cfg['warmup'] + 1}..{cfg['steps']} (forward, backward, optimizer step); compile time = first "
            "step minus the median step (Inductor's FX-graph and AOTAutograd caches off, its on-disk kernel build "
            "cache as found, so a kernel built by an earlier run is not rebuilt); peak memory: "
            f"{any_run['peak_counts']} ({any_run.get('peak_accounting', '')}).",
            "",
        ]
        for name in sorted(models, key=lambda m: MODEL_ORDER.index(m) if m in MODEL_ORDER else 99):
            rows = models[name]
            first = rows[0]["model"]
            out += [
                f"### {name}: {first['description']}",
                "",
                f"{first['source']}; {first['num_params'] / 1e6:.2f} M parameters. "
                f"Frontier: [`frontier_{device_type}_{name}.png`](frontier_{device_type}_{name}.png).",
                "",
            ]
            out += _table(rows)
            out.append("")
            frontier_png(device_type, name, rows, results / f"frontier_{device_type}_{name}.png")
        out += ["### Targets", ""]
        if device_type == "cpu":
            paired = _paired_ratios(results, "cpu")
            for t in cpu_targets(models, {m: p for (m, key), p in paired.items() if key == "trinity-50%"}):
                if "error" in t:
                    out.append(f"- {t['model']}: not evaluated, a run failed: {t['error']}")
                    continue
                how = (
                    f"paired, stepped alternately with it (`bench.step_ratio`; quartiles {t['step_ratio_iqr'][0]:.2f}–"
                    f"{t['step_ratio_iqr'][1]:.2f}; {t['sequential_step_ratio']:.2f}x from the separately timed rows above)"
                    if t["step_ratio_iqr"]
                    else "from the separately timed rows above"
                )
                out.append(
                    f"- {t['model']}, trinity 50% (Inductor) vs torch.compile (Inductor): measured peak "
                    f"{_mib(t['peak_bytes'])} against a budget of {_mib(t['budget_bytes'])}: "
                    f"{'**met**' if t['within_budget'] else '**not met**'}; step time {t['step_ratio']:.2f}x, {how} "
                    f"(target ≤ 1.3x): {'**met**' if t['step_ok'] else '**not met**'}."
                )
            for (m, key), p in paired.items():
                if key != "trinity-50%":
                    out.append(
                        f"- {m}, {key} vs {p['reference']} (paired): step time {p['ratio']:.2f}x (quartiles "
                        f"{p['ratio_q1']:.2f}–{p['ratio_q3']:.2f})."
                    )
            out.append(
                "- GPU targets (trinity's peak at Inductor's speed; fastest at the lowest peak): not evaluable "
                "from a CPU run."
            )
        else:
            for t in gpu_targets(models):
                t1, t2 = t.get("t1", {}), t.get("t2", {})
                line1 = (
                    f"{t1['trinity']} peak {_mib(t1['trinity_peak'])} vs lowest other within 5% "
                    f"({t1['best_other']}) {_mib(t1['best_other_peak'])}"
                    if "trinity" in t1
                    else t1.get("why", "")
                )
                line2 = (
                    f"lowest other peak {_mib(t2['lowest_peak'])}: {t2['trinity']} {_ms(t2['trinity_step'])} vs "
                    f"{t2['fastest_other']} {_ms(t2['other_step'])}"
                    if "trinity" in t2
                    else t2.get("why", "")
                )
                out.append(
                    f"- {t['model']}: at Inductor's speed (±5%): {'**met**' if t1.get('met') else '**not met**'} "
                    f"({line1}); at the lowest peak: {'**met**' if t2.get('met') else '**not met**'} ({line2})."
                )
        out.append("")
    if "cuda" not in grouped:
        out += ["No GPU run is recorded here: every figure above is from a CPU.", ""]
    planner = _planner_section(results)
    if planner:
        out += ["## Planner benches", ""] + planner + [""]
    out += [
        "## Files",
        "",
        "- `runs/<device type>/<model>/<method>.json`: one per run (device, torch, command, commit, every step's "
        "time and loss, the peak, trinity's report figures, warnings, errors).",
        "- `suite_<device type>.json`: the suite invocation (command, wall time, models and methods).",
        "- `peak_vs_budget_<inner>_<device type>.json`: the GPT rows of trinity against the same inner compiler "
        "(the older per-bench file, now written from the suite's runs).",
        "- `step_ratio_<device type>.json`: trinity and its inner compiler stepped alternately in one process "
        "(`python -m bench.step_ratio`), the paired step-time ratios the step target is judged on.",
        "- `frontier_<device type>_<model>.png`, `planner_time.json`, `plan_llama7b.json`.",
        "",
    ]
    path = results / "README.md"
    path.write_text("\n".join(out))
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="regenerate bench/results/README.md and the frontier PNGs")
    parser.parse_args(argv)
    print(f"written {write_report()}")


if __name__ == "__main__":
    main()
