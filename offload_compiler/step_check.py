"""The runtime check of the first steps: measure a plan on the machine it runs on, replan if needed.

It joins the planner (liveness, margins, the pipeline) and the runtime (the host pool), so it
lives beside the backend, in neither ``passes/`` nor ``runtime/``.

The plan is made from fake tensors: every buffer's size is exact, but what a kernel allocates
*inside itself* (scratch it frees before returning) is only an estimate, the table
``passes/liveness.py:_WORKSPACE`` measured on one CPU. Other machines run other kernels: a oneDNN
bf16 matmul on an AVX512-BF16/AMX CPU, cuDNN's convolution algorithms, a user's custom op. There
the measured peak can be above a budget the plan met on paper. So the compiled code measures its
first step and checks it against the plan.

What is measured. The pair's forward call and its backward (``CompiledFunctionBackward``,
bracketed by autograd hooks on that node) each run once under ``torch.profiler`` with
``profile_memory`` and ``record_shapes``: the allocator reports every allocation and free with its
address and size (the CPU allocator and CUDA's caching allocator alike, so Inductor's own buffers
are seen too), and every dispatcher op call with its input shapes. From that:

* the **measured peak**: the device storages of the pair's inputs (parameters, the step's
  inputs) when the forward starts, until the step frees them, plus the largest sum of bytes that
  the forward and backward allocated and had not yet freed, host-pool blocks left out (they are
  host memory); what runs between the two calls (the user's code, other graphs) is not counted.
  The trace does not see those storages allocated, and the CPU allocator then reports no free of
  them either: a parameter that ``offload="activations+params"`` releases after its last forward
  reader (and fetches back, an allocation the trace sees, for the backward) stops counting at its
  ``trinity::param_release`` call, whose argument's storage the profiler records
  (:func:`~offload_compiler.runtime.accounting.param_release_call`);
* per op call, its **workspace**: the most it had allocated at once inside the call less what
  it still held at its end (the ``(peak - end)`` of ``bench/workspace_probe.py``), plus what it
  held at its end beyond the outputs the plan gives its node (an output larger than modelled).
  Calls are matched to the plan's nodes by :data:`~offload_compiler.passes.margins.OpKey`; the
  largest over the calls of a key counts;
* for a pair with later graph pairs in its step (a graph break), what the caller still holds of
  their latest outputs when its backward starts (the loss, logits returned with it:
  :meth:`~offload_compiler.step_budget.StepLedger.later_outputs_alive`): the step ledger counts it
  held while the pair runs, and the pair is planned again for it at its next call
  (:meth:`CheckedCompile._later_due`, as for the later pairs' inputs).

The step report (:func:`~offload_compiler.step_budget.step_report`) shows each pair's measured
peak beside its plan, and a step whose measurement is above its budget is not "within budget".

Where the plan's peak with the measured workspace added at every node is above the budget, and
the measured peak is too (``runtime_check="replan"``), the pair is planned again with a
:class:`~offload_compiler.passes.margins.WorkspaceMargins`: liveness counts the measured workspace
at each node of the same op key, in the same per-node accounting as ``liveness._WORKSPACE``, and
the budget stays the bytes the first plan resolved. The new plan's first step is measured again;
at most :data:`MAX_REPLANS` replans. A measured peak above a budget the plan met on paper by bytes
that no op's workspace explains (an allocation the plan does not model: on a CPU with AMX,
oneDNN's bf16 matmuls held 76 KiB outside their calls on the bf16 GPT block) is planned again with
those bytes as a reserve at every node (:attr:`~offload_compiler.passes.margins.WorkspaceMargins.reserve_bytes`),
within the same replan limit; where the reserve makes the budget unreachable the plan stays and
the check warns, as it does once the replans are spent. A measured backward run with
``retain_graph=True`` (the autograd engine's flag for the running backward, read in the backward
node's pre-hook: :func:`_backward_keeps_graph`) is not replanned for such bytes: autograd then keeps
every saved tensor of the graph until the graph is freed, not to its last use in the backward as
the plan counts, which no reserve fixes; the check warns, saying so.

**Runs per step.** The same compiled pair can run several times before its first backward: a
block graph that identical blocks run (FSDP2's per-block compile, ``block.compile()``: ``F1 .. FN
BN .. B1``), or two forwards before one backward. Each forward keeps its run on its
``CompiledFunctionBackward`` node (:class:`_Run`, ended by a hook when its backward runs, gone
with the autograd graph). From the measured forward to its backward (the measuring window; the
pair's further forwards before any backward are its runs in the same step, not a stale
measurement) every forward of the pair records what it has beside it (:func:`observe_reuse`):
the pair's own runs alive in the window (the reuse count N), and the runs of other checked pairs
among the autograd ancestors of its inputs (the same step's earlier pairs, such as the first
block's own graph, whose input needs no gradient) that the step ledger does not count, with their
kept saved activations, inputs and the parameters still allocated. When that is more than the
plan assumed (a :class:`~offload_compiler.step_budget.StepReuse`), or differs from the count
that the compile predicted from the module structure (:func:`~offload_compiler.step_budget.predict_runs`:
fewer runs too), the pair is planned again, by
the same recompile, with it as a planning input: the planner then meets own peak + (N - 1) x kept
+ held <= budget (``earlier_runs`` in :mod:`.passes.plan_window` and :mod:`.passes.plan_recompute`),
and a percentage is of that step's unplanned peak. The measurement itself stays that of the
measured run (the others' memory is the plan's held bytes). A percentage that a module compiled on
its own cannot reach for one run waits for this (``CompileSession.provisional``): it is refused
(or warned about) only when the first step shows no more runs, and for the first block's own
graph only when its planned peak is above the budget of the reused graph's step too.

How a replan takes effect, and why this way. The plan is made inside the partitioner, at compile
time, from Dynamo's graph. Three ways were weighed:

1. *Run every op once on real inputs before planning* (made from the fake values): it needs
   real data for ops whose behaviour depends on it (indices, ``nonzero``, collectives, RNG state,
   custom ops with side effects), it adds device memory and time to every compile of a large
   graph, and with Inductor it measures aten kernels, not the kernels Inductor calls. It also
   never looks at the step that really runs, so a miss elsewhere stays unseen.
2. *Keep the pre-rewrite pair, rewrite it again and swap the forward and backward callables
   inside AOTAutograd*: with Inductor, AOTAutograd holds Inductor's compiled objects (and the
   lazy backward compile) in its own runtime wrappers, with no public way to swap them; and a
   forward of the old plan whose backward has not run yet must still get the old backward.
3. *Compile Dynamo's graph again* (this module): the backend keeps Dynamo's graph module, fake
   copies of its example inputs and the ``TracingContext`` it was compiled under (fake mode and
   shape environment, so dynamic shapes stay symbolic), and at the next call after a measured
   step runs the whole backend again (AOTAutograd, the partitioner with the margins as one more
   planning input, Inductor or FX code) and calls the new compiled function from then on. It is
   the path of the first compile, for both inner compilers and on CUDA; the old compiled
   function (and its transfer runtime) stays alive, so an autograd graph recorded with it still
   runs its own backward. Its cost is one more compile of the pair, once, only where the
   measured workspace breaks the budget.

So the first step of a plan whose measurement breaks the budget is itself above it: the check
finds the miss, it cannot undo it (for a reused block graph too, where the compile could not
predict its runs: the first step then runs the plan made for one run). Not measured: a call while a profiler is already on (measured at a later step
instead), forwards without a backward. Not replanned: parameter offload (``offload`` other than
``"activations"``; measured and reported only, a reused pair warned about). With dynamic shapes the
margins are the bytes measured at the first sizes. A backward that raises on a CUDA device thread
leaves that thread's profiler session open (on the CPU it is closed at the next call).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .passes.margins import OpKey, WorkspaceMargins, op_key
from .runtime.accounting import (
    SMALL_ALLOCATION_BYTES,
    ResidentStorages,
    param_release_call,
    replay_allocations,
    resident_storages,
)
from .runtime.pool import live_pool_blocks

__all__ = ["PlannedSteps", "StepMeasurement", "CheckedCompile", "MAX_REPLANS", "measure_step_enabled"]

log = logging.getLogger(__name__)

MAX_REPLANS = 2
# A forward measured but whose backward never ran (the graph was dropped) is given up after this
# many further calls, and another step is measured; after _ATTEMPTS such steps the check stops.
_PENDING_CALLS = 3
_ATTEMPTS = 3
# Transients below this (bytes) are the allocator's small bookkeeping (a wrapped scalar, a shape
# buffer) and are not margins: one op runs at a time, so leaving them out understates a peak by
# less than this.
MIN_TRANSIENT_BYTES = SMALL_ALLOCATION_BYTES

# Forwards in a row, each after a backward of the pair, that must find fewer gradients held from an
# earlier backward than the plan counts before it is planned again without them
# (CheckedCompile._grads_gone): more than the micro-steps that hold none in an accumulation step.
GRADS_GONE_PHASES = 3

# Training calls in a row under someone else's profiler before the check warns that the first
# step is still unmeasured (CheckedCompile._note_profiled_call).
PROFILED_CALLS_WARN = 3


def measure_step_enabled() -> bool:
    """Whether a measurement can start on this thread now (no profiler is running)."""
    return not torch._C._autograd._profiler_enabled()


@dataclass(frozen=True)
class PlannedSteps:
    """The rewritten pair's accounting per node of the joint schedule, as the plan has it.

    Attributes:
        nodes: ``"forward:name"`` / ``"backward:name"`` per step.
        ops: the op name per step (``"aten::mm"``; ``""`` for nodes that are no dispatcher op).
        keys: the :data:`OpKey` per step (``None`` where there is none).
        base_bytes: device bytes live at each step without op workspace (bytes).
        workspace_bytes: the op workspace the plan counted at each step (table and margins).
        table_workspace_bytes: the workspace the table alone gives each step.
        defined_bytes: device bytes of the buffers each step allocates (its outputs, as planned).
        resident_bytes: the pair's parameters and inputs on the device when the step starts, as
            the plan counts them (bytes; a measurement counts the storages it finds instead).
        peak_bytes: the planned peak (bytes).
        device: the compute device (``"cpu"``, ``"cuda:0"``).
    """

    nodes: tuple[str, ...]
    ops: tuple[str, ...]
    keys: tuple[OpKey | None, ...]
    base_bytes: tuple[int, ...]
    workspace_bytes: tuple[int, ...]
    table_workspace_bytes: tuple[int, ...]
    defined_bytes: tuple[int, ...]
    resident_bytes: int
    peak_bytes: int
    device: str

    @staticmethod
    def of(pair, assume_fusion: bool, margins: WorkspaceMargins | None) -> PlannedSteps:
        """From the rewritten ``pair`` (a :class:`~offload_compiler.graph_pair.GraphPair`),
        before the inner compiler sees it (Inductor changes the graphs in place)."""
        from .passes import liveness

        live = liveness.analyze(pair, assume_fusion=assume_fusion, margins=margins)
        nodes = list(pair.forward.graph.nodes) + list(pair.backward.graph.nodes)
        ws = np.asarray(live.workspace_bytes or [0] * len(nodes), dtype=np.int64)
        base = live.live_bytes() - ws
        keys = tuple(op_key(n) for n in nodes)
        defined = np.zeros(len(nodes), dtype=np.int64)
        for b in live.buffers:
            if b.on_device and not b.fused:
                defined[b.def_step] += b.size_bytes
        # Held before the step starts: the allocator trace does not see them. A parameter that
        # trinity fetches (parameter offload) is not, unless it is resident when the step starts:
        # its fetches are allocations the trace sees.
        resident = sum(
            b.size_bytes
            for b in live.buffers
            if b.on_device
            and b.kind in (liveness.BufferKind.PARAMETER, liveness.BufferKind.INPUT)
            and (not b.resident_steps or b.resident_steps[0][0] <= b.def_step)
        )
        return PlannedSteps(
            nodes=tuple(f"{s.graph}:{s.node}" for s in live.steps),
            ops=tuple(k[0] if k else "" for k in keys),
            keys=keys,
            base_bytes=tuple(int(x) for x in base),
            workspace_bytes=tuple(int(x) for x in ws),
            table_workspace_bytes=tuple(liveness.table_workspace_bytes(n) for n in nodes),
            defined_bytes=tuple(int(x) for x in defined),
            resident_bytes=int(resident),
            peak_bytes=live.peak_bytes,
            device=live.device,
        )


@dataclass(frozen=True)
class StepMeasurement:
    """One measured step of a pair (bytes).

    Attributes:
        peak_bytes: the measured peak (see the module docstring).
        op_workspace: ``(node op key, bytes)``: the measured workspace of the plan's nodes, by
            the nodes' keys (where at least :data:`MIN_TRANSIENT_BYTES`).
        node_margins: ``(node, op, bytes)``: per node, the measured workspace beyond the table's.
        extra_bytes: the most the measured workspace of one node is above what the plan counted there.
        predicted_with_margins_bytes: the measured plan's peak had it counted the measured workspace.
        unexplained_bytes: ``peak_bytes`` less ``predicted_with_margins_bytes`` (0 if below).
        num_allocations / num_ops: allocation events and op calls seen (a check that it worked).
        method: ``"cpu-allocator-trace"`` or ``"cuda-allocator-trace"``.
        retain_graph: whether the measured backward ran with ``retain_graph=True`` (or
            ``create_graph=True``, which implies it): its saved tensors stayed alive to its end
            (``None``: not known, see :func:`_backward_keeps_graph`).
    """

    peak_bytes: int
    op_workspace: tuple[tuple[OpKey, int], ...]
    node_margins: tuple[tuple[str, str, int], ...]
    extra_bytes: int
    predicted_with_margins_bytes: int
    unexplained_bytes: int
    num_allocations: int
    num_ops: int
    method: str
    retain_graph: bool | None = None


# ------------------------------------------------------------------------------ the trace


def _walk(nodes):
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children)


def _input_key(inputs) -> tuple:
    from torch._C._profiler import _TensorMetadata

    out = []

    def add(v):
        if isinstance(v, _TensorMetadata):
            out.append((tuple(int(s) for s in v.sizes), str(v.dtype)))
        elif isinstance(v, (list, tuple)):
            for x in v:
                add(x)

    for v in inputs:
        add(v)
    return tuple(out)


class _Trace:
    """Allocation events and op calls of the sessions (forward, backward) of one step."""

    def __init__(self, device: torch.device, op_names: frozenset[str]):
        self.device = device
        self.op_names = op_names
        self.allocations: list[tuple[int, int, int]] = []  # (time ns, ptr, bytes; < 0: free)
        # Device storages of the pair's inputs when its forward starts (ptr -> bytes; None: as the
        # plan counts them, PlannedSteps.resident_bytes), and the trinity::param_release calls
        # (time ns, ptr) that may free them (analyze).
        self.resident: dict[int, int] | None = None
        self.releases: list[tuple[int, int]] = []
        self.ops: list[tuple[OpKey, int, int]] = []  # (measured key, transient bytes, bytes held at its end)
        self.phases: list[str] = []
        self.valid = True
        self.retain_graph: bool | None = None  # the backward's retain_graph (_backward_keeps_graph)
        # Device bytes of later graph pairs' outputs alive when the backward started (the loss
        # the caller holds: StepLedger.later_outputs_alive; None: not a graph-break pair).
        self.later_outputs: int | None = None
        # Device storages of the one-element gradients the backward receives (a scalar loss's
        # seed, which torch.autograd.backward holds until every backward has run; liveness counts
        # such a tangent through the whole backward), as its pre-hook sees them (ptr -> bytes):
        # allocated before the backward's trace starts and freed after it stops, the trace sees
        # neither (stop() adds both).
        self.tangents: dict[int, int] = {}
        self._open: Any = None
        self._open_thread: int | None = None
        self._cuda_before = 0
        self.cuda_delta = 0

    def start(self, phase: str) -> None:
        os.environ.setdefault("KINETO_LOG_LEVEL", "99")
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True)
        if self.device.type == "cuda":
            self._cuda_before = torch.cuda.memory_allocated(self.device)
        prof.__enter__()
        self._open = (prof, phase)
        self._open_thread = threading.get_ident()

    def stop(self) -> None:
        prof, phase = self._open
        self._open = None
        self._open_thread = None
        prof.__exit__(None, None, None)
        if self.device.type == "cuda":
            self.cuda_delta += torch.cuda.memory_allocated(self.device) - self._cuda_before
        first, first_release = len(self.allocations), len(self.releases)
        self._collect(prof)
        self.phases.append(phase)
        if phase == "backward" and self.tangents:
            # The tangents, alive from before the backward's first event to after its last: one
            # allocation and one free each, at pointers no allocator hands out (negative).
            times = [e[0] for e in self.allocations[first:]] + [t for t, _ in self.releases[first_release:]]
            if times:
                t0, t1 = min(times), max(times)
                for i, nbytes in enumerate(self.tangents.values(), 1):
                    self.allocations += [(t0 - 1, -i, nbytes), (t1 + 1, -i, -nbytes)]

    @property
    def is_open(self) -> bool:
        return self._open is not None

    def _collect(self, prof) -> None:
        from torch._C._profiler import _EventType

        pool = {ptr for ptr, _ in live_pool_blocks()}
        dev = self.device.type

        def alloc_of(node):
            if node.tag != _EventType.Allocation:
                return None
            f = node.extra_fields
            if f.device.type != dev or f.ptr in pool:
                return None
            return (node.start_time_ns, int(f.ptr), int(f.alloc_size))

        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            a = alloc_of(node)
            if a is not None:
                self.allocations.append(a)
                continue
            release = param_release_call(node)
            if release is not None:
                self.releases.append(release)
            if node.tag == _EventType.TorchOp and node.name in self.op_names:
                inner = sorted(a for a in (alloc_of(m) for m in _walk(node.children)) if a is not None)
                self.allocations.extend(inner)
                cur = peak = 0
                for _, _, size in inner:
                    cur += size
                    peak = max(peak, cur)
                transient = peak - max(cur, 0)
                key = (node.name, _input_key(node.extra_fields.inputs))
                self.ops.append((key, int(transient), int(max(cur, 0))))
                continue
            stack.extend(node.children)


def _backward_keeps_graph() -> bool | None:
    """Whether the backward running now (called from a backward hook) was called with
    ``retain_graph=True`` (or ``create_graph=True``, which implies it): autograd then keeps every
    node's saved tensors until the graph is freed instead of freeing them as it goes (AOTAutograd's
    compiled backward reads the same flag, as ``saved_tensors_use_once``). ``None`` where this
    torch does not expose it."""
    try:
        return bool(torch._C._autograd._get_current_graph_task_keep_graph())
    except Exception:  # noqa: BLE001  (the check must never break a backward)
        return None


def analyze(trace: _Trace, planned: PlannedSteps) -> StepMeasurement:
    """The :class:`StepMeasurement` of a finished ``trace`` against the ``planned`` accounting.

    The measured peak is the bytes of ``trace.resident`` (``planned.resident_bytes`` where it is
    ``None``), less those of its storages freed so far (a ``trinity::param_release`` call on one,
    or a free the allocator reports of one), plus the largest sum of the trace's allocations
    alive at once."""
    # ``offload="activations+params"`` releases parameters resident when the forward started
    # after their last forward reader and fetches them back (an allocation the trace sees) for the
    # backward; the CPU allocator does not report the free of a block allocated before the trace,
    # so the release call says it (CUDA's reports it too: counted once).
    replay = replay_allocations(
        [*trace.allocations, *((t, ptr, None) for t, ptr in trace.releases)],
        ResidentStorages(trace.resident or {}),
    )
    peak = replay.peak_bytes
    base = planned.resident_bytes if trace.resident is None else sum(trace.resident.values())
    measured = base + peak
    transient: dict[OpKey, int] = {}
    held: dict[OpKey, int] = {}
    for key, t, h in trace.ops:
        transient[key] = max(transient.get(key, 0), t)
        held[key] = max(held.get(key, 0), h)
    found_t = WorkspaceMargins(tuple(transient.items()))
    found_h = WorkspaceMargins(tuple(held.items()))
    by_node_key: dict[OpKey, int] = {}
    node_margins = []
    with_margins = []
    extra = 0
    for i, key in enumerate(planned.keys):
        got = 0
        if key is not None:
            got = found_t.bytes_for(key) + max(0, found_h.bytes_for(key) - planned.defined_bytes[i])
        if got < MIN_TRANSIENT_BYTES:
            got = 0
        if got:
            by_node_key[key] = max(by_node_key.get(key, 0), got)
        # A few bytes over the table's estimate are rounding, not a margin (MIN_TRANSIENT_BYTES).
        if got - planned.table_workspace_bytes[i] >= MIN_TRANSIENT_BYTES:
            node_margins.append((planned.nodes[i], planned.ops[i], got - planned.table_workspace_bytes[i]))
        if got - planned.workspace_bytes[i] >= MIN_TRANSIENT_BYTES:
            extra = max(extra, got - planned.workspace_bytes[i])
        with_margins.append(planned.base_bytes[i] + max(planned.workspace_bytes[i], got))
    predicted = max(with_margins, default=0)
    return StepMeasurement(
        peak_bytes=int(measured),
        op_workspace=tuple(sorted(by_node_key.items())),
        node_margins=tuple(node_margins),
        extra_bytes=int(extra),
        predicted_with_margins_bytes=int(predicted),
        unexplained_bytes=int(max(0, measured - predicted)),
        num_allocations=len(trace.allocations),
        num_ops=len(trace.ops),
        method=f"{trace.device.type}-allocator-trace",
        retain_graph=trace.retain_graph,
    )


def _flat_tensors(args) -> list[torch.Tensor]:
    """The tensors among a compiled call's arguments (a boxed call passes one list)."""
    out, stack = [], [args]
    while stack:
        a = stack.pop()
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            stack.extend(a)
    return out


