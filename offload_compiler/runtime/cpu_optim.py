"""The optimizer step on the CPU for ``offload="all"``: :class:`CPUOptimizer`.

It wraps one of PyTorch's own optimizers (``torch.optim.AdamW``, ``SGD``, ...; their own CPU
implementations, ``foreach`` or not as the keyword arguments say; no update rule is written here)
around the parameters' **host master copies**: the inner optimizer's parameters are
``nn.Parameter`` views of the masters, their ``.grad`` the host gradients the backward wrote, so
the optimizer state (``exp_avg``, ...) lives in host memory too.

Overlap: ``step()`` splits the parameters into chunks (in the order given, which for a model's
``parameters()`` is the order the forward uses them), marks every parameter "update pending"
and hands the chunks to a worker thread, then returns. The next forward's ``param_fetch`` of a
parameter waits for that parameter's update only, so the first layers' forward runs while the
last chunks are still being updated. ``state_dict()``, ``load_state_dict()``,
``clip_grad_norm_()``, :func:`~offload_compiler.runtime.model_state.materialized` and
``synchronize()`` wait for the worker.

With ``overlap="backward"`` the update of a chunk starts during the backward, as soon as every
gradient of the chunk is final (in the ``accumulation_steps``-th backward since ``zero_grad``): it
overlaps the backward of the layers still to come. The graph sends a parameter's gradient to the
host only after the parameter's last backward reader, so no later part of the backward reads a
parameter being updated. Clipping by total norm needs every gradient first, so it is refused in
that mode. ``step()`` then starts what is left (chunks with a parameter that got no gradient).
Backwards are counted per step (a backward is one autograd graph task,
``torch._C._current_graph_task_id()``, that delivers a gradient to this optimizer):

* fewer than ``accumulation_steps`` backwards before ``step()``: ``step()`` raises, and no update
  of the step has started (early starts happen only in the ``accumulation_steps``-th backward);
* more: the first extra backward raises as soon as its first gradient arrives; if updates of the
  step had already started (after the ``accumulation_steps``-th backward), the error says that
  this step's update is wrong;
* updates start early only after one ``step()`` has confirmed the count (the first step of a run
  never starts early), and never for a chunk with a parameter that received two gradients in one
  backward (a parameter read by two compiled graphs, e.g. across a graph break): such chunks
  start at ``step()``. If that only shows after the chunk started, the backward raises.

Ownership: each parameter given to a ``CPUOptimizer`` points back to it (a weak reference in the
attribute ``_trinity_optimizer``); the host gradient's arrival is reported to the owner, and a
forward refuses to run when a parameter has host gradients but no owner (a plain ``torch.optim``
optimizer would silently update nothing; see ``ParamSlot.check_owner``).

``load_state_dict()`` works before the first ``step()`` (restoring a checkpoint before training,
even before the model is compiled): the state is kept and loaded into the inner optimizers, by
their own ``load_state_dict``, when they are built at the first ``step()``.

Compiles on other threads: ``torch.compiler.is_compiling()`` is one process-wide flag, set for the
whole of a Dynamo compile (``torch.compiler._compile_session_context``), and ``torch.optim`` reads
it (``optimizer._get_value`` keeps Adam's step count a tensor, so the bias corrections are
computed in float32 instead of Python floats, changing the update's last bits). The worker
therefore holds Dynamo's compile lock (``torch._dynamo.convert_frame.compile_lock``, inside which
that flag is set) while it runs an update: a compile on the main thread waits for the chunk in
progress, and a chunk waits for a compile in progress.

The graph's parameter copies are asynchronous (see :mod:`.model_state`): before updating a
chunk, the worker waits on the host for the copies that still read its masters (a fetch issued
by the graph) and for its gradients' copies to the host (adding staged gradients); ``step()``
itself does not wait for them. ``synchronize()`` (so ``clip_grad_norm_``, ``state_dict``) and
``host_grads()`` complete the gradient copies first.

The user's loop stays ``loss.backward(); opt.step(); opt.zero_grad()``; gradient clipping is
``opt.clip_grad_norm_(max_norm)`` (``torch.nn.utils.clip_grad_norm_`` on the host gradients:
with ``"all"`` the device parameters' ``.grad`` stays ``None``).

**Which implementation runs** (:attr:`CPUOptimizer.implementation` says it, per optimizer):

* ``implementation="exact"`` (the default): the inner optimizers get exactly the keyword
  arguments given, so the bits are those of ``optimizer_class(params, **options)`` on the same
  tensors. When neither ``fused`` nor ``foreach`` is given, torch runs its for-loop on CPU
  tensors; for the element-wise optimizers (:data:`ELEMENTWISE`: every update of an element
  reads only that element of the parameter, gradient and state) each parameter is then handed to
  torch as flat pieces of about ``piece_bytes`` (default 512 KiB, sized for a core's L2 cache), so
  the for-loop's ten or so passes over each piece hit the cache instead of main memory (2-2.5x
  faster measured here) with the same bits (each element's arithmetic is unchanged; tested for
  every class of :data:`ELEMENTWISE`). ``state_dict()`` shows the state per parameter, shaped
  like it (the pieces' state tensors are views into it).
* ``implementation="fastest"``: ``fused=True`` where torch has a fused CPU kernel for the class
  (:func:`fused_cpu_kernel`: Adam, AdamW, SGD and Adagrad in torch 2.13; one pass over memory,
  near the host's bandwidth floor), else the for-loop in pieces for :data:`ELEMENTWISE` classes
  (faster than ``foreach`` on CPU tensors, where torch's ``foreach`` is a loop of the same
  kernels that walks all of memory once per operation), else torch's own default for the class.
  The bits are those of ``optimizer_class(params, **options, fused=True)`` where that is chosen.
  Giving ``fused`` or ``foreach`` too is refused (``ValueError``).
* Other optimizers (matrix optimizers such as ``torch.optim.Muon``, ``Adafactor``, any
  subclass) are never split: each parameter reaches torch whole, with its own shape (Muon's
  orthogonalisation needs the matrix).

**Refused at construction** (:func:`unsupported_reason`, ``ValueError`` naming the class and why):
optimizers whose ``step`` requires a closure (``torch.optim.LBFGS``: its line search re-evaluates
the loss and gradients several times per step, while ``CPUOptimizer.step()`` updates from the
gradients of the backward already run, on a worker thread, and takes no closure), and
``torch.optim.SparseAdam`` (it accepts only sparse gradients; the host gradients the graph writes
are dense, and its ``step`` raises "SparseAdam does not support dense gradients"). Every other
``torch.optim`` class of torch 2.13 runs (tests/test_cpu_optim.py steps each one).

Threads: the update runs on torch's intra-op threads of the worker: ``num_threads`` of them
(default: ``torch.get_num_threads()`` when the optimizer is built, i.e. every core unless the
process asked for fewer). torch's fused kernels and element-wise ops split each tensor over them.

Parameters kept on the device (``optimizer_on_device``, :mod:`offload_compiler.passes.optimizer_split`):
the plan may keep some parameters resident on the device with their gradients and optimizer
state, as in ZeRO-Offload++'s Twin-Flow. Such a parameter carries ``_trinity_on_device`` and no
host slot; ``step()`` updates it with the same torch optimizer class and options on the device
(after handing the host chunks to the worker), so its bits are torch's on that device.

**Sharded across ranks** (``shard_group``, ZeRO-Offload's partitioned CPU optimizer): under data
parallelism every rank holds the same host gradients (averaged across ranks, by DDP or by
trinity's gradient sync with ``offload="all"``), so every rank's update would be the same work on
the same bits. With ``shard_group`` each rank updates only its own share of the parameters and
holds optimizer state only for them; the share is a contiguous run of the host parameters (in
the order given), balanced by bytes (:func:`shard_owners`: rank ``r`` of ``N`` owns the
parameters whose middle byte falls in the ``r``-th ``N``-th of all their bytes). After its own
chunks, the worker **exchanges** the updated master copies: for every host parameter, in order,
``torch.distributed.broadcast`` of its master's bytes from its owner over ``shard_group``
(asynchronous, then waited in order); a parameter owned by another rank is "update pending"
until its broadcast arrived, so the next forward's fetch of it waits for exactly that. The
owner's update is the unsharded update (same class, options, chunking rule over its share), and
the others receive its bytes, so every rank ends the step with the bits of the unsharded
optimizer. Host memory per rank: the optimizer state of ``1/N`` of the parameters (AdamW: 8 of
its 16 bytes per fp32 parameter); the masters and host gradients stay whole on every rank.

The exchange's collectives run on the worker thread while the main thread trains, so
``shard_group`` must be a group of its own, used by nothing else (``dist.new_group(backend=
"gloo")``; the default group, which DDP uses, is refused), and have a CPU backend (gloo): the
masters are host tensors. ``state_dict()`` holds this rank's share of the state (as a ZeRO
checkpoint does, one per rank); ``load_state_dict()`` takes the entries of this rank's share from
the state given (a full state from an unsharded optimizer over the same parameters loads too). A
rank whose update fails still takes part in the exchange (so the others do not wait for the
group's timeout) and raises at its next ``step()``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from .model_state import ON_DEVICE_ATTR, OWNER_ATTR, ParamSlot, slot_of

__all__ = [
    "CPUOptimizer",
    "ELEMENTWISE",
    "fused_cpu_kernel",
    "set_thread_num_threads",
    "shard_owners",
    "unsupported_reason",
]

log = logging.getLogger("offload_compiler")

# Optimizers whose update of an element reads only that element of the parameter, gradient and
# per-parameter state (plus scalars such as the step count): splitting a parameter into pieces
# changes no bit (tests/test_cpu_optim.py checks every one). Exact classes only: a subclass may
# change the rule.
ELEMENTWISE = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adamax,
        torch.optim.Adagrad,
        torch.optim.RMSprop,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.ASGD,
        torch.optim.Rprop,
        torch.optim.Adadelta,
    }
)
_PIECE_ALIGN = 64  # elements: pieces start and end on multiples (vector width, cache line)


def _stop_worker(work: queue.Queue, thread: threading.Thread) -> None:
    """Stop a :class:`CPUOptimizer`'s worker once the work queued before is done, and wait for it
    (not from the worker itself: a finalizer may run there)."""
    work.put(None)
    if thread is not threading.current_thread():
        thread.join()


@functools.cache
def fused_cpu_kernel(optimizer_class: type) -> bool:
    """Whether torch has a fused kernel of ``optimizer_class`` for CPU float32 tensors (probed
    once: a 2-element parameter with a zero gradient stepped with ``fused=True``)."""
    try:
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad = torch.zeros(2)
        optimizer_class([p], fused=True).step()
    except Exception:  # noqa: BLE001  (no `fused` argument, or no CPU kernel)
        return False
    return True


def _class_name(cls: type) -> str:
    """``torch.optim.LBFGS`` for torch's own classes, else ``module.QualName``."""
    mod = cls.__module__
    if mod.startswith("torch.optim") and getattr(torch.optim, cls.__name__, None) is cls:
        mod = "torch.optim"
    return f"{mod}.{cls.__qualname__}"


