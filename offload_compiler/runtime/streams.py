"""Copy streams and events for one device.

On CUDA: one device-to-host (D2H) and one host-to-device (H2D) copy stream, separate from the
compute stream, and CUDA events to order them. On a device without streams (the CPU) every method
is an ordered no-op: copies run synchronously on the calling thread, so program order is the order.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["CopyStreams"]


class CopyStreams:
    """The copy streams of one device.

    Args:
        device: the compute device. Streams exist only when ``device.type == "cuda"`` and CUDA
            is available.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.enabled = device.type == "cuda" and torch.cuda.is_available()
        if self.enabled:
            self.d2h = torch.cuda.Stream(device=device)
            self.h2d = torch.cuda.Stream(device=device)
        else:
            self.d2h = None
            self.h2d = None

    def compute_stream(self) -> Any:
        """The stream the compiled graph runs on (the current stream), or ``None``."""
        return torch.cuda.current_stream(self.device) if self.enabled else None

    def start_on(self, copy_stream: Any) -> contextlib.AbstractContextManager:
        """Make ``copy_stream`` wait for all work queued so far on the compute stream and run the
        ``with`` body on it. A no-op context without streams."""
        if not self.enabled:
            return contextlib.nullcontext()
        copy_stream.wait_stream(self.compute_stream())
        return torch.cuda.stream(copy_stream)

    def record(self, stream: Any) -> Any:
        """An event recorded on ``stream`` (``None`` without streams)."""
        if not self.enabled:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, event: Any) -> None:
        """Make the compute stream wait for ``event`` (no-op for ``None``)."""
        if event is not None:
            self.compute_stream().wait_event(event)

    def synchronize(self) -> None:
        """Block the host until both copy streams are idle."""
        if self.enabled:
            self.d2h.synchronize()
            self.h2d.synchronize()
