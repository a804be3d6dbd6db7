"""Parameter residency: where each offloaded parameter is fetched to the device and released.

With ``offload="activations+params"`` or ``"all"`` every parameter (an ``nn.Parameter`` among
the forward's static-lifetime inputs) becomes a plan candidate. For each one, over the joint
schedule (steps as in :mod:`.liveness`):

* forward: ``param_fetch`` (issues the asynchronous host-to-device copy) ahead of its first
  reader (the **working window**, below), ``param_fetch_wait`` right before that reader, and
  ``param_release`` right after its last *real* forward reader. The forward's output node, which
  only hands saved views to the backward, is not a reader, and neither are the views that exist
  only to be saved (:attr:`.liveness.Liveness.save_only_steps`: a partitioner may save
  ``t(t(weight))`` computed after the loss): :func:`apply` moves those views before the release,
  so no view op ever runs on a released parameter. A parameter whose only forward readers are
  such views is fetched for them;
* backward: ``param_fetch`` ahead of its first backward reader (the saved views of it, e.g. the
  ``t(weight)`` a linear layer's input gradient needs), ``param_fetch_wait`` right before it and,
  with ``"all"``, ``param_release`` after its last one. With ``"activations+params"`` it stays
  resident to the end of the step (the user's own optimizer updates it on the device); the
  forward's release then writes the device value back to the host master first (a copy exposed
  on the device: the storage is freed only after it).
* with ``"all"``, the parameter's gradient goes to host memory (``grad_to_host``, an
  asynchronous device-to-host copy) right after the node that produces it (or after the
  parameter's last backward reader, if that comes later: from then on the CPU optimizer may
  update the parameter), and the backward returns ``None`` in its place. Its
  ``grad_to_host_wait``, which keeps the device gradient alive until the copy is done, comes
  after the fewest nodes whose compute covers that copy (at the latest before the output; right
  after the ``grad_to_host`` when the windows are shrunk): the gradient's device memory counts
  until there.

**DDP buckets** (``offload="all"`` under DDP, a :class:`~.grad_sync.GradSyncModel`): the
reduced gradients, in the order the backward issues them, form all-reduce buckets
(:func:`~.grad_sync.bucket_layout`, :attr:`ResidencyPlan.grad_buckets`); a bucket's all-reduce is
issued after its last gradient, so every gradient of a bucket is waited for no earlier than that
and, with windows, after the fewest nodes whose compute covers the all-reduce's time: the
gradients' device memory counts until there, in the predicted peak and in the activation
planner's view.

**Working window.** A fetch is issued ``window_steps`` nodes before the reader, the fewest such
that the cost model's compute time of those nodes covers the parameter's host-to-device copy
time (so the copy hides under compute on a GPU). If the predicted peak with those windows is over
the budget, windows shrink to zero (fetch right before the reader): the pipeline plans the
activations on :func:`activation_view` with windows first and, if that misses the budget, again
without. Per-parameter windows, the
predicted peak and the host bytes are reported in :class:`ResidencyPlan`.

``plan`` is a pure function of liveness, costs and options. ``apply`` mutates the graphs: it
inserts ``trinity::param_fetch`` / ``param_fetch_wait`` / ``param_release`` / ``grad_to_host`` /
``grad_to_host_wait`` nodes (matched by op target elsewhere) and, with ``"all"``, replaces
offloaded gradients in the backward's output by ``None``. It reads ``node.meta["val"]`` only
through the liveness analysis and writes ``node.meta["trinity"]`` (a human-readable
description), ``node.meta["val"] = None`` and, on the nodes that issue a copy,
``node.meta["trinity_param_copy"] = (direction, bytes)`` (read by the dump's timeline
simulation) on the nodes it inserts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch.fx as fx

from ..graph_pair import GraphPair
from ..ir.meta import NOTE_KEY, PARAM_COPY_KEY
from ..ir.ops import GRAD_TO_HOST, GRAD_TO_HOST_WAIT, PARAM_FETCH, PARAM_FETCH_WAIT, PARAM_RELEASE
from ..ir.refs import node_ref, plain_dict
from .cost_model import Costs
from .liveness import Buffer, BufferKind, Liveness

__all__ = [
    "ParamResidency",
    "ResidencyPlan",
    "plan",
    "apply",
    "activation_view",
    "copy_tasks",
    "update_tasks",
    "step_timeline",
    "MODES",
]

MODES = ("activations+params", "all")


@dataclass(frozen=True)
class ParamResidency:
    """The schedule of one offloaded parameter (joint-schedule steps; ``None``: no such node).

    Attributes:
        slot: the :class:`~offload_compiler.runtime.model_state.ParamSlot` id.
        placeholder: the forward placeholder's name (``placeholder_ref``: the node itself, a
            reference into the graphs planned, which :func:`apply` uses).
        buffer: the liveness buffer id (the parameter's storage and all its views).
        nbytes: device bytes of its storage.
        fw_fetch_before / fw_release_after: forward fetch and release positions.
        bw_fetch_before / bw_release_after: backward fetch and release positions
            (``bw_release_after`` is ``None`` with ``"activations+params"``: resident to the end).
        fw_window_steps / bw_window_steps: how many nodes ahead of the first reader the fetch is.
        grad_to_host_after: the step after which its gradient copy to host is issued (``"all"``).
        grad_buffer: the liveness buffer of that gradient.
        resident_steps: ``(first, last)`` inclusive intervals where its storage is on the device.
        fw_wait_before / bw_wait_before: the ``param_fetch_wait`` positions (the first reader).
        grad_wait_after: the step after which the ``grad_to_host_wait`` comes; the gradient's
            device memory is live up to it.
        fw_save_views: steps of the forward's save-only views of it that come after
            ``fw_release_after``; :func:`apply` moves them right before the release.
    """

    slot: int
    placeholder: str
    buffer: int
    nbytes: int
    fw_fetch_before: int | None
    fw_release_after: int | None
    bw_fetch_before: int | None
    bw_release_after: int | None
    fw_window_steps: int
    bw_window_steps: int
    grad_to_host_after: int | None
    grad_buffer: int | None
    resident_steps: tuple[tuple[int, int], ...]
    fw_wait_before: int | None = None
    bw_wait_before: int | None = None
    grad_wait_after: int | None = None
    fw_save_views: tuple[int, ...] = ()
    placeholder_ref: fx.Node | None = node_ref()


@dataclass(frozen=True)
class ResidencyPlan:
    """Where every offloaded parameter lives over the step.

    Attributes:
        mode: ``"activations+params"`` or ``"all"``.
        params: one :class:`ParamResidency` per offloaded parameter.
        num_steps / num_fw_steps: the joint schedule's length and its forward part.
        peak_bytes_resident_params: predicted peak with parameters resident throughout (bytes).
        peak_bytes: predicted peak with this residency (bytes).
        budget_bytes: the budget the windows were checked against (``None``: no limit).
        windows_shrunk: whether the windows were cut to zero (to meet the budget).
        host_bytes: host memory for the parameters' master copies (and host gradients with
            ``"all"``), bytes.
        max_window_steps: the largest fetch lead, in nodes.
        window_seconds: the largest fetch lead, in the cost model's compute seconds.
        grad_buckets: under DDP with ``"all"``, the all-reduce buckets of the reduced gradients
            (:class:`~.grad_sync.GradBucket`), in launch order; else empty.
    """

    mode: str
    params: tuple[ParamResidency, ...]
    num_steps: int
    num_fw_steps: int
    peak_bytes_resident_params: int
    peak_bytes: int
    budget_bytes: int | None
    windows_shrunk: bool
    host_bytes: int
    max_window_steps: int
    window_seconds: float
    grad_buckets: tuple = ()

    def resident_param_bytes(self) -> np.ndarray:
        """Parameter bytes on the device at each step (int64 array of ``num_steps``)."""
        diff = np.zeros(self.num_steps + 1, dtype=np.int64)
        for p in self.params:
            for a, b in p.resident_steps:
                diff[a] += p.nbytes
                diff[b + 1] -= p.nbytes
        return np.cumsum(diff[:-1])

    def to_json(self) -> str:
        """The plan as JSON, with the per-step resident parameter bytes (for dumps)."""
        d = plain_dict(self)
        d["resident_param_bytes"] = self.resident_param_bytes().tolist()
        return json.dumps(d, indent=1)

    def summary(self) -> str:
        mib = 2**20
        return (
            f"trinity params ({self.mode}): {len(self.params)} parameters offloaded, host "
            f"{self.host_bytes / mib:.1f} MiB; predicted peak {self.peak_bytes / mib:.1f} MiB "
            f"(resident parameters: {self.peak_bytes_resident_params / mib:.1f} MiB); window up to "
            f"{self.max_window_steps} nodes ({self.window_seconds * 1e3:.3f} ms)"
            + (" (shrunk to meet the budget)" if self.windows_shrunk else "")
        )


def _grad_waits(params) -> dict[int, int]:
    """Gradient buffer -> the step after its last ``grad_to_host_wait`` (several parameters'
    gradients may be views of one buffer)."""
    out: dict[int, int] = {}
    for p in params:
        if p.grad_wait_after is not None and p.grad_buffer is not None:
            out[p.grad_buffer] = max(out.get(p.grad_buffer, -1), p.grad_wait_after)
    return out


def _lead(first_use: int, floor: int, nbytes: int, costs: Costs) -> int:
    """Fewest steps before ``first_use`` (not before ``floor``) whose compute covers the copy."""
    need = costs.transfer_seconds(nbytes, "h2d")
    s, acc = first_use, 0.0
    while s > floor and acc < need:
        s -= 1
        acc += costs.step_seconds[s]
    return first_use - s


def _trail(after: int, ceiling: int, nbytes: int, costs: Costs, seconds: float | None = None) -> int:
    """The last step of the fewest steps after ``after`` (not past ``ceiling``) whose compute
    covers the device-to-host copy of ``nbytes`` (or ``seconds``, where given)."""
    need = costs.transfer_seconds(nbytes, "d2h") if seconds is None else seconds
    s, acc = after, 0.0
    while s < ceiling and acc < need:
        s += 1
        acc += costs.step_seconds[s]
    return s


def plan(
    pair: GraphPair,
    live: Liveness,
    costs: Costs,
    slots: Mapping[int, tuple[int, int]],
    mode: str,
    base_live: np.ndarray,
    budget: int | None,
    host_grad: bool | None = None,
    use_windows: bool = True,
    grad_sync=None,
) -> ResidencyPlan:
    """Plan the residency of the parameters in ``slots``.

    Args:
        pair: the (unrewritten) graph pair ``live`` and ``costs`` describe.
        live: its liveness; costs: its cost model.
        slots: forward placeholder index -> ``(slot id, host bytes of the slot)``, for the
            parameters to offload. Parameters whose storage is a user output of the forward are
            left resident.
        mode: ``"activations+params"`` or ``"all"``.
        base_live: device bytes per step with parameters resident (after the activation plan).
        budget: the budget (bytes, ``None``: no limit), recorded in the plan.
        host_grad: send gradients to host; defaults to ``mode == "all"``.
        use_windows: fetch ahead by the working window; ``False`` fetches right before the first
            reader (the caller retries with it when the windows make the budget unreachable).
        grad_sync: under DDP with ``"all"``, the :class:`~.grad_sync.GradSyncModel`: the reduced
            gradients are bucketed and waited for after their bucket's launch (module docstring).

    Returns:
        A :class:`ResidencyPlan`.

    Raises:
        ValueError: for an unknown ``mode``.
    """
    if mode not in MODES:
        raise ValueError(f"param_residency.plan: mode {mode!r}; expected one of {MODES}")
    ctx = _PlanContext.of(pair, live, costs, mode, mode == "all" if host_grad is None else host_grad, use_windows)
    params = []
    for index, (slot_id, _host) in sorted(slots.items()):
        p = _plan_param(ctx, index, slot_id)
        if p is not None:
            params.append(p)
    buckets: tuple = ()
    if grad_sync is not None and ctx.host_grad:
        params, buckets = _bucket_grads(ctx, params, grad_sync)
    peak = int(_predicted_live(live, base_live, params).max()) if live.num_steps else 0
    return ResidencyPlan(
        mode=mode,
        params=tuple(params),
        num_steps=live.num_steps,
        num_fw_steps=live.num_fw_steps,
        peak_bytes_resident_params=int(base_live.max()) if live.num_steps else 0,
        peak_bytes=peak,
        budget_bytes=budget,
        windows_shrunk=not use_windows,
        host_bytes=sum(host for _, host in slots.values()),
        max_window_steps=max([max(p.fw_window_steps, p.bw_window_steps) for p in params], default=0),
        window_seconds=_window_seconds(params, costs),
        grad_buckets=buckets,
    )


def _bucket_grads(ctx: _PlanContext, params: list[ParamResidency], model) -> tuple[list[ParamResidency], tuple]:
    """The reduced gradients of ``params`` in buckets (:func:`~.grad_sync.bucket_layout`, in the
    order the backward issues them) and ``params`` with each bucket's gradients waited for at
    or after the bucket's launch: after the fewest nodes whose compute covers its all-reduce
    (:meth:`~.grad_sync.GradSyncModel.seconds`), with windows; right at the launch without."""
    from .grad_sync import GradBucket, bucket_layout

    last = ctx.live.num_steps - 1
    reduced = sorted(
        (i for i, p in enumerate(params) if p.grad_to_host_after is not None and p.slot in model.slot_ids),
        key=lambda i: (params[i].grad_to_host_after, i),
    )

    def dtype(p: ParamResidency):
        val = p.placeholder_ref.meta.get("val") if p.placeholder_ref is not None else None
        return getattr(val, "dtype", None)

    layout = bucket_layout([(i, params[i].nbytes, dtype(params[i])) for i in reduced], model.bucket_caps)
    out = list(params)
    buckets = []
    for members in layout:
        nbytes = sum(params[i].nbytes for i in members)
        seconds = model.seconds(nbytes)
        launch = max(params[i].grad_to_host_after for i in members)
        floor = _trail(launch, last - 1, 0, ctx.costs, seconds) if ctx.use_windows else launch
        floor = max(floor, launch)
        for i in members:
            own = params[i].grad_wait_after if params[i].grad_wait_after is not None else launch
            out[i] = replace(params[i], grad_wait_after=max(own, floor))
        buckets.append(
            GradBucket(
                slots=tuple(params[i].slot for i in members),
                nbytes=nbytes,
                launch_after=launch,
                wait_after=min(out[i].grad_wait_after for i in members),
                seconds=seconds,
            )
        )
    return out, tuple(buckets)


@dataclass(frozen=True)
class _PlanContext:
    """What :func:`plan` reads of the pair and its liveness, looked up once."""

    pair: GraphPair
    live: Liveness
    costs: Costs
    mode: str
    host_grad: bool
    use_windows: bool
    fw_placeholders: list[fx.Node]
    buffer_of_node: dict[fx.Node, int]  # a node of either graph -> the buffer it holds
    user_out_buffers: set
    bw_out: list
    first_real: int  # the forward's first non-placeholder step
    bw_first_real: int  # the backward's

    @staticmethod
    def of(pair: GraphPair, live: Liveness, costs: Costs, mode: str, host_grad: bool, use_windows: bool):
        num_fw, last = live.num_fw_steps, live.num_steps - 1
        buffer_of_node: dict[fx.Node, int] = {}
        for b in live.buffers:
            for n in b.holders:
                buffer_of_node[n] = b.id
        user_out_buffers = {
            buffer_of_node.get(n)
            for i, n in enumerate(pair.fw_outputs())
            if i < pair.num_fwd_outputs and isinstance(n, fx.Node)
        }
        bw_out = pair.bw_output_node().args[0]
        return _PlanContext(
            pair=pair,
            live=live,
            costs=costs,
            mode=mode,
            host_grad=host_grad,
            use_windows=use_windows,
            fw_placeholders=list(pair.forward.graph.find_nodes(op="placeholder")),
            buffer_of_node=buffer_of_node,
            user_out_buffers=user_out_buffers,
            bw_out=list(bw_out) if isinstance(bw_out, (tuple, list)) else [bw_out],
            first_real=next((s for s in range(num_fw) if not live.steps[s].is_placeholder), 0),
            bw_first_real=next((s for s in range(num_fw, last + 1) if not live.steps[s].is_placeholder), last),
        )


def _save_views(ctx: _PlanContext, buf: Buffer) -> tuple[list[int], int]:
    """The buffer's save-only forward views (steps) and the latest step of an input of theirs
    that is not one of them (they can move to just after it, not earlier)."""
    live, save_only = ctx.live, ctx.live.save_only_steps
    fw_graph = ctx.pair.forward.graph
    steps = sorted(live.step_at(n) for n in buf.holders if n.graph is fw_graph and live.step_at(n) in save_only)
    own = set(steps)
    floor = -1
    for s in steps:
        for m in live.steps[s].ref.all_input_nodes:
            ms = live.step_at(m)
            if ms not in own:
                floor = max(floor, ms)
    return steps, floor


def _plan_param(ctx: _PlanContext, index: int, slot_id: int) -> ParamResidency | None:
    """The residency of the parameter at forward placeholder ``index`` (``None``: it stays
    resident): its forward fetch and release, its backward fetch and release, and with host
    gradients the copy of its gradient (module docstring)."""
    live, costs, mode = ctx.live, ctx.costs, ctx.mode
    num_fw, last = live.num_fw_steps, live.num_steps - 1
    fw_out_step = num_fw - 1
    ph = ctx.fw_placeholders[index]
    bid = ctx.buffer_of_node.get(ph)
    if bid is None or bid in ctx.user_out_buffers:
        return None
    buf = live.buffers[bid]
    if buf.kind is not BufferKind.PARAMETER:
        return None
    views, views_floor = _save_views(ctx, buf)
    fw_uses = [s for s in buf.use_steps if s < fw_out_step and s not in live.save_only_steps]
    if not fw_uses:
        fw_uses, views = views, []  # only saved: fetched for its views
    bw_uses = [s for s in buf.use_steps if num_fw <= s < last]
    if mode == "activations+params" and not bw_uses:
        # The backward has no handle on it to fetch it back before the step ends (the user's
        # optimizer needs it there): it stays resident.
        return None
    intervals = []
    fw_fetch = fw_release = bw_fetch = bw_release = fw_wait = bw_wait = None
    fw_w = bw_w = 0
    if fw_uses:
        first, lastu = min(fw_uses), max(fw_uses)
        if views:
            lastu = max(lastu, views_floor)
        fw_w = _lead(first, ctx.first_real, buf.size_bytes, costs) if ctx.use_windows else 0
        fw_fetch, fw_release, fw_wait = max(first - fw_w, ctx.first_real), lastu, first
        start = 0 if mode == "activations+params" else fw_fetch
        intervals.append((start, fw_release))
    if bw_uses:
        first = min(bw_uses)
        bw_w = _lead(first, ctx.bw_first_real, buf.size_bytes, costs) if ctx.use_windows else 0
        bw_fetch, bw_wait = max(first - bw_w, ctx.bw_first_real), first
        bw_release = max(bw_uses) if mode == "all" else None
        intervals.append((bw_fetch, bw_release if bw_release is not None else last))
    grad_after, grad_buffer, grad_wait = _plan_grad_to_host(ctx, index, bw_release)
    return ParamResidency(
        slot=slot_id,
        placeholder=ph.name,
        buffer=bid,
        nbytes=buf.size_bytes,
        fw_fetch_before=fw_fetch,
        fw_release_after=fw_release,
        bw_fetch_before=bw_fetch,
        bw_release_after=bw_release,
        fw_window_steps=fw_w,
        bw_window_steps=bw_w,
        grad_to_host_after=grad_after,
        grad_buffer=grad_buffer,
        resident_steps=tuple(intervals),
        fw_wait_before=fw_wait,
        bw_wait_before=bw_wait,
        grad_wait_after=grad_wait,
        fw_save_views=tuple(v for v in views if fw_release is not None and v > fw_release),
        placeholder_ref=ph,
    )


def _plan_grad_to_host(
    ctx: _PlanContext, index: int, bw_release: int | None
) -> tuple[int | None, int | None, int | None]:
    """``(grad_to_host_after, grad_buffer, grad_wait_after)`` of the parameter at forward
    placeholder ``index`` (all ``None`` without host gradients or a gradient node)."""
    live, bw_out = ctx.live, ctx.bw_out
    if not (ctx.host_grad and index < len(bw_out) and isinstance(bw_out[index], fx.Node)):
        return None, None, None
    last = live.num_steps - 1
    g = bw_out[index]
    gstep = live.step_at(g)
    readers = [live.step_at(u) for u in g.users if u.op != "output"]
    # Not before the parameter's last backward reader either: once its gradient is on the host,
    # the CPU optimizer may update the master copy (CPUOptimizer with overlap="backward"), which a
    # later fetch in this backward would read.
    grad_after = max([gstep, *readers] + ([bw_release] if bw_release is not None else []))
    grad_buffer = ctx.buffer_of_node.get(g)
    # The wait (which keeps the gradient alive) after the copy's time of compute; the last step
    # before the backward's output at the latest.
    grad_wait = (
        _trail(grad_after, last - 1, live.buffers[grad_buffer].size_bytes, ctx.costs)
        if ctx.use_windows and grad_buffer is not None
        else grad_after
    )
    return grad_after, grad_buffer, grad_wait


def _predicted_live(live: Liveness, base_live: np.ndarray, params: list[ParamResidency]) -> np.ndarray:
    """Device bytes per step with ``params`` fetched and released as planned (``base_live``
    counts them resident throughout)."""
    diff = np.zeros(live.num_steps + 1, dtype=np.int64)
    for p in params:
        diff[0] -= p.nbytes  # counted resident throughout in base_live
        diff[live.num_steps] += p.nbytes
        for a, b in p.resident_steps:
            diff[a] += p.nbytes
            diff[b + 1] -= p.nbytes
    for gid, wait in _grad_waits(params).items():
        # Freed after its (last) grad_to_host_wait instead of at the backward's end.
        gb = live.buffers[gid]
        diff[wait + 1] -= gb.size_bytes
        diff[live.num_steps] += gb.size_bytes
    return base_live + np.cumsum(diff[:-1])


def _window_seconds(params: list[ParamResidency], costs: Costs) -> float:
    """The largest fetch lead, in the cost model's compute seconds."""
    ce = np.concatenate([[0.0], np.cumsum(costs.step_seconds)])
    window_s = 0.0
    for p in params:
        for before, w in ((p.fw_fetch_before, p.fw_window_steps), (p.bw_fetch_before, p.bw_window_steps)):
            if before is not None and w:
                window_s = max(window_s, float(ce[before + w] - ce[before]))
    return window_s


