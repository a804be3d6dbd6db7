"""Liveness: alias-aware buffers over the joint forward→backward schedule.

The joint schedule is every node of the forward graph in order (steps ``0 .. F-1``), then every
node of the backward graph (steps ``F .. F+B-1``). A **buffer** is one storage with every tensor
that aliases it (views, ``detach``, the backward placeholder that receives a saved tensor); its
live range runs from the first node that holds it to its last reader:

* parameters, buffers and other inputs: the whole schedule (the caller owns them);
* user outputs of the forward and gradients: from their definition to the end (the caller owns
  them after the graph returns);
* saved activations: from their definition in the forward to their last reader in the backward;
  the span between the last forward reader and the first backward reader is the **idle gap**;
* tangents (the gradients of the forward's outputs that the backward receives): definition to
  last reader, except one-element tangents, through the whole backward: a scalar loss's seed
  (``torch.ones_like(loss)``, made by ``loss.backward()``) is held by ``torch.autograd.backward``
  until every backward has run (a fresh-user trial: a byte budget named by a refusal measured 4
  bytes above it). A larger tangent made by the engine (the gradient of the hidden state that a
  graph-broken step's later pair passes back) is freed at its last reader, as measured;
* temporaries: definition to last reader.

Memory at step ``s`` is the sum of the buffers live at ``s`` (a node's output is allocated while
its inputs are still live). Sizes are storage bytes from ``meta["val"]``; symbolic sizes are kept
as sympy expressions and evaluated with the shape environment's hints.

Reads ``node.meta["val"]``; writes nothing. Host tensors made by ``trinity::evict`` (and backward
placeholders that only feed ``trinity::prefetch``) are host memory and are not counted. A
parameter whose storage ``trinity::param_fetch`` / ``param_release`` nodes fetch and release
(parameter offload, rewritten graphs) counts only where it is resident (see
:attr:`Buffer.resident_steps`).
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
import sympy
import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..graph_pair import GraphPair, called_op, hint_int, is_rng_state, tensor_vals
from ..ir.alias import plain_tensors, schema_view_of, span_bytes, tensor_span_bytes
from ..ir.meta import TARGET_DEVICE_KEY
from ..ir.ops import EVICT, PARAM_FETCH, PARAM_RELEASE, PREFETCH
from ..ir.refs import node_ref
from .gc_pause import paused_gc
from .margins import WorkspaceMargins

__all__ = [
    "BufferKind",
    "Buffer",
    "SavedTensor",
    "Step",
    "Liveness",
    "analyze",
    "graph_device",
    "inductor_layout_opt",
    "layout_copies",
    "table_workspace_bytes",
]


class BufferKind(str, enum.Enum):
    """What a buffer is, by AOTAutograd's own bookkeeping (never by names)."""

    PARAMETER = "parameter"
    INPUT = "input"
    HOST = "host"
    OUTPUT = "output"
    GRADIENT = "gradient"
    SAVED = "saved activation"
    TANGENT = "tangent"
    TEMPORARY = "temporary"
    LAYOUT_COPY = "layout copy"
    """A copy the inner compiler makes of a graph input in another memory layout (Inductor's
    channels-last copy of a convolution's input or weight, :func:`layout_copies`); no FX node holds it."""


# Kinds a run of the pair keeps on the device for its backward (Liveness.boundary_saved).
_KEPT_KINDS = frozenset({BufferKind.SAVED, BufferKind.LAYOUT_COPY})

# When aliases disagree, the first kind in this order wins (a saved view of a parameter is a
# parameter; a saved tensor that is also a user output stays with the user).
_PRIORITY = list(BufferKind)


@dataclass(frozen=True)
class Step:
    """One node of the joint schedule: ``node`` is its name, ``ref`` the node itself (a reference
    into the graphs analysed, see :mod:`offload_compiler.ir.refs`)."""

    index: int
    graph: str  # "forward" or "backward"
    node: str
    op: str
    is_placeholder: bool
    is_output: bool
    ref: fx.Node | None = node_ref()


@dataclass(frozen=True)
class Buffer:
    """One storage and its live range (steps are joint-schedule indices, inclusive).

    Attributes:
        size_bytes: storage bytes, evaluated with shape hints.
        size_expr: the same as a sympy expression (an Integer for static shapes).
        on_device: whether the bytes count against the device budget.
        nodes: ``"forward:name"`` / ``"backward:name"`` of every node holding it (for display).
        holders: the same nodes, as references into the graphs analysed (what the rewrites use;
            see :mod:`offload_compiler.ir.refs`).
        saved: indices into :attr:`Liveness.saved` of the saved tensors that are views of it.
        last_fw_use / first_bw_use: last forward reader and first backward reader (graph outputs
            excluded); ``None`` when there is none.
        source_step: the earliest forward node holding it as a single tensor (its data is final
            there: the graphs are functional), from which a copy can start.
        fused: a temporary the inner compiler is expected to fuse away (never allocated); not
            counted in live bytes. Only with ``assume_fusion``.
        resident_steps: ``(first, last)`` inclusive intervals where the storage is on the device,
            for a parameter that ``trinity::param_fetch`` / ``param_release`` nodes fetch and
            release (empty otherwise: the storage counts from ``def_step`` to ``last_step``). A
            parameter is resident when the step starts if its forward release writes back
            (``offload="activations+params"``), else from its first fetch; each fetch starts an
            interval, the next release ends it (at the release node), the schedule's end ends
            the last one.
    """

    id: int
    kind: BufferKind
    size_bytes: int
    size_expr: sympy.Expr
    device: str
    on_device: bool
    def_step: int
    last_step: int
    use_steps: tuple[int, ...]
    nodes: tuple[str, ...]
    saved: tuple[int, ...]
    last_fw_use: int | None
    first_bw_use: int | None
    source_step: int | None = None
    fused: bool = False
    resident_steps: tuple[tuple[int, int], ...] = ()
    holders: tuple[fx.Node, ...] = node_ref(())

    def intervals(self) -> tuple[tuple[int, int], ...]:
        """The inclusive step intervals where the storage holds device memory."""
        return self.resident_steps or ((self.def_step, self.last_step),)

    @property
    def idle_gap_steps(self) -> int:
        """Steps between the last forward reader and the first backward reader (0 if none)."""
        if self.last_fw_use is None or self.first_bw_use is None:
            return 0
        return max(0, self.first_bw_use - self.last_fw_use - 1)