def _backward_node(out) -> Any:
    """The ``CompiledFunctionBackward`` node behind the outputs of a compiled forward, or ``None``."""
    from collections import deque

    stack = deque()
    for t in out if isinstance(out, (list, tuple)) else [out]:
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            stack.append((t.grad_fn, 0))
    seen = set()
    while stack:
        fn, depth = stack.popleft()  # the shallowest first: this run's, not an input's run's
        if fn is None or id(fn) in seen or depth > 8:
            continue
        seen.add(id(fn))
        if type(fn).__name__ == "CompiledFunctionBackward":
            return fn
        stack.extend((nxt, depth + 1) for nxt, _ in fn.next_functions)
    return None


# ------------------------------------------------------------------------------ runs of a step

_RUN_ATTR = "_trinity_run"
# Autograd nodes the walk from a run's inputs visits at most (it finds the earlier runs of the
# step: ancestors of the inputs); a larger graph is walked this far.
_MAX_WALK_NODES = 200_000


class _Run:
    """One run of a checked pair (a forward call whose output has a backward node), kept on its
    ``CompiledFunctionBackward`` node (attribute ``_trinity_run``): it lives as long as the
    autograd graph, and ``ended`` is set when its backward has run."""

    __slots__ = ("checker", "session", "params", "ended")

    def __init__(self, checker, session, params: tuple):
        self.checker = checker
        self.session = session
        self.params = params  # weak references to the parameter inputs of this run
        self.ended = False


