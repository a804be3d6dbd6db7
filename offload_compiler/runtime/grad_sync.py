"""Averaging gradients across DDP ranks with ``offload="all"``: :class:`GradSync` and its ops.

With ``offload="all"`` the backward sends each parameter's gradient to host memory
(``trinity::grad_to_host``) and returns ``None`` in its place, so DDP's reducer (whose hooks fire
on the parameters' gradient accumulation) never sees it. Under DDP the backend therefore
replaces those nodes (:mod:`offload_compiler.passes.grad_sync`) by ops that do what DDP's reducer
does with a gradient bucket, per gradient, on the device, before the device-to-host copy:

* ``trinity::grad_sync_mark(int sync) -> ()``, the forward's first node: records whether this
  forward syncs the gradients of its backward. DDP decides that in its forward
  (``require_backward_grad_sync``, turned off by ``no_sync()``; the reducer is prepared in
  ``_post_forward``), and so does this op: the latest forward of the pair decides.
* ``trinity::grad_reduce(Tensor g, int slot, int rt, int sync, bool inplace, int bucket, bool
  launch) -> ()``, where ``grad_to_host`` was: without sync, exactly ``grad_to_host`` (the
  gradient is accumulated on the host, locally). With sync, like DDP's reducer with no
  communication hook (``reducer.cpp``, ``mark_variable_ready_dense``): the bucket entry is the
  accumulated gradient ``grad + g`` (the host gradient accumulated so far, copied to the device,
  when there is one: ``no_sync`` micro-steps, or a step without ``zero_grad``) times
  ``1 / world_size``; it joins bucket ``bucket``. ``launch`` (the bucket's last gradient, chosen
  by :mod:`offload_compiler.passes.grad_sync`): the bucket's entries are all-reduced with ``SUM``
  over DDP's process group in ONE collective, asynchronously, overlapping the rest of the
  backward: ``torch.distributed._coalescing_manager`` over the entries' own tensors (one
  ``ProcessGroup.allreduce_coalesced``; gloo and NCCL both implement it; no flat bucket buffer is
  allocated here), or a plain ``all_reduce`` for a bucket of one. ``inplace``: the graph reads
  ``g`` no more (the pass checked it), so the sum and the scaling are done in ``g`` itself; else
  in a new tensor (one more gradient-sized buffer until the wait).
* ``trinity::grad_reduce_wait(Tensor g, int slot, int rt, int sync) -> ()``, where
  ``grad_to_host_wait`` was: waits for its bucket's all-reduce, sends the averaged gradient to the
  host (replacing the host gradient, which it includes) and waits for that copy. ``g`` stays
  alive until here (keep-alive through the IR). A wait whose bucket has not been launched yet
  (its last gradient not issued; the planner never places one so) launches the entries the bucket
  has so far, and a later entry of that bucket starts a new part: every rank runs the same graph,
  so every rank issues the same collectives in the same order, and nothing deadlocks.

The result equals DDP's: ``(grad + g) * (1 / world_size)`` summed over ranks; the addition
``g + grad`` is the commutative twin of autograd's ``grad += g`` (the same bits), and with two
ranks the sum is the same two-operand addition whatever the bucket layout. Several graphs
producing a gradient of one parameter (a weight read on both sides of a graph break) are
reduced one after the other, each folding in what the host holds: ``R1 + avg(g2)``, the value
DDP gets from accumulating a reduced gradient.

DDP's own reducer still fires its hooks for these parameters (autograd runs their gradient
accumulators with no gradient): without more it would all-reduce its buckets of zeros a second
time. The backend therefore registers :func:`idle_comm_hook` as the DDP module's communication
hook (``DistributedDataParallel.register_comm_hook``; only with ``offload="all"``, where a hook
of the user's is refused): a bucket whose every parameter had its gradient reduced by trinity
since its pair's latest forward is returned as it is, without communicating (as torch's
``noop_hook``; the marks are taken then); any other bucket (a parameter whose gradient reached DDP another way, e.g. the
module run uncompiled) is averaged exactly as DDP's built-in reduction does (``bucket *
(1 / world_size)``, all-reduced with ``SUM``).

Every rank receives every averaged gradient; with
``CPUOptimizer(shard_group=...)`` each rank then updates only its share of the parameters and
broadcasts it (:mod:`.cpu_optim`), else every rank updates every parameter on identical gradients.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import torch
import torch.distributed as dist

from ..ir import ops as _ir_ops  # noqa: F401  (defines the trinity::* schemas first)
from .model_state import get_slot, grad_key
from .transfer import get_runtime

__all__ = ["GradSync", "IdleHookState", "get_grad_sync", "idle_comm_hook", "install_idle_comm_hook"]

_ids = itertools.count(1)
_registry: weakref.WeakValueDictionary[int, GradSync] = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()


class _Launch:
    """One issued all-reduce of a bucket (or of the part of it issued before a wait needed it):
    its work handle, waited for once by the first of its gradients' waits."""

    __slots__ = ("work", "done")

    def __init__(self, work):
        self.work = work
        self.done = False

    def wait(self) -> None:
        if not self.done:
            self.work.wait()
            self.done = True