@dataclass(frozen=True)
class SavedTensor:
    """One tensor the forward saves for the backward.

    Attributes:
        index: position among :attr:`Liveness.saved`.
        fw_output_index: position in the forward graph's output tuple.
        fw_node / bw_node: the forward node and the backward placeholder (names).
        fw_ref / bw_ref: the same nodes, as references into the graphs analysed.
        copy_bytes: bytes a copy of this view moves (first to last element), with hints.
        view_key: (size, stride, storage offset, dtype); equal keys on one buffer are the same
            view and share one host copy.
        storage_offset: offset of the first element in the storage (elements, with hints).
        itemsize: bytes per element.
        static: whether size, stride and offset are plain ints (no symbols).
        same_view_as_source: whether it is exactly the view held by its buffer's source node
            (size, stride and offset equal, symbolically).
        evictable: whether it may be moved to host memory; ``reason`` says why not.
    """

    index: int
    fw_output_index: int
    fw_node: str
    bw_node: str | None
    buffer: int
    def_step: int
    first_bw_use: int | None
    last_bw_use: int | None
    copy_bytes: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    device: str
    view_key: tuple
    storage_offset: int
    itemsize: int
    static: bool
    same_view_as_source: bool
    evictable: bool
    reason: str
    fw_ref: fx.Node | None = node_ref()
    bw_ref: fx.Node | None = node_ref()


@dataclass(frozen=True)
class Liveness:
    """Result of :func:`analyze`. ``live_bytes()[s]`` is the device bytes live at step ``s``;
    ``node_step`` maps each node of the schedule (a reference) to its step."""

    steps: tuple[Step, ...]
    num_fw_steps: int
    buffers: tuple[Buffer, ...]
    saved: tuple[SavedTensor, ...]
    device: str
    workspace_bytes: tuple[int, ...] = ()
    step_of: dict = field(repr=False, compare=False, hash=False, default_factory=dict)
    save_only_steps: frozenset[int] = frozenset()
    """Steps of forward nodes that exist only to be saved: views (a partitioner's late ``detach``
    or ``t(t(weight))``) whose readers are the forward's output or other such views. Their reads
    are not forward uses (``Buffer.last_fw_use`` leaves them out)."""
    node_step: dict = node_ref({})

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def live_bytes(self) -> np.ndarray:
        """Device bytes live at each step (int64 array of length ``num_steps``)."""
        return self._live_bytes.copy()

    @cached_property
    def _live_bytes(self) -> np.ndarray:
        diff = np.zeros(self.num_steps + 1, dtype=np.int64)
        for b in self.buffers:
            if b.on_device and b.size_bytes and not b.fused:
                for first, last in b.intervals():
                    diff[first] += b.size_bytes
                    diff[last + 1] -= b.size_bytes
        live = np.cumsum(diff[:-1])
        if self.workspace_bytes:
            live += np.asarray(self.workspace_bytes, dtype=np.int64)
        return live

    def fused_holders(self) -> frozenset:
        """The nodes holding a buffer Inductor fuses into its reader (``Buffer.fused``)."""
        return frozenset(h for b in self.buffers if b.fused for h in b.holders)

    @property
    def peak_bytes(self) -> int:
        return int(self._live_bytes.max()) if self.num_steps else 0

    @property
    def peak_step(self) -> int:
        return int(self._live_bytes.argmax()) if self.num_steps else 0

    def bytes_by_kind(self, step: int, removed: frozenset[int] = frozenset()) -> dict[str, int]:
        """Device bytes live at ``step`` by buffer kind, leaving out buffer ids in ``removed``."""
        out: dict[str, int] = {}
        for b in self.buffers:
            if (
                b.on_device
                and not b.fused
                and b.id not in removed
                and any(first <= step <= last for first, last in b.intervals())
            ):
                out[b.kind.value] = out.get(b.kind.value, 0) + b.size_bytes
        if self.workspace_bytes and self.workspace_bytes[step]:
            out["workspace"] = self.workspace_bytes[step]
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def step_named(self, graph: str, node: str) -> int:
        """The step of the node named ``node`` in ``graph`` (for reports and tests; passes use
        :meth:`step_at`)."""
        return self.step_of[(graph, node)]

    def step_at(self, node: fx.Node) -> int:
        """The step of ``node``, a node of the graphs analysed.

        Raises:
            KeyError: for a node that is not in the schedule.
        """
        return self.node_step[node]

    def rebind(self, nodes: Sequence[fx.Node]) -> Liveness:
        """This liveness with its node references moved to ``nodes``: the joint schedule (forward
        nodes, then backward nodes) of other graphs that are, step for step, the graphs analysed.

        The one place a result made on copied graphs finds its nodes in the graphs being
        rewritten: the planner analyses a copy rewritten by ``insert_recompute`` and the pipeline
        then repeats that rewrite on the real graphs (``pipeline._insert_recompute``), so the two
        schedules agree by position; they are checked to agree by name and op too.

        Raises:
            ValueError: if ``nodes`` is not such a schedule.
        """
        nodes = list(nodes)
        if len(nodes) != len(self.steps) or any(
            n.name != s.node or _op_name(n) != s.op for n, s in zip(nodes, self.steps)
        ):
            raise ValueError("liveness.rebind: the nodes are not the schedule this liveness was computed on")
        moved = {s.ref: n for s, n in zip(self.steps, nodes)}
        return replace(
            self,
            steps=tuple(replace(s, ref=n) for s, n in zip(self.steps, nodes)),
            buffers=tuple(replace(b, holders=tuple(moved[h] for h in b.holders)) for b in self.buffers),
            saved=tuple(
                replace(s, fw_ref=moved.get(s.fw_ref), bw_ref=moved.get(s.bw_ref) if s.bw_ref is not None else None)
                for s in self.saved
            ),
            node_step={n: i for i, n in enumerate(nodes)},
        )

    @cached_property
    def boundary_saved(self) -> dict[int, int]:
        """Buffer id -> device bytes of every saved activation alive across the forward/backward
        boundary (live at the forward's last step and after it): what one run of the pair keeps
        on the device for its backward unless it is evicted or recomputed. The inner compiler's
        layout copies saved in place of inputs (:func:`layout_copies`) are kept the same way. A pair run N times
        per step holds N - 1 runs' worth beside its last run (:func:`.plan_window.plan`'s
        ``earlier_runs``)."""
        boundary = self.num_fw_steps - 1
        out: dict[int, int] = {}
        for b in self.buffers:
            if not b.on_device or b.fused or b.kind not in _KEPT_KINDS or not b.size_bytes:
                continue
            if any(first <= boundary < last for first, last in b.intervals()):
                out[b.id] = b.size_bytes
        return out

    def candidates(self, min_bytes: int = 0) -> list[Buffer]:
        """Buffers that may be evicted: saved activations on the device, every saved view of
        which is evictable, of at least ``min_bytes``."""
        out = []
        for b in self.buffers:
            if b.kind is not BufferKind.SAVED or not b.on_device or b.size_bytes < min_bytes:
                continue
            if not b.saved or not all(self.saved[i].evictable for i in b.saved):
                continue
            if b.last_fw_use is None or b.first_bw_use is None:
                continue
            out.append(b)
        return out


def _op_name(node: fx.Node) -> str:
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return node.op


def _size_expr(nbytes) -> sympy.Expr:
    if isinstance(nbytes, torch.SymInt):
        return sympy.sympify(nbytes.node.expr)
    return sympy.Integer(int(nbytes))