def apply(
    pair: GraphPair,
    the_plan: ResidencyPlan,
    step_nodes: Sequence[fx.Node],
    rt: int,
    release: bool = True,
    backward: bool = True,
) -> None:
    """Insert the fetch, wait, release and gradient nodes of ``the_plan`` into ``pair``.

    Args:
        pair: the graphs (possibly already rewritten by ``insert_transfers``).
        the_plan: from :func:`plan` on the same graphs before any rewrite.
        step_nodes: the node objects of the joint schedule as it was when planned (forward nodes
            then backward nodes); positions are relative to them, so nodes inserted since (the
            activation transfers) do not shift anything.
        rt: the id of the :class:`~offload_compiler.runtime.transfer.TransferRuntime` whose copy
            streams the parameter copies use.
        release: insert the forward's releases (``False``: fetch only, for a forward-only graph
            with ``"activations+params"``, whose parameters stay resident between steps).
        backward: rewrite the backward graph too.

    Raises:
        ValueError: if a planned parameter (``ParamResidency.placeholder_ref``) is not a
            placeholder of ``pair.forward``.
    """
    bw_out_node = pair.bw_output_node()
    bw_outs = bw_out_node.args[0]
    bw_outs = list(bw_outs) if isinstance(bw_outs, (tuple, list)) else [bw_outs]
    fw_index = {n: i for i, n in enumerate(pair.forward.graph.find_nodes(op="placeholder"))}
    for p in the_plan.params:
        if p.placeholder_ref not in fw_index:
            raise ValueError(
                f"param_residency.apply: parameter {p.placeholder!r} of the plan is not a placeholder of this forward"
            )
    for p in the_plan.params:
        ph = p.placeholder_ref
        if p.fw_fetch_before is not None:
            _insert_forward(pair.forward.graph, p, ph, the_plan.mode, step_nodes, rt, release)
        if not backward:
            continue
        if p.bw_fetch_before is not None or p.grad_to_host_after is not None:
            alias = _backward_alias(pair, ph, p.buffer, step_nodes, the_plan.num_fw_steps)
            if p.bw_fetch_before is not None and alias is not None:
                _insert_backward_fetch(pair.backward.graph, p, alias, step_nodes, rt)
            if p.grad_to_host_after is not None:
                _insert_grad_to_host(pair.backward.graph, p, bw_outs[fw_index[ph]], step_nodes, rt)
                bw_outs[fw_index[ph]] = None
    if backward and any(p.grad_to_host_after is not None for p in the_plan.params):
        bw_out_node.args = (tuple(bw_outs),)
    for gm in (pair.forward, pair.backward) if backward else (pair.forward,):
        gm.graph.lint()
        gm.recompile()


