"""Pack a request's scattered KV pages into one contiguous chunk, and unpack it.

Buffers (one tensor per layer; sglang's 3-D ``[num_tokens, H, D]`` buffers are viewed as
pages)::

    k_buffers[l] : [num_pages, page_size, H, D]     any strides, D contiguous
    v_buffers[l] : [num_pages, page_size, H, Dv]    (absent for a K-only cache)
    page_ids     : int32 | int64 [n]                pages to move, in chunk order

Packed chunk layout (fixed; sglang 0.5.23's staging layout, ``gather_all_layers_to_staging``),
a 1-D ``uint8`` buffer of ``packed_nbytes`` bytes::

    for l in layers:            # K of every selected layer, in the order given
        for p in page_ids:      #   pages in page_ids order
            k_buffers[l][p, :, h0:h1, :]     # [page_size, h1-h0, D], tokens in order
    for l in layers:            # then V of every selected layer likewise
        for p in page_ids:
            v_buffers[l][p, :, h0:h1, :]     # [page_size, h1-h0, Dv]

``heads=(h0, h1)`` (stop exclusive) selects a head range for prefill and decode running
different tensor-parallel sizes; ``layers`` is any sequence of layer indices, packed in
the order given.  A chunk is bytes: fp8 and K/V of different head dims need no special case.

Implementation.  One Triton kernel body serves both directions (``PACK`` is a
``tl.constexpr``); one launch covers every selected layer, K and V, and the head range:
the grid is ``(n, num_selected_layers * 2)``, one program per (page, layer, K|V), each
copying that page's ``[page_size, heads, D]`` block as rows of contiguous 4-byte units
(16-byte vector accesses when the addresses allow it).  Rows that are contiguous with each
other (all heads selected, dense buffers) are merged into one long row, so a dense page is
one straight copy.  Every offset that reaches an address is int64 (a chunk's K half
passes 2^31 units at 8 GiB of bf16).  Each launch runs under ``device_guard`` of the
buffers' device, on that device's current stream.  Copy plans are cached per device
(``_PLAN_CACHE_SIZE``, thread-safe).  The CPU path (torch) moves rows with one
``index_select`` / ``index_put_`` over every selected layer, K and V (two when K and V
rows differ in size) when the buffers share one storage (a KVPool, either layout), and one
per layer and K/V for separate per-layer tensors; never a Python loop per page (each
torch op is an OpenMP parallel region, and under CPU contention every region costs a
wait: ``_one_storage_rows``).

Files: ``triton.py`` holds the Triton kernel and its launcher, ``cpu.py`` the CPU path
(torch), ``plan.py`` the validation and the copy plan both share, ``ref.py`` the plain
references ``pack_buffers_ref`` / ``unpack_buffers_ref`` the tests compare against.
This module: the public functions, which choose per call between the two paths.

Host syncs on CUDA: ``check=True`` (the default) costs one, to validate the ids.  With
``check=False`` there is none: ids given as a list or a NumPy array reach the device
through pinned memory and a non-blocking copy (``kvmem._ids``), and a new plan's layer
offsets likewise.
"""

from __future__ import annotations

import torch

from kvmem._ids import as_page_ids
from kvmem.kernels._dispatch import is_async_device, use_triton
from kvmem.kernels.pack.cpu import _torch_copy
from kvmem.kernels.pack.plan import (
    _check_chunk,
    _check_heads,
    _check_layers,
    _Plan,
    _validate_page_ids,
    make_plan,
)
from kvmem.kernels.pack.ref import pack_buffers_ref, unpack_buffers_ref
from kvmem.kernels.pack.triton import _launch, kernel_params

# _check_layers / _check_heads: kvmem.pool validates its selections with them
__all__ = [
    "make_plan",
    "kernel_params",
    "pack_buffers",
    "unpack_buffers",
    "run_pack",
    "run_unpack",
    "pack_buffers_ref",
    "unpack_buffers_ref",
    "_check_layers",
    "_check_heads",
]


def pack_buffers(
    k_buffers, v_buffers, page_ids, *, page_size=None, layers=None, heads=None, out=None, check=True
) -> torch.Tensor:
    """Pack pages of per-layer K/V tensors into one chunk (layout: module docstring).

    Args:
        k_buffers, v_buffers: lists of per-layer tensors, ``[num_pages, page_size, H, D]``
            or sglang's ``[num_tokens, H, D]`` (then ``page_size=`` is required);
            ``v_buffers`` may be ``None`` / empty for a K-only cache.
        page_ids: int32/int64 ``[n]`` on the buffers' device: a torch tensor (any
            stride), a CuPy array (DLPack, zero-copy), a NumPy array or a Python
            sequence of ints (on CUDA: pinned memory and a non-blocking copy, no sync);
            bool and float ids are refused (``kvmem._ids.as_page_ids``).
        layers: layer indices in chunk order; ``None`` = all.
        heads: ``(start, stop)``; ``None`` = all heads.
        out: optional preallocated 1-D uint8 chunk of exactly the packed size.
        check: on CUDA, validate page ids first (one host sync); with ``check=False`` an
            out-of-range id is skipped and raised by the next checked call.  CPU always
            validates.

    Returns:
        ``uint8 [packed_nbytes]``: ``out`` when given.
    """
    plan = make_plan(k_buffers, v_buffers, page_size, layers, heads)
    return run_pack(plan, k_buffers, v_buffers, page_ids, out=out, check=check)


def unpack_buffers(
    buf, k_buffers, v_buffers, page_ids, *, page_size=None, layers=None, heads=None, check=True
) -> None:
    """Write a packed chunk back into pages of per-layer K/V tensors (inverse of
    :func:`pack_buffers`; same arguments).  ``page_ids`` must be distinct."""
    plan = make_plan(k_buffers, v_buffers, page_size, layers, heads)
    run_unpack(plan, buf, k_buffers, v_buffers, page_ids, check=check)


def run_pack(plan: _Plan, k_buffers, v_buffers, page_ids, *, out=None, check=True) -> torch.Tensor:
    """pack_buffers with a plan already made (KVPool keeps its plans)."""
    ids = as_page_ids(page_ids, plan.device)
    nbytes = plan.nbytes(ids.numel())
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=plan.device)
    else:
        _check_chunk(out, nbytes, plan.device, "out")
    _run(plan, k_buffers, v_buffers, ids, out, pack=True, check=check)
    return out


def run_unpack(plan: _Plan, buf, k_buffers, v_buffers, page_ids, *, check=True) -> None:
    ids = as_page_ids(page_ids, plan.device)
    _check_chunk(buf, plan.nbytes(ids.numel()), plan.device, "buf")
    _run(plan, k_buffers, v_buffers, ids, buf, pack=False, check=check)


def _run(
    plan: _Plan,
    k_buffers,
    v_buffers,
    ids: torch.Tensor,
    chunk: torch.Tensor,
    *,
    pack: bool,
    check: bool,
) -> None:
    if check or not is_async_device(ids):
        _validate_page_ids(ids, plan.num_pages, unique=not pack, what="pack" if pack else "unpack")
    if use_triton(ids):
        _launch(plan, k_buffers, ids, chunk, pack)
    else:
        _torch_copy(plan, k_buffers, v_buffers, ids, chunk, pack)