def graph_device(pair: GraphPair) -> torch.device:
    """The compute device of a graph pair: the accelerator its forward inputs live on, else CPU."""
    counts: dict[torch.device, int] = {}
    for node in pair.forward.graph.find_nodes(op="placeholder"):
        for t in tensor_vals(node):
            counts[t.device] = counts.get(t.device, 0) + 1
    accel = [d for d in counts if d.type != "cpu"]
    if accel:
        return max(accel, key=lambda d: counts[d])
    return torch.device("cpu")


class _UnionFind:
    def __init__(self):
        self.parent: dict = {}

    def find(self, x):
        self.parent.setdefault(x, x)
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a, b) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra


# Bytes an op allocates and frees inside itself (beyond its outputs), as a multiple of the bytes
# of one of its tensors: (argument index, or -1 for the first output) -> factor. Measured with
# torch.profiler's allocator trace on CPU, torch 2.13 (bench/workspace_probe.py reproduces it);
# on CUDA the same factors serve as an estimate (cuDNN workspaces are of the same order) until a
# calibration replaces them. Ops not listed are taken to need none (mm, addmm, layer norm, the
# flash-attention forward, embedding and the cross-entropy ops measured at ~0).
_WORKSPACE = {
    torch.ops.aten.convolution.default: (-1, 1.0),
    torch.ops.aten.convolution_backward.default: (0, 2.0),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (0, 1.0),
    torch.ops.aten.native_batch_norm_backward.default: (0, 1.0),
    # (input - target)^2 in full before the reduction (reduction="none" needs none: overcounted).
    torch.ops.aten.mse_loss.default: (0, 1.0),
    # The CPU kernel draws its Bernoulli noise into a tensor of the input's size and dtype, then
    # makes the mask and output from it (fp32 and bf16 alike). A fresh-user trial's MLP with
    # dropout (inner="eager") measured 4 MiB per call above its plan at the first step.
    torch.ops.aten.native_dropout.default: (0, 1.0),
    # grad * mask * scale with the bool mask converted to grad's dtype first (fp32 and bf16
    # alike): a second fresh-user trial's attention blocks measured 12 MiB per call above the
    # plan at the first step of every new size (dynamic shapes), replanned only after it.
    torch.ops.aten.native_dropout_backward.default: (0, 1.0),
}


def _safe_softmax_workspace(node: fx.Node, args) -> int:
    """``aten._safe_softmax`` (SDPA's math path, with dropout or a mask) on CPU: a bool mask of
    the input's size (which elements are -inf), a bool per row (whether all are), and the fill
    value, a 0-d tensor of the input's dtype: ``numel + numel / size[dim] + element_size``
    bytes (bench/workspace_probe.py; torch 2.13, fp32 and bf16 alike; a sixth fresh-user trial's
    attention blocks measured these 16,900 bytes above the plan at the first step)."""
    t = args[0].meta.get("val") if args and isinstance(args[0], fx.Node) else None
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return 0
    dim = args[1] if len(args) > 1 and isinstance(args[1], int) else -1
    numel = hint_int(t.numel())
    return numel + numel // max(1, hint_int(t.shape[dim])) + t.element_size()


# Workspaces that are no multiple of one tensor's bytes: op -> f(node, args) -> bytes.
_SAFE_SOFTMAX = getattr(getattr(torch.ops.aten, "_safe_softmax", None), "default", None)
_WORKSPACE_FN = {_SAFE_SOFTMAX: _safe_softmax_workspace} if _SAFE_SOFTMAX is not None else {}

# Outputs whose real storage is larger than their fake value's: op -> (argument index, factor of
# that argument's bytes). aten.mse_loss returns its scalar in a storage of the input's size (CPU,
# torch 2.13; bench/workspace_probe.py prints it), alive as long as the loss is.
_OUTPUT_STORAGE = {
    torch.ops.aten.mse_loss.default: (0, 1.0),
}


def _output_storage_floor(node: fx.Node) -> int:
    """The real storage bytes of ``node``'s output from :data:`_OUTPUT_STORAGE` (0: its fake value's)."""
    if node.op != "call_function" or node.target not in _OUTPUT_STORAGE:
        return 0
    which, factor = _OUTPUT_STORAGE[node.target]
    arg = node.args[which] if which < len(node.args) else None
    t = arg.meta.get("val") if isinstance(arg, fx.Node) else None
    if not isinstance(t, torch.Tensor):
        return 0
    return int(factor * hint_int(t.untyped_storage().nbytes()))


def loss_output_bytes(pair: GraphPair) -> int:
    """Device bytes of the storages of the one-element outputs that ``pair``'s forward returns to
    the caller (among its first ``num_fwd_outputs``): a loss, which the caller holds while it calls
    ``backward()`` on it, so through the backward of every graph pair of the step. Each storage
    once, whole, at least the real storage :data:`_OUTPUT_STORAGE` gives its op (``mse_loss``
    returns its scalar in a storage of its input's size); storages of the forward's inputs are
    not counted. Larger outputs (logits) may or may not be held (``model(**batch).loss.backward()``
    drops them first): :mod:`offload_compiler.step_check` measures that."""
    device = graph_device(pair)
    inputs = {
        StorageWeakRef(t.untyped_storage())
        for n in pair.forward.graph.find_nodes(op="placeholder")
        for t in plain_tensors(tensor_vals(n))
    }
    seen: dict = {}
    for i, n in enumerate(pair.fw_outputs()):
        if i >= pair.num_fwd_outputs or not isinstance(n, fx.Node):
            continue
        for t in plain_tensors(tensor_vals(n)):
            if hint_int(t.numel()) != 1 or (t.device != device and device.type != "cpu"):
                continue
            key = StorageWeakRef(t.untyped_storage())
            if key in inputs:
                continue
            nbytes = max(hint_int(t.untyped_storage().nbytes()), _output_storage_floor(n))
            seen[key] = max(seen.get(key, 0), nbytes)
    return sum(seen.values())


def _workspace(node: fx.Node) -> int:
    """Transient bytes of ``node`` from :data:`_WORKSPACE` (0 for ops not listed)."""
    if node.op != "call_function":
        return 0
    target, args, _ = called_op(node)  # a random op under an RNG-state wrapper: the op's
    if target in _WORKSPACE_FN:
        return int(_WORKSPACE_FN[target](node, args))
    if target not in _WORKSPACE:
        return 0
    which, factor = _WORKSPACE[target]
    if which < 0:
        vals = tensor_vals(node)
        if target is not node.target and len(vals) > 1:
            vals = vals[1:]  # run_and_save_rng_state: (state, result)
        t = vals[0] if vals else None
    else:
        arg = args[which] if which < len(args) else None
        t = arg.meta.get("val") if isinstance(arg, fx.Node) else None
    if not isinstance(t, torch.Tensor):
        return 0
    nbytes = tensor_span_bytes(t)
    return int(factor * nbytes)


def table_workspace_bytes(node: fx.Node) -> int:
    """The op workspace the plan models for ``node`` from :data:`_WORKSPACE` alone (bytes, with
    shape hints; 0 for ops not listed), before any measured margin."""
    return _workspace(node)


