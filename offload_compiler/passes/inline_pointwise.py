"""Inline reused pointwise values: compute a pointwise result in each of its readers' kernels
when that never raises the memory in use and never moves more bytes.

Trinity compiles with Inductor's ``realize_reads_threshold=0`` (``backend.py``): a pointwise
result read by more than one node is allocated (*realized*) once, so that a residual stream's
branches do not keep every input of their chain alive to the last reader. Liveness models exactly
that (a pointwise node is fused into its reader only when it has one reader,
:func:`.liveness._fusible`). The rule costs memory where the reused value is larger than what it
is computed from. The common case is the loss of a language model: ``cross_entropy`` on bf16
logits of tokens x vocabulary elements computes ``x = logits.float()``, ``x - amax`` and
``x - amax - log(sum(exp(...)))`` in float32, each read twice (by a reduction and by the next
op), and its backward ``where(target == iota, -1, 0) * scale`` (read by a sum and a subtraction).
Realized, each is a float32 tokens x vocabulary buffer: 2.1 GB for Llama 3.2 1B at 4096 tokens,
two of them live at once, where plain Inductor (threshold 4) allocates none and re-reads the bf16
logits in each kernel.

This pass makes that choice per node, in the graph: a pointwise node read by 2 to
:data:`MAX_READERS` pointwise ops, reductions or ``gather`` (each of which Inductor computes it
inside), with its chain of single-reader pointwise inputs (those Inductor already computes inside
it), is copied once per reader, so that each copy has one reader and is fused into it. The chain
reads its *leaves* (every input not itself in the chain; each storage counted once, with its full
size). With ``k`` readers, the copy is made only when

* memory: the leaves that would stay allocated longer (those whose last reader comes before the
  kernel of the value's last reader; a graph output's storage outlives the graph) hold at most the
  value's bytes. They are extended within the interval where the value would have been allocated,
  so the bytes in use never rise at any node (under liveness's model, which then counts the
  copies as fused);
* traffic: ``k`` kernels reading the leaves move at most what the realized value costs, its
  write and ``k`` reads: ``k * leaves <= (k + 1) * value``.

On a CPU target a chain containing ``exp``, ``log``, ``log10``, ``log1p``, ``log2``, ``sigmoid``
or ``tanh`` is not copied: Inductor's own heuristic (``StorageBox.should_realize_on_reuse`` in
``torch/_inductor/ir.py``) realizes reused results of those ops on the CPU, where recomputing them
is costly. A chain with a random op, a mutation or more than :data:`MAX_LEAVES` leaves is not
copied either (many reads in one kernel make Inductor realize it, ``has_exceeded_max_reads``).

The copies compute the same values with the same ops, so results are bit-identical. Only for
Inductor as the inner compiler (``inner="eager"`` runs every node as written). Reads
``node.meta["val"]``; writes ``meta["val"]`` (fresh fake tensors of the same size, stride, dtype
and device: each copy is its own storage) and the dump note (:data:`~offload_compiler.ir.meta.NOTE_KEY`)
of each copy. Mutates the graph: inserts copies of existing aten nodes (matched as any node is, by
target).
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from ..graph_pair import fake_mode_of
from ..ir.alias import node_span_bytes, node_storages
from ..ir.meta import NOTE_KEY
from .liveness import becomes_addmm, inlining_reader

__all__ = ["inline_reused_pointwise", "MAX_READERS", "MAX_LEAVES"]

MAX_READERS = 4
"""Most readers a value is copied for: Inductor's default ``realize_reads_threshold`` (4)."""

MAX_LEAVES = 8
"""Most distinct storages one copied chain may read: Inductor realizes a pointwise result that
reads more than 8 buffers on a GPU (``_realize_acc_reads_threshold_default``; 12 on a CPU)."""

_aten = torch.ops.aten
_CPU_HEAVY = frozenset(
    {
        _aten.exp.default,
        _aten.log.default,
        _aten.log10.default,
        _aten.log1p.default,
        _aten.log2.default,
        _aten.sigmoid.default,
        _aten.tanh.default,
    }
)


def _pointwise(node: fx.Node) -> bool:
    t = node.target
    return (
        node.op == "call_function"
        and isinstance(t, torch._ops.OpOverload)
        and torch.Tag.pointwise in t.tags
        and torch.Tag.nondeterministic_seeded not in t.tags
        and not t._schema.is_mutable
        and isinstance(node.meta.get("val"), torch.Tensor)
    )