def _insert(graph: fx.Graph, where: fx.Node, before: bool, op, args, note: str, copy=None) -> fx.Node:
    """A ``op(*args)`` node before or after ``where``, with its note and, for a copy, its
    ``(direction, bytes)``."""
    ctx = graph.inserting_before(where) if before else graph.inserting_after(where)
    with ctx:
        n = graph.call_function(op, args)
    n.meta[NOTE_KEY] = note
    n.meta["val"] = None  # returns nothing (later analyses, e.g. the dump's simulation, read it)
    if copy is not None:
        n.meta[PARAM_COPY_KEY] = copy
    return n


def _insert_forward(
    fg: fx.Graph, p: ParamResidency, ph: fx.Node, mode: str, step_nodes: Sequence[fx.Node], rt: int, release: bool
) -> None:
    """The forward's fetch and its wait, the save-only views moved before the release, and the
    release (with ``release``)."""
    write_back = mode == "activations+params"
    mib = p.nbytes / 2**20
    wait_at = p.fw_wait_before if p.fw_wait_before is not None else p.fw_fetch_before
    # With "activations+params" the parameter is resident when the forward starts: its fetch
    # issues nothing (unless a forward without backward released it).
    copies = mode == "all"
    _insert(
        fg,
        step_nodes[p.fw_fetch_before],
        True,
        PARAM_FETCH,
        (ph, p.slot, rt),
        f"fetch parameter {p.placeholder} ({mib:.2f} MiB): H2D issued, "
        f"{_nodes(wait_at - p.fw_fetch_before)} ahead of its first reader",
        ("h2d", p.nbytes) if copies else None,
    )
    _insert(fg, step_nodes[wait_at], True, PARAM_FETCH_WAIT, (ph, p.slot, rt), f"H2D of parameter {p.placeholder} done")
    if not release:
        return
    # The views that exist only to be saved go right before the release (they read no data; run
    # after it they would view a released storage).
    anchor = step_nodes[p.fw_release_after]
    for s in p.fw_save_views:
        anchor.append(step_nodes[s])
        anchor = step_nodes[s]
    _insert(
        fg,
        anchor,
        False,
        PARAM_RELEASE,
        (ph, p.slot, write_back, rt),
        f"release parameter {p.placeholder}" + (" (D2H write-back to its master first, exposed)" if write_back else ""),
        ("d2h", p.nbytes) if write_back else None,
    )


