"""The working-window planner: which saved activations to evict, and where every copy goes.

A pure function of (liveness, costs, budget). For an evicted buffer:

* each distinct saved view gets a device-to-host copy issued right after the view is defined
  (its data is final then, so the copy overlaps the rest of the forward);
* the forward waits for those copies after the buffer's last forward reader, or later if the
  copies need more compute to hide under; the device storage is freed at that wait;
* the backward issues the host-to-device copies (the *prefetch*) early enough that they finish
  under the compute before the first backward reader, and waits right before that reader. The
  prefetched tensors hold device memory from the prefetch on, so the window between prefetch and
  use is part of the peak.

Selection is greedy over the peak: while the simulated peak exceeds the budget, take the step
where it peaks and cover it with the candidate that costs least: first a candidate whose copies
hide fully (largest first), else the smallest tightening of some candidate's window (wait earlier
or prefetch later), ranked by the copy time it exposes, then by size. With every candidate at its
tightest window the peak is the lowest any plan reaches; a budget below it is infeasible and the
plan says what dominates that peak.

**A pair run several times per step** (``earlier_runs`` m > 0: a block graph run by m + 1
blocks, ``F1 .. FN BN .. B1``): while the last run runs, the m earlier runs hold every saved
activation they keep across the forward/backward boundary. The budget then binds own live bytes
+ m x kept at every step, which is linear in the choice: the planner works on the live bytes
plus m x every boundary-crossing saved buffer's size (:attr:`.liveness.Liveness.boundary_saved`),
and evicting a candidate lowers every step by m x its size besides its own window (so every
unselected candidate covers the peak step). The plan's ``peak_bytes_planned`` stays the pair's
own; ``reuse_held_bytes`` is m x what it keeps, and ``feasible`` and the lowest reachable peak
count both.

**A cap on the kept saved activations** (``kept_cap`` C: an earlier pair of a training step
replanned so that a later pair fits, :mod:`offload_compiler.step_budget`): the boundary-crossing
saved bytes that stay on the device (not evicted) must total at most C. That is one more linear
constraint, planned as one virtual extra step after the backward whose live bytes are the kept
boundary-crossing bytes + (budget - C): the budget binds there exactly when the kept bytes exceed
C, and evicting a boundary-crossing candidate lowers that step by its size (and no real step
changes). The greedy selection covers it like any step over the budget (it prefers the candidates
whose copies hide); the reported peaks are of the real steps only, and ``feasible`` requires both
the budget and the cap (``kept_bytes`` is what the plan keeps).

After selection, copy placement accounts for channel contention (copies in one direction run one
at a time): D2H waits move later and prefetches earlier until each copy hides, as far as the
budget allows. :func:`~offload_compiler.passes.simulate.simulate` then predicts the step time and
the exposed copy time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from ..options import MemoryBudget, format_bytes
from .cost_model import Costs
from .liveness import Liveness
from .simulate import CopyTask, Timeline, simulate

__all__ = ["CopyGroup", "Eviction", "Plan", "plan", "planned_live_bytes", "copy_tasks", "copy_groups"]


@dataclass(frozen=True)
class CopyGroup:
    """Saved tensors of one buffer that one host copy serves.

    Two layouts:

    * ``"view"``: every member is the same view (same size, stride, offset, dtype); the host copy
      and the prefetched tensor have exactly that layout.
    * ``"span"``: the members are different views of one storage (``q``, ``k``, ``v`` split from
      one projection, a tensor and its transpose). One 1-D copy covers the storage elements
      ``[span_offset, span_offset + span_numel)`` and the backward rebuilds each view from it with
      ``as_strided``. Used only for static shapes and one dtype, and only when it moves no more
      bytes than copying the views one by one.

    Steps are joint-schedule indices: ``issue_after`` (forward: the D2H copy reads the tensor of
    this node and starts right after it), ``wait_before`` (backward: the prefetch wait goes right
    before this node, the group's first reader) and ``last_use`` (backward: its last reader).
    ``from_source``: the node at ``issue_after`` is the buffer's first forward holder rather than
    a member, and the copied view is taken from it with ``as_strided`` (needs static shapes) unless
    it is already the same view. Copying from the first holder starts the copy as soon as the data
    exists, even when the partitioner defines the saved view itself (a ``detach``) much later.
    """

    saved: tuple[int, ...]
    copy_bytes: int
    issue_after: int
    wait_before: int
    last_use: int
    layout: str = "view"
    span_offset: int = 0
    span_numel: int = 0
    from_source: bool = False


@dataclass(frozen=True)
class Eviction:
    """One evicted buffer.

    Attributes:
        buffer: the :class:`~offload_compiler.passes.liveness.Buffer` id.
        size_bytes: device bytes freed while it is on the host.
        groups: its host copies.
        wait_after: forward step after which the D2H copies are waited for (the storage is freed).
        prefetch_before: backward step before which the H2D copies are issued.
        idle_gap_seconds: compute time between its last forward and first backward reader.
    """

    buffer: int
    size_bytes: int
    groups: tuple[CopyGroup, ...]
    wait_after: int
    prefetch_before: int
    idle_gap_seconds: float

    @property
    def copy_bytes(self) -> int:
        return sum(g.copy_bytes for g in self.groups)


@dataclass(frozen=True)
class Plan:
    """The planner's answer (bytes, seconds).

    Attributes:
        budget_bytes: the resolved budget (``None``: no limit).
        evictions: what is evicted and where the copies go.
        peak_bytes_unplanned / peak_bytes_planned: simulated peaks without and with the plan.
        lowest_reachable_peak_bytes: the peak with every candidate evicted as tightly as possible.
        feasible: whether ``peak_bytes_planned <= budget_bytes``.
        peak_breakdown: device bytes by buffer kind at the planned peak.
        predicted_step_seconds / exposed_transfer_seconds / compute_seconds: from the simulator.
        num_candidates: buffers that could have been evicted.
        reuse_held_bytes: with ``earlier_runs`` m > 0 (:func:`plan`), the saved activations the m
            earlier runs keep on the device under this plan (m x the boundary-crossing saved
            bytes not evicted), held beside the pair's own ``peak_bytes_planned``; 0 otherwise.
            ``lowest_reachable_peak_bytes`` and ``feasible`` count them.
        kept_cap_bytes: the cap on the kept boundary-crossing saved bytes it was planned with
            (``kept_cap``; ``None``: none).
        kept_bytes: with a cap, the boundary-crossing saved bytes the plan keeps on the device
            (``feasible`` requires ``kept_bytes <= kept_cap_bytes``); ``None`` without a cap.
    """

    budget_bytes: int | None
    evictions: tuple[Eviction, ...]
    peak_bytes_unplanned: int
    peak_bytes_planned: int
    peak_step_planned: int
    lowest_reachable_peak_bytes: int
    feasible: bool
    peak_breakdown: tuple[tuple[str, int], ...]
    predicted_step_seconds: float
    exposed_transfer_seconds: float
    compute_seconds: float
    num_candidates: int
    reuse_held_bytes: int = 0
    kept_cap_bytes: int | None = None
    kept_bytes: int | None = None

    @property
    def step_peak_bytes(self) -> int:
        """The peak with the earlier runs' kept saved activations (``peak_bytes_planned`` +
        ``reuse_held_bytes``): what the budget binds."""
        return self.peak_bytes_planned + self.reuse_held_bytes

    @property
    def evicted_bytes(self) -> int:
        """Device bytes of the evicted buffers (each counted once)."""
        return sum(e.size_bytes for e in self.evictions)

    @property
    def copy_bytes(self) -> int:
        """Bytes moved each way per step."""
        return sum(e.copy_bytes for e in self.evictions)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, default=str)


# ---------------------------------------------------------------------------------- helpers
def _groups(liveness: Liveness, buffer_id: int) -> list[CopyGroup]:
    """The host copies of one buffer: one per distinct view, or one ``"span"`` copy for all."""
    buf = liveness.buffers[buffer_id]
    members = [liveness.saved[i] for i in buf.saved]
    by_key: dict[tuple, list] = {}
    for st in members:
        by_key.setdefault(st.view_key, []).append(st)
    source = buf.source_step

    def group(sts, layout="view", **extra) -> CopyGroup:
        own = min(s.def_step for s in sts)
        # Start from the buffer's first holder when the view can be taken from it exactly.
        movable = source is not None and source < own
        if layout == "view":
            movable = movable and (all(s.static for s in sts) or all(s.same_view_as_source for s in sts))
        return CopyGroup(
            saved=tuple(s.index for s in sts),
            copy_bytes=extra.pop("copy_bytes", sts[0].copy_bytes),
            issue_after=source if movable else own,
            wait_before=min(s.first_bw_use for s in sts),
            last_use=max(s.last_bw_use for s in sts),
            layout=layout,
            from_source=movable,
            **extra,
        )

    per_view = [group(sts) for sts in by_key.values()]
    if len(by_key) > 1 and all(s.static for s in members) and len({s.dtype for s in members}) == 1:
        itemsize = members[0].itemsize
        lo = min(s.storage_offset for s in members)
        hi = max(s.storage_offset + s.copy_bytes // itemsize for s in members)
        if (hi - lo) * itemsize <= sum(g.copy_bytes for g in per_view):
            return [group(members, "span", span_offset=lo, span_numel=hi - lo, copy_bytes=(hi - lo) * itemsize)]
    return per_view


def copy_groups(liveness: Liveness, buffer_id: int) -> tuple[CopyGroup, ...]:
    """The host copies the planner makes for buffer ``buffer_id`` when it evicts it: one per
    distinct saved view, or one ``"span"`` copy for all of them (see :class:`CopyGroup`)."""
    return tuple(_groups(liveness, buffer_id))


def planned_live_bytes(liveness: Liveness, evictions: tuple[Eviction, ...] | list[Eviction]) -> np.ndarray:
    """Device bytes live at each step with ``evictions`` applied (int64 array)."""
    diff = np.zeros(liveness.num_steps + 1, dtype=np.int64)
    for ev in evictions:
        buf = liveness.buffers[ev.buffer]
        diff[ev.wait_after + 1] -= buf.size_bytes
        diff[buf.last_step + 1] += buf.size_bytes
        for g in ev.groups:
            diff[ev.prefetch_before] += g.copy_bytes
            diff[g.last_use + 1] -= g.copy_bytes
    return liveness.live_bytes() + np.cumsum(diff[:-1])


def copy_tasks(evictions, costs: Costs) -> list[CopyTask]:
    """The simulator's copy tasks for ``evictions`` (a D2H and an H2D task per copy group)."""
    tasks = []
    for ev in evictions:
        for g in ev.groups:
            tasks.append(costs.copy_task(len(tasks), "d2h", g.copy_bytes, g.issue_after + 1, ev.wait_after + 1))
            tasks.append(costs.copy_task(len(tasks), "h2d", g.copy_bytes, ev.prefetch_before, g.wait_before))
    return tasks