def unsupported_reason(optimizer_class: type) -> str | None:
    """Why :class:`CPUOptimizer` cannot run ``optimizer_class``, in words, or ``None`` when it can.

    Refused (subclasses too):

    * a ``step`` whose ``closure`` argument has no default, i.e. that requires a closure
      (``torch.optim.LBFGS``: its line search calls the closure to re-evaluate the loss and the
      gradients several times per step). ``CPUOptimizer.step()`` runs the update on a worker
      thread from the host gradients of the backward already run and takes no closure; LBFGS's
      update also couples every parameter (one flat search direction), so it could not be
      chunked or sharded either.
    * ``torch.optim.SparseAdam``: it accepts only sparse gradients (its ``step`` raises
      "SparseAdam does not support dense gradients"), and the host gradients that
      ``offload="all"`` writes are dense tensors.
    """
    import inspect

    if not isinstance(optimizer_class, type):
        return f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}"
    try:
        closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature (a C extension): nothing to tell from it
        closure = None
    if closure is not None and closure.default is inspect.Parameter.empty:
        return (
            "its step() requires a closure (e.g. LBFGS's line search re-evaluates the loss and gradients "
            "several times per step), but CPUOptimizer.step() updates from the gradients of the backward "
            "already run, on a worker thread, and takes no closure; use a first-order optimizer such as "
            "torch.optim.AdamW"
        )
    if issubclass(optimizer_class, torch.optim.SparseAdam):
        return (
            "it accepts only sparse gradients, and the host gradients written by offload='all' are dense "
            "(torch raises 'SparseAdam does not support dense gradients'); use torch.optim.Adam"
        )
    return None


def set_thread_num_threads(n: int) -> None:
    """Make the calling thread's torch ops use ``n`` intra-op threads, leaving every other thread's
    setting as it was.

    ``torch.set_num_threads`` sets the calling thread's OpenMP team size and a process-wide value
    that threads starting later initialise theirs from; the latter is put back from a short-lived
    thread (which changes only its own team), so other threads are unaffected.
    """
    if torch.get_num_threads() == n:
        return
    before = [None]
    probe = threading.Thread(target=lambda: before.__setitem__(0, torch.get_num_threads()))
    probe.start()
    probe.join()
    torch.set_num_threads(n)
    if before[0] is not None and before[0] != n:
        restore = threading.Thread(target=torch.set_num_threads, args=(before[0],))
        restore.start()
        restore.join()


