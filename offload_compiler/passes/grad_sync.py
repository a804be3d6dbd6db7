"""Gradient averaging under DDP with ``offload="all"``: rewrite the gradients' trips to the host.

Runs after :func:`.param_residency.apply` (and its check) on a pair compiled inside a DDP
forward. It

* inserts ``trinity::grad_sync_mark`` as the forward's first node after its placeholders (the
  forward records whether its backward syncs: DDP's ``no_sync()``);
* replaces, for every parameter DDP reduces, ``trinity::grad_to_host(g, slot, rt)`` by
  ``trinity::grad_reduce(g, slot, rt, sync, inplace)`` and its ``trinity::grad_to_host_wait`` by
  ``trinity::grad_reduce_wait(g, slot, rt, sync)`` at the same places: the all-reduce is issued
  where the copy was issued, and waited for (with the copy) where the copy was waited for, so it
  overlaps the backward's compute in between (see :mod:`offload_compiler.runtime.grad_sync`).

``inplace`` is true when the graph cannot observe ``g`` being scaled: no node holding its storage
(``g`` and its views, e.g. the ``mm`` whose transpose is a weight's gradient) is a placeholder
or a graph output, or is read after the issue except by the copy ops. Otherwise the sum is
formed in a new tensor.

**Buckets** (as DDP's reducer: ``reducer.cpp``, ``compute_bucket_assignment_by_size``): the
planner (:func:`.param_residency.plan` with a :class:`GradSyncModel`) groups the reduced gradients,
in the order the backward produces them, into buckets of at most the bucket caps' bytes
(:func:`bucket_layout`), and waits for every gradient of a bucket no earlier than the bucket's
last gradient (its device memory counts until there). This pass marks, per bucket, the
``grad_reduce`` that comes last in the backward as the one that launches it: ONE all-reduce per
bucket (coalesced over the bucket's gradients, no flat buffer), issued when its last gradient is
ready, overlapping the rest of the backward. A ``grad_reduce_wait`` placed before its bucket's
launch (the planner never does so) would launch the part of the bucket issued so far
(:mod:`offload_compiler.runtime.grad_sync`): every rank runs the same graph, so that is the same
on every rank.

Matches nodes by op target. Reads ``node.meta["val"]`` (storage identity of fake values); writes
``node.meta["trinity"]`` on the nodes it inserts or replaces.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.fx as fx

from ..collectives import LINKS, Cluster, Group, Link, collective_seconds
from ..graph_pair import GraphPair
from ..ir.alias import storage_key
from ..ir.meta import NOTE_KEY, PARAM_COPY_KEY
from ..ir.ops import GRAD_REDUCE, GRAD_REDUCE_WAIT, GRAD_SYNC_MARK, GRAD_TO_HOST, GRAD_TO_HOST_WAIT

__all__ = [
    "DEFAULT_LINK",
    "GradBucket",
    "GradSyncModel",
    "GradSyncRewrite",
    "GradSyncSpec",
    "apply",
    "bucket_layout",
]

from ..collectives import DEFAULT_LINK  # noqa: E402  (re-exported: defined next to LINKS)


def bucket_layout(grads: Sequence[tuple[Hashable, int, object]], caps: Sequence[int]) -> tuple[tuple, ...]:
    """Group gradients into all-reduce buckets, in the given order (the order the backward
    produces them, as DDP's reducer fills its buckets in the order gradients become ready).

    Args:
        grads: ``(key, bytes, dtype)`` per gradient, in production order.
        caps: bucket caps in bytes, per bucket in order; the last repeats (DDP's
            ``bucket_size_limits``: the first bucket's cap, then ``bucket_bytes_cap``).

    Returns:
        The keys of each bucket, in order. A bucket holds at most its cap's bytes (a gradient
        larger than the cap is a bucket of its own) and one dtype (a coalesced all-reduce
        reduces one dtype; DDP's buckets are per dtype too). Unlike DDP, which closes a bucket
        once it has reached its cap, a bucket here never goes over it.

    Raises:
        ValueError: for no caps, a cap < 1 byte or a negative size.
    """
    if not caps or any(int(c) < 1 for c in caps):
        raise ValueError(f"bucket_layout: caps must be one or more sizes >= 1 byte, got {list(caps)!r}")
    buckets: list[list] = []
    size = 0
    dtype = None
    for key, nbytes, dt in grads:
        if nbytes < 0:
            raise ValueError(f"bucket_layout: gradient {key!r} has a negative size {nbytes}")
        cap = caps[min(len(buckets) - 1, len(caps) - 1)] if buckets else caps[0]
        if not buckets or size + nbytes > cap or dt != dtype:
            buckets.append([])
            size, dtype = 0, dt
        buckets[-1].append(key)
        size += nbytes
    return tuple(tuple(b) for b in buckets)


@dataclass(frozen=True)
class GradSyncModel:
    """What the planner knows of DDP's gradient averaging with ``offload="all"`` (part of
    :class:`~offload_compiler.pipeline.ModelState`).

    Attributes:
        world_size: ranks in DDP's process group (>= 1).
        bucket_caps: bucket caps in bytes, per bucket in order, the last repeating: DDP's first
            bucket cap (``dist._DEFAULT_FIRST_BUCKET_BYTES`` with DDP's default cap, else the cap)
            and ``bucket_bytes_cap`` (or DDP's ``bucket_cap_mb_list``).
        link: the link every ring step crosses (:data:`offload_compiler.collectives.LINKS` entry
            or a ``calibrate --collectives`` measurement; option ``interconnect``).
        slot_ids: the parameter slots whose gradients are reduced.
    """

    world_size: int
    bucket_caps: tuple[int, ...]
    link: Link = LINKS[DEFAULT_LINK]
    slot_ids: frozenset[int] = frozenset()

    def __post_init__(self):
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"GradSyncModel.world_size must be an int >= 1, got {self.world_size!r}")
        if not self.bucket_caps or any(int(c) < 1 for c in self.bucket_caps):
            raise ValueError(f"GradSyncModel.bucket_caps must be one or more sizes >= 1 byte, got {self.bucket_caps!r}")

    def seconds(self, nbytes: int) -> float:
        """Seconds of one bucket's all-reduce of ``nbytes`` bytes: the ring all-reduce of
        :func:`offload_compiler.collectives.collective_seconds` (``base + 2 (p - 1) alpha +
        2 (p - 1) / p * nbytes / bandwidth``, Thakur et al. 2005, NCCL's tuning model) with
        every step over :attr:`link` (one node of ``world_size`` ranks; 0 for one rank)."""
        p = self.world_size
        return collective_seconds("all_reduce", nbytes, Group(p, p), Cluster(p, 1, self.link))


@dataclass(frozen=True)
class GradBucket:
    """One planned all-reduce bucket (joint-schedule steps, bytes, seconds).

    Attributes:
        slots: the parameter slots of its gradients, in the order the backward produces them.
        nbytes: their bytes.
        launch_after: the step after which its last gradient is ready: its all-reduce is issued there.
        wait_after: the step after which the first of its gradients' waits comes (the all-reduce
            must be done there); every member's wait is at or after ``launch_after``.
        seconds: the all-reduce's time (:meth:`GradSyncModel.seconds`).
    """

    slots: tuple[int, ...]
    nbytes: int
    launch_after: int
    wait_after: int
    seconds: float


class GradSyncSpec(Protocol):
    """What :func:`apply` reads of the gradient sync it rewrites for (the runtime's
    :class:`~offload_compiler.runtime.grad_sync.GradSync` is one)."""

    id: int  # the sync's id, an argument of the inserted ops
    slot_ids: frozenset[int]  # the parameter slots whose gradients are reduced
    world_size: int  # ranks in the process group


@dataclass(frozen=True)
class GradSyncRewrite:
    """What :func:`apply` did: gradients whose trip to the host now all-reduces first, of which
    how many in place, and the all-reduces (buckets) that launch them."""

    num_reduced: int
    num_inplace: int
    num_buckets: int = 0


def _storage(node: fx.Node):
    val = node.meta.get("val")
    return storage_key(val) if isinstance(val, torch.Tensor) else None


def _inplace_ok(g: fx.Node, issue: fx.Node, slot: int, order: dict[fx.Node, int]) -> bool:
    """Whether nothing can observe ``g``'s storage being written at ``issue``: no node holding
    that storage (``g`` and its views) is a placeholder or feeds the output, and none is read
    after ``issue`` except by this slot's gradient-copy ops."""
    st = _storage(g)
    if st is None:
        return False
    holders = [n for n in order if (s := _storage(n)) is not None and s == st]
    if g not in holders:
        holders.append(g)
    for h in holders:
        if h.op == "placeholder":
            return False
        for user in h.users:
            if user.op == "output":
                return False
            own_copy = user.op == "call_function" and user.target in (GRAD_TO_HOST, GRAD_TO_HOST_WAIT)
            if user is issue or (own_copy and user.args[1] == slot):
                continue
            if order[user] > order[issue]:
                return False
    return True


def _only_trinity_between(nodes: list[fx.Node], a: int, b: int) -> bool:
    """Whether every node strictly between positions ``a`` and ``b`` of ``nodes`` is a
    ``trinity::`` op (matched by the op's namespace)."""
    return all(n.op == "call_function" and getattr(n.target, "namespace", None) == "trinity" for n in nodes[a + 1 : b])


def apply(pair: GraphPair, sync: GradSyncSpec, buckets: Sequence[Sequence[int]]) -> GradSyncRewrite:
    """Rewrite ``pair`` in place for ``sync`` (module docstring); returns what was done.

    Args:
        pair: the graphs after :func:`.param_residency.apply`.
        sync: the gradient sync the inserted ops call.
        buckets: the planned buckets' slots (:attr:`.param_residency.ResidencyPlan.grad_buckets`).

    Raises:
        ValueError: a reduced gradient's slot in no bucket or in several, or two gradients of one
            slot in the backward (the plan and the graphs disagree).
    """
    bucket_of: dict[int, int] = {}
    for i, members in enumerate(buckets):
        for slot in members:
            if slot in bucket_of:
                raise ValueError(f"grad_sync.apply: slot {slot} is in buckets {bucket_of[slot]} and {i}")
            bucket_of[slot] = i
    fw = pair.forward.graph
    placeholders = list(fw.find_nodes(op="placeholder"))
    anchor = placeholders[-1] if placeholders else None
    if anchor is not None:
        with fw.inserting_after(anchor):
            mark = fw.call_function(GRAD_SYNC_MARK, (sync.id,))
    else:
        with fw.inserting_before(next(iter(fw.nodes))):
            mark = fw.call_function(GRAD_SYNC_MARK, (sync.id,))
    mark.meta["val"] = None
    mark.meta[NOTE_KEY] = "records DDP's require_backward_grad_sync (no_sync) for this forward's backward"
    bw = pair.backward.graph
    order = {n: i for i, n in enumerate(bw.nodes)}
    issues: dict[int, fx.Node] = {}
    for n in list(bw.nodes):
        if n.op != "call_function" or n.target is not GRAD_TO_HOST:
            continue
        slot = n.args[1]
        if slot not in sync.slot_ids:
            continue
        if slot not in bucket_of:
            raise ValueError(f"grad_sync.apply: the gradient of slot {slot} is reduced but in no planned bucket")
        if slot in issues:
            raise ValueError(f"grad_sync.apply: two gradients of slot {slot} go to the host in this backward")
        issues[slot] = n
    # Per bucket, its gradient issued last in the backward launches the all-reduce.
    launcher: dict[int, int] = {}
    for slot, n in issues.items():
        b = bucket_of[slot]
        if b not in launcher or order[n] > order[issues[launcher[b]]]:
            launcher[b] = slot
    reduced = inplace_count = 0
    new_issues: dict[int, fx.Node] = {}
    for slot, n in issues.items():
        g, _slot, rt = n.args
        b = bucket_of[slot]
        launch = launcher[b] == slot
        inplace = _inplace_ok(g, n, slot, order)
        with bw.inserting_before(n):
            new = bw.call_function(GRAD_REDUCE, (g, slot, rt, sync.id, inplace, b, launch))
        new.meta["val"] = None
        new.meta[NOTE_KEY] = (
            f"gradient (slot {slot}) x 1/{sync.world_size}"
            + (" in place" if inplace else " (in a copy)")
            + f", bucket {b}"
            + ("; its last gradient: the bucket's all-reduce is issued" if launch else "")
            + "; its D2H copy follows at the wait"
        )
        if PARAM_COPY_KEY in n.meta:
            new.meta[PARAM_COPY_KEY] = n.meta[PARAM_COPY_KEY]
        bw.erase_node(n)
        new_issues[slot] = new
        reduced += 1
        inplace_count += inplace
    nodes = list(bw.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    for n in nodes:
        if n.op != "call_function" or n.target is not GRAD_TO_HOST_WAIT:
            continue
        g, slot, rt = n.args
        if slot not in new_issues:
            continue
        with bw.inserting_before(n):
            new = bw.call_function(GRAD_REDUCE_WAIT, (g, slot, rt, sync.id))
        new.meta["val"] = None
        new.meta[NOTE_KEY] = (
            f"all-reduce of bucket {bucket_of[slot]} done, D2H of the averaged gradient (slot {slot}) done"
        )
        bw.erase_node(n)
        launch_node = new_issues[launcher[bucket_of[slot]]]
        if order[n] < order[launch_node] and _only_trinity_between(nodes, order[n], order[launch_node]):
            # Planned after the same step as the launch but inserted before it: moved after it
            # (only trinity ops in between, so no compute step and no lifetime moves). A wait
            # planned before its bucket's launch stays: the runtime launches what is issued.
            launch_node.append(new)
    for gm in (pair.forward, pair.backward):
        gm.graph.lint()
        gm.recompile()
    return GradSyncRewrite(reduced, inplace_count, len(launcher))
