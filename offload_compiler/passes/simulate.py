"""Timeline simulator: one compute stream, one D2H and one H2D copy channel, event waits.

The schedule is a sequence of steps with known durations. Copies are issued at *positions*:
position ``p`` is the gap just before step ``p`` (``0 <= p <= number of steps``). At a position,
copies are issued first (in order), then waits are served; then step ``p`` runs. A copy starts
when it is issued and its channel is free (each channel runs its copies one at a time, in issue
order) and takes ``seconds``; a wait stalls the compute stream until its copy has finished. The
stall is exposed copy time.

This is exact for that model; it is the model the planner scores plans with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["CopyTask", "CopyTiming", "Timeline", "simulate"]


@dataclass(frozen=True)
class CopyTask:
    """One copy: issued at position ``issue_pos``, waited for at position ``wait_pos``."""

    id: int
    direction: Literal["d2h", "h2d"]
    seconds: float
    issue_pos: int
    wait_pos: int


@dataclass(frozen=True)
class CopyTiming:
    id: int
    direction: str
    issue: float
    start: float
    end: float
    stall: float


@dataclass(frozen=True)
class Timeline:
    """Result of :func:`simulate` (seconds).

    Attributes:
        step_seconds: predicted time of the whole schedule (compute plus stalls).
        compute_seconds: sum of the step durations.
        exposed_seconds: total stall of the compute stream on copies.
        step_start: start time of each step.
        copies: per copy, when it was issued, started, ended, and the stall it caused.
    """

    step_seconds: float
    compute_seconds: float
    exposed_seconds: float
    step_start: tuple[float, ...]
    copies: tuple[CopyTiming, ...]


def simulate(step_seconds: Sequence[float], copies: Sequence[CopyTask]) -> Timeline:
    """Simulate the schedule (see the module docstring).

    Raises:
        ValueError: for a copy waited before it is issued, or positions out of range.
    """
    n = len(step_seconds)
    issues: dict[int, list[CopyTask]] = {}
    waits: dict[int, list[CopyTask]] = {}
    for c in copies:
        if not (0 <= c.issue_pos <= c.wait_pos <= n):
            raise ValueError(
                f"copy {c.id}: issue position {c.issue_pos} and wait position {c.wait_pos} must satisfy "
                f"0 <= issue <= wait <= {n}"
            )
        issues.setdefault(c.issue_pos, []).append(c)
        waits.setdefault(c.wait_pos, []).append(c)
    free = {"d2h": 0.0, "h2d": 0.0}
    timing: dict[int, list[float]] = {}
    t = 0.0
    exposed = 0.0
    starts = []
    for pos in range(n + 1):
        for c in issues.get(pos, ()):
            start = max(t, free[c.direction])
            end = start + c.seconds
            free[c.direction] = end
            timing[c.id] = [t, start, end, 0.0]
        for c in waits.get(pos, ()):
            end = timing[c.id][2]
            if end > t:
                timing[c.id][3] += end - t
                exposed += end - t
                t = end
        if pos < n:
            starts.append(t)
            t += step_seconds[pos]
    copies_out = tuple(CopyTiming(c.id, c.direction, *timing[c.id]) for c in sorted(copies, key=lambda c: c.id))
    return Timeline(
        step_seconds=t,
        compute_seconds=float(sum(step_seconds)),
        exposed_seconds=exposed,
        step_start=tuple(starts),
        copies=copies_out,
    )
