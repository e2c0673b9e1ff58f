"""The page allocator's CPU path: take and free on NumPy views of the allocator's
tensors (zero copy), a free of a short Python list in plain Python, and the torch slot
computations of alloc_extend / alloc_decode.  Layouts: ``kvmem.kernels.alloc``.

Take and free are NumPy, not torch: they move a few hundred integers, where a torch
call's dispatch costs several times a NumPy call's (docs/kernels.md, "Measured on the
CPU").  The slot computations are torch.
"""

from __future__ import annotations

import numpy as np
import torch

from kvmem.kernels.alloc.checks import free_errors_cpu


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


def free_marks(n: int) -> np.ndarray:
    """int32 [n]: the distinct marks 2, 3, ... that free_pages_cpu writes into the map.
    Its caller keeps them (PageAllocator: one array per allocator, grown on demand, so no
    scratch is shared between allocators or threads)."""
    return np.arange(2, n + 2, dtype=np.int32)


def free_pages_cpu(
    pages: np.ndarray,
    ring: np.ndarray,
    owned_ext: np.ndarray,
    tail: int,
    marks: np.ndarray | None = None,
) -> tuple[int, int] | None:
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
        ring[: end - cap] = pages[cap - tail :]
    return None


# Longest Python list free_pages_list takes: where it and free_pages_cpu cross
# (docs/kernels.md, "Measured on the CPU").
PY_FREE_MAX = 32


def free_pages_list(pages: list, ring: memoryview, owned: memoryview, tail: int) -> bool:
    """free_pages_cpu for a short Python list of ints, without NumPy: ``ring`` and
    ``owned`` are memoryviews of the ring and of the ownership map proper (without the
    extra entry).  If every entry is an ``int`` (``type(p) is int``: bool and NumPy
    scalars are not) naming an allocated page, listed once: mark them free, write them
    to the ring from ``tail`` (wrapping) and return True.  Else change nothing and
    return False, and the caller takes free_pages_cpu's path, which reports the first
    offending entry.  For a few pages (up to PY_FREE_MAX) plain Python is cheaper than
    NumPy's per-call cost."""
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


def extend_slots_torch(
    prefix_lens, seq_lens, last_loc, new_pages, page_size: int, total: int
) -> torch.Tensor:
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
    # index_select, not advanced indexing: same result, faster (docs/kernels.md,
    # "Measured on the CPU")
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
