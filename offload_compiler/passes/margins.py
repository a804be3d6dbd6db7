"""Measured workspace margins: what the first real steps showed the plan had missed.

The planner models a node's memory as its output buffers plus an op workspace taken from a table
(:data:`.liveness._WORKSPACE`, measured on one CPU). A kernel on another machine (a oneDNN AMX
bf16 matmul, a cuDNN convolution, a custom op) can allocate more: scratch it frees before it
returns. :mod:`offload_compiler.step_check` measures that on the running machine, per op,
from the allocator's events, and the next plan takes it in through a :class:`WorkspaceMargins`:
liveness then counts, at every node, the larger of the table's workspace and the measured one.

Ops are matched by an :data:`OpKey`, the op's name as the dispatcher (and so ``torch.profiler``)
calls it and the shapes and dtypes of its tensor arguments in schema order, never by node name:
the replanned graphs are traced again, and Inductor calls an op's ``out=`` overload, which takes
its output as one more tensor argument (so a measured key matches a node's key when the node's
tensors are a prefix of the measured op's).

Pure: reads ``node.meta["val"]`` of a node's arguments; writes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..graph_pair import called_op, hint_int

__all__ = ["OpKey", "TensorKey", "WorkspaceMargins", "op_key", "matches"]

TensorKey = tuple[tuple[int, ...], str]
"""(shape with symbolic sizes at their hints, dtype as ``str(torch.dtype)``)."""

OpKey = tuple[str, tuple[TensorKey, ...]]
"""(op name such as ``"aten::mm"``, the :data:`TensorKey` of each tensor argument in schema order)."""


def tensor_key(t: torch.Tensor) -> TensorKey:
    return tuple(hint_int(s) for s in t.shape), str(t.dtype)


def _flat(value) -> Iterable:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat(v)
    else:
        yield value


def op_key(node: fx.Node) -> OpKey | None:
    """The :data:`OpKey` of a ``call_function`` node of an ``OpOverload`` (``None`` for anything
    else: placeholders, ``getitem``, higher-order ops), or of the op a random-number-state wrapper
    runs (:func:`~offload_compiler.graph_pair.called_op`: the profiler sees that op)."""
    if node.op != "call_function":
        return None
    target, args, kwargs = called_op(node)
    if not isinstance(target, torch._ops.OpOverload):
        return None
    schema = target._schema
    tensors: list[TensorKey] = []
    for i, arg in enumerate(schema.arguments):
        if i < len(args):
            value = args[i]
        elif arg.name in kwargs:
            value = kwargs[arg.name]
        else:
            continue
        for v in _flat(value):
            val = v.meta.get("val") if isinstance(v, fx.Node) else None
            if isinstance(val, torch.Tensor):
                tensors.append(tensor_key(val))
    return schema.name, tuple(tensors)


def matches(measured: OpKey, node: OpKey) -> bool:
    """Whether a measured op (``measured``) is a call of the node's op (``node``): same name, and
    the node's tensors are the measured op's first tensors (an ``out=`` call has one more)."""
    return measured[0] == node[0] and measured[1][: len(node[1])] == node[1]


@dataclass(frozen=True)
class WorkspaceMargins:
    """The planning input built from a measured step.

    Attributes:
        workspace: ``(op key, bytes)``: the bytes ops of that key allocated inside a call beyond
            the outputs the plan gives them (scratch freed before they return, and outputs larger
            than modelled), the largest over their calls.
        budget_bytes: the budget the first plan resolved, in bytes, kept for every later plan
            (a fraction budget is of the peak without the margins, so that a margin never
            raises the budget it is meant to respect); ``None``: no limit.
        unplanned_peak_bytes: the pair's own unplanned peak as the first plan saw it, without
            the margins (bytes). Where given, a fraction budget is resolved again from it and
            the later plan's model state (which the runtime check changes when it measures the
            pair running several times per step), instead of taking ``budget_bytes``.
        reserve_bytes: bytes a measured step held beyond the plan with the measured workspace,
            which no op's workspace explains (an allocation the plan does not model: seen on a
            CPU with AMX, where oneDNN's bf16 matmuls hold memory outside their calls); liveness
            counts it at every node, a uniform reserve (bytes, default 0).
    """

    workspace: tuple[tuple[OpKey, int], ...] = ()
    budget_bytes: int | None = None
    unplanned_peak_bytes: int | None = None
    reserve_bytes: int = 0
    _by_name: dict = field(default=None, repr=False, compare=False, hash=False)

    def __post_init__(self):
        by_name: dict[str, list[tuple[tuple[TensorKey, ...], int]]] = {}
        for (name, tensors), nbytes in self.workspace:
            by_name.setdefault(name, []).append((tensors, int(nbytes)))
        object.__setattr__(self, "_by_name", by_name)

    def bytes_for(self, key: OpKey | None) -> int:
        """The measured workspace of ops with ``key`` (0 when none was measured)."""
        if key is None:
            return 0
        best = 0
        for tensors, nbytes in self._by_name.get(key[0], ()):
            if tensors[: len(key[1])] == key[1]:
                best = max(best, nbytes)
        return best

    def node_bytes(self, node: fx.Node) -> int:
        """The measured workspace of ``node`` (0 when none was measured)."""
        return self.bytes_for(op_key(node)) if self._by_name else 0

    def merged(self, more: Mapping[OpKey, int]) -> WorkspaceMargins:
        """These margins with ``more`` (the larger value per key)."""
        table = dict(self.workspace)
        for k, v in more.items():
            table[k] = max(table.get(k, 0), int(v))
        return WorkspaceMargins(
            tuple(sorted(table.items())), self.budget_bytes, self.unplanned_peak_bytes, self.reserve_bytes
        )

    def with_reserve(self, more_bytes: int) -> WorkspaceMargins:
        """These margins with :attr:`reserve_bytes` raised by ``more_bytes`` (bytes, >= 0).

        Raises:
            ValueError: for a negative ``more_bytes``.
        """
        if more_bytes < 0:
            raise ValueError(f"with_reserve: more_bytes must be >= 0, got {more_bytes}")
        return WorkspaceMargins(
            self.workspace, self.budget_bytes, self.unplanned_peak_bytes, self.reserve_bytes + int(more_bytes)
        )
