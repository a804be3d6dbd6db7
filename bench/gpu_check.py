"""The prepared GPU check: everything a lent GPU should show, in one run of under 8 minutes.

``bench/gpu_check.sh`` runs this (``python -m bench.gpu_check``); each part runs in its own
process with its own time limit, under one deadline for the whole check, so that a part that
crashes the CUDA context or hangs costs only its own share. The parts:

1. ``cuda_tests``: ``pytest tests/test_cuda.py`` (the CUDA-only tests; without CUDA each test
   skips itself);
2. ``demo``: ``python -m offload_compiler demo`` on CUDA (exit status 1 when the losses disagree
   or the measured peak is over the budget);
3. ``calibrate``: ``python -m offload_compiler calibrate`` (the figures are kept in the result and
   passed to part 5);
4. ``step_ratio``: the paired step-time ratio of trinity against Inductor at a 50% budget
   (:func:`bench.step_ratio.measure_pair`, GPT);
5. ``predicted_vs_measured``: the demo's model at budgets 100%, 50% and 25%: the planner's
   predicted step time (forward and backward) and peak against the measured ones, with the
   runtime check's own measurement and correction. The steps are timed after the runtime check
   of the first steps has finished (:func:`warm_up_until_checked`: its measured steps and
   replans are profiled steps and recompiles, seconds each with Inductor), warm-up bounded by
   :data:`CHECK_WARMUP_MAX_STEPS`.

Without CUDA the check is a dry run on the CPU: the same parts, shrunk (``--quick`` or
``TRINITY_GPU_CHECK_QUICK=1`` shrinks them on any device), with ``inner="eager"`` where Inductor's
compile would take minutes on a small CPU; the result's ``skipped`` says what did not run as on
a GPU. Nothing is installed: the machine's own torch is used (see ``bench/gpu_check.sh``).

Writes one JSON (default ``bench/results/gpu_check_<device type>.json``) with the device, torch
version, command and commit, and every part's status, time, command and result.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import torch

from .common import RESULTS, device_description, git_commit

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("cuda_tests", "demo", "calibrate", "step_ratio", "predicted_vs_measured")
# Seconds each part may take on a GPU (their sum stays under the 8 minutes with start-up); the
# whole check also stops at --deadline.
LIMITS = {"cuda_tests": 150, "demo": 90, "calibrate": 45, "step_ratio": 90, "predicted_vs_measured": 110}
BUDGETS = ("100%", "50%", "25%")
# The most warm-up steps part 5 runs while waiting for the runtime check to finish: its first
# measured step, up to step_check.MAX_REPLANS replans (each measured at its own step, a recompile
# with Inductor: about a second each on an H200), up to step_check._ATTEMPTS tries at steps it
# could not measure, and the step that shows nothing more changed.
CHECK_WARMUP_MAX_STEPS = 10

__all__ = ["check_finished", "main", "run_part", "warm_up_until_checked"]


def _python() -> list[str]:
    return [sys.executable]


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int | None, str, float]:
    """``(exit status or None on timeout, output, seconds)``."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, timeout), env={**os.environ, **(env or {})}
        )
        return p.returncode, p.stdout + p.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, out, time.perf_counter() - t0


# ------------------------------------------------------------------------------ in-process parts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def part_step_ratio(device: torch.device, quick: bool, calibration: str | None) -> dict:
    from .step_ratio import measure_pair

    key = "trinity-50%" if device.type == "cuda" else "trinity-eager-50%"
    size = "tiny" if quick else "cpu"
    row = measure_pair("gpt", key, rounds=2 if quick else 8, warmup=1 if quick else 3, device=device, size=size)
    return {"size_preset": size, **row}


