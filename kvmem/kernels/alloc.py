"""Page-allocator kernels: take pages off the free ring, compute token slots for
alloc_extend / alloc_decode, put pages back on the ring.

Layouts (one allocator, all tensors on its device; ``cap = num_pages - 1``)::

    ring      : int64 [cap]        free page ids; the free pages are
                                   ring[(head + k) % cap] for k < count
    owned     : int32 [num_pages]  1 = allocated, 0 = free; owned[0] == 0 always
    err       : int64 [4]          device-side error record of the check=False paths:
                                   err[0] = code (0 = none, else one of the ERR_* below),
                                   err[1] = the page (or request index) it names,
                                   err[2], err[3] = per-free scratch: lowest offending
                                   position of a flagged free, NO_BAD when clean; frees
                                   alternate between the two (``parity``)
    prefix_lens, seq_lens, last_loc : int32 or int64 [bs]
    new_pages : int64 [num_new]    pages taken for one alloc_extend / alloc_decode,
                                   in the order they are handed to requests
    slots     : int64 [extend_num_tokens] (extend) or [bs] (decode);
                slot = page * page_size + offset in page

Token-slot semantics are sglang 0.5.23's PagedTokenToKVPoolAllocator: for a request
extended from ``prefix_len`` to ``seq_len`` tokens, position ``pos`` goes

    pos <  ceil(prefix_len / page_size) * page_size : last_loc + 1 + (pos - prefix_len)
                                                      (the request's partial last page)
    otherwise : new_pages[first_new + pos // page_size - ceil(prefix_len / page_size)]
                * page_size + pos % page_size

where ``first_new`` counts the new pages of the requests before it; each request
needs ``ceil(seq_len / page_size) - ceil(prefix_len / page_size)`` new pages.  Decode is
the extend of one token: a new page when ``(seq_len - 1) % page_size == 0``, else
``last_loc + 1``.

Offsets.  Every offset that reaches an address is computed in int64 (program ids and
32-bit arguments are widened before any arithmetic): a pool of 80 layers and 64 GiB
has token slots and page ids far below 2^31, but nothing here relies on it, and
tests/test_pack_ptx.py checks the sm_90 PTX of these kernels for 32-bit address math.

File order (the project's kernel-file order): Triton kernels, their launchers, the CPU implementations,
the plain references ``*_ref``, then the per-call dispatchers of the slot computations
(the allocator dispatches take/free itself).  On CPU, take/free work on numpy views of
the allocator's tensors (zero copy) rather than torch: they move a few hundred integers,
and a torch call's dispatch (3-15 us on this project's 2-core CPU machines, measured
2026-11-30) against numpy's 0.5-2 us decides whether an alloc+free cycle keeps up with
sglang's TokenToKVPoolAllocator (bench/bench_allocator.py).  The slot computations are
torch.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kvmem.kernels._dispatch import device_guard, use_triton

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

# The same values as Triton constants (kernels may only read constexpr globals).
_K_FREE_OUT_OF_RANGE = tl.constexpr(FREE_OUT_OF_RANGE)
_K_FREE_PAGE_ZERO = tl.constexpr(FREE_PAGE_ZERO)
_K_ERR_FREE_NOT_ALLOCATED_OR_TWICE = tl.constexpr(ERR_FREE_NOT_ALLOCATED_OR_TWICE)
_K_ERR_TAKE_OWNED = tl.constexpr(ERR_TAKE_OWNED)
_K_ERR_EXTEND_LENGTHS = tl.constexpr(ERR_EXTEND_LENGTHS)
_K_ERR_EXTEND_LAST_LOC = tl.constexpr(ERR_EXTEND_LAST_LOC)
_K_ERR_EXTEND_COUNTS = tl.constexpr(ERR_EXTEND_COUNTS)
_K_ERR_DECODE_SEQ = tl.constexpr(ERR_DECODE_SEQ)
_K_ERR_DECODE_LAST_LOC = tl.constexpr(ERR_DECODE_LAST_LOC)
_K_ERR_DECODE_COUNTS = tl.constexpr(ERR_DECODE_COUNTS)
_K_NO_BAD = tl.constexpr(NO_BAD)
_K_INT64_MAX = tl.constexpr(9223372036854775807)

# Block sizes: unmeasured guesses until bench/gpu_check.sh runs on the H200.  These
# kernels move a few KiB; what matters is one or two launches and no host sync.
TAKE_BLOCK = 1024  # pages per program (take, free)
REQ_BLOCK = 1024  # requests summed per loop step for a request's prefix sums
TOKEN_BLOCK = 1024  # token slots written per loop step of one extend request
DECODE_BLOCK = 1024  # requests per decode program


# ----------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------


@triton.jit
def _record(err_ptr, value, code: tl.constexpr):
    """Record ``(code, value)`` in err[0:2] unless an error is recorded already (the
    first one wins).  Scalar; call it under an ``if``."""
    zero = tl.zeros((), dtype=tl.int64)
    old = tl.atomic_cas(err_ptr, zero, zero + code)
    if old == 0:
        tl.store(err_ptr + 1, value)  # converted to int64 by the store


@triton.jit
def _record_any(err_ptr, bad, value, code: tl.constexpr):
    """If any lane of ``bad`` is set, _record the lowest ``value`` among those lanes."""
    if tl.sum(bad.to(tl.int32), axis=0) > 0:
        _record(err_ptr, tl.min(tl.where(bad, value.to(tl.int64), _K_INT64_MAX), axis=0), code)


@triton.jit(do_not_specialize=["head", "n"])
def _take_pages_kernel(
    ring_ptr,  # int64 [cap]
    owned_ptr,  # int32 [num_pages]
    out_ptr,  # int64 [n]
    err_ptr,  # int64 [4]
    head,
    n,
    cap,
    num_pages,
    BLOCK: tl.constexpr,
    FLAG: tl.constexpr,
):
    """out[k] = ring[(head + k) % cap] and owned[out[k]] = 1, for k < n.  With FLAG
    (check=False) ownership is taken with atomic exchanges and a page that was owned
    already, or is not a page id, is recorded in err (ERR_TAKE_OWNED)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    page = tl.load(ring_ptr + (head + offs) % cap, mask=mask, other=0)
    tl.store(out_ptr + offs, page, mask=mask)
    if FLAG:
        ok = mask & (page > 0) & (page < num_pages)
        old = tl.atomic_xchg(owned_ptr + page, 1, mask=ok)
        bad = mask & ((~ok) | (old != 0))
        _record_any(err_ptr, bad, page, _K_ERR_TAKE_OWNED)
    else:
        tl.store(owned_ptr + page, 1, mask=mask)


