"""What a checked (check=True) allocator call validates before it changes anything, and
the counts of a batch: on the device in torch (CUDA; the caller reads the result in
its one sync) and the NumPy twin on the CPU.  Codes: ``kvmem.errors``."""

from __future__ import annotations

import numpy as np
import torch

from kvmem.errors import FREE_LISTED_TWICE, FREE_NOT_ALLOCATED, FREE_OUT_OF_RANGE, FREE_PAGE_ZERO


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

