"""Keep, offload or recompute: the joint planner over every saved activation.

For each saved activation buffer the plan chooses one of

* **keep** it on the device from its definition to its last backward reader;
* **offload** it (the working-window planner, :mod:`.plan_window`, places the copies);
* **recompute** it in the backward from its recompute chain (:mod:`.recompute_chains`), right
  before its first backward reader, when its chain's leaves are kept, offloaded or recomputed.

The choice is joint and global: minimise the predicted step (compute, recomputation, copies on
their channels, the copy time left exposed) subject to the peak, in-flight copies included, within
the budget. It is made in three stages:

1. **Model and solve.** A mixed-integer program (HiGHS through ``highspy``) with one binary per
   offload candidate (copies at their ideal working window, as :mod:`.plan_window` computes it)
   and one per recompute chain. Device memory is exact per step for those windows (cumulative
   sums over the points where a choice changes the live bytes). Exposed copy time is modelled per
   channel as in :mod:`.simulate`: copies in one direction run one at a time in issue order, so
   the compute stream stalls at least ``sum(copy seconds of copies j..k) - (compute time between
   copy j's issue and copy k's wait)`` for every ``j <= k``, a bound written with ``O(n)`` rows by
   cumulative sums; in the backward the recomputation is compute time the prefetches hide under.
   The objective is recompute seconds plus the two channels' stalls. Where copies are
   synchronous (the device is the host CPU: :attr:`.cost_model.Costs.synchronous_copies`), an
   offload costs its two copies' seconds instead, and there are no channels. The smallest
   buffers, whose bytes total at most :data:`PROGRAM_SMALL_SHARE` of the bytes the plan must
   free, are left out of the programs (kept; a program infeasible without them is solved again
   with them: :func:`_program_buffers`). The solver has a soft time
   limit (:data:`SOLVER_TIME_LIMIT_S`: then it stops at its first feasible solution) and a hard
   one (:data:`SOLVER_HARD_LIMIT_S`), both in its thread's CPU seconds (:func:`solver_clock`), so
   that how busy the machine is does not change the plan; without ``highspy``, or when it finds no solution in time, a
   greedy fallback ranks chains by recompute seconds per byte freed and tries prefixes of that
   ranking. The plan says which was used. When the program is infeasible (no choice meets the
   budget), the same program with a peak variable in place of the budget (the lowest-peak
   program, step seconds only a tie-break) gives the choice scored for the lowest peak.
2. **Score.** Each candidate choice (the solver's, up to two of its earlier incumbents, offload
   only, recompute only, the greedy prefixes) is scored by the working-window planner on a view
   of the liveness and costs with the recomputation applied (:func:`recompute_view`): the
   recomputed buffer is freed after its last forward reader and allocated again at its recompute
   point, its chain's intermediates count there, its leaves stay live until it, and its seconds
   are added to the schedule. The best feasible predicted step wins (ties: fewer
   recomputations); with none feasible, the lowest peak.
3. **Exact.** The winning recomputation is applied to a copy of the graphs
   (:mod:`.insert_recompute`), liveness and the cost model run on the copy, and the
   working-window planner makes the final plan on them, so the planned peak is the one the
   verifier re-measures. If the exact plan misses a budget its score met, the plan falls back to
   offloading only, and says so.

A budget at or above the unplanned peak (or no budget) gives an empty plan at once: nothing is
analysed or rewritten ("fits without a plan").

**A pair run several times per step** (``earlier_runs`` m > 0, :func:`.plan_window.plan`): the
budget binds own live bytes + m x the saved activations kept across the forward/backward boundary.
Offloading or recomputing such a buffer frees m x its size at every step: the program adds that
uniform term to its memory rows (a recomputed buffer is not kept across the boundary), the greedy
fallback and the scoring count it through the working-window planner, and the unplanned peak
that decides "fits without a plan" includes the earlier runs' saved activations, all kept.

**A cap on the kept saved activations** (``kept_cap`` C, :func:`.plan_window.plan`: an earlier
pair of a training step replanned so that a later pair fits): the boundary-crossing saved bytes
neither offloaded nor recomputed total at most C. The program gets one linear row (the sizes of
the boundary-crossing buffers offloaded or recomputed >= their total - C); the greedy fallback
takes recomputations until the cap holds too; every candidate's exact plan is the working-window
planner's with the cap, so ``feasible`` requires it, and a plan that does not fit without one
is planned when the unplanned kept bytes exceed C.

Pure: reads liveness, costs and the graphs (for the chains); the graphs are not changed (stage 3
rewrites a copy).
"""

from __future__ import annotations

import bisect
import json
import threading
import time
from dataclasses import dataclass, field, replace

import numpy as np

from ..ir.meta import RECOMPUTE_KEY
from ..ir.refs import node_ref, plain_dict
from .cost_model import Costs
from .gc_pause import paused_gc
from .liveness import BufferKind, Liveness
from .plan_window import Plan, _groups
from .plan_window import plan as plan_offload
from .recompute_chains import Chain

__all__ = [
    "STRATEGIES",
    "SOLVER_TIME_LIMIT_S",
    "SOLVER_HARD_LIMIT_S",
    "SOLVER_WALL_FACTOR",
    "PROGRAM_SMALL_SHARE",
    "solver_clock",
    "Recompute",
    "RecomputePlan",
    "JointPlan",
    "recompute_view",
    "choose",
    "plan_joint",
    "have_solver",
    "summary",
    "decisions",
    "infeasible_note",
]

STRATEGIES = ("auto", "offload", "recompute")
SOLVER_TIME_LIMIT_S = 0.5
"""Solver seconds (:func:`solver_clock`) after which the solver returns its best solution so far
(soft: see :meth:`_Model.solve`)."""
SOLVER_HARD_LIMIT_S = 10.0
"""Solver seconds (:func:`solver_clock`) the solver may search for a first feasible solution
before the greedy fallback."""
SOLVER_WALL_FACTOR = 4.0
"""The wall-clock backstop of a solve: HiGHS's own ``time_limit`` (wall seconds) is this many
times the hard limit in solver seconds, so that a solve stops on a machine so busy that the
solver's thread gets less than a quarter of a core (only there may the plan depend on the load)."""
SOLVER_START_PATIENCE_S = 0.5
"""Seconds past the soft time limit that the joint program searches for a first incumbent once the
recompute-only choice is known feasible (:func:`choose`; that choice is scored either way), and
that a program given a MIP start searches on for an incumbent better than the start
(:meth:`_Model.solve`)."""
MAX_EXACT_TRIES = 3
_EARLIER_INCUMBENTS = 2
"""How many of the joint program's incumbents before its last (the distinct recomputations, latest
first) are scored beside it, with offloading free (about 12 ms each on the Llama preset)."""
_MIN_PEAK_TIME_WEIGHT = 1e-4
"""Weight of the step's seconds against the peak in the lowest-peak program (both in model units:
1e6 units span the unplanned peak, 1e4 the step's compute): a tie-break, so that of two plans
with the same peak the faster one wins."""
_PREFIX_FRACTIONS = (0.125, 0.25, 0.5, 1.0)
# The programs leave out (keep) the smallest buffers while their bytes total at most this share of
# the bytes the plan must free (the unplanned peak over the budget); see _program_buffers.
PROGRAM_SMALL_SHARE = 0.01


def solver_clock() -> float:
    """Seconds of CPU time the calling thread has used (``time.thread_time``): the clock of the
    solver's time limits.

    HiGHS runs single-threaded (``threads=1``) in the calling thread, and its search is the same
    on every run of the same program; only where a time limit stops it depends on the clock. The
    thread's CPU time, unlike wall time, does not advance while other processes hold the cores,
    so the same program on the same machine gets the same plan whether the machine is idle or
    busy. Measured on this 2-core machine with three busy processes beside the solver: every
    incumbent of six programs came at the same CPU seconds within 10% and in the same order,
    at up to 2.1x the wall seconds; a compile test whose solve took 0.2 s idle and 0.49 s of wall
    time loaded had stopped at an earlier incumbent under the 0.5 s wall-clock limit and named
    another budget."""
    return time.thread_time()


