"""Copy streams, compute streams and events for one device.

On CUDA: one device-to-host (D2H) and one host-to-device (H2D) copy stream, separate from the
compute stream, and CUDA events to order them. On a device without streams (the CPU) every method
is an ordered no-op: copies run synchronously on the calling thread, so program order is the order.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["CopyStreams", "ComputeStreams"]


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


class ComputeStreams:
    """The compute streams and reusable events of one compiled artifact, on one device.

    Stream index 0 is the stream that was current when the graph started (the caller's stream;
    remembered per thread, because autograd runs the backward on its own thread); indices
    ``1 .. n-1`` are side streams this object creates on first use and keeps for its lifetime.
    Events are created on first use, one per event id, and re-recorded on every step: a wait
    uses the event's latest record, which in a graph is always the one just before it in program
    order (the verifier checks that every wait has an earlier record).

    On a device without streams (the CPU) every method is an ordered no-op: the graph's nodes run
    one after another on the calling thread, so program order already is the order.

    Args:
        device: the compute device. Streams exist only when ``device.type == "cuda"`` and CUDA
            is available.
    """

    def __init__(self, device: torch.device):
        import threading

        self.device = torch.device(device)
        self.enabled = self.device.type == "cuda" and torch.cuda.is_available()
        self._side: dict[int, Any] = {}
        self._events: dict[int, Any] = {}
        self._local = threading.local()

    def _main(self) -> Any:
        # Stream 0 is the current stream unless a side stream is current (between a switch to
        # it and the switch back): then it is the stream that was current before that switch.
        current = torch.cuda.current_stream(self.device)
        if all(current != s for s in self._side.values()):
            self._local.main = current
            return current
        return self._local.main

    def restore(self) -> None:
        """Make stream 0 current again if a side stream is (after an exception mid-graph)."""
        if self.enabled and any(torch.cuda.current_stream(self.device) == s for s in self._side.values()):
            main = getattr(self._local, "main", None)
            if main is not None:
                torch.cuda.set_stream(main)

    def stream(self, index: int) -> Any:
        """The stream with this index (``None`` without streams).

        Raises:
            ValueError: for a negative index.
        """
        if index < 0:
            raise ValueError(f"stream index must be >= 0, got {index}")
        if not self.enabled:
            return None
        if index == 0:
            return self._main()
        if index not in self._side:
            self._side[index] = torch.cuda.Stream(device=self.device)
        return self._side[index]

    def set_stream(self, index: int) -> None:
        """Make stream ``index`` current. While no side stream is current, the current stream is
        stream 0 (remembered per thread); switching to 0 restores it."""
        if not self.enabled:
            return
        self._main()  # remembers the caller's stream while it is current
        torch.cuda.set_stream(self.stream(index))

    def record(self, event: int, index: int) -> None:
        """Record event ``event`` on stream ``index``."""
        if not self.enabled:
            return
        ev = self._events.get(event)
        if ev is None:
            ev = self._events[event] = torch.cuda.Event()
        ev.record(self.stream(index))

    def wait(self, event: int, index: int) -> None:
        """Make stream ``index`` wait for event ``event``'s latest record."""
        if not self.enabled:
            return
        ev = self._events.get(event)
        if ev is not None:
            self.stream(index).wait_event(ev)

    @property
    def num_side_streams(self) -> int:
        """Side streams created so far (0 on the CPU)."""
        return len(self._side)