@triton.jit(do_not_specialize=["n", "tail"])
def _free_apply_kernel(
    pages_ptr,  # int [n], any integer dtype, stride pages_stride
    ring_ptr,  # int64 [cap]
    owned_ptr,  # int32 [num_pages]
    err_ptr,  # int64 [4]
    n,
    pages_stride,
    tail,
    cap,
    num_pages,
    parity,
    BLOCK: tl.constexpr,
    FLAG: tl.constexpr,
):
    """Put ``pages`` on the ring at ``tail`` and mark them free.

    Without FLAG the pages were validated on the host: owned[p] = 0 and
    ring[(tail + i) % cap] = p.  With FLAG (check=False) each page is released with an
    atomic exchange; a lane that did not release an owned page (out of range, not
    owned, or the second copy of a page in this call) writes 0 to its ring slot and
    lowers err[2 + parity] to its position.  _free_commit_kernel then undoes the call
    if any lane failed."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    page = tl.load(pages_ptr + offs * pages_stride, mask=mask, other=0).to(tl.int64)
    slot = (tail + offs) % cap
    if FLAG:
        in_range = mask & (page > 0) & (page < num_pages)
        old = tl.atomic_xchg(owned_ptr + page, 0, mask=in_range)
        released = in_range & (old == 1)
        tl.store(ring_ptr + slot, tl.where(released, page, 0), mask=mask)
        bad_pos = tl.min(tl.where(mask & (~released), offs, _K_NO_BAD), axis=0)
        if bad_pos < _K_NO_BAD:
            tl.atomic_min(err_ptr + 2 + tl.cast(parity, tl.int64), bad_pos)
    else:
        tl.store(owned_ptr + page, 0, mask=mask)
        tl.store(ring_ptr + slot, page, mask=mask)


@triton.jit(do_not_specialize=["n", "tail"])
def _free_commit_kernel(
    pages_ptr,
    ring_ptr,
    owned_ptr,
    err_ptr,
    n,
    pages_stride,
    tail,
    cap,
    num_pages,
    parity,
    BLOCK: tl.constexpr,
):
    """Second half of a check=False free.  If any lane of the call failed
    (err[2 + parity] < NO_BAD): re-own the pages the call released, zero its ring
    slots, and (program 0) record the first offending page in err[0:2].  A clean call
    keeps the ring writes of _free_apply_kernel.  Program 0 also clears the other
    scratch slot for the next flagged free."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64, as every offset here
    mask = offs < n
    par = tl.cast(parity, tl.int64)  # int64 like every offset (parity may be a constexpr)
    bad_pos = tl.load(err_ptr + 2 + par)
    if bad_pos < _K_NO_BAD:
        slot = (tail + offs) % cap
        page = tl.load(ring_ptr + slot, mask=mask, other=0)
        tl.store(owned_ptr + page, 1, mask=mask & (page != 0))
        tl.store(ring_ptr + slot, 0, mask=mask)
        if pid == 0:
            p = tl.load(pages_ptr + bad_pos * pages_stride).to(tl.int64)
            if p == 0:
                _record(err_ptr, p, _K_FREE_PAGE_ZERO)
            elif (p < 0) | (p >= num_pages):
                _record(err_ptr, p, _K_FREE_OUT_OF_RANGE)
            else:
                _record(err_ptr, p, _K_ERR_FREE_NOT_ALLOCATED_OR_TWICE)
    if pid == 0:
        tl.store(err_ptr + 3 - par, _K_NO_BAD)