def _view_exprs(t: torch.Tensor) -> tuple:
    """(sizes, strides, offset, dtype) with symbols as sympy expressions, for exact comparison."""

    def ex(v):
        return v.node.expr if isinstance(v, torch.SymInt) else int(v)

    return (tuple(ex(v) for v in t.shape), tuple(ex(v) for v in t.stride()), ex(t.storage_offset()), t.dtype)


def _alias_reader_steps(root: fx.Node, node_keys: dict, node_step: dict, reader_step) -> tuple[int, int] | None:
    """(first, last) step at which ``root`` or a view taken from it (transitively) is read: the
    first reader's own step (the data must be ready there) and the last step a reader's kernel
    runs (the end of its fused chain). ``None`` when nothing reads it."""
    first = last = None
    frontier = [root]
    seen = {root}
    while frontier:
        node = frontier.pop()
        keys = set(node_keys.get(node, ()))
        for user in node.users:
            if user.op == "output":
                continue
            s, e = node_step[user], reader_step(user)
            first = s if first is None else min(first, s)
            last = e if last is None else max(last, e)
            if user not in seen and keys & set(node_keys.get(user, ())):
                seen.add(user)
                frontier.append(user)
    return None if first is None else (first, last)


_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d"})


def _is_collective(node: fx.Node) -> bool:
    """A distributed collective (``torch.distributed`` functional or in-place c10d op)."""
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target.namespace in _COLLECTIVE_NAMESPACES
    )


def fused_chain_end(node: fx.Node, fused_nodes: set) -> fx.Node:
    """The node whose kernel computes ``node``: ``node`` itself, or, for a node fused into its
    only reader, the end of that chain."""
    while node in fused_nodes:
        (node,) = node.users
    return node


def _is_host_placeholder(node: fx.Node) -> bool:
    return (
        node.op == "placeholder"
        and bool(node.users)
        and all(u.op == "call_function" and u.target is PREFETCH and u.args[0] is node for u in node.users)
    )


def _fusible(node: fx.Node, device_type: str | None = None) -> bool:
    """A node Inductor computes inside its only reader's kernel and never allocates: a pointwise
    op whose only reader is a pointwise op, a reduction or ``gather`` (:func:`inlining_reader`),
    or an ``mm`` that Inductor's ``addmm`` pattern fuses into that reader (:func:`addmm_fused_into`)."""
    if addmm_fused_into(node, device_type) is not None:
        return True
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if torch.Tag.pointwise not in node.target.tags or len(node.users) != 1:
        return False
    if becomes_addmm(node, device_type):
        return False  # an add that becomes an extern addmm kernel is allocated
    (user,) = node.users
    return inlining_reader(user, device_type)


_INLINING_READERS = frozenset({torch.ops.aten.gather.default})
"""Ops other than pointwise ops and reductions that Inductor lowers to a ``Pointwise`` loading
their input in place (``torch/_inductor/lowering.py``: ``gather``)."""