def have_solver() -> bool:
    """Whether ``highspy`` (the HiGHS MIP solver) is importable."""
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class Recompute:
    """One recomputed buffer (bytes, FLOPs, seconds on the cost model's device), its nodes named
    (for reports) and referenced (``*_refs``, into the graphs before the rewrite; not compared nor
    in JSON, see :mod:`offload_compiler.ir.refs`).

    Attributes:
        buffer: its liveness buffer id (in the liveness before the rewrite).
        saved: forward names of its saved views, no longer saved.
        size_bytes: device bytes it no longer holds between its last forward and first backward reader.
        nodes: forward nodes duplicated into the backward.
        leaves: what the chain reads (forward names).
        new_saved: leaves added as saved values (parameters, inputs, generator states).
        rng_nodes: random ops replayed from their saved generator state.
        flops, seconds: of the recomputation, less the nodes an earlier record's chain shares
            (recomputed once, counted there): the records' sums are the rewrite's.
        saved_refs / node_refs / leaf_refs: ``saved``, ``nodes`` and ``leaves`` as nodes (a
            generator-state leaf, which the rewrite makes, by its random op).
    """

    buffer: int
    saved: tuple[str, ...]
    size_bytes: int
    nodes: tuple[str, ...]
    leaves: tuple[str, ...]
    new_saved: tuple[str, ...]
    rng_nodes: tuple[str, ...]
    flops: int
    seconds: float
    saved_refs: tuple = node_ref(())
    node_refs: tuple = node_ref(())
    leaf_refs: tuple = node_ref(())


@dataclass(frozen=True)
class RecomputePlan:
    """What the joint planner chose and how (bytes, seconds).

    Attributes:
        strategy: the strategy asked for (``"auto"``, ``"offload"``, ``"recompute"``).
        chosen: the winning candidate (``"none"`` when it fits without a plan, ``"offload only"``,
            ``"recompute only"``, ``"solver"``, ``"solver, offload free"``, ``"solver's incumbent k
            before its last, offload free"``, ``"greedy prefix k"``).
        recomputes: the recomputed buffers.
        solver: ``"highs"``, ``"greedy"`` or ``"none"`` (nothing to solve).
        solver_status: the solver's status, or why the greedy fallback was used.
        fallback_used: whether the greedy fallback made the choice set (no solver or no solution).
        solver_seconds / plan_seconds: wall time of the solver and of the whole joint planner.
        plan_cpu_seconds: the compiling thread's CPU time over the whole joint planner
            (``time.thread_time``): what the machine's speed gives, without the time its other
            work (another process, a hypervisor's steal) took from the wall time.
        solver_bound_seconds: HiGHS's proven lower bound (``mip_dual_bound``) on the joint
            program's objective when it stopped, in seconds: no choice of the program (offloads
            at their ideal windows, recompute chains) meets the budget with less recomputation
            plus exposed copy time. ``compute_seconds`` plus it bounds the step from below within
            the program's model (the scored plans are timed by the simulator, which it
            approximates). ``None`` without a joint program (no solver, strategy other than
            ``"auto"``, an infeasible budget).
        num_recomputable: saved buffers that have a recompute chain.
        refused: ``(saved view, reason)`` for saved buffers that may not be recomputed.
        scored: every candidate scored, ``(name, recomputed buffers, predicted step seconds,
            peak bytes, feasible)`` (stage 2, on the liveness view).
        lowest_reachable_peak_bytes: the lowest peak a scored all-out candidate reaches (every
            chain recomputed and/or every candidate offloaded tightly; stage 2 estimate).
        fits_without_plan: the budget is at or above the unplanned peak (nothing to do).
        note: why the exact stage changed the choice, if it did.
    """

    strategy: str
    chosen: str
    recomputes: tuple[Recompute, ...] = ()
    solver: str = "none"
    solver_status: str = ""
    fallback_used: bool = False
    solver_seconds: float = 0.0
    plan_seconds: float = 0.0
    plan_cpu_seconds: float = 0.0
    solver_bound_seconds: float | None = None
    num_recomputable: int = 0
    refused: tuple[tuple[str, str], ...] = ()
    scored: tuple[tuple[str, int, float, int, bool], ...] = ()
    lowest_reachable_peak_bytes: int | None = None
    fits_without_plan: bool = False
    note: str | None = None

    @property
    def recompute_flops(self) -> int:
        return sum(r.flops for r in self.recomputes)

    @property
    def recompute_seconds(self) -> float:
        return sum(r.seconds for r in self.recomputes)

    @property
    def recomputed_bytes(self) -> int:
        return sum(r.size_bytes for r in self.recomputes)

    def to_json(self) -> str:
        out = plain_dict(self)
        out.update(
            recompute_flops=self.recompute_flops,
            recompute_seconds=self.recompute_seconds,
            recomputed_bytes=self.recomputed_bytes,
        )
        return json.dumps(out, indent=1, default=str)


@dataclass(frozen=True)
class JointPlan:
    """The joint planner's answer.

    Attributes:
        recompute: the choice (see :class:`RecomputePlan`).
        chains: the chains to apply with :func:`.insert_recompute.apply` (on ``source_liveness``).
        source_liveness: the liveness the chains refer to (the graphs before the rewrite).
        liveness, costs: of the graphs after the recomputation (the source ones without any).
        plan: the working-window plan on them (evictions, peak, predicted step).
        rewritten_names: forward and backward node names after the rewrite (to check that the
            rewrite of the real graphs matches the copy this plan was made on).
        pin: the ``pin`` the copy was rewritten with (planned for Inductor); the real rewrite
            passes the same.
    """

    recompute: RecomputePlan
    chains: tuple[Chain, ...]
    source_liveness: Liveness
    liveness: Liveness
    costs: Costs
    plan: Plan
    rewritten_names: tuple[tuple[str, ...], tuple[str, ...]] = field(default=((), ()), repr=False)
    pin: bool = False


# ------------------------------------------------------------------------------------ the view
def _recompute_points(chains: dict[int, Chain], chosen) -> dict[int, int]:
    """Recompute step per chosen buffer: its first backward reader, or earlier when a chosen
    chain that reads it as a leaf comes first."""
    rc = {b: chains[b].recompute_before for b in chosen}
    changed = True
    while changed:
        changed = False
        for b in chosen:
            for d in chains[b].depends_on:
                if d in rc and rc[d] > rc[b]:
                    rc[d] = rc[b]
                    changed = True
    return rc


def recompute_view(live: Liveness, costs: Costs, chains: dict[int, Chain], chosen) -> tuple[Liveness, Costs]:
    """``live`` and ``costs`` as they would be with the buffers ``chosen`` recomputed (see the
    module docstring, stage 2). Buffer ids are kept; the recomputed copies, their chains'
    intermediates and nothing else are added after them."""
    chosen = frozenset(chosen)
    if not chosen:
        return live, costs
    rc = _recompute_points(chains, chosen)
    need: dict[int, int] = {}  # leaf buffer -> latest recompute step reading it
    need_view: dict[str, int] = {}  # leaf saved view -> earliest recompute step reading it
    for b in chosen:
        for leaf in chains[b].leaves:
            if leaf.buffer is not None:
                need[leaf.buffer] = max(need.get(leaf.buffer, -1), rc[b])
                need_view[leaf.fw_node] = min(need_view.get(leaf.fw_node, 1 << 62), rc[b])
    buffers = list(live.buffers)
    saved = list(live.saved)
    extra = []
    secs = list(costs.step_seconds)
    flops = list(costs.step_flops)
    nxt = len(buffers)
    states: dict[int, tuple[int, int]] = {}
    for b in sorted(chosen):
        buf, c = buffers[b], chains[b]
        end = max(buf.def_step, buf.last_fw_use if buf.last_fw_use is not None else buf.def_step)
        buffers[b] = replace(buf, last_step=end, saved=(), first_bw_use=None)
        common = dict(
            kind=BufferKind.TEMPORARY, use_steps=(), nodes=(), holders=(), saved=(), last_fw_use=None, first_bw_use=None
        )
        extra.append(
            replace(
                buf,
                id=nxt,
                def_step=rc[b],
                last_step=max(buf.last_step, need.get(b, -1), rc[b]),
                source_step=None,
                fused=False,
                **common,
            )
        )
        nxt += 1
        if c.transient_bytes:
            extra.append(
                replace(
                    buf,
                    id=nxt,
                    size_bytes=c.transient_bytes,
                    def_step=rc[b],
                    last_step=rc[b],
                    source_step=None,
                    fused=False,
                    **common,
                )
            )
            nxt += 1
        for step, nbytes in c.rng_states:
            if nbytes:  # a saved generator state: from the random op to the first replay
                prev = states.get(step)
                states[step] = (nbytes, min(rc[b], prev[1]) if prev else rc[b])
        secs[rc[b] - 1] += c.seconds
        flops[rc[b] - 1] += c.flops
    for step, (nbytes, until) in sorted(states.items()):
        extra.append(
            replace(
                live.buffers[next(iter(chosen))],
                id=nxt,
                kind=BufferKind.TEMPORARY,
                size_bytes=nbytes,
                def_step=step,
                last_step=until,
                use_steps=(),
                nodes=(),
                holders=(),
                saved=(),
                last_fw_use=None,
                first_bw_use=None,
                source_step=None,
                fused=False,
            )
        )
        nxt += 1
    for leaf_buf, step in need.items():
        if leaf_buf in chosen:
            continue
        buf = buffers[leaf_buf]
        if buf.kind is not BufferKind.SAVED:
            continue  # parameters and inputs live throughout
        upd = {}
        if buf.last_step < step:
            upd["last_step"] = step
        first = min(need_view.get(saved[i].fw_node, 1 << 62) for i in buf.saved) if buf.saved else 1 << 62
        if buf.first_bw_use is not None and first < buf.first_bw_use:
            upd["first_bw_use"] = first
        if upd:
            buffers[leaf_buf] = replace(buf, **upd)
        for i in buf.saved:
            s = saved[i]
            at = need_view.get(s.fw_node)
            if at is not None and s.first_bw_use is not None:
                saved[i] = replace(s, first_bw_use=min(s.first_bw_use, at), last_bw_use=max(s.last_bw_use, at))
    view = replace(live, buffers=tuple(buffers + extra), saved=tuple(saved))
    return view, replace(costs, step_seconds=tuple(secs), step_flops=tuple(flops))


