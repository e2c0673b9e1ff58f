"""The pack/unpack CPU path (torch): whole rows moved by one ``index_select`` (pack) /
``index_put_`` (unpack) per row shape, never a Python loop per page.  Layouts:
``kvmem.kernels.pack``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvmem.kernels.pack.plan import _as_pages, _Plan

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


@dataclass(frozen=True)
class _Rows:
    """One op of the CPU path: rows of ``seg`` bytes gathered from (pack) or scattered to
    (unpack) one storage, viewed as ``[R, seg]`` rows ``pitch`` bytes apart.  Row
    ``starts[c] + page * page_step + within[r]`` is row r of page ``page`` of copy c
    (copies in chunk order: the selected K layers, then V when K and V rows match)."""

    base: torch.Tensor  # any view into the storage (as_strided counts from its start)
    pitch: int  # bytes between consecutive rows of the [R, seg] view
    seg: int  # bytes per row
    num_rows: int  # R
    starts: list  # row index of page 0's first row, per copy
    page_step: int  # rows between the same row of consecutive pages
    within: list  # row offsets of a page's rows from its first, chunk order


def _row_geometry(view: torch.Tensor, h0: int, nh: int):
    """(seg, row offsets within a page, page stride), in bytes, of the head slice
    [h0, h0+nh) of a ``[P, ps, H, D]`` view, rows merged where contiguous (like _kind)."""
    item = view.element_size()
    ps, d = view.shape[1], view.shape[3]
    sp, st, sh = (s * item for s in view.stride()[:3])
    seg, toks, heads = d * item, ps, nh
    if nh == 1 or sh == seg:
        seg, heads = seg * nh, 1
        if ps == 1 or st == seg:
            seg, toks = seg * ps, 1
    within = [t * st + h * sh for t in range(toks) for h in range(heads)]
    return seg, within, sp, h0 * sh


def _one_storage_rows(plan: _Plan, k_buffers, v_buffers) -> list[_Rows] | None:
    """The CPU copy of ``plan`` as one op per row shape (one in all for K and V of the
    same head_dim, two otherwise), or None when the selected buffers do not share one
    storage (separate per-layer tensors, e.g. sglang's own): then per-layer ops.

    Why: each torch op on the CPU is one OpenMP parallel region, and each region waits
    for all its threads; with another process keeping a core busy that wait is one
    scheduler slice per region (measured: docs/kernels.md, "Measured on the CPU").
    Offsets need not be equal strides: every row sits a multiple of ``pitch`` (the gcd of
    all offsets and strides) from the storage's start, so any layout in one storage is one
    view."""
    h0, h1 = plan.heads
    kinds = [[_as_pages(k_buffers[l], plan.page_size, "buffer") for l in plan.layers]]
    if plan.has_v:
        kinds.append([_as_pages(v_buffers[l], plan.page_size, "buffer") for l in plan.layers])
    storage = kinds[0][0].untyped_storage().data_ptr()
    for views in kinds:
        for v in views:
            if v.untyped_storage().data_ptr() != storage:
                return None
    geoms = [_row_geometry(views[0], h0, h1 - h0) for views in kinds]
    if len(kinds) == 2 and geoms[0][:3] == geoms[1][:3]:  # same rows: K and V in one op
        kinds, geoms = [kinds[0] + kinds[1]], geoms[:1]
    out = []
    for views, (seg, within, sp, head0) in zip(kinds, geoms):
        starts = [v.data_ptr() - storage + head0 for v in views]
        pitch = 0
        for x in starts + within + [sp]:
            pitch = math.gcd(pitch, x)
        pitch = pitch or seg  # one row in all (a single page of a single layer)
        last = max(starts) + (views[0].shape[0] - 1) * sp + max(within)
        out.append(
            _Rows(
                views[0],
                pitch,
                seg,
                last // pitch + 1,
                [x // pitch for x in starts],
                sp // pitch,
                [x // pitch for x in within],
            )
        )
    return out


def _torch_copy(
    plan: _Plan, k_buffers, v_buffers, page_ids: torch.Tensor, chunk: torch.Tensor, pack: bool
) -> None:
    """CPU path: whole rows moved by one ``index_select`` (pack) / ``index_put_`` (unpack)
    per row shape over every selected layer when the buffers share one storage (a
    KVPool, either layout), else one per layer and K/V; rows viewed as the widest integer
    word their size and alignment allow.  Row indices are computed with NumPy, which
    runs no parallel region."""
    n = page_ids.numel()
    if n == 0:
        return
    ids = page_ids.to(torch.int64)
    groups = _one_storage_rows(plan, k_buffers, v_buffers)
    if groups is None:
        _torch_copy_per_layer(plan, k_buffers, v_buffers, ids, chunk, pack)
        return
    ids_np = ids.numpy()
    off = 0
    for g in groups:
        idx = (
            np.asarray(g.starts, dtype=np.int64)[:, None, None]
            + ids_np[None, :, None] * g.page_step
            + np.asarray(g.within, dtype=np.int64)[None, None, :]
        ).reshape(-1)
        nbytes = idx.shape[0] * g.seg
        align = math.gcd(g.pitch, math.gcd(g.seg, chunk.data_ptr() + off))
        word = next(w for w in _WORDS if align % w.itemsize == 0)
        item = g.base.element_size()
        rows = g.base.as_strided((g.num_rows, g.seg // item), (g.pitch // item, 1), 0)
        rows = rows.view(word)
        dst = chunk[off : off + nbytes].view(word).view(idx.shape[0], -1)
        idx_t = torch.from_numpy(idx)
        if pack:
            torch.index_select(rows, 0, idx_t, out=dst)
        else:
            rows.index_put_((idx_t,), dst)
        off += nbytes


def _torch_copy_per_layer(
    plan: _Plan, k_buffers, v_buffers, ids: torch.Tensor, chunk: torch.Tensor, pack: bool
) -> None:
    """CPU path for buffers in separate storages: one index_select / index_put_ of whole
    page rows per layer and per K/V."""
    n = ids.numel()
    h0, h1 = plan.heads
    off = 0
    for bufs in (k_buffers, v_buffers) if plan.has_v else (k_buffers,):
        for l in plan.layers:
            view = _as_pages(bufs[l], plan.page_size, "buffer")
            sel = view[:, :, h0:h1, :]
            if h1 - h0 == view.shape[2] and view.is_contiguous():
                sel = view.view(view.shape[0], -1)  # whole pages as rows
            nbytes = n * sel[0].numel() * sel.element_size()
            row_bytes = sel.shape[-1] * sel.element_size()
            g = math.gcd(row_bytes, math.gcd(sel.data_ptr(), chunk.data_ptr() + off))
            word = next(w for w in _WORDS if g % w.itemsize == 0)
            sel_w = sel.view(word)
            dst = chunk[off : off + nbytes].view(word).view((n,) + tuple(sel_w.shape[1:]))
            if pack:
                torch.index_select(sel_w, 0, ids, out=dst)
            else:  # index_put_, not index_copy_ or NumPy (docs/kernels.md)
                sel_w.index_put_((ids,), dst)
            off += nbytes