def inlining_reader(node: fx.Node, device_type: str | None = None) -> bool:
    """Whether Inductor computes a single-reader pointwise input of ``node`` inside ``node``'s
    kernel: ``node`` is a pointwise op, a reduction or ``gather``, and not an ``add`` that
    Inductor's ``addmm`` pattern turns into an extern kernel (:func:`addmm_fused_into`)."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return False
    if not (torch.Tag.pointwise in t.tags or torch.Tag.reduction in t.tags or t in _INLINING_READERS):
        return False
    return not becomes_addmm(node, device_type)


def becomes_addmm(node: fx.Node, device_type: str | None = None) -> bool:
    """Whether ``node`` is the ``add`` that Inductor's ``addmm`` pattern turns into an extern
    ``addmm`` kernel with one of its inputs (:func:`addmm_fused_into`)."""
    return any(addmm_fused_into(a, device_type) is node for a in node.all_input_nodes)


_GPU_DEVICE_TYPES = frozenset({"cuda", "xpu", "mtia"})


def addmm_fused_into(node: fx.Node, device_type: str | None = None) -> fx.Node | None:
    """The ``add`` that Inductor's post-grad ``addmm`` pattern fuses ``node`` (an ``aten.mm``)
    into, or ``None``.

    ``torch/_inductor/fx_passes/post_grad.py`` (``addmm``, ``is_valid_addmm_fusion``,
    ``should_prefer_unfused_addmm``) replaces ``add(mm(a, b), c)`` (either argument order, no
    ``alpha``, the mm read by the add alone, ``c`` a tensor of the mm's dtype that broadcasts to
    its shape) with ``addmm(c, a, b)`` *at the add*: the product then runs where the add is, so
    ``a`` and ``b`` stay allocated up to there and the product itself is never allocated. On a
    GPU the pattern is skipped when every reader of the add is pointwise. ``device_type``: the
    device the graph is compiled for (``None``: the fake value's; liveness passes
    :data:`~offload_compiler.ir.meta.TARGET_DEVICE_KEY` of the forward where set). A tied weight's two
    gradient terms (a language model's head and its token embedding) are the common case: the
    head's product moves from the start of the backward to its end, with the logits' gradient.
    """
    if not _is_single_use_mm(node):
        return None
    (add,) = node.users
    if add.op != "call_function" or add.target is not torch.ops.aten.add.Tensor or add.kwargs or len(add.args) != 2:
        return None
    a, b = add.args
    if (a is node) == (b is node):
        return None
    # add(mm_a, mm_b): the pattern with the product second is tried first, so mm_b is fused
    # (checked with torch 2.13: ``addmm(mm_a, c, d)``).
    if a is node and _is_single_use_mm(b) and _addmm_valid(b, a, device_type):
        return None
    return add if _addmm_valid(node, b if a is node else a, device_type) else None


def _is_single_use_mm(node) -> bool:
    return (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target is torch.ops.aten.mm.default
        and len(node.users) == 1
    )


def _addmm_valid(node: fx.Node, inp, device_type: str | None) -> bool:
    """``is_valid_addmm_fusion`` and ``should_prefer_unfused_addmm`` of Inductor's post-grad
    pass for ``add(node, inp)`` (``node`` an ``aten.mm``)."""
    (add,) = node.users
    vals = [x.meta.get("val") if isinstance(x, fx.Node) else None for x in (inp, *node.args[:2], node)]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return False
    v_inp, v_a, v_b, v_out = vals
    if not (v_inp.dtype == v_a.dtype == v_b.dtype):
        return False
    try:
        if torch.broadcast_shapes(v_inp.shape, v_out.shape) != v_out.shape:
            return False
    except (RuntimeError, ValueError):
        return False
    on_gpu = (device_type or v_out.device.type) in _GPU_DEVICE_TYPES
    return not (on_gpu and all(_is_pointwise_use(u) for u in add.users))


def _is_pointwise_use(use: fx.Node) -> bool:
    """Inductor's ``is_pointwise_use`` (``torch/_inductor/utils.py``): a pointwise op, or a view
    (or ``getitem``) all of whose readers are pointwise uses."""
    if use.op != "call_function":
        return False
    if use.target is operator.getitem:
        return all(_is_pointwise_use(u) for u in use.users)
    if not isinstance(use.target, torch._ops.OpOverload):
        return False
    if use.target.is_view:
        return all(_is_pointwise_use(u) for u in use.users)
    return torch.Tag.pointwise in use.target.tags


def analyze(pair: GraphPair, assume_fusion: bool = False, margins: WorkspaceMargins | None = None) -> Liveness:
    """Buffers, live ranges and saved tensors of ``pair`` over the joint schedule.

    With ``assume_fusion`` (the inner compiler is Inductor), a temporary made by a pointwise op
    whose only reader is pointwise or a reduction is taken to be fused away (see
    :attr:`Buffer.fused`), and so is a matrix product that Inductor's ``addmm`` pattern moves into
    the add reading it (:func:`addmm_fused_into`); the channels-last copies Inductor makes of a
    convolution's inputs and weights are buffers of their own (:func:`layout_copies`). With ``margins`` (workspace measured on this machine, see
    :mod:`.margins`), a node's workspace is the larger of :data:`_WORKSPACE`'s and the measured one,
    plus the margins' uniform reserve (:attr:`~.margins.WorkspaceMargins.reserve_bytes`).

    The phases, one function each: the joint schedule (:func:`_schedule`), storage keys and their
    union across the saved links (:func:`_storage_keys`), buffer kinds (:func:`_buffer_kinds`),
    save-only views (:func:`_save_only_views`), fused temporaries (:func:`_fused_nodes`),
    definitions and uses (:func:`_defs_and_uses`), collectives' storages
    (:func:`_collective_roots`), parameter residency (:func:`_resident_intervals`), saved tensors
    (:func:`_saved_tensors`) and buffers (:func:`_buffers`).

    Raises:
        ValueError: if a node's ``meta["val"]`` is missing where a tensor is expected (the graphs
            were not traced with fake tensors).

    Python's cyclic garbage collector is paused while it runs (:mod:`.gc_pause`).
    """
    with paused_gc():
        return _analyze(pair, assume_fusion, margins)


def _analyze(pair: GraphPair, assume_fusion: bool, margins: WorkspaceMargins | None) -> Liveness:
    """:func:`analyze` without pausing the garbage collector (:mod:`.gc_pause`)."""
    device = graph_device(pair)
    fw_nodes = list(pair.forward.graph.nodes)
    bw_nodes = list(pair.backward.graph.nodes)
    sched = _schedule(fw_nodes, bw_nodes)
    links = pair.saved_links()
    keys = _storage_keys(fw_nodes, bw_nodes, links)
    kind_of = _buffer_kinds(pair, fw_nodes, keys, links)
    save_only = _save_only_views(fw_nodes, keys.node_keys)
    target = getattr(pair.forward, "meta", {}).get(TARGET_DEVICE_KEY)
    fused_nodes = _fused_nodes(sched.nodes, keys, kind_of, target) if assume_fusion else set()

    def reader_step(n: fx.Node) -> int:
        return sched.node_step[fused_chain_end(n, fused_nodes)]

    roots = _defs_and_uses(sched, keys, save_only, reader_step)
    saved, saved_of_root = _saved_tensors(
        links, keys, kind_of, roots, sched.node_step, device, _collective_roots(sched.nodes, keys), reader_step
    )
    buffers = _buffers(
        roots, keys, kind_of, saved_of_root, _resident_intervals(sched, keys), fused_nodes, sched, device
    )
    if assume_fusion:
        buffers += layout_copies(pair, sched, keys, roots, len(buffers), device, target)
    return Liveness(
        steps=sched.steps,
        num_fw_steps=sched.num_fw,
        buffers=tuple(buffers),
        saved=tuple(saved),
        device=str(device),
        workspace_bytes=tuple(
            max(_workspace(n), margins.node_bytes(n)) + margins.reserve_bytes if margins is not None else _workspace(n)
            for n in sched.nodes
        ),
        step_of=sched.step_of,
        save_only_steps=frozenset(sched.node_step[n] for n in save_only),
        node_step=sched.node_step,
    )


@dataclass(frozen=True)
class _Schedule:
    """The joint schedule: forward nodes (steps ``0 .. num_fw-1``), then backward nodes."""

    nodes: list[fx.Node]
    num_fw: int
    steps: tuple[Step, ...]
    step_of: dict[tuple[str, str], int]
    node_step: dict[fx.Node, int]

    @property
    def last(self) -> int:
        return len(self.nodes) - 1


def _schedule(fw_nodes: list[fx.Node], bw_nodes: list[fx.Node]) -> _Schedule:
    """The joint schedule of the two graphs' nodes.

    Raises:
        ValueError: for a node without ``meta["val"]`` (see :func:`analyze`).
    """
    for graph_name, nodes in (("forward", fw_nodes), ("backward", bw_nodes)):
        for n in nodes:
            if n.op in ("call_function", "placeholder") and "val" not in n.meta:
                raise ValueError(
                    f"liveness: {graph_name} node {n.name!r} ({n.op} {n.target}) has no meta['val']; the "
                    "graphs must be traced with fake tensors (as AOTAutograd does)"
                )
    num_fw = len(fw_nodes)
    steps: list[Step] = []
    step_of: dict[tuple[str, str], int] = {}
    node_step: dict[fx.Node, int] = {}
    for graph_name, nodes, offset in (("forward", fw_nodes, 0), ("backward", bw_nodes, num_fw)):
        for i, n in enumerate(nodes):
            s = offset + i
            steps.append(Step(s, graph_name, n.name, _op_name(n), n.op == "placeholder", n.op == "output", n))
            step_of[(graph_name, n.name)] = s
            node_step[n] = s
    return _Schedule(fw_nodes + bw_nodes, num_fw, tuple(steps), step_of, node_step)


@dataclass(frozen=True)
class _Keys:
    """Storage keys per node (one per plain tensor of its value) and their union-find: the root
    of a key is its buffer. ``node_roots``: each node's keys' roots, computed once the union-find
    is complete (every union is made in :func:`_storage_keys`, which builds this)."""

    uf: _UnionFind
    node_keys: dict[fx.Node, list]
    key_tensor: dict
    node_roots: dict[fx.Node, list]

    def roots(self, node: fx.Node) -> list:
        """The buffers (union-find roots) of ``node``'s plain tensors; ``[]`` for a node with none."""
        return self.node_roots.get(node, [])


