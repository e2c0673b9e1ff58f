"""The allocator's one CUDA stream: which stream it is, and running its calls on it.

Contract: :func:`own_stream` picks the stream a new :class:`~kvmem.allocator.PageAllocator`
runs on (None on CPU); :class:`StreamBound` runs a body on that device and stream,
ordered after the caller's current stream both ways, without a host sync; and
:func:`on_own_stream` wraps a method so that it runs there, recording the tensors that
cross between the two streams.  On the CPU each of them is a plain call.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

import torch


def on_own_stream(method):
    """Run a PageAllocator method on the allocator's CUDA device and stream (see
    ``PageAllocator._on_stream``); on CPU a plain call.  When the caller's stream is
    another one, tensors it passes are recorded on the allocator's stream and a tensor
    returned is recorded on the caller's (so neither is reused while the other stream
    may still read it)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self._stream is None:
            return method(self, *args, **kwargs)
        caller = torch.cuda.current_stream(self.device)
        with self._on_stream():
            if caller != self._stream:
                for a in (*args, *kwargs.values()):
                    if isinstance(a, torch.Tensor) and a.device.type == "cuda":
                        a.record_stream(self._stream)
            out = method(self, *args, **kwargs)
        if caller != self._stream and isinstance(out, torch.Tensor) and out.device.type == "cuda":
            out.record_stream(caller)
        return out

    return wrapper


def own_stream(device: torch.device, stream) -> torch.cuda.Stream | None:
    """The stream a new allocator on ``device`` runs on: ``stream``, or the device's
    current stream at construction; None on CPU (where ``stream`` must be None)."""
    if device.type != "cuda":
        if stream is not None:
            raise ValueError(
                f"stream= is for an allocator on a CUDA device; this one is on "
                f"{device}, got stream={stream!r}"
            )
        return None
    if stream is None:
        return torch.cuda.current_stream(device)
    if not isinstance(stream, torch.cuda.Stream):
        raise ValueError(f"stream must be a torch.cuda.Stream, got {type(stream).__name__}")
    if stream.device != device:
        raise ValueError(f"stream is on {stream.device}, the allocator on {device}")
    return stream


class StreamBound:
    """The stream of a :class:`~kvmem.allocator.PageAllocator` and running on it."""

    if TYPE_CHECKING:  # what PageAllocator (kvmem/allocator.py) provides
        device: torch.device
        _stream: torch.cuda.Stream | None

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream every call of this allocator runs on (PageAllocator's
        docstring); None on CPU."""
        return self._stream

    @contextlib.contextmanager
    def _on_stream(self):
        """CUDA: run the body on this allocator's device and stream, ordered after the
        caller's current stream (PageAllocator's docstring, "CUDA").  CPU: nothing."""
        own = self._stream
        if own is None:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        if caller == own and torch.cuda.current_device() == self.device.index:
            yield  # the common case: already on our device and stream
            return
        with torch.cuda.device(self.device), torch.cuda.stream(own):
            if caller != own:
                own.wait_stream(caller)  # what the caller queued before, inputs included
            try:
                yield
            finally:
                if caller != own:
                    caller.wait_stream(own)  # what the caller queues next sees our work
