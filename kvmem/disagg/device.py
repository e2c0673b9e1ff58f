"""Device and host without a host sync, for the sides' hot paths.

On CUDA the sides' step() never waits for the device: what the host must know of device
values (page ids for messages and descriptors, the stand-in's verdicts) comes through a
:class:`HostCopy` polled in later steps, host values go to the device through pinned
memory (:func:`to_device`), and host decisions that depend on device work finishing (post
a packed chunk, reuse a landing slot) poll an event recorded after that work
(:func:`device_event`).  On the CPU every copy is done when it returns and every event
is ready at once, so behaviour there is the same step for step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch


class Event(Protocol):
    """What a side polls after queued device work: ``query()`` is True once that work is
    done (a ``torch.cuda.Event``; on the CPU :data:`READY`, always done)."""

    def query(self) -> bool: ...


class _Ready:
    """What :func:`device_event` gives on the CPU: device work is done when it returns."""

    @staticmethod
    def query() -> bool:
        return True


READY = _Ready()


def device_event(device) -> Callable[[], Event]:
    """``() -> Event``: on CUDA a ``torch.cuda.Event`` recorded on
    ``device``'s current stream (where the side's kernels and copies run) when called; on
    the CPU an object that is always ready.  Polled with ``query()``, never waited on."""
    device = torch.device(device)
    if device.type != "cuda":
        return lambda: READY

    def record():
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        return ev

    return record


class HostCopy:
    """A host copy of a device tensor made without a host sync: on CUDA a non-blocking
    copy into pinned host memory queued on the tensor's device's current stream (after
    the work that produced the tensor) and an event recorded after it; on the CPU the
    tensor itself (which must not change afterwards).

    ``t`` : any shape, a dtype NumPy has (``int64 [n]`` page ids, a 0-dim bool verdict).
    :meth:`ready` polls (never waits); :meth:`numpy` gives the copy once ready.  The one
    way the disagg sides read device values (tests/disagg/test_sync_free.py)."""

    __slots__ = ("_host", "_event")

    def __init__(self, t: torch.Tensor):
        if t.device.type == "cuda":
            with torch.cuda.device(t.device):
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(t.device))
            self._host, self._event = host, ev
        else:
            self._host, self._event = t, None

    def ready(self) -> bool:
        if self._event is not None and self._event.query():
            self._event = None
        return self._event is None

    def numpy(self) -> np.ndarray:
        """The copy (a NumPy view of host memory); RuntimeError while not :meth:`ready`."""
        if not self.ready():
            raise RuntimeError("HostCopy.numpy: the copy is still in flight; poll ready()")
        return self._host.numpy()


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """The CPU tensor ``t`` on ``device`` without a host sync: through pinned memory and a
    non-blocking copy on CUDA (torch's pinned-memory cache keeps the staging copy until
    the device has read it, so ``t`` may change at once); ``t`` itself on the CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