def _storage_keys(fw_nodes: list[fx.Node], bw_nodes: list[fx.Node], links: list) -> _Keys:
    """Storage keys per node, by the IR's aliasing rule (:mod:`offload_compiler.ir.alias`).

    Aliasing is derived per graph from the graph's structure: an op's output is a view of an input
    when their fake storages are the same, else it is a fresh allocation of that node. (Fake
    storages cannot be compared across the two graphs: the partitioner copies recomputed nodes
    into the backward with the forward's fake values.) Placeholders that alias each other share a
    key. The two graphs are joined only where a saved tensor crosses: forward output <-> backward
    placeholder."""
    uf = _UnionFind()
    node_keys: dict[fx.Node, list] = {}
    key_tensor: dict = {}
    # Each node's plain tensors' storages, made once (a reader looks its inputs' up here), by
    # their storage's address (``_cdata``, what StorageWeakRef hashes and compares, without
    # making a weak reference per lookup): every value is held by its node's meta while this runs.
    node_storages: dict[fx.Node, list] = {}
    for graph_name, nodes in (("forward", fw_nodes), ("backward", bw_nodes)):
        for n in nodes:
            keys = []
            input_keys: dict = {}
            if n.op != "placeholder":
                for m in n.all_input_nodes:
                    for st, k in zip(node_storages.get(m, ()), node_keys.get(m, ())):
                        input_keys.setdefault(st, k)
            tensors = plain_tensors(tensor_vals(n))
            storages = [t.untyped_storage()._cdata for t in tensors]
            node_storages[n] = storages
            for i, (t, st) in enumerate(zip(tensors, storages)):
                if n.op == "placeholder":
                    k = ("placeholder", graph_name, st)
                elif st in input_keys:
                    k = input_keys[st]
                elif (src := schema_view_of(n, i)) is not None and len(node_keys.get(src, ())) == 1:
                    # A view op whose fake value came from the other graph (a recomputed node):
                    # its schema still says whose storage it shares.
                    k = node_keys[src][0]
                else:
                    k = ("node", graph_name, n.name, i)
                uf.find(k)
                key_tensor.setdefault(k, t)
                keys.append(k)
            node_keys[n] = keys
    for link in links:
        ph = link.bw_placeholder
        if ph is not None and node_keys.get(link.fw_node) and node_keys.get(ph):
            uf.union(node_keys[link.fw_node][0], node_keys[ph][0])
    find = uf.find
    node_roots = {n: [find(k) for k in keys] for n, keys in node_keys.items()}
    return _Keys(uf, node_keys, key_tensor, node_roots)


def _buffer_kinds(pair: GraphPair, fw_nodes: list[fx.Node], keys: _Keys, links: list) -> dict:
    """``root -> BufferKind`` from AOTAutograd's bookkeeping (never from names); where aliases
    disagree the first kind in :data:`_PRIORITY` wins."""
    kind_of: dict = {}

    def mark(node: fx.Node, kind: BufferKind) -> None:
        for r in keys.roots(node):
            old = kind_of.get(r)
            if old is None or _PRIORITY.index(kind) < _PRIORITY.index(old):
                kind_of[r] = kind

    static = set(pair.static_input_indices)
    for i, n in enumerate(pair.forward.graph.find_nodes(op="placeholder")):
        mark(n, BufferKind.PARAMETER if i in static else BufferKind.INPUT)
    for n in fw_nodes:
        if n.op == "call_function" and n.target is EVICT:
            mark(n, BufferKind.HOST)
    for n in pair.backward.graph.find_nodes(op="placeholder"):
        if _is_host_placeholder(n):
            mark(n, BufferKind.HOST)
    for i, out in enumerate(pair.fw_outputs()):
        if i < pair.num_fwd_outputs and isinstance(out, fx.Node):
            mark(out, BufferKind.OUTPUT)
    bw_out = pair.bw_output_node().args[0]
    for out in bw_out if isinstance(bw_out, (tuple, list)) else [bw_out]:
        if isinstance(out, fx.Node):
            mark(out, BufferKind.GRADIENT)
    saved_placeholders = set()
    for link in links:
        mark(link.fw_node, BufferKind.SAVED)
        if link.bw_placeholder is not None:
            saved_placeholders.add(link.bw_placeholder)
    for n in pair.backward.graph.find_nodes(op="placeholder"):
        if n not in saved_placeholders:
            mark(n, BufferKind.TANGENT)
    return kind_of


def _save_only_views(fw_nodes: list[fx.Node], node_keys: dict) -> set[fx.Node]:
    """Views that exist only to be saved (the partitioner's late ``detach`` of an activation):
    their reads are not forward uses for eviction planning; the rewrite replaces and removes them."""
    save_only: set[fx.Node] = set()
    for n in reversed(fw_nodes):
        if n.op != "call_function" or not n.users or not node_keys.get(n):
            continue
        in_keys = {k for m in n.all_input_nodes for k in node_keys.get(m, ())}
        if set(node_keys[n]) <= in_keys and all(u.op == "output" or u in save_only for u in n.users):
            save_only.add(n)
    return save_only


def _fused_nodes(nodes: list[fx.Node], keys: _Keys, kind_of: dict, device_type: str | None = None) -> set[fx.Node]:
    """With fusion, a pointwise node whose only reader is pointwise or a reduction is computed
    inside that reader's kernel: it is never allocated, and what it reads is read where the chain
    of such nodes ends. Only temporaries held by that node alone."""
    holders: dict = {}
    for n in nodes:
        for r in keys.roots(n):
            holders.setdefault(r, set()).add(n)
    fused: set[fx.Node] = set()
    for n in nodes:
        node_keys = keys.node_keys.get(n)
        if (
            node_keys
            and len(node_keys) == 1
            and kind_of.get(keys.uf.find(node_keys[0]), BufferKind.TEMPORARY) is BufferKind.TEMPORARY
            and holders[keys.uf.find(node_keys[0])] == {n}
            and _fusible(n, device_type)
        ):
            fused.add(n)
    return fused


def _defs_and_uses(sched: _Schedule, keys: _Keys, save_only: set[fx.Node], reader_step) -> dict:
    """``root -> {"def", "uses", "nodes", "holders", "fw_uses", "bw_uses", "source", "source_any"}``:
    where each buffer is first held, every step that reads it (forward and backward uses apart,
    save-only views and graph outputs not counted as either), the nodes holding it (names and
    nodes), and its source node."""
    num_fw = sched.num_fw
    roots: dict = {}
    for n in sched.nodes:
        s = sched.node_step[n]
        for r in keys.roots(n):
            info = roots.setdefault(
                r,
                {
                    "def": s,
                    "uses": [],
                    "nodes": [],
                    "holders": [],
                    "fw_uses": [],
                    "bw_uses": [],
                    "source": None,
                    "source_any": n,
                },
            )
            info["def"] = min(info["def"], s)
            if info["source"] is None and s < num_fw and isinstance(n.meta.get("val"), torch.Tensor):
                info["source"] = n
            info["nodes"].append(("forward:" if s < num_fw else "backward:") + n.name)
            info["holders"].append(n)
        if n.op == "placeholder":
            continue
        # Data must be ready before the node itself (its place in the graph); it is read, and so
        # stays live, up to where the node's kernel runs (the end of its fused chain).
        read_first, read_last = s, reader_step(n)
        seen_roots = set()
        for m in n.all_input_nodes:
            for r in keys.roots(m):
                if r in seen_roots or r not in roots:
                    continue
                seen_roots.add(r)
                info = roots[r]
                info["uses"].append(read_last)
                if n.op != "output" and n not in save_only:
                    if s < num_fw:
                        info["fw_uses"].append(read_last)
                    else:
                        info["bw_uses"].append(read_first)
    return roots