def part_predicted_vs_measured(device: torch.device, quick: bool, calibration: str | None) -> dict:
    import offload_compiler
    from offload_compiler import measure_peak_device_bytes
    from offload_compiler.demo import Batches, _LossModel, load_corpus
    from offload_compiler.models import GPT, GPTConfig

    # The demo's defaults; quick: a smaller GPT, with every saved activation a candidate (the default
    # min_offload_bytes of 1 MiB would leave it nothing to evict).
    layers, width, seq, batch_size = (2, 64, 64, 4) if quick else (4, 128, 128, 16)
    inner = "inductor" if device.type == "cuda" else "eager"
    cfg = GPTConfig(vocab_size=256, block_size=seq, n_layer=layers, n_head=4, n_embd=width)
    batches = Batches(load_corpus(1 << 20), batch_size, seq, seed=0)
    warmup, timed = (2, 1) if quick else (3, 10)
    rows = []
    for budget in BUDGETS:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = _LossModel(GPT(cfg)).to(device)
        options = {"memory_budget": budget, "inner": inner, "on_infeasible": "warn"}
        if quick:
            options["min_offload_bytes"] = 0
        if calibration:
            options["calibration"] = calibration
        before = len(offload_compiler.reports())
        compiled = torch.compile(model, backend="trinity", options=options)

        def one_step(step: int, compiled=compiled, model=model) -> float:
            x, y = batches.batch(step, device)
            _sync(device)
            t0 = time.perf_counter()
            compiled(x, y).backward()
            _sync(device)
            model.zero_grad(set_to_none=True)
            return time.perf_counter() - t0

        def reps_now(before=before) -> list:
            return list(offload_compiler.reports()[before:])

        times = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warmup_times, settled_at = warm_up_until_checked(one_step, reps_now, warmup, CHECK_WARMUP_MAX_STEPS)
            reps_timed = reps_now()
            for _ in range(timed):
                times.append(one_step(len(warmup_times) + len(times)))
            timed_after_check = check_finished(reps_timed, reps_now())
        x, y = batches.batch(len(warmup_times) + timed, device)
        own = list(model.parameters()) + [x, y]
        if device.type == "cuda":
            _sync(device)
            other = torch.cuda.memory_allocated(device) - sum(t.numel() * t.element_size() for t in own)
            m = measure_peak_device_bytes(lambda c=compiled, x=x, y=y: c(x, y).backward(), device=device)
            peak = m.peak_bytes - other
        else:
            m = measure_peak_device_bytes(lambda c=compiled, x=x, y=y: c(x, y).backward(), resident=own, device=device)
            peak = m.peak_bytes
        model.zero_grad(set_to_none=True)
        reps = offload_compiler.reports()[before:]
        budget_bytes = sum(r.budget_bytes for r in reps if r.budget_bytes is not None) if reps else None
        predicted = sum(r.predicted_step_seconds for r in reps)
        planned = sum(r.peak_bytes_planned for r in reps)
        measured_t = statistics.median(times)
        rows.append(
            {
                "budget": budget,
                "inner": inner,
                "num_graphs": len(reps),
                "feasible": all(r.feasible for r in reps),
                "budget_bytes": budget_bytes,
                "num_evicted": sum(r.num_evicted for r in reps),
                "planned_peak_bytes": planned,
                "measured_peak_bytes": peak,
                "measured_over_planned_peak": peak / planned if planned else None,
                "over_budget_bytes": None if budget_bytes is None else max(0, peak - budget_bytes),
                "runtime_check_measured_peak_bytes": [r.measured_peak_bytes for r in reps],
                "runtime_check_correction": [
                    None
                    if r.correction is None
                    else {
                        "replans": r.correction.replans,
                        "margins": len(r.correction.margins),
                        "total_margin_bytes": r.correction.total_margin_bytes,
                    }
                    for r in reps
                ],  # fmt: skip
                "predicted_step_seconds": predicted,
                "measured_step_seconds_median": measured_t,
                "measured_over_predicted_step": measured_t / predicted if predicted else None,
                "timed_steps": len(times),
                "warmup_steps": len(warmup_times),
                "warmup_step_seconds": warmup_times,
                # The runtime check: the number of warm-up steps after which it had finished
                # (None: not within CHECK_WARMUP_MAX_STEPS), and whether it had finished before
                # the timed steps (every report measured, none replaced while they ran).
                "runtime_check_finished_after_steps": settled_at,
                "timed_after_runtime_check": timed_after_check,
                "device_figures": reps[0].device_name if reps else None,
                "warnings": sorted({str(w.message)[:300] for w in caught}),
            }
        )
    return {
        "model": f"demo GPT: {layers} layers, width {width}, seq {seq}, batch {batch_size}, byte vocab",
        "step": "forward and backward (the optimizer is outside trinity's graphs)",
        "calibration": calibration,
        "rows": rows,
    }


