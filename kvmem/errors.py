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


# Error codes.  1-4: reasons a free is refused (host checks name the exact one);
# 5-12: recorded on the device by the check=False paths.
FREE_OUT_OF_RANGE = 1
FREE_PAGE_ZERO = 2
FREE_NOT_ALLOCATED = 3
FREE_LISTED_TWICE = 4
ERR_FREE_NOT_ALLOCATED_OR_TWICE = 5  # the device cannot tell which of the two
ERR_TAKE_OWNED = 6  # a page taken off the ring was already owned (or not a page)
ERR_EXTEND_LENGTHS = 7  # prefix_len < 0 or prefix_len > seq_len
ERR_EXTEND_LAST_LOC = 8  # (last_loc + 1) % page_size != prefix_len % page_size
ERR_EXTEND_COUNTS = 9  # hints / extend_num_tokens disagree with the device lengths
ERR_DECODE_SEQ = 10  # seq_len < 1
ERR_DECODE_LAST_LOC = 11  # (last_loc + 1) % page_size != (seq_len - 1) % page_size
ERR_DECODE_COUNTS = 12  # seq_lens_cpu disagrees with seq_lens

FREE_REASONS = {
    FREE_OUT_OF_RANGE: "is out of range",
    FREE_PAGE_ZERO: "is page 0, the padding page, which is never allocated",
    FREE_NOT_ALLOCATED: "is not allocated (freed already or never handed out)",
    FREE_LISTED_TWICE: "is listed twice in this free",
    ERR_FREE_NOT_ALLOCATED_OR_TWICE: "is not allocated (freed already, never handed "
    "out, or listed twice in one free)",
}

NO_BAD = 1 << 62  # "no offending position" in the per-free scratch slots of err

# Reasons an alloc_extend / alloc_decode batch is refused (host checks, check=True).
_LEN_NEGATIVE_PREFIX = 1
_LEN_PREFIX_OVER_SEQ = 2
_LEN_LAST_LOC_OFFSET = 3
_LEN_LAST_PAGE_FREE = 4
_LEN_SEQ_BELOW_ONE = 5
_LEN_REASONS = {
    _LEN_NEGATIVE_PREFIX: "prefix_len < 0",
    _LEN_PREFIX_OVER_SEQ: "prefix_len > seq_len",
    _LEN_LAST_LOC_OFFSET: "last_loc is inconsistent with the length: (last_loc + 1) % "
    "page_size must equal the number of tokens on the request's partial last page",
    _LEN_LAST_PAGE_FREE: "last_loc is not in an allocated page (the request's partial "
    "last page must be allocated)",
    _LEN_SEQ_BELOW_ONE: "seq_len < 1",
}

_DEVICE_ERROR_WHAT = {
    ERR_TAKE_OWNED: "alloc(check=False) took a page off the free list that was "
    "allocated already (or not a page id)",
    ERR_EXTEND_LENGTHS: "alloc_extend(check=False): prefix_len < 0 or prefix_len > "
    "seq_len",
    ERR_EXTEND_LAST_LOC: "alloc_extend(check=False): (last_loc + 1) % page_size != "
    "prefix_len % page_size for a request with a partial last page",
    ERR_EXTEND_COUNTS: "alloc_extend(check=False): prefix_lens_cpu / seq_lens_cpu / "
    "extend_num_tokens disagree with the device lengths",
    ERR_DECODE_SEQ: "alloc_decode(check=False): seq_len < 1",
    ERR_DECODE_LAST_LOC: "alloc_decode(check=False): (last_loc + 1) % page_size != "
    "(seq_len - 1) % page_size for a request that does not start a page",
    ERR_DECODE_COUNTS: "alloc_decode(check=False): seq_lens_cpu disagrees with "
    "seq_lens",
}
