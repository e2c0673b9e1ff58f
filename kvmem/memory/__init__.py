"""Memory backends: one address range per pool, reserved once.

A backend owns the bytes behind a :class:`kvmem.KVPool`: ``tensor`` is a ``uint8`` view
of the whole range, whose address never changes for the backend's life.  Backends that
can give physical memory back (pause/resume) implement ``release`` / ``resume``.

The range is cut into physical chunks by a :class:`~kvmem.memory.plan.ChunkPlan`
(``backend.plan``); ``regions()`` is one ``(ptr, nbytes)`` per chunk, which is what a
transfer engine registers (NIXL refuses a descriptor across two registrations).  A pool
asks for a plan that keeps every layer plane (kvmem layout) or K|V block (sglang layout)
inside one chunk; a plain range (a staging buffer) is cut every ``chunk_bytes``.
"""

from __future__ import annotations

import errno
from typing import Callable, cast

import torch

from kvmem.errors import PoolMemoryError
from kvmem.memory.plan import ChunkPlan, plan_range

# The largest range a backend can be asked for: torch sizes and the OS's ssize_t are int64.
MAX_BYTES = (1 << 63) - 1


class MemoryBackend:
    """Interface of a pool's memory.

    Attributes:
        tensor: ``uint8 [nbytes]`` view of the whole range (stable ``data_ptr()``).
        device: where the memory lives.
        plan: the range's :class:`~kvmem.memory.plan.ChunkPlan` (one chunk unless the
            backend maps several).
        exportable: the chunks can be exported to another process (CUDA: POSIX file
            descriptor handles, what UCX's ``cuda_ipc`` needs to map them in a peer).
    """

    name = "abstract"
    can_release = False
    exportable = False
    # True while the range must not be touched (its memory is given back, or only partly
    # mapped).  Backends that release keep it exact, failures included.
    released = False

    def __init__(self, nbytes: int, device: torch.device, plan: ChunkPlan | None = None):
        self.nbytes = nbytes
        self.device = device
        self.tensor: torch.Tensor | None
        self.plan = plan if plan is not None or nbytes <= 0 else plan_range(nbytes, 1, None)

    def regions(self) -> list[tuple[int, int]]:
        """``(ptr, nbytes)`` of every physical chunk's used bytes, in address order: what a
        transfer engine registers (one region per physical allocation)."""
        if self.plan is None:  # an empty range: no chunk
            return []
        if self.tensor is None:
            raise RuntimeError(f"{self.name} memory backend: no regions once released")
        base = self.tensor.data_ptr()
        return [(base + c.offset, c.nbytes) for c in self.plan.chunks]

    def info(self) -> dict:
        """What the backend says about its memory: ``backend``, ``chunks`` (count),
        ``granularity``, ``target``, ``padding`` (bytes allocated that hold no item),
        ``exportable``, ``handle_type`` (the handle kind chunks can be exported as, or
        None)."""
        p = self.plan
        return dict(
            backend=self.name,
            chunks=len(p.chunks) if p is not None else 0,
            granularity=p.granularity if p is not None else None,
            target=p.target if p is not None else None,
            padding=p.padding if p is not None else 0,
            exportable=self.exportable,
            handle_type=None,
        )

    def release(self) -> None:
        raise NotImplementedError(f"the {self.name} memory backend cannot release its memory")

    def resume(self, prefault: bool = True) -> None:
        raise NotImplementedError(f"the {self.name} memory backend cannot release its memory")

    def resident_bytes(self) -> int:
        return self.nbytes

    def partly_held(self) -> bool:
        """Released (must not be touched) yet still holding some physical memory, as a
        CUDA VMM range can after a failed undo; a release then gives the rest back."""
        return False

    def prefault(self) -> None:
        """Back every page with physical memory now (host mappings fault lazily);
        device memory is backed when mapped, so the default does nothing."""

    def close(self) -> None:
        """Give everything back now; the backend and every view of its range are unusable
        afterwards.  Idempotent."""


class RangeArray:
    """Just enough of ``__cuda_array_interface__`` (``__array_interface__`` for host
    addresses) for torch to view a range zero-copy.  It keeps ``owner`` (the object that
    frees the range, never a backend) alive while any tensor views the range: torch keeps
    it in the storage's deleter, numpy as the array's base."""

    def __init__(self, ptr: int, nbytes: int, owner, host: bool = False):
        self._owner = owner
        desc = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "strides": None}
        if host:
            self.__array_interface__ = dict(desc, version=3)
        else:
            self.__cuda_array_interface__ = dict(desc, version=2)


def range_tensor(ptr: int, nbytes: int, owner, device: torch.device) -> torch.Tensor:
    """``uint8 [nbytes]`` view of the memory at ``ptr`` (host memory for a CPU device,
    device memory for a CUDA one) that keeps ``owner`` alive (:class:`RangeArray`)."""
    import numpy as np

    if device.type == "cpu":
        t = torch.from_numpy(np.asarray(RangeArray(ptr, nbytes, owner, host=True)))
    else:
        t = torch.as_tensor(RangeArray(ptr, nbytes, owner), device=device)
    assert t.data_ptr() == ptr
    return t


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