class _Cand:
    """Mutable working state of one candidate during planning."""

    __slots__ = (
        "buf",
        "groups",
        "size",
        "last",
        "lo_e",
        "hi_e",
        "lo_p",
        "hi_p",
        "issue",
        "d2h",
        "h2d",
        "e",
        "p",
        "selected",
        "gap",
        "shadow",
        "capped",
    )


def plan(
    liveness: Liveness,
    costs: Costs,
    budget_bytes: int | None,
    min_offload_bytes: int = 0,
    only: frozenset[int] | None = None,
    earlier_runs: int = 0,
    kept_cap: int | None = None,
) -> Plan:
    """Plan evictions so the simulated peak stays within ``budget_bytes`` (see module docstring).

    Args:
        liveness: from :func:`~offload_compiler.passes.liveness.analyze`.
        costs: from :func:`~offload_compiler.passes.cost_model.estimate` on the same graphs.
        budget_bytes: peak device bytes allowed; ``None`` means no limit (nothing is evicted).
        min_offload_bytes: buffers smaller than this are not candidates.
        only: when given, only these buffer ids are candidates (the joint keep/offload/recompute
            planner, :mod:`.plan_recompute`, restricts offloading to what it chose).
        earlier_runs: runs of the same pair whose saved activations are held while this one
            runs (a block graph run by ``earlier_runs + 1`` blocks per step; module docstring).
        kept_cap: at most this many bytes of boundary-crossing saved activations
            (:attr:`.liveness.Liveness.boundary_saved`) stay on the device across the
            forward/backward boundary (module docstring); ``None``: no cap.

    Raises:
        ValueError: ``earlier_runs`` < 0, ``kept_cap`` < 0, or ``kept_cap`` without a budget.

    Returns:
        A :class:`Plan`. When the budget cannot be met, ``feasible`` is False and the plan holds
        every candidate at its tightest window (the lowest reachable peak); the caller decides
        whether that is an error.
    """
    if earlier_runs < 0:
        raise ValueError(f"plan_window.plan: earlier_runs must be >= 0, got {earlier_runs}")
    if kept_cap is not None and (kept_cap < 0 or budget_bytes is None):
        raise ValueError(
            f"plan_window.plan: kept_cap must be >= 0 bytes and needs a budget; got kept_cap={kept_cap}, "
            f"budget_bytes={budget_bytes}"
        )
    T = liveness.num_steps
    F = liveness.num_fw_steps
    own = liveness.live_bytes()
    unplanned_peak = int(own.max()) if T else 0
    # The earlier runs' saved activations, all kept: every eviction of one lowers every step.
    crossing = liveness.boundary_saved if earlier_runs or kept_cap is not None else {}
    base = own + earlier_runs * sum(crossing.values())
    if kept_cap is not None:
        # The virtual step (module docstring): over the budget exactly when more than the cap is kept.
        base = np.append(base, sum(crossing.values()) + budget_bytes - kept_cap)
    secs = np.asarray(costs.step_seconds, dtype=np.float64)
    ce = np.concatenate([[0.0], np.cumsum(secs)])  # ce[s] = start of step s; ce[s+1] = its end
    bw_compute = [s.index for s in liveness.steps[F:] if not s.is_placeholder]
    b0 = bw_compute[0] if bw_compute else F
    last_fw = F - 2  # the node before the forward's output node

    cands: list[_Cand] = []
    for buf in liveness.candidates(min_offload_bytes):
        if only is not None and buf.id not in only:
            continue
        c = _Cand()
        c.buf = buf
        c.groups = _groups(liveness, buf.id)
        c.size = buf.size_bytes
        c.last = buf.last_step
        c.issue = max(g.issue_after for g in c.groups)
        c.lo_e = max(buf.last_fw_use, c.issue)
        c.hi_e = max(c.lo_e, last_fw)
        c.hi_p = buf.first_bw_use
        c.lo_p = min(b0, c.hi_p)
        copy_bytes = sum(g.copy_bytes for g in c.groups)
        c.d2h = costs.transfer_seconds(copy_bytes, "d2h")
        c.h2d = costs.transfer_seconds(copy_bytes, "h2d")
        # Ideal window: hide each copy under compute, ignoring other copies.
        e = int(np.searchsorted(ce, ce[c.issue + 1] + c.d2h, side="left")) - 1
        c.e = min(max(e, c.lo_e), c.hi_e)
        p = int(np.searchsorted(ce, ce[c.hi_p] - c.h2d, side="right")) - 1
        c.p = min(max(p, c.lo_p), c.hi_p)
        c.selected = False
        c.gap = float(ce[buf.first_bw_use] - ce[buf.last_fw_use + 1])
        c.shadow = earlier_runs * crossing.get(buf.id, 0)
        c.capped = crossing.get(buf.id, 0) if kept_cap is not None else 0
        cands.append(c)

    def exposure(c: _Cand, e: int, p: int) -> float:
        hidden_d2h = ce[e + 1] - ce[c.issue + 1]
        hidden_h2d = ce[c.hi_p] - ce[p]
        return max(0.0, c.d2h - hidden_d2h) + max(0.0, c.h2d - hidden_h2d)

    def change(c: _Cand, e: int, p: int) -> np.ndarray:
        """Change of live device bytes per step when ``c`` is evicted with window (e, p)."""
        d = np.zeros(T + 1, dtype=np.int64)
        d[e + 1] -= c.size
        d[c.last + 1] += c.size
        for g in c.groups:
            d[p] += g.copy_bytes
            d[g.last_use + 1] -= g.copy_bytes
        out = np.cumsum(d[:-1]) - c.shadow
        return np.append(out, -c.capped) if kept_cap is not None else out

    # The lowest reachable peak: every candidate at its tightest window.
    tight = base.copy()
    for c in cands:
        tight += change(c, c.lo_e, c.hi_p)
    lowest = int(tight.max()) if len(tight) else 0

    cur = base.copy()
    if budget_bytes is not None and int(base.max() if len(base) else 0) > budget_bytes:
        if lowest > budget_bytes:
            for c in cands:
                c.e, c.p, c.selected = c.lo_e, c.hi_p, True
            cur = tight.copy()
            # Keep the lowest peak, and the cap wherever the tightest plan meets it (the virtual
            # step's own limit): a copy dropped must raise neither.
            limit = np.full(len(cur), lowest, dtype=np.int64)
            if kept_cap is not None:
                limit[:T] = max(budget_bytes, int(tight[:T].max()) if T else 0)
                limit[T] = max(budget_bytes, int(tight[T]))
            _drop_unneeded(cands, cur, limit, change)
        else:
            _select(cands, cur, budget_bytes, exposure, change, virtual_step=kept_cap is not None)
            if cur.max() > budget_bytes:
                # The greedy choice got stuck although the tightest plan fits: use that.
                for c in cands:
                    c.e, c.p, c.selected = c.lo_e, c.hi_p, True
                cur = tight.copy()
                _drop_unneeded(cands, cur, budget_bytes, change)
            _place_for_contention(cands, cur, budget_bytes, ce, b0)

    chosen = [c for c in cands if c.selected]
    chosen.sort(key=lambda c: c.buf.def_step)
    evictions = tuple(
        Eviction(
            buffer=c.buf.id,
            size_bytes=c.size,
            groups=tuple(c.groups),
            wait_after=int(c.e),
            prefetch_before=int(c.p),
            idle_gap_seconds=c.gap,
        )
        for c in chosen
    )
    live = planned_live_bytes(liveness, evictions)
    peak = int(live.max()) if T else 0
    peak_step = int(live.argmax()) if T else 0
    evicted = {c.buf.id for c in chosen}
    held = earlier_runs * sum(size for bid, size in crossing.items() if bid not in evicted)
    kept = sum(size for bid, size in crossing.items() if bid not in evicted) if kept_cap is not None else None
    timeline: Timeline = simulate(costs.step_seconds, copy_tasks(evictions, costs))
    breakdown = _breakdown(liveness, evictions, peak_step)
    if held:
        breakdown = dict(sorted({**breakdown, "earlier runs' saved activation": held}.items(), key=lambda kv: -kv[1]))
    return Plan(
        budget_bytes=budget_bytes,
        evictions=evictions,
        peak_bytes_unplanned=unplanned_peak,
        peak_bytes_planned=peak,
        peak_step_planned=peak_step,
        # The real steps' lowest peak (the cap's virtual step is no peak of the device).
        lowest_reachable_peak_bytes=int(tight[:T].max()) if T else 0,
        feasible=(budget_bytes is None or peak + held <= budget_bytes) and (kept is None or kept <= kept_cap),
        peak_breakdown=tuple(breakdown.items()),
        predicted_step_seconds=timeline.step_seconds,
        exposed_transfer_seconds=timeline.exposed_seconds,
        compute_seconds=timeline.compute_seconds,
        num_candidates=len(cands),
        reuse_held_bytes=held,
        kept_cap_bytes=kept_cap,
        kept_bytes=kept,
    )


