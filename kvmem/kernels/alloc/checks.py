"""What the allocator's calls check, and the counts of a batch.

- ``check_batch`` / ``check_hints``: the host checks of a batch's tensors (dtype, shape,
  device), every call, no sync;
- ``free_errors_*``, ``extend_problems*``, ``decode_problems*``: what a checked
  (check=True) call validates before it changes anything, in torch on the device (CUDA:
  the caller reads the result in its one sync) and the NumPy twin on the CPU
  (``*_cpu`` / ``*_np``);
- ``extend_counts`` / ``decode_counts`` and their ``*_host`` twins: the pages and tokens
  a batch needs.

Each check returns the first offending entry and its ``kvmem.errors.AllocCode``.
"""

from __future__ import annotations

import numpy as np
import torch

from kvmem.errors import AllocCode as C


def free_errors_cpu(pages: np.ndarray, owned: np.ndarray) -> tuple[int, int] | None:
    """``(position, FREE_* code)`` of the first page of ``pages`` (int64 [n]) that may not
    be freed given ``owned`` (int32 [num_pages]), or None.  Classifies every entry."""
    n = pages.shape[0]
    num_pages = owned.shape[0]
    in_range = (pages >= 1) & (pages < num_pages)
    code = np.where(pages == 0, C.FREE_PAGE_ZERO, C.FREE_OUT_OF_RANGE)
    not_owned = owned[np.where(in_range, pages, 0)] != 1
    order = np.argsort(pages, kind="stable")
    twice = np.zeros(n, dtype=bool)
    twice[order[1:]] = pages[order[1:]] == pages[order[:-1]]
    code = np.where(
        in_range,
        np.where(not_owned, C.FREE_NOT_ALLOCATED, np.where(twice, C.FREE_LISTED_TWICE, 0)),
        code,
    )
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
        torch.where(not_owned, C.FREE_NOT_ALLOCATED, torch.where(twice, C.FREE_LISTED_TWICE, 0)),
        torch.where(p == 0, C.FREE_PAGE_ZERO, C.FREE_OUT_OF_RANGE),
    )
    return _first_problem(code)


def extend_counts(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, page_size: int):
    """(new pages, extend tokens) of a batch, as int64 0-d tensors on its device."""
    pre = prefix_lens.to(torch.int64)
    seq = seq_lens.to(torch.int64)
    new = (seq + page_size - 1) // page_size - (pre + page_size - 1) // page_size
    return new.sum(), (seq - pre).sum()