@triton.jit(do_not_specialize=["bs", "num_new", "total"])
def _extend_slots_kernel(
    prefix_ptr,  # int32/int64 [bs]
    seq_ptr,  # int32/int64 [bs]
    last_loc_ptr,  # int32/int64 [bs]
    new_pages_ptr,  # int64 [num_new]
    out_ptr,  # int64 [total]
    err_ptr,  # int64 [4]
    bs,
    num_new,
    total,
    PAGE_SIZE: tl.constexpr,
    REQ_BLOCK: tl.constexpr,
    TOKEN_BLOCK: tl.constexpr,
    FLAG: tl.constexpr,
):
    """One program per request r: the slots of positions prefix_len..seq_len-1 of r,
    written at out[sum of the extend lengths of requests < r ...].  Prefix sums over
    the earlier requests are recomputed by each program (REQ_BLOCK at a time), so one
    launch does the whole batch.  Writes and page reads outside [0, total) and
    [0, num_new) are masked; with FLAG they are recorded in err (the hints that sized
    them disagreed with the device lengths), as are bad lengths and last_loc."""
    r = tl.program_id(0).to(tl.int64)
    out_start = tl.zeros((), dtype=tl.int64)
    page_start = tl.zeros((), dtype=tl.int64)
    for b in range(0, r, REQ_BLOCK):
        offs = b + tl.arange(0, REQ_BLOCK)
        m = offs < r
        pre_b = tl.load(prefix_ptr + offs, mask=m, other=0).to(tl.int64)
        seq_b = tl.load(seq_ptr + offs, mask=m, other=0).to(tl.int64)
        out_start += tl.sum(seq_b - pre_b, axis=0)
        page_start += tl.sum(
            (seq_b + PAGE_SIZE - 1) // PAGE_SIZE - (pre_b + PAGE_SIZE - 1) // PAGE_SIZE,
            axis=0,
        )
    pre = tl.load(prefix_ptr + r).to(tl.int64)
    seq = tl.load(seq_ptr + r).to(tl.int64)
    last = tl.load(last_loc_ptr + r).to(tl.int64)
    ceil_pre = (pre + PAGE_SIZE - 1) // PAGE_SIZE  # pages the prefix occupies
    first_new_pos = ceil_pre * PAGE_SIZE  # positions from here go to new pages
    page_delta = page_start - ceil_pre  # new_pages index = pos // PAGE_SIZE + page_delta
    ext = seq - pre
    for t in range(0, ext, TOKEN_BLOCK):
        k = t + tl.arange(0, TOKEN_BLOCK)
        mk = k < ext
        pos = pre + k
        in_old = pos < first_new_pos
        pidx = pos // PAGE_SIZE + page_delta
        pidx_ok = (pidx >= 0) & (pidx < num_new)
        page = tl.load(new_pages_ptr + pidx, mask=mk & (~in_old) & pidx_ok, other=0)
        slot = tl.where(in_old, last + 1 + k, page * PAGE_SIZE + pos % PAGE_SIZE)
        dst = out_start + k
        dst_ok = (dst >= 0) & (dst < total)
        tl.store(out_ptr + dst, slot, mask=mk & dst_ok)
        if FLAG:
            bad = mk & (((~in_old) & (~pidx_ok)) | (~dst_ok))
            _record_any(err_ptr, bad, r + k * 0, _K_ERR_EXTEND_COUNTS)
    if FLAG:
        if (pre < 0) | (seq < pre):
            _record(err_ptr, r, _K_ERR_EXTEND_LENGTHS)
        if (pre > 0) & (pre % PAGE_SIZE != 0) & ((last + 1) % PAGE_SIZE != pre % PAGE_SIZE):
            _record(err_ptr, r, _K_ERR_EXTEND_LAST_LOC)
        if r == bs - 1:
            # the last request must end at the end of out and use the last new page
            used = page_start + (seq + PAGE_SIZE - 1) // PAGE_SIZE - ceil_pre
            if (out_start + ext != total) | (used != num_new):
                _record(err_ptr, r, _K_ERR_EXTEND_COUNTS)


