"""Timeline simulator: one compute stream, one D2H and one H2D copy channel, event waits.

The schedule is a sequence of steps with known durations. Copies are issued at *positions*:
position ``p`` is the gap just before step ``p`` (``0 <= p <= number of steps``). At a position,
copies are issued first (in order), then waits are served; then step ``p`` runs. A copy starts
when it is issued and its channel is free (each channel runs its copies one at a time, in issue
order) and takes ``seconds``; a wait stalls the compute stream until its copy has finished. The
stall is exposed copy time. A synchronous copy (``CopyTask.on_compute``: the device is the host CPU,
whose copies are memcpys on the compute cores) runs on the compute stream where it is issued and
is exposed in full.

This is exact for that model; it is the model the planner scores plans with.

**The optimizer update** (``offload="all"``; :class:`UpdateTask`): a third channel, the host's
update (the ``CPUOptimizer`` worker; one task per chunk of parameters, run one after the other).
A task becomes ready at its ``ready_pos`` (where ``step()`` is called, position ``n``; or, with
``overlap="backward"``, where its last gradient's copy to the host is issued) and starts once it
is ready, the channel is free and its gradients' copies (``after``) have ended. Its parameters'
fetches in the *next* step wait for it: at ``wait_pos`` of the next step the host, and with it
the compute stream, stalls until the task is done (before the copies issued there); that stall is
exposed update time. A task with ``on_compute`` (the device's own update of parameters kept on
the device, or any update when the device is the host CPU itself) runs on the compute stream at
its ready position instead: all of it is exposed. With updates the result is the steady state of
a training loop: the schedule is simulated repeatedly, each step carrying the previous step's
update end times (relative to its end) into the next, until they repeat (to within rounding:
``SETTLE_REL_TOL``); the returned timeline is that step's, from the start of its forward to the end of its backward (``step_seconds``: the
time between two ``step()`` calls).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "CopyTask",
    "CopyTiming",
    "UpdateTask",
    "UpdateTiming",
    "Timeline",
    "simulate",
    "PairTimeline",
    "ProgramStep",
    "ProgramTimeline",
    "simulate_program",
]


@dataclass(frozen=True)
class CopyTask:
    """One copy: issued at position ``issue_pos``, waited for at position ``wait_pos``.

    ``direction`` names its channel: ``"d2h"``, ``"h2d"``, or ``"allreduce"`` (a gradient
    bucket's all-reduce between the ranks, DDP with ``offload="all"``: the network's own channel).

    ``on_compute``: a synchronous copy (the device is the host CPU, see
    :attr:`.cost_model.Costs.synchronous_copies`): it runs on the compute stream where it is
    issued, after the copies issued before it there, and all of its ``seconds`` are exposed
    (its wait then finds it done). Its channel is not used.

    ``after``: ids of copies issued earlier that must end before it starts (an averaged
    gradient's copy to the host after its bucket's all-reduce). Where it runs on the compute
    stream, the compute stream waits for them first: that stall is theirs (their
    :attr:`CopyTiming.stall`)."""

    id: int
    direction: Literal["d2h", "h2d", "allreduce"]
    seconds: float
    issue_pos: int
    wait_pos: int
    on_compute: bool = False
    after: tuple[int, ...] = ()


@dataclass(frozen=True)
class CopyTiming:
    id: int
    direction: str
    issue: float
    start: float
    end: float
    stall: float


@dataclass(frozen=True)
class UpdateTask:
    """One optimizer-update task (see the module docstring); positions as for copies.

    Attributes:
        id: its number.
        seconds: its duration.
        ready_pos: where it may start (``0 <= ready_pos <= n``).
        after: ids of the copies that must end first (its gradients' copies to the host).
        wait_pos: where the next step waits for it (its parameters' first fetch); ``None``: at the
            end of the next step (its ``step()``).
        on_compute: it runs on the compute stream at ``ready_pos`` (exposed in full).
    """

    id: int
    seconds: float
    ready_pos: int
    after: tuple[int, ...] = ()
    wait_pos: int | None = None
    on_compute: bool = False


@dataclass(frozen=True)
class UpdateTiming:
    """When an update ran in the steady-state step (seconds from its start): ready, start, end;
    ``stall``: how long the next step's compute stream waits for it."""

    id: int
    ready: float
    start: float
    end: float
    stall: float


@dataclass(frozen=True)
class Timeline:
    """Result of :func:`simulate` (seconds).

    Attributes:
        step_seconds: predicted time of the whole schedule (compute plus stalls).
        compute_seconds: sum of the step durations.
        exposed_seconds: total stall of the compute stream on copies (synchronous copies in full).
        step_start: start time of each step.
        copies: per copy, when it was issued, started, ended, and the stall it caused.
        update_seconds: total optimizer-update time per step (every :class:`UpdateTask`).
        exposed_update_seconds: of it, the time the compute stream waits for (stalls on updates
            plus the ``on_compute`` tasks); included in ``step_seconds``.
        updates: per update task, its timing in the steady-state step (by id).
    """

    step_seconds: float
    compute_seconds: float
    exposed_seconds: float
    step_start: tuple[float, ...]
    copies: tuple[CopyTiming, ...]
    update_seconds: float = 0.0
    exposed_update_seconds: float = 0.0
    updates: tuple[UpdateTiming, ...] = ()


def simulate(step_seconds: Sequence[float], copies: Sequence[CopyTask], updates: Sequence[UpdateTask] = ()) -> Timeline:
    """Simulate the schedule (see the module docstring); with ``updates``, the steady state of a
    training loop.

    Raises:
        ValueError: for a copy waited before it is issued, positions out of range, or an update
            after a copy id that does not exist.
    """
    if updates:
        return _simulate_with_updates(step_seconds, copies, updates)
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
    free = {"d2h": 0.0, "h2d": 0.0, "allreduce": 0.0}
    timing: dict[int, list[float]] = {}
    t = 0.0
    exposed = 0.0
    starts = []
    for pos in range(n + 1):
        for c in issues.get(pos, ()):
            t, copy_stall = _issue(c, t, free, timing)
            exposed += copy_stall
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


def _issue(c: CopyTask, t: float, free: dict[str, float], timing: dict[int, list[float]]) -> tuple[float, float]:
    """Issue copy ``c`` at time ``t``: records its ``[issue, start, end, stall]`` in ``timing``;
    returns the compute stream's time after it and the stall it caused there (a synchronous copy
    runs on the compute stream, exposed in full; any other starts when its channel is free),
    both after the copies of ``c.after``."""
    missing = [a for a in c.after if a not in timing]
    if missing:
        raise ValueError(f"copy {c.id} is issued before the copies {missing} it must follow")
    dep = max((timing[a][2] for a in c.after), default=0.0)
    if c.on_compute:
        stall = 0.0
        if dep > t:
            last = max(c.after, key=lambda a: timing[a][2])
            timing[last][3] += dep - t
            stall, t = dep - t, dep
        timing[c.id] = [t - stall, t, t + c.seconds, c.seconds]
        return t + c.seconds, stall + c.seconds
    start = max(t, free[c.direction], dep)
    free[c.direction] = start + c.seconds
    timing[c.id] = [t, start, start + c.seconds, 0.0]
    return t, 0.0


def _simulate_with_updates(
    step_seconds: Sequence[float], copies: Sequence[CopyTask], updates: Sequence[UpdateTask]
) -> Timeline:
    n = len(step_seconds)
    ids = {c.id for c in copies}
    for c in copies:
        if not (0 <= c.issue_pos <= c.wait_pos <= n):
            raise ValueError(
                f"copy {c.id}: issue position {c.issue_pos} and wait position {c.wait_pos} must satisfy "
                f"0 <= issue <= wait <= {n}"
            )
    for u in updates:
        wait = n if u.wait_pos is None else u.wait_pos
        if not (0 <= u.ready_pos <= n and 0 <= wait <= n):
            raise ValueError(
                f"update {u.id}: ready position {u.ready_pos} and wait position {u.wait_pos} must be in 0..{n}"
            )
        if not set(u.after) <= ids:
            raise ValueError(f"update {u.id}: waits for copies {sorted(set(u.after) - ids)} that do not exist")
    issues: dict[int, list[CopyTask]] = {}
    waits: dict[int, list[CopyTask]] = {}
    for c in copies:
        issues.setdefault(c.issue_pos, []).append(c)
        waits.setdefault(c.wait_pos, []).append(c)
    ready: dict[int, list[UpdateTask]] = {}
    update_waits: dict[int, list[UpdateTask]] = {}
    # At one position the host hands its tasks to the update channel first, then queues the
    # on-compute ones (CPUOptimizer.step starts the worker, then steps the device's share).
    for u in sorted(updates, key=lambda u: u.on_compute):
        ready.setdefault(u.ready_pos, []).append(u)
        if not u.on_compute:
            update_waits.setdefault(n if u.wait_pos is None else u.wait_pos, []).append(u)

    def one_step(carry: dict[int, float]):
        """One step; ``carry``: the previous step's update end times, relative to this step's start."""
        free = {"d2h": 0.0, "h2d": 0.0, "allreduce": 0.0}
        host = max([0.0, *carry.values()])  # the update channel finishes the previous step's work first
        timing: dict[int, list[float]] = {}
        done: dict[int, list[float]] = {}
        t = exposed = exposed_update = 0.0
        starts = []
        stall = {u.id: 0.0 for u in updates}
        for pos in range(n + 1):
            for u in update_waits.get(pos, ()):
                end = carry.get(u.id, 0.0)
                if end > t:
                    stall[u.id] += end - t
                    exposed_update += end - t
                    t = end
            for c in issues.get(pos, ()):
                t, copy_stall = _issue(c, t, free, timing)
                exposed += copy_stall
            for c in waits.get(pos, ()):
                end = timing[c.id][2]
                if end > t:
                    timing[c.id][3] += end - t
                    exposed += end - t
                    t = end
            for u in ready.get(pos, ()):
                if u.on_compute:
                    done[u.id] = [t, t, t + u.seconds]
                    t += u.seconds
                    exposed_update += u.seconds
                else:
                    start = max([t, host, *(timing[a][2] for a in u.after)])
                    host = start + u.seconds
                    done[u.id] = [t, start, host]
            if pos < n:
                starts.append(t)
                t += step_seconds[pos]
        return t, exposed, exposed_update, starts, timing, done, stall

    def next_carry(carry: dict[int, float]) -> tuple[dict[int, float], float]:
        total, done = (r := one_step(carry))[0], r[5]
        return {u.id: done[u.id][2] - total for u in updates if not u.on_compute}, total

    # The carry settles within as many steps as there are updates.
    carry = _settle(next_carry, limit=len(updates) + 2)
    # The steady step; the stalls its updates cause in the next step are this step's own.
    total, exposed, exposed_update, starts, timing, done, next_stall = one_step(carry)
    return Timeline(
        step_seconds=total,
        compute_seconds=float(sum(step_seconds)),
        exposed_seconds=exposed,
        step_start=tuple(starts),
        copies=tuple(CopyTiming(c.id, c.direction, *timing[c.id]) for c in sorted(copies, key=lambda c: c.id)),
        update_seconds=float(sum(u.seconds for u in updates)),
        exposed_update_seconds=exposed_update,
        updates=tuple(
            UpdateTiming(u.id, *done[u.id], next_stall.get(u.id, 0.0)) for u in sorted(updates, key=lambda u: u.id)
        ),
    )


SETTLE_REL_TOL = 1e-12
"""Two carries are the same steady state when every update's end time agrees within this fraction
of the step time: the float sums of one simulated step can alternate in the last bit from one
repetition to the next (seen on llama-70b: 7e-15 s on a 57.8 s step, forever), so exact equality
would run every simulation to its repetition limit."""


def _settle(next_carry, limit: int) -> dict[int, float]:
    """Repeat ``next_carry`` (carry -> (carry, step seconds)) from an empty carry until two
    successive carries agree within ``SETTLE_REL_TOL`` of the step, or ``limit`` repetitions;
    returns the last carry (update id -> end time relative to the step's end, seconds)."""
    carry: dict[int, float] = {}
    for _ in range(limit):
        new, total = next_carry(carry)
        tol = SETTLE_REL_TOL * max(abs(total), 1e-9)
        if new.keys() == carry.keys() and all(abs(new[k] - carry[k]) <= tol for k in new):
            break
        carry = new
    return carry


# ------------------------------------------------------------------------------------------
# Several compute streams: a program of steps in issue order.


@dataclass(frozen=True)
class ProgramStep:
    """One step of a multi-stream program, in host issue order.

    ``kind``:
      * ``"compute"``: a kernel of ``seconds`` on ``stream``; starts when ``stream`` is free.
      * ``"record"``: event ``key`` captures ``stream``'s work issued so far.
      * ``"wait"``: ``stream`` waits for event ``key``'s latest record (plus the event latency);
        a wait on an event never recorded does nothing (as in CUDA).
      * ``"copy"``: copy ``key`` of ``seconds`` on the ``direction`` channel, ordered after
        ``stream``'s work so far (the runtime's ``wait_stream``).
      * ``"copy_wait"``: ``stream`` waits for copy ``key``; the stall is exposed copy time.

    ``on_compute`` (a ``"copy"`` where copies are synchronous, as :attr:`CopyTask.on_compute`): the
    copy runs on ``stream`` itself, exposed in full; its channel is not used.
    """

    kind: Literal["compute", "record", "wait", "copy", "copy_wait"]
    stream: int = 0
    seconds: float = 0.0
    key: object = None
    direction: str = "d2h"
    on_compute: bool = False


@dataclass(frozen=True)
class ProgramTimeline:
    """Result of :func:`simulate_program` (seconds).

    Attributes:
        step_seconds: when the last stream finishes (the step time).
        start: start time of every program step (for records and waits: when they take effect).
        end: end time of every program step.
        exposed_seconds: total stall of streams on copies.
        copies: per copy key, ``(issue, start, end, stall)``.
    """

    step_seconds: float
    start: tuple[float, ...]
    end: tuple[float, ...]
    exposed_seconds: float
    copies: tuple[tuple[object, float, float, float, float], ...]


def simulate_program(steps: Sequence[ProgramStep], event_seconds: float = 0.0) -> ProgramTimeline:
    """Simulate ``steps`` (see :class:`ProgramStep`): the host issues them in order without ever
    blocking; each stream runs its work in issue order; ``event_seconds`` is added to every
    satisfied wait. With one stream and no events this is exactly :func:`simulate`.

    Raises:
        ValueError: for a copy waited before it is issued, or an unknown kind.
    """
    free: dict[int, float] = {}
    channel = {"d2h": 0.0, "h2d": 0.0}
    events: dict[object, float] = {}
    copies: dict[object, list] = {}
    starts, ends = [], []
    exposed = 0.0
    for st in steps:
        t = free.get(st.stream, 0.0)
        if st.kind == "compute":
            start, end = t, t + st.seconds
            free[st.stream] = end
        elif st.kind == "record":
            events[st.key] = t
            start = end = t
        elif st.kind == "wait":
            start = t
            if st.key in events:
                free[st.stream] = max(t, events[st.key] + event_seconds)
            end = free.get(st.stream, 0.0)
        elif st.kind == "copy" and st.on_compute:
            start, end = t, t + st.seconds
            free[st.stream] = end
            copies[st.key] = [t, start, end, st.seconds]
            exposed += st.seconds
        elif st.kind == "copy":
            start = max(t, channel[st.direction])
            end = start + st.seconds
            channel[st.direction] = end
            copies[st.key] = [t, start, end, 0.0]
        elif st.kind == "copy_wait":
            if st.key not in copies:
                raise ValueError(f"copy {st.key!r} is waited for before it is issued")
            start = t
            done = copies[st.key][2]
            if done > t:
                copies[st.key][3] += done - t
                exposed += done - t
                free[st.stream] = done
            end = free.get(st.stream, 0.0)
        else:
            raise ValueError(f"unknown program step kind {st.kind!r}")
        starts.append(start)
        ends.append(end)
    total = max([0.0, *free.values(), *(c[2] for c in copies.values())])
    return ProgramTimeline(
        step_seconds=total,
        start=tuple(starts),
        end=tuple(ends),
        exposed_seconds=exposed,
        copies=tuple((k, *v) for k, v in copies.items()),
    )


# ------------------------------------------------------------------------------------------
# The simulator applied to a rewritten graph pair.


@dataclass(frozen=True)
class PairTimeline:
    """The simulated schedule of a rewritten forward/backward pair (seconds, bytes).

    Attributes:
        timeline: the compute/copy timeline (see :class:`Timeline`).
        step_names: ``"forward:node"`` / ``"backward:node"`` per step.
        step_seconds: each step's compute time.
        live_bytes: device bytes live at each step.
        copy_names: the trinity node that issues each copy (by copy id).
    """

    timeline: Timeline
    step_names: tuple[str, ...]
    step_seconds: tuple[float, ...]
    live_bytes: tuple[int, ...]
    copy_names: tuple[str, ...]
    step_streams: tuple[int, ...] = ()

    @property
    def step_time(self) -> float:
        return self.timeline.step_seconds

    @property
    def exposed_seconds(self) -> float:
        return self.timeline.exposed_seconds

    @property
    def peak_bytes(self) -> int:
        return max(self.live_bytes) if self.live_bytes else 0

    def memory_over_time(self) -> list[tuple[float, int]]:
        """(start time in seconds, live device bytes) of every step."""
        return list(zip(self.timeline.step_start, self.live_bytes))

    def chrome_trace(self) -> dict:
        """The schedule in Chrome's trace-event format (Perfetto and chrome://tracing open it):
        one track per compute stream, one per copy direction, a device-memory counter."""
        us = 1e6
        events: list[dict] = []
        tids = {"compute": 1, "d2h": 2, "h2d": 3}
        names = {
            "compute": "compute stream",
            "d2h": "D2H copies (device to host)",
            "h2d": "H2D copies (host to device)",
        }
        streams = self.step_streams or (0,) * len(self.step_names)
        for s in sorted(set(streams) - {0}):
            tids[f"stream{s}"] = 10 + s
            names[f"stream{s}"] = f"compute side stream {s}"
        for key, tid in tids.items():
            events.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": names[key]}})
        events.append({"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "trinity simulated step"}})
        for name, start, dur, live, stream in zip(
            self.step_names, self.timeline.step_start, self.step_seconds, self.live_bytes, streams
        ):
            if dur > 0:
                events.append(
                    {
                        "ph": "X",
                        "pid": 1,
                        "tid": tids["compute"] if stream == 0 else tids[f"stream{stream}"],
                        "name": name,
                        "ts": start * us,
                        "dur": dur * us,
                        "args": {"live_device_bytes": live},
                    }
                )
            events.append({"ph": "C", "pid": 1, "name": "device memory", "ts": start * us, "args": {"bytes": live}})
        for c in self.timeline.copies:
            events.append(
                {
                    "ph": "X",
                    "pid": 1,
                    "tid": tids[c.direction],
                    "name": self.copy_names[c.id],
                    "ts": c.start * us,
                    "dur": (c.end - c.start) * us,
                    "args": {"issued_at_s": c.issue, "stall_s": c.stall},
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}