def _insert_backward_fetch(
    bg: fx.Graph, p: ParamResidency, alias: fx.Node, step_nodes: Sequence[fx.Node], rt: int
) -> None:
    """The backward's fetch of the parameter (through the saved view ``alias``), its wait and,
    with ``"all"``, its release."""
    mib = p.nbytes / 2**20
    wait_at = p.bw_wait_before if p.bw_wait_before is not None else p.bw_fetch_before
    _insert(
        bg,
        step_nodes[p.bw_fetch_before],
        True,
        PARAM_FETCH,
        (alias, p.slot, rt),
        f"fetch parameter {p.placeholder} for the backward ({mib:.2f} MiB): H2D issued, "
        f"{_nodes(wait_at - p.bw_fetch_before)} ahead of its first reader",
        ("h2d", p.nbytes),
    )
    _insert(
        bg, step_nodes[wait_at], True, PARAM_FETCH_WAIT, (alias, p.slot, rt), f"H2D of parameter {p.placeholder} done"
    )
    if p.bw_release_after is not None:
        _insert(
            bg,
            step_nodes[p.bw_release_after],
            False,
            PARAM_RELEASE,
            (alias, p.slot, False, rt),
            f"release parameter {p.placeholder}",
        )


def _insert_grad_to_host(bg: fx.Graph, p: ParamResidency, g: fx.Node, step_nodes: Sequence[fx.Node], rt: int) -> None:
    """The copy of the parameter's gradient ``g`` to the host and its wait (the caller replaces
    ``g`` in the backward's output by ``None``)."""
    issue = _insert(
        bg,
        step_nodes[p.grad_to_host_after],
        False,
        GRAD_TO_HOST,
        (g, p.slot, rt),
        f"gradient of {p.placeholder} to host: D2H issued",
        ("d2h", p.nbytes),
    )
    wait_after = p.grad_wait_after if p.grad_wait_after is not None else p.grad_to_host_after
    _insert(
        bg,
        issue if wait_after <= p.grad_to_host_after else step_nodes[wait_after],
        False,
        GRAD_TO_HOST_WAIT,
        (g, p.slot, rt),
        f"D2H of the gradient of {p.placeholder} done; the device gradient is freed after this",
    )