@triton.jit(do_not_specialize=["bs", "num_new"])
def _decode_slots_kernel(
    seq_ptr,  # int32/int64 [bs]
    last_loc_ptr,  # int32/int64 [bs]
    new_pages_ptr,  # int64 [num_new]
    out_ptr,  # int64 [bs]
    err_ptr,  # int64 [4]
    bs,
    num_new,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    FLAG: tl.constexpr,
):
    """BLOCK requests per program: out[i] = new_pages[rank] * PAGE_SIZE when request i
    starts a page ((seq_len - 1) % PAGE_SIZE == 0; rank = number of such requests
    before it), else last_loc[i] + 1."""
    pid = tl.program_id(0).to(tl.int64)
    base = tl.zeros((), dtype=tl.int64)
    block_start = pid * BLOCK
    for b in range(0, block_start, BLOCK):
        offs_b = b + tl.arange(0, BLOCK)
        s_b = tl.load(seq_ptr + offs_b, mask=offs_b < block_start, other=1).to(tl.int64)
        base += tl.sum(((s_b - 1) % PAGE_SIZE == 0).to(tl.int64), axis=0)
    offs = block_start + tl.arange(0, BLOCK)
    mask = offs < bs
    seq = tl.load(seq_ptr + offs, mask=mask, other=1).to(tl.int64)
    need = mask & ((seq - 1) % PAGE_SIZE == 0)
    need_i = need.to(tl.int64)
    rank = base + tl.cumsum(need_i, axis=0) - need_i
    rank_ok = rank < num_new
    page = tl.load(new_pages_ptr + rank, mask=need & rank_ok, other=0)
    last = tl.load(last_loc_ptr + offs, mask=mask & (~need), other=0).to(tl.int64)
    tl.store(out_ptr + offs, tl.where(need, page * PAGE_SIZE, last + 1), mask=mask)
    if FLAG:
        _record_any(err_ptr, mask & (seq < 1), offs, _K_ERR_DECODE_SEQ)
        bad_last = mask & (~need) & (seq >= 1) & (
            ((last + 1) % PAGE_SIZE) != ((seq - 1) % PAGE_SIZE)
        )
        _record_any(err_ptr, bad_last, offs, _K_ERR_DECODE_LAST_LOC)
        _record_any(err_ptr, need & (~rank_ok), offs, _K_ERR_DECODE_COUNTS)
        if block_start + BLOCK >= bs:  # the last program: every new page used
            if base + tl.sum(need_i, axis=0) != num_new:
                _record(err_ptr, bs - 1, _K_ERR_DECODE_COUNTS)


# ----------------------------------------------------------------------------------
# Launchers (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)
# ----------------------------------------------------------------------------------


