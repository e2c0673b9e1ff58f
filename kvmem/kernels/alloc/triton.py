"""The page allocator's Triton kernels (take, free, extend and decode slots) and their
launchers.  Layouts and slot semantics: ``kvmem.kernels.alloc``.  They run on CUDA
tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (the interpreter tests)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmem.errors import AllocCode
from kvmem.kernels._dispatch import device_guard

NO_BAD = 1 << 62  # "no offending position" in the per-free scratch slots of err

# The codes the kernels record, as Triton constants (kernels may only read constexpr
# globals); what each means, raises and says: kvmem.errors.AllocCode.
_K_FREE_OUT_OF_RANGE = tl.constexpr(int(AllocCode.FREE_OUT_OF_RANGE))
_K_FREE_PAGE_ZERO = tl.constexpr(int(AllocCode.FREE_PAGE_ZERO))
_K_ERR_FREE_NOT_ALLOCATED_OR_TWICE = tl.constexpr(int(AllocCode.ERR_FREE_NOT_ALLOCATED_OR_TWICE))
_K_ERR_TAKE_OWNED = tl.constexpr(int(AllocCode.ERR_TAKE_OWNED))
_K_ERR_EXTEND_LENGTHS = tl.constexpr(int(AllocCode.ERR_EXTEND_LENGTHS))
_K_ERR_EXTEND_LAST_LOC = tl.constexpr(int(AllocCode.ERR_EXTEND_LAST_LOC))
_K_ERR_EXTEND_COUNTS = tl.constexpr(int(AllocCode.ERR_EXTEND_COUNTS))
_K_ERR_DECODE_SEQ = tl.constexpr(int(AllocCode.ERR_DECODE_SEQ))
_K_ERR_DECODE_LAST_LOC = tl.constexpr(int(AllocCode.ERR_DECODE_LAST_LOC))
_K_ERR_DECODE_COUNTS = tl.constexpr(int(AllocCode.ERR_DECODE_COUNTS))
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
        bad_last = (
            mask & (~need) & (seq >= 1) & (((last + 1) % PAGE_SIZE) != ((seq - 1) % PAGE_SIZE))
        )
        _record_any(err_ptr, bad_last, offs, _K_ERR_DECODE_LAST_LOC)
        _record_any(err_ptr, need & (~rank_ok), offs, _K_ERR_DECODE_COUNTS)
        if block_start + BLOCK >= bs:  # the last program: every new page used
            if base + tl.sum(need_i, axis=0) != num_new:
                _record(err_ptr, bs - 1, _K_ERR_DECODE_COUNTS)


def take_pages_triton(ring, owned, err, head: int, n: int, *, flag: bool) -> torch.Tensor:
    """int64 [n]: the pages ring[(head + k) % cap], now owned.  One launch."""
    out = torch.empty(n, dtype=torch.int64, device=ring.device)
    if n:
        with device_guard(ring.device):
            _take_pages_kernel[(triton.cdiv(n, TAKE_BLOCK),)](
                ring,
                owned,
                out,
                err,
                head,
                n,
                ring.numel(),
                owned.numel(),
                BLOCK=TAKE_BLOCK,
                FLAG=flag,
            )
    return out


def free_pages_triton(pages, ring, owned, err, tail: int, parity: int, *, flag: bool) -> None:
    """Release ``pages`` (int [n], validated unless ``flag``) onto the ring at ``tail``.
    One launch, or two with ``flag`` (apply, then commit-or-undo)."""
    n = pages.numel()
    if n == 0:
        return
    grid = (triton.cdiv(n, TAKE_BLOCK),)
    args = (pages, ring, owned, err, n, pages.stride(0), tail, ring.numel(), owned.numel(), parity)
    with device_guard(ring.device):
        _free_apply_kernel[grid](*args, BLOCK=TAKE_BLOCK, FLAG=flag)
        if flag:
            _free_commit_kernel[grid](*args, BLOCK=TAKE_BLOCK)


def extend_slots_triton(
    prefix_lens,
    seq_lens,
    last_loc,
    new_pages,
    page_size: int,
    total: int,
    err,
    *,
    flag: bool = False,
) -> torch.Tensor:
    """int64 [total] token slots; one launch, one program per request."""
    out = torch.empty(total, dtype=torch.int64, device=seq_lens.device)
    bs = seq_lens.numel()
    if bs:
        with device_guard(seq_lens.device):
            _extend_slots_kernel[(bs,)](
                prefix_lens.contiguous(),
                seq_lens.contiguous(),
                last_loc.contiguous(),
                new_pages,
                out,
                err,
                bs,
                new_pages.numel(),
                total,
                PAGE_SIZE=page_size,
                REQ_BLOCK=REQ_BLOCK,
                TOKEN_BLOCK=TOKEN_BLOCK,
                FLAG=flag,
            )
    return out


def decode_slots_triton(
    seq_lens, last_loc, new_pages, page_size: int, err, *, flag: bool = False
) -> torch.Tensor:
    """int64 [bs] token slots; one launch."""
    bs = seq_lens.numel()
    out = torch.empty(bs, dtype=torch.int64, device=seq_lens.device)
    if bs:
        with device_guard(seq_lens.device):
            _decode_slots_kernel[(triton.cdiv(bs, DECODE_BLOCK),)](
                seq_lens.contiguous(),
                last_loc.contiguous(),
                new_pages,
                out,
                err,
                bs,
                new_pages.numel(),
                PAGE_SIZE=page_size,
                BLOCK=DECODE_BLOCK,
                FLAG=flag,
            )
    return out
