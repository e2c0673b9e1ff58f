"""Which implementation a call runs: the Triton kernel or the torch one.

CUDA tensors run the Triton kernels; CPU tensors run the torch implementations.
``KVMEM_FORCE_TRITON=1`` routes CPU tensors to the Triton kernels too, which only
works when ``TRITON_INTERPRET=1`` was set before kvmem's kernel modules were imported
(the test run ``make test-interpret`` sets both).  The choice is made per call from the
tensor's device, never by swapping functions at import time.
"""

from __future__ import annotations

import contextlib
import os

import torch


def force_triton() -> bool:
    return os.environ.get("KVMEM_FORCE_TRITON", "") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """True when calls on tensors like ``t`` go to the Triton kernels."""
    return t.device.type == "cuda" or force_triton()


def is_async_device(t: torch.Tensor) -> bool:
    """True when reading a value of ``t`` on the host costs a device sync."""
    return t.device.type == "cuda"


def device_guard(device: torch.device):
    """Context manager under which a kernel launch goes to ``device``: Triton launches on
    the *current* CUDA device and its current stream, not on the device of the tensors it
    is given, so every launcher enters this with its tensors' device.  For a CUDA device
    it is ``torch.cuda.device(device)`` (cheap when the device is already current: a
    device exchange, no sync); for any other device (CPU tensors under the interpreter)
    a no-op context."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