def decode_counts(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """New pages a decode step needs, int64 0-d tensor on the batch's device."""
    return ((seq_lens.to(torch.int64) - 1) % page_size == 0).sum()


def extend_counts_host(pre: torch.Tensor, seq: torch.Tensor, ps: int) -> tuple[int, int]:
    """(new pages, extend tokens) from the CPU hints, with numpy (no torch dispatch)."""
    pre = pre.numpy().astype(np.int64, copy=False)
    seq = seq.numpy().astype(np.int64, copy=False)
    new = (seq + ps - 1) // ps - (pre + ps - 1) // ps
    return int(new.sum()), int((seq - pre).sum())


def decode_count_host(seq: torch.Tensor, ps: int) -> int:
    seq = seq.numpy().astype(np.int64, copy=False)
    return int(np.count_nonzero((seq - 1) % ps == 0))


def agree(t: torch.Tensor, hint: torch.Tensor) -> torch.Tensor:
    """int64 [1] on t's device: 1 if the CPU hint holds the same values as t."""
    same = (t.to(torch.int64) == hint.to(device=t.device, dtype=torch.int64)).all()
    return same.to(torch.int64).reshape(1)


def _first_problem(code: torch.Tensor) -> torch.Tensor:
    """int64 [2]: [index of the first nonzero code or -1, that code]."""
    if code.numel() == 0:
        return torch.tensor([-1, 0], dtype=torch.int64, device=code.device)
    bad = code != 0
    first = bad.to(torch.int8).argmax()
    return torch.stack((torch.where(bad.any(), first, -1), code[first]))


def _last_page_problem(partial, last, owned, ps):
    """Codes for requests with a partial last page: its slot ``last`` must be in an
    allocated page."""
    page = torch.where(partial, last // ps, 0)
    in_range = (page >= 1) & (page < owned.numel())
    owned_page = owned[torch.where(in_range, page, 0)] == 1
    return partial & ~(in_range & owned_page)


def extend_problems(prefix_lens, seq_lens, last_loc, owned, ps) -> torch.Tensor:
    """int64 [4] on the device: [first bad request or -1, its code, new pages, tokens]."""
    pre = prefix_lens.to(torch.int64)
    seq = seq_lens.to(torch.int64)
    last = last_loc.to(torch.int64)
    partial = (pre > 0) & (pre % ps != 0)
    code = torch.zeros_like(pre)
    code = torch.where(_last_page_problem(partial, last, owned, ps), C.LEN_LAST_PAGE_FREE, code)
    code = torch.where(partial & ((last + 1) % ps != pre % ps), C.LEN_LAST_LOC_OFFSET, code)
    code = torch.where(pre > seq, C.LEN_PREFIX_OVER_SEQ, code)
    code = torch.where(pre < 0, C.LEN_NEGATIVE_PREFIX, code)
    num_new, total = extend_counts(pre, seq, ps)
    return torch.cat((_first_problem(code), torch.stack((num_new, total))))


def decode_problems(seq_lens, last_loc, owned, ps) -> torch.Tensor:
    """int64 [3] on the device: [first bad request or -1, its code, new pages]."""
    seq = seq_lens.to(torch.int64)
    last = last_loc.to(torch.int64)
    partial = (seq >= 1) & ((seq - 1) % ps != 0)
    code = torch.zeros_like(seq)
    code = torch.where(_last_page_problem(partial, last, owned, ps), C.LEN_LAST_PAGE_FREE, code)
    code = torch.where(partial & ((last + 1) % ps != (seq - 1) % ps), C.LEN_LAST_LOC_OFFSET, code)
    code = torch.where(seq < 1, C.LEN_SEQ_BELOW_ONE, code)
    return torch.cat((_first_problem(code), decode_counts(seq, ps).reshape(1)))


def _last_page_problem_np(partial, last, owned_ext, ps):
    """_last_page_problem on the CPU, with the ownership map's end marker (``owned_ext``
    is one entry longer, that entry 0): one clipped lookup checks range (below 1 lands on
    page 0, past the end on the marker, both never owned) and ownership at once."""
    return partial & (owned_ext.take(last // ps, mode="clip") != 1)


def extend_problems_np(pre, seq, last, owned_ext, ps) -> list[int]:
    """numpy twin of extend_problems for CPU batches (NumPy calls cost a fraction of
    torch's there: docs/kernels.md, "Measured on the CPU"): [first bad request or -1,
    code, new pages, tokens]."""
    pre = pre.astype(np.int64, copy=False)
    seq = seq.astype(np.int64, copy=False)
    num_new = int(((seq + ps - 1) // ps - (pre + ps - 1) // ps).sum())
    total = int((seq - pre).sum())
    code = np.zeros(pre.shape[0], dtype=np.int64)
    if ps > 1:
        filled = pre % ps  # tokens on the request's partial last page
        partial = (pre > 0) & (filled != 0)
        if np.count_nonzero(partial):
            last = last.astype(np.int64, copy=False)
            code[_last_page_problem_np(partial, last, owned_ext, ps)] = C.LEN_LAST_PAGE_FREE
            code[partial & ((last + 1) % ps != filled)] = C.LEN_LAST_LOC_OFFSET
    code[pre > seq] = C.LEN_PREFIX_OVER_SEQ
    code[pre < 0] = C.LEN_NEGATIVE_PREFIX
    bad = np.flatnonzero(code)
    first = int(bad[0]) if bad.size else -1
    return [first, int(code[first]) if bad.size else 0, num_new, total]


def decode_problems_np(seq, last, owned_ext, ps) -> list[int]:
    """numpy twin of decode_problems: [first bad request or -1, code, new pages]."""
    seq = seq.astype(np.int64, copy=False)
    offset = (seq - 1) % ps  # where the new token goes in its page
    starts = offset == 0
    num_new = int(np.count_nonzero(starts))
    code = np.zeros(seq.shape[0], dtype=np.int64)
    if ps > 1:
        partial = (seq >= 1) & ~starts
        if np.count_nonzero(partial):
            last = last.astype(np.int64, copy=False)
            code[_last_page_problem_np(partial, last, owned_ext, ps)] = C.LEN_LAST_PAGE_FREE
            code[partial & ((last + 1) % ps != offset)] = C.LEN_LAST_LOC_OFFSET
    code[seq < 1] = C.LEN_SEQ_BELOW_ONE
    bad = np.flatnonzero(code)
    first = int(bad[0]) if bad.size else -1
    return [first, int(code[first]) if bad.size else 0, num_new]


def _same_device(t: torch.Tensor, device: torch.device) -> bool:
    if t.device.type != device.type:
        return False
    return device.index is None or t.device.index is None or t.device.index == device.index


def check_batch(what: str, device: torch.device, **tensors: torch.Tensor) -> int:
    """Host-only checks (no sync) of the batch tensors; returns bs."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what}: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 1:
            raise ValueError(f"{what}: {name} must be 1-D, got shape {tuple(t.shape)}")
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{what}: {name} must be int32 or int64, got {t.dtype}")
        if not _same_device(t, device):
            raise ValueError(f"{what}: {name} is on {t.device}, the allocator on {device}")
    sizes = {name: t.shape[0] for name, t in tensors.items()}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{k}={v}" for k, v in sizes.items())
        raise ValueError(f"{what}: batch tensors differ in length ({listed})")
    return next(iter(sizes.values()))


def check_hints(what: str, bs: int, **hints: torch.Tensor | None):
    """The *_cpu hints (checked: CPU, int32/int64, [bs]), or None when none is given."""
    given = {k: v for k, v in hints.items() if v is not None}
    if not given:
        return None
    if len(given) != len(hints):
        missing = ", ".join(k for k in hints if k not in given)
        raise ValueError(f"{what}: give all of the *_cpu hints or none ({missing} missing)")
    out = []
    for name, t in given.items():
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise ValueError(f"{what}: {name} must be a CPU tensor")
        if t.dim() != 1 or t.numel() != bs:
            raise ValueError(f"{what}: {name} must have shape ({bs},), got {tuple(t.shape)}")
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{what}: {name} must be int32 or int64, got {t.dtype}")
        out.append(t)
    return out