def _collective_roots(nodes: list[fx.Node], keys: _Keys) -> dict:
    """``root -> collective node`` for storages a collective reads or writes: the collective runs
    on its own stream (NCCL), which trinity's copies are not ordered with, so such tensors stay
    on the device."""
    collective_of_root: dict = {}
    for n in nodes:
        if _is_collective(n):
            for m in (*n.all_input_nodes, n):
                for r in keys.roots(m):
                    collective_of_root.setdefault(r, n)
    return collective_of_root


def _resident_intervals(sched: _Schedule, keys: _Keys) -> dict:
    """Parameter offload (rewritten graphs): ``root -> ((first, last), ...)``, the steps where each
    fetched parameter's storage is resident (see :attr:`Buffer.resident_steps`)."""
    param_events: dict = {}  # root -> [(step, is_fetch, write_back)]
    for n in sched.nodes:
        if n.op == "call_function" and n.target in (PARAM_FETCH, PARAM_RELEASE) and n.args:
            node_keys = keys.node_keys.get(n.args[0]) if isinstance(n.args[0], fx.Node) else None
            if node_keys:
                write_back = n.target is PARAM_RELEASE and bool(n.args[2])
                param_events.setdefault(keys.uf.find(node_keys[0]), []).append(
                    (sched.node_step[n], n.target is PARAM_FETCH, write_back)
                )
    resident_of_root: dict = {}
    for r, events in param_events.items():
        start = 0 if any(wb for _, _, wb in events) else None
        intervals = []
        for s, is_fetch, _ in sorted(events):
            if is_fetch and start is None:
                start = s
            elif not is_fetch and start is not None:
                intervals.append((start, s))
                start = None
        if start is not None:
            intervals.append((start, sched.last))
        # A parameter never fetched is never resident: an empty interval (not "the whole step").
        resident_of_root[r] = tuple(intervals) if intervals else ((0, -1),)
    return resident_of_root


def _saved_tensors(
    links: list,
    keys: _Keys,
    kind_of: dict,
    roots: dict,
    node_step: dict,
    device: torch.device,
    collective_of_root: dict,
    reader_step,
) -> tuple[list[SavedTensor], dict]:
    """The saved tensors (whether each is evictable, and why not) and ``root -> [saved index]``."""
    root_id = {r: i for i, r in enumerate(roots)}
    saved_of_root: dict = {}
    saved: list[SavedTensor] = []
    for j, link in enumerate(links):
        node_keys = keys.node_keys.get(link.fw_node) or []
        val = link.fw_node.meta.get("val")
        ph = link.bw_placeholder
        reason = ""
        if not node_keys:
            reason = "not a plain strided tensor (subclass or sparse)"
        root = keys.uf.find(node_keys[0]) if node_keys else None
        kind = kind_of.get(root, BufferKind.TEMPORARY) if root is not None else None
        if not reason and kind is not BufferKind.SAVED:
            reason = f"aliases a {kind.value}" if kind else "no storage"
        if not reason and is_rng_state(link.fw_node):
            # A few KiB; and Inductor sees it as a real tensor, which no trinity op may take.
            reason = "random-number-generator state of a checkpointed random op"
        if not reason and (ph is None or not ph.users):
            reason = "no backward reader"
        if not reason and val.device != device:
            reason = f"on {val.device}, not the compute device {device}"
        if not reason and root in collective_of_root:
            c = collective_of_root[root]
            reason = (
                f"read or written by collective {c.name!r} ({c.target}); trinity's copies are not ordered "
                "with the collective's stream"
            )
        bw_reads = _alias_reader_steps(ph, keys.node_keys, node_step, reader_step) if ph is not None else None
        source = roots[root]["source"] if root is not None and root in roots else None
        same_view = source is not None and _view_exprs(source.meta["val"]) == _view_exprs(val)
        shape = tuple(hint_int(s) for s in val.shape)
        stride = tuple(hint_int(s) for s in val.stride())
        itemsize = val.element_size()
        saved.append(
            SavedTensor(
                index=j,
                fw_output_index=link.fw_output_index,
                fw_node=link.fw_node.name,
                bw_node=ph.name if ph is not None else None,
                buffer=root_id[root] if root is not None else -1,
                def_step=node_step[link.fw_node],
                first_bw_use=bw_reads[0] if bw_reads else None,
                last_bw_use=bw_reads[1] if bw_reads else None,
                copy_bytes=span_bytes(shape, stride, itemsize),
                shape=shape,
                stride=stride,
                dtype=str(val.dtype).replace("torch.", ""),
                device=str(val.device),
                view_key=(shape, stride, hint_int(val.storage_offset()), str(val.dtype)),
                storage_offset=hint_int(val.storage_offset()),
                itemsize=itemsize,
                static=all(isinstance(v, int) for v in (*val.shape, *val.stride(), val.storage_offset())),
                same_view_as_source=same_view,
                evictable=not reason,
                reason=reason,
                fw_ref=link.fw_node,
                bw_ref=ph,
            )
        )
        if root is not None:
            saved_of_root.setdefault(root, []).append(j)
    return saved, saved_of_root


def _buffers(
    roots: dict,
    keys: _Keys,
    kind_of: dict,
    saved_of_root: dict,
    resident_of_root: dict,
    fused_nodes: set[fx.Node],
    sched: _Schedule,
    device: torch.device,
) -> list[Buffer]:
    """One :class:`Buffer` per root, in the order the roots were first held."""
    num_fw, node_step = sched.num_fw, sched.node_step
    buffers: list[Buffer] = []
    for buffer_id, (r, info) in enumerate(roots.items()):
        kind = kind_of.get(r, BufferKind.TEMPORARY)
        t = keys.key_tensor[r] if r in keys.key_tensor else None
        nbytes = t.untyped_storage().nbytes() if t is not None else 0
        src = info["source_any"]
        floor = _output_storage_floor(src) if node_step[src] == info["def"] else 0
        if floor > hint_int(nbytes):
            nbytes = floor
        uses = sorted(info["uses"])
        end = max([info["def"]] + uses)
        if kind in (BufferKind.PARAMETER, BufferKind.INPUT, BufferKind.OUTPUT, BufferKind.GRADIENT) or (
            kind is BufferKind.TANGENT and t is not None and hint_int(t.numel()) == 1
        ):
            end = sched.last
        tdev = t.device if t is not None else device
        on_device = kind is not BufferKind.HOST and (tdev == device or device.type == "cpu")
        buffers.append(
            Buffer(
                id=buffer_id,
                kind=kind,
                size_bytes=hint_int(nbytes),
                size_expr=_size_expr(nbytes),
                device=str(tdev),
                on_device=on_device,
                def_step=info["def"],
                last_step=end,
                use_steps=tuple(uses),
                nodes=tuple(info["nodes"]),
                saved=tuple(saved_of_root.get(r, ())),
                last_fw_use=(
                    max(info["fw_uses"]) if info["fw_uses"] else (info["def"] if info["def"] < num_fw else None)
                ),
                first_bw_use=min(info["bw_uses"]) if info["bw_uses"] else None,
                source_step=node_step[info["source"]] if info["source"] is not None else None,
                fused=src in fused_nodes,
                resident_steps=resident_of_root.get(r, ()) if kind is BufferKind.PARAMETER else (),
                holders=tuple(info["holders"]),
            )
        )
    return buffers


