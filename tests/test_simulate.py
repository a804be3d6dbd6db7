"""Timeline simulator: hand-computed timelines and properties that hold for any schedule.

Durations are small integers or binary fractions, so every sum below is exact in floating point
and the expected values are compared with ``==``.
"""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_compiler.passes.simulate import CopyTask, CopyTiming, simulate


def d2h(id, seconds, issue, wait):
    return CopyTask(id, "d2h", seconds, issue, wait)


def h2d(id, seconds, issue, wait):
    return CopyTask(id, "h2d", seconds, issue, wait)


# (name, step durations, copies, expected total, expected exposed, expected step starts,
#  expected per-copy (issue, start, end, stall) by id)
CASES = [
    (
        "no copies: steps run back to back",
        [1.0, 2.0, 3.0, 4.0],
        [],
        10.0,
        0.0,
        (0.0, 1.0, 3.0, 6.0),
        {},
    ),
    (
        # 4-step chain; a 2 s D2H issued after step 0 (t=1) runs [1, 3] under steps 1 and 2 and is
        # waited before step 3 (t=3): it hides exactly.
        "one D2H hidden exactly",
        [1.0, 1.0, 1.0, 1.0],
        [d2h(0, 2.0, 1, 3)],
        4.0,
        0.0,
        (0.0, 1.0, 2.0, 3.0),
        {0: (1.0, 1.0, 3.0, 0.0)},
    ),
    (
        # Same, 3 s: it ends at 4, the wait at t=3 stalls 1 s and step 3 starts at 4.
        "one D2H exposed by one second",
        [1.0, 1.0, 1.0, 1.0],
        [d2h(0, 3.0, 1, 3)],
        5.0,
        1.0,
        (0.0, 1.0, 2.0, 4.0),
        {0: (1.0, 1.0, 4.0, 1.0)},
    ),
    (
        # Waited at its own issue position: nothing to hide under, the full 0.5 s is exposed.
        "wait at the issue position",
        [1.0, 1.0, 1.0, 1.0],
        [d2h(0, 0.5, 2, 2)],
        4.5,
        0.5,
        (0.0, 1.0, 2.5, 3.5),
        {0: (2.0, 2.0, 2.5, 0.5)},
    ),
    (
        # Two 1.5 s D2H copies issued together run one after the other: [0, 1.5] and [1.5, 3].
        # Waited before step 2 (t=2), the second stalls 1 s.
        "channel contention: two D2H copies in series",
        [1.0, 1.0, 1.0, 1.0],
        [d2h(0, 1.5, 0, 2), d2h(1, 1.5, 0, 2)],
        5.0,
        1.0,
        (0.0, 1.0, 3.0, 4.0),
        {0: (0.0, 0.0, 1.5, 0.0), 1: (0.0, 1.5, 3.0, 1.0)},
    ),
    (
        # The same two copies in opposite directions use separate channels and run together.
        "no contention across directions",
        [1.0, 1.0, 1.0, 1.0],
        [d2h(0, 1.5, 0, 2), h2d(1, 1.5, 0, 2)],
        4.0,
        0.0,
        (0.0, 1.0, 2.0, 3.0),
        {0: (0.0, 0.0, 1.5, 0.0), 1: (0.0, 0.0, 1.5, 0.0)},
    ),
    (
        # A copy issued while its channel is busy starts when the channel frees: B is issued at
        # t=2 but A occupies the channel until 3; B runs [3, 4] and is waited at the end (t=4).
        "issue while the channel is busy",
        [1.0, 1.0, 1.0, 1.0],
        [d2h(0, 3.0, 0, 4), d2h(1, 1.0, 2, 4)],
        4.0,
        0.0,
        (0.0, 1.0, 2.0, 3.0),
        {0: (0.0, 0.0, 3.0, 0.0), 1: (2.0, 3.0, 4.0, 0.0)},
    ),
    (
        # Waited after the last step (position n): the 5 s copy stalls the end by 3 s.
        "wait after the last step",
        [1.0, 1.0],
        [h2d(0, 5.0, 0, 2)],
        5.0,
        3.0,
        (0.0, 1.0),
        {0: (0.0, 0.0, 5.0, 3.0)},
    ),
    (
        # Two waits at one position: the D2H (ends 2) stalls 1 s, then the H2D (ends 3) 1 s more.
        "two stalls at one position add",
        [1.0, 1.0, 1.0],
        [d2h(0, 2.0, 0, 1), h2d(1, 3.0, 0, 1)],
        5.0,
        2.0,
        (0.0, 3.0, 4.0),
        {0: (0.0, 0.0, 2.0, 1.0), 1: (0.0, 0.0, 3.0, 1.0)},
    ),
    (
        # An H2D prefetch issued before step 1 (t=1) and waited before step 3 (t=3.5) hides under
        # steps 1 and 2 (2.5 s) although it takes 2 s; a D2H of 0.25 s waited right away is exposed.
        "prefetch hides under two steps, tiny D2H exposed",
        [1.0, 2.0, 0.5, 1.0],
        [h2d(0, 2.0, 1, 3), d2h(1, 0.25, 3, 3)],
        4.75,
        0.25,
        (0.0, 1.0, 3.0, 3.75),
        {0: (1.0, 1.0, 3.0, 0.0), 1: (3.5, 3.5, 3.75, 0.25)},
    ),
]