class _Env(dict):
    """Original node -> its copy; ``get_or_same`` maps an argument of a copied node."""

    def get_or_same(self, node: fx.Node) -> fx.Node:
        return self.get(node, node)


def _kernel_end(node: fx.Node, device_type: str | None) -> fx.Node:
    """The node whose kernel computes ``node``: ``node``, or the end of the chain of single-reader
    pointwise nodes it is fused into."""
    while _pointwise(node) and len(node.users) == 1 and not becomes_addmm(node, device_type):
        (user,) = node.users
        if not inlining_reader(user, device_type):
            break
        node = user
    return node


def _chain(node: fx.Node, device_type: str | None) -> list[fx.Node]:
    """``node`` and the pointwise nodes fused into it (single reader, recursively, as
    :func:`.liveness._fusible` has it), inputs first."""
    out: list[fx.Node] = []

    def visit(n: fx.Node) -> None:
        for m in n.all_input_nodes:
            if _pointwise(m) and len(m.users) == 1 and not becomes_addmm(m, device_type) and m not in out:
                visit(m)
        out.append(n)

    visit(node)
    return out


def inline_reused_pointwise(gm: fx.GraphModule, device_type: str | None = None, *, max_leaves: int = MAX_LEAVES) -> int:
    """Copy each reused pointwise value (with its fused input chain) into each of its readers
    where the module docstring's conditions hold. Returns how many nodes were inserted; the graph
    is linted and recompiled when any was.

    ``device_type``: the device the graph is compiled for (``None``: the fake values'); ``"cpu"``
    keeps reused ``exp``/``log``/``sigmoid``/``tanh`` results realized, as Inductor does there.
    ``max_leaves``: the most storages a copied chain may read (:data:`MAX_LEAVES`; the benchmark
    models plain Inductor's own inlining with its ``realize_reads_threshold``, 4).

    Raises:
        ValueError: for ``max_leaves`` below 1.
    """
    if max_leaves < 1:
        raise ValueError(f"inline_reused_pointwise: max_leaves must be at least 1, got {max_leaves!r}")
    graph = gm.graph
    fake_mode = None
    nodes = list(graph.nodes)
    pos: dict = {n: float(i) for i, n in enumerate(nodes)}
    owner: dict = {}  # storage -> the first node holding it
    last: dict = {}  # storage -> position of its last reader (inf: a graph output)
    for n in nodes:
        for s in node_storages(n):
            owner.setdefault(s, n)
            last.setdefault(s, pos[n])
        for a in n.all_input_nodes:
            for s in node_storages(a):
                last[s] = math.inf if n.op == "output" else pos[n]
    inserted = 0
    for n in nodes:
        if not _pointwise(n) or not 2 <= len(n.users) <= MAX_READERS:
            continue
        dev = device_type or n.meta["val"].device.type
        if becomes_addmm(n, dev) or not all(inlining_reader(u, dev) for u in n.users):
            continue
        chain = _chain(n, dev)
        if dev == "cpu" and any(m.target in _CPU_HEAVY for m in chain):
            continue
        in_chain = set(chain)
        leaves: dict = {}
        for m in chain:
            for a in m.all_input_nodes:
                if a not in in_chain:
                    for st in node_storages(a):
                        leaves.setdefault(st, node_span_bytes(owner.get(st, a)))
        readers = list(n.users)
        end = max(pos[_kernel_end(r, dev)] for r in readers)
        size = node_span_bytes(n)
        extended = sum(b for st, b in leaves.items() if last.get(st, -1.0) < end)
        k = len(readers)
        if len(leaves) > max_leaves or extended > size or k * sum(leaves.values()) > (k + 1) * size:
            continue
        if fake_mode is None:
            fake_mode = fake_mode_of(gm)
            if fake_mode is None:
                break
        for r in readers[1:]:
            env = _Env()
            with graph.inserting_before(r):
                for m in chain:
                    new = graph.node_copy(m, env.get_or_same)
                    val = m.meta["val"]
                    with fake_mode:
                        new.meta["val"] = torch.empty_strided(
                            val.shape, val.stride(), dtype=val.dtype, device=val.device
                        )
                    new.meta[NOTE_KEY] = f"copy of {m.name} for {r.name}: computed in its kernel, not allocated"
                    pos[new] = pos[r] - 0.5
                    env[m] = new
                    inserted += 1
            r.replace_input_with(n, env[n])
        for st in leaves:
            last[st] = max(last.get(st, -1.0), end)
    if inserted:
        graph.lint()
        gm.recompile()
    return inserted
