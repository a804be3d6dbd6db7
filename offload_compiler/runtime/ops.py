"""The kernels of the transfer and stream ``trinity::*`` ops: what they do at run time.

The schemas, fake implementations and op handles are the IR's (:mod:`offload_compiler.ir.ops`,
which documents each op); this module registers their ``CompositeExplicitAutograd`` kernels,
which call the owning :class:`~offload_compiler.runtime.transfer.TransferRuntime` (``rt`` is its
id) and its :class:`~offload_compiler.runtime.streams.ComputeStreams`. Importing the
``offload_compiler`` package imports it.
"""

from __future__ import annotations

import torch

from ..ir import ops as _ir_ops  # noqa: F401  (defines the trinity::* schemas first)
from .transfer import get_runtime

__all__: list[str] = []


def _evict(src: torch.Tensor, rt: int, stride: list[int] | None = None) -> torch.Tensor:
    return get_runtime(rt).evict(src, None if stride is None else tuple(stride))


def _evict_wait(host: torch.Tensor, src: torch.Tensor, rt: int, after: torch.Tensor | None = None) -> None:
    get_runtime(rt).evict_wait(host, src)


def _prefetch(host: torch.Tensor, device: torch.device, rt: int, after: torch.Tensor | None = None) -> torch.Tensor:
    return get_runtime(rt).prefetch(host, device)


def _prefetch_wait(dev: torch.Tensor, rt: int, after: torch.Tensor | None = None) -> None:
    get_runtime(rt).prefetch_wait(dev)


def _fence(hosts: list[torch.Tensor], reader: torch.Tensor) -> None:
    return None


def _set_stream(rt: int, stream: int) -> None:
    get_runtime(rt).compute_streams.set_stream(stream)


def _record_event(after: list[torch.Tensor], rt: int, event: int, stream: int) -> None:
    get_runtime(rt).compute_streams.record(event, stream)


def _wait_event(keep: list[torch.Tensor], rt: int, event: int, stream: int) -> None:
    get_runtime(rt).compute_streams.wait(event, stream)


_lib = torch.library.Library("trinity", "IMPL")
for _name, _fn in (
    ("set_stream", _set_stream),
    ("record_event", _record_event),
    ("wait_event", _wait_event),
    ("fence", _fence),
    ("evict", _evict),
    ("evict_wait", _evict_wait),
    ("prefetch", _prefetch),
    ("prefetch_wait", _prefetch_wait),
):
    _lib.impl(_name, _fn, "CompositeExplicitAutograd")
