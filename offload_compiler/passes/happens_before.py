"""Happens-before check of a stream-annotated graph (part of :mod:`.verify`).

Model (the CUDA semantics the runtime relies on): the host issues the nodes in program order;
each stream runs its nodes in that order; ``record_event(e, A)`` captures everything issued on
stream A so far and ``wait_event(e, B)`` orders B's later work after that capture. Happens-before
is tracked with one vector clock per stream. A node's stream is ``node.meta["trinity_stream"]``
(0 where absent); views (outputs aliasing inputs) launch nothing and read no data.

Rejected, each with the nodes named:

* a wait on an event that no earlier node records (CUDA would not wait at all), or an event
  recorded twice in one graph;
* **read**: a node on stream B reads a buffer last written on stream A != B without an event
  path from the writer (graph inputs count as written on stream 0 at entry);
* **write**: a node writes (mutates) a buffer that another stream reads or wrote before it,
  without an event path from that access;
* **entry**: a side stream's first node is not ordered after stream 0's entry;
* **free**: a buffer is freed (its last use in program order, ``keep`` arguments of waits
  included) and its allocating stream's next node is not ordered after every read of it on
  other streams: that node may reuse the memory while the read is still running. (A stream
  with no later node in the graph reuses it only in a later graph, after that graph's entry
  wait on stream 0, which comes after this graph's exit.)
* **exit**: the output is not ordered after every side stream's last node.

Reads ``node.meta["val"]`` and ``node.meta["trinity_stream"]``; writes nothing.
"""

from __future__ import annotations

import torch.fx as fx

from ..ir.meta import STREAM_KEY
from ..ir.ops import RECORD_EVENT, SET_STREAM, WAIT_EVENT
from .storage_access import GraphAccess

__all__ = ["check_streams", "has_streams"]


def has_streams(gm: fx.GraphModule) -> bool:
    """Whether any node of ``gm`` is on a side stream or is an event op."""
    for n in gm.graph.nodes:
        if n.meta.get(STREAM_KEY, 0) != 0 or (n.op == "call_function" and n.target in (RECORD_EVENT, WAIT_EVENT)):
            return True
    return False


def check_streams(gm: fx.GraphModule, graph_name: str = "graph") -> list[str]:
    """Every happens-before violation of ``gm`` (see the module docstring); ``[]`` if none."""
    access = GraphAccess.of(gm.graph, ignore=())
    errors: list[str] = []
    clock: dict[int, dict[int, int]] = {0: {0: 0}}
    count: dict[int, int] = {}
    node_at: dict[tuple[int, int], fx.Node] = {}
    recorded: dict[int, dict[int, int]] = {}
    writer: dict = {}  # buffer -> (stream, seq, node)
    readers: dict = {}  # buffer -> {stream: (seq, node)} since the last write
    all_readers: dict = {}  # buffer -> {stream: (seq, node)}
    alloc: dict = {}
    pending: dict[int, list] = {}
    last_at: dict[int, list] = {}
    for k, p in access.last_use.items():
        if k not in access.escapes:
            last_at.setdefault(p, []).append(k)

    def clk(s: int) -> dict[int, int]:
        return clock.setdefault(s, {})

    def covered(B: int, A: int, seq: int) -> bool:
        return A == B or clk(B).get(A, -1) >= seq

    def who(A: int, seq: int) -> str:
        node = node_at.get((A, seq))
        return "the graph's entry" if node is None else repr(node.name)

    for pos, n in enumerate(access.nodes):
        s = n.meta.get(STREAM_KEY, 0)
        if n.op == "call_function" and n.target is SET_STREAM:
            continue  # switches the host's current stream; orders nothing
        if n.op == "call_function" and n.target is RECORD_EVENT:
            ev, A = n.args[2], n.args[3]
            if ev in recorded:
                errors.append(f"{graph_name}: event {ev} is recorded twice (again at {n.name!r})")
            recorded[ev] = dict(clk(A))
        elif n.op == "call_function" and n.target is WAIT_EVENT:
            ev, B = n.args[2], n.args[3]
            if ev not in recorded:
                errors.append(f"{graph_name}: {n.name!r} waits for event {ev}, which no earlier node records")
            else:
                for A, q in recorded[ev].items():
                    if q > clk(B).get(A, -1):
                        clk(B)[A] = q
        elif n.op == "placeholder":
            node_at[(0, 0)] = None
            for k in access.writes.get(n, ()):
                writer[k] = (0, 0, n)
                alloc[k] = 0
        elif n not in access.views:
            B = s
            if B != 0 and count.get(B, 0) == 0 and not covered(B, 0, 0):
                errors.append(
                    f"{graph_name}: stream {B} starts at {n.name!r} without waiting for stream 0 "
                    "(the caller's work and the graph's inputs)"
                )
            for C, q, _k, reader in pending.pop(B, []):
                if not covered(B, C, q):
                    errors.append(
                        f"{graph_name}: a buffer allocated on stream {B} is freed after its last use while "
                        f"{reader.name!r} on stream {C} may still read it; {n.name!r} on stream {B} may reuse "
                        "the memory (keep it alive to a wait on that stream)"
                    )
            for k in access.reads.get(n, ()):
                if k in writer:
                    A, q, w = writer[k]
                    if not covered(B, A, q):
                        errors.append(
                            f"{graph_name}: {n.name!r} on stream {B} reads {w.name!r} (written on stream {A}) "
                            "without an event ordering it after the write"
                        )
            for k in access.writes.get(n, ()):
                if k not in writer:
                    continue  # a fresh allocation
                A, q, w = writer[k]
                if not covered(B, A, q):
                    errors.append(
                        f"{graph_name}: {n.name!r} on stream {B} overwrites {w.name!r} from stream {A} unordered"
                    )
                for C, (q, r) in readers.get(k, {}).items():
                    if not covered(B, C, q):
                        errors.append(
                            f"{graph_name}: {n.name!r} on stream {B} writes a buffer that {r.name!r} on stream {C} "
                            "reads, without an event ordering it after that read"
                        )
            if n.op == "output":
                for C, q in count.items():
                    if C != 0 and q and not covered(0, C, q):
                        errors.append(
                            f"{graph_name}: the output is not ordered after stream {C}'s last node {who(C, q)}"
                        )
            count[B] = q = count.get(B, 0) + 1  # seq 0 on stream 0 is the graph's entry
            clk(B)[B] = q
            node_at[(B, q)] = n
            for k in access.reads.get(n, ()):
                readers.setdefault(k, {})[B] = (q, n)
                all_readers.setdefault(k, {})[B] = (q, n)
            for k in access.writes.get(n, ()):
                alloc.setdefault(k, B)
                writer[k] = (B, q, n)
                readers[k] = {}
        # Frees at this position.
        for k in last_at.get(pos, ()):
            A = alloc.get(k, 0)
            for C, (q, r) in all_readers.get(k, {}).items():
                if C != A and not covered(A, C, q):
                    pending.setdefault(A, []).append((C, q, k, r))
    return errors
