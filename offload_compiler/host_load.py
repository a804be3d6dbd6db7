"""How much of the host's CPU other processes use: the check behind ``op_times="measured"``.

Timing is only as good as the machine is quiet. Torch's CPU kernels run an OpenMP parallel region
on every core it was given (``torch.get_num_threads()``); when another process holds a core, the
region waits for a descheduled worker at every barrier. On a 2-core machine beside two test runs
a 1 MiB ``mul`` took 5-12 ms instead of 0.035 ms, and ``op_times="measured"`` predicted a 3.6 s
step for a 0.1 s one. :class:`OtherLoad` measures that load around a block; the op timing
(:mod:`.passes.op_timing`) records it and the pipeline warns when it is high
(:data:`BUSY_FRACTION`).

Source: Linux ``/proc/stat`` (the first line: jiffies all CPUs spent busy since boot, ``proc(5)``)
and ``/proc/<pid>/stat`` (``utime``, ``stime``, ``cutime``, ``cstime`` of this process and its
live descendants, Inductor's compile workers included). Elsewhere nothing is measured (``None``).
Both count in clock ticks (``SC_CLK_TCK``, usually 10 ms), so a block shorter than about 0.5 s
reads a few percent either way.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["BUSY_FRACTION", "OtherLoad", "busy_seconds", "own_tree_seconds"]

BUSY_FRACTION = 0.2
"""Other processes' share of all cores (0-1) from which measured op times are warned about: one
busy core of five, or under half a core on a 2-core machine."""


def busy_seconds() -> float | None:
    """CPU seconds all processes have spent busy since boot (user, nice, system, irq, softirq,
    steal of ``/proc/stat``), or ``None`` where ``/proc/stat`` is missing."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, *rest = (int(f) for f in fields)
    steal = rest[0] if rest else 0
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_tree_seconds() -> float | None:
    """CPU seconds of this process and its live descendants, or ``None`` where ``/proc`` is
    missing."""
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
    """How much of the machine's CPU other processes used while a block ran: ``fraction``, their
    busy CPU seconds over the block's wall time times the cores (0 = nothing else ran, 1 = every
    core busy with others). ``None`` where ``/proc`` is missing.

    ``with OtherLoad() as load: ...`` then ``load.fraction``.
    """

    def __enter__(self) -> OtherLoad:
        self.fraction: float | None = None
        self._t0 = time.perf_counter()
        self._busy0, self._own0 = busy_seconds(), own_tree_seconds()
        return self

    def __exit__(self, *exc) -> None:
        busy, own = busy_seconds(), own_tree_seconds()
        wall = time.perf_counter() - self._t0
        if None in (busy, own, self._busy0, self._own0) or wall <= 0:
            return
        others = (busy - self._busy0) - (own - self._own0)
        self.fraction = min(1.0, max(0.0, others) / (wall * (os.cpu_count() or 1)))