@pytest.mark.parametrize(
    "steps, copies, total, exposed, starts, per_copy",
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_hand_computed_timelines(steps, copies, total, exposed, starts, per_copy):
    tl = simulate(steps, copies)
    assert tl.step_seconds == total
    assert tl.exposed_seconds == exposed
    assert tl.compute_seconds == sum(steps)
    assert tl.step_start == starts
    got = {c.id: (c.issue, c.start, c.end, c.stall) for c in tl.copies}
    assert got == per_copy
    assert [c.direction for c in tl.copies] == [c.direction for c in sorted(copies, key=lambda c: c.id)]


def test_synchronous_copies_run_on_the_compute_stream():
    """A copy with ``on_compute`` (the device is the host CPU) runs where it is issued and is
    exposed in full, however much compute lies before its wait; the channel it would have used
    stays free for an asynchronous copy."""
    sync = CopyTask(0, "d2h", 2.0, 1, 3, on_compute=True)
    tl = simulate([1.0, 1.0, 1.0, 1.0], [sync])
    # The same copy asynchronous hides exactly (the "one D2H hidden exactly" case); synchronous,
    # steps 1-3 start 2 s later.
    assert tl.step_seconds == 6.0 and tl.exposed_seconds == 2.0
    assert tl.step_start == (0.0, 3.0, 4.0, 5.0)
    assert tl.copies[0] == CopyTiming(0, "d2h", 1.0, 1.0, 3.0, 2.0)
    both = simulate([1.0, 1.0, 1.0, 1.0], [sync, d2h(1, 1.0, 1, 3)])
    # The asynchronous copy, issued after the synchronous one at position 1, starts at t=3 on its
    # free channel and ends at 4, before its wait (t=4).
    assert both.step_seconds == 6.0 and both.exposed_seconds == 2.0
    assert both.copies[1] == CopyTiming(1, "d2h", 3.0, 3.0, 4.0, 0.0)
    # Two synchronous copies at one position run one after the other.
    two = simulate(
        [1.0, 1.0], [CopyTask(0, "d2h", 2.0, 1, 2, on_compute=True), CopyTask(1, "h2d", 0.5, 1, 1, on_compute=True)]
    )
    assert two.step_seconds == 4.5 and two.exposed_seconds == 2.5
    assert two.step_start == (0.0, 3.5)


def test_synchronous_copy_in_a_program_matches_the_single_stream_simulator():
    """``simulate_program`` with one stream is ``simulate``, synchronous copies included."""
    from offload_compiler.passes.simulate import ProgramStep, simulate_program

    prog = simulate_program(
        [
            ProgramStep("compute", 0, 1.0),
            ProgramStep("copy", 0, 2.0, "a", "d2h", on_compute=True),
            ProgramStep("compute", 0, 1.0),
            ProgramStep("copy_wait", 0, key="a"),
            ProgramStep("compute", 0, 1.0),
        ]
    )
    single = simulate([1.0, 1.0, 1.0], [CopyTask(0, "d2h", 2.0, 1, 2, on_compute=True)])
    assert prog.step_seconds == single.step_seconds == 5.0
    assert prog.exposed_seconds == single.exposed_seconds == 2.0
    assert prog.copies == (("a", 1.0, 1.0, 3.0, 2.0),)


def test_copies_come_back_sorted_by_id():
    copies = [d2h(3, 1.0, 0, 1), h2d(1, 1.0, 0, 1), d2h(2, 1.0, 0, 1)]
    tl = simulate([1.0, 1.0], copies)
    assert [c.id for c in tl.copies] == [1, 2, 3]


def test_contention_order_follows_issue_order_within_a_position():
    # Both issued at position 0: the first in the list gets the channel first.
    tl = simulate([1.0], [d2h(7, 2.0, 0, 1), d2h(5, 1.0, 0, 1)])
    by_id = {c.id: c for c in tl.copies}
    assert (by_id[7].start, by_id[7].end) == (0.0, 2.0)
    assert (by_id[5].start, by_id[5].end) == (2.0, 3.0)
    assert tl.step_seconds == 3.0


def test_empty_schedule():
    tl = simulate([], [])
    assert (tl.step_seconds, tl.exposed_seconds, tl.compute_seconds, tl.step_start, tl.copies) == (
        0.0,
        0.0,
        0.0,
        (),
        (),
    )


def test_copy_on_an_empty_schedule_is_waited_at_position_zero():
    tl = simulate([], [d2h(0, 2.0, 0, 0)])
    assert (tl.step_seconds, tl.exposed_seconds) == (2.0, 2.0)


@pytest.mark.parametrize(
    "issue, wait",
    [(2, 1), (-1, 1), (0, 4), (5, 5)],
    ids=["wait before issue", "negative issue", "wait past the end", "both past the end"],
)
def test_invalid_positions_raise(issue, wait):
    with pytest.raises(ValueError, match="copy 9: issue position"):
        simulate([1.0, 1.0, 1.0], [d2h(9, 1.0, issue, wait)])


# ------------------------------------------------------------------------------ properties
@st.composite
def schedules(draw, integral: bool):
    n = draw(st.integers(0, 8))
    if integral:
        dur = st.integers(0, 6).map(float)
    else:
        dur = st.floats(0.0, 5.0, allow_nan=False, allow_infinity=False)
    steps = draw(st.lists(dur, min_size=n, max_size=n))
    num = draw(st.integers(0, 6))
    copies = []
    for i in range(num):
        issue = draw(st.integers(0, n))
        wait = draw(st.integers(issue, n))
        direction = draw(st.sampled_from(["d2h", "h2d"]))
        copies.append(CopyTask(i, direction, draw(dur), issue, wait))
    return steps, copies


@settings(max_examples=300, deadline=None)
@given(schedules(integral=True))
def test_property_bounds_and_decomposition_exact(schedule):
    steps, copies = schedule
    tl = simulate(steps, copies)
    compute = sum(steps)
    total_h2d = sum(c.seconds for c in copies if c.direction == "h2d")
    total_d2h = sum(c.seconds for c in copies if c.direction == "d2h")
    # Every copy is waited for at or before the end, and each channel runs one copy at a time.
    assert tl.step_seconds >= max(compute, total_h2d, total_d2h)
    # Integers: all sums are exact.
    assert tl.step_seconds == compute + tl.exposed_seconds
    assert tl.exposed_seconds == sum(c.stall for c in tl.copies)


@settings(max_examples=300, deadline=None)
@given(schedules(integral=False))
def test_property_timeline_is_consistent(schedule):
    steps, copies = schedule
    tl = simulate(steps, copies)
    compute = sum(steps)
    total_h2d = sum(c.seconds for c in copies if c.direction == "h2d")
    total_d2h = sum(c.seconds for c in copies if c.direction == "d2h")
    eps = 1e-9 * (1 + compute + total_h2d + total_d2h)
    assert tl.step_seconds >= max(compute, total_h2d, total_d2h) - eps
    assert tl.step_seconds == pytest.approx(compute + tl.exposed_seconds, rel=1e-12, abs=1e-12)
    assert tl.exposed_seconds >= 0
    # Steps run in order, none shorter than its duration.
    assert len(tl.step_start) == len(steps)
    ends = list(tl.step_start[1:]) + [tl.step_seconds]
    for start, end, d in zip(tl.step_start, ends, steps):
        assert end - start >= d - eps
    by_id = {c.id: c for c in copies}
    for direction in ("d2h", "h2d"):
        timings = [t for t in tl.copies if t.direction == direction]
        for t in timings:
            c = by_id[t.id]
            assert t.start >= t.issue
            assert t.end == pytest.approx(t.start + c.seconds)
            assert t.stall >= 0
            # The wait position's time is at or after the copy's end.
            wait_time = tl.step_start[c.wait_pos] if c.wait_pos < len(steps) else tl.step_seconds
            assert wait_time >= t.end - eps
        # One at a time on a channel.
        spans = sorted((t.start, t.end) for t in timings)
        for (_s0, e0), (s1, _e1) in itertools.pairwise(spans):
            assert s1 >= e0 - eps


# ------------------------------------------------------------------ the optimizer-update channel
from offload_compiler.passes.simulate import UpdateTask  # noqa: E402


def upd(id, seconds, ready, wait=None, after=(), on_compute=False):
    return UpdateTask(id, seconds, ready, tuple(after), wait, on_compute)


# (name, steps, copies, updates, total, exposed copies, exposed update, starts,
#  per-copy (issue, start, end, stall), per-update (ready, start, end, stall in the next step))
# Four steps of 1 s: the forward is steps 0-1, the backward 2-3, step() at position 4. Every
# timeline is the steady state: it starts where the previous step's step() returned.
UPDATE_CASES = [
    (
        # The 1 s update started at step() runs [0, 1] of the next step, under its first forward
        # step; the fetch before step 1 (t=1) finds it done.
        "update at step() hidden under the next forward",
        [1.0, 1.0, 1.0, 1.0],
        [],
        [upd(0, 1.0, 4, wait=1)],
        4.0,
        0.0,
        0.0,
        (0.0, 1.0, 2.0, 3.0),
        {},
        {0: (4.0, 4.0, 5.0, 0.0)},
    ),
    (
        # 3 s: it ends at 3 in the next step; the fetch at t=1 stalls 2 s.
        "update at step() longer than the forward before its fetch",
        [1.0, 1.0, 1.0, 1.0],
        [],
        [upd(0, 3.0, 4, wait=1)],
        6.0,
        0.0,
        2.0,
        (0.0, 3.0, 4.0, 5.0),
        {},
        {0: (6.0, 6.0, 9.0, 2.0)},
    ),
    (
        # Two chunks in series on the update channel: [0, 1] and [1, 3] of the next step. The
        # first is fetched before step 0: stall 1 s; the second before step 2, at t=3: no stall.
        "two chunks queue on the update channel",
        [1.0, 1.0, 1.0, 1.0],
        [],
        [upd(0, 1.0, 4, wait=0), upd(1, 2.0, 4, wait=2)],
        5.0,
        0.0,
        1.0,
        (1.0, 2.0, 3.0, 4.0),
        {},
        {0: (5.0, 5.0, 6.0, 1.0), 1: (5.0, 6.0, 8.0, 0.0)},
    ),
    (
        # overlap="backward": ready when its gradient's copy is issued (position 2), it starts when
        # that 0.5 s copy ends. Steady state: the previous update ends at 1 s into this step, so the
        # fetch before step 0 stalls 1 s; then the copy runs [3, 3.5] and the update [3.5, 6],
        # which is 1 s past this step's end (5): the same carry again.
        "update during the backward, after its gradient's copy",
        [1.0, 1.0, 1.0, 1.0],
        [d2h(0, 0.5, 2, 3)],
        [upd(0, 2.5, 2, wait=0, after=(0,))],
        5.0,
        0.0,
        1.0,
        (1.0, 2.0, 3.0, 4.0),
        {0: (3.0, 3.0, 3.5, 0.0)},
        {0: (3.0, 3.5, 6.0, 1.0)},
    ),
    (
        # The same update started at step() instead: it runs [0, 2.5] of the next step, whose
        # first fetch stalls all 2.5 s (1.5 s more than starting it in the backward).
        "the same update at step()",
        [1.0, 1.0, 1.0, 1.0],
        [d2h(0, 0.5, 2, 3)],
        [upd(0, 2.5, 4, wait=0, after=(0,))],
        6.5,
        0.0,
        2.5,
        (2.5, 3.5, 4.5, 5.5),
        {0: (4.5, 4.5, 5.0, 0.0)},
        {0: (6.5, 6.5, 9.0, 2.5)},
    ),
    (
        # On the compute stream (the device's own update, or the host when it is the device):
        # 0.5 s after the backward, all exposed.
        "update on the compute stream",
        [1.0, 1.0],
        [],
        [upd(0, 0.5, 2, on_compute=True)],
        2.5,
        0.0,
        0.5,
        (0.0, 1.0),
        {},
        {0: (2.0, 2.0, 2.5, 0.0)},
    ),
    (
        # A host chunk (1 s, fetched before step 0) and the device's share (0.5 s) at step():
        # the host chunk is handed to the worker first and runs [2.5, 3.5] while the device
        # update runs [2.5, 3]; the next step's fetch waits 0.5 s for the host chunk.
        "host chunk and device share at step()",
        [1.0, 1.0],
        [],
        [upd(0, 0.5, 2, on_compute=True), upd(1, 1.0, 2, wait=0)],
        3.0,
        0.0,
        1.0,
        (0.5, 1.5),
        {},
        {0: (2.5, 2.5, 3.0, 0.0), 1: (2.5, 2.5, 3.5, 0.5)},
    ),
    (
        # A fetch (H2D, 0.5 s) issued and waited for where the host waits for the update: the
        # copy is issued only after that wait (t=2), so it runs [2, 2.5] and stalls 0.5 s more
        # (issued first it would have run [1, 1.5], under the update's stall).
        "a fetch is issued after its parameter's update",
        [1.0, 1.0, 1.0, 1.0],
        [h2d(0, 0.5, 1, 1)],
        [upd(0, 2.0, 4, wait=1)],
        5.5,
        0.5,
        1.0,
        (0.0, 2.5, 3.5, 4.5),
        {0: (2.0, 2.0, 2.5, 0.5)},
        {0: (5.5, 5.5, 7.5, 1.0)},
    ),
]


@pytest.mark.parametrize(
    "steps, copies, updates, total, exposed, exposed_update, starts, per_copy, per_update",
    [c[1:] for c in UPDATE_CASES],
    ids=[c[0] for c in UPDATE_CASES],
)
def test_hand_computed_update_timelines(
    steps, copies, updates, total, exposed, exposed_update, starts, per_copy, per_update
):
    tl = simulate(steps, copies, updates)
    assert tl.step_seconds == total
    assert tl.exposed_seconds == exposed
    assert tl.exposed_update_seconds == exposed_update
    assert tl.update_seconds == sum(u.seconds for u in updates)
    assert tl.step_start == starts
    assert {c.id: (c.issue, c.start, c.end, c.stall) for c in tl.copies} == per_copy
    assert {u.id: (u.ready, u.start, u.end, u.stall) for u in tl.updates} == per_update
    # The step is its compute plus what it waits for.
    assert tl.step_seconds == sum(steps) + tl.exposed_seconds + tl.exposed_update_seconds


def test_updates_that_finish_in_time_change_nothing():
    copies = [d2h(0, 2.0, 1, 3), h2d(1, 1.0, 0, 2)]
    plain = simulate([1.0, 2.0, 0.5, 1.0], copies)
    with_updates = simulate([1.0, 2.0, 0.5, 1.0], copies, [upd(0, 0.25, 4, wait=3)])
    assert (with_updates.step_seconds, with_updates.exposed_seconds) == (plain.step_seconds, plain.exposed_seconds)
    assert with_updates.copies == plain.copies and with_updates.exposed_update_seconds == 0.0


@pytest.mark.parametrize(
    "update, match",
    [
        (upd(3, 1.0, 5), "update 3: ready position 5"),
        (upd(3, 1.0, 0, wait=-1), "update 3: ready position 0 and wait position -1"),
        (upd(3, 1.0, 0, after=(7,)), r"update 3: waits for copies \[7\]"),
    ],
)
def test_invalid_updates_raise(update, match):
    with pytest.raises(ValueError, match=match):
        simulate([1.0, 1.0], [d2h(0, 1.0, 0, 1)], [update])


def test_the_steady_state_stops_when_the_carry_alternates_in_the_last_bit():
    # llama-70b's update carry alternated by 7e-15 s on a 57.8 s step forever; with exact equality
    # every simulation ran to its repetition limit (len(updates) + 2 steps: 287, 200 s of planning).
    from offload_compiler.passes import simulate as sim

    calls = []

    def next_carry(carry):
        calls.append(dict(carry))
        wobble = 7.105427357601002e-15 * (len(calls) % 2)
        return {0: 3.0 + wobble, 1: 1.25 - wobble}, 57.83593302381792

    carry = sim._settle(next_carry, limit=287)
    assert len(calls) == 2  # {} -> the first carry -> its 1-ulp twin, accepted as the same state
    assert carry == {0: 3.0 + 7.105427357601002e-15, 1: 1.25 - 7.105427357601002e-15}

    # A carry that really moves (by more than 1e-12 of the step) is followed to the limit.
    calls.clear()
    assert sim._settle(lambda c: (calls.append(1) or {0: float(len(calls))}, 57.8), limit=9) == {0: 9.0}
    assert len(calls) == 9