def _probe_defaults(optimizer_class: type, defaults: dict, first: torch.Tensor) -> dict:
    """Every option of ``optimizer_class`` with its defaults filled in (as torch's own
    ``param_groups`` hold them), from a tiny probe parameter with the first parameter's number of
    dimensions (matrix optimizers such as Muon refuse anything not 2-D).

    Raises:
        the optimizer's own error (e.g. ``ValueError`` for a bad learning rate) when every probe fails.
    """
    shapes = [(2,) * first.dim(), (1,)] if first.dim() else [(), (1,)]
    error: BaseException | None = None
    for shape in shapes:
        try:
            probe = optimizer_class([torch.nn.Parameter(torch.zeros(shape, dtype=first.dtype))], **defaults)
        except Exception as exc:  # noqa: BLE001  (re-raised below when no probe works)
            error = error or exc
            continue
        return {k: v for k, v in probe.param_groups[0].items() if k != "params"}
    assert error is not None
    raise error


def _dynamo_compile_lock():
    """Dynamo's compile lock (held while ``torch.compiler.is_compiling()`` is set by a compile),
    or a no-op context when this torch has none."""
    try:
        from torch._dynamo.convert_frame import compile_lock
    except Exception:  # noqa: BLE001  (another torch)
        return contextlib.nullcontext()
    return compile_lock