def take_pages_triton(ring, owned, err, head: int, n: int, *, flag: bool) -> torch.Tensor:
    """int64 [n]: the pages ring[(head + k) % cap], now owned.  One launch."""
    out = torch.empty(n, dtype=torch.int64, device=ring.device)
    if n:
        with device_guard(ring.device):
            _take_pages_kernel[(triton.cdiv(n, TAKE_BLOCK),)](
                ring, owned, out, err, head, n, ring.numel(), owned.numel(),
                BLOCK=TAKE_BLOCK, FLAG=flag,
            )
    return out


def free_pages_triton(pages, ring, owned, err, tail: int, parity: int, *, flag: bool) -> None:
    """Release ``pages`` (int [n], validated unless ``flag``) onto the ring at ``tail``.
    One launch, or two with ``flag`` (apply, then commit-or-undo)."""
    n = pages.numel()
    if n == 0:
        return
    grid = (triton.cdiv(n, TAKE_BLOCK),)
    args = (pages, ring, owned, err, n, pages.stride(0), tail, ring.numel(),
            owned.numel(), parity)
    with device_guard(ring.device):
        _free_apply_kernel[grid](*args, BLOCK=TAKE_BLOCK, FLAG=flag)
        if flag:
            _free_commit_kernel[grid](*args, BLOCK=TAKE_BLOCK)


def extend_slots_triton(prefix_lens, seq_lens, last_loc, new_pages, page_size: int,
                        total: int, err, *, flag: bool = False) -> torch.Tensor:
    """int64 [total] token slots; one launch, one program per request."""
    out = torch.empty(total, dtype=torch.int64, device=seq_lens.device)
    bs = seq_lens.numel()
    if bs:
        with device_guard(seq_lens.device):
            _extend_slots_kernel[(bs,)](
                prefix_lens.contiguous(), seq_lens.contiguous(), last_loc.contiguous(),
                new_pages, out, err, bs, new_pages.numel(), total,
                PAGE_SIZE=page_size, REQ_BLOCK=REQ_BLOCK, TOKEN_BLOCK=TOKEN_BLOCK,
                FLAG=flag,
            )
    return out


def decode_slots_triton(seq_lens, last_loc, new_pages, page_size: int, err, *,
                        flag: bool = False) -> torch.Tensor:
    """int64 [bs] token slots; one launch."""
    bs = seq_lens.numel()
    out = torch.empty(bs, dtype=torch.int64, device=seq_lens.device)
    if bs:
        with device_guard(seq_lens.device):
            _decode_slots_kernel[(triton.cdiv(bs, DECODE_BLOCK),)](
                seq_lens.contiguous(), last_loc.contiguous(), new_pages, out, err, bs,
                new_pages.numel(), PAGE_SIZE=page_size, BLOCK=DECODE_BLOCK, FLAG=flag,
            )
    return out


# ----------------------------------------------------------------------------------
# CPU implementations (vectorised; no Python loop per page or per request)
# ----------------------------------------------------------------------------------


def take_pages_cpu(ring: np.ndarray, owned: np.ndarray, head: int, n: int) -> torch.Tensor:
    """take_pages on numpy views of CPU state (``ring`` [cap], ``owned`` [>= num_pages]):
    a copy of the n ring entries from ``head`` (never a view: ring slots are overwritten
    later), now marked owned."""
    cap = ring.shape[0]
    end = head + n
    if end <= cap:
        pages = ring[head:end].copy()
    else:
        pages = np.concatenate((ring[head:], ring[: end - cap]))
    owned[pages] = 1
    return torch.from_numpy(pages)


def free_errors_cpu(pages: np.ndarray, owned: np.ndarray) -> tuple[int, int] | None:
    """``(position, FREE_* code)`` of the first page of ``pages`` (int64 [n]) that may not
    be freed given ``owned`` (int32 [num_pages]), or None.  Classifies every entry."""
    n = pages.shape[0]
    num_pages = owned.shape[0]
    in_range = (pages >= 1) & (pages < num_pages)
    code = np.where(pages == 0, FREE_PAGE_ZERO, FREE_OUT_OF_RANGE)
    not_owned = owned[np.where(in_range, pages, 0)] != 1
    order = np.argsort(pages, kind="stable")
    twice = np.zeros(n, dtype=bool)
    twice[order[1:]] = pages[order[1:]] == pages[order[:-1]]
    code = np.where(in_range, np.where(not_owned, FREE_NOT_ALLOCATED,
                                       np.where(twice, FREE_LISTED_TWICE, 0)), code)
    bad = np.flatnonzero(code)
    return None if bad.size == 0 else (int(bad[0]), int(code[bad[0]]))