# ------------------------------------------------------------------------------------ the model
@dataclass
class _Off:
    buffer: int
    size: int
    last: int
    issue: int
    e: int
    p: int
    hi_p: int
    groups: list
    d2h: float
    h2d: float


def _offload_cands(live: Liveness, costs: Costs, min_bytes: int, ce: np.ndarray) -> list[_Off]:
    """Offload candidates at their ideal working window (as :func:`.plan_window.plan` computes
    it before contention: each copy hides under compute, other copies ignored)."""
    F = live.num_fw_steps
    bw_compute = [s.index for s in live.steps[F:] if not s.is_placeholder]
    b0 = bw_compute[0] if bw_compute else F
    out = []
    for buf in live.candidates(min_bytes):
        groups = _groups(live, buf.id)
        issue = max(g.issue_after for g in groups)
        lo_e = max(buf.last_fw_use, issue)
        hi_e = max(lo_e, F - 2)
        hi_p = buf.first_bw_use
        lo_p = min(b0, hi_p)
        nbytes = sum(g.copy_bytes for g in groups)
        d2h = costs.transfer_seconds(nbytes, "d2h")
        h2d = costs.transfer_seconds(nbytes, "h2d")
        e = int(np.searchsorted(ce, ce[issue + 1] + d2h, side="left")) - 1
        p = int(np.searchsorted(ce, ce[hi_p] - h2d, side="right")) - 1
        out.append(
            _Off(
                buf.id,
                buf.size_bytes,
                buf.last_step,
                issue,
                min(max(e, lo_e), hi_e),
                min(max(p, lo_p), hi_p),
                hi_p,
                groups,
                d2h,
                h2d,
            )
        )
    return out


def _quiet_highs(highspy):
    """``highspy.Highs()`` without the banner its C++ constructor prints to the process's stdout
    (before any option can turn logging off): file descriptor 1 points to ``os.devnull`` for the
    duration of the constructor only."""
    import os
    import sys

    try:
        fd = sys.stdout.fileno() if hasattr(sys.stdout, "fileno") else 1
    except (OSError, ValueError):  # a captured stdout without a descriptor
        fd = 1
    sys.stdout.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
            try:
                return highspy.Highs()
            finally:
                os.dup2(saved, fd)
    finally:
        os.close(saved)


class _Model:
    """A sparse MIP built row by row (``row_lower <= A x <= row_upper``)."""

    def __init__(self):
        self.dual_bound: float | None = None  # after solve: HiGHS's proven lower bound on the objective
        # After solve: every improving solution HiGHS reported, in order (the last is the one
        # returned); empty with a highspy without the callback.
        self.incumbents: list[np.ndarray] = []
        self.cost: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.integer: list[bool] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []

    def var(self, cost=0.0, lo=0.0, hi=1.0, integer=False) -> int:
        self.cost.append(cost)
        self.lo.append(lo)
        self.hi.append(hi)
        self.integer.append(integer)
        return len(self.cost) - 1

    def row(self, coefs: dict[int, float], lo: float, hi: float) -> None:
        self.rows.append((coefs, lo, hi))

    def solve(self, time_limit: float, hard_limit: float | None = None, mip_start: dict[int, float] | None = None):
        """``(status text, solution or None)``.

        ``mip_start``: values of some variables (a known feasible choice: the recompute-only
        program's, in the joint one), handed to HiGHS as its first incumbent (a MIP start; HiGHS
        completes the other variables by an LP with these fixed, and drops a start that is not
        feasible). With one, the solver stops past ``time_limit`` at an incumbent better than
        the start, or at the start's after :data:`SOLVER_START_PATIENCE_S` more. :func:`choose`
        does not use it (with the recompute-only choice as the start HiGHS returned the start
        on small programs where it finds offloads without one); it bounds the joint program's
        ``hard_limit`` instead.

        ``time_limit`` (solver seconds, :func:`solver_clock`: the thread's CPU time, so that the
        plan does not depend on what else the machine runs) is soft: once it has passed, the
        solver stops at the first moment it holds a feasible solution (at once if it already
        does). Without one it searches on, up to ``hard_limit`` (solver seconds, default
        :data:`SOLVER_HARD_LIMIT_S`), so that a program whose first incumbent comes late gets a
        later plan, not a much worse one (llama-1b on H100 figures at the per-block checkpoint
        peak: no solution in 0.5 s on a loaded 2-core machine, so the greedy fallback's 194 ms
        step, against the solver's 80.6 ms after 2 s). HiGHS's own ``time_limit`` (wall seconds)
        is :data:`SOLVER_WALL_FACTOR` x the hard limit, a backstop. The limits are checked where
        HiGHS calls back (between its root node's rounds and nodes: about every 0.2 s at most on
        the demo GPT at 48 layers). With a ``highspy`` without MIP callbacks the limit is
        ``time_limit`` wall seconds, hard.
        """
        import highspy

        inf = highspy.kHighsInf
        lp = highspy.HighsLp()
        lp.num_col_ = len(self.cost)
        lp.num_row_ = len(self.rows)
        lp.col_cost_ = np.asarray(self.cost, dtype=np.float64)
        lp.col_lower_ = np.asarray([max(v, -inf) for v in self.lo], dtype=np.float64)
        lp.col_upper_ = np.asarray([min(v, inf) for v in self.hi], dtype=np.float64)
        lp.row_lower_ = np.asarray([max(r[1], -inf) for r in self.rows], dtype=np.float64)
        lp.row_upper_ = np.asarray([min(r[2], inf) for r in self.rows], dtype=np.float64)
        start, index, value = [0], [], []
        for coefs, _, _ in self.rows:
            for k, v in coefs.items():
                if v != 0.0:
                    index.append(k)
                    value.append(v)
            start.append(len(index))
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.asarray(start, dtype=np.int32)
        lp.a_matrix_.index_ = np.asarray(index, dtype=np.int32)
        lp.a_matrix_.value_ = np.asarray(value, dtype=np.float64)
        lp.integrality_ = [
            highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in self.integer
        ]
        h = _quiet_highs(highspy)
        h.setOptionValue("output_flag", False)
        h.setOptionValue("mip_rel_gap", 1e-3)
        h.setOptionValue("threads", 1)
        hard = max(float(time_limit), SOLVER_HARD_LIMIT_S if hard_limit is None else float(hard_limit))
        start, wall_start = solver_clock(), time.perf_counter()
        caller = threading.get_ident()

        first = [None]  # the first incumbent's objective: the start's, when there is one
        stopped = [False]  # whether a limit below stopped it (HiGHS says "Interrupted by user")

        def stop_when_solved(event) -> None:
            # A highspy that called back from another thread: that thread's CPU clock is not the
            # caller's, so wall time (the limits then depend on the load, as before solver_clock).
            if threading.get_ident() == caller:
                elapsed = solver_clock() - start
            else:
                elapsed = time.perf_counter() - wall_start
            # mip_primal_bound: the incumbent's objective (+inf while there is none).
            bound = event.data_out.mip_primal_bound
            if bound >= inf:
                if elapsed >= hard:  # no solution within the hard limit: the greedy fallback
                    stopped[0] = True
                    event.interrupt()
                return
            if first[0] is None:
                first[0] = bound
            if elapsed < time_limit:
                return
            improved = bound < first[0] - 1e-9 * max(1.0, abs(first[0]))
            if not mip_start or improved or elapsed >= time_limit + SOLVER_START_PATIENCE_S:
                stopped[0] = True
                event.interrupt()

        self.incumbents = []

        def record(event) -> None:
            self.incumbents.append(np.array(event.data_out.mip_solution, dtype=np.float64))

        try:
            h.cbMipInterrupt.subscribe(stop_when_solved)
            h.cbMipImprovingSolution.subscribe(record)
            h.setOptionValue("time_limit", SOLVER_WALL_FACTOR * hard)
        except AttributeError:  # highspy before the callback descriptors (1.8)
            h.setOptionValue("time_limit", float(time_limit))
        h.passModel(lp)
        if mip_start:
            idx = np.asarray(sorted(mip_start), dtype=np.int32)
            try:
                h.setSolution(len(idx), idx, np.asarray([mip_start[int(i)] for i in idx], dtype=np.float64))
            except TypeError:  # highspy before sparse solutions (1.8): the full vector or nothing
                pass
        h.run()
        status = h.modelStatusToString(h.getModelStatus())
        if stopped[0] and h.getModelStatus() == highspy.HighsModelStatus.kInterrupt:
            status = "Time limit reached"  # ours, in solver seconds
        info = h.getInfo()
        self.dual_bound = float(info.mip_dual_bound)  # model units (the objective's)
        if info.primal_solution_status != 2:  # 2: a feasible solution
            return status, None
        return status, np.asarray(h.getSolution().col_value)