def _ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ``11th``, ``21st`` ..."""
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def shard_owners(nbytes: list[int], world: int) -> list[int]:
    """The owning rank of each parameter when ``world`` ranks share the update: contiguous runs
    in the order given, balanced by bytes; parameter ``i`` (``nbytes[i]`` bytes, starting at byte
    ``b_i`` of the concatenation) goes to rank ``floor((b_i + nbytes[i] / 2) * world / total)``.

    Raises:
        ValueError: for ``world < 1`` or a negative size.
    """
    if world < 1:
        raise ValueError(f"shard_owners: world must be >= 1, got {world}")
    if any(n < 0 for n in nbytes):
        raise ValueError("shard_owners: parameter sizes must be >= 0 bytes")
    total = sum(nbytes)
    owners, start = [], 0
    for n in nbytes:
        owners.append(min(world - 1, int((start + n / 2) * world // total)) if total else 0)
        start += n
    return owners


class _Exchange:
    """The worker's exchange task of one sharded step: ``entries`` are ``(slot, source)`` for every
    host parameter in order, ``source`` the global rank of its owner; ``foreign`` the slot ids this
    rank receives."""

    def __init__(self, entries: list[tuple[ParamSlot, int]], foreign: set[int]):
        self.entries = entries
        self.foreign = foreign
        self.slots = [s for s, _ in entries if s.id in foreign]


class _Chunk:
    def __init__(self, indices: list[int], slots: list[ParamSlot], optimizer: torch.optim.Optimizer, groups: list[int]):
        self.indices = indices  # global parameter indices, in the inner optimizer's order
        self.slots = slots
        self.optimizer = optimizer
        self.groups = groups  # user group index of each inner group
        self.shadows: list[torch.nn.Parameter] = []  # per parameter: a Parameter over its master
        # per parameter: what the inner optimizer holds for it: [shadow], or flat pieces of the
        # master (see ELEMENTWISE), with their (start, end) element ranges
        self.pieces: list[list[torch.nn.Parameter]] = []
        self.ranges: list[list[tuple[int, int]]] = []
        self.full_state: dict[int, dict[str, torch.Tensor]] = {}  # j -> entry -> flat state (pieces' views)
        self.needs: set[int] = set()  # slot ids whose gradient the chunk's update waits for
        self.done: set[int] = set()  # of those, the ones final for this step
        self.enqueued = False  # handed to the worker this step
        self.early = True  # overlap="backward": may start during the backward (no doubled gradients)

    def set_grads(self) -> None:
        """Point the inner parameters' ``.grad`` at the host gradients (``None`` where there is
        none this step)."""
        for s, shadow, pieces, ranges in zip(self.slots, self.shadows, self.pieces, self.ranges):
            g = s.grad if s.grad is not None and s.grad_valid else None
            shadow.grad = g
            if len(pieces) > 1 or pieces[0] is not shadow:
                flat = g.view(-1) if g is not None else None
                for piece, (a, b) in zip(pieces, ranges):
                    piece.grad = flat[a:b] if flat is not None else None


class CPUOptimizer:
    """A PyTorch optimizer stepping host master copies on a worker thread.

    Args:
        params: the parameters (an iterable of ``nn.Parameter``) or parameter groups (dicts with
            ``"params"`` and per-group options), as for any torch optimizer. Every parameter must
            be offloaded with ``offload="all"`` (compile the model with it first, or run one step)
            by the time ``step()`` is first called.
        optimizer_class: a ``torch.optim.Optimizer`` subclass (default ``torch.optim.AdamW``).
        chunk_bytes: parameters are updated in chunks of about this many bytes (default 16 MiB);
            smaller chunks let the next forward start earlier.
        overlap: ``"forward"`` (updates start at ``step()`` and overlap the next forward) or
            ``"backward"`` (updates start during the last backward of the step; no clipping).
        accumulation_steps: with ``overlap="backward"``, backwards per optimizer step (gradient
            accumulation micro-steps); a step with another number of backwards raises (see the
            module docstring).
        implementation: ``"exact"`` (the bits of ``optimizer_class(params, **options)``) or
            ``"fastest"`` (torch's fused CPU kernel where there is one); see the module docstring.
        piece_bytes: with torch's for-loop on an element-wise optimizer, each parameter is handed
            to torch in flat pieces of about this many bytes (rounded to 64 elements); default
            512 KiB.
        num_threads: intra-op threads of the update (default ``torch.get_num_threads()``).
        shard_group: a ``torch.distributed`` process group (gloo, used by nothing else) across
            whose ranks the update and the optimizer state are partitioned (see "Sharded across
            ranks" in the module docstring); ``None`` (the default): every rank updates every
            parameter.
        **defaults: the optimizer's options (``lr``, ``betas``, ``weight_decay``, ``foreach``...).

    Attributes:
        implementation: which path runs, in words (e.g. ``"fused (torch's fused CPU kernel)"``).
        shard_rank, shard_world: this rank and the ranks of ``shard_group`` (0 and 1 unsharded).
        exchange_seconds: wall seconds of the latest step's exchange of master copies on the
            worker (sharded; from its first broadcast until its last arrived), 0.0 before.

    Raises:
        ValueError: for an empty parameter list, a closure passed to ``step``, a non-positive
            ``chunk_bytes``, ``piece_bytes``, ``num_threads`` or ``accumulation_steps``, an unknown
            ``overlap`` or ``implementation``, ``implementation="fastest"`` with ``fused`` or
            ``foreach`` given, a ``shard_group`` without an initialized process group, that is
            the default group, or that has no CPU (gloo) backend; for an optimizer class that
            cannot run here (a ``step`` that requires a closure, such as ``torch.optim.LBFGS``;
            ``torch.optim.SparseAdam``), sharded or not: see :func:`unsupported_reason`; the
            optimizer's own error for options it refuses.
        RuntimeError: from the first ``step()`` of a sharded optimizer whose ranks hold different
            parameters (count, shapes or dtypes).
        RuntimeError: with ``overlap="backward"``, from ``step()`` or the backward, when the
            number of backwards per step is not ``accumulation_steps``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        chunk_bytes: int = 16 * 2**20,
        overlap: str = "forward",
        accumulation_steps: int = 1,
        implementation: str = "exact",
        piece_bytes: int = 512 * 1024,
        num_threads: int | None = None,
        shard_group: Any = None,
        **defaults: Any,
    ):
        if chunk_bytes <= 0:
            raise ValueError(f"CPUOptimizer: chunk_bytes must be positive, got {chunk_bytes}")
        if overlap not in ("forward", "backward"):
            raise ValueError(f"CPUOptimizer: overlap must be 'forward' or 'backward', got {overlap!r}")
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"CPUOptimizer: accumulation_steps must be a positive int, got {accumulation_steps!r}")
        if implementation not in ("exact", "fastest"):
            raise ValueError(f"CPUOptimizer: implementation must be 'exact' or 'fastest', got {implementation!r}")
        if isinstance(piece_bytes, bool) or not isinstance(piece_bytes, int) or piece_bytes <= 0:
            raise ValueError(f"CPUOptimizer: piece_bytes must be a positive int, got {piece_bytes!r}")
        if num_threads is not None and (
            isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1
        ):
            raise ValueError(f"CPUOptimizer: num_threads must be None or an int >= 1, got {num_threads!r}")
        why = unsupported_reason(optimizer_class)
        if why is not None:
            name = _class_name(optimizer_class) if isinstance(optimizer_class, type) else repr(optimizer_class)
            raise ValueError(f"CPUOptimizer: {name} cannot be used: {why}")
        self._init_shard(shard_group)
        self.overlap = overlap
        self.accumulation_steps = accumulation_steps
        self.num_threads = int(num_threads) if num_threads is not None else torch.get_num_threads()
        self.piece_bytes = int(piece_bytes)
        params = list(params)
        if not params:
            raise ValueError("CPUOptimizer: got an empty parameter list")
        if not isinstance(params[0], dict):
            params = [{"params": params}]
        params = [
            {**g, "params": [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])}
            for g in params
        ]
        self.optimizer_class = optimizer_class
        self.defaults = dict(defaults)
        self.chunk_bytes = int(chunk_bytes)
        self.implementation_request = implementation
        if implementation == "fastest":
            given = [k for k in ("fused", "foreach") if defaults.get(k) is not None]
            if given:
                raise ValueError(
                    f"CPUOptimizer: implementation='fastest' chooses the implementation itself; drop "
                    f"{' and '.join(repr(k) for k in given)} (or use implementation='exact' to keep them)"
                )
            if fused_cpu_kernel(optimizer_class):
                self.defaults["fused"] = True
        first = next((p for g in params for p in g["params"]), None)
        # Every option of the optimizer, its defaults filled in (as torch's own param_groups hold).
        full_defaults = _probe_defaults(
            optimizer_class, self.defaults, first if isinstance(first, torch.Tensor) else torch.zeros(1)
        )
        self.param_groups: list[dict[str, Any]] = []
        self._params: list[torch.nn.Parameter] = []
        self._group_of: list[int] = []
        seen = set()
        for gi, group in enumerate(params):
            ps = list(group["params"])
            for p in ps:
                if not isinstance(p, torch.Tensor):
                    raise ValueError(f"CPUOptimizer: parameter group {gi} holds {type(p).__name__}, not a tensor")
                if id(p) in seen:
                    raise ValueError("CPUOptimizer: a parameter appears twice")
                seen.add(id(p))
                self._params.append(p)
                self._group_of.append(gi)
            self.param_groups.append({**full_defaults, **{k: v for k, v in group.items() if k != "params"}})
        self.implementation = self._describe_implementation()
        log.info("CPUOptimizer(%s): %s", optimizer_class.__name__, self.implementation)
        self._device_params: list[int] = []  # indices of parameters the plan keeps on the device
        self._device_optimizer: torch.optim.Optimizer | None = None
        self._chunks: list[_Chunk] | None = None
        self._chunk_of: dict[int, _Chunk] = {}
        self._queue: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self._pending = 0
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._compile_lock = _dynamo_compile_lock()
        # A state loaded before the inner optimizers exist (global index -> state), see load_state_dict.
        self._pending_state: dict[int, Any] | None = None
        # overlap="backward" bookkeeping (see the module docstring).
        self._backwards = 0  # backwards that delivered a gradient since the last step()/zero_grad()
        self._task: int | None = None  # autograd graph task of the current backward
        self._seen: set[int] = set()  # slot ids with a gradient in the current backward
        self._doubled: set[int] = set()  # slot ids seen twice in one backward (several graphs)
        self._confirmed = False  # a step() has confirmed accumulation_steps backwards
        me = weakref.ref(self)
        for p in self._params:
            setattr(p, OWNER_ATTR, me)

    # ------------------------------------------------------------------ setup
    def _init_shard(self, group: Any) -> None:
        """Validate ``shard_group`` and record this rank's place in it (see the class docstring)."""
        self.shard_group = group
        self.shard_rank, self.shard_world = 0, 1
        self._owner: dict[int, int] = {}  # parameter index -> owning rank in shard_group (host parameters)
        self._host_slots: list[tuple[int, ParamSlot]] = []  # (parameter index, slot) of the host parameters
        self._shard_checked = False
        self.exchange_seconds = 0.0  # wall seconds of the latest exchange on the worker (sharded)
        if group is None:
            return
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("CPUOptimizer: shard_group needs an initialized torch.distributed process group")
        if group is dist.group.WORLD or group == dist.distributed_c10d._get_default_group():
            raise ValueError(
                "CPUOptimizer: shard_group must be a group of its own (the exchange runs on the optimizer's "
                "worker thread, beside the collectives of DDP and of the training loop on the default group); "
                "create one with torch.distributed.new_group(backend='gloo')"
            )
        backend = str(dist.get_backend(group))
        if "gloo" not in backend:
            raise ValueError(
                f"CPUOptimizer: shard_group has backend {backend!r}; the exchanged master copies are host "
                "tensors, which need a CPU backend: torch.distributed.new_group(backend='gloo')"
            )
        self.shard_rank = dist.get_rank(group)
        self.shard_world = dist.get_world_size(group)

    def _check_shard(self, slots: list[ParamSlot | None]) -> None:
        """Once, in the first ``step()`` (which every rank calls): the ranks of ``shard_group``
        hold the same host parameters (sizes and dtypes, in order).

        Raises:
            RuntimeError: naming the ranks whose parameters differ from rank 0's.
        """
        if self.shard_group is None or self._shard_checked:
            return
        import torch.distributed as dist

        mine = [(i, s.nbytes, str(s.master.dtype), tuple(s.master.shape)) for i, s in enumerate(slots) if s is not None]
        every: list = [None] * self.shard_world
        dist.all_gather_object(every, mine, group=self.shard_group)
        differ = [r for r, theirs in enumerate(every) if theirs != every[0]]
        if differ:
            raise RuntimeError(
                f"CPUOptimizer(shard_group=...): ranks {differ} of the shard group hold other parameters than rank 0 "
                f"({len(mine)} host parameters here); every rank must give the same parameters in the same order"
            )
        self._shard_checked = True

    @property
    def shard(self) -> str:
        """Who updates what, in words: ``"unsharded"``, or this rank's share (known from the first
        ``step()``)."""
        if self.shard_group is None:
            return "unsharded"
        if not self._owner:
            return f"sharded across {self.shard_world} ranks (shares assigned at the first step())"
        mine = [i for i, r in self._owner.items() if r == self.shard_rank]
        slots = {s.id: s for c in self._chunks or () for s in c.slots}
        nbytes = sum(s.nbytes for s in slots.values())
        return (
            f"sharded: rank {self.shard_rank} of {self.shard_world} updates {len(mine)} of {len(self._owner)} "
            f"host parameters ({nbytes} bytes) and holds their optimizer state"
        )

    def _describe_implementation(self) -> str:
        """Which path runs (see the module docstring), in words."""
        cls, d = self.optimizer_class, self.defaults
        name = cls.__name__
        if d.get("fused"):
            return f"fused: torch's fused CPU kernel of {name}"
        if d.get("foreach"):
            return f"foreach: torch's foreach implementation of {name}"
        has_fused = fused_cpu_kernel(cls)
        tail = (
            "" if self.implementation_request == "exact" or has_fused else f" (torch has no fused CPU kernel of {name})"
        )
        if self._splits():
            return f"for-loop over cache-sized pieces of {self.piece_bytes} bytes: torch's for-loop of {name}" + tail
        why = "each parameter whole, with its own shape" if cls not in ELEMENTWISE else "each parameter whole"
        return f"torch's default implementation of {name} for CPU tensors, {why}" + tail

    def _splits(self) -> bool:
        """Whether parameters are handed to torch in flat pieces (torch's for-loop of an
        element-wise optimizer)."""
        d = self.defaults
        return self.optimizer_class in ELEMENTWISE and not d.get("fused") and not d.get("foreach")

    def _pieces(self, master: torch.Tensor, requires_grad: bool) -> tuple[list[torch.nn.Parameter], list]:
        """The inner parameters of one master copy: flat pieces (contiguous masters larger than a
        piece, when :meth:`_splits`), else one Parameter over the master itself."""
        per = max(_PIECE_ALIGN, self.piece_bytes // max(1, master.element_size()) // _PIECE_ALIGN * _PIECE_ALIGN)
        n = master.numel()
        if not self._splits() or n <= per or not master.is_contiguous():
            return [], []
        flat = master.view(-1)
        ranges = [(a, min(a + per, n)) for a in range(0, n, per)]
        return [torch.nn.Parameter(flat[a:b], requires_grad=requires_grad) for a, b in ranges], ranges

    def _slots(self) -> list[ParamSlot | None]:
        """The slot of every parameter (``None`` for a parameter the plan keeps on the device).

        Raises:
            ValueError: for a parameter that is neither offloaded with ``offload="all"`` nor kept
                on the device by the plan.
        """
        slots: list[ParamSlot | None] = []
        for i, p in enumerate(self._params):
            slot = slot_of(p)
            if slot is None and getattr(p, ON_DEVICE_ATTR, False):
                slots.append(None)
                continue
            if slot is not None and not slot.keep_resident and p.requires_grad and slot.grad is None:
                raise ValueError(
                    f"CPUOptimizer: {slot.label()} is offloaded with offload='all' but no compiled backward "
                    "has a gradient for it: the compiled forward does not use it (an unused parameter: pass only "
                    "the parameters the model uses, or set requires_grad=False on it), or no compiled step has "
                    "run yet (run one before opt.step())"
                )
            if slot is None or slot.keep_resident:
                what = f"parameter {i} of the optimizer (shape {list(p.shape)}, {p.dtype})"
                raise ValueError(
                    f"CPUOptimizer: {slot.label() if slot is not None else what} is not offloaded with "
                    "offload='all'"
                    + (
                        " (it is offloaded with offload='activations+params': use your own optimizer)"
                        if slot is not None
                        else ": compile its model with torch.compile(model, backend='trinity', options={'offload': "
                        "'all'}) and run a step before opt.step(). If its model is compiled so, the compiled "
                        "forward never reads it (Dynamo gives trinity only the parameters the forward reads): leave "
                        "it out of CPUOptimizer, or set requires_grad=False on it and leave it out"
                    )
                )
            slots.append(slot)
        return slots

    def _build(self) -> list[_Chunk]:
        if self._chunks is not None:
            return self._chunks
        slots = self._slots()
        host = [i for i, s in enumerate(slots) if s is not None]
        owners = shard_owners([slots[i].nbytes for i in host], self.shard_world)
        self._owner = dict(zip(host, owners))
        self._host_slots = [(i, slots[i]) for i in host]
        chunks: list[_Chunk] = []
        current: list[int] = []
        size = 0

        def close():
            if not current:
                return
            by_group: dict[int, list[int]] = {}
            for i in current:
                by_group.setdefault(self._group_of[i], []).append(i)
            order = [i for g in sorted(by_group) for i in by_group[g]]
            shadows, pieces, ranges = {}, {}, {}
            for i in order:
                s = slots[i]
                rg = self._params[i].requires_grad
                shadows[i] = torch.nn.Parameter(s.master, requires_grad=rg)
                pieces[i], ranges[i] = self._pieces(s.master, rg)
                if not pieces[i]:
                    pieces[i], ranges[i] = [shadows[i]], [(0, s.master.numel())]
            inner_groups = [
                {"params": [q for i in by_group[g] for q in pieces[i]], **self.param_groups[g]}
                for g in sorted(by_group)
            ]
            opt = self.optimizer_class(inner_groups)
            chunk = _Chunk(order, [slots[i] for i in order], opt, sorted(by_group))
            chunk.shadows = [shadows[i] for i in order]
            chunk.pieces = [pieces[i] for i in order]
            chunk.ranges = [ranges[i] for i in order]
            chunk.needs = {slots[i].id for i in order if self._params[i].requires_grad}
            chunk.early = not (chunk.needs & self._doubled)
            chunks.append(chunk)

        for i, s in enumerate(slots):
            if s is None or self._owner[i] != self.shard_rank:
                continue
            current.append(i)
            size += s.nbytes
            if size >= self.chunk_bytes:
                close()
                current, size = [], 0
        close()
        self._device_params = [i for i, s in enumerate(slots) if s is None]
        if self._device_params:
            by_group = {}
            for i in self._device_params:
                by_group.setdefault(self._group_of[i], []).append(self._params[i])
            self._device_optimizer = self.optimizer_class(
                [{"params": ps, **self.param_groups[g]} for g, ps in sorted(by_group.items())]
            )
            self._device_groups = sorted(by_group)
        self._chunks = chunks
        self._chunk_of = {s.id: c for c in chunks for s in c.slots}
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self._load_into_chunks(state)
        return chunks

    def _grad_arrived(self, slot: ParamSlot) -> None:
        """A gradient of ``slot`` reached the host (called by ``ParamSlot.add_grad`` on the
        owner). With ``overlap="backward"``: count the backwards of this step, refuse one too
        many, and once every gradient of a chunk is final for this step (it arrived in the
        ``accumulation_steps``-th backward), start the chunk's update. The graph sends a gradient
        to the host only after the parameter's last backward reader, so nothing later in this
        backward reads the value being updated.

        Raises:
            RuntimeError: on the first gradient of a backward beyond ``accumulation_steps``, or
                a second gradient of a parameter in one backward after its update started.
        """
        if self.overlap != "backward":
            return
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self._task = task
            self._backwards += 1
            self._seen = set()
        k = self.accumulation_steps
        if self._backwards > k:
            started = [c for c in self._chunks or () if c.enqueued]
            raise RuntimeError(
                f"CPUOptimizer(overlap='backward', accumulation_steps={k}): a {_ordinal(self._backwards)} "
                f"backward since the last step()/zero_grad() sent a gradient of {slot.label()}; set "
                "accumulation_steps to the number of backwards per optimizer step. "
                + (
                    f"The updates of {len(started)} of {len(self._chunks)} parameter chunks already started "
                    f"after the {_ordinal(k)} backward, with the gradients of {k} backwards: this step's update "
                    "is wrong (restore a checkpoint)."
                    if started
                    else "No update of this step has started."
                )
            )
        chunk = self._chunk_of.get(slot.id)
        if slot.id in self._seen:
            # A second gradient in one backward: the parameter is read by several compiled graphs.
            self._doubled.add(slot.id)
            if chunk is not None:
                if chunk.enqueued:
                    raise RuntimeError(
                        f"CPUOptimizer(overlap='backward'): {slot.label()} received two gradients in one backward "
                        "(it is read by several compiled graphs, e.g. across a graph break) after its update for "
                        "this step had started with the first one: this step's update is wrong. Use "
                        "overlap='forward' (or avoid the graph break)."
                    )
                chunk.early = False
            return
        self._seen.add(slot.id)
        if not self._confirmed or self._backwards != k or chunk is None or chunk.enqueued or not chunk.early:
            return
        chunk.done.add(slot.id)
        if chunk.needs <= chunk.done:
            self._enqueue([chunk])

    def _enqueue(self, chunks: list[_Chunk]) -> None:
        for chunk in chunks:
            for inner_group, g in zip(chunk.optimizer.param_groups, chunk.groups):
                for k, v in self.param_groups[g].items():
                    inner_group[k] = v
            for s in chunk.slots:
                # The device copy (if any, e.g. after an exception mid-step) never changes
                # inside a step with offload="all"; the master is the current value.
                s.release(write_back=False)
                s.ready.clear()
            chunk.set_grads()
            chunk.enqueued = True
        self._ensure_worker()
        with self._cv:
            self._pending += len(chunks)
        for chunk in chunks:
            self._queue.put((self, chunk))  # the queue keeps the optimizer alive while work is pending

    def _enqueue_exchange(self) -> None:
        """Hand the worker this step's exchange (after this rank's chunks, in queue order): the
        parameters other ranks own are "update pending" until their broadcast arrives."""
        import torch.distributed as dist

        foreign = set()
        entries = []
        for i, s in self._host_slots:
            owner = self._owner[i]
            entries.append((s, dist.get_global_rank(self.shard_group, owner)))
            if owner != self.shard_rank:
                s.release(write_back=False)  # the device copy, if any, is stale after the exchange
                s.ready.clear()
                foreign.add(s.id)
        self._ensure_worker()
        with self._cv:
            self._pending += 1
        self._queue.put((self, _Exchange(entries, foreign)))

    def _exchange(self, task: _Exchange) -> None:
        """On the worker: broadcast every host master from its owner, in order (see the module
        docstring); a received parameter is ready once its broadcast is waited for."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        works = []
        for s, src in task.entries:
            if s.id in task.foreign:
                s.sync_master_copies()  # no fetch copy may still read a master being overwritten
            works.append((s, dist.broadcast(s.master_bytes, src=src, group=self.shard_group, async_op=True)))
        for s, work in works:
            work.wait()
            if s.id in task.foreign:
                s.ready.set()
        self.exchange_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------------ the worker
    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            # The thread holds the optimizer only while it has work for it (the queued items), so
            # a dropped CPUOptimizer is collected once idle (its parameters then have no owner);
            # the finalizer then stops the thread.
            self._worker = threading.Thread(
                target=CPUOptimizer._run,
                args=(self._queue, self.num_threads),
                name="trinity-cpu-optimizer",
                daemon=True,
            )
            self._worker.start()
            # Also at interpreter exit (weakref.finalize's atexit): the thread finishes the
            # updates queued and stops before the interpreter tears down, instead of being
            # killed inside a torch kernel (a fresh-user trial: a script ending right after
            # opt.step() aborted with "terminate called without an active exception", rc 134).
            weakref.finalize(self, _stop_worker, self._queue, self._worker)

    @staticmethod
    def _run(work: queue.Queue, num_threads: int) -> None:
        set_thread_num_threads(num_threads)  # this thread's intra-op threads only
        while True:
            item = work.get()
            if item is None:
                return
            self, chunk = item
            if isinstance(chunk, _Exchange):
                try:
                    self._exchange(chunk)  # also after a failed update: the other ranks wait for it
                except BaseException as exc:  # noqa: BLE001  (re-raised on the main thread)
                    self._error = self._error or exc
                    for s in chunk.slots:
                        s.error = exc
                finally:
                    for s in chunk.slots:
                        s.ready.set()
                    with self._cv:
                        self._pending -= 1
                        self._cv.notify_all()
                del self, chunk, item
                continue
            try:
                if self._error is None:
                    for s in chunk.slots:
                        # The graph's copies are asynchronous: no update of a master an H2D copy
                        # still reads, nor from a host gradient whose D2H copy (or staged add) is
                        # not done.
                        s.sync_master_copies()
                        s.finish_grad()
                    # No Dynamo compile may run meanwhile: it sets the process-wide
                    # is_compiling() flag that torch.optim reads (module docstring).
                    with self._compile_lock:
                        chunk.optimizer.step()
            except BaseException as exc:  # noqa: BLE001  (re-raised on the main thread)
                self._error = exc
                for s in chunk.slots:
                    s.error = exc
            finally:
                for s in chunk.slots:
                    s.ready.set()
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()
            del self, chunk, item

    def synchronize(self) -> None:
        """Wait until every update handed to the worker is done and every gradient copied to
        the host by the graphs is complete in the host gradients.

        Raises:
            RuntimeError: when an update failed (the worker's exception is the cause).
        """
        self._wait_worker()
        self._finish_grads()

    def _wait_worker(self) -> None:
        """Wait for the updates handed to the worker; re-raise the first failure."""
        with self._cv:
            while self._pending:
                self._cv.wait()
        if self._error is not None:
            raise RuntimeError("CPUOptimizer: an update on the worker thread failed") from self._error

    def _finish_grads(self) -> None:
        """Complete the gradient copies in flight (and staged adds) of every parameter."""
        for p in self._params:
            s = slot_of(p)
            if s is not None and s.grad is not None:
                s.finish_grad()

    # ------------------------------------------------------------------ the optimizer interface
    def step(self, closure=None) -> None:
        """Start the update of every parameter that has a host gradient; returns at once.

        Raises:
            ValueError: when ``closure`` is given (not supported).
            RuntimeError: when an earlier update failed; with ``overlap="backward"``, when the
                number of backwards since the last step is neither 0 nor ``accumulation_steps``
                (nothing of this step is updated then, unless the error says otherwise).
        """
        if closure is not None:
            raise ValueError("CPUOptimizer.step: closures are not supported")
        self._refuse_device_grads()
        if self.overlap == "forward" or self._chunks is None:
            # Not synchronize(): the worker waits for the gradient copies itself, so step()
            # does not block on the backward's last copies.
            self._wait_worker()
        elif self._error is not None:
            raise RuntimeError("CPUOptimizer: an update on the worker thread failed") from self._error
        if self.overlap == "backward":
            k, n = self.accumulation_steps, self._backwards
            if n not in (0, k):
                started = sum(c.enqueued for c in self._chunks or ())
                raise RuntimeError(
                    f"CPUOptimizer(overlap='backward', accumulation_steps={k}).step(): {n} backward"
                    f"{'s' if n != 1 else ''} since the last step()/zero_grad(), not {k}; set accumulation_steps to "
                    "the number of backwards per optimizer step. "
                    + (
                        f"The updates of {started} parameter chunks already started: this step's update is wrong."
                        if started
                        else "No update of this step was started."
                    )
                )
            if n == k:
                self._confirmed = True
            self._backwards, self._task = 0, None
        chunks = self._build()
        self._check_shard(self._slots())
        # overlap="backward": the chunks whose gradients were complete already started.
        self._enqueue([c for c in chunks if not c.enqueued])
        if self.shard_group is not None:
            self._enqueue_exchange()
        for c in chunks:
            c.enqueued = False
            c.done.clear()
        if self._device_optimizer is not None:
            # Parameters the plan keeps on the device: the same optimizer, there (on a GPU its
            # kernels are queued on the compute stream; the host does not wait for them).
            for inner_group, g in zip(self._device_optimizer.param_groups, self._device_groups):
                for k, v in self.param_groups[g].items():
                    inner_group[k] = v
            self._device_optimizer.step()

    def _refuse_device_grads(self) -> None:
        """Refuse a device ``.grad`` on a parameter offloaded with ``offload="all"``: no compiled
        backward writes one (its gradients go to the host, and DDP's idle buckets are dropped),
        and ``materialized()`` hands an uncompiled backward's to the host on exit. One left there
        comes from an uncompiled backward outside ``materialized()`` (before the model's first
        compiled call, where the parameters are not offloaded yet); stepping without it would
        train silently wrong.

        Raises:
            RuntimeError: naming the first such parameter.
        """
        for p in self._params:
            if p.grad is None:
                continue
            s = slot_of(p)
            if s is not None and not s.keep_resident:
                raise RuntimeError(
                    f"CPUOptimizer.step: {s.label()} has a device .grad that no compiled backward wrote (an "
                    "uncompiled backward outside `with offload_compiler.materialized(model.parameters()):`, or "
                    "before the model's first compiled call); with offload='all' the update reads the host "
                    "gradients only, so it would not be used. Run uncompiled steps inside materialized(), and "
                    "not before the first compiled step; or zero_grad() to drop it."
                )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the host gradients: the next backward writes them afresh (``set_to_none``) or
        they are zeroed (``set_to_none=False``, after the pending updates)."""
        for c in self._chunks or ():
            c.done.clear()
        self._backwards, self._task = 0, None
        for p in self._params:
            s = slot_of(p)
            if s is None and getattr(p, ON_DEVICE_ATTR, False) and p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()
                continue
            if s is None or s.grad is None:
                continue
            s.num_grads = 0
            s.handover_replaces = False  # a flag left by a backward that failed before its hand-over
            if set_to_none and p.grad is not None:
                # The device tensor of zeros DDP's reducer writes for a parameter whose gradient
                # went to the host (offload="all" under DDP): freed like any .grad.
                p.grad = None
            if set_to_none:
                # A gradient copy still in flight is completed by the next gradient's copy or
                # the worker, before anything reads the host gradient again.
                s.grad_valid = False
            else:
                s.wait_ready()
                s.finish_grad()  # no copy into the host gradient may land after the zeroing
                s.grad.zero_()
                s.grad_valid = True

    def host_grads(self) -> list[torch.Tensor | None]:
        """The gradients, in parameter order: the host gradient of an offloaded parameter, the
        device ``.grad`` of one the plan keeps on the device; ``None`` where there is none this
        step."""
        self._finish_grads()
        out = []
        for p in self._params:
            s = slot_of(p)
            if s is None and getattr(p, ON_DEVICE_ATTR, False):
                out.append(p.grad)
                continue
            out.append(s.grad if s is not None and s.grad is not None and s.grad_valid else None)
        return out

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, **kwargs: Any) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the host gradients, in parameter order (as
        over ``model.parameters()`` in eager); returns the total norm.

        Raises:
            ValueError: with ``overlap="backward"`` (updates start before every gradient is known).
        """
        if self.overlap == "backward":
            raise ValueError(
                "CPUOptimizer.clip_grad_norm_: with overlap='backward' updates start during the backward, before "
                "the total norm is known; use overlap='forward' to clip"
            )
        self.synchronize()
        chunks = self._build()
        shadow_of = {i: self._params[i] for i in self._device_params}
        for chunk in chunks:
            chunk.set_grads()
            shadow_of.update(zip(chunk.indices, chunk.shadows))
        for i, s in self._host_slots:
            if i not in shadow_of:  # owned by another rank (sharded): its averaged gradient is here too
                shadow = shadow_of[i] = torch.nn.Parameter(s.master, requires_grad=self._params[i].requires_grad)
                shadow.grad = s.grad if s.grad is not None and s.grad_valid else None
        return torch.nn.utils.clip_grad_norm_(
            [shadow_of[i] for i in range(len(self._params))], max_norm, norm_type=norm_type, **kwargs
        )

    def _can_build(self) -> bool:
        """Whether every parameter is offloaded already (the inner optimizers can be built)."""
        try:
            self._slots()
        except ValueError:
            return False
        return True

    def state_dict(self) -> dict[str, Any]:
        """The state in ``torch.optim.Optimizer.state_dict()`` form (parameters numbered in the
        order given), after pending updates; tensors are the live host state. Before the first
        ``step()`` (the inner optimizers not built yet): the state loaded by
        :meth:`load_state_dict`, if any, else no state."""
        self.synchronize()
        state: dict[int, Any] = {}
        if self._chunks is None and not self._can_build():
            state = dict(self._pending_state or {})
        else:
            for chunk in self._build():
                for j, i in enumerate(chunk.indices):
                    st = self._param_state(chunk, j)
                    if st:
                        state[i] = st
            if self._device_optimizer is not None:
                sd = self._device_optimizer.state_dict()
                order = [i for g in self._device_groups for i in self._device_params if self._group_of[i] == g]
                for local, st in sd["state"].items():
                    state[order[local]] = st
        groups = []
        for g, group in enumerate(self.param_groups):
            groups.append({**group, "params": [i for i, gi in enumerate(self._group_of) if gi == g]})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (of an optimizer over the same parameters, in the same order).

        Works at any time, also right after construction (before the model is compiled or the
        first ``step()``): the group options apply at once, and the per-parameter state is loaded
        into the inner optimizers (by their own ``load_state_dict``, so with their casts) as
        soon as they exist; until then :meth:`state_dict` returns it.

        Raises:
            ValueError: when the number of groups or parameters differs, or the state names a
                parameter index the groups do not hold.
        """
        self.synchronize()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or [len(g["params"]) for g in groups] != [
            self._group_of.count(g) for g in range(len(self.param_groups))
        ]:
            raise ValueError("CPUOptimizer.load_state_dict: the parameter groups do not match this optimizer's")
        position = {}
        for g, group in enumerate(groups):
            for k, i in enumerate(group["params"]):
                position[i] = [j for j, gi in enumerate(self._group_of) if gi == g][k]
        state = {}
        for saved_i, st in state_dict["state"].items():
            if int(saved_i) not in position:
                raise ValueError(
                    f"CPUOptimizer.load_state_dict: the state names parameter {saved_i!r}, which no group holds"
                )
            state[position[int(saved_i)]] = st
        for g, group in enumerate(groups):
            self.param_groups[g] = {k: v for k, v in group.items() if k != "params"}
        if self._chunks is None and not self._can_build():
            self._pending_state = state  # loaded by _build
            return
        self._pending_state = None
        self._build()
        self._load_into_chunks(state)

    def _param_state(self, chunk: _Chunk, j: int) -> dict[str, Any]:
        """The live state of the chunk's ``j``-th parameter, shaped like it. For a parameter held
        in pieces, the element-wise entries (tensors shaped like the piece) are gathered once into
        one tensor per entry, and the pieces' entries become views of it (so later steps update it
        in place); the other entries (the step count and such scalars, equal in every piece) are
        the first piece's."""
        pieces = chunk.pieces[j]
        states = [chunk.optimizer.state.get(q) for q in pieces]
        if not states[0]:
            return {}
        if len(pieces) == 1:
            return states[0]
        full = chunk.full_state.setdefault(j, {})
        shape = chunk.slots[j].master.shape
        n = chunk.slots[j].master.numel()
        out: dict[str, Any] = {}
        for key, v0 in states[0].items():
            if not (isinstance(v0, torch.Tensor) and v0.shape == pieces[0].shape):
                out[key] = v0
                continue
            f = full.get(key)
            if f is None or not all(
                st[key].data_ptr() == f.data_ptr() + a * f.element_size() and st[key].numel() == b - a
                for st, (a, b) in zip(states, chunk.ranges[j])
            ):
                f = torch.empty(n, dtype=v0.dtype)
                for st, (a, b) in zip(states, chunk.ranges[j]):
                    f[a:b].copy_(st[key])
                    st[key] = f[a:b]
                full[key] = f
            out[key] = f.view(shape)
        return out

    def _load_into_chunks(self, state: dict[int, Any]) -> None:
        """Load ``state`` (global parameter index -> state) into the inner optimizers, replacing
        theirs, with ``self.param_groups``' options. A parameter held in pieces gets views of
        its element-wise entries (cast to the parameter's dtype, as torch's own load does) and a
        copy of the others per piece (so that no two pieces share a step count)."""
        for chunk in self._chunks or ():
            local_state: dict[int, Any] = {}
            local = 0
            chunk.full_state = {}
            for j, glob in enumerate(chunk.indices):
                pieces, st = chunk.pieces[j], state.get(glob)
                if st is None:
                    local += len(pieces)
                    continue
                if len(pieces) == 1:
                    local_state[local] = st
                    local += 1
                    continue
                master = chunk.slots[j].master
                flat = {}
                for key, v in st.items():
                    if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(master.shape):
                        f = (v.to(master.dtype) if v.is_floating_point() else v).contiguous().view(-1)
                        flat[key] = f
                chunk.full_state[j] = dict(flat)
                for k, (a, b) in enumerate(chunk.ranges[j]):
                    local_state[local] = {
                        key: flat[key][a:b] if key in flat else (v.clone() if isinstance(v, torch.Tensor) and k else v)
                        for key, v in st.items()
                    }
                    local += 1
            inner_groups = []
            start = 0
            for ig, g in zip(chunk.optimizer.param_groups, chunk.groups):
                n = len(ig["params"])
                inner_groups.append({**self.param_groups[g], "params": list(range(start, start + n))})
                start += n
            chunk.optimizer.load_state_dict({"state": local_state, "param_groups": inner_groups})
        if self._device_optimizer is not None:
            order = [i for g in self._device_groups for i in self._device_params if self._group_of[i] == g]
            inner_groups = []
            start = 0
            for ig, g in zip(self._device_optimizer.param_groups, self._device_groups):
                n = len(ig["params"])
                inner_groups.append({**self.param_groups[g], "params": list(range(start, start + n))})
                start += n
            self._device_optimizer.load_state_dict(
                {"state": {k: state[i] for k, i in enumerate(order) if i in state}, "param_groups": inner_groups}
            )
