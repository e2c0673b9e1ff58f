"""The page allocator's references: plain Python, written to be obviously right, that the
tests compare the Triton and CPU paths against.  Layouts: ``kvmem.kernels.alloc``."""

from __future__ import annotations

import torch

from kvmem.errors import AllocCode as C


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
            return i, C.FREE_PAGE_ZERO
        if not 0 < p < len(owned):
            return i, C.FREE_OUT_OF_RANGE
        if owned[p] != 1:
            return i, C.FREE_NOT_ALLOCATED
        if p in seen:
            return i, C.FREE_LISTED_TWICE
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
