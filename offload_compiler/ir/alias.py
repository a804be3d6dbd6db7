"""The one aliasing rule of trinity's IR: which storage a node's value lives on, when a node is a
view, and how many bytes a tensor's copy moves.

* **Storage keys.** A tensor's storage key is ``StorageWeakRef(t.untyped_storage())`` of its fake
  ``meta["val"]``: two values alias when their keys are equal. Only strided tensors whose storage
  is accessible have one (:func:`storage_key`; ``None`` otherwise: sparse, mkldnn, or a wrapper
  without a storage). Fake storages are compared within one graph only: the partitioner copies
  recomputed nodes into the backward with the forward's fake values.
* **Schema first.** A read-only alias by the op's schema (``Tensor(a) self -> Tensor(a)``:
  ``detach``, ``t``, ``view``...) shares its input's storage even where its fake value does not (a
  ``detach`` recomputed into the backward carries the forward's fake tensor):
  :func:`schema_view_of` names that input, and callers take its key before the fake value's.
* **Views.** A node is a view when it has storages and all of them are storages of its inputs
  (:func:`is_view`): it allocates nothing and launches no kernel.
* **Reads and writes by schema.** An op writes the arguments its schema marks ``(a!)``
  (:func:`mutated_args`), except the ``after`` ordering edges of the transfer ops, which are
  neither read nor written at run time (:func:`ordering_args`; see :mod:`.ops`).
* **Bytes.** A view's copy moves the bytes from its first element to the end of its last
  (:func:`span_bytes`, :func:`tensor_span_bytes`), symbolic sizes taken at their hints
  (:func:`hint_int`).

Reads ``node.meta["val"]``; writes nothing.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .ops import TRANSFER_OPS

__all__ = [
    "tensor_vals",
    "hint_int",
    "span_bytes",
    "tensor_span_bytes",
    "node_span_bytes",
    "plain_tensors",
    "storage_key",
    "node_storages",
    "is_view",
    "schema_view_of",
    "ordering_args",
    "mutated_args",
]


def tensor_vals(node: fx.Node) -> list[torch.Tensor]:
    """The tensors in ``node.meta["val"]`` (one for most ops, several for tuple outputs, in the
    order of the flattened, possibly nested, tuple)."""
    return list(_flat_tensors(node.meta.get("val")))


def _flat_tensors(val):
    # Nested tuples too: ``run_and_save_rng_state(op, ...)`` returns ``(state, op's result)``, and
    # the result of a multi-output op (``native_dropout``) is a tuple itself. Counting only the
    # first level left its outputs out of the plan at the op's step: a recomputed dropout's output
    # and mask were counted from their getitem on, after the events the stream pass puts between.
    if isinstance(val, torch.Tensor):
        yield val
    elif isinstance(val, (tuple, list)):
        for v in val:
            yield from _flat_tensors(v)


def hint_int(value) -> int:
    """An int for a possibly symbolic value, from the shape environment's hint (adds no guard)."""
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        node = value.node
        for attr in ("hint", "_hint"):
            hint = getattr(node, attr, None)
            if hint is not None:
                return int(hint)
        try:  # torch >= 2.12
            from torch.fx.experimental.symbolic_shapes import optimization_hint
        except ImportError:
            return int(node.shape_env.size_hint(node.expr))
        return int(optimization_hint(value))
    return int(value)


def span_bytes(size: tuple[int, ...], stride: tuple[int, ...], itemsize: int) -> int:
    """Bytes from a view's first element to the end of its last (0 for an empty view)."""
    span = 1
    for s, st in zip(size, stride):
        if s == 0:
            return 0
        span += (s - 1) * st
    return span * itemsize


def tensor_span_bytes(t: torch.Tensor) -> int:
    """:func:`span_bytes` of a (possibly fake, possibly symbolic) tensor, sizes at their hints."""
    return span_bytes(tuple(hint_int(s) for s in t.shape), tuple(hint_int(s) for s in t.stride()), t.element_size())


def node_span_bytes(node: fx.Node) -> int:
    """Bytes the tensors of ``node.meta["val"]`` span, summed (:func:`tensor_span_bytes`)."""
    return sum(tensor_span_bytes(t) for t in tensor_vals(node))


def plain_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors whose storage can be accounted: plain, strided (not subclasses, not sparse)."""
    return [t for t in tensors if not is_traceable_wrapper_subclass(t) and t.layout == torch.strided]


def storage_key(t: torch.Tensor) -> StorageWeakRef | None:
    """The storage key of ``t`` (module docstring), or ``None`` when it has none."""
    if t.layout != torch.strided:
        return None
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


def node_storages(node: fx.Node) -> list[StorageWeakRef]:
    """The storage keys of the tensors in ``node.meta["val"]``, in output order (those without a
    key left out)."""
    return [k for t in tensor_vals(node) if (k := storage_key(t)) is not None]


def is_view(node: fx.Node) -> bool:
    """Whether every storage of ``node``'s value is a storage of one of its inputs (and it has
    one): a view, ``getitem`` or alias, which allocates nothing."""
    outs = set(node_storages(node))
    ins = {k for m in node.all_input_nodes for k in node_storages(m)}
    return bool(outs) and outs <= ins


def schema_view_of(node: fx.Node, index: int) -> fx.Node | None:
    """The input node whose storage output ``index`` of ``node`` shares according to the op's
    schema (``Tensor(a) self -> Tensor(a)``, a read-only alias), or ``None``."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    schema = node.target._schema
    rets = schema.returns
    if not rets:
        return None
    ret = rets[0] if len(rets) == 1 else (rets[index] if index < len(rets) else None)
    if ret is None or ret.alias_info is None or ret.alias_info.is_write:
        return None
    for arg, value in zip(schema.arguments, node.args):
        if arg.alias_info is not None and arg.alias_info.before_set & ret.alias_info.before_set:
            return value if isinstance(value, fx.Node) else None
    return None


def ordering_args(node: fx.Node) -> set[fx.Node]:
    """The ``after`` arguments of the transfer ops (``prefetch``, ``prefetch_wait``,
    ``evict_wait``): ordering edges for a scheduler, neither read nor written at run time
    (:mod:`.ops`). They still hold their tensor alive up to the op."""
    if node.op != "call_function" or node.target not in TRANSFER_OPS:
        return set()
    schema = node.target._schema
    out = set()
    for i, arg in enumerate(schema.arguments):
        if arg.name == "after":
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, fx.Node):
                out.add(value)
    return out


def mutated_args(node: fx.Node) -> list[fx.Node]:
    """The argument nodes an op writes (from its schema's alias annotations; a transfer op's
    ``after`` ordering edge excluded)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    ordering = ordering_args(node)
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        out.extend(v for v in values if isinstance(v, fx.Node) and v not in ordering)
    return out