def warm_up_until_checked(
    one_step: Callable[[int], float], reports_now: Callable[[], list], min_steps: int, max_steps: int
) -> tuple[list[float], int | None]:
    """Warm up a compiled training step until the runtime check of its first steps has finished
    (:func:`check_finished`): its measured steps are profiled and its replans recompile (with
    Inductor, about a second each), so a step timed before it finishes is not the steady state
    the plan predicts.

    Args:
        one_step: runs training step ``i`` (forward and backward), returns its seconds.
        reports_now: the compile's current reports (``offload_compiler.reports()`` from its first).
        min_steps: warm-up steps to run in any case.
        max_steps: the most to run while the check has not finished.

    Returns:
        ``(seconds of each warm-up step, the number of warm-up steps after which the check had
        finished, or None when it had not within max_steps)``.

    Raises:
        ValueError: when ``min_steps`` < 0 or ``max_steps`` < ``min_steps``.
    """
    if min_steps < 0 or max_steps < min_steps:
        raise ValueError(
            f"warm-up steps: need 0 <= min_steps <= max_steps, got min_steps={min_steps}, max_steps={max_steps}"
        )
    seconds: list[float] = []
    settled_at = None
    while len(seconds) < min_steps or (settled_at is None and len(seconds) < max_steps):
        before = reports_now()
        seconds.append(one_step(len(seconds)))
        if settled_at is None and check_finished(before, reports_now()):
            settled_at = len(seconds)
    return seconds, settled_at


def check_finished(before: list, after: list) -> bool:
    """Whether the runtime check of the first steps (``offload_compiler/step_check.py``) had
    finished for every pair before a step whose report log went from ``before`` to ``after``:
    every report measured (``measured_peak_bytes``) and none replaced during the step. The check
    replaces a pair's report when it measures a step (the measured peak) and when it replans (a
    new plan, measured again at that step); a step that replaces none ran with no check left to
    do, and the later steps run those plans unmeasured."""
    return (
        bool(after)
        and len(after) == len(before)
        and all(a is b for a, b in zip(after, before))
        and all(r.measured_peak_bytes is not None for r in after)
    )


IN_PROCESS = {"step_ratio": part_step_ratio, "predicted_vs_measured": part_predicted_vs_measured}


def run_part(name: str, device: str, quick: bool, calibration: str | None, out: str) -> int:
    """Run one in-process part and write ``{"result": ...}`` or ``{"error": ...}`` to ``out``."""
    try:
        result = {"result": IN_PROCESS[name](torch.device(device), quick, calibration)}
        status = 0
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        status = 1
    Path(out).write_text(json.dumps(result, indent=1, default=str))
    return status


# ------------------------------------------------------------------------------ the check