def runs_before(args) -> list[_Run]:
    """The runs of checked pairs among the autograd ancestors of ``args`` whose backward has not
    run: the pairs whose outputs this call reads, directly or through other code (earlier blocks,
    earlier DDP splits, the graph before a graph break), in the same step."""
    from collections import deque

    stack = deque(a.grad_fn for a in args if isinstance(a, torch.Tensor) and a.grad_fn is not None)
    seen: set[int] = set()
    found = []
    while stack and len(seen) < _MAX_WALK_NODES:
        fn = stack.popleft()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        run = getattr(fn, _RUN_ATTR, None)
        if isinstance(run, _Run) and not run.ended:
            found.append(run)
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return found


def _counted_by_ledger(step, run: _Run) -> bool:
    """Whether the step ledger of ``step`` (a :class:`~offload_compiler.step_budget.StepPair`)
    already counts ``run``'s pair among the holdings it planned ``step``'s pair with."""
    other = run.session.step
    if step is None or other is None or other.ledger is not step.ledger:
        return False
    return step.ledger.counts(other.key, run.session.step_holding, step.key)


def observe_reuse(session, earlier: list[_Run], others: list[_Run], params: tuple[torch.Tensor, ...]):
    """The :class:`~offload_compiler.step_budget.StepReuse` that one run of a pair (planned in
    ``session``, reading ``params``) has beside it: ``earlier``, the pair's own runs alive at its
    forward, count as runs (their inputs as held bytes); ``others``, other pairs' runs alive that
    its step ledger does not count, add their kept saved activations and inputs (under their
    plans); the parameters the other runs read that are still allocated (not the ones this run
    reads nor the model's, which the ledger counts) add their storage bytes, twice where they
    require a gradient (the gradient, counted conservatively as the ledger does)."""
    from .step_budget import StepReuse

    step = session.step
    others = [r for r in others if not _counted_by_ledger(step, r)]
    held = held_unplanned = 0
    for r in earlier:
        held += r.session.run_bytes[2]
        held_unplanned += r.session.run_bytes[2]
    for r in others:
        kept, kept_unplanned, inputs = r.session.run_bytes
        held += kept + inputs
        held_unplanned += kept_unplanned + inputs
    skip = step.ledger.parameter_ids() if step is not None else set()
    seen = set()
    for t in params:
        try:
            seen.add(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # a tensor subclass without one storage
            pass
    for r in earlier + others:
        for ref in r.params:
            t = ref()
            if t is None or id(t) in skip:
                continue
            try:
                storage = t.untyped_storage()
                size, ptr = storage.nbytes(), storage.data_ptr()
            except (RuntimeError, NotImplementedError):
                continue
            if size == 0 or ptr in seen:  # freed (FSDP2 reshards after the forward) or counted
                continue
            seen.add(ptr)
            size *= 2 if t.requires_grad else 1
            held += size
            held_unplanned += size
    return StepReuse(len(earlier) + 1, held, held_unplanned)


# ------------------------------------------------------------------------------ the wrapper


class CheckedCompile:
    """The callable the backend returns: the compiled pair, measured in its first steps.

    Args:
        compiled: the compiled function of one backend call (AOTAutograd's, Inductor's).
        session: its :class:`~offload_compiler.pipeline.CompileSession` (the report, the planned
            accounting, the runtime).
        recompile: ``(margins, reuse, grad_bytes) -> compiled function`` (the backend compiled
            again with the margins, the measured :class:`~offload_compiler.step_budget.StepReuse`
            and the bytes of gradients the pair's parameters hold from an earlier backward; its session
            is read from the function, see :func:`session_of`), or ``None`` where replanning is
            not supported (the check then measures and reports only).
        mode: ``"replan"`` or ``"measure"`` (``TrinityOptions.runtime_check``).

    Calls pass their arguments to the current compiled function unchanged.

    Raises (from a call that replans):
        offload_compiler.pipeline.InfeasibleBudgetError: when, with the measured workspace or the
            measured runs per step, no plan reaches the budget and ``on_infeasible="error"``.
    """

    def __init__(self, compiled: Callable, session, recompile: Callable | None, mode: str):
        self._current = compiled
        self._session = session
        self._recompile = recompile
        self._mode = mode
        self._lock = threading.Lock()
        self._retired: list = []
        self._margins: WorkspaceMargins | None = None
        self._first: tuple[int, int] | None = None  # (measured, planned) of the first plan
        self._base_peak = session.own_unplanned_peak_bytes if session is not None else None
        self._replans = 0
        self._due: StepMeasurement | None = None
        self._due_reuse = None
        self._due_reserve = 0  # bytes of a measured peak over budget that no op explains
        self._pending: tuple[_Trace, list, int] | None = None
        self._attempts = 0  # measured forwards whose step could not be measured
        # The measuring window (a measured forward to its backward): the pair's runs in it, what
        # they had beside them (step_budget.StepReuse), whether a backward of one of them ran,
        # whether the measured forward's graph was dropped.
        self._window: list[_Run] = []
        self._observed = None
        self._backward_seen = False
        self._dropped = False
        self._reuse_warned = False
        self._due_error: Exception | None = None
        # Pairs whose runs had this pair's run beside them in a step, and the earlier pairs whose
        # provisional percentage waits for this pair's final plan (see _settle_provisional).
        self._beside: weakref.WeakSet = weakref.WeakSet()
        self._waiting: weakref.WeakSet = weakref.WeakSet()
        # A cap on the kept saved activations that a later pair of the step asked for and that a
        # replan failed to meet (not tried again).
        self._cap_tried: int | None = None
        # The later pairs' inputs (bytes) that a replan failed to plan for, or that were warned
        # about (not tried again).
        self._later_tried: int | None = None
        # The gradients of the pair's parameters left by an earlier backward (gradient
        # accumulation) that its plan counts (bytes), and whether no call can show more (the plan
        # counts all of them, or they cannot be planned for and the warning was given).
        self._grad_bytes = session.accumulated_grad_bytes if session is not None else 0
        self._grads_planned = self._grad_bytes  # (what the plan counted before a replan for more)
        self._grads_settled = session is None or session.options.memory_budget.kind not in ("bytes", "fraction")
        # Forwards in a row that found fewer gradients than the plan counts ((phases, backward
        # count at the last one, most bytes seen), _grads_gone); whether the plan was lowered for
        # that, and whether it keeps the most from now on (they came back after a lowering).
        self._grads_low: tuple[int, int | None, int] | None = None
        self._grads_lowered = False
        self._grads_keep_most = False
        self._grads_why = ""
        self._backwards = 0  # backwards of this pair's runs so far
        step = session.step if session is not None else None
        if step is not None:
            step.ledger.register_checker(step.key, self)  # (the step report shows its measurement)
        if step is not None and recompile is not None and mode == "replan":
            step.ledger.register_replanner(step.key, self)  # a later pair may cap this one
        self.measurements: list[StepMeasurement] = []
        self._state = "measure" if self._checkable() else "done"
        # Whether the step after a plan's first measured step is measured too (under Inductor,
        # whose first backward compiles inside the measured window: see _finish).
        self._steady_check = session is not None and session.options.inner == "inductor"
        self._steady_pending = self._steady_check
        if getattr(compiled, "_boxed_call", False):
            self._boxed_call = True

    def _checkable(self) -> bool:
        s = self._session
        return s is not None and len(s.reports) == 1 and s.planned_steps is not None

    @property
    def replan_due(self) -> bool:
        """Whether the measured step calls for a replan at the next call (workspace, runs)."""
        return self._due is not None

    @property
    def report(self):
        """The current report of the pair (``None`` when the compile planned no training pair)."""
        return self._session.reports[-1] if self._session is not None and self._session.reports else None

    # ------------------------------------------------------------------ calls
    def __call__(self, *args):
        if self._due_error is not None:
            err, self._due_error = self._due_error, None
            raise err
        grads_due = not self._grads_settled and self._grads_due(args)
        if self._due is not None:
            self._replan()  # (reads the ledger's cap, the later pairs' inputs and the gradients too)
        elif self._cap_due():
            self._replan_for_cap()
        elif self._later_due():
            self._replan_for_later_inputs(grads_due)
        elif grads_due:
            self._replan_for_grads()
        grad = torch.is_grad_enabled()
        if self._state == "pending":
            self._abandon_if_stale(grad)
        io = self._io_refs(args)  # before the call: a boxed call frees its inputs as it goes
        if self._state == "measure" and grad:
            if measure_step_enabled():
                out = self._measured_forward(args)
                self._note_io(io, out)
                return out
            self._note_profiled_call()
        out = self._current(*args)
        self._note_io(io, out)
        node = self._track(args, out, window=self._state == "pending") if grad else None
        if node is None and self._state == "pending":
            self._count_pending_call()
        return out

    def _io_refs(self, args):
        """Weak references to this call's input tensors other than parameters, with their
        storages' addresses, for the step ledger (:meth:`_note_io`); ``None`` outside a step
        ledger's graph-break pairs (DDP splits are not watched)."""
        step = self._session.step if self._session is not None else None
        if step is None or step.split is not None:
            return None
        from .step_budget import storage_refs

        try:
            return storage_refs(t for t in _flat_tensors(args) if not isinstance(t, torch.nn.Parameter))
        except Exception:  # noqa: BLE001  (the check must never break a step)
            return None

    def _note_io(self, io, out) -> None:
        """Record the storages this call read (``io``) and made (``out``) in the step ledger
        (:meth:`~offload_compiler.step_budget.StepLedger.note_call`): a later pair's compile tells
        its inputs made in the step from those there from its start."""
        if io is None:
            return
        from .step_budget import storage_refs

        try:
            made = storage_refs(t for t in _flat_tensors(out) if not isinstance(t, torch.nn.Parameter))
            step = self._session.step
            step.ledger.note_call(step.key, io + made, made)
        except Exception:  # noqa: BLE001  (the check must never break a step)
            pass

    def _later_outputs_now(self) -> int | None:
        """Device bytes of the step's later pairs' outputs alive now, at this pair's backward
        (:meth:`~offload_compiler.step_budget.StepLedger.later_outputs_alive`); ``None`` outside a
        step ledger's graph-break pairs, as :meth:`_io_refs`."""
        s = self._session
        step = s.step if s is not None else None
        if step is None or step.split is not None or s.planned_steps is None:
            return None
        try:
            return step.ledger.later_outputs_alive(step.key, torch.device(s.planned_steps.device))
        except Exception:  # noqa: BLE001  (the check must never break a backward)
            return None

    def _watches_later(self) -> bool:
        """Whether this pair's backwards after its measured first step look for later pairs'
        outputs the caller holds (:meth:`_note_later_outputs`): a graph-break pair of a step with
        later pairs, under a bytes or percentage budget."""
        s = self._session
        step = s.step if s is not None else None
        return (
            step is not None
            and step.split is None
            and s.planned_steps is not None
            and s.options.memory_budget.kind in ("bytes", "fraction")
            and step.ledger.has_later(step.key)
        )

    def _note_later_outputs(self, grad_outputs):
        """Backward pre-hook of every call (not only the measured first step): the later pairs'
        outputs alive as this backward starts go in the ledger
        (:meth:`~offload_compiler.step_budget.StepLedger.set_later_outputs`, which keeps the
        most seen), so that a caller who starts holding the logits after the first steps gets the
        pair planned again for them at its next call (:meth:`_later_due`), or the warning."""
        now = self._later_outputs_now()
        if now is not None:
            try:
                step = self._session.step
                step.ledger.set_later_outputs(step.key, now)
            except Exception:  # noqa: BLE001  (the check must never break a backward)
                pass
        return None

    def _later_due(self) -> bool:
        """Whether later pairs of the step, compiled after this pair's plan, read inputs that
        exist from the step's start, or return outputs the caller holds through this pair's
        backward, that its plan did not count (they are alive while it runs:
        :meth:`~offload_compiler.step_budget.StepLedger.later_held_bytes`). Where it cannot be
        planned again (``runtime_check="measure"``, parameter offload) it warns once with their
        bytes."""
        s = self._session
        step = s.step if s is not None else None
        if step is None or s.step_holding is None or s.options.memory_budget.kind not in ("bytes", "fraction"):
            return False
        now = step.ledger.later_held_bytes(step.key)
        if now <= s.step_later_bytes or now == self._later_tried:
            return False
        if self._recompile is None or self._mode != "replan":
            self._later_tried = now
            label = self.report.graph_id if self.report is not None else "?"
            why = "runtime_check='measure'" if self._mode != "replan" else f"offload={s.options.offload!r}"
            warnings.warn(
                f"trinity graph {label}: later graph pairs of the step hold {_later_what(step.ledger, step.key)}, "
                f"alive while this pair runs; its plan counts {s.step_later_bytes}. With {why} it is not planned again for them (only "
                "runtime_check='replan' with offload='activations' is), so the step can exceed the budget by up to "
                f"{now - s.step_later_bytes} bytes.",
                stacklevel=3,
            )
            return False
        return True

    def _replan_for_later_inputs(self, grads_due: bool = False) -> None:
        """Plan the pair again with the later pairs' inputs that the step holds from its start
        and their outputs the caller holds (:meth:`_later_due`), at this call (the next step's start, never inside a step);
        ``grads_due``: the gradients its parameters hold changed too (:meth:`_grads_due`), and
        the replan counts them as well."""
        from .pipeline import InfeasibleBudgetError

        step = self._session.step
        now = step.ledger.later_held_bytes(step.key)
        why = f"for what later graph pairs of the step hold while it runs ({_later_what(step.ledger, step.key)})"
        if grads_due:
            why += " and " + self._grads_why.removeprefix("for ")
        try:
            session = self._replan_again(why)
        except InfeasibleBudgetError:
            self._later_tried = now  # (not tried again)
            if grads_due:
                self._grad_bytes = self._grads_planned
            raise
        if session is None:
            self._later_tried = now

    def _note_profiled_call(self) -> None:
        """A training call that the check could not measure because a profiler was already
        running (``torch.profiler``, or :func:`~offload_compiler.measure_peak_device_bytes` on
        the CPU, which uses one): after :data:`PROFILED_CALLS_WARN` of them in a row, warn once
        that the plan is still unchecked (a reused block graph's runs not counted, no workspace
        margin), instead of running unchecked in silence."""
        self._profiled_calls = getattr(self, "_profiled_calls", 0) + 1
        if self._profiled_calls == PROFILED_CALLS_WARN:
            label = self.report.graph_id if self.report is not None else "?"
            warnings.warn(
                f"trinity graph {label}: runtime_check={self._mode!r} has not measured this pair's first step: "
                f"its last {PROFILED_CALLS_WARN} training calls ran while a profiler was on (torch.profiler, or "
                "offload_compiler.measure_peak_device_bytes on the CPU). Until one step runs without a profiler, "
                "the plan is unchecked: the runs of a block graph reused in one step are not counted and no "
                "measured workspace is planned for, so the step can exceed its budget. Run one training step "
                "without a profiler first, then measure.",
                stacklevel=3,
            )

    def _params_of(self, args) -> tuple[torch.Tensor, ...]:
        out = []
        for i in self._session.param_positions:
            if i < len(args) and isinstance(args[i], torch.Tensor):
                out.append(args[i])
        return tuple(out)

    def _track(self, args, out, node=None, window: bool = False):
        """Keep the run that produced ``out`` on its backward node (:class:`_Run`: later runs of
        the step find it among their inputs' autograd ancestors), and, inside this pair's
        measuring window (``window``), what it has beside it. Returns its backward node, or
        ``None`` (no backward: nothing kept)."""
        node = node if node is not None else _backward_node(out)
        if node is None:
            return None
        session = self._session
        params = self._params_of(args)
        refs = []
        for t in params:
            try:
                refs.append(weakref.ref(t))
            except TypeError:
                pass
        run = _Run(self, session, tuple(refs))
        before = None
        if window:
            try:
                before = runs_before(args)
            except Exception:  # noqa: BLE001  (the check must never break a step)
                before = None
        try:
            setattr(node, _RUN_ATTR, run)
        except (AttributeError, TypeError):
            return node

        def ended(grad_inputs, grad_outputs):
            run.ended = True
            self._backwards += 1
            if run in self._window:
                self._backward_seen = True

        node.register_hook(ended)
        if self._watches_later():
            node.register_prehook(self._note_later_outputs)
        if before is not None:
            earlier = [r for r in self._window if not r.ended]
            others = [r for r in before if r.checker is not self]
            for r in others:  # their pairs' step goes on with this one (their provisional waits)
                r.checker._beside.add(self)
            try:
                seen = observe_reuse(session, earlier, others, params)
            except Exception:  # noqa: BLE001  (the check must never break a step)
                seen = None
            with self._lock:
                self._window.append(run)
                if seen is not None:
                    self._observed = seen.merged(self._observed)
        return node

    def _count_pending_call(self) -> None:
        with self._lock:
            if self._pending is None:
                return
            trace, handles, calls = self._pending
            self._pending = (trace, handles, calls + 1)

    def _abandon_if_stale(self, grad: bool) -> None:
        """Give up a measured forward whose backward will not come: its graph was dropped, its
        backward raised, the calls without a backward since exceed :data:`_PENDING_CALLS`, or
        (``grad``: this call is a forward with autograd) a backward of this pair ran since
        without the measured one's (the step ended). Forwards before any backward are the pair's
        further runs in the same step (a reused block graph) and wait."""
        with self._lock:
            trace, handles, calls = self._pending
            if trace.is_open and trace._open_thread == threading.get_ident():
                trace.stop()  # a backward that raised: its post hook never ran
                trace.valid = False
            if self._dropped or calls > _PENDING_CALLS or not trace.valid or (grad and self._backward_seen):
                for h in handles:
                    h.remove()
                self._pending = None
                self._attempts += 1
                self._window = []
                self._observed = None
                self._state = "measure" if self._attempts < _ATTEMPTS else "done"

    def _measured_forward(self, args):
        planned = self._session.planned_steps
        names = frozenset(op for op in planned.ops if op)
        trace = _Trace(torch.device(planned.device), names)
        try:
            trace.resident = resident_storages(_flat_tensors(args), planned.device)
            trace.start("forward")
        except Exception as exc:  # the check must never break a step
            self._give_up(trace, exc)
            return self._current(*args)
        try:
            out = self._current(*args)
        finally:
            try:
                trace.stop()
            except Exception as exc:
                self._give_up(trace, exc)
        if not trace.valid:
            return out
        node = _backward_node(out)
        if node is None:
            self._attempts += 1
            if self._attempts >= _ATTEMPTS:
                self._state = "done"
            return out
        with self._lock:
            self._window = []
            self._observed = None
            self._backward_seen = False
            self._dropped = False
        self._track(args, out, node, window=True)
        fired = [False]

        def pre(grad_outputs):
            if fired[0]:
                return None
            fired[0] = True
            if not (measure_step_enabled() and trace.valid):
                trace.valid = False
                return None
            trace.retain_graph = _backward_keeps_graph()
            trace.later_outputs = self._later_outputs_now()
            try:
                # Tangents not already counted among the step's resident inputs.
                scalars = [g for g in _flat_tensors(grad_outputs) if g.numel() == 1]
                trace.tangents = {
                    ptr: nbytes
                    for ptr, nbytes in resident_storages(scalars, planned.device).items()
                    if ptr not in (trace.resident or {})
                }
            except Exception as exc:  # the check must never break a backward
                self._give_up(trace, exc)
                return None
            try:
                trace.start("backward")
            except Exception as exc:  # the check must never break a backward
                self._give_up(trace, exc)
            return None

        def post(grad_inputs, grad_outputs):
            if trace.is_open and trace._open_thread == threading.get_ident():
                try:
                    trace.stop()
                    self._finish(trace)
                except Exception as exc:
                    self._give_up(trace, exc)
            return None

        def dropped():
            self._dropped = True

        handles = [node.register_prehook(pre), node.register_hook(post)]
        weakref.finalize(node, dropped)
        with self._lock:
            self._pending = (trace, handles, 0)
            self._state = "pending"
        return out

    def _give_up(self, trace: _Trace, exc: BaseException) -> None:
        """Stop checking after an error inside the check itself (it never breaks a step)."""
        trace.valid = False
        with self._lock:
            self._pending = None
            self._state = "done"
        warnings.warn(
            f"trinity runtime_check: measuring the first step failed ({type(exc).__name__}: {exc}); the pair is "
            "not checked",
            stacklevel=2,
        )

    # ------------------------------------------------------------------ after a measured step
    def _finish(self, trace: _Trace) -> None:
        planned = self._session.planned_steps
        with self._lock:
            self._pending = None
            seen, self._observed = self._observed, None
            self._window = []
            if not trace.valid or trace.phases != ["forward", "backward"]:
                self._attempts += 1
                self._state = "measure" if self._attempts < _ATTEMPTS else "done"
                return
            if trace.device.type == "cuda" and trace.cuda_delta != 0 and not trace.allocations:
                self._state = "done"
                warnings.warn(
                    "trinity runtime_check: the profiler reported no CUDA allocations while the allocator's count "
                    "changed; the first step is not measured on this machine",
                    stacklevel=2,
                )
                return
            if trace.later_outputs:
                step = self._session.step
                step.ledger.set_later_outputs(step.key, trace.later_outputs)
            m = analyze(trace, planned)
            self.measurements.append(m)
            old = self.report
            planned_reuse = self._session.reuse
            new = dataclasses.replace(
                old,
                measured_peak_bytes=m.peak_bytes,
                reuse_measured=max(seen.runs if seen is not None else 1, old.reuse_measured or 1),
            )
            _replace(old, new)
            self._session.reports[-1] = new
            if self._first is None:
                self._first = (m.peak_bytes, old.peak_bytes_planned)
            # The pair's own share of the step's budget: what the step's other graph pairs (and,
            # for a reused pair, its earlier runs) hold while it runs (step_budget.py) is not in
            # its measurement, which is of one run.
            held = self._session.step_held[0]
            budget = None if old.budget_bytes is None else old.budget_bytes - held
            own_planned = old.peak_bytes_planned - held
            over = budget is not None and m.peak_bytes > budget
            # Margins change the plan only where they raise its peak above the budget (and above
            # the plan's own peak, for the lowest-peak plan of an infeasible budget).
            explained = over and m.extra_bytes > 0 and m.predicted_with_margins_bytes > max(budget, own_planned)
            # A pair run several times per step (or beside other pairs' runs the ledger does not
            # count) holds more than its plan assumed: plan again for what the step showed.
            measured_step = seen is not None and old.budget_bytes is not None
            more = measured_step and seen.exceeds(planned_reuse, MIN_TRANSIENT_BYTES)
            # A count predicted at the compile from the module structure (step_budget.predict_runs)
            # is replaced by the measured one where they differ: more runs (or more held beside
            # them) as above, or fewer (the plan then keeps more on the device, still in budget).
            predicted = planned_reuse is not None and planned_reuse.predicted is not None
            fewer = measured_step and predicted and seen.runs < planned_reuse.runs
            reuse_due = more or fewer
            can_replan = self._mode == "replan" and self._recompile is not None and self._replans < MAX_REPLANS
            # Over a budget the plan met on paper by bytes no op's workspace explains (an
            # allocation the plan does not model): plan again with them as a reserve at every node,
            # unless the backward ran with retain_graph=True: its saved tensors then stay alive to
            # its end, which no reserve fixes (warned about below).
            retained = m.retain_graph is True and m.unexplained_bytes >= MIN_TRANSIENT_BYTES
            unexplained = (
                over
                and not explained
                and own_planned <= budget
                and m.unexplained_bytes >= MIN_TRANSIENT_BYTES
                and not retained
            )
            if (explained or reuse_due or unexplained) and can_replan:
                if self._replans == 0:
                    # The report names the measurement that led to the first replan: under
                    # Inductor that can be the step after the first (a fresh-user trial's report
                    # named the first step's 29.36 MiB, within its budget, as the reason).
                    self._first = (m.peak_bytes, old.peak_bytes_planned)
                self._due = m
                self._due_reuse = (seen if predicted else seen.merged(planned_reuse)) if reuse_due else None
                self._due_reserve = m.unexplained_bytes if unexplained else 0
                self._state = "replan"
                return
            # Under Inductor the first backward compiles the backward graph inside the measured
            # window (lazily), and that step is no steady one: a sixth fresh-user trial's bf16
            # Llama measured 361 KB at its first step, then 398 KB at every later one, above the
            # budget that the first step met. The next step of a plan is measured too.
            self._state = "done"
            if self._steady_pending:
                self._steady_pending = False
                self._state = "measure"
        self._settle_provisional(seen)
        self._resolve_waiting()
        if more and not self._reuse_warned:
            self._reuse_warned = True
            if self._mode != "replan":
                why = "runtime_check='measure'"
            elif self._recompile is None:
                why = "replanning is not supported with parameter offload"
            else:
                why = f"still after {self._replans} replans"
            warnings.warn(
                f"trinity graph {new.graph_id}: the first step ran this graph {seen.runs} times at once (a block graph "
                f"reused by {seen.runs} blocks), with {seen.held_bytes} bytes held beside its last run besides their "
                f"saved activations, while its plan covers {planned_reuse.runs if planned_reuse else 1} run(s); "
                f"{why}: the step's peak can be above the budget {old.budget_bytes} bytes",
                stacklevel=2,
            )
        if over and (explained or own_planned <= budget):
            unseen = _unseen_causes(m.retain_graph)
            if not explained and retained:
                kept = self._session.run_bytes[0]
                why = (
                    "its backward ran with retain_graph=True, which keeps the graph's saved tensors alive until the "
                    f"graph is freed (the {kept} bytes of saved activations this plan keeps on the device, and the "
                    "host copies of those it offloads), where the plan frees each at its last use in the backward: "
                    f"{m.unexplained_bytes} bytes beyond the plan with the measured workspace that no plan models, "
                    "so not replanned. Call backward() without retain_graph=True where the graph is not needed "
                    "again (e.g. one backward of the summed losses), or raise memory_budget to leave room for them"
                )
            elif not explained and self._mode == "replan" and self._recompile is not None:
                why = (
                    f"no op's workspace explains it ({m.unexplained_bytes} bytes beyond the plan with the measured "
                    f"workspace: {unseen}); "
                    + (
                        f"not replanned again after {self._replans} replans"
                        if m.unexplained_bytes >= MIN_TRANSIENT_BYTES
                        else "not replanned"
                    )
                )
            elif not explained:
                why = (
                    f"no op's workspace explains it ({m.unexplained_bytes} bytes beyond the plan with the measured "
                    f"workspace: {unseen}); not replanned"
                )
            elif self._mode != "replan":
                why = "runtime_check='measure': not replanned"
            elif self._recompile is None:
                why = "replanning is not supported with parameter offload"
            else:
                why = f"still after {self._replans} replans"
            warnings.warn(
                f"trinity graph {new.graph_id}: the measured peak of the first step, {m.peak_bytes} bytes, is above "
                f"the budget {budget} bytes (planned {own_planned})"
                + (f", the step's {old.budget_bytes} bytes less {held} held by its other graph pairs" if held else "")
                + f"; {why}. "
                + _describe(m),
                stacklevel=2,
            )

    def _settle_provisional(self, seen) -> None:
        """The first plan's percentage was infeasible for one run and waited for the first step
        (``CompileSession.provisional``), which showed no more runs of this pair to plan for. If
        later pairs' runs had this pair's run beside them (the first block's own graph before the
        reused block graph), the step's percentage is theirs, of the whole step: the decision waits
        for their final plans (:meth:`_resolve_waiting`). Else the budget is refused at the next
        call (``on_infeasible="error"``) or warned about."""
        message = self._session.provisional
        if message is None:
            return
        later = [c for c in self._beside if c is not self]
        if not later:
            runs = seen.runs if seen is not None else 1
            self._settle(
                message
                + f" (the first step ran this graph {runs} time{'s' if runs != 1 else ''} at once: the budget is of "
                + f"{'those runs' if runs != 1 else 'one run'})"
            )
            return
        for c in later:
            c._waiting.add(self)
            if c._first is not None and c._due is None:  # its plan is final already
                c._resolve_waiting()

    def _resolve_waiting(self) -> None:
        """With this pair's plan final for its step: every earlier pair waiting on it
        (:meth:`_settle_provisional`) fits the step when its planned peak (nothing else is held
        while it runs) is within this pair's step budget, the larger percentage base."""
        budget = self.report.budget_bytes if self.report is not None else None
        for a in list(self._waiting):
            self._waiting.discard(a)
            message = a._session.provisional
            if message is None or a.report is None:
                continue
            if budget is not None and a.report.peak_bytes_planned <= budget:
                a._session.provisional = None  # within the step's budget
            else:
                a._settle(
                    message + f" The training step's budget, with graph {self.report.graph_id}'s runs beside it, is "
                    f"{budget} bytes, below this graph's lowest-peak plan ({a.report.peak_bytes_planned} bytes) too."
                )

    def _settle(self, message: str) -> None:
        """Refuse the provisional budget ``message`` at the next call (``on_infeasible="error"``),
        or warn."""
        from .pipeline import InfeasibleBudgetError

        self._session.provisional = None
        if self._session.options.on_infeasible == "error":
            self._due_error = InfeasibleBudgetError(message)
        else:
            warnings.warn(message + " (on_infeasible='warn': using the lowest-peak plan)", stacklevel=3)

    def _grads_due(self, args) -> bool:
        """Whether the pair's parameters now hold more gradients from an earlier backward than
        its plan counts (gradient accumulation: the second ``no_sync()`` micro-step, the step after
        ``zero_grad(set_to_none=False)``): they stay allocated through this call's forward and
        backward. Where the pair can be planned again (``runtime_check="replan"``,
        ``offload="activations"``) the new amount is kept for :meth:`_replan_for_grads` (or the
        replan due at this call); else it warns once that the step can exceed the budget by it.
        Where they hold fewer than the plan counts (``zero_grad(set_to_none=True)`` freed them), the
        pair is planned again without them once forwards of several steps showed it
        (:meth:`_grads_gone`), so the plan does not keep counting gradients that are gone."""
        params = self._params_of(args)
        from .step_budget import _nbytes, accumulated_grad_bytes

        held = any(getattr(t, "grad", None) is not None for t in params)
        got = accumulated_grad_bytes(params, self._session.device) if held else 0
        can_replan = self._recompile is not None and self._mode == "replan"
        if got < self._grad_bytes and can_replan and not self._grads_keep_most:
            return self._grads_gone(got)
        self._grads_low = None
        if got <= self._grad_bytes:
            every = self._grad_bytes >= sum(_nbytes(t) for t in params if t.requires_grad)
            if every and (self._grads_keep_most or not can_replan):
                self._grads_settled = True  # the plan counts every gradient these parameters can have
            return False
        if not can_replan:
            self._grads_settled = True
            label = self.report.graph_id if self.report is not None else "?"
            why = "runtime_check='measure'" if self._mode != "replan" else f"offload={self._session.options.offload!r}"
            warnings.warn(
                f"trinity graph {label}: its parameters hold {got} bytes of gradients from an earlier backward "
                "(gradient accumulation: DDP's no_sync(), zero_grad(set_to_none=False)) that stay allocated through "
                f"this forward and backward; its plan counts {self._grad_bytes}. With {why} it is not planned again "
                "for them (only runtime_check='replan' with offload='activations' is), so the step can exceed "
                f"the budget by up to {got - self._grad_bytes} bytes. Use zero_grad(set_to_none=True) (the default) "
                "where there is no accumulation, or lower memory_budget by that much.",
                stacklevel=3,
            )
            return False
        if self._grads_lowered:
            # They came back after a replan without them (accumulation over more forwards than
            # GRADS_GONE_PHASES): count the most from now on, never lowered again.
            self._grads_keep_most = True
        self._grads_planned, self._grad_bytes = self._grad_bytes, got
        self._grads_why = f"for the {got} bytes of gradients its parameters hold from an earlier backward"
        return True

    def _grads_gone(self, got: int) -> bool:
        """The pair's parameters hold fewer gradients at this forward (``got`` bytes) than its
        plan counts (``zero_grad(set_to_none=True)`` freed them, accumulation stopped): whether
        to plan it again without them, now. Only after :data:`GRADS_GONE_PHASES` forwards in a row
        showed fewer, each after a backward of this pair (the forwards of one step, a reused block
        graph's N runs, count once): the first micro-step of each accumulation step holds none
        and must not undo the plan the next micro-steps need. The plan then counts the most
        those forwards showed; where gradients come back above it later, it is planned for them
        again and no longer lowered (:meth:`_grads_due`)."""
        phases, mark, most = self._grads_low or (0, None, 0)
        if mark != self._backwards:
            phases += 1
        self._grads_low = (phases, self._backwards, max(most, got))
        if phases < GRADS_GONE_PHASES:
            return False
        most = self._grads_low[2]
        self._grads_low = None
        self._grads_lowered = True
        old = self._grad_bytes
        self._grads_planned, self._grad_bytes = old, most
        self._grads_why = (
            f"without the {old - most} of the {old} bytes of gradients its plan counted, which its parameters "
            f"no longer hold when its forward runs ({GRADS_GONE_PHASES} forwards in a row, each after a backward: "
            "zero_grad(set_to_none=True) frees them)"
        )
        return True

    def _replan_for_grads(self) -> None:
        """Plan the pair again with the gradients its parameters hold from an earlier backward
        (:meth:`_grads_due`), at this call, before its forward runs. When no plan fits them
        (``on_infeasible="error"``), the plan keeps counting what it counted before, so every
        later call that finds them raises again."""
        from .pipeline import InfeasibleBudgetError

        try:
            self._replan_again(self._grads_why)
        except InfeasibleBudgetError:
            self._grad_bytes = self._grads_planned
            raise

    def _cap_due(self) -> bool:
        """Whether a later pair of the step capped this pair's kept saved activations
        (:meth:`~offload_compiler.step_budget.StepLedger.set_caps`) since its plan."""
        s = self._session
        step = s.step if s is not None else None
        if step is None or self._recompile is None or self._mode != "replan":
            return False
        cap = step.ledger.kept_cap(step.key)
        return cap is not None and cap != s.kept_cap_bytes and cap != self._cap_tried

    @property
    def may_recompute(self) -> bool:
        """Whether a cap on this pair may be met by recomputing (``strategy`` other than
        ``"offload"``) and :meth:`probe_cap` can say what its plan keeps."""
        s = self._session
        return s is not None and getattr(s, "cap_probe_pair", None) is not None and s.options.strategy != "offload"

    def probe_cap(self, cap_bytes: int) -> tuple[int, int] | None:
        """``(kept bytes, own planned peak bytes)`` of the plan :meth:`_replan_for_cap` would make
        for a cap of ``cap_bytes`` at the next call (the session's
        :meth:`~offload_compiler.pipeline.CompileSession.probe_cap`); ``None`` where it cannot say."""
        session = self._session
        probe = getattr(session, "probe_cap", None) if session is not None else None
        if probe is None:
            return None
        try:
            return probe(cap_bytes)
        except Exception as exc:  # noqa: BLE001  (a failed probe leaves the cap as planned: the next call checks it)
            log.debug("trinity: probing a cap of %d bytes failed: %s", cap_bytes, exc)
            return None

    def _replan_for_cap(self) -> None:
        """Plan the pair again with the cap the step ledger holds for it (at this call: the
        start of the step after the one whose later pair asked for it, never inside a step).

        Where no plan keeps that little (the pair's floor was an estimate: under
        ``strategy="recompute"`` recomputing a saved activation keeps its chain's leaves), the
        pair runs its lowest-peak plan, the ledger counts what that keeps (so the step's report
        and the later pairs' holdings say what the step holds), and when the step's predicted
        peak is then above its budget the call raises :class:`~.pipeline.InfeasibleBudgetError`
        (``on_infeasible="error"``) or warns, with the budget that runs. (A trial's graph-broken
        recompute-only step at 50% planned its second pair for a 6.80 MiB cap on the first,
        which kept 20 MiB: it measured 64.52 MiB against a 57.33 MiB budget while its report
        said it fit; with ``on_infeasible="error"`` the error named a budget below the one asked
        for.)"""
        step = self._session.step
        cap = step.ledger.kept_cap(step.key)
        from .passes.plan_window import lowest_budget_percent
        from .pipeline import InfeasibleBudgetError

        later = step.ledger.caps()[step.key][1]
        options = self._session.options
        why = f"to keep at most {cap} bytes of saved activations for a later graph pair of the step"

        def replan(on_infeasible=None):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                return self._replan_again(why, on_infeasible=on_infeasible), seen

        refused = None
        try:
            session, seen = replan()
        except InfeasibleBudgetError as exc:
            # Its own budget, or the cap (a later pair's need, not this pair's budget)? Its
            # lowest-peak plan tells: what that keeps decides what the step reaches.
            refused = exc
            session, seen = replan(on_infeasible="warn")
        holding = session.step_holding if session is not None else None
        missed = holding is not None and holding.kept_bytes > cap
        for w in seen:
            # This pair's own infeasibility message: where the cap is missed it describes the miss
            # as a peak (said below); where the replan was refused, the error says it.
            if not ((missed or refused is not None) and str(w.message).startswith("trinity: memory_budget")):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if not missed:
            if session is None or refused is not None:
                self._cap_tried = cap  # (not tried again)
            if refused is not None:
                raise refused
            return
        # The later pair was planned for the cap: count what this pair keeps instead, so that the
        # step's report and the later pairs' holdings say what the step holds.
        kept = holding.kept_bytes
        step.ledger.set_caps({step.key: kept}, later)
        self._cap_tried = kept
        report = step.ledger.report()
        budget, peak = report.budget_bytes, report.predicted_peak_bytes
        over = 0 if budget is None else peak - budget
        how = " (strategy='recompute' offloads none of them)" if options.strategy == "recompute" else ""
        message = (
            f"trinity graph {self.report.graph_id}: the step's later graph pair {later} fits the step's budget only "
            f"if this pair keeps at most {cap} bytes of saved activations; planned again, it still keeps {kept} "
            f"bytes{how}. The step's predicted peak is then {peak} bytes"
        )
        if over <= 0:
            warnings.warn(message + f", within its budget {budget} bytes", stacklevel=4)
            return
        percent = lowest_budget_percent(peak, report.unplanned_peak_bytes)
        message += (
            f", {over} above its budget {budget} bytes. Raise memory_budget (these plans run within '{percent}' "
            f"of the training step's unplanned peak, {report.unplanned_peak_bytes} bytes, or {peak} bytes; with a "
            "higher budget the pairs are planned again and may need less)"
            + (", or use strategy='auto', which may offload them" if options.strategy == "recompute" else "")
            + "."
        )
        if options.on_infeasible == "error":
            raise InfeasibleBudgetError(message)
        warnings.warn(message + " (on_infeasible='warn': the step runs above its budget)", stacklevel=4)

    def _replan_again(self, why: str, on_infeasible: str | None = None):
        """Plan the pair again with what the step holds now (the ledger's cap on this pair, the
        gradients its parameters hold) and the margins and runs the check measured so far; run
        the new plan from this call on. The report keeps its graph id and measured correction;
        the new plan's first step is measured again. ``why``: the reason, as the messages say it
        ("for ...", "to ..."); ``on_infeasible``: in place of the option's (``"warn"``: the
        lowest-peak plan where none fits). Returns the new session, or ``None`` when the plan
        stays (a failed replan warns: it must not stop training that runs).

        Raises:
            InfeasibleBudgetError: no plan reaches the budget with them and ``on_infeasible="error"``.
        """
        from .pipeline import InfeasibleBudgetError

        old_report = self.report
        try:
            extra = {} if on_infeasible is None else {"on_infeasible": on_infeasible}
            compiled = self._recompile(self._margins, self._session.reuse, self._grad_bytes, **extra)
        except InfeasibleBudgetError as exc:
            text = str(exc).removeprefix("trinity: ")
            raise InfeasibleBudgetError(f"trinity graph {old_report.graph_id}: planned again {why}: {text}") from exc
        except Exception as exc:  # a failed replan must not stop training that runs
            warnings.warn(
                f"trinity graph {old_report.graph_id}: planning again {why} failed ({type(exc).__name__}: {exc}); "
                "its plan stays",
                stacklevel=4,
            )
            return None
        session = session_of(compiled)
        if session is None or len(session.reports) != 1:
            return None
        recorded = session.reports[-1]
        final = dataclasses.replace(
            recorded,
            graph_id=old_report.graph_id,
            correction=old_report.correction,
            reuse_measured=old_report.reuse_measured,
        )
        self._record_final(old_report, final, recorded, session)
        self._install(compiled, session)
        return session

    def _record_final(self, old_report, final, recorded, session) -> None:
        """Put the replanned pair's report ``final`` (``recorded`` with the old graph id and the
        check's figures) in the report log in place of ``old_report``."""
        _replace(old_report, final, drop=recorded)
        session.reports[-1] = final

    def _install(self, compiled, session) -> None:
        """Run ``compiled`` (a replan's compile, with ``session``) from the next call on; the old
        compiled function stays alive for the autograd graphs recorded with it, and its host
        pool's free blocks are released."""
        with self._lock:
            self._retired.append((self._current, self._session))
            self._session.runtime.pool.release_free()
            self._session.cap_probe_pair = None  # (only the current plan is probed)
            self._current = compiled
            self._session = session
            self._state = "measure" if self._checkable() else "done"
            self._steady_pending = self._steady_check
        self._resolve_waiting()

    def _replan(self) -> None:
        from .pipeline import InfeasibleBudgetError
        from .report import MeasuredCorrection

        with self._lock:
            m, self._due = self._due, None
            due_reuse, self._due_reuse = self._due_reuse, None
            reserve, self._due_reserve = self._due_reserve, 0
        old_report = self.report
        budget = old_report.budget_bytes
        reuse = due_reuse if due_reuse is not None else self._session.reuse
        margins = (self._margins or WorkspaceMargins(budget_bytes=budget, unplanned_peak_bytes=self._base_peak)).merged(
            dict(m.op_workspace)
        )
        if reserve:
            margins = margins.with_reserve(reserve)
        try:
            compiled = self._recompile(margins, reuse, self._grad_bytes)
        except InfeasibleBudgetError as exc:
            self._state = "done"
            if due_reuse is None and self._cap_due():
                # The recompile also carried a cap that a later pair of the step asked for: what
                # cannot be met may be the cap, not the budget. The cap's replan tells them apart
                # and names the budget the step runs within (a fresh-user trial: this error said
                # a budget of 23.57 MiB was below a lowest peak of 19.16 MiB, and named 59.6%
                # for a step refused at 73.2%).
                self._margins = margins
                self._replan_for_cap()
                return
            if reserve and due_reuse is None:
                # The reserve is a guess at where unmodelled bytes sit (everywhere): a budget it
                # makes unreachable keeps the plan that runs, with the warning it had before.
                warnings.warn(
                    f"trinity graph {old_report.graph_id}: the measured peak of a step, {m.peak_bytes} bytes, is above "
                    f"the budget {budget} bytes (planned {old_report.peak_bytes_planned}); {reserve} bytes beyond the "
                    f"plan with the measured workspace, which no op explains ({_unseen_causes(m.retain_graph)}); with "
                    f"them reserved at every node no plan reaches the budget ({exc}); the plan stays. " + _describe(m),
                    stacklevel=3,
                )
                return
            # What the step showed that the plan did not count: the reason for this replan.
            if due_reuse is not None and due_reuse.runs > 1:
                runs = (
                    f"ran this graph {reuse.runs} times at once (a block graph reused by {reuse.runs} blocks), so the "
                    f"budget covers the {reuse.runs} runs."
                )
            elif due_reuse is not None:
                planned_held = self._session.reuse.held_bytes if self._session.reuse is not None else 0
                runs = (
                    f"held {due_reuse.held_bytes} bytes beside this graph's run (runs of other graph pairs that the "
                    f"step's ledger does not count), where its plan counted {planned_held}, so the budget covers them."
                )
            else:
                runs = ""
            if runs and not m.node_margins:
                head = f"the first step on this machine {runs}"
            elif runs:  # the reason first: one run's own peak is within the budget (trial 6)
                head = (
                    f"the first step on this machine {runs} One run of it measured {m.peak_bytes} bytes (planned "
                    f"{old_report.peak_bytes_planned}); {_describe(m)}"
                )
            else:
                within = budget is not None and m.peak_bytes <= budget
                head = (
                    f"the first step on this machine measured {m.peak_bytes} bytes"
                    + (", within" if within else " against")
                    + f" the budget {budget} bytes (planned {old_report.peak_bytes_planned}); {_describe(m)}"
                )
            raise InfeasibleBudgetError(f"trinity graph {old_report.graph_id}: {head} With that: {exc}") from exc
        except Exception as exc:  # a failed replan must not stop training that runs
            self._state = "done"
            warnings.warn(
                f"trinity graph {old_report.graph_id}: planning again with the measured step failed "
                f"({type(exc).__name__}: {exc}); the plan measured at {m.peak_bytes} bytes (budget {budget}) stays",
                stacklevel=3,
            )
            return
        session = session_of(compiled)
        if session is None or len(session.reports) != 1:
            self._state = "done"
            return
        self._replans += 1
        self._margins = margins
        recorded = session.reports[-1]
        margins_now = session.planned_steps
        node_margins = (
            tuple(
                (
                    margins_now.nodes[i],
                    margins_now.ops[i],
                    margins_now.workspace_bytes[i] - margins.reserve_bytes - margins_now.table_workspace_bytes[i],
                )
                for i in range(len(margins_now.nodes))
                if margins_now.workspace_bytes[i] - margins.reserve_bytes > margins_now.table_workspace_bytes[i]
            )
            if margins_now is not None
            else m.node_margins
        )
        correction = MeasuredCorrection(
            first_measured_peak_bytes=self._first[0],
            first_planned_peak_bytes=self._first[1],
            margins=node_margins,
            total_margin_bytes=sum(b for _, _, b in node_margins),
            replans=self._replans,
            method=m.method,
            reuse_count=reuse.runs if reuse is not None else 1,
            reserve_bytes=margins.reserve_bytes,
        )
        final = dataclasses.replace(
            recorded,
            graph_id=old_report.graph_id,
            correction=correction,
            reuse_measured=old_report.reuse_measured,
        )
        self._record_final(old_report, final, recorded, session)
        self._install(compiled, session)


def _replace(old, new, drop=None) -> None:
    """Put ``new`` in the report log in place of ``old``; with a dump folder, its ``report.json``
    follows (the dumps describe the current report)."""
    from pathlib import Path

    from .report import replace_report

    replace_report(old, new, drop)
    if new.dump_dir is not None:
        try:
            (Path(new.dump_dir) / "report.json").write_text(new.to_json())
        except OSError:
            pass


def _later_what(ledger, key) -> str:
    """What the later pairs of ``key``'s step hold while it runs, for a message: the bytes of
    their inputs there from the step's start and of their outputs the caller held at its
    backward."""
    parts = []
    inputs, outputs = ledger.later_input_bytes(key), ledger.later_output_bytes(key)
    if inputs:
        parts.append(f"{inputs} bytes of inputs that exist from the step's start (the step's inputs only they read)")
    if outputs:
        parts.append(f"{outputs} bytes of outputs the caller still held when this pair's backward started")
    return " and ".join(parts) or "0 bytes"


def _unseen_causes(retain_graph: bool | None) -> str:
    """What may hold bytes beyond the plan that no op's workspace explains, for a warning: a
    backward with ``retain_graph=True`` is named only where the measured backward's flag is not
    known (``None``: the private API :func:`_backward_keeps_graph` reads is missing); where it is
    known to be True the caller names it as the cause, and where False it is no cause."""
    if retain_graph is False:
        return "allocations the plan does not see"
    return "a backward with retain_graph=True, or allocations the plan does not see"


def _describe(m: StepMeasurement) -> str:
    top = sorted(m.node_margins, key=lambda x: -x[2])[:3]
    if not top:
        return "No op allocated workspace beyond the plan's."
    where = ", ".join(f"{node} ({op}) {b} bytes" for node, op, b in top)
    return (
        f"Ops allocated workspace the plan did not model: {where}"
        + (f", and {len(m.node_margins) - 3} more" if len(m.node_margins) > 3 else "")
        + "."
    )


def session_of(compiled: Callable):
    """The :class:`~offload_compiler.pipeline.CompileSession` the backend attached to ``compiled``."""
    from torch._dynamo.eval_frame import innermost_fn

    return getattr(innermost_fn(compiled), "_trinity_session", None)