def _nodes(k: int) -> str:
    return f"{k} node" if k == 1 else f"{k} nodes"


def _backward_alias(pair: GraphPair, fw_placeholder: fx.Node, buffer: int, step_nodes, num_fw: int) -> fx.Node | None:
    """A backward placeholder that receives a saved view of ``fw_placeholder``'s storage."""
    from torch.multiprocessing.reductions import StorageWeakRef

    target = StorageWeakRef(fw_placeholder.meta["val"].untyped_storage())
    for link in pair.saved_links():
        ph = link.bw_placeholder
        val = link.fw_node.meta.get("val")
        if ph is None or val is None:
            continue
        if StorageWeakRef(val.untyped_storage()) == target:
            return ph
    return None


def activation_view(live: Liveness, the_plan: ResidencyPlan) -> Liveness:
    """``live`` as the activation planner should see it under ``the_plan``: each offloaded
    parameter's buffer counts only over its resident intervals (one synthetic buffer per
    interval, ids after the real ones), and a gradient sent to host stops counting after its
    ``grad_to_host_wait`` (its copy reads it until there). Saved-activation buffers keep their
    ids, so a plan made on the view applies to the real graphs."""
    buffers = list(live.buffers)
    extra: list[Buffer] = []
    next_id = len(buffers)
    for p in the_plan.params:
        b = buffers[p.buffer]
        buffers[p.buffer] = replace(b, on_device=False)
        for first, last in p.resident_steps:
            extra.append(
                replace(
                    b,
                    id=next_id,
                    def_step=first,
                    last_step=last,
                    use_steps=(),
                    nodes=(),
                    holders=(),
                    saved=(),
                    source_step=None,
                )
            )
            next_id += 1
    for gid, wait in _grad_waits(the_plan.params).items():
        g = buffers[gid]
        buffers[gid] = replace(g, last_step=max(g.def_step, wait))
    return replace(live, buffers=tuple(buffers + extra))


