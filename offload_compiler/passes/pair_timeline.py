"""The graph adapter of the timeline simulator: a (rewritten) graph pair as copy tasks and steps.

:mod:`.simulate` is the pure simulator (steps, copies and updates with known durations); this
module reads a graph pair's ``trinity::*`` ops by op target, times its nodes with the cost model
and its live bytes with liveness, and runs the simulator on them: one compute stream
(:func:`~.simulate.simulate`) or several (:func:`~.simulate.simulate_program`, with the stream
pass's program order, :func:`.assign_streams.program_steps`).

Reads ``node.meta["val"]``, ``node.meta["trinity_stream"]`` and ``node.meta["trinity_param_copy"]``;
writes nothing.
"""

from __future__ import annotations

from ..ir.alias import tensor_span_bytes
from ..ir.meta import PARAM_COPY_KEY, STREAM_KEY
from ..ir.ops import (
    EVICT,
    EVICT_WAIT,
    GRAD_TO_HOST,
    GRAD_TO_HOST_WAIT,
    PARAM_FETCH,
    PARAM_FETCH_WAIT,
    PARAM_RELEASE,
    PREFETCH,
    PREFETCH_WAIT,
)
from . import cost_model, liveness
from .assign_streams import EVENT_OVERHEAD_S, program_steps
from .happens_before import has_streams
from .simulate import CopyTask, CopyTiming, PairTimeline, Timeline, simulate, simulate_program

__all__ = ["simulate_pair"]


def simulate_pair(pair, spec, assume_fusion: bool = False, pinned: bool = True) -> PairTimeline:
    """Simulate a (rewritten) graph pair on device figures ``spec``.

    Copies are read from the graphs by op target: each ``trinity::evict`` issues a D2H copy of its
    tensor's bytes, waited for at its ``evict_wait``; each ``trinity::prefetch`` an H2D copy,
    waited for at its ``prefetch_wait``. With parameter offload (one compute stream), the
    parameter ops that copy (``node.meta["trinity_param_copy"]``, set by
    ``param_residency.apply``) too: a ``param_fetch`` waited for at the next ``param_fetch_wait``
    of its slot, a ``grad_to_host`` at the next ``grad_to_host_wait`` of its slot, a write-back
    ``param_release`` where it is. Compute times come from the cost model, live bytes from
    liveness, both on the rewritten graphs.
    """
    live = liveness.analyze(pair, assume_fusion=assume_fusion)
    costs = cost_model.estimate(pair, live, spec, pinned=pinned)
    nodes = list(pair.forward.graph.nodes) + list(pair.backward.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    tasks: list[CopyTask] = []
    names: list[str] = []
    for n in nodes:
        if n.op != "call_function" or n.target not in (EVICT, PREFETCH):
            continue
        wait_target = EVICT_WAIT if n.target is EVICT else PREFETCH_WAIT
        waits = [u for u in n.users if u.op == "call_function" and u.target is wait_target and u.args[0] is n]
        val = n.meta["val"]
        nbytes = tensor_span_bytes(val)
        direction = "d2h" if n.target is EVICT else "h2d"
        wait_pos = index[waits[0]] if waits else len(nodes)
        tasks.append(costs.copy_task(len(tasks), direction, nbytes, index[n], wait_pos))
        names.append(f"{'evict' if direction == 'd2h' else 'prefetch'} {n.name} ({nbytes} bytes)")
    step_names = tuple(f"{s.graph}:{s.node}" for s in live.steps)
    if not (has_streams(pair.forward) or has_streams(pair.backward)):
        _param_copy_tasks(nodes, index, costs, tasks, names)
        timeline = simulate(costs.step_seconds, tasks)
        return PairTimeline(
            timeline, step_names, tuple(costs.step_seconds), tuple(int(b) for b in live.live_bytes()), tuple(names)
        )
    # Several compute streams: the joint program, forward then backward, in issue order.
    seconds = {n: costs.step_seconds[index[n]] for n in nodes}
    copy_seconds = {
        n: tasks[i].seconds
        for i, n in enumerate(x for x in nodes if x.op == "call_function" and x.target in (EVICT, PREFETCH))
    }
    sync = costs.synchronous_copies
    steps = program_steps(pair.forward, seconds, copy_seconds, "forward", sync) + program_steps(
        pair.backward, seconds, copy_seconds, "backward", sync
    )
    prog = simulate_program(steps, EVENT_OVERHEAD_S)
    copy_names = {}
    for n in nodes:
        if n.op == "call_function" and n.target in (EVICT, PREFETCH):
            copy_names[(n.graph.owning_module is pair.forward and "forward" or "backward", n.name)] = len(copy_names)
    timings = [None] * len(copy_names)
    stalls = 0.0
    for key, issue, start, end, stall in prog.copies:
        i = copy_names[key]
        timings[i] = CopyTiming(i, tasks[i].direction, issue, start, end, stall)
        stalls += stall
    timeline = Timeline(
        step_seconds=prog.step_seconds,
        compute_seconds=float(sum(costs.step_seconds)),
        exposed_seconds=stalls,
        step_start=prog.start,
        copies=tuple(t for t in timings if t is not None),
    )
    return PairTimeline(
        timeline,
        step_names,
        tuple(costs.step_seconds),
        tuple(int(b) for b in live.live_bytes()),
        tuple(names),
        tuple(n.meta.get(STREAM_KEY, 0) for n in nodes),
    )


def _param_copy_tasks(nodes, index, costs, tasks: list, names: list) -> None:
    """Append the copies of the parameter ops among ``nodes`` (see :func:`simulate_pair`)."""
    wait_of = {PARAM_FETCH: PARAM_FETCH_WAIT, GRAD_TO_HOST: GRAD_TO_HOST_WAIT}
    for i, n in enumerate(nodes):
        copy = n.meta.get(PARAM_COPY_KEY) if n.op == "call_function" else None
        if copy is None or n.target not in (PARAM_FETCH, GRAD_TO_HOST, PARAM_RELEASE):
            continue
        direction, nbytes = copy
        wait_pos = index[n]
        if n.target in wait_of:
            wait_pos = next(
                (
                    index[m]
                    for m in nodes[i + 1 :]
                    if m.graph is n.graph and m.op == "call_function" and m.target is wait_of[n.target]
                    and m.args[1] == n.args[1]
                ),
                len(nodes),
            )  # fmt: skip
        tasks.append(costs.copy_task(len(tasks), direction, nbytes, index[n], wait_pos))
        names.append(f"{n.target._schema.name.split('::')[1]} {n.name} ({nbytes} bytes)")