# ------------------------------------------------------------------------------ layout copies


def inductor_layout_opt(gm: fx.GraphModule, target: str | None = None) -> bool:
    """Whether Inductor compiles ``gm`` with its layout optimization (channels-last convolutions):
    Inductor's own decision, ``GraphLowering.decide_layout_opt(gm, is_inference=False)``
    (``torch/_inductor/graph.py``; it reads ``torch._inductor.config.layout_optimization``, so the
    backend's ``config_patches`` apply). On the CPU with oneDNN it is on for every graph with a
    convolution; on a GPU Inductor weighs the convolutions' shapes. With ``target`` (the device
    the plan is for, :data:`~offload_compiler.ir.meta.TARGET_DEVICE_KEY`) a GPU while the graph
    is on the CPU, the GPU rule is the one asked (oneDNN's branch is turned off around the call)."""
    try:
        from torch._inductor.graph import GraphLowering

        decide = GraphLowering.decide_layout_opt
    except (ImportError, AttributeError):
        return False
    if not any(n.target is torch.ops.aten.convolution.default for n in gm.graph.nodes):
        return False
    try:
        if target is not None and target in _GPU_DEVICE_TYPES:
            with torch.backends.mkldnn.flags(enabled=False):
                return bool(decide(gm, is_inference=False))
        return bool(decide(gm, is_inference=False))
    except (AttributeError, KeyError, IndexError, TypeError):  # a graph the heuristics cannot read
        return False


def _prefer_channels_last(nodes: list[fx.Node]) -> set[fx.Node]:
    """The first pass of Inductor's ``GraphLowering.find_nodes_prefer_channels_last``: a
    convolution, and every node one of whose readers is in the set (not through a ``bmm``). The
    second pass adds only nodes downstream of others (never a placeholder)."""
    out: set[fx.Node] = set()
    for n in reversed(nodes):
        if n.target is torch.ops.aten.convolution.default:
            out.add(n)
        elif n.target is not torch.ops.aten.bmm.default and any(u in out for u in n.users):
            out.add(n)
    return out


def _channels_last_copied(val) -> bool:
    """Whether Inductor copies a dense 4-D tensor of this fake value to make it channels-last (its
    strides are not already the channels-last ones)."""
    import torch._prims_common as prims

    # Inductor's test (graph.py); named without "_or_false" in older torch.
    dense = getattr(prims, "is_non_overlapping_and_dense_or_false", None) or prims.is_non_overlapping_and_dense
    if not isinstance(val, torch.Tensor) or val.dim() != 4 or not dense(val):
        return False
    want = prims.make_channels_last_strides_for(val.shape)
    return tuple(hint_int(s) for s in val.stride()) != tuple(hint_int(s) for s in want)


def layout_copies(
    pair: GraphPair, sched: _Schedule, keys: _Keys, roots: dict, first_id: int, device: torch.device, target=None
) -> list[Buffer]:
    """The channels-last copies Inductor's layout optimization makes of graph inputs, as
    :attr:`BufferKind.LAYOUT_COPY` buffers with ids from ``first_id``.

    Where Inductor compiles a graph with its layout optimization (:func:`inductor_layout_opt`), a
    2-D convolution wants its input and weight channels-last (``torch/_inductor/kernel/conv.py``,
    ``require_channels_last``), and a graph input is a fixed layout, so Inductor copies it:

    * a forward input that the graph returns, not to the user (a saved tensor: the convolution's
      input and weight are saved for its backward), and whose readers lead to a convolution, is
      copied where the graph starts (``GraphLowering.run_node``: an output in
      ``nodes_prefer_channels_last`` gets channels-last strides). Every reader then reads the copy
      and the forward returns the copy as the saved tensor: it is alive from the input's step to
      the last reader of the input or of a saved view of it in the backward, while the caller
      still holds the original (a parameter, the step's input);
    * any other graph input read by a convolution as input or weight is copied for that
      convolution alone: a temporary at its step.

    Seen with Hugging Face's ViT on the CPU (torch 2.13): the patch embedding's pixel values
    (8x3x32x32 float32, 98,304 bytes) and weight (32x3x8x8, 24,576 bytes) were copied and held from
    the forward's start to the backward's ``convolution_backward``, 122,880 bytes the plan did not
    count. Inputs made by other nodes are left out: Inductor lays out what it computes itself
    channels-last from the start, and fixed-layout results (extern kernels) are not modelled."""
    out: list[Buffer] = []
    for graph_name, gm in (("forward", pair.forward), ("backward", pair.backward)):
        if not inductor_layout_opt(gm, target):
            continue
        nodes = list(gm.graph.nodes)
        prefer = _prefer_channels_last(nodes)
        returned: set[fx.Node] = set()
        user_visible: set[fx.Node] = set()
        if graph_name == "forward":
            for i, o in enumerate(pair.fw_outputs()):
                if isinstance(o, fx.Node):
                    (user_visible if i < pair.num_fwd_outputs else returned).add(o)
        for ph in gm.graph.find_nodes(op="placeholder"):
            val = ph.meta.get("val")
            if not _channels_last_copied(val) or not keys.node_keys.get(ph):
                continue
            tdev = val.device
            if not (tdev == device or device.type == "cpu"):
                continue
            nbytes = val.numel() * val.element_size()
            step = sched.node_step[ph]
            if ph in returned and ph not in user_visible and ph in prefer:
                info = roots[keys.uf.find(keys.node_keys[ph][0])]
                spans = [(step, max([step, *info["uses"]]))]
            else:
                spans = [
                    (sched.node_step[c], sched.node_step[c])
                    for c in ph.users
                    if c.target is torch.ops.aten.convolution.default and ph in c.args[:2]
                ]
            for first, last in spans:
                out.append(
                    Buffer(
                        id=first_id + len(out),
                        kind=BufferKind.LAYOUT_COPY,
                        size_bytes=hint_int(nbytes),
                        size_expr=_size_expr(nbytes),
                        device=str(tdev),
                        on_device=True,
                        def_step=first,
                        last_step=last,
                        use_steps=(),
                        nodes=(f"{graph_name}:{ph.name} (layout copy)",),  # display only: no node holds it
                        saved=(),
                        last_fw_use=None,
                        first_bw_use=None,
                    )
                )
    return out
