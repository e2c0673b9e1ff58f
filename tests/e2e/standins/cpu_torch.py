"""``torch`` as one sglang module sees it on a CPU host: everything is torch's, except
a few CUDA-only calls, and only when no CUDA device is there (on this CUDA build of torch
both name CUDA whatever the server runs on):

* ``get_device_module()`` with no argument is ``torch.cpu``, not ``torch.cuda`` (whose
  ``synchronize`` raises).  For ``sglang/srt/managers/scheduler_components/
  weight_updater.py:379``, ``torch.get_device_module().synchronize()`` at the end of a
  release.
* ``torch.cuda.Event()`` is :class:`CpuEvent`, whose calls have nothing to wait for.  For
  ``sglang/srt/disaggregation/prefill.py:1496``: with the overlap schedule on, a prefill
  records an event on its forward stream before it sends a cached prefix early (the
  transfer is to wait for the previous forward's writes).  A CPU forward is done when
  its call returns (torch runs CPU ops on the calling thread), so there is nothing to
  record.  The same for ``prefill.py:1760-1761`` (``torch.cuda.Event()``,
  ``.record(torch.cuda.current_stream())``): a sender with host-tensor indices
  (Mooncake's, ``mooncake/conn.py:3312``; not NIXL's) copies its page indices to the
  host and records an event its transfer worker waits on (``mooncake/conn.py:2540``);
  ``torch.cuda.current_stream()`` is ``None`` here (nothing to record on).
* ``torch.empty(..., pin_memory=True)`` allocates unpinned memory.  For
  ``prefill.py:1753``, that same host copy of a Mooncake sender's page indices: pinning
  needs a CUDA driver ("Found no NVIDIA driver" at the first request otherwise), and
  pinned memory only speeds a device-to-host copy, which a CPU tensor never makes.

Used by the e2e tier's stand-ins (``sitecustomize.py`` beside this file, which imports
it as ``cpu_torch``) and by the harness tests (``tests/sglang/sglang_env.py``, as
``tests.e2e.standins.cpu_torch``).  It is applied to one module's ``torch`` name at a
time, so a call anywhere else that names CUDA without a device (sglang's or kvmem's)
still fails as it would on this host.
"""

from __future__ import annotations

import types


class CpuEvent:
    """``torch.cuda.Event``'s calls for work that is done when it is issued."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _no_stream(device=None):
    """``torch.cuda.current_stream()`` on a host with no CUDA device: no stream."""
    return None


class _View(types.ModuleType):
    """A module as seen through this view: its own attributes first, then ``inner``'s."""

    def __init__(self, name, inner):
        super().__init__(name)
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


class TorchWithCpuDeviceModule(_View):
    def __init__(self, torch):
        super().__init__("torch", torch)
        self._cuda = None

    def __getattr__(self, name):
        if name == "cuda" and not self._inner.cuda.is_available():
            if self._cuda is None:
                self._cuda = _View("torch.cuda", self._inner.cuda)
                self._cuda.Event = CpuEvent
                self._cuda.current_stream = _no_stream
            return self._cuda
        return super().__getattr__(name)

    def empty(self, *args, **kwargs):
        if kwargs.get("pin_memory") and not self._inner.cuda.is_available():
            kwargs["pin_memory"] = False
        return self._inner.empty(*args, **kwargs)

    def get_device_module(self, device=None):
        torch = self._inner
        if device is None and not torch.cuda.is_available():
            return torch.cpu
        return torch.get_device_module(device)


def apply(module) -> bool:
    """Give ``module`` the view above as its ``torch``; False if it already has it."""
    if isinstance(module.torch, TorchWithCpuDeviceModule):
        return False
    module.torch = TorchWithCpuDeviceModule(module.torch)
    return True