def copy_tasks(the_plan: ResidencyPlan, costs: Costs, first_id: int = 0) -> list:
    """The simulator's copy tasks of ``the_plan`` (ids from ``first_id``), at the positions the
    rewritten graphs issue and wait for them (positions as in :mod:`.simulate`: ``p`` is the gap
    before step ``p``):

    * per fetch that copies (every backward fetch; forward fetches with ``"all"``), an H2D copy
      issued at the ``param_fetch`` (the working window ahead) and waited for at the
      ``param_fetch_wait`` right before the first reader;
    * per write-back (``"activations+params"``), a D2H copy issued and waited for where the
      storage is freed (exposed);
    * per gradient sent to host, a D2H copy issued after the node that makes it (or the
      parameter's last backward reader) and waited for at its ``grad_to_host_wait``;
    * under DDP (:attr:`ResidencyPlan.grad_buckets`), per bucket an all-reduce on its own
      ``"allreduce"`` channel, issued after its last gradient and waited for at its first
      gradient's wait; a reduced gradient's D2H copy is issued and waited for at its wait, after
      the all-reduce.
    """
    return _copy_tasks(the_plan, costs, first_id)[0]


def _copy_tasks(the_plan: ResidencyPlan, costs: Costs, first_id: int) -> tuple[list, dict[int, int]]:
    """:func:`copy_tasks` and, per parameter (its placeholder's name), the id of its gradient's copy.

    Under DDP (:attr:`ResidencyPlan.grad_buckets`) each bucket's all-reduce is a task of the
    ``"allreduce"`` channel, issued after the bucket's last gradient and waited for at its first
    gradient's wait; a reduced gradient's copy to the host is issued and waited for at its own
    wait, after its bucket's all-reduce (``after``), as ``trinity::grad_reduce_wait`` does."""
    from .simulate import CopyTask

    tasks = []
    grad_copy: dict[int, int] = {}

    def add(direction, nbytes, issue, wait, after=()):
        task = costs.copy_task(first_id + len(tasks), direction, nbytes, issue, wait)
        tasks.append(replace(task, after=tuple(after)) if after else task)

    allreduce_of: dict[int, int] = {}  # slot -> its bucket's all-reduce task id
    for b in the_plan.grad_buckets:
        tid = first_id + len(tasks)
        tasks.append(CopyTask(tid, "allreduce", b.seconds, b.launch_after + 1, b.wait_after + 1))
        allreduce_of.update((slot, tid) for slot in b.slots)
    for p in the_plan.params:
        if p.fw_fetch_before is not None and the_plan.mode == "all":
            wait = p.fw_wait_before if p.fw_wait_before is not None else p.fw_fetch_before
            add("h2d", p.nbytes, p.fw_fetch_before, wait)
        if p.fw_release_after is not None and the_plan.mode == "activations+params":
            add("d2h", p.nbytes, p.fw_release_after + 1, p.fw_release_after + 1)
        if p.bw_fetch_before is not None:
            wait = p.bw_wait_before if p.bw_wait_before is not None else p.bw_fetch_before
            add("h2d", p.nbytes, p.bw_fetch_before, wait)
        if p.grad_to_host_after is not None:
            wait = p.grad_wait_after if p.grad_wait_after is not None else p.grad_to_host_after
            if p.slot in allreduce_of:
                add("d2h", p.nbytes, wait + 1, wait + 1, (allreduce_of[p.slot],))
            else:
                add("d2h", p.nbytes, p.grad_to_host_after + 1, wait + 1)
            grad_copy[p.placeholder] = tasks[-1].id
    return tasks, grad_copy


