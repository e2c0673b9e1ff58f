"""Memory backends: one address range per pool, reserved once.

A backend owns the bytes behind a :class:`kvmem.KVPool`: ``tensor`` is a ``uint8`` view
of the whole range, whose address never changes for the backend's life.  Backends that
can give physical memory back (pause/resume) implement ``release`` / ``resume``.

The range is cut into physical chunks by a :class:`~kvmem.memory.plan.ChunkPlan`
(``backend.plan``); ``regions()`` is one ``(ptr, nbytes)`` per chunk, which is what a
transfer engine registers (NIXL refuses a descriptor across two registrations).  A pool
asks for a plan that keeps every layer plane (kvmem layout) or K|V block (sglang layout)
inside one chunk; a plain range (a staging buffer) is cut every ``chunk_bytes``.

This package chooses and makes a backend (:func:`make_backend`) and holds the ``plain``
one; the interface is :mod:`kvmem.memory.backend`, the others are ``host`` and
``cuda_vmm``.
"""

from __future__ import annotations

import errno
from typing import Callable, cast

import torch

from kvmem.errors import PoolMemoryError

# The interface lives in kvmem.memory.backend (the backends import it from there, never
# this package, which imports them); kvmem.memory stays its public path.
from kvmem.memory.backend import MAX_BYTES, MemoryBackend
from kvmem.memory.backend import RangeArray as RangeArray
from kvmem.memory.backend import range_tensor as range_tensor
from kvmem.memory.plan import ChunkPlan


class PlainBackend(MemoryBackend):
    """One ordinary device allocation (``torch.empty``): no release."""

    name = "plain"
    ALIGN = 512  # the range starts on this boundary (torch's CPU allocator gives 64)

    def __init__(self, nbytes: int, device: torch.device, plan: ChunkPlan | None = None):
        super().__init__(nbytes, device, plan)
        raw = torch.empty(nbytes + self.ALIGN, dtype=torch.uint8, device=device)
        skip = -raw.data_ptr() % self.ALIGN
        self.tensor = raw[skip : skip + nbytes]

    def close(self) -> None:
        """Drop the allocation: torch frees it once no view of it is left."""
        self.tensor = None


BACKENDS = ("host", "cuda_vmm", "plain")


Planner = Callable[[int, "int | None"], ChunkPlan]


def make_backend(
    nbytes: int,
    device: torch.device,
    kind: str | Callable[..., MemoryBackend] | None = None,
    *,
    purpose: str = "",
    planner: Planner | None = None,
    chunk_bytes: int | None = None,
) -> MemoryBackend:
    """The backend for a device: ``host`` on CPU, ``cuda_vmm`` on CUDA; ``kind`` forces one
    (``"plain"``: an ordinary allocation that cannot be released), or is a callable
    ``(nbytes, device) -> MemoryBackend`` that builds one.

    Chunks: ``host`` and ``cuda_vmm`` map the range in physical chunks (``backend.plan``,
    one region each).  ``planner(granularity, target) -> ChunkPlan`` places them (a pool's
    :func:`~kvmem.memory.plan.plan_pool`); without one the range is cut every
    ``target`` bytes (:func:`~kvmem.memory.plan.plan_range`).  ``target`` is
    ``chunk_bytes``, else ``$KVMEM_CHUNK_BYTES``, else 2 GiB
    (:func:`~kvmem.memory.plan.chunk_target`).  ``plain`` and callables are one chunk
    (``planner(1, None)``) unless the callable has ``chunked = True``
    (``CudaVmmBackend.factory``): it is then called as ``kind(nbytes, device,
    planner=planner, chunk_bytes=chunk_bytes)``.  ``nbytes`` is what the range holds
    before any padding (the backend's ``nbytes`` is its plan's).

    Raises:
        PoolMemoryError: ``nbytes`` cannot be had (more than :data:`MAX_BYTES`, or the OS,
            driver or torch is out of memory); names the bytes, the backend and
            ``purpose``.  Nothing stays reserved.
        ValueError: an unknown kind, or a kind that does not fit the device.
    """
    if kind is None:
        kind = {"cpu": "host", "cuda": "cuda_vmm"}.get(device.type)
        if kind is None:
            raise ValueError(f"no memory backend for device {device}")
    chunked = False
    factory: Callable[..., MemoryBackend]
    if callable(kind):
        factory, name = kind, str(getattr(kind, "name", getattr(kind, "__name__", "custom")))
        chunked = bool(getattr(kind, "chunked", False))
    elif kind == "host":
        if device.type != "cpu":
            raise ValueError(f"the host backend needs a cpu device, got {device}")
        from kvmem.memory.host import HostBackend

        factory, name, chunked = HostBackend, kind, True
    elif kind == "cuda_vmm":
        if device.type != "cuda":
            raise ValueError(f"the cuda_vmm backend needs a cuda device, got {device}")
        from kvmem.memory.cuda_vmm import CudaVmmBackend

        factory, name, chunked = CudaVmmBackend, kind, True
    elif kind == "plain":
        factory, name = PlainBackend, kind
    else:
        raise ValueError(f"unknown memory backend {kind!r} (known: {', '.join(BACKENDS)})")
    if nbytes > MAX_BYTES:
        raise PoolMemoryError(
            nbytes,
            name,
            device,
            f"more than the {MAX_BYTES} bytes one range can address",
            purpose=purpose,
        )
    try:
        if chunked:  # the factories that take a planner (the branches above say which)
            make = cast(Callable[..., MemoryBackend], factory)
            return make(nbytes, device, planner=planner, chunk_bytes=chunk_bytes)
        if planner is None:
            return factory(nbytes, device)
        plan = planner(1, None)
        mem = factory(plan.nbytes, device)
        mem.plan = plan
        return mem
    except PoolMemoryError as e:
        if e.purpose or not purpose:
            raise
        raise PoolMemoryError(
            e.nbytes, e.backend, e.device, e.reason, what=e.what, purpose=purpose
        ) from e
    except (MemoryError, OverflowError) as e:
        raise PoolMemoryError(nbytes, name, device, _first_line(e), purpose=purpose) from e
    except OSError as e:
        if e.errno in (errno.ENOMEM, errno.EOVERFLOW, errno.EFBIG):
            raise PoolMemoryError(nbytes, name, device, _first_line(e), purpose=purpose) from e
        raise
    except RuntimeError as e:  # torch's allocators: OutOfMemoryError on CUDA, enforce on CPU
        if isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e):
            raise PoolMemoryError(nbytes, name, device, _first_line(e), purpose=purpose) from e
        raise


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
