"""Storage access: which buffers (storages) each node of one FX graph allocates, reads and writes.

An analysis on one graph (forward or backward alone), by the IR's aliasing rule
(:mod:`offload_compiler.ir.alias`): storage keys from the fake values, schema-first aliasing,
reads and writes from the op schemas, the transfer ops' ``after`` ordering edges neither read nor
written. The stream pass (:mod:`.assign_streams`), the happens-before check (:mod:`.happens_before`)
and the interleaving test executor (:mod:`offload_compiler.testing.interleave`) read it.

Reads ``node.meta["val"]``; writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..ir.alias import mutated_args, node_storages, ordering_args, schema_view_of
from ..ir.ops import STREAM_OPS

__all__ = ["GraphAccess"]


@dataclass(frozen=True)
class GraphAccess:
    """Which buffers (storages) each node of one graph allocates, reads and writes.

    Attributes:
        nodes: the graph's nodes in program order.
        views: nodes whose outputs all alias their inputs (views, ``getitem``): metadata only,
            they read no data.
        reads: per node, the storages whose data it reads (empty for views and placeholders;
            a transfer op's ``after`` ordering edge is not a read).
        writes: per node, the storages it writes (its fresh outputs, and mutated arguments).
        allocator: per storage, the node that allocated it (a placeholder for inputs).
        holder: per storage, the first node whose value is a tensor on it (a keep-alive handle).
        last_use: per storage, the position of its last reader in program order (views count:
            they hold the storage), or its allocator's position when nothing reads it.
        escapes: the storages the output node returns (never freed inside the graph).
    """

    nodes: tuple[fx.Node, ...]
    views: frozenset
    reads: dict
    writes: dict
    allocator: dict
    holder: dict
    last_use: dict
    escapes: frozenset

    @staticmethod
    def of(graph: fx.Graph, ignore: tuple = STREAM_OPS) -> GraphAccess:
        """Analyse ``graph``; nodes whose target is in ``ignore`` are skipped entirely."""
        nodes = tuple(n for n in graph.nodes if not (n.op == "call_function" and n.target in ignore))
        pos = {n: i for i, n in enumerate(nodes)}
        keys = {}
        for n in nodes:
            # A read-only alias by the op's schema (``detach``, ``t``, ``view``...) shares its
            # input's storage even where its fake value does not (a ``detach`` recomputed into the
            # backward carries the forward's fake tensor): aliasing comes from the schema first.
            src = schema_view_of(n, 0) if isinstance(n.meta.get("val"), torch.Tensor) else None
            keys[n] = list(keys[src]) if src is not None and keys.get(src) else node_storages(n)
        views, reads, writes = set(), {}, {}
        allocator, holder, last_use = {}, {}, {}
        escapes = set()
        for n in nodes:
            in_keys = {k for m in n.all_input_nodes for k in keys.get(m, ())}
            own = keys[n]
            if n.op == "call_function" and own and all(k in in_keys for k in own):
                views.add(n)
            for k in own:
                allocator.setdefault(k, n)
                if isinstance(n.meta.get("val"), torch.Tensor):
                    holder.setdefault(k, n)
            if n.op == "output":
                escapes |= in_keys
                reads[n] = in_keys
                writes[n] = set()
                continue
            for k in in_keys:
                last_use[k] = pos[n]
            if n.op != "call_function" or n in views:
                reads[n] = set()
                writes[n] = set(k for k in own if n.op == "placeholder")
                continue
            ordering = ordering_args(n)
            data = [m for m in n.all_input_nodes if m not in ordering]
            reads[n] = {k for m in data for k in keys.get(m, ())}
            mutated = {k for m in mutated_args(n) for k in keys.get(m, ())}
            writes[n] = {k for k in own if k not in in_keys} | mutated
        for k, a in allocator.items():
            last_use.setdefault(k, pos[a])
        return GraphAccess(nodes, frozenset(views), reads, writes, allocator, holder, last_use, frozenset(escapes))