def _base_live_bytes(live: Liveness, earlier_runs: int = 0) -> np.ndarray:
    """Device bytes live at each step with nothing offloaded or recomputed: the pair's own plus,
    at every step, the boundary-crossing saved activations the ``earlier_runs`` keep (int64)."""
    held = earlier_runs * sum(live.boundary_saved.values()) if earlier_runs else 0
    return live.live_bytes() + held


def _build_model(
    live,
    costs,
    offs: list[_Off],
    chains: list[Chain],
    budget: int,
    use_offload,
    use_recompute,
    earlier_runs: int = 0,
    kept_cap: int | None = None,
    min_peak: bool = False,
):
    """The MIP of the module docstring. Returns ``(model, offload var per buffer, recompute var
    per buffer)``. ``kept_cap``: the row capping the kept boundary-crossing saved bytes.

    ``min_peak``: the lowest-peak program, solved when the budget's is infeasible. ``budget`` is
    then ignored: a peak variable ``P`` (bytes, in model units) bounds the live bytes of every
    step, and the objective is ``P`` plus the step's seconds weighted by
    :data:`_MIN_PEAK_TIME_WEIGHT` (of two plans with the same peak, the faster one)."""
    T = live.num_steps
    crossing = live.boundary_saved if earlier_runs else {}
    base = _base_live_bytes(live, earlier_runs)
    ce = np.concatenate([[0.0], np.cumsum(np.asarray(costs.step_seconds, dtype=np.float64))])
    sb = max(1.0, float(base.max())) / 1e6  # bytes -> model units
    st = max(float(ce[-1]), 1e-12) / 1e4  # seconds -> model units
    w = _MIN_PEAK_TIME_WEIGHT if min_peak else 1.0  # weight of the step's seconds in the objective
    m = _Model()
    # Synchronous copies (the device is the host CPU) stall the compute stream for their whole
    # time wherever they are placed: each offload costs its two copies, and there are no channels.
    sync = costs.synchronous_copies
    xo = (
        {c.buffer: m.var(w * (c.d2h + c.h2d) / st if sync else 0.0, 0.0, 1.0, True) for c in offs}
        if use_offload
        else {}
    )
    xr = {c.buffer: m.var(w * c.seconds / st, 0.0, 1.0, True) for c in chains} if use_recompute else {}
    peak = m.var(1.0, -np.inf, np.inf) if min_peak else None
    for b in set(xo) & set(xr):
        m.row({xo[b]: 1.0, xr[b]: 1.0}, -np.inf, 1.0)
    if kept_cap is not None:
        # Kept = sum(size) - sum(size x (offloaded + recomputed)) <= cap.
        boundary = live.boundary_saved
        coefs: dict[int, float] = {}
        for b, size in boundary.items():
            for x in (xo, xr):
                if b in x:
                    coefs[x[b]] = coefs.get(x[b], 0.0) + size / sb
        need = (sum(boundary.values()) - kept_cap) / sb
        if coefs and need > 0:
            m.row(coefs, need, np.inf)
    # Memory: jumps of live bytes where a choice changes them.
    jumps: dict[int, dict[int, float]] = {}

    def jump(step: int, var: int, nbytes: float) -> None:
        if 0 <= step < T and nbytes:
            d = jumps.setdefault(step, {})
            d[var] = d.get(var, 0.0) + nbytes / sb

    for c in offs:
        if c.buffer not in xo:
            continue
        v = xo[c.buffer]
        jump(0, v, -earlier_runs * crossing.get(c.buffer, 0))  # the earlier runs evict it too
        jump(c.e + 1, v, -c.size)
        jump(c.last + 1, v, c.size)
        for g in c.groups:
            jump(c.p, v, g.copy_bytes)
            jump(g.last_use + 1, v, -g.copy_bytes)
    for c in chains:
        if c.buffer not in xr:
            continue
        v = xr[c.buffer]
        jump(0, v, -earlier_runs * crossing.get(c.buffer, 0))  # and recompute it
        if c.recompute_before > c.last_fw_use + 1:
            jump(c.last_fw_use + 1, v, -c.size_bytes)
            jump(c.recompute_before, v, c.size_bytes)
        jump(c.recompute_before, v, c.transient_bytes)
        jump(c.recompute_before + 1, v, -c.transient_bytes)
        for step, nbytes in c.rng_states:
            jump(step, v, nbytes)
            jump(c.recompute_before + 1, v, -nbytes)
    # A chain that reads a recomputed leaf before the leaf's own recompute point moves that
    # recomputation earlier (the leaf's copy lives longer): with both chosen (y >= r_d + r_L - 1)
    # the leaf's bytes count from the dependent's point. Moves of moves are excluded (below), so
    # this is exact for every choice the model allows.
    by_buf = {c.buffer: c for c in chains if c.buffer in xr}
    moves = _moves(by_buf)
    for d, leaf in moves:
        y = m.var(0.0, 0.0, 1.0)
        m.row({y: 1.0, xr[d]: -1.0, xr[leaf]: -1.0}, -1.0, np.inf)
        jump(by_buf[d].recompute_before, y, by_buf[leaf].size_bytes)
        jump(by_buf[leaf].recompute_before, y, -by_buf[leaf].size_bytes)
    for d, leaf, leaf2 in _double_moves(by_buf, moves):
        m.row({xr[d]: 1.0, xr[leaf]: 1.0, xr[leaf2]: 1.0}, -np.inf, 2.0)
    points = sorted(set(jumps) | {0})
    seg_max = np.maximum.reduceat(base, points)
    prev = None
    for pt, mx in zip(points, seg_max):
        if min_peak:  # d + mx <= P
            d = m.var(0.0, -np.inf, np.inf)
            m.row({d: 1.0, peak: -1.0}, -np.inf, -int(mx) / sb)
        else:
            d = m.var(0.0, -np.inf, (budget - int(mx)) / sb)
        coefs = {d: 1.0}
        if prev is not None:
            coefs[prev] = -1.0
        for var, val in jumps.get(pt, {}).items():
            coefs[var] = coefs.get(var, 0.0) - val
        m.row(coefs, 0.0, 0.0)
        prev = d
    # Recompute time in the backward, cumulative over recompute points (U(x) in the docstring).
    pis = sorted({c.recompute_before for c in chains if c.buffer in xr})
    vcols = []
    for i, pos in enumerate(pis):
        v = m.var(0.0, 0.0, np.inf)
        coefs = {v: 1.0}
        if i:
            coefs[vcols[-1]] = -1.0
        for c in chains:
            if c.buffer in xr and c.recompute_before == pos:
                coefs[xr[c.buffer]] = -c.seconds / st
        m.row(coefs, 0.0, 0.0)
        vcols.append(v)

    def u_at(x: int) -> int | None:
        i = bisect.bisect_right(pis, x) - 1
        return vcols[i] if i >= 0 else None

    def channel(items) -> None:
        """items: (var, copy seconds, release step position, wait position), in issue order."""
        if not items:
            return
        e = m.var(w, 0.0, np.inf)
        q_prev = m_prev = None
        for var, secs, rel, wait in items:
            q = m.var(0.0, 0.0, np.inf)
            coefs = {q: 1.0, var: -secs / st}
            if q_prev is not None:
                coefs[q_prev] = -1.0
            m.row(coefs, 0.0, 0.0)
            mk = m.var(0.0, -np.inf, np.inf)
            if m_prev is not None:
                m.row({mk: 1.0, m_prev: -1.0}, -np.inf, 0.0)
            # m_k <= Q_{k-1} - (ce[rel] + U(rel))
            coefs = {mk: 1.0}
            if q_prev is not None:
                coefs[q_prev] = -1.0
            ur = u_at(rel)
            if ur is not None:
                coefs[ur] = coefs.get(ur, 0.0) + 1.0
            m.row(coefs, -np.inf, -ce[rel] / st)
            # E >= Q_k - (ce[wait] + U(wait)) - m_k
            coefs = {e: 1.0, q: -1.0, mk: 1.0}
            uw = u_at(wait)
            if uw is not None:
                coefs[uw] = coefs.get(uw, 0.0) + 1.0
            m.row(coefs, -ce[wait] / st, np.inf)
            q_prev, m_prev = q, mk

    live_offs = [c for c in offs if c.buffer in xo and not sync]
    channel([(xo[c.buffer], c.d2h, c.issue + 1, c.e + 1) for c in sorted(live_offs, key=lambda c: c.issue)])
    channel([(xo[c.buffer], c.h2d, c.p, c.hi_p) for c in sorted(live_offs, key=lambda c: (c.p, c.hi_p))])
    return m, xo, xr