def _junit_counts(path: Path) -> dict:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in counts:
            counts[k] += int(s.get(k, 0))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for s in suites
        for case in s.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {**counts, "failed_tests": failed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/gpu_check.sh", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="shrink every part (also TRINITY_GPU_CHECK_QUICK=1)")
    parser.add_argument("--out", default=None, help="the JSON to write (default bench/results/gpu_check_<device>.json)")
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds for the whole check (default 450 on CUDA; 1200 for a dry run on a CPU, which is slower)",
    )
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ", ".join(PARTS))
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # internal: run one in-process part
    parser.add_argument("--device", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--calibration", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--part-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick or os.environ.get("TRINITY_GPU_CHECK_QUICK", "") not in ("", "0")
    if args.part:
        return run_part(args.part, args.device, quick, args.calibration, args.part_out)

    t_start = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dry = not cuda
    deadline = args.deadline if args.deadline is not None else (450.0 if cuda else 1200.0)
    wanted = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(wanted) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; known: {', '.join(PARTS)}")
    scale = 0.5 if quick else 1.0
    work = Path(tempfile.mkdtemp(prefix="trinity_gpu_check_"))
    parts: dict[str, dict] = {}
    skipped: list[str] = []
    calibration_file: str | None = None

    def remaining(part: str) -> float:
        return min(LIMITS[part] * (1 if cuda else 4) * scale, deadline - (time.perf_counter() - t_start))

    for name in PARTS:
        if name not in wanted:
            skipped.append(f"{name}: not asked for (--parts)")
            continue
        limit = remaining(name)
        if limit < 5:
            parts[name] = {"status": "skipped", "note": "the check's deadline was reached"}
            skipped.append(f"{name}: deadline reached")
            continue
        entry: dict = {}
        if name == "cuda_tests":
            xml = work / "cuda_tests.xml"
            cmd = _python() + [
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "tests/test_cuda.py",
                f"--junitxml={xml}",
            ]
            rc, out, secs = _run(cmd, limit)
            counts = _junit_counts(xml) if xml.exists() else {}
            entry = {"command": " ".join(cmd[1:]), "exit_status": rc, "tests": counts, "output_tail": _tail(out)}
            if rc is None:
                entry["status"] = "timeout"
            elif counts and counts["tests"] == counts["skipped"]:
                entry["status"] = "skipped"
                skipped.append(f"cuda_tests: no CUDA, all {counts['tests']} tests skipped themselves")
            else:
                entry["status"] = "ok" if rc == 0 else "failed"
        elif name == "demo":
            demo_args = ["--device", device.type, "--dump-dir", str(work / "dumps")]
            # The demo's model (at the default min_offload_bytes a smaller one has nothing to evict).
            demo_args += ["--steps", "2" if quick else ("5" if dry else "20")]
            if dry:
                demo_args += ["--inner", "eager"]
            cmd = _python() + ["-m", "offload_compiler", "demo", *demo_args]
            rc, out, secs = _run(cmd, limit, env={"COLUMNS": "160"})
            entry = {"command": " ".join(cmd[1:]), "exit_status": rc, "output_tail": _tail(out, 40)}
            entry["status"] = "timeout" if rc is None else ("ok" if rc == 0 else "failed")
            if dry:
                skipped.append("demo on CUDA: ran on the CPU instead, with inner='eager' and fewer steps")
        elif name == "calibrate":
            target = work / "calibration.json"
            cmd = _python() + ["-m", "offload_compiler", "calibrate", "--out", str(target)]
            if quick or dry:
                cmd.append("--quick")
            rc, out, secs = _run(cmd, limit)
            entry = {"command": " ".join(cmd[1:]), "exit_status": rc, "output_tail": _tail(out, 12)}
            entry["status"] = "timeout" if rc is None else ("ok" if rc == 0 else "failed")
            if rc == 0 and target.exists():
                entry["figures"] = json.loads(target.read_text())
                calibration_file = str(target)
            if dry:
                skipped.append("calibrate on CUDA: measured the CPU (the host as device) instead")
        else:
            target = work / f"{name}.json"
            cmd = _python() + [
                "-m",
                "bench.gpu_check",
                "--part",
                name,
                "--device",
                device.type,
                "--part-out",
                str(target),
            ]
            if quick:
                cmd.append("--quick")
            if calibration_file and name == "predicted_vs_measured":
                cmd += ["--calibration", calibration_file]
            rc, out, secs = _run(cmd, limit)
            entry = {"command": " ".join(cmd[1:]), "exit_status": rc}
            data = json.loads(target.read_text()) if target.exists() else {}
            entry.update(data)
            entry["status"] = "timeout" if rc is None else ("ok" if rc == 0 else "failed")
            if rc != 0:
                entry["output_tail"] = _tail(out)
            if dry:
                what = "trinity-eager vs aot_eager" if name == "step_ratio" else "with inner='eager'"
                skipped.append(f"{name} on CUDA: ran on the CPU instead, {what}")
        entry["seconds"] = round(secs, 1)
        parts[name] = entry
        print(f"{name:22s} {entry['status']:8s} {secs:6.1f} s", flush=True)

    commit = os.environ.get("TRINITY_COMMIT") or git_commit() or "unknown"
    record = {
        "benchmark": "gpu_check",
        "device": device_description(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "command": os.environ.get("TRINITY_GPU_CHECK_COMMAND")
        or " ".join([Path(sys.executable).name, "-m", "bench.gpu_check", *sys.argv[1:]]),
        "git_commit": commit,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "dry_run": dry,
        "quick": quick,
        "seconds": round(time.perf_counter() - t_start, 1),
        "skipped": skipped,
        "ok": all(p["status"] in ("ok", "skipped") for p in parts.values()),
        "parts": parts,
    }
    if dry:
        record["note"] = (
            "Dry run without CUDA: the figures are the CPU's (the host plays the device), not a GPU's; "
            "the CUDA-only tests skipped themselves."
        )
    path = Path(args.out) if args.out else RESULTS / f"gpu_check_{device.type}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"written {path} ({record['seconds']} s, {'ok' if record['ok'] else 'FAILED parts'})", flush=True)
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
