"""Multi-stream compute: put independent nodes on side streams, ordered by explicit events.

Runs on one (already transfer-rewritten) forward or backward graph. :func:`plan` is a pure
function of the graph and the per-node times: it walks the nodes in program order and list-schedules
each *eligible* node (below) onto one of ``num_streams`` streams, choosing the stream that gives the
earliest simulated makespan so far; a side stream is taken only where that beats the main stream
(0) by more than :data:`EVENT_OVERHEAD_S`. If the whole graph's simulated time with side streams is
not shorter than on one stream by more than that overhead, the plan keeps every node on stream 0.
:func:`apply` materialises a plan.

Eligible for a side stream: a ``call_function`` of an ATen ``OpOverload`` that mutates nothing,
returns one fresh tensor (not a view) that no ``trinity::evict`` copies, and is not a trinity op. Everything else (views, tuple
results, mutations, the copies and their waits, placeholders, the output) stays on stream 0; the
copies themselves keep running on the runtime's copy streams, issued from stream 0.

Streams and events (the rules the verifier's happens-before check also enforces):

* **read**: a node on stream B that reads a buffer last written on stream A != B waits for an
  event recorded on A right after the writer (placeholders count as written on stream 0 at
  graph entry). No wait is inserted where the ordering is already implied (vector clocks over
  all earlier events): the events are a transitive reduction of the cross-stream edges.
* **entry**: a side stream's first node is ordered after stream 0's entry (so it runs after the
  caller's earlier work, and may reuse memory the caller freed).
* **free (keep-alive)**: a buffer is allocated on the stream that produced it (the caching
  allocator's stream) and is freed at its last use in program order; every read on another
  stream must happen before the allocating stream's next node after that point. Where it is not
  already implied when that next node comes, a ``wait_event`` on the allocating stream is
  inserted right after the last use (the stream ran nothing in between); if the last use was on
  another stream, the wait takes the buffer as ``keep``: FX keeps the tensor alive up to that
  wait, so the free is ordered after the other stream's read (no ``record_stream``). Because the
  wait directly follows the last use and allocates nothing, the program-order peak stays the
  same. A side stream with no later node needs no wait (its next work, in a later graph, starts
  after that graph's entry wait on stream 0, which follows this graph's exit).
* **exit**: before the output, stream 0 waits for every side stream's last node.

Event cost (:data:`EVENT_OVERHEAD_S`): a cross-stream dependency costs one
``cudaEventRecord`` and one ``cudaStreamWaitEvent`` (each a driver call comparable to a kernel
launch, a few microseconds of host time) plus the device-side latency of resolving the
dependency between streams (a few microseconds more). We take 10 us as a conservative total;
it is a single constant so that calibration on a GPU can replace it.

Reads ``node.meta["val"]`` (aliasing and sizes). :func:`apply` writes ``node.meta["trinity_stream"]``
(:data:`STREAM_KEY`, an int stream index: 0 is the stream current when the graph starts) on every
node, and ``node.meta["val"] = None`` / ``node.meta["trinity"]`` on the nodes it inserts
(``trinity::set_stream``, ``trinity::record_event``, ``trinity::wait_event``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..ir.alias import tensor_span_bytes
from ..ir.meta import NOTE_KEY, STREAM_KEY
from ..ir.ops import (
    EVICT,
    EVICT_WAIT,
    PREFETCH,
    PREFETCH_WAIT,
    RECORD_EVENT,
    SET_STREAM,
    STREAM_OPS,
    TRANSFER_OPS,
    WAIT_EVENT,
)
from ..ir.refs import node_ref
from .storage_access import GraphAccess

__all__ = [
    "EVENT_OVERHEAD_S",
    "STREAM_KEY",
    "GraphAccess",
    "StreamPlan",
    "EventRecord",
    "EventWait",
    "plan",
    "apply",
    "remove",
    "graph_seconds",
    "program_steps",
]

EVENT_OVERHEAD_S = 10e-6


def _evicted(access: GraphAccess) -> set:
    """Storages some ``trinity::evict`` copies (the plan frees them at their ``evict_wait``)."""
    return {k for n in access.nodes if n.op == "call_function" and n.target is EVICT for k in access.reads[n]}


def _eligible(node: fx.Node, access: GraphAccess, evicted: frozenset = frozenset()) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target in TRANSFER_OPS or target in STREAM_OPS or node in access.views:
        return False
    if target._schema.is_mutable or not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    writes = access.writes.get(node)
    # A buffer the plan evicts stays on stream 0, where its copy and its free are issued.
    return bool(writes) and not (writes & evicted)


def graph_seconds(gm: fx.GraphModule, spec, pinned: bool = True) -> tuple[dict, dict]:
    """Per-node compute seconds (the cost model's roofline, :func:`cost_model.node_cost`) and
    per-copy seconds (``evict``/``prefetch`` nodes: ``DeviceSpec.copy_seconds``, the cost
    model's copy formula) of ``gm``. Where
    the device is the host CPU (``spec.host_is_device``: synchronous copies, see
    :attr:`.cost_model.Costs.synchronous_copies`) a copy's seconds are its node's own, on its
    stream, and its channel time is 0."""
    from .cost_model import node_cost

    allow_tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    seconds, copies = {}, {}
    for n in gm.graph.nodes:
        seconds[n] = node_cost(n, spec, allow_tf32)[2]
        if n.op == "call_function" and n.target in (EVICT, PREFETCH):
            val = n.meta["val"]
            nbytes = tensor_span_bytes(val)
            direction = "d2h" if n.target is EVICT else "h2d"
            copies[n] = spec.copy_seconds(nbytes, direction, pinned)
            if spec.host_is_device:
                seconds[n], copies[n] = seconds[n] + copies[n], 0.0
    return seconds, copies


# ------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class EventRecord:
    """Event ``event`` recorded on ``stream`` right after node ``after`` (a node name; ``after_ref``
    is the node itself, which :func:`apply` uses)."""

    event: int
    after: str
    stream: int
    after_ref: fx.Node | None = node_ref()


@dataclass(frozen=True)
class EventWait:
    """``stream`` waits for event ``event``, placed ``where`` (``"before"``/``"after"``) node
    ``anchor``; ``keep`` names the nodes whose tensors it keeps alive. ``anchor_ref`` and
    ``keep_refs`` are those nodes themselves, which :func:`apply` uses."""

    event: int
    stream: int
    anchor: str
    where: str
    keep: tuple[str, ...] = ()
    anchor_ref: fx.Node | None = node_ref()
    keep_refs: tuple[fx.Node, ...] = node_ref(())


@dataclass(frozen=True)
class StreamPlan:
    """Streams and events for one graph (times in seconds).

    Attributes:
        num_streams: streams the plan was allowed to use.
        streams: ``(node name, stream)`` for every node of the graph (views: the stream of
            the buffer they view).
        nodes: the nodes of ``streams``, in the same order (references into the graph planned).
        records, waits: the events to insert.
        single_stream_seconds: simulated time with every node on stream 0.
        seconds: simulated time of this plan (equal to the above when it uses one stream).
    """

    num_streams: int
    streams: tuple[tuple[str, int], ...]
    records: tuple[EventRecord, ...]
    waits: tuple[EventWait, ...]
    single_stream_seconds: float
    seconds: float
    nodes: tuple[fx.Node, ...] = node_ref(())

    @property
    def num_events(self) -> int:
        return len(self.records)

    @property
    def used_streams(self) -> int:
        return len({s for _, s in self.streams})

    def stream_of(self) -> dict[str, int]:
        return dict(self.streams)


class _Walk:
    """The list scheduler's state while it walks the program (see the module docstring)."""

    def __init__(self, access: GraphAccess, seconds: dict, copies: dict, num_streams: int, event_s: float):
        self.a = access
        self.seconds = seconds
        self.copies = copies
        self.S = num_streams
        self.event_s = event_s
        self.free = [0.0] * num_streams
        self.clock: list[dict[int, int]] = [dict() for _ in range(num_streams)]
        self.clock[0][0] = 0
        self.count = [0] * num_streams  # nodes on each stream so far (entry is seq 0 on stream 0)
        self.by_seq: list[dict[int, fx.Node | None]] = [dict() for _ in range(num_streams)]
        self.stream: dict[fx.Node, int] = {}
        self.seq: dict[fx.Node, int] = {}
        self.end: dict[fx.Node, float] = {}
        self.after_clock: dict[fx.Node, dict[int, int]] = {}
        self.writer: dict = {}
        self.readers: dict = {}
        self.alloc_stream: dict = {}
        self.record_of: dict[fx.Node, int] = {}
        self.records: list[EventRecord] = []
        self.waits: list[EventWait] = []
        self.channel = {"d2h": 0.0, "h2d": 0.0}
        self.copy_end: dict[fx.Node, float] = {}
        self.entry: fx.Node | None = None
        self.pending: list[list] = [[] for _ in range(num_streams)]  # (stream, seq, buffer, last use)
        self.by_pos_last: dict[int, list] = {}
        for k, p in access.last_use.items():
            if k not in access.escapes:
                self.by_pos_last.setdefault(p, []).append(k)

    # -- helpers
    def _at(self, stream: int, seq: int) -> fx.Node:
        return self.entry if (stream == 0 and seq == 0) else self.by_seq[stream][seq]

    def _needs(self, n: fx.Node, B: int, final: bool = False) -> dict[int, int]:
        need: dict[int, int] = {}

        def add(A, s):
            if A != B and s > need.get(A, -1):
                need[A] = s

        for k in self.a.reads.get(n, ()):
            w = self.writer.get(k)
            if w is not None:
                add(self.stream[w], self.seq[w])
        for k in self.a.writes.get(n, ()):
            if self.a.allocator.get(k) is n:
                continue  # a fresh allocation: nobody has touched it yet
            w = self.writer.get(k)
            if w is not None:
                add(self.stream[w], self.seq[w])
            for A, s in self.readers.get(k, {}).items():
                add(A, s)
        if B != 0 and self.count[B] == 0:
            add(0, 0)
        if final:
            for A in range(1, self.S):
                if self.count[A]:
                    add(A, self.count[A])
        return {A: s for A, s in need.items() if self.clock[B].get(A, -1) < s}

    def _event_after(self, p: fx.Node) -> int:
        ev = self.record_of.get(p)
        if ev is None:
            ev = self.record_of[p] = len(self.records)
            self.records.append(EventRecord(ev, p.name, self.stream[p], p))
        return ev

    def _merge(self, B: int, p: fx.Node) -> None:
        for A, s in self.after_clock[p].items():
            if s > self.clock[B].get(A, -1):
                self.clock[B][A] = s
        self.free[B] = max(self.free[B], self.end[p] + self.event_s)

    def _cross_missing(self, k, A: int, clock: dict, extra: tuple | None = None) -> dict[int, int]:
        missing = {}
        items = list(self.readers.get(k, {}).items())
        if extra is not None:
            items.append(extra)
        for C, s in items:
            if C != A and clock.get(C, -1) < s and s > missing.get(C, -1):
                missing[C] = s
        return missing

    # -- scoring a choice without committing it
    def score(self, n: fx.Node, B: int) -> float:
        free = list(self.free)
        need = self._needs(n, B)
        start = free[B]
        for A, s in need.items():
            start = max(start, self.end[self._at(A, s)] + self.event_s)
        end = start + self.seconds.get(n, 0.0)
        free[B] = end
        for k in self.by_pos_last.get(self._pos(n), ()):
            A = self.alloc_stream.get(k, 0)
            if A != B and k in self.a.reads.get(n, ()):
                free[A] = max(free[A], end + self.event_s)  # the keep-alive join
        return max(free)

    def _pos(self, n: fx.Node) -> int:
        return self._posmap[n]

    # -- committing
    def place(self, n: fx.Node, B: int) -> None:
        a = self.a
        if n.op == "placeholder":
            self.stream[n], self.seq[n], self.end[n] = 0, 0, 0.0
            self.after_clock[n] = {0: 0}
            self.entry = n
            for k in a.writes.get(n, ()):
                self.writer[k] = n
                self.alloc_stream[k] = 0
            return
        if n in a.views:
            # Metadata only: it runs on the host; give it the stream of what it views.
            src = next((m for m in n.all_input_nodes if m in self.stream), None)
            self.stream[n] = self.stream.get(src, 0) if src is not None else 0
            self._free_after(n)
            return
        final = n.op == "output"
        # Keep-alive: buffers allocated on B and freed (at P) while another stream may still read
        # them. B's next node is here, so B waits now; the wait goes right after P (B has run
        # nothing since), taking the buffers, so FX frees them after it and the peak stays put.
        groups: dict[tuple[fx.Node, int], tuple[int, list]] = {}
        for C, q, k, P in self.pending[B]:
            old_q, keys = groups.get((P, C), (-1, []))
            groups[(P, C)] = (max(old_q, q), keys + [k])
        self.pending[B] = []
        for (P, C), (q, keys) in sorted(groups.items(), key=lambda kv: (self._pos(kv[0][0]), kv[0][1])):
            if self.clock[B].get(C, -1) >= q:
                continue
            p = self._at(C, q)
            ev = self._event_after(p)
            # The buffers stay alive to the wait only where their last reader ran elsewhere; if
            # B itself read them last, the free is already in B's order (and an evicted buffer
            # must not outlive its evict_wait).
            cross = P not in self.a.views and self.stream.get(P, 0) != B
            held = tuple(dict.fromkeys(self.a.holder[k] for k in keys if k in self.a.holder)) if cross else ()
            self.waits.append(EventWait(ev, B, P.name, "after", tuple(h.name for h in held), P, held))
            self._merge(B, p)
        for A, q in sorted(self._needs(n, B, final=final).items()):
            p = self._at(A, q)
            ev = self._event_after(p)
            self.waits.append(EventWait(ev, B, n.name, "before", anchor_ref=n))
            self._merge(B, p)
        start = self.free[B]
        if n.op == "call_function" and n.target in (EVICT, PREFETCH):
            direction = "d2h" if n.target is EVICT else "h2d"
            cstart = max(start, self.channel[direction])
            self.copy_end[n] = self.channel[direction] = cstart + self.copies.get(n, 0.0)
        elif n.op == "call_function" and n.target in (EVICT_WAIT, PREFETCH_WAIT):
            src = n.args[0]
            start = max(start, self.copy_end.get(src, 0.0))
        end = start + self.seconds.get(n, 0.0)
        self.free[B] = end
        self.count[B] += 1
        s = self.count[B]
        self.clock[B][B] = s
        self.by_seq[B][s] = n
        self.stream[n], self.seq[n], self.end[n] = B, s, end
        self.after_clock[n] = dict(self.clock[B])
        for k in a.reads.get(n, ()):
            r = self.readers.setdefault(k, {})
            r[B] = s
        for k in a.writes.get(n, ()):
            if a.allocator.get(k) is n:
                self.alloc_stream[k] = B
            self.writer[k] = n
            self.readers[k] = {}
        if not final:
            self._free_after(n)

    def _free_after(self, n: fx.Node) -> None:
        """Record the obligations of the buffers whose last use is ``n``: their allocating
        stream's next node must come after every read of them on other streams."""
        for k in self.by_pos_last.get(self._pos(n), ()):
            A = self.alloc_stream.get(k, 0)
            for C, s in self._cross_missing(k, A, self.clock[A]).items():
                self.pending[A].append((C, s, k, n))

    def run(self, choose: Callable[[fx.Node], list[int]]) -> float:
        self._posmap = {n: i for i, n in enumerate(self.a.nodes)}
        for n in self.a.nodes:
            options = choose(n)
            if len(options) == 1:
                B = options[0]
            else:
                scores = {B: self.score(n, B) for B in options}
                B = 0
                for cand in options[1:]:
                    if scores[cand] + self.event_s < scores[B]:
                        B = cand
            self.place(n, B)
        return max(self.free)


def plan(
    gm: fx.GraphModule,
    num_streams: int,
    seconds: dict,
    copies: dict | None = None,
    event_seconds: float = EVENT_OVERHEAD_S,
) -> StreamPlan:
    """List-schedule ``gm``'s nodes onto ``num_streams`` streams (see the module docstring).

    Args:
        gm: a forward or backward graph (transfer ops included; no stream ops yet).
        num_streams: streams to use (>= 1; 1 puts everything on stream 0).
        seconds: compute seconds per node (:func:`graph_seconds`); missing nodes cost 0.
        copies: copy seconds per ``evict``/``prefetch`` node.
        event_seconds: the cost of one cross-stream event (:data:`EVENT_OVERHEAD_S`).

    Raises:
        ValueError: if ``num_streams < 1`` or the graph already has stream ops.
    """
    if not isinstance(num_streams, int) or num_streams < 1:
        raise ValueError(f"assign_streams: num_streams must be an int >= 1, got {num_streams!r}")
    if any(n.op == "call_function" and n.target in STREAM_OPS for n in gm.graph.nodes):
        raise ValueError("assign_streams: the graph already has stream ops; remove() them first")
    access = GraphAccess.of(gm.graph)
    copies = copies or {}
    single = _Walk(access, seconds, copies, 1, event_seconds)
    single_time = single.run(lambda n: [0])
    best = single
    best_time = single_time
    if num_streams > 1:
        multi = _Walk(access, seconds, copies, num_streams, event_seconds)
        evicted = frozenset(_evicted(access))
        eligible = {n for n in access.nodes if _eligible(n, access, evicted)}
        multi_time = multi.run(lambda n: list(range(num_streams)) if n in eligible else [0])
        if multi.records and multi_time + event_seconds < single_time:
            best, best_time = multi, multi_time
    streams = tuple((n.name, best.stream.get(n, 0)) for n in access.nodes)
    return StreamPlan(
        num_streams=num_streams,
        streams=streams,
        records=tuple(best.records) if best is not single else (),
        waits=tuple(best.waits) if best is not single else (),
        single_stream_seconds=single_time,
        seconds=best_time,
        nodes=tuple(access.nodes),
    )


# ------------------------------------------------------------------------------ rewriting
def _insert(graph: fx.Graph, where: str, anchor: fx.Node, target, args, note: str, stream: int) -> fx.Node:
    ctx = graph.inserting_after(anchor) if where == "after" else graph.inserting_before(anchor)
    with ctx:
        node = graph.call_function(target, args)
    node.meta["val"] = None
    node.meta[NOTE_KEY] = note
    node.meta[STREAM_KEY] = stream
    return node


def apply(gm: fx.GraphModule, the_plan: StreamPlan, runtime_id: int, event_offset: int = 0) -> dict[str, int]:
    """Annotate every node of ``gm`` with its stream and insert the plan's ``record_event`` /
    ``wait_event`` nodes and the ``set_stream`` switches; recompiles ``gm``. Event ids in the
    graph are the plan's plus ``event_offset`` (graphs sharing one runtime use disjoint ids).

    Returns:
        Counts of inserted nodes (``{"record_event": n, "wait_event": n, "set_stream": n}``).

    Raises:
        ValueError: if the plan's nodes are not nodes of ``gm`` (a plan of :func:`plan` on ``gm``
            carries them: :attr:`StreamPlan.nodes`, ``after_ref``, ``anchor_ref``, ``keep_refs``).
    """
    graph = gm.graph
    present = set(graph.nodes)
    refs = [*the_plan.nodes, *(r.after_ref for r in the_plan.records)]
    refs += [n for w in the_plan.waits for n in (w.anchor_ref, *w.keep_refs)]
    missing = [n.name if n is not None else None for n in refs if n not in present]
    if missing or len(the_plan.nodes) != len(the_plan.streams):
        raise ValueError(
            "assign_streams.apply: the plan's nodes are not nodes of this graph (plan() on this graph makes "
            f"them): {missing[:5] or f'{len(the_plan.nodes)} nodes for {len(the_plan.streams)} streams'}"
        )
    for n, (_, s) in zip(the_plan.nodes, the_plan.streams):
        n.meta[STREAM_KEY] = s
    counts = {"record_event": 0, "wait_event": 0, "set_stream": 0}
    if not the_plan.records:
        gm.recompile()
        return counts
    # Insert in program order at each gap: records after x, keep-alive waits after x, then the
    # waits before y. Chained cursors keep that order.
    cursor_after: dict[fx.Node, fx.Node] = {}
    for rec in the_plan.records:
        p = rec.after_ref
        anchor = cursor_after.get(p, p)
        if p.op == "placeholder":
            # The entry: after the last placeholder.
            last_ph = [n for n in graph.nodes if n.op == "placeholder"][-1]
            anchor = cursor_after.get(last_ph, last_ph)
            p = last_ph
        after = [p] if (p.op != "placeholder" and isinstance(p.meta.get("val"), torch.Tensor)) else []
        node = _insert(
            graph, "after", anchor, RECORD_EVENT, (after, runtime_id, rec.event + event_offset, rec.stream),
            f"event {rec.event + event_offset} recorded on stream {rec.stream}", rec.stream,
        )  # fmt: skip
        cursor_after[p] = node
        counts["record_event"] += 1
    for w in the_plan.waits:
        n = w.anchor_ref
        keep = list(w.keep_refs)
        args = (keep, runtime_id, w.event + event_offset, w.stream)
        note = f"stream {w.stream} waits for event {w.event + event_offset}" + (
            f"; keeps {', '.join(w.keep)} alive until here" if w.keep else ""
        )
        if w.where == "after":
            anchor = cursor_after.get(n, n)
            node = _insert(graph, "after", anchor, WAIT_EVENT, args, note, w.stream)
            cursor_after[n] = node
        else:
            node = _insert(graph, "before", n, WAIT_EVENT, args, note, w.stream)
        counts["wait_event"] += 1
    # Stream switches: before each kernel-launching node whose stream differs from the current.
    access = GraphAccess.of(graph)
    current = 0
    for n in list(graph.nodes):
        if n.op == "placeholder" or n in access.views:
            continue
        if n.op == "call_function" and n.target in (RECORD_EVENT, WAIT_EVENT):
            continue
        s = n.meta.get(STREAM_KEY, 0)
        if s != current:
            _insert(graph, "before", n, SET_STREAM, (runtime_id, s), f"switch to stream {s}", s)
            counts["set_stream"] += 1
            current = s
    graph.lint()
    gm.recompile()
    return counts


def remove(gm: fx.GraphModule) -> int:
    """Undo :func:`apply`: erase the stream ops and the stream annotations; returns how many
    nodes were erased."""
    erased = 0
    for n in list(gm.graph.nodes):
        n.meta.pop(STREAM_KEY, None)
        if n.op == "call_function" and n.target in STREAM_OPS:
            gm.graph.erase_node(n)
            erased += 1
    gm.recompile()
    return erased


def program_steps(
    gm: fx.GraphModule, seconds: dict, copies: dict, key_prefix: object = None, synchronous: bool = False
) -> list:
    """``gm``'s nodes as :class:`~offload_compiler.passes.simulate.ProgramStep` s for
    :func:`~offload_compiler.passes.simulate.simulate_program`, with streams from
    ``meta["trinity_stream"]`` (0 where absent). Event and copy keys are ``(key_prefix, id)``.
    ``synchronous``: copies run on their node's stream (the device is the host CPU)."""
    from .simulate import ProgramStep

    steps = []
    for n in gm.graph.nodes:
        s = n.meta.get(STREAM_KEY, 0)
        if n.op == "call_function" and n.target is RECORD_EVENT:
            steps.append(ProgramStep("record", n.args[3], key=(key_prefix, n.args[2])))
        elif n.op == "call_function" and n.target is WAIT_EVENT:
            steps.append(ProgramStep("wait", n.args[3], key=(key_prefix, n.args[2])))
        elif n.op == "call_function" and n.target in (EVICT, PREFETCH):
            direction = "d2h" if n.target is EVICT else "h2d"
            steps.append(
                ProgramStep("copy", s, copies.get(n, 0.0), (key_prefix, n.name), direction, on_compute=synchronous)
            )
        elif n.op == "call_function" and n.target in (EVICT_WAIT, PREFETCH_WAIT):
            steps.append(ProgramStep("copy_wait", s, key=(key_prefix, n.args[0].name)))
        else:
            steps.append(ProgramStep("compute", s, seconds.get(n, 0.0)))
    return steps