def _moves(by_buf: dict[int, Chain]) -> list[tuple[int, int]]:
    """``(dependent, leaf)`` pairs of chains where the dependent reads the recomputed leaf before
    the leaf's own recompute point."""
    out = []
    for d, c in by_buf.items():
        for leaf in c.depends_on:
            if leaf in by_buf and by_buf[leaf].recompute_before > c.recompute_before:
                out.append((d, leaf))
    return out


def _double_moves(by_buf: dict[int, Chain], moves) -> list[tuple[int, int, int]]:
    """Chains of two moves ``d -> leaf -> leaf2`` whose second move the first one extends."""
    after: dict[int, list[int]] = {}
    for d, leaf in moves:
        after.setdefault(d, []).append(leaf)
    out = []
    for d, leaf in moves:
        for leaf2 in after.get(leaf, ()):
            if by_buf[leaf2].recompute_before > by_buf[d].recompute_before:
                out.append((d, leaf, leaf2))
    return out


def _no_double_moves(ranking: list[Chain], limit: int | None = None) -> frozenset[int]:
    """Chains from the front of ``ranking`` (at most ``limit``), skipping any that would make a
    move of a move with those already taken (see :func:`_build_model`)."""
    taken: dict[int, Chain] = {}
    for c in ranking:
        if limit is not None and len(taken) >= limit:
            break
        trial = {**taken, c.buffer: c}
        if _double_moves(trial, _moves(trial)):
            continue
        taken = trial
    return frozenset(taken)


def _program_buffers(
    live: Liveness, offs: list[_Off], chains, budget: int, earlier_runs: int = 0
) -> tuple[list[_Off], list[Chain], int, int]:
    """The offload candidates and chains the programs get: ``(offs, chains, buffers left out,
    their bytes)``.

    The smallest buffers are left out (kept) while their bytes total at most
    :data:`PROGRAM_SMALL_SHARE` of the bytes the plan must free (the unplanned peak, earlier
    runs' kept saved activations included, minus ``budget``): what the program chooses for them
    moves the step by little, and each costs it a binary, rows in its memory and channel
    constraints and branching. The demo GPT at 48 layers on H100 figures at 50%: 243 of 629
    buffers (4 and 16 KiB LayerNorm statistics and the like, 1.58 MB of the 223 MB to free) left
    out, the joint program went from 6,291 to 4,585 variables and found its first incumbent
    inside its limits (before: at 2.4 s of CPU, past them), and the planner chose it: a step
    predicted at 8.757 ms against 8.876 ms. The scored candidates' working-window plans may still
    offload the left-out buffers (the "offload free" variants); a program that is infeasible
    without them is solved again with them (:func:`choose`)."""
    base = _base_live_bytes(live, earlier_runs)
    need = int(base.max()) - budget if len(base) else 0
    if need <= 0:
        return offs, list(chains), 0, 0
    sizes = {o.buffer: o.size for o in offs}
    sizes.update((c.buffer, c.size_bytes) for c in chains)
    left: set[int] = set()
    total = 0
    for b, size in sorted(sizes.items(), key=lambda kv: (kv[1], kv[0])):
        if total + size > PROGRAM_SMALL_SHARE * need:
            break
        left.add(b)
        total += size
    if not left:
        return offs, list(chains), 0, 0
    return [o for o in offs if o.buffer not in left], [c for c in chains if c.buffer not in left], len(left), total


# ------------------------------------------------------------------------------------ choosing
def _over_cap(p: Plan) -> bool:
    """Whether ``p`` keeps more boundary-crossing saved bytes than its ``kept_cap``."""
    return p.kept_bytes is not None and p.kept_cap_bytes is not None and p.kept_bytes > p.kept_cap_bytes


def _score_key(p: Plan, n_recompute: int):
    # Of the plans that miss the budget, those within a kept cap first (the cap is what a later
    # pair of the step counts on), then the lowest peak.
    if p.feasible:
        return (0, 0, p.predicted_step_seconds, n_recompute)
    return (1, int(_over_cap(p)), p.step_peak_bytes, n_recompute)


