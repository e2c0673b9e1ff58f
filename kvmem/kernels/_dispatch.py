"""Which implementation a call runs: the Triton kernel or the torch one.

CUDA tensors run the Triton kernels; CPU tensors run the torch implementations.
``KVMEM_FORCE_TRITON=1`` routes CPU tensors to the Triton kernels too, which only
works when ``TRITON_INTERPRET=1`` was set before kvmem's kernel modules were imported
(the test run ``make test-interpret`` sets both).  The choice is made per call from the
tensor's device, never by swapping functions at import time.
"""

from __future__ import annotations

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