def free_marks(n: int) -> np.ndarray:
    """int32 [n]: the distinct marks 2, 3, ... that free_pages_cpu writes into the map.
    Its caller keeps them (PageAllocator: one array per allocator, grown on demand, so no
    scratch is shared between allocators or threads)."""
    return np.arange(2, n + 2, dtype=np.int32)


def free_pages_cpu(pages: np.ndarray, ring: np.ndarray, owned_ext: np.ndarray,
                   tail: int, marks: np.ndarray | None = None) -> tuple[int, int] | None:
    """free on numpy views of CPU state.  ``owned_ext`` is the ownership map with one
    extra entry at the end that is always 0, so that a single clipped lookup checks range
    and ownership together (below 1 clips to page 0, past the end to the extra entry, both
    never owned).  If every page may be freed: mark them free, write them to the ring
    from ``tail`` (wrapping), return None.  Else change nothing and return
    ``(position, code)`` of the first offending page.  O(n): duplicates are found by
    writing each entry's position into the map and reading it back (a page listed twice
    reads another entry's position), then the map entries are set to 0 (or back to 1).
    ``marks``: the caller's scratch, ``free_marks(m)`` with m >= min(n, num_pages - 1);
    None makes one for this call."""
    n = pages.shape[0]
    if n == 0:
        return None
    owned = owned_ext[:-1]
    if n > owned.shape[0] - 1:  # more entries than pages: one is bad or listed twice
        return free_errors_cpu(pages, owned)
    # (np.count_nonzero: ndarray.all() costs several times more on arrays this small)
    if np.count_nonzero(owned_ext.take(pages, mode="clip")) != n:
        return free_errors_cpu(pages, owned)
    if n > 1:
        if marks is None:
            marks = free_marks(n)
        assert marks.shape[0] >= n, "free_pages_cpu: marks shorter than the free"
        marks = marks[:n]
        owned[pages] = marks
        if np.count_nonzero(owned[pages] == marks) != n:
            owned[pages] = 1
            return free_errors_cpu(pages, owned)
    owned[pages] = 0
    cap = ring.shape[0]
    end = tail + n
    if end <= cap:
        ring[tail:end] = pages
    else:
        ring[tail:] = pages[: cap - tail]
        ring[: end - cap] = pages[cap - tail:]
    return None


# Longest Python list free_pages_list takes.  Per call on the project's 2-core VM
# (2026-11-30, bench/bench_allocator.py::test_free_short_list, min of 5 x 3000):
# free_pages_list costs
# 0.23 / 1.28 / 3.43 / 6.45 us at 1 / 10 / 32 / 64 pages, free_pages_cpu of the same list
# (np.array first) 1.45 / 2.69 / 3.21 / 3.79 us: they cross at about 30 pages.
PY_FREE_MAX = 32


def free_pages_list(pages: list, ring: memoryview, owned: memoryview, tail: int) -> bool:
    """free_pages_cpu for a short Python list of ints, without NumPy: ``ring`` and
    ``owned`` are memoryviews of the ring and of the ownership map proper (without the
    extra entry).  If every entry is an ``int`` (``type(p) is int``: bool and NumPy
    scalars are not) naming an allocated page, listed once: mark them free, write them
    to the ring from ``tail`` (wrapping) and return True.  Else change nothing and
    return False, and the caller takes free_pages_cpu's path, which reports the first
    offending entry.  Each NumPy call costs about 1 us here whatever its size, so for a
    few pages plain Python is cheaper (PY_FREE_MAX, measured)."""
    num_pages = len(owned)
    for p in pages:
        if type(p) is not int or not 0 < p < num_pages or owned[p] != 1:
            return False
    n = len(pages)
    if n > 1 and len(set(pages)) != n:
        return False
    for p in pages:
        owned[p] = 0
    cap = len(ring)
    for p in pages:
        ring[tail] = p
        tail += 1
        if tail == cap:
            tail = 0
    return True