def update_tasks(
    the_plan: ResidencyPlan,
    update,
    grad_copy: Mapping[int, int] | None = None,
    device_param_bytes: int = 0,
    first_id: int = 0,
) -> list:
    """The simulator's optimizer-update tasks (:class:`~.simulate.UpdateTask`) for ``the_plan``
    (``"all"``) under ``update`` (a :class:`~.cost_model.HostUpdate`):

    * the offloaded parameters in the order the forward fetches them, in chunks of at least
      ``update.chunk_bytes`` (as ``CPUOptimizer`` makes them from ``model.parameters()``); each
      chunk's task lasts :func:`~.cost_model.host_update_seconds` of its bytes and tensors, becomes ready at
      ``step()`` (position ``num_steps``) or, with ``overlap="backward"``, where its last
      gradient's copy is issued, starts after its gradients' copies (``grad_copy``: placeholder
      name -> copy id) and is waited for at the chunk's first forward fetch of the next step;
    * ``device_param_bytes`` of parameters the plan keeps on the device: one task on the compute
      stream at ``step()``.

    With ``update.on_compute`` (the host is the device) every task is on the compute stream.
    """
    from .cost_model import host_update_seconds
    from .simulate import UpdateTask

    if the_plan.mode != "all":
        return []
    grad_copy = grad_copy or {}
    n = the_plan.num_steps
    tasks: list = []

    def first_fetch(p: ParamResidency) -> int:
        for pos in (p.fw_fetch_before, p.bw_fetch_before):
            if pos is not None:
                return pos
        return n

    order = sorted(the_plan.params, key=first_fetch)
    chunks: list[list[ParamResidency]] = [[]]
    size = 0
    for p in order:
        chunks[-1].append(p)
        size += p.nbytes
        if size >= update.chunk_bytes:
            chunks.append([])
            size = 0
    for chunk in (c for c in chunks if c):
        after = tuple(grad_copy[p.placeholder] for p in chunk if p.placeholder in grad_copy)
        ready = n
        if update.overlap == "backward" and all(p.grad_to_host_after is not None for p in chunk):
            ready = max(p.grad_to_host_after + 1 for p in chunk)
        tasks.append(
            UpdateTask(
                first_id + len(tasks),
                host_update_seconds(sum(p.nbytes for p in chunk), update, num_tensors=len(chunk)),
                ready,
                after,
                min(first_fetch(p) for p in chunk),
                update.on_compute,
            )
        )
    if device_param_bytes:
        seconds = host_update_seconds(device_param_bytes, update, on_device=True)
        tasks.append(UpdateTask(first_id + len(tasks), seconds, n, (), None, True))
    return tasks