def _drop_unneeded(cands, cur: np.ndarray, limit, change) -> None:
    """Unselect every candidate whose eviction is not needed to keep the peak within ``limit``:
    a copy that buys nothing (its buffer is not live at any step the limit binds, or offloading
    cannot lower the peak at all) costs host-link time for no memory. Mutates ``cands`` and
    ``cur`` (the live bytes with the selected candidates applied). ``limit``: bytes, or bytes per
    step (an array as long as ``cur``).

    One pass, most copy bytes first, is enough for a set from which no single eviction can be
    dropped: dropping evictions only raises the live bytes, so a candidate needed with more
    evictions selected is needed with fewer too."""
    for c in sorted((c for c in cands if c.selected), key=lambda c: -sum(g.copy_bytes for g in c.groups)):
        without = cur - change(c, c.e, c.p)
        if (without <= limit).all():
            cur[:] = without
            c.selected = False


def _select(cands, cur: np.ndarray, budget: int, exposure, change, virtual_step: bool = False) -> None:
    """Greedy selection over the peak (mutates ``cands`` and ``cur``). ``virtual_step``: the last
    entry of ``cur`` is the kept cap's virtual step (:func:`plan`), which only evicting a
    boundary-crossing candidate lowers."""
    if not cands:
        return
    n = len(cands)
    size = np.array([c.size for c in cands], dtype=np.int64)
    shadow = np.array([c.shadow for c in cands], dtype=np.int64)
    capped = np.array([c.capped for c in cands], dtype=np.int64)
    virtual = len(cur) - 1 if virtual_step else None  # the kept cap's step (module docstring)
    lo_e = np.array([c.lo_e for c in cands])
    hi_p = np.array([c.hi_p for c in cands])
    # Copy time each candidate would expose at its ideal window (0: it hides under compute).
    exposed_ideal = np.array([exposure(c, c.e, c.p) for c in cands])

    def tightened(c: _Cand, t: int) -> tuple[int, int]:
        """The window of ``c`` moved just enough to cover ``t`` and the over-budget steps next to
        it on the same side."""
        e, p = c.e, c.p
        if t <= e:
            e = t - 1
            while e > c.lo_e and cur[e] > budget:
                e -= 1
        if t >= p:
            p = t + 1
            while p < c.hi_p and cur[p] > budget:
                p += 1
        return e, p

    # Each round lowers the live bytes at the current peak step by at least one byte-holding
    # buffer, so this ends; the bound only guards against a bug looping forever.
    for _ in range(50 * (n + len(cur)) + 100):
        t = int(cur.argmax())
        if cur[t] <= budget:
            return
        e = np.array([c.e for c in cands])
        p = np.array([c.p for c in cands])
        sel = np.array([c.selected for c in cands])
        # 1) an unselected candidate whose ideal window covers t: those whose copies hide fully
        #    first, largest first (a long idle gap and a large size); then the fewest exposed
        #    seconds per byte saved.
        #    With earlier runs (``shadow``), every unselected candidate lowers t by its shadow;
        #    the bytes it saves at t rank it.
        #    At the kept cap's virtual step, an unselected boundary-crossing candidate lowers it by
        #    its size (``capped``) and nothing covers it otherwise.
        at_virtual = t == virtual
        covers = (e < t) & (t < p) if not at_virtual else np.zeros(n, dtype=bool)
        lowers = capped if at_virtual else shadow
        ideal = (~sel) & (covers | (lowers > 0))
        if ideal.any():
            idx = np.flatnonzero(ideal)
            saves = np.where(covers[idx], size[idx], 0) + lowers[idx]
            keys = exposed_ideal[idx] / saves
            best = np.lexsort((-saves, keys))[0]
            c = cands[int(idx[best])]
            c.selected = True
            cur += change(c, c.e, c.p)
            continue
        # 2) the cheapest tightening (of any candidate) that covers t.
        ok = (lo_e < t) & (t < hi_p)
        if at_virtual or not ok.any():
            return  # nothing can lower this step
        best, best_key, best_window = None, None, None
        for i in np.flatnonzero(ok):
            c = cands[i]
            ne, np_ = tightened(c, t)
            if c.selected and (ne, np_) == (c.e, c.p):
                continue  # already evicted across t: tightening it changes nothing
            added = exposure(c, ne, np_) - (exposure(c, c.e, c.p) if c.selected else 0.0)
            key = (added, -c.size)
            if best_key is None or key < best_key:
                best, best_key, best_window = c, key, (ne, np_)
        if best is None:
            return  # every candidate that could cover t already does
        if best.selected:
            cur -= change(best, best.e, best.p)
        best.e, best.p = best_window
        best.selected = True
        cur += change(best, best.e, best.p)


