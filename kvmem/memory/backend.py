"""The interface every memory backend implements, and the zero-copy view of a range.

Contract: :class:`MemoryBackend` is what a :class:`kvmem.KVPool` asks of its memory (the
range's ``tensor``, its chunk ``plan``, ``regions()``, release/resume, ``info()``,
``close()``); :func:`range_tensor` views an address range as a ``uint8`` tensor that
keeps the range's owner alive (:class:`RangeArray`); :data:`MAX_BYTES` is the largest
range a backend can be asked for.  The backends themselves and the choice between them:
:mod:`kvmem.memory`.
"""

from __future__ import annotations

import torch

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