def step_timeline(
    the_plan: ResidencyPlan, costs: Costs, activation_tasks: Sequence = (), update=None, device_param_bytes: int = 0
):
    """The simulated step with parameter residency: ``activation_tasks`` (the activation plan's
    copies, ids from 0), the parameter copies of ``the_plan`` and, with ``update`` (a
    :class:`~.cost_model.HostUpdate`), the optimizer update (:func:`update_tasks`): the steady
    state of a training loop (:func:`~.simulate.simulate`). The one function the backend's
    report and the ``plan`` command predict a step with."""
    from .simulate import simulate

    copies, grad_copy = _copy_tasks(the_plan, costs, len(activation_tasks))
    updates = update_tasks(the_plan, update, grad_copy, device_param_bytes) if update is not None else []
    return simulate(costs.step_seconds, list(activation_tasks) + copies, updates)


def plan_with_activations(
    pair: GraphPair,
    live: Liveness,
    costs: Costs,
    slots: Mapping[int, tuple[int, int]],
    mode: str,
    budget: int | None,
    min_offload_bytes: int,
    host_grad: bool | None = None,
    grad_sync=None,
):
    """The residency of the parameters in ``slots`` and the activation plan on device memory with
    that residency, under ``budget``: working windows first; if they make the budget unreachable,
    both again without windows. ``grad_sync``: :func:`plan`'s (DDP's buckets). The one loop the planning spine
    (:func:`offload_compiler.pipeline.plan_pair`) and :mod:`.optimizer_split` plan with.

    Returns:
        ``(residency plan, activation view of live, activation plan, seconds in this planner)``.
    """
    import time

    from . import plan_window

    plan_s = 0.0
    for use_windows in (True, False):
        t0 = time.perf_counter()
        residency = plan(pair, live, costs, slots, mode, live.live_bytes(), budget, host_grad, use_windows, grad_sync)
        view = activation_view(live, residency)
        plan_s += time.perf_counter() - t0
        act = plan_window.plan(view, costs, budget, min_offload_bytes)
        if act.feasible or not residency.max_window_steps:
            break
    return residency, view, act, plan_s
