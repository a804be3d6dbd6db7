"""Trinity's IR: the ``trinity::*`` op schemas and handles (:mod:`.ops`), the ``node.meta`` keys
the passes write (:mod:`.meta`), the one aliasing rule (:mod:`.alias`) and node references in
frozen results (:mod:`.refs`).

A leaf: it imports torch and nothing else of trinity. Both the passes and the runtime import it;
the passes never import the runtime, nor the runtime the passes (``tests/test_imports.py``).
"""

from .alias import (
    hint_int,
    is_view,
    mutated_args,
    node_storages,
    ordering_args,
    plain_tensors,
    schema_view_of,
    span_bytes,
    storage_key,
    tensor_span_bytes,
    tensor_vals,
)
from .meta import NOTE_KEY, PARAM_COPY_KEY, PREPARED_KEY, RECOMPUTE_KEY, STREAM_KEY
from .ops import (
    EVICT,
    EVICT_WAIT,
    FENCE,
    GRAD_REDUCE,
    GRAD_REDUCE_WAIT,
    GRAD_SYNC_MARK,
    GRAD_SYNC_OPS,
    GRAD_TO_HOST,
    GRAD_TO_HOST_WAIT,
    PARAM_FETCH,
    PARAM_FETCH_WAIT,
    PARAM_OPS,
    PARAM_RELEASE,
    PREFETCH,
    PREFETCH_WAIT,
    RECORD_EVENT,
    SET_STREAM,
    STREAM_OPS,
    TRANSFER_OPS,
    WAIT_EVENT,
)
from .refs import NODE_REF, node_ref, plain_dict

__all__ = [
    "EVICT",
    "EVICT_WAIT",
    "FENCE",
    "PREFETCH",
    "PREFETCH_WAIT",
    "TRANSFER_OPS",
    "SET_STREAM",
    "RECORD_EVENT",
    "WAIT_EVENT",
    "STREAM_OPS",
    "PARAM_FETCH",
    "PARAM_FETCH_WAIT",
    "PARAM_RELEASE",
    "GRAD_TO_HOST",
    "GRAD_TO_HOST_WAIT",
    "PARAM_OPS",
    "GRAD_SYNC_MARK",
    "GRAD_REDUCE",
    "GRAD_REDUCE_WAIT",
    "GRAD_SYNC_OPS",
    "NOTE_KEY",
    "STREAM_KEY",
    "RECOMPUTE_KEY",
    "PARAM_COPY_KEY",
    "PREPARED_KEY",
    "tensor_vals",
    "hint_int",
    "span_bytes",
    "tensor_span_bytes",
    "plain_tensors",
    "storage_key",
    "node_storages",
    "is_view",
    "schema_view_of",
    "ordering_args",
    "mutated_args",
    "NODE_REF",
    "node_ref",
    "plain_dict",
]