def choose(
    live: Liveness,
    costs: Costs,
    chains: tuple[Chain, ...],
    budget: int | None,
    strategy: str = "auto",
    min_offload_bytes: int = 0,
    time_limit_s: float = SOLVER_TIME_LIMIT_S,
    use_solver: bool = True,
    earlier_runs: int = 0,
    kept_cap: int | None = None,
) -> tuple[str, frozenset[int], frozenset[int] | None, dict]:
    """Stages 1 and 2 of the module docstring: the winning ``(name, recomputed buffers, offload
    restriction or None, details)``. ``details`` has ``solver``, ``solver_status``,
    ``fallback_used``, ``solver_seconds``, ``scored`` and ``lowest``. ``earlier_runs`` and
    ``kept_cap``: as :func:`.plan_window.plan`'s.

    Raises:
        ValueError: for an unknown ``strategy``.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(STRATEGIES)}")
    by_buf = {c.buffer: c for c in chains}
    details = {"solver": "none", "solver_status": "", "fallback_used": False, "solver_seconds": 0.0}
    scored: dict[tuple, tuple[str, Plan]] = {}

    def score(name: str, chosen, only) -> Plan:
        key = (frozenset(chosen), only)
        if key not in scored:
            view, vcosts = recompute_view(live, costs, by_buf, chosen)
            allowed = only
            if allowed is not None:
                allowed = frozenset(b for b in allowed if b not in chosen)
            scored[key] = (
                name,
                plan_offload(
                    view, vcosts, budget, min_offload_bytes, only=allowed, earlier_runs=earlier_runs, kept_cap=kept_cap
                ),
            )
        return scored[key][1]

    offload_ok = strategy in ("auto", "offload")
    recompute_ok = strategy in ("auto", "recompute") and bool(chains)
    if offload_ok:
        score("offload only", (), None)
    if recompute_ok:
        # The cheapest recomputation per byte freed first.
        ranking = sorted(chains, key=lambda c: (c.seconds / max(1, c.size_bytes), -c.size_bytes))
        alone = _fit_by_recompute(live, ranking, budget, earlier_runs, kept_cap)
        solved_rc = solved_joint = None
        earlier: list[frozenset[int]] = []  # the joint program's earlier incumbents' recomputations
        if use_solver and have_solver() and budget is not None:
            t0 = time.perf_counter()
            details["solver"] = "highs"
            ce = np.concatenate([[0.0], np.cumsum(np.asarray(costs.step_seconds, dtype=np.float64))])
            offs = _offload_cands(live, costs, min_offload_bytes, ce)
            p_offs, p_chains, n_left, left_bytes = _program_buffers(live, offs, chains, budget, earlier_runs)
            statuses = []
            if n_left:
                statuses.append(f"{n_left} smallest buffers ({left_bytes} bytes) kept out of the programs")
            try:
                # The recompute-only program (what strategy="recompute" solves, so that auto
                # scores it too) is small and easy: at most a quarter of the time; the joint one
                # what the first left. The time counted is the solver's own (solver_clock, the
                # thread's CPU time), from each program's start: a pause between them (building
                # the joint program, the host's other work, a garbage collection in a large
                # process) must not cut the joint search short. On the Llama preset at the per-block checkpoint peak (H100 figures) the
                # joint program's incumbents come at 0.05, 0.18 and 0.84 s; a share shrunk below
                # 0.18 s stopped it at the second, a 15.85 ms step against the third's 15.75 ms
                # (the GPU frontier run at 6742d7e).
                variants = [("recompute only", False)] + ([("solver", True)] if offload_ok else [])
                solving = [0.0]  # seconds spent inside earlier programs' solves

                def share(with_offload: bool) -> float:
                    if with_offload is False and offload_ok:
                        return 0.25 * time_limit_s
                    return time_limit_s - solving[0]

                for name, with_offload in variants:
                    model, xo, xr = _build_model(
                        live, costs, p_offs, p_chains, budget, with_offload, True, earlier_runs, kept_cap
                    )
                    started = solver_clock()

                    def time_left(with_offload: bool = with_offload, started: float = started) -> float:
                        return max(0.05, share(with_offload) - (solver_clock() - started))

                    # The recompute-only choice is scored whatever the joint program finds, so
                    # once it is known feasible the joint program searches for its first
                    # incumbent only SOLVER_START_PATIENCE_S past its time limit, not up to
                    # SOLVER_HARD_LIMIT_S (the demo GPT at 48 layers on H100 figures has none
                    # before 1.9 s). Not a MIP start: handing HiGHS that choice (41c12bb) made it
                    # return the start on small programs where it finds offloads without it
                    # (test_e2e's eager cases evicted nothing at 50%).
                    hard = None
                    if with_offload and solved_rc is not None and solved_rc[0] == "recompute only":
                        hard = time_left(with_offload) + SOLVER_START_PATIENCE_S
                    status, sol = model.solve(time_left(with_offload), hard_limit=hard)
                    statuses.append(f"{name}: {status}")
                    if sol is None and status == "Infeasible" and n_left:
                        # Infeasible without the small buffers: with them.
                        model, xo, xr = _build_model(
                            live, costs, offs, list(chains), budget, with_offload, True, earlier_runs, kept_cap
                        )
                        status, sol = model.solve(time_left(with_offload), hard_limit=hard)
                        statuses.append(f"{name}, every buffer: {status}")
                    if sol is None and status == "Infeasible":
                        # No choice meets the budget: the choice with the lowest peak instead
                        # (what on_infeasible="warn" runs and the error quotes), not the greedy
                        # fallback's, whose recompute transients can pile up to a higher peak.
                        name = f"{name}, lowest peak"
                        model, xo, xr = _build_model(
                            live,
                            costs,
                            offs,
                            list(chains),
                            budget,
                            with_offload,
                            True,
                            earlier_runs,
                            kept_cap,
                            min_peak=True,
                        )
                        status, sol = model.solve(time_left(with_offload))
                        statuses.append(f"{name}: {status}")
                    solving[0] += solver_clock() - started
                    if sol is None:
                        continue
                    chosen = frozenset(b for b, v in xr.items() if sol[v] > 0.5)
                    picked = frozenset(b for b, v in xo.items() if sol[v] > 0.5)
                    if with_offload:
                        solved_joint = (name, chosen, picked)
                        if name == "solver":
                            # The program's objective approximates the simulator's step: an
                            # earlier incumbent can score better than the last (on the Llama
                            # preset at the checkpoint peak, H100 figures, given 3 s the last
                            # incumbent gave 15.82 ms and the one before it 15.75 ms).
                            earlier = []
                            for inc in reversed(model.incumbents[:-1]):
                                rc = frozenset(b for b, v in xr.items() if inc[v] > 0.5)
                                if rc != chosen and rc not in earlier:
                                    earlier.append(rc)
                                if len(earlier) == _EARLIER_INCUMBENTS:
                                    break
                        if name == "solver" and model.dual_bound is not None and np.isfinite(model.dual_bound):
                            # Objective units: seconds / st, st = the step's compute / 1e4 (_build_model).
                            details["solver_bound_seconds"] = (
                                max(0.0, model.dual_bound) * max(float(ce[-1]), 1e-12) / 1e4
                            )
                    else:
                        solved_rc = (name, chosen)
            except Exception as exc:  # a solver failure must not fail the compile: fall back
                statuses.append(f"error: {type(exc).__name__}: {exc}")
            details["solver_status"] = "; ".join(statuses)
            details["solver_seconds"] = time.perf_counter() - t0
        else:
            details["solver"] = "greedy"
            details["solver_status"] = (
                "highspy is not installed" if not have_solver() else "solver off" if not use_solver else "no budget"
            )
        if solved_rc is None and solved_joint is None:
            details["fallback_used"] = details["solver"] != "none"
            details["solver"] = "greedy"
        if solved_rc is None:
            score("recompute only", alone, frozenset())
        elif solved_rc[0] == "recompute only":
            score("recompute only", solved_rc[1], frozenset())
        else:  # the lowest-peak program's choice, and the greedy one next to it
            score(f"{solved_rc[0]} (solver)", solved_rc[1], frozenset())
            score("recompute only", alone, frozenset())
        if solved_joint is not None:
            score(solved_joint[0], solved_joint[1], solved_joint[2])
            score(f"{solved_joint[0]}, offload free", solved_joint[1], None)
            for k, rc in enumerate(earlier, 1):
                score(f"solver's incumbent {k} before its last, offload free", rc, None)
        if offload_ok:
            # Prefixes of the ranking with offloading free: all of them for the fallback, the
            # largest two next to the solver's choice.
            n = len(alone)
            fractions = _PREFIX_FRACTIONS if solved_joint is None else _PREFIX_FRACTIONS[-2:]
            for f in fractions:
                k = max(1, int(round(f * n)))
                score(f"greedy prefix {k}", _no_double_moves(ranking, k), None)
        if not any(p.feasible for _n, p in scored.values()):
            # The lowest peaks: everything recomputed, alone and with the rest offloaded tightly.
            everything = _no_double_moves(ranking)
            score("recompute everything", everything, frozenset())
            if offload_ok:
                score("recompute everything, offload the rest", everything, None)
    if not scored:  # recompute only, and nothing can be recomputed
        score("recompute only", (), frozenset())
    ranked = sorted(scored.items(), key=lambda kv: _score_key(kv[1][1], len(kv[0][0])))
    details["ranked"] = tuple((name, chosen, only) for (chosen, only), (name, _p) in ranked)
    best = details["ranked"][0]
    details["scored"] = tuple(
        (name, len(chosen), p.predicted_step_seconds, p.step_peak_bytes, p.feasible)
        for (chosen, only), (name, p) in scored.items()
    )
    lows = [p.lowest_reachable_peak_bytes for (_c, o), (_n, p) in scored.items() if o is None]
    lows += [p.step_peak_bytes for (_c, o), (_n, p) in scored.items() if o is not None]
    details["lowest"] = min(lows) if lows else None
    details["offload_only"] = scored.get((frozenset(), None), (None, None))[1]
    return best[0], best[1], best[2], details


def _fit_by_recompute(
    live: Liveness, ranking: list[Chain], budget: int | None, earlier_runs: int = 0, kept_cap: int | None = None
) -> frozenset[int]:
    """Chains from the front of ``ranking`` (no move of a move, see :func:`_build_model`) until
    the recomputation alone brings the peak within ``budget``, by the model's memory (with
    ``earlier_runs``' kept saved activations, :func:`.plan_window.plan`) and the kept
    boundary-crossing saved bytes within ``kept_cap``; all that can be taken if it never does."""
    if budget is None:
        return frozenset()
    boundary = live.boundary_saved
    crossing = boundary if earlier_runs else {}
    cur = live.live_bytes() + earlier_runs * sum(crossing.values())
    kept = sum(boundary.values())

    def fits() -> bool:
        return cur.max() <= budget and (kept_cap is None or kept <= kept_cap)

    if fits():
        return frozenset()
    T = live.num_steps
    taken: dict[int, Chain] = {}

    def add(d, step, nbytes):
        if 0 <= step < T:
            d[step] += nbytes

    for c in ranking:
        trial = {**taken, c.buffer: c}
        moves = _moves(trial)
        if _double_moves(trial, moves):
            continue
        d = np.zeros(T + 1, dtype=np.int64)
        if c.recompute_before > c.last_fw_use + 1:
            add(d, c.last_fw_use + 1, -c.size_bytes)
            add(d, c.recompute_before, c.size_bytes)
        add(d, c.recompute_before, c.transient_bytes)
        add(d, c.recompute_before + 1, -c.transient_bytes)
        for dep, leaf in moves:
            if c.buffer in (dep, leaf):
                add(d, trial[dep].recompute_before, trial[leaf].size_bytes)
                add(d, trial[leaf].recompute_before, -trial[leaf].size_bytes)
        cur = cur + np.cumsum(d[:-1]) - earlier_runs * crossing.get(c.buffer, 0)
        kept -= boundary.get(c.buffer, 0)
        taken = trial
        if fits():
            break
    return frozenset(taken)


def _costs_after(pair, live: Liveness, costs: Costs, live2: Liveness) -> Costs:
    """The cost model on the rewritten ``pair`` (liveness ``live2``). A node's cost depends on the
    node, on whether it is fused into its reader and on which of its inputs are fused into it
    (:func:`.cost_model.node_cost`): a node the rewrite kept, with the same fusion of itself and
    of its inputs, reuses its figures from ``costs`` (on ``live``; measured op times stay the
    same); the inserted ones and those whose fusion changed are estimated with ``live2``'s fused
    nodes, as :func:`.cost_model.estimate` would (a recomputed pointwise chain is one kernel, as
    its forward original is)."""
    import torch

    from .cost_model import node_cost

    allow_tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    # By (graph, name): ``live`` holds the graphs before the rewrite, these nodes are their copies.
    fused_before = {(live.steps[live.step_at(h)].graph, h.name) for h in live.fused_holders() if h in live.node_step}
    fused_nodes = live2.fused_holders()
    secs, flops, nbytes = [], [], []
    nodes = list(pair.forward.graph.nodes) + list(pair.backward.graph.nodes)
    for step, n in zip(live2.steps, nodes):
        old = live.step_of.get((step.graph, step.node))
        same = (
            old is not None
            and live.steps[old].op == step.op
            and RECOMPUTE_KEY not in n.meta
            and ((step.graph, n.name) in fused_before) == (n in fused_nodes)
            and all(
                RECOMPUTE_KEY not in m.meta
                and (step.graph, m.name) in live.step_of
                and ((step.graph, m.name) in fused_before) == (m in fused_nodes)
                for m in n.all_input_nodes
            )
        )
        if same:
            secs.append(costs.step_seconds[old])
            flops.append(costs.step_flops[old])
            nbytes.append(costs.step_bytes[old])
        else:
            f, b, t = node_cost(n, costs.device, allow_tf32, fused_nodes)
            secs.append(t)
            flops.append(f)
            nbytes.append(b)
    return replace(costs, step_seconds=tuple(secs), step_flops=tuple(flops), step_bytes=tuple(nbytes))


# ------------------------------------------------------------------------------------ all stages
def _records(live: Liveness, costs: Costs, chains) -> tuple[Recompute, ...]:
    """The report's records of ``chains``. A node on several chains is recomputed once (the
    rewrite copies it for the first chain that needs it and the others read that copy), so its
    FLOPs and seconds count in the first record only: the records' sums are what the rewritten
    backward recomputes (a fresh-user trial's two transformer blocks: 0.268 GFLOP reported, each
    block's projection counted twice, against the 0.235 GFLOP of the rewrite)."""
    out = []
    counted: set = set()
    for c in chains:
        steps = [live.step_at(n) for n in c.node_refs if n not in counted]
        counted.update(c.node_refs)
        out.append(
            Recompute(
                buffer=c.buffer,
                saved=tuple(live.saved[i].fw_node for i in c.saved),
                size_bytes=c.size_bytes,
                nodes=c.nodes,
                leaves=tuple(leaf.fw_node for leaf in c.leaves),
                new_saved=tuple(leaf.fw_node for leaf in c.leaves if leaf.bw_node is None),
                rng_nodes=c.rng_nodes,
                flops=int(sum(costs.step_flops[i] for i in steps)),
                seconds=float(sum(costs.step_seconds[i] for i in steps)),
                saved_refs=tuple(live.saved[i].fw_ref for i in c.saved),
                node_refs=c.node_refs,
                leaf_refs=tuple(leaf.fw_ref for leaf in c.leaves),
            )
        )
    return tuple(out)


def plan_joint(
    pair,
    live: Liveness,
    costs: Costs,
    budget: int | None,
    strategy: str = "auto",
    min_offload_bytes: int = 0,
    rng_replay: bool = False,
    assume_fusion: bool = False,
    time_limit_s: float = SOLVER_TIME_LIMIT_S,
    use_solver: bool = True,
    margins=None,
    earlier_runs: int = 0,
    kept_cap: int | None = None,
) -> JointPlan:
    """Plan keep/offload/recompute for ``pair`` (all three stages of the module docstring).

    Args:
        pair: the graphs ``live`` and ``costs`` describe (not changed).
        live, costs: their liveness and costs.
        budget: peak device bytes allowed (``None``: no limit).
        strategy: ``"auto"`` (the best of everything), ``"offload"`` (offload only: the
            working-window planner alone), ``"recompute"`` (recompute only, no copies).
        min_offload_bytes: buffers smaller than this are not offloaded.
        rng_replay: whether random ops may be recomputed by replaying their generator state
            (``inner="eager"``; see :mod:`.recompute_chains`).
        assume_fusion: liveness's ``assume_fusion`` (the inner compiler is Inductor).
        time_limit_s: the solver's time limit (seconds).
        use_solver: ``False`` forces the greedy fallback (tests, comparisons).
        margins: measured per-op workspace (:class:`~.margins.WorkspaceMargins`, from the runtime
            check of the first steps): the liveness of a rewritten candidate counts it as ``live``'s does.
        earlier_runs: runs of the same pair whose kept saved activations are held while this
            one runs (a block graph run by ``earlier_runs + 1`` blocks per step; module docstring).
        kept_cap: at most this many bytes of boundary-crossing saved activations stay on the
            device across the forward/backward boundary (module docstring); ``None``: no cap.

    Python's cyclic garbage collector is paused while it plans (:mod:`.gc_pause`): the planner
    allocates many small objects while the graphs keep millions alive, and each collection walks
    them all (at 48 layers the model building took 2.8 s with it, 0.17 s without).

    Raises:
        ValueError: for an unknown ``strategy``.
    """
    cpu0 = time.thread_time()
    with paused_gc():
        joint = _plan_joint(
            pair,
            live,
            costs,
            budget,
            strategy,
            min_offload_bytes,
            rng_replay,
            assume_fusion,
            time_limit_s,
            use_solver,
            margins,
            earlier_runs,
            kept_cap,
        )
    return replace(joint, recompute=replace(joint.recompute, plan_cpu_seconds=time.thread_time() - cpu0))


def _plan_joint(
    pair,
    live: Liveness,
    costs: Costs,
    budget: int | None,
    strategy: str = "auto",
    min_offload_bytes: int = 0,
    rng_replay: bool = False,
    assume_fusion: bool = False,
    time_limit_s: float = SOLVER_TIME_LIMIT_S,
    use_solver: bool = True,
    margins=None,
    earlier_runs: int = 0,
    kept_cap: int | None = None,
) -> JointPlan:
    """:func:`plan_joint` without pausing the garbage collector."""
    from . import insert_recompute, recompute_chains
    from . import liveness as liveness_pass

    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(STRATEGIES)}")
    t0 = time.perf_counter()
    held = earlier_runs * sum(live.boundary_saved.values()) if earlier_runs else 0
    capped = kept_cap is not None and sum(live.boundary_saved.values()) > kept_cap
    if budget is None or (live.peak_bytes + held <= budget and not capped):
        the_plan = plan_offload(live, costs, budget, min_offload_bytes, earlier_runs=earlier_runs, kept_cap=kept_cap)
        rp = RecomputePlan(
            strategy, "none", fits_without_plan=True, plan_seconds=time.perf_counter() - t0, note="fits without a plan"
        )
        return JointPlan(rp, (), live, live, costs, the_plan)
    analysis = recompute_chains.analyze(pair, live, costs, rng_replay=rng_replay)
    refused = []
    for bid, why in analysis.refused:
        names = [live.saved[i].fw_node for i in live.buffers[bid].saved]
        refused.append((", ".join(names), why))

    def choose_for(budget_bytes):
        return choose(
            live,
            costs,
            analysis.chains,
            budget_bytes,
            strategy,
            min_offload_bytes,
            time_limit_s,
            use_solver,
            earlier_runs,
            kept_cap,
        )

    name, chosen, only, details = choose_for(budget)
    by_buf = analysis.by_buffer()
    common = dict(
        strategy=strategy,
        solver=details["solver"],
        solver_status=details["solver_status"],
        fallback_used=details["fallback_used"],
        solver_seconds=details["solver_seconds"],
        solver_bound_seconds=details.get("solver_bound_seconds"),
        num_recomputable=len(analysis.chains),
        refused=tuple(refused),
        scored=details["scored"],
    )

    def exact(chosen, only):
        """``(chains, liveness, costs, plan, names)`` of a candidate on the rewritten graphs."""
        if not chosen:
            allowed = None if only is None else frozenset(only)
            p = plan_offload(live, costs, budget, min_offload_bytes, allowed, earlier_runs, kept_cap)
            return (), live, costs, p, None
        chains = tuple(by_buf[b] for b in sorted(chosen))
        copy = insert_recompute.copy_pair(pair)
        insert_recompute.apply(copy, live, chains, pin=assume_fusion)
        live2 = liveness_pass.analyze(copy, assume_fusion=assume_fusion, margins=margins)
        costs2 = _costs_after(copy, live, costs, live2)
        allowed = None
        if only is not None:
            # The saved views of the buffers allowed, as nodes of the copy.
            wanted = {
                insert_recompute.copied_node(copy, live.saved[i].fw_ref)
                for b in only
                if b not in chosen
                for i in live.buffers[b].saved
            }
            allowed = frozenset(s.buffer for s in live2.saved if s.fw_ref in wanted)
        p = plan_offload(
            live2, costs2, budget, min_offload_bytes, only=allowed, earlier_runs=earlier_runs, kept_cap=kept_cap
        )
        if not p.feasible and allowed is not None and strategy != "recompute":
            p = plan_offload(live2, costs2, budget, min_offload_bytes, earlier_runs=earlier_runs, kept_cap=kept_cap)
        names = (tuple(n.name for n in copy.forward.graph.nodes), tuple(n.name for n in copy.backward.graph.nodes))
        return chains, live2, costs2, replace(p, peak_bytes_unplanned=live.peak_bytes), names

    # Stage 3: the best candidates by their scores, exactly, until one meets the budget.
    tried = []
    result = None
    for name, chosen, only in details["ranked"][:MAX_EXACT_TRIES]:
        got = exact(chosen, only)
        tried.append((name, got))
        if got[3].feasible:
            result = (name, got)
            break
    if result is None and analysis.chains and strategy != "offload" and budget is not None:
        # The best-scored candidates' estimated peaks were within the budget and their rewrites'
        # are not: the lowest-peak choice (what a budget below every plan gets) can still meet it.
        # A fresh-user trial's attention blocks (strategy="recompute"), at the percentage a
        # refusal had named from that choice's peak, were refused again: the three best missed
        # it by 2 MiB.
        low_name, low_chosen, low_only, _d = choose_for(0)
        if low_chosen and all(t[1][0] != tuple(by_buf[b] for b in sorted(low_chosen)) for t in tried):
            got = exact(low_chosen, low_only)
            tried.append((f"{low_name} (the lowest-peak choice)", got))
            if got[3].feasible:
                result = tried[-1]
    note = None
    offload_only = details["offload_only"]
    if result is None and offload_only is not None and offload_only.feasible:
        result = ("offload only", ((), live, costs, offload_only, None))
    if result is None:  # none meets the budget: the lowest exact peak
        result = min(tried, key=lambda t: (_over_cap(t[1][3]), t[1][3].step_peak_bytes, len(t[1][0])))
    if result[0] != details["ranked"][0][0]:
        note = (
            f"the exact plan of the best-scored candidate {details['ranked'][0][0]!r} missed the budget; "
            f"using {result[0]!r}"
        )
    name, (chains, live2, costs2, the_plan, names) = result
    # The lowest peak: exact where the budget is missed (the candidates tried), else the lowest of
    # every candidate's (estimated).
    if the_plan.feasible:
        lowest = min(the_plan.lowest_reachable_peak_bytes, details["lowest"] or the_plan.lowest_reachable_peak_bytes)
    else:
        lowest = min(t[1][3].step_peak_bytes for t in tried)
        for _name, (chains_t, _l, _c, p, _n) in tried:
            if not chains_t:  # offloading every allowed candidate tightly: exact too
                lowest = min(lowest, p.lowest_reachable_peak_bytes)
    the_plan = replace(the_plan, lowest_reachable_peak_bytes=lowest)
    rp = RecomputePlan(
        chosen=name,
        recomputes=_records(live, costs, chains),
        plan_seconds=time.perf_counter() - t0,
        note=note,
        lowest_reachable_peak_bytes=lowest,
        **common,
    )
    return JointPlan(rp, chains, live, live2, costs2, the_plan, names or ((), ()), pin=assume_fusion)


