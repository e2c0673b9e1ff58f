"""Memory backends: one address range per pool, reserved once.

A backend owns the bytes behind a :class:`kvmem.KVPool`: ``tensor`` is a ``uint8`` view
of the whole range, whose address never changes for the backend's life.  Backends that
can give physical memory back (pause/resume) implement ``release`` / ``resume``.
"""

from __future__ import annotations

import errno
from typing import Callable

import torch

from kvmem.errors import PoolMemoryError

# The largest range a backend can be asked for: torch sizes and the OS's ssize_t are int64.
MAX_BYTES = (1 << 63) - 1


class MemoryBackend:
    """Interface of a pool's memory.

    Attributes:
        tensor: ``uint8 [nbytes]`` view of the whole range (stable ``data_ptr()``).
        device: where the memory lives.
    """

    name = "abstract"
    can_release = False
    # True while the range must not be touched (its memory is given back, or only partly
    # mapped).  Backends that release keep it exact, failures included.
    released = False

    def __init__(self, nbytes: int, device: torch.device):
        self.nbytes = nbytes
        self.device = device
        self.tensor: torch.Tensor

    def regions(self) -> list[tuple[int, int]]:
        """``(ptr, nbytes)`` ranges to register with a transfer engine (few and large)."""
        return [(self.tensor.data_ptr(), self.nbytes)]

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


class PlainBackend(MemoryBackend):
    """One ordinary device allocation (``torch.empty``): no release."""

    name = "plain"
    ALIGN = 512  # the range starts on this boundary (torch's CPU allocator gives 64)

    def __init__(self, nbytes: int, device: torch.device):
        super().__init__(nbytes, device)
        raw = torch.empty(nbytes + self.ALIGN, dtype=torch.uint8, device=device)
        skip = -raw.data_ptr() % self.ALIGN
        self.tensor = raw[skip:skip + nbytes]

    def close(self) -> None:
        """Drop the allocation: torch frees it once no view of it is left."""
        self.tensor = None


BACKENDS = ("host", "cuda_vmm", "plain")


def make_backend(nbytes: int, device: torch.device,
                 kind: str | Callable[[int, torch.device], MemoryBackend] | None = None, *,
                 purpose: str = "") -> MemoryBackend:
    """The backend for a device: ``host`` on CPU, ``cuda_vmm`` on CUDA; ``kind`` forces one
    (``"plain"``: an ordinary allocation that cannot be released), or is a callable
    ``(nbytes, device) -> MemoryBackend`` that builds one.

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
    if callable(kind):
        factory, name = kind, str(getattr(kind, "name", getattr(kind, "__name__", "custom")))
    elif kind == "host":
        if device.type != "cpu":
            raise ValueError(f"the host backend needs a cpu device, got {device}")
        from kvmem.memory.host import HostBackend

        factory, name = HostBackend, kind
    elif kind == "cuda_vmm":
        if device.type != "cuda":
            raise ValueError(f"the cuda_vmm backend needs a cuda device, got {device}")
        from kvmem.memory.cuda_vmm import CudaVmmBackend

        factory, name = CudaVmmBackend, kind
    elif kind == "plain":
        factory, name = PlainBackend, kind
    else:
        raise ValueError(f"unknown memory backend {kind!r} (known: {', '.join(BACKENDS)})")
    if nbytes > MAX_BYTES:
        raise PoolMemoryError(nbytes, name, device,
                              f"more than the {MAX_BYTES} bytes one range can address",
                              purpose=purpose)
    try:
        return factory(nbytes, device)
    except PoolMemoryError as e:
        if e.purpose or not purpose:
            raise
        raise PoolMemoryError(e.nbytes, e.backend, e.device, e.reason, what=e.what,
                              purpose=purpose) from e
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