def free_errors_torch(pages: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """free_errors on the device, for check=True on CUDA: int64 [2] =
    ``[position of the first offending page or -1, its FREE_* code]``, computed without
    a host sync (the caller reads it, with anything else it needs, in one sync)."""
    num_pages = owned.numel()
    p = pages.to(torch.int64)
    n = p.numel()
    if n == 0:
        return torch.tensor([-1, 0], dtype=torch.int64, device=p.device)
    in_range = (p >= 1) & (p < num_pages)
    not_owned = owned[torch.where(in_range, p, 0)] != 1
    s, order = torch.sort(p, stable=True)
    twice = torch.zeros(n, dtype=torch.bool, device=p.device)
    twice[order[1:]] = s[1:] == s[:-1]
    code = torch.where(
        in_range,
        torch.where(not_owned, FREE_NOT_ALLOCATED,
                    torch.where(twice, FREE_LISTED_TWICE, 0)),
        torch.where(p == 0, FREE_PAGE_ZERO, FREE_OUT_OF_RANGE),
    )
    bad = code != 0
    first = bad.to(torch.int8).argmax()
    return torch.stack((torch.where(bad.any(), first, -1), code[first]))


def extend_counts(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, page_size: int):
    """(new pages, extend tokens) of a batch, as int64 0-d tensors on its device."""
    pre = prefix_lens.to(torch.int64)
    seq = seq_lens.to(torch.int64)
    new = (seq + page_size - 1) // page_size - (pre + page_size - 1) // page_size
    return new.sum(), (seq - pre).sum()


def decode_counts(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """New pages a decode step needs, int64 0-d tensor on the batch's device."""
    return ((seq_lens.to(torch.int64) - 1) % page_size == 0).sum()


def extend_slots_torch(prefix_lens, seq_lens, last_loc, new_pages, page_size: int,
                       total: int) -> torch.Tensor:
    """extend_slots in torch: int64 [total].  Inputs must be valid (the allocator
    checks them): total == sum(seq_lens - prefix_lens), new_pages as many as needed."""
    device = seq_lens.device
    pre = prefix_lens.to(torch.int64)
    seq = seq_lens.to(torch.int64)
    last = last_loc.to(torch.int64)
    ext = seq - pre
    ceil_pre = (pre + page_size - 1) // page_size
    new_per_req = (seq + page_size - 1) // page_size - ceil_pre
    out_start = torch.cumsum(ext, 0) - ext
    page_start = torch.cumsum(new_per_req, 0) - new_per_req
    # Per request: pos = j + pos_delta for output index j; old-page slot = pos +
    # old_delta; new-page index = pos // page_size + page_delta; first new position.
    per_req = torch.stack(
        (pre - out_start, last + 1 - pre, page_start - ceil_pre, ceil_pre * page_size), 1
    )
    owner = torch.repeat_interleave(
        torch.arange(seq.numel(), device=device), ext, output_size=total
    )
    # index_select, not advanced indexing: one thread on CPU, 32k rows, 66 vs 171 us
    # (2-D) and 11 vs 98 us (1-D), same result
    per_tok = per_req.index_select(0, owner)
    pos = torch.arange(total, device=device) + per_tok[:, 0]
    old_slot = pos + per_tok[:, 1]
    if new_pages.numel() == 0:
        return old_slot
    pidx = (pos // page_size + per_tok[:, 2]).clamp_(0, new_pages.numel() - 1)
    new_slot = new_pages.index_select(0, pidx) * page_size + pos % page_size
    return torch.where(pos < per_tok[:, 3], old_slot, new_slot)


def decode_slots_torch(seq_lens, last_loc, new_pages, page_size: int) -> torch.Tensor:
    """decode_slots in torch: int64 [bs]."""
    seq = seq_lens.to(torch.int64)
    after_last = last_loc.to(torch.int64) + 1
    if new_pages.numel() == 0:
        return after_last
    need = (seq - 1) % page_size == 0
    need_i = need.to(torch.int64)
    rank = (torch.cumsum(need_i, 0) - need_i).clamp_(max=new_pages.numel() - 1)
    return torch.where(need, new_pages[rank] * page_size, after_last)


# ----------------------------------------------------------------------------------
# References: plain Python, written to be obviously right
# ----------------------------------------------------------------------------------


def take_pages_ref(ring: torch.Tensor, owned: torch.Tensor, head: int, n: int):
    """(pages int64 [n], owned afterwards); inputs untouched."""
    cap = ring.numel()
    pages = [int(ring[(head + k) % cap]) for k in range(n)]
    owned_after = owned.clone()
    for p in pages:
        owned_after[p] = 1
    return torch.tensor(pages, dtype=torch.int64), owned_after


def free_errors_ref(pages, owned) -> tuple[int, int] | None:
    """``(position, FREE_* code)`` of the first page that may not be freed, or None."""
    owned = [int(x) for x in owned]
    seen = set()
    for i, p in enumerate(int(x) for x in pages):
        if p == 0:
            return i, FREE_PAGE_ZERO
        if not 0 < p < len(owned):
            return i, FREE_OUT_OF_RANGE
        if owned[p] != 1:
            return i, FREE_NOT_ALLOCATED
        if p in seen:
            return i, FREE_LISTED_TWICE
        seen.add(p)
    return None


def free_pages_ref(pages, ring: torch.Tensor, owned: torch.Tensor, tail: int):
    """(ring, owned) after freeing ``pages`` at ``tail``, or the free_errors_ref
    tuple if the free must be refused; inputs untouched."""
    bad = free_errors_ref(pages, owned)
    if bad is not None:
        return bad
    ring_after, owned_after = ring.clone(), owned.clone()
    cap = ring.numel()
    for i, p in enumerate(int(x) for x in pages):
        ring_after[(tail + i) % cap] = p
        owned_after[p] = 0
    return ring_after, owned_after


def extend_slots_ref(prefix_lens, seq_lens, last_loc, new_pages, page_size: int) -> torch.Tensor:
    """Token slots of an extend batch, one request and one position at a time."""
    new_pages = [int(x) for x in new_pages]
    taken = 0
    out = []
    for pre, seq, last in zip(prefix_lens.tolist(), seq_lens.tolist(), last_loc.tolist()):
        first_new_pos = -(-pre // page_size) * page_size
        page = None
        for pos in range(pre, seq):
            if pos < first_new_pos:  # the rest of the request's last, partial page
                out.append(last + 1 + (pos - pre))
                continue
            if page is None or pos % page_size == 0:  # start a new page
                page = new_pages[taken]
                taken += 1
            out.append(page * page_size + pos % page_size)
    assert taken == len(new_pages), "new_pages does not match the batch"
    return torch.tensor(out, dtype=torch.int64)


def decode_slots_ref(seq_lens, last_loc, new_pages, page_size: int) -> torch.Tensor:
    """Token slot of one new token per request."""
    new_pages = [int(x) for x in new_pages]
    taken = 0
    out = []
    for seq, last in zip(seq_lens.tolist(), last_loc.tolist()):
        if (seq - 1) % page_size == 0:
            out.append(new_pages[taken] * page_size)
            taken += 1
        else:
            out.append(last + 1)
    assert taken == len(new_pages), "new_pages does not match the batch"
    return torch.tensor(out, dtype=torch.int64)


# ----------------------------------------------------------------------------------
# Dispatch, per call, from the tensors' device (kvmem.kernels._dispatch)
# ----------------------------------------------------------------------------------


def extend_slots(prefix_lens, seq_lens, last_loc, new_pages, page_size: int, total: int,
                 err, *, flag: bool = False) -> torch.Tensor:
    if use_triton(seq_lens):
        return extend_slots_triton(prefix_lens, seq_lens, last_loc, new_pages, page_size,
                                   total, err, flag=flag)
    return extend_slots_torch(prefix_lens, seq_lens, last_loc, new_pages, page_size, total)


def decode_slots(seq_lens, last_loc, new_pages, page_size: int, err, *,
                 flag: bool = False) -> torch.Tensor:
    if use_triton(seq_lens):
        return decode_slots_triton(seq_lens, last_loc, new_pages, page_size, err, flag=flag)
    return decode_slots_torch(seq_lens, last_loc, new_pages, page_size)
