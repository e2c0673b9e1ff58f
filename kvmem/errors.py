"""kvmem's exceptions.  Each carries the values that explain it; a call that raises
one has changed nothing (the allocator's device-flag errors say what they restored)."""

from __future__ import annotations


class KVMemError(Exception):
    """Base class of kvmem's own errors."""


class OutOfPagesError(KVMemError):
    """An allocation asked for more pages than are free.  The allocator is unchanged."""

    def __init__(self, requested: int, available: int, what: str = "alloc"):
        self.requested = requested
        self.available = available
        super().__init__(
            f"{what}: out of KV pages: {requested} page(s) requested, {available} free"
        )


class DoubleFreeError(KVMemError):
    """A free named a page that is not allocated (freed already, never handed out,
    page 0, out of range, or listed twice in one free).  Nothing was freed."""

    def __init__(self, page: int, reason: str):
        self.page = page
        self.reason = reason
        super().__init__(f"free: page {page} {reason}; nothing was freed")


class ReleasedPoolError(KVMemError):
    """The pool's physical memory is released; touching it would fault."""


class ClosedPoolError(ReleasedPoolError):
    """The pool was closed (:meth:`kvmem.KVPool.close`): its memory and addresses are
    gone for good.  A subclass of :class:`ReleasedPoolError`, so every check that refuses
    a released pool refuses a closed one too."""


def _human_bytes(n: int) -> str:
    for unit, shift in (("EiB", 60), ("PiB", 50), ("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


class PoolMemoryError(KVMemError, MemoryError):
    """Memory for a pool (or another backend range) could not be reserved or mapped.

    Attributes:
        nbytes: bytes asked for.
        backend: the memory backend's name (``host``, ``cuda_vmm``, ``plain``).
        device: the device, as a string.
        reason: what the OS / driver / torch said.

    The call that raised holds nothing it did not hold before: a failed construction
    reserved nothing, a failed resume left the pool released (and retryable).
    """

    def __init__(self, nbytes: int, backend: str, device, reason: str, *,
                 what: str = "allocate", purpose: str = ""):
        self.nbytes = nbytes
        self.backend = backend
        self.device = str(device)
        self.reason = reason
        self.purpose = purpose
        self.what = what
        for_ = f" for {purpose}" if purpose else ""
        super().__init__(
            f"cannot {what} {nbytes} bytes ({_human_bytes(nbytes)}){for_} on the {backend} "
            f"memory backend ({self.device}): {reason}"
        )


class CudaDriverError(KVMemError, RuntimeError):
    """A CUDA driver call failed.  ``call`` names it, ``code`` is the ``CUresult`` name
    (e.g. ``"CUDA_ERROR_INVALID_VALUE"``)."""

    def __init__(self, call: str, code: str, detail: str = ""):
        self.call = call
        self.code = code
        self.detail = detail
        super().__init__(f"{call} failed: {code}" + (f" ({detail})" if detail else ""))
