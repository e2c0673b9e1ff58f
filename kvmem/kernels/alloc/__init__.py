"""The page allocator's operations on its device state: take pages off the free ring,
compute token slots for alloc_extend / alloc_decode, put pages back on the ring.

Layouts (one allocator, all tensors on its device; ``cap = num_pages - 1``)::

    ring      : int64 [cap]        free page ids; the free pages are
                                   ring[(head + k) % cap] for k < count
    owned     : int32 [num_pages]  1 = allocated, 0 = free; owned[0] == 0 always
    err       : int64 [4]          device-side error record of the check=False paths:
                                   err[0] = code (0 = none, else a kvmem.errors.AllocCode),
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
tests/kernels/test_ptx_sm90.py checks the sm_90 PTX of these kernels for 32-bit address math.

Files: ``triton.py`` holds the Triton kernels and their launchers, ``cpu.py`` the CPU
path (NumPy take/free, torch slot computations), ``checks.py`` what the allocator's
calls check and the batch counts, ``ref.py`` the plain references ``*_ref`` the
tests compare against; the error codes: ``kvmem.errors.AllocCode``.  This module: the
per-call dispatchers of the slot computations (the allocator dispatches take/free
itself) and the names the allocator imports.
"""

from __future__ import annotations

import torch

from kvmem.kernels._dispatch import use_triton
from kvmem.kernels.alloc.checks import (
    decode_counts,
    extend_counts,
    free_errors_cpu,
    free_errors_torch,
)
from kvmem.kernels.alloc.cpu import (
    PY_FREE_MAX,
    decode_slots_torch,
    extend_slots_torch,
    free_marks,
    free_pages_cpu,
    free_pages_list,
    take_pages_cpu,
)
from kvmem.kernels.alloc.ref import (
    decode_slots_ref,
    extend_slots_ref,
    free_errors_ref,
    free_pages_ref,
    take_pages_ref,
)
from kvmem.kernels.alloc.triton import (
    NO_BAD,
    decode_slots_triton,
    extend_slots_triton,
    free_pages_triton,
    take_pages_triton,
)

__all__ = [
    "NO_BAD",
    "PY_FREE_MAX",
    "decode_counts",
    "decode_slots",
    "decode_slots_ref",
    "decode_slots_torch",
    "decode_slots_triton",
    "extend_counts",
    "extend_slots",
    "extend_slots_ref",
    "extend_slots_torch",
    "extend_slots_triton",
    "free_errors_cpu",
    "free_errors_ref",
    "free_errors_torch",
    "free_marks",
    "free_pages_cpu",
    "free_pages_list",
    "free_pages_ref",
    "free_pages_triton",
    "take_pages_cpu",
    "take_pages_ref",
    "take_pages_triton",
]


# ----------------------------------------------------------------------------------
# Dispatch, per call, from the tensors' device (kvmem.kernels._dispatch)
# ----------------------------------------------------------------------------------


def extend_slots(
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
    if use_triton(seq_lens):
        return extend_slots_triton(
            prefix_lens, seq_lens, last_loc, new_pages, page_size, total, err, flag=flag
        )
    return extend_slots_torch(prefix_lens, seq_lens, last_loc, new_pages, page_size, total)


def decode_slots(
    seq_lens, last_loc, new_pages, page_size: int, err, *, flag: bool = False
) -> torch.Tensor:
    if use_triton(seq_lens):
        return decode_slots_triton(seq_lens, last_loc, new_pages, page_size, err, flag=flag)
    return decode_slots_torch(seq_lens, last_loc, new_pages, page_size)
