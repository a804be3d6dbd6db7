"""Verifier: structural invariants of a rewritten graph pair and its re-measured peak.

Checked (transfer nodes found by op target, never by name):

1. every ``evict`` has exactly one ``evict_wait`` on its host tensor, later in the forward, that
   also takes the evicted tensor, and the host tensor is returned by the forward;
2. the evicted device tensor (and every alias of it) is not read after its ``evict_wait``;
3. every host tensor the backward receives feeds exactly one ``prefetch``; every ``prefetch`` has
   exactly one ``prefetch_wait``; nothing reads the prefetched tensor between the two;
4. happens-before across streams (multi-stream graphs only; see :mod:`.happens_before`): every
   cross-stream read is ordered by an event path from its writer, and no buffer is freed while
   another stream may still read it;
5. recomputed nodes (``node.meta["trinity_recompute"]``, from ``insert_recompute``) are ops that
   may be recomputed (no mutation, side effect, collective, unknown cost; a random op only as
   ``run_with_rng_state`` on a generator state the forward saved with ``run_and_save_rng_state``);
6. parameter residency (:func:`check_residency`, parameter offload only): no offloaded parameter
   is read, nor viewed, while released or while its fetch may still be writing it; fetches,
   waits, releases and gradient copies pair up (run first, by the pipeline and the inference
   rewrite);
7. the peak of the rewritten pair, measured again by liveness from scratch (recomputed nodes are
   backward nodes like any other there), is within the budget and equals the planner's simulated
   peak.

Reads ``node.meta["val"]``; writes nothing.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from ..graph_pair import GraphPair, tensor_vals
from ..ir.alias import node_storages, storage_key
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
from ..options import format_bytes
from . import happens_before
from . import liveness as liveness_pass
from .margins import WorkspaceMargins

if TYPE_CHECKING:
    from .param_residency import ResidencyPlan

__all__ = ["VerificationError", "verify", "check_residency"]


class VerificationError(RuntimeError):
    """A rewritten graph pair breaks an invariant; the message says which and where."""


def _storages(node: fx.Node) -> set:
    return set(node_storages(node))


def _check_forward(fw: fx.GraphModule, fw_outputs: list) -> list[str]:
    errors = []
    nodes = list(fw.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    outs = set(n for n in fw_outputs if isinstance(n, fx.Node))
    storages = {n: _storages(n) for n in nodes}
    last_read: dict = {}  # storage -> (position, reader, the alias it reads)
    for i, n in enumerate(nodes):
        if n.op in ("output", "placeholder"):
            continue
        for m in n.all_input_nodes:
            # ``getitem`` of a multi-output node reads the one output it selects, not the others.
            reads = storages[n] if n.target is operator.getitem and len(tensor_vals(m)) > 1 else storages[m]
            for s in reads:
                last_read[s] = (i, n, m)
    # A buffer evicted as several views is freed after the last of their waits.
    freed_at: dict = {}  # storage -> (position, wait node)
    for n in nodes:
        if n.op == "call_function" and n.target is EVICT_WAIT and isinstance(n.args[1], fx.Node):
            for s in storages[n.args[1]]:
                if s not in freed_at or freed_at[s][0] < pos[n]:
                    freed_at[s] = (pos[n], n)
    for n in nodes:
        if n.op != "call_function" or n.target is not EVICT:
            continue
        waits = [u for u in n.users if u.op == "call_function" and u.target is EVICT_WAIT and u.args[0] is n]
        if len(waits) != 1:
            errors.append(f"forward: evict {n.name!r} has {len(waits)} evict_wait nodes (expected 1)")
            continue
        w = waits[0]
        src = n.args[0]
        if w.args[1] is not src:
            errors.append(f"forward: {w.name!r} waits for {n.name!r} but keeps {w.args[1]} alive, not its source {src}")
        if pos[w] < pos[n]:
            errors.append(f"forward: {w.name!r} comes before its evict {n.name!r}")
        if n not in outs:
            errors.append(f"forward: host tensor {n.name!r} is not returned to the backward")
        # Nothing may read the evicted storage after the wait (it is freed there).
        for s in storages[src]:
            i, reader, alias = last_read.get(s, (-1, None, None))
            if s not in freed_at:
                continue  # no wait keeps this storage alive: reported above
            free_pos, free_node = freed_at[s]
            if i > free_pos:
                errors.append(
                    f"forward: {reader.name!r} reads {alias.name!r}, an alias of evicted {src.name!r}, "
                    f"after its storage was freed at {free_node.name!r}"
                )
        if src in outs:
            errors.append(f"forward: evicted {src.name!r} is still returned to the backward as a device tensor")
    return errors


def _check_backward(bw: fx.GraphModule) -> list[str]:
    errors = []
    nodes = list(bw.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    for n in nodes:
        if n.op != "call_function" or n.target is not PREFETCH:
            continue
        host = n.args[0]
        if host.op != "placeholder":
            errors.append(f"backward: prefetch {n.name!r} reads {host}, not a host placeholder")
        elif len(host.users) != 1:
            errors.append(
                f"backward: host placeholder {host.name!r} has {len(host.users)} readers (expected 1 prefetch)"
            )
        waits = [u for u in n.users if u.op == "call_function" and u.target is PREFETCH_WAIT]
        if len(waits) != 1:
            errors.append(f"backward: prefetch {n.name!r} has {len(waits)} prefetch_wait nodes (expected 1)")
            continue
        w = waits[0]
        for u in n.users:
            if u is w:
                continue
            if pos[u] < pos[w]:
                errors.append(f"backward: {u.name!r} reads prefetched {n.name!r} before its wait {w.name!r}")
    return errors


def _check_recompute(pair: GraphPair) -> list[str]:
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    from .insert_recompute import RECOMPUTE_KEY
    from .recompute_chains import refusal

    errors = []
    # The forward node each backward placeholder receives (GraphPair.saved_links binds them).
    saved_from = {link.bw_placeholder: link.fw_node for link in pair.saved_links() if link.bw_placeholder is not None}
    for n in pair.backward.graph.nodes:
        if RECOMPUTE_KEY not in n.meta:
            continue
        if n.op == "call_function" and n.target is run_with_rng_state:
            state = n.args[0]
            src = saved_from.get(state) if isinstance(state, fx.Node) else None
            if (
                not isinstance(state, fx.Node)
                or state.op != "placeholder"
                or src is None
                or src.target is not operator.getitem
                or getattr(src.args[0], "target", None) is not run_and_save_rng_state
            ):
                errors.append(
                    f"backward: recomputed random op {n.name!r} does not replay a generator state the forward saved"
                )
            continue
        why = refusal(n, rng_replay=False)
        if why is not None:
            errors.append(f"backward: recomputed node {n.name!r} may not be recomputed: {why}")
    return errors


def verify(
    pair: GraphPair,
    budget_bytes: int | None,
    expected_peak_bytes: int | None = None,
    assume_fusion: bool = False,
    margins: WorkspaceMargins | None = None,
) -> int:
    """Check the rewritten ``pair`` (see module docstring) and return its re-measured peak (bytes).
    ``margins``: the measured workspace the plan was made with (see :mod:`.margins`).

    Raises:
        VerificationError: listing every broken invariant.
    """
    errors = _check_forward(pair.forward, pair.fw_outputs()) + _check_backward(pair.backward)
    errors += _check_recompute(pair)
    for name, gm in (("forward", pair.forward), ("backward", pair.backward)):
        if happens_before.has_streams(gm):
            errors += happens_before.check_streams(gm, name)
    if errors:  # the peak of a malformed rewrite means nothing; report the structure first
        raise VerificationError("trinity verification failed:\n  - " + "\n  - ".join(errors))
    try:
        live = liveness_pass.analyze(pair, assume_fusion=assume_fusion, margins=margins)
    except ValueError as exc:
        raise VerificationError(f"trinity verification failed: cannot re-measure the peak: {exc}") from exc
    peak = live.peak_bytes
    if budget_bytes is not None and peak > budget_bytes:
        step = live.steps[live.peak_step]
        errors.append(
            f"re-measured peak {format_bytes(peak)} ({peak} bytes) at {step.graph} node {step.node!r} "
            f"exceeds the budget {format_bytes(budget_bytes)} ({budget_bytes} bytes)"
        )
    if expected_peak_bytes is not None and peak != expected_peak_bytes:
        errors.append(
            f"re-measured peak {peak} bytes differs from the planner's simulated peak {expected_peak_bytes} bytes"
        )
    if errors:
        raise VerificationError("trinity verification failed:\n  - " + "\n  - ".join(errors))
    return peak


_RELEASED, _FETCHING, _RESIDENT = "released", "fetching", "resident"


def check_residency(pair: GraphPair, the_plan: ResidencyPlan) -> list[str]:
    """Invariants of a pair rewritten by :func:`.param_residency.apply` with ``the_plan``.
    Returns the violations (empty when none):

    * no node reads an offloaded parameter's storage (any view of it) while it is released, nor
      between its ``param_fetch`` and that fetch's ``param_fetch_wait`` (the copy may still be
      writing it); a view op counts as a reader (a view of a released storage must never be
      made), only size and stride queries (``sym_size``, ...) are allowed;
    * every ``param_fetch`` has exactly one ``param_fetch_wait`` of the same slot and storage
      after it, before any release or other fetch of that slot; every wait follows a fetch;
      every release follows a fetch's wait;
    * every ``grad_to_host`` has exactly one ``grad_to_host_wait`` of the same slot and gradient
      later in the backward (it keeps the gradient alive while the copy reads it).

    A parameter is resident at the start of the forward with ``"activations+params"`` and
    released with ``"all"``; the backward starts with whatever the forward left. Nodes are
    matched by op target.
    """
    RELEASED, RESIDENT = _RELEASED, _RESIDENT
    errors: list[str] = []
    by_slot = {p.slot: p for p in the_plan.params}
    state = {p.slot: RESIDENT if the_plan.mode == "activations+params" else RELEASED for p in the_plan.params}

    def name_of(slot) -> str:
        return by_slot[slot].placeholder if slot in by_slot else f"slot {slot}"

    for graph_name, gm in (("forward", pair.forward), ("backward", pair.backward)):
        errors += _residency_errors(graph_name, gm, state, name_of)
    return errors


def _residency_errors(graph_name: str, gm: fx.GraphModule, state: dict, name_of) -> list[str]:
    """The residency violations in one graph (see :func:`check_residency`), walking it in order
    from ``state`` (slot -> released, fetching or resident; updated to the graph's end)."""
    walk = _ResidencyWalk(graph_name, gm, state, name_of)
    steps = {
        PARAM_FETCH: walk.fetch,
        PARAM_FETCH_WAIT: walk.fetch_wait,
        PARAM_RELEASE: walk.release,
        GRAD_TO_HOST: walk.grad_to_host,
        GRAD_TO_HOST_WAIT: walk.grad_to_host_wait,
    }
    for n in gm.graph.nodes:
        step = steps.get(n.target) if n.op == "call_function" else None
        if step is not None:
            step(n)
        elif n.op not in ("placeholder", "output"):
            walk.read(n)
    walk.finish()
    return walk.errors


def _storage_of(node):
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return storage_key(val) if isinstance(val, torch.Tensor) else None


class _ResidencyWalk:
    """One graph's walk of :func:`_residency_errors`: a method per parameter op (``n.args[1]`` is
    the slot), :meth:`read` for every other node, :meth:`finish` at the graph's end."""

    def __init__(self, graph_name: str, gm: fx.GraphModule, state: dict, name_of):
        self.graph_name, self.state, self.name_of = graph_name, state, name_of
        self.errors: list[str] = []
        self.fetch_of: dict = {}  # slot -> the fetch node waiting for its wait
        self.grad_issue: dict = {}  # slot -> the grad_to_host node waiting for its wait
        self.storage_slot: dict = {}  # a parameter's storage -> its slot
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target in (PARAM_FETCH, PARAM_FETCH_WAIT, PARAM_RELEASE):
                st = _storage_of(n.args[0])
                if st is not None:
                    self.storage_slot[st] = n.args[1]

    def _error(self, text: str) -> None:
        self.errors.append(f"{self.graph_name}: {text}")

    def fetch(self, n: fx.Node) -> None:
        slot = n.args[1]
        if self.state.get(slot) == _FETCHING:
            self._error(
                f"{n.name} fetches parameter {self.name_of(slot)} again before the wait of {self.fetch_of[slot].name}"
            )
        self.state[slot] = _FETCHING
        self.fetch_of[slot] = n

    def fetch_wait(self, n: fx.Node) -> None:
        slot = n.args[1]
        if self.state.get(slot) != _FETCHING:
            # The state stays as it was (a released parameter's readers are reported).
            self._error(f"{n.name} waits for a fetch of {self.name_of(slot)} that was not issued")
            return
        if _storage_of(n.args[0]) != _storage_of(self.fetch_of[slot].args[0]):
            self._error(f"{n.name} waits on another storage than its fetch {self.fetch_of[slot].name}")
        self.state[slot] = _RESIDENT
        self.fetch_of.pop(slot)

    def release(self, n: fx.Node) -> None:
        slot = n.args[1]
        if self.state.get(slot) == _FETCHING:
            self._error(
                f"{n.name} releases parameter {self.name_of(slot)} before the wait of its fetch "
                f"{self.fetch_of[slot].name}"
            )
            self.fetch_of.pop(slot, None)
        elif self.state.get(slot) != _RESIDENT:
            self._error(f"{n.name} releases slot {slot} that is not resident")
        self.state[slot] = _RELEASED

    def grad_to_host(self, n: fx.Node) -> None:
        slot = n.args[1]
        if slot in self.grad_issue:
            self._error(
                f"{n.name} sends the gradient of {self.name_of(slot)} to host again before the wait of "
                f"{self.grad_issue[slot].name}"
            )
        self.grad_issue[slot] = n

    def grad_to_host_wait(self, n: fx.Node) -> None:
        slot = n.args[1]
        issue = self.grad_issue.pop(slot, None)
        if issue is None:
            self._error(f"{n.name} waits for a gradient copy of {self.name_of(slot)} that was not issued")
        elif n.args[0] is not issue.args[0]:
            self._error(f"{n.name} keeps {n.args[0]} alive, not the gradient {issue.args[0]} that {issue.name} copies")

    def read(self, n: fx.Node) -> None:
        """``n`` reads its inputs: every parameter among them must be resident (size queries
        excepted)."""
        for m in n.all_input_nodes:
            st = _storage_of(m)
            slot = self.storage_slot.get(st) if st is not None else None
            if slot is None or self.state.get(slot) == _RESIDENT or _size_query(n):
                continue
            what = f"parameter {self.name_of(slot)} (via {m.name})"
            if self.state.get(slot) == _FETCHING:
                self._error(f"{n.name} reads {what} before the wait of its fetch {self.fetch_of[slot].name}")
            elif _metadata_only(n):
                self._error(f"view {n.name} of {what} is made while it is released")
            else:
                self._error(f"{n.name} reads {what} while it is released")

    def finish(self) -> None:
        for slot, f in self.fetch_of.items():
            self._error(f"fetch {f.name} of parameter {self.name_of(slot)} has no param_fetch_wait")
            self.state[slot] = _RESIDENT  # do not report every later reader again
        for slot, g in self.grad_issue.items():
            self._error(f"{g.name} (gradient of {self.name_of(slot)} to host) has no grad_to_host_wait")


_SIZE_QUERIES = frozenset(
    {
        torch.ops.aten.sym_size.int,
        torch.ops.aten.sym_stride.int,
        torch.ops.aten.sym_numel.default,
        torch.ops.aten.sym_storage_offset.default,
    }
)


def _size_query(node: fx.Node) -> bool:
    """A size, stride, numel or offset query: reads the tensor's metadata only and makes no view."""
    return node.op == "call_function" and node.target in _SIZE_QUERIES


def _metadata_only(node: fx.Node) -> bool:
    """A view op (reads no data, but makes a view of the storage)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    info = schema.returns[0].alias_info
    return info is not None and not info.is_write
