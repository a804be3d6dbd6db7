"""Shared bench plumbing: where results go and what every result records."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def device_description(device: torch.device) -> str:
    """A human-readable name of the device the numbers were measured on."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=RESULTS.parent
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=RESULTS.parent
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "unknown"


def dirty_paths() -> list[str]:
    """Tracked files with uncommitted changes (what ``+dirty`` in the commit refers to)."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=RESULTS.parent
        )
    except OSError:
        return []
    return [line[3:] for line in out.stdout.splitlines() if line.strip()]


def _busy_seconds() -> float | None:
    """CPU seconds all processes have spent busy since boot (Linux ``/proc/stat``), else ``None``."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, *rest = (int(f) for f in fields)
    steal = rest[0] if rest else 0
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_tree_seconds() -> float | None:
    """CPU seconds of this process and its live descendants (Inductor's compile workers included)."""
    try:
        parent: dict[int, int] = {}
        cpu: dict[int, float] = {}
        tick = os.sysconf("SC_CLK_TCK")
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            rest = stat[stat.rindex(")") + 2 :].split()
            parent[int(entry)] = int(rest[1])
            cpu[int(entry)] = (int(rest[11]) + int(rest[12]) + int(rest[13]) + int(rest[14])) / tick
    except OSError:
        return None
    me, total = os.getpid(), 0.0
    for pid in cpu:
        p, seen = pid, 0
        while p and p != me and seen < 64:
            p, seen = parent.get(p, 0), seen + 1
        if p == me:
            total += cpu[pid]
    return total


class OtherLoad:
    """Measures how much of the machine's CPU other processes used while a block ran: a fraction
    of all cores over the wall time (0 = nothing else ran). ``None`` where ``/proc`` is missing.

    ``with OtherLoad() as load: ...`` then ``load.fraction``.
    """

    def __enter__(self) -> OtherLoad:
        self.fraction: float | None = None
        self._t0 = time.perf_counter()
        self._busy0, self._own0 = _busy_seconds(), _own_tree_seconds()
        return self

    def __exit__(self, *exc) -> None:
        busy, own = _busy_seconds(), _own_tree_seconds()
        wall = time.perf_counter() - self._t0
        if None in (busy, own, self._busy0, self._own0) or wall <= 0:
            return
        others = (busy - self._busy0) - (own - self._own0)
        self.fraction = max(0.0, others) / (wall * (os.cpu_count() or 1))


def write_result(name: str, payload: dict, device: torch.device) -> Path:
    """Write ``bench/results/<name>.json`` with the device, torch version, command and commit
    (``name`` may contain ``/``: sub-folders are made)."""
    record = {
        "benchmark": name,
        "device": device_description(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join([Path(sys.executable).name, "-m", "bench"] + sys.argv[1:])
        if sys.argv[0].endswith("__main__.py")
        else " ".join(sys.argv),
        "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **payload,
    }
    path = RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path