class GradSync:
    """Gradient averaging of one compiled graph pair under one DDP module.

    Args:
        ddp: the ``DistributedDataParallel`` module whose forward compiled the pair (held weakly;
            its ``process_group`` is used, and its ``require_backward_grad_sync`` read at every
            forward).
        slot_ids: the parameter slots whose gradients DDP reduces (parameters that require a
            gradient and are not in ``ddp.parameters_to_ignore``).

    Attributes:
        world_size: ranks in DDP's process group.
        sync: whether the latest forward asked for synced gradients.
        num_reduced: gradients all-reduced so far (for tests and reports).
        num_collectives: all-reduces issued so far (one per bucket and synced backward).
    """

    def __init__(self, ddp: torch.nn.Module, slot_ids: frozenset[int]):
        self.ddp_ref = weakref.ref(ddp)
        self.group = ddp.process_group
        self.world_size = int(self.group.size())
        self.slot_ids = frozenset(slot_ids)
        self.sync = True
        self.num_reduced = 0
        self.num_collectives = 0
        self.reduced: set[int] = set()  # slots reduced by trinity since the latest forward
        self._pending: dict[int, list[tuple[int, torch.Tensor]]] = {}  # bucket -> entries not launched
        self._bucket_of: dict[int, int] = {}  # slot -> bucket of its pending entry
        self._inflight: dict[int, tuple[_Launch, torch.Tensor]] = {}  # slot -> (its launch, its entry)
        self._lock = threading.Lock()
        with _registry_lock:
            self.id = next(_ids)
            _registry[self.id] = self

    def mark(self) -> None:
        """Record the sync decision of the forward now running (``trinity::grad_sync_mark``)."""
        ddp = self.ddp_ref()
        self.sync = bool(getattr(ddp, "require_backward_grad_sync", True)) if ddp is not None else True
        with self._lock:
            self.reduced.clear()

    def reduce(self, g: torch.Tensor, slot_id: int, runtime, inplace: bool, bucket: int, launch: bool) -> None:
        """``trinity::grad_reduce`` (module docstring)."""
        slot = get_slot(slot_id)
        if not self.sync or slot_id not in self.slot_ids:
            slot.add_grad(g, runtime)
            return
        slot.finish_grad()  # a previous micro-step's copy into the host gradient lands first
        scale = 1.0 / self.world_size
        if slot.grad_valid:
            held = torch.empty_like(g)
            held.copy_(slot.grad)  # host -> device (DDP's bucket holds the accumulated .grad)
            entry = g.add_(held) if inplace else torch.add(g, held)
            del held
            entry.mul_(scale)
        else:
            entry = g.mul_(scale) if inplace else torch.mul(g, scale)
        with self._lock:
            self.reduced.add(slot_id)
            self._pending.setdefault(bucket, []).append((slot_id, entry))
            self._bucket_of[slot_id] = bucket
            if launch:
                self._launch(bucket)

    def _launch(self, bucket: int) -> None:
        """Issue one all-reduce over the pending entries of ``bucket`` (caller holds the lock)."""
        entries = self._pending.pop(bucket, [])
        if not entries:
            return
        tensors = [t for _, t in entries]
        if len(tensors) == 1:
            work = dist.all_reduce(tensors[0], op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        else:
            with dist._coalescing_manager(group=self.group, async_ops=True) as work:
                for t in tensors:
                    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        launched = _Launch(work)
        for slot_id, t in entries:
            self._bucket_of.pop(slot_id, None)
            self._inflight[slot_id] = (launched, t)
        self.num_collectives += 1

    def wait(self, g: torch.Tensor, slot_id: int, runtime) -> None:
        """``trinity::grad_reduce_wait`` (module docstring)."""
        with self._lock:
            if slot_id not in self._inflight and slot_id in self._bucket_of:
                self._launch(self._bucket_of[slot_id])  # its bucket's last gradient has not come yet
            entry = self._inflight.pop(slot_id, None)
        if entry is not None:
            launched, bucket = entry
            launched.wait()
            slot = get_slot(slot_id)
            slot.grad_valid = False  # the host gradient is replaced: the bucket includes it
            slot.add_grad(bucket, runtime)
            self.num_reduced += 1
            del bucket
        runtime.wait_key(grad_key(slot_id))
        runtime.reap_staged()


class IdleHookState:
    """The state of :func:`idle_comm_hook` on one DDP module.

    Attributes:
        ddp_ref: the module (weakly).
        idle_buckets: buckets returned without communication (all their gradients reduced by
            trinity).
        reduced_buckets: buckets averaged by the hook itself, as DDP's built-in reduction.
    """

    def __init__(self, ddp: torch.nn.Module):
        self.ddp_ref = weakref.ref(ddp)
        self.idle_buckets = 0
        self.reduced_buckets = 0

    def __getstate__(self):  # DDP pickles its comm hooks' state with the module
        return {"idle_buckets": self.idle_buckets, "reduced_buckets": self.reduced_buckets}

    def __setstate__(self, state):
        self.ddp_ref = lambda: None
        self.idle_buckets = state["idle_buckets"]
        self.reduced_buckets = state["reduced_buckets"]


def _take_reduced(ddp: torch.nn.Module, slot_ids: list[int]) -> bool:
    """Whether the live :class:`GradSync` objects of ``ddp`` reduced the gradients of all of
    ``slot_ids`` since their pairs' latest forwards; if so the marks are taken (removed), so
    that a later backward that trinity does not reduce (the module run uncompiled) is reduced
    by the hook again."""
    with _registry_lock:
        syncs = [s for s in _registry.values() if s.ddp_ref() is ddp]
    for sync in syncs:
        sync._lock.acquire()
    try:
        done = set().union(*(s.reduced for s in syncs)) if syncs else set()
        if not slot_ids or not all(i in done for i in slot_ids):
            return False
        for sync in syncs:
            sync.reduced.difference_update(slot_ids)
        return True
    finally:
        for sync in syncs:
            sync._lock.release()


def idle_comm_hook(state, bucket):  # unannotated: DDP checks annotations, which are strings here
    """DDP communication hook under ``offload="all"`` (module docstring): ``bucket``'s buffer
    (1-D, the bucket's gradients flattened) returned as it is when trinity reduced every one of
    its parameters' gradients in this backward, else averaged as DDP's built-in reduction does.
    Every rank runs the same graphs, so every rank takes the same branch for a bucket.

    Args:
        state: the module's :class:`IdleHookState` (counts the branches taken).
        bucket: DDP's ``dist.GradBucket``.

    Returns:
        a future of the bucket's averaged 1-D buffer, as every DDP communication hook.
    """
    from .model_state import slot_of

    ddp = state.ddp_ref()
    params = bucket.parameters()
    slots = [slot_of(p) for p in params]
    if ddp is not None and all(s is not None for s in slots) and _take_reduced(ddp, [s.id for s in slots]):
        state.idle_buckets += 1
        _drop_ddp_grads_after_backward(params)
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut
    state.reduced_buckets += 1
    group = ddp.process_group if ddp is not None else None
    buffer = bucket.buffer()
    for s, view in zip(slots, bucket.gradients()):  # views of the buffer, one per parameter
        if s is None:
            continue
        # An uncompiled backward inside materialized() (offload="all"): the gradients of this
        # step's earlier micro-steps are on the host (local ones from no_sync micro-steps, or
        # averaged ones from a synced backward without zero_grad since). DDP's reducer averages
        # grad + g (reducer.cpp, mark_variable_ready_dense), as the compiled path does: the host
        # gradient joins the bucket, and on leaving materialized() the averaged total replaces it.
        s.finish_grad()
        if s.grad is not None and s.grad_valid and s.num_grads > 0:
            view.add_(s.grad.to(view.device))
        s.handover_replaces = True
    buffer.mul_(1.0 / dist.get_world_size(group))  # as reducer.cpp's mul_out by 1 / div_factor
    work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return work.get_future().then(lambda f: f.value()[0])


def _drop_ddp_grads_after_backward(params: list[torch.Tensor]) -> None:
    """Set ``p.grad = None`` for ``params`` once DDP's reducer has written them at the end of
    this backward.

    Their gradients went to host memory through trinity (``offload="all"``); what DDP's reducer
    writes into ``p.grad`` at the end of the backward (``finalize_backward``, a final callback of
    the autograd engine that the reducer queues only when its last bucket is ready, so after this
    hook) is the idle bucket handed back: zeros of the parameters' sizes on the device. Left
    there, they would hold device memory until ``zero_grad`` and let a ``torch.optim`` optimizer
    step the released parameters (their storage freed: a crash in the optimizer's kernels rather
    than trinity's error naming the parameter at the next forward). The engine runs the final
    callbacks in the order queued, callbacks queued by a callback included, so the callback
    queued here queues the one that drops the gradients, which then runs after DDP's."""
    engine = torch.autograd.Variable._execution_engine
    refs = [weakref.ref(p) for p in params]

    def drop() -> None:
        for ref in refs:
            p = ref()
            if p is not None:
                p.grad = None

    engine.queue_callback(lambda: engine.queue_callback(drop))


idle_comm_hook._trinity_hook = True  # distributed.TRINITY_HOOK_ATTR: not a user's hook to refuse


def install_idle_comm_hook(ddp: torch.nn.Module) -> IdleHookState:
    """Register :func:`idle_comm_hook` on ``ddp`` once (a later call returns the same state).

    Raises:
        RuntimeError: from ``register_comm_hook`` when another hook is registered already
            (``offload="all"`` refuses a user's hook before this is called).
    """
    for hook, state in getattr(ddp, "_comm_hooks", ()):
        if hook is idle_comm_hook:
            return state
    state = IdleHookState(ddp)
    ddp.register_comm_hook(state, idle_comm_hook)
    return state


def get_grad_sync(sync_id: int) -> GradSync:
    """The live :class:`GradSync` with this id.

    Raises:
        RuntimeError: when the compiled code that owned it has been freed.
    """
    sync = _registry.get(sync_id)
    if sync is None:
        raise RuntimeError(f"trinity gradient sync {sync_id} no longer exists")
    return sync


def _grad_sync_mark(sync: int) -> None:
    get_grad_sync(sync).mark()


def _grad_reduce(g: torch.Tensor, slot: int, rt: int, sync: int, inplace: bool, bucket: int, launch: bool) -> None:
    get_grad_sync(sync).reduce(g, slot, get_runtime(rt), inplace, bucket, launch)


def _grad_reduce_wait(g: torch.Tensor, slot: int, rt: int, sync: int) -> None:
    get_grad_sync(sync).wait(g, slot, get_runtime(rt))


_lib = torch.library.Library("trinity", "IMPL")
for _name, _fn in (
    ("grad_sync_mark", _grad_sync_mark),
    ("grad_reduce", _grad_reduce),
    ("grad_reduce_wait", _grad_reduce_wait),
):
    _lib.impl(_name, _fn, "CompositeExplicitAutograd")