def summary(rp: RecomputePlan) -> dict:
    """The report's view of ``rp`` (JSON-friendly; bytes, FLOPs, seconds)."""
    return {
        "strategy": rp.strategy,
        "chosen": rp.chosen,
        "solver": rp.solver,
        "solver_status": rp.solver_status,
        "fallback_used": rp.fallback_used,
        "num_recomputed": len(rp.recomputes),
        "num_recomputable": rp.num_recomputable,
        "recomputed_bytes": rp.recomputed_bytes,
        "recompute_flops": rp.recompute_flops,
        "recompute_seconds": rp.recompute_seconds,
        "solver_seconds": rp.solver_seconds,
        "solver_bound_seconds": rp.solver_bound_seconds,
        "plan_seconds": rp.plan_seconds,
        "plan_cpu_seconds": rp.plan_cpu_seconds,
        "fits_without_plan": rp.fits_without_plan,
        "note": rp.note,
    }


def decisions(joint: JointPlan) -> tuple[tuple[str, int, str], ...]:
    """Per saved activation (forward node name, bytes of its view, ``"keep"`` / ``"offload"`` /
    ``"recompute"``), in forward order: the tensors the forward saved before the plan (parameters'
    and inputs' saved views are left out: they are neither saved activations nor movable)."""
    recomputed = {name for r in joint.recompute.recomputes for name in r.saved}
    evicted = {ev.buffer for ev in joint.plan.evictions}
    offloaded = {s.fw_node for s in joint.liveness.saved if s.buffer in evicted}
    out = []
    for s in joint.source_liveness.saved:
        kind = joint.source_liveness.buffers[s.buffer].kind if s.buffer >= 0 else None
        if kind is not BufferKind.SAVED:
            continue
        decision = "recompute" if s.fw_node in recomputed else "offload" if s.fw_node in offloaded else "keep"
        out.append((s.fw_node, s.copy_bytes, decision))
    return tuple(out)


def infeasible_note(rp: RecomputePlan, held_bytes: int = 0) -> str:
    """What the joint planner adds to the error for a budget no plan reaches (empty for
    ``strategy="offload"``). ``held_bytes``: what the rest of the training step holds while the
    graph runs (bytes), added to the lowest peak so that it reads as the error's other figures."""
    if rp.strategy == "offload":
        return ""
    from ..options import format_bytes

    parts = [
        f" strategy={rp.strategy!r}: {len(rp.recomputes)} of {rp.num_recomputable} recomputable saved buffers "
        "recomputed in this plan"
    ]
    if rp.lowest_reachable_peak_bytes is not None:
        lowest = rp.lowest_reachable_peak_bytes + held_bytes
        parts.append(f", lowest peak estimated with recomputation {format_bytes(lowest)}")
    if rp.refused:
        name, why = rp.refused[0]
        parts.append(f"; {len(rp.refused)} saved buffers may not be recomputed (e.g. {name}: {why})")
    return "".join(parts) + "."