def _place_for_contention(cands, cur: np.ndarray, budget: int, ce: np.ndarray, b0: int) -> None:
    """Move D2H waits later and prefetches earlier so copies in one direction, which run one at a
    time, still hide; never past the budget (mutates ``cands`` and ``cur``)."""
    chosen = [c for c in cands if c.selected]
    # Forward: D2H copies in issue order on one channel. Waiting later keeps the storage longer.
    free = 0.0
    for c in sorted(chosen, key=lambda c: c.issue):
        start = max(ce[c.issue + 1], free)
        end = start + c.d2h
        free = end
        want = min(max(int(np.searchsorted(ce, end, side="left")) - 1, c.lo_e), c.hi_e)
        s = c.e + 1
        while s <= want and cur[s] + c.size <= budget:
            s += 1
        if s - 1 > c.e:
            cur[c.e + 1 : s] += c.size
            c.e = s - 1
    # Backward: H2D copies, latest deadline first, on one channel. Prefetching earlier holds the
    # copies' device memory longer.
    until = float("inf")
    for c in sorted(chosen, key=lambda c: -c.hi_p):
        end = min(ce[c.hi_p], until)
        start = end - c.h2d
        until = start
        want = min(max(int(np.searchsorted(ce, start, side="right")) - 1, b0), c.hi_p)
        added = sum(g.copy_bytes for g in c.groups)
        s = c.p - 1
        while s >= want and cur[s] + added <= budget:
            s -= 1
        if s + 1 < c.p:
            cur[s + 1 : c.p] += added
            c.p = s + 1


