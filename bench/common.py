"""Shared bench plumbing: where results go and what every result records."""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

from offload_compiler.host_load import OtherLoad  # noqa: F401  (re-exported for the benches)

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
