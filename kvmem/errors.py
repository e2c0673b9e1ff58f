"""kvmem's exceptions, and the allocator's refusal codes with the exception and message
of each (:class:`AllocCode`, one table).  Each exception carries the values that explain
it; a call that raises one has changed nothing (the allocator's device-flag errors say
what they restored).  Imports nothing outside the standard library: tools/aot_sm90.py
loads it, for the kernels' codes, where only triton is installed."""

from __future__ import annotations

import enum
from typing import cast


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
    for unit, shift in (
        ("EiB", 60),
        ("PiB", 50),
        ("TiB", 40),
        ("GiB", 30),
        ("MiB", 20),
        ("KiB", 10),
    ):
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

    def __init__(
        self,
        nbytes: int,
        backend: str,
        device,
        reason: str,
        *,
        what: str = "allocate",
        purpose: str = "",
    ):
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


@enum.unique
class AllocCode(enum.IntEnum):
    """Why the allocator refused a call, one row per code: the number the allocator's
    kernels record in ``err[0]`` (kvmem/kernels/alloc/triton.py) and its checks return
    (kvmem/kernels/alloc/checks.py), the exception :func:`alloc_error` raises for it, what
    the value recorded with it names (a page id, or a request's index in the batch), and
    the message.

    - ``FREE_*``: a free refused.  The host checks (check=True, and every CPU free) name
      the exact reason; a check=False free on the device records FREE_PAGE_ZERO,
      FREE_OUT_OF_RANGE or ERR_FREE_NOT_ALLOCATED_OR_TWICE.
    - ``ERR_*``: found on the device by a check=False call, raised at the next
      synchronising call; the message names the call.
    - ``LEN_*``: an alloc_extend / alloc_decode batch refused by the host checks.
    """

    raises: type[Exception]
    names: str
    message: str

    def __new__(cls, code: int, raises: type[Exception], names: str, message: str):
        member = int.__new__(cls, code)
        member._value_ = code
        member.raises, member.names, member.message = raises, names, message
        return member

    # name = code, raises, names, message
    FREE_OUT_OF_RANGE = 1, DoubleFreeError, "page", "is out of range"
    FREE_PAGE_ZERO = (
        2,
        DoubleFreeError,
        "page",
        ("is page 0, the padding page, which is never allocated"),
    )
    FREE_NOT_ALLOCATED = (
        3,
        DoubleFreeError,
        "page",
        ("is not allocated (freed already or never handed out)"),
    )
    FREE_LISTED_TWICE = 4, DoubleFreeError, "page", "is listed twice in this free"
    ERR_FREE_NOT_ALLOCATED_OR_TWICE = (
        5,
        DoubleFreeError,
        "page",
        (  # can't tell which
            "is not allocated (freed already, never handed out, or listed twice in one free)"
        ),
    )
    ERR_TAKE_OWNED = (
        6,
        KVMemError,
        "page",
        (
            "alloc(check=False) took a page off the free list that was allocated already (or "
            "not a page id)"
        ),
    )
    ERR_EXTEND_LENGTHS = (
        7,
        ValueError,
        "request",
        ("alloc_extend(check=False): prefix_len < 0 or prefix_len > seq_len"),
    )
    ERR_EXTEND_LAST_LOC = (
        8,
        ValueError,
        "request",
        (
            "alloc_extend(check=False): (last_loc + 1) % page_size != prefix_len % page_size "
            "for a request with a partial last page"
        ),
    )
    ERR_EXTEND_COUNTS = (
        9,
        ValueError,
        "request",
        (
            "alloc_extend(check=False): prefix_lens_cpu / seq_lens_cpu / extend_num_tokens "
            "disagree with the device lengths"
        ),
    )
    ERR_DECODE_SEQ = 10, ValueError, "request", "alloc_decode(check=False): seq_len < 1"
    ERR_DECODE_LAST_LOC = (
        11,
        ValueError,
        "request",
        (
            "alloc_decode(check=False): (last_loc + 1) % page_size != (seq_len - 1) % "
            "page_size for a request that does not start a page"
        ),
    )
    ERR_DECODE_COUNTS = (
        12,
        ValueError,
        "request",
        ("alloc_decode(check=False): seq_lens_cpu disagrees with seq_lens"),
    )
    LEN_NEGATIVE_PREFIX = 13, ValueError, "request", "prefix_len < 0"
    LEN_PREFIX_OVER_SEQ = 14, ValueError, "request", "prefix_len > seq_len"
    LEN_LAST_LOC_OFFSET = (
        15,
        ValueError,
        "request",
        (
            "last_loc is inconsistent with the length: (last_loc + 1) % page_size must equal "
            "the number of tokens on the request's partial last page"
        ),
    )
    LEN_LAST_PAGE_FREE = (
        16,
        ValueError,
        "request",
        (
            "last_loc is not in an allocated page (the request's partial last page must be "
            "allocated)"
        ),
    )
    LEN_SEQ_BELOW_ONE = 17, ValueError, "request", "seq_len < 1"


def alloc_error(
    code: int, value: int, num_pages: int, *, call: str = "", rebuilt: str = ""
) -> Exception:
    """The exception for ``code`` (an :class:`AllocCode`) found at ``value`` (the page, or
    the request's index, that its ``names`` says) in an allocator of ``num_pages`` pages.
    ``call`` names the call whose host checks refused a batch (LEN_*); ``rebuilt``, given
    for what the device recorded, says how the allocator restored its state.  A code
    outside the table is reported as a device error of a batch."""
    c = cast("AllocCode | None", AllocCode._value2member_map_.get(code))
    if c is not None and c.raises is DoubleFreeError:
        reason = c.message
        if c is AllocCode.FREE_OUT_OF_RANGE:
            reason += f" [1, {num_pages})"
        return DoubleFreeError(value, f"{reason}; {rebuilt}" if rebuilt else reason)
    raises = c.raises if c is not None else ValueError
    what = c.message if c is not None else f"device error code {code}"
    if not rebuilt:
        return raises(f"{call}: request {value}: {what}")
    msg = f"{what} ({c.names if c is not None else 'request'} {value}); {rebuilt}"
    if raises is ValueError:  # bad batch inputs: the call went ahead on the device
        msg += "; the slots that call returned are wrong and the pages it took stay allocated"
    return raises(msg)