def _breakdown(liveness: Liveness, evictions, step: int) -> dict[str, int]:
    """Device bytes live at ``step`` by kind, with ``evictions`` applied (as
    :func:`planned_live_bytes` counts them)."""
    out: dict[str, int] = {}
    by_buffer = {e.buffer: e for e in evictions}
    for b in liveness.buffers:
        if not b.on_device or b.fused or not (b.def_step <= step <= b.last_step):
            continue
        ev = by_buffer.get(b.id)
        if ev is not None and step > ev.wait_after:
            continue
        out[b.kind.value] = out.get(b.kind.value, 0) + b.size_bytes
    for ev in evictions:
        for g in ev.groups:
            if ev.prefetch_before <= step <= g.last_use:
                out["prefetched saved activation"] = out.get("prefetched saved activation", 0) + g.copy_bytes
    if liveness.workspace_bytes and liveness.workspace_bytes[step]:
        out["op workspace"] = liveness.workspace_bytes[step]
    return dict(sorted(((k, v) for k, v in out.items() if v), key=lambda kv: -kv[1]))


def lowest_budget_percent(lowest_peak_bytes: int, unplanned_peak_bytes: int) -> str:
    """The smallest ``memory_budget`` percentage, to 0.1%, that resolves to at least
    ``lowest_peak_bytes``: resolved as the backend does (``int(fraction * unplanned_peak_bytes)``,
    :func:`offload_compiler.pipeline.resolve_budget`), so passing it back is never below the
    lowest reachable peak by a rounding. At most ``"100%"``.

    Returns a string such as ``"62.5%"`` that :meth:`~offload_compiler.options.MemoryBudget.parse`
    accepts."""
    if unplanned_peak_bytes <= 0 or lowest_peak_bytes >= unplanned_peak_bytes:
        return "100%"
    tenths = max(1, -(-1000 * lowest_peak_bytes // unplanned_peak_bytes))  # ceiling, at least 0.1%
    while tenths < 1000:
        text = f"{tenths // 10}.{tenths % 10}%" if tenths % 10 else f"{tenths // 10}%"
        if int(MemoryBudget.parse(text).value * unplanned_peak_bytes) >= lowest_peak_bytes:
            return text
        tenths += 1
    return "100%"


def describe_infeasible(
    plan_: Plan,
    liveness: Liveness,
    budget_request: str,
    min_offload_bytes: int,
    on_infeasible: str = "error",
    unplanned_peak_bytes: int | None = None,
    reach_override: str | None = None,
    strategy: str = "offload",
    base_label: str | None = None,
) -> str:
    """The error text for a budget no plan reaches: the budget, the lowest reachable peak (in
    bytes and as the ``memory_budget`` percentage that reaches it, see
    :func:`lowest_budget_percent`), what dominates that peak, and only the remedies that apply (no
    "lower min_offload_bytes" when it is 0, no "pass on_infeasible='warn'" when it is already
    ``"warn"``).

    ``strategy``: the option. ``"recompute"`` never offloads, so ``min_offload_bytes`` changes
    nothing there: the text says so and offers ``strategy='auto'`` or ``'offload'`` instead when
    the plan keeps saved activations on the device that those could offload (``liveness``'s
    candidates; what offloading would reach is not planned under ``"recompute"``, so no figure).

    ``unplanned_peak_bytes``: the peak a percentage budget is a fraction of (default: the plan's
    unplanned peak; with parameter offload, the peak with every parameter resident).
    ``reach_override``: replaces the sentence naming the lowest budget that runs (a pair of a
    multi-graph training step states it as a fraction of the step's peak instead).
    ``base_label``: what ``unplanned_peak_bytes`` is, where it is not this graph's peak without
    offloading (a replan with measured op workspace: the peak without that workspace)."""
    parts = ", ".join(
        f"{kind} {format_bytes(b)} ({100 * b / max(1, plan_.lowest_reachable_peak_bytes):.0f}%)"
        for kind, b in plan_.peak_breakdown
    )
    step = liveness.steps[plan_.peak_step_planned]
    dominant = plan_.peak_breakdown[0][0] if plan_.peak_breakdown else "nothing"
    resolved = f"{format_bytes(plan_.budget_bytes)} ({plan_.budget_bytes} bytes)"
    requested = budget_request if resolved in budget_request else f"{budget_request} = {resolved}"
    n = plan_.num_candidates
    size = f" of at least {format_bytes(min_offload_bytes)}" if min_offload_bytes > 0 else ""
    recompute_only = strategy == "recompute"
    without = "without recomputation" if recompute_only else "without offloading"
    if recompute_only:
        candidates = (
            "strategy='recompute' never offloads: every saved activation this plan does not recompute stays on "
            "the device."
        )
    elif n == 0:
        candidates = f"No saved activation{size} can be offloaded."
    elif len(plan_.evictions) == n:
        candidates = f"All {n} saved activation{'s' if n != 1 else ''}{size} that can be offloaded are."
    elif not plan_.evictions:
        candidates = (
            f"None of the {n} saved activation{'s' if n != 1 else ''}{size} that can be offloaded would lower it."
        )
    else:
        k = len(plan_.evictions)
        candidates = (
            f"{k} of the {n} saved activation{'s' if n != 1 else ''}{size} that can be offloaded "
            f"{'is' if k == 1 else 'are'}; offloading the others would not lower it."
        )
    reference = plan_.peak_bytes_unplanned if unplanned_peak_bytes is None else unplanned_peak_bytes
    lowest = plan_.lowest_reachable_peak_bytes
    percent = lowest_budget_percent(lowest, reference)
    if lowest >= reference:
        reach = (
            f"{'Recomputation' if recompute_only else 'Offloading'} cannot lower this graph's peak: the lowest "
            f"budget that runs is memory_budget='100%' ({format_bytes(reference)}, {reference} bytes)."
        )
    else:
        of = base_label or f"this graph's peak {without}"
        reach = f"The lowest budget that runs is memory_budget='{percent}' of {of}, or memory_budget={lowest} (bytes)."
    if reach_override is not None:
        reach = reach_override
    remedies = ["raise memory_budget"]
    switch = ""
    # Saved activations that could be offloaded at the threshold, and those only below it.
    kept = len(liveness.candidates(min_offload_bytes))
    smaller = len(liveness.candidates(0)) - kept
    if recompute_only:
        # min_offload_bytes only matters once offloading is allowed: it is named only with the
        # strategy that allows it, and only where it holds back every saved activation kept.
        if kept:
            which, lower = f"{kept} saved activation{'s' if kept != 1 else ''}{size}", ""
        else:
            which = f"{smaller} saved activation{'s' if smaller != 1 else ''}"
            lower = f" with min_offload_bytes below {format_bytes(min_offload_bytes)}"
        if kept or smaller:
            switch = (
                f" strategy='auto' or strategy='offload'{lower} may also offload the {which} this plan keeps on "
                "the device; what that would reach is not planned under strategy='recompute'."
            )
    elif min_offload_bytes > 0 and smaller > 0:
        # Only where smaller saved activations exist that a lower threshold would let it offload.
        remedies.append("lower min_offload_bytes")
    if on_infeasible != "warn":
        remedies.append("pass on_infeasible='warn' to run with the lowest-peak plan")
    remedy = (", ".join(remedies[:-1]) + " or " + remedies[-1]) if len(remedies) > 1 else remedies[0]
    remedy = remedy[0].upper() + remedy[1:]
    return (
        f"trinity: memory_budget {requested} is below the lowest peak any plan reaches, "
        f"{format_bytes(plan_.lowest_reachable_peak_bytes)} ({plan_.lowest_reachable_peak_bytes} bytes; "
        f"{format_bytes(plan_.peak_bytes_unplanned)} {without}), at {step.graph} node "
        f"{step.node!r}. That peak is dominated by {dominant}; by kind: {parts}. "
        f"{candidates} {reach} {remedy}.{switch}"
    )
