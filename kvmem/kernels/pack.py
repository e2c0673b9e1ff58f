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
``pack_buffers_ref`` / ``unpack_buffers_ref`` are the plain references the tests compare
against.

Host syncs on CUDA: ``check=True`` (the default) costs one, to validate the ids.  With
``check=False`` there is none: ids given as a list or a NumPy array reach the device
through pinned memory and a non-blocking copy (``kvmem._ids``), and a new plan's layer
offsets likewise.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from kvmem._ids import as_page_ids
from kvmem.kernels._dispatch import device_guard, is_async_device, use_triton

# Units of one copy element, widest first.  4 bytes is enough for 16-byte vector accesses
# (ld/st.global.v4.b32) when addresses and sizes are 16-byte aligned.
_UNITS = {4: torch.int32, 2: torch.int16, 1: torch.uint8}
# Elements one program moves per loop iteration.  2048 x 4 B = 8 KiB: with 4 warps each
# thread has four 16-byte loads in flight.  A guess, not yet measured on an H200.
_TILE = 2048
_NUM_WARPS = 4  # guess, unmeasured (see _TILE)


# ----------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------
@triton.jit
def _copy_page(
    base,
    layer_off,
    page,
    chunk,
    chunk_off,
    valid,
    PACK: tl.constexpr,
    ROWS: tl.constexpr,
    NH: tl.constexpr,
    SEG: tl.constexpr,
    PAGE_STRIDE: tl.constexpr,
    TOK_STRIDE: tl.constexpr,
    HEAD_STRIDE: tl.constexpr,
    HEAD0: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Copy one page of one layer: ROWS rows of SEG units.  Row r is token r // NH,
    head r % NH of the selected range; rows sit at TOK_STRIDE / HEAD_STRIDE in the
    buffer and back to back in the chunk."""
    src_page = base + layer_off + page * PAGE_STRIDE + HEAD0
    dst_page = chunk + chunk_off
    for r0 in range(0, ROWS, BLOCK_R):
        # int64 row indices: every product below that feeds an address is 64-bit
        rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        buf_row = (rows // NH) * TOK_STRIDE + (rows % NH) * HEAD_STRIDE
        chunk_row = rows * SEG
        for c0 in range(0, SEG, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            mask = valid & (rows < ROWS)[:, None] & (cols < SEG)[None, :]
            buf_ptrs = src_page + buf_row[:, None] + cols[None, :]
            chunk_ptrs = dst_page + chunk_row[:, None] + cols[None, :]
            if PACK:
                tl.store(chunk_ptrs, tl.load(buf_ptrs, mask=mask), mask=mask)
            else:
                tl.store(buf_ptrs, tl.load(chunk_ptrs, mask=mask), mask=mask)


@triton.jit
def _chunk_offset(t, j, n, NUM_K: tl.constexpr, K_UNITS: tl.constexpr,
                  V_UNITS: tl.constexpr):
    """Units from the chunk's start to page j of copy t (t < NUM_K: K of the t-th
    selected layer; else V of layer t - NUM_K): the module docstring's layout.  ``t``,
    ``j`` and ``n`` must be int64, so the whole sum is (a constexpr times an int64 is
    int64; an int32 product would wrap past 2^31 units)."""
    if t < NUM_K:
        off = (t * n + j) * K_UNITS
    else:
        off = n * (NUM_K * K_UNITS) + ((t - NUM_K) * n + j) * V_UNITS
    return off


@triton.jit
def _copy_pages_kernel(
    base,  # *unit: anchor; layer t's buffer starts at base + layer_offs[t]
    layer_offs,  # int64 [NUM_K + NUM_V]: K layers, then V layers, in chunk order
    page_ids,  # int32 | int64 [n]
    chunk,  # *unit: the packed chunk
    n,  # pages in this chunk
    num_pages,  # pages in the buffers: ids outside [0, num_pages) are skipped and flagged
    err,  # int64 [2]: (flag, bad page id) for unchecked calls
    PACK: tl.constexpr,
    NUM_K: tl.constexpr,
    ALIGN: tl.constexpr,  # every layer offset is a multiple of ALIGN units
    K_ROWS: tl.constexpr, K_NH: tl.constexpr, K_SEG: tl.constexpr,
    K_PAGE_STRIDE: tl.constexpr, K_TOK_STRIDE: tl.constexpr,
    K_HEAD_STRIDE: tl.constexpr, K_HEAD0: tl.constexpr,
    K_BLOCK_R: tl.constexpr, K_BLOCK_C: tl.constexpr,
    V_ROWS: tl.constexpr, V_NH: tl.constexpr, V_SEG: tl.constexpr,
    V_PAGE_STRIDE: tl.constexpr, V_TOK_STRIDE: tl.constexpr,
    V_HEAD_STRIDE: tl.constexpr, V_HEAD0: tl.constexpr,
    V_BLOCK_R: tl.constexpr, V_BLOCK_C: tl.constexpr,
):
    # Every address product is int64: a chunk's K half passes 2^31 units at 8 GiB of
    # bf16, and an int32 product there would wrap (tests/test_pack_ptx.py checks the PTX).
    j = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64)
    n64 = tl.cast(n, tl.int64)  # n may arrive as a constexpr (Triton specialises 1)
    page = tl.load(page_ids + j).to(tl.int64)
    valid = (page >= 0) & (page < num_pages)
    if t == 0:
        if (page < 0) | (page >= num_pages):
            tl.atomic_max(err, 1)
            tl.store(err + 1, page)
    layer_off = tl.multiple_of(tl.load(layer_offs + t), ALIGN)
    chunk_off = _chunk_offset(t, j, n64, NUM_K, K_ROWS * K_SEG, V_ROWS * V_SEG)
    if t < NUM_K:
        _copy_page(base, layer_off, page, chunk, chunk_off, valid, PACK,
                   K_ROWS, K_NH, K_SEG, K_PAGE_STRIDE, K_TOK_STRIDE, K_HEAD_STRIDE,
                   K_HEAD0, K_BLOCK_R, K_BLOCK_C)
    else:
        _copy_page(base, layer_off, page, chunk, chunk_off, valid, PACK,
                   V_ROWS, V_NH, V_SEG, V_PAGE_STRIDE, V_TOK_STRIDE, V_HEAD_STRIDE,
                   V_HEAD0, V_BLOCK_R, V_BLOCK_C)


# ----------------------------------------------------------------------------------------
# Validation and the copy plan (shared by the Triton and the torch paths)
# ----------------------------------------------------------------------------------------
def _as_pages(buf: torch.Tensor, page_size: int | None, what: str) -> torch.Tensor:
    """View a layer buffer as ``[num_pages, page_size, H, D]``."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dim() == 4:
        if page_size is not None and buf.shape[1] != page_size:
            raise ValueError(f"{what} has page_size {buf.shape[1]}, expected {page_size}")
        return buf
    if buf.dim() == 3:
        if page_size is None:
            raise ValueError(f"{what} is [num_tokens, H, D]: pass page_size=")
        if buf.shape[0] % page_size:
            raise ValueError(
                f"{what} has {buf.shape[0]} token rows, not a multiple of page_size {page_size}"
            )
        return buf.unflatten(0, (buf.shape[0] // page_size, page_size))
    raise ValueError(f"{what} must be [num_pages, page_size, H, D] or [num_tokens, H, D], "
                     f"got shape {tuple(buf.shape)}")


@dataclass(frozen=True)
class _Kind:
    """How to copy one page of one layer of K (or V): ROWS rows of SEG units."""

    rows: int
    nh: int
    seg: int
    page_stride: int
    tok_stride: int
    head_stride: int
    head0: int
    block_r: int
    block_c: int


@dataclass(frozen=True)
class _Plan:
    """Geometry of one (buffers, layers, heads) selection.  Holds no tensor views, so a
    cached plan never keeps a pool's memory alive."""

    device: torch.device
    unit_bytes: int  # bytes of one copy element of the Triton path
    num_pages: int
    page_size: int
    heads: tuple[int, int]
    layers: tuple[int, ...]  # selected layer indices, chunk order
    has_v: bool
    k: _Kind
    v: _Kind | None
    align: int  # every layer offset is a multiple of `align` units
    layer_offs: torch.Tensor  # int64 [len(layers) * (1 + has_v)], units from layer 0's start
    k_page_bytes: int  # bytes of one page of one selected layer in the chunk
    v_page_bytes: int
    # CUDA: [event] recorded after layer_offs' non-blocking copy, until a launch sees it
    # complete; launches before that make their stream wait on it (the copy was queued
    # on whichever stream was current when the plan was made).  Empty otherwise.
    ready: list = field(default_factory=list, compare=False, repr=False)

    @property
    def num_copies(self) -> int:
        return len(self.layers) * (2 if self.has_v else 1)

    def nbytes(self, n: int) -> int:
        return n * len(self.layers) * (self.k_page_bytes + self.v_page_bytes)


def _kind(view: torch.Tensor, unit: int, h0: int, nh: int) -> _Kind:
    """Copy geometry of the head slice [h0, h0+nh) of a [P, ps, H, D] view, in units."""
    item = view.element_size()
    ps, d = view.shape[1], view.shape[3]
    page_stride, tok_stride, head_stride = (s * item // unit for s in view.stride()[:3])
    seg = d * item // unit
    rows_per_tok = nh
    if nh == 1 or head_stride == seg:  # the token's selected heads are back to back: one row
        seg, rows_per_tok = seg * nh, 1
        if ps == 1 or tok_stride == seg:  # and the page's tokens too: one row per page
            seg, ps = seg * ps, 1
    rows = ps * rows_per_tok
    block_c = min(triton.next_power_of_2(seg), _TILE)
    block_r = max(1, min(triton.next_power_of_2(rows), _TILE // block_c))
    return _Kind(rows, rows_per_tok, seg, page_stride, tok_stride, head_stride,
                 h0 * view.stride(2) * item // unit, block_r, block_c)


def _check_layers(layers, num_layers: int) -> tuple[int, ...]:
    if layers is None:
        return tuple(range(num_layers))
    if isinstance(layers, torch.Tensor):
        layers = layers.tolist()
    try:
        out = tuple(layers)
    except TypeError:
        raise ValueError(f"layers must be a sequence of layer indices, got {layers!r}") from None
    if not out:
        raise ValueError("layers is empty: select at least one layer")
    for l in out:
        if isinstance(l, bool) or not isinstance(l, int) or not 0 <= l < num_layers:
            raise ValueError(f"layers: {l!r} is not a layer index in [0, {num_layers})")
    if len(set(out)) != len(out):
        raise ValueError(f"layers lists a layer twice: {list(out)}")
    return out


def _check_heads(heads, num_heads: int) -> tuple[int, int]:
    if heads is None:
        return (0, num_heads)
    try:
        h0, h1 = heads
    except (TypeError, ValueError):
        raise ValueError(f"heads must be a (start, stop) pair, got {heads!r}") from None
    for h in (h0, h1):
        if isinstance(h, bool) or not isinstance(h, int):
            raise ValueError(f"heads must be a pair of ints, got {heads!r}")
    if not 0 <= h0 < h1 <= num_heads:
        raise ValueError(f"heads=({h0}, {h1}) is not a non-empty range within [0, {num_heads}]")
    return (h0, h1)


def _uniform(views: Sequence[torch.Tensor], what: str) -> None:
    first = views[0]
    if first.stride(-1) != 1:
        raise ValueError(f"{what}[0]: the head_dim axis must be contiguous (stride 1), "
                         f"got strides {first.stride()}")
    for i, v in enumerate(views[1:], 1):
        if (v.shape, v.stride(), v.dtype, v.device) != (first.shape, first.stride(),
                                                        first.dtype, first.device):
            raise ValueError(
                f"{what}[{i}] differs from {what}[0] in shape, strides, dtype or device: "
                f"{tuple(v.shape)} {v.stride()} {v.dtype} {v.device} vs "
                f"{tuple(first.shape)} {first.stride()} {first.dtype} {first.device}"
            )


def _buffers(buffers, what: str) -> list:
    if buffers is None:
        return []
    if isinstance(buffers, torch.Tensor):
        raise TypeError(f"{what} must be a list of per-layer tensors, got one tensor")
    return list(buffers)


# The plan cache, one LRU per device, shared by every thread under _LOCK (it is
# thread-safe; a plan is immutable once made).  A miss costs a plan (host work) and one
# non-blocking copy of the layer offsets; a hit costs the key.  Sized so that normal use
# never evicts: sglang packs one layer at a time, so an 80-layer model asks for 80
# single-layer plans per head range, and two pools (or K/V layouts) x 80 layers x 4 head
# ranges = 640 < 1024.  Each entry holds one small int64 tensor on its device.  (A
# size chosen from that count, not measured.)
_PLAN_CACHE_SIZE = 1024
_PLANS: dict[torch.device, OrderedDict] = {}
_LOCK = threading.Lock()


def make_plan(k_buffers, v_buffers, page_size, layers, heads) -> _Plan:
    """Validate a selection and return its copy plan, cached by device, addresses and
    shapes (thread-safe; see ``_PLAN_CACHE_SIZE``).  On CUDA a new plan's layer offsets
    go to the device with a non-blocking copy from pinned memory (no host sync)."""
    k_buffers, v_buffers = _buffers(k_buffers, "k_buffers"), _buffers(v_buffers, "v_buffers")
    if not k_buffers:
        raise ValueError("k_buffers is empty")
    for what, bufs in (("k_buffers", k_buffers), ("v_buffers", v_buffers)):
        for i, b in enumerate(bufs):
            if not isinstance(b, torch.Tensor):
                raise TypeError(f"{what}[{i}] must be a torch.Tensor, got {type(b).__name__}")
    layers = _check_layers(layers, len(k_buffers))
    if k_buffers[0].dim() not in (3, 4):
        raise ValueError("k_buffers[0] must be [num_pages, page_size, H, D] or [num_tokens, H, D], "
                         f"got shape {tuple(k_buffers[0].shape)}")
    heads = _check_heads(heads, k_buffers[0].shape[-2])
    key = (
        tuple((b.data_ptr(), b.shape, b.stride()) for b in k_buffers),
        tuple((b.data_ptr(), b.shape, b.stride()) for b in v_buffers),
        k_buffers[0].dtype, k_buffers[0].device, page_size, layers, heads,
    )
    device = k_buffers[0].device
    with _LOCK:
        cache = _PLANS.setdefault(device, OrderedDict())
        plan = cache.get(key)
        if plan is not None:
            cache.move_to_end(key)
            return plan
    plan = _make_plan(k_buffers, v_buffers, page_size, layers, heads)  # outside the lock
    with _LOCK:
        plan = cache.setdefault(key, plan)  # a plan another thread made first wins
        cache.move_to_end(key)
        if len(cache) > _PLAN_CACHE_SIZE:
            cache.popitem(last=False)
    return plan


def _make_plan(k_buffers, v_buffers, page_size, layers, heads) -> _Plan:
    k_views = [_as_pages(b, page_size, f"k_buffers[{i}]") for i, b in enumerate(k_buffers)]
    v_views = [_as_pages(b, page_size, f"v_buffers[{i}]") for i, b in enumerate(v_buffers)]
    _uniform(k_views, "k_buffers")
    k0 = k_views[0]
    num_pages, ps, num_heads, _ = k0.shape
    if v_views:
        if len(v_views) != len(k_views):
            raise ValueError(f"{len(k_views)} K layers but {len(v_views)} V layers")
        _uniform(v_views, "v_buffers")
        v0 = v_views[0]
        if v0.shape[:3] != k0.shape[:3] or v0.dtype != k0.dtype or v0.device != k0.device:
            raise ValueError(
                f"v_buffers[0] {tuple(v0.shape)} {v0.dtype} {v0.device} does not match "
                f"k_buffers[0] {tuple(k0.shape)} {k0.dtype} {k0.device} in pages, page_size, "
                "heads, dtype or device"
            )
    sel = layers
    h0, h1 = heads
    sel_views = [k_views[l] for l in sel] + [v_views[l] for l in sel if v_views]
    item = k0.element_size()
    # The widest unit dividing every address, stride, head offset and row size.
    g = 0
    for v in sel_views:
        g = math.gcd(g, v.data_ptr())
    for v in (k0,) + ((v_views[0],) if v_views else ()):
        for q in [s * item for s in v.stride()[:3]] + [h0 * v.stride(2) * item,
                                                      v.shape[3] * item]:
            g = math.gcd(g, q)
    unit = next(u for u in _UNITS if g % u == 0)
    anchor = sel_views[0].data_ptr()
    offs_bytes = [v.data_ptr() - anchor for v in sel_views]
    layer_offs, ready = _to_device([o // unit for o in offs_bytes], k0.device)
    return _Plan(
        device=k0.device, unit_bytes=unit, num_pages=num_pages, page_size=ps, heads=(h0, h1),
        layers=sel, has_v=bool(v_views),
        k=_kind(k0, unit, h0, h1 - h0),
        v=_kind(v_views[0], unit, h0, h1 - h0) if v_views else None,
        align=16 // unit if all(o % 16 == 0 for o in offs_bytes) else 1,
        layer_offs=layer_offs, ready=ready,
        k_page_bytes=ps * (h1 - h0) * k0.shape[3] * item,
        v_page_bytes=ps * (h1 - h0) * v_views[0].shape[3] * item if v_views else 0,
    )


def _to_device(values: list[int], device: torch.device) -> tuple[torch.Tensor, list]:
    """(int64 [len(values)] on ``device``, ``_Plan.ready``).  CUDA: from pinned memory
    with a non-blocking copy on the device's current stream and an event recorded after
    it (no host sync; PyTorch's pinned-memory cache keeps the staging buffer until the
    copy is done)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.int64).to(device), []
    host = torch.tensor(values, dtype=torch.int64, pin_memory=True)
    with torch.cuda.device(device):
        out = host.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    return out, [event]


def _wait_ready(plan: _Plan) -> None:
    """Order the current stream after the copy of ``plan.layer_offs`` (CUDA; a no-op
    once a launch has seen that copy complete).  Call under the plan's device guard."""
    pending = plan.ready
    event = next(iter(pending), None)  # another thread may clear it: read it once
    if event is None:
        return
    if event.query():  # done: no launch needs to wait any more
        pending.clear()
    else:
        torch.cuda.current_stream().wait_event(event)


# Device-side error flags of unchecked (check=False) CUDA calls, one per device:
# int64 [flag, bad page id].  Raised by the next checked call on that device.  Made
# once per device under _LOCK (two threads must not each make one and lose a flag).
_ERR_FLAGS: dict[torch.device, torch.Tensor] = {}


def _err_flag(device: torch.device) -> torch.Tensor:
    flag = _ERR_FLAGS.get(device)
    if flag is None:
        with _LOCK:
            flag = _ERR_FLAGS.get(device)
            if flag is None:
                flag = _ERR_FLAGS[device] = torch.zeros(2, dtype=torch.int64, device=device)
    return flag


def _validate_page_ids(page_ids: torch.Tensor, num_pages: int, *, unique: bool,
                       what: str) -> None:
    """Raise ValueError for ids outside [0, num_pages) (and, for unpack, ids listed twice).
    One host sync on CUDA; also raises what an earlier unchecked call flagged."""
    flag = _ERR_FLAGS.get(page_ids.device)
    stats = [page_ids.min(), page_ids.max()] if page_ids.numel() else []
    if unique and page_ids.numel() > 1:
        srt = torch.sort(page_ids).values
        stats.append((srt[1:] == srt[:-1]).any().to(page_ids.dtype))
    if flag is not None:
        stats += [flag[0].to(page_ids.dtype), flag[1].to(page_ids.dtype)]
    if not stats:
        return
    values = torch.stack(stats).tolist()  # the one host sync
    if flag is not None and values[-2]:
        bad = values[-1]
        flag.zero_()
        raise ValueError(
            f"an earlier unchecked (check=False) pack/unpack on {page_ids.device} was given "
            f"page id {bad}, outside [0, {num_pages}); its pages were skipped"
        )
    if page_ids.numel():
        lo, hi = values[0], values[1]
        if lo < 0 or hi >= num_pages:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{what}: page id {bad} is outside [0, {num_pages})")
        if unique and page_ids.numel() > 1 and values[2]:
            raise ValueError(f"{what}: page_ids lists a page twice; unpack needs distinct pages")


def _check_chunk(buf: torch.Tensor, nbytes: int, device: torch.device, what: str) -> None:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8:
        raise ValueError(f"{what} must be uint8, got {buf.dtype}")
    if buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"{what} must be a contiguous 1-D tensor, got shape "
                         f"{tuple(buf.shape)} strides {buf.stride()}")
    if buf.device != device:
        raise ValueError(f"{what} is on {buf.device}, the KV buffers on {device}")
    if buf.numel() != nbytes:
        raise ValueError(f"{what} has {buf.numel()} bytes, the chunk needs {nbytes}")


# ----------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------
def kernel_params(plan: _Plan, pack: bool) -> dict:
    """The kernel's constexpr parameters for a plan (the PTX test compiles with these)."""
    v = plan.v or plan.k  # K-only: the V branch is never taken; any valid values do
    params = dict(PACK=pack, NUM_K=len(plan.layers), ALIGN=plan.align)
    for prefix, kind in (("K", plan.k), ("V", v)):
        params.update({
            f"{prefix}_ROWS": kind.rows, f"{prefix}_NH": kind.nh, f"{prefix}_SEG": kind.seg,
            f"{prefix}_PAGE_STRIDE": kind.page_stride, f"{prefix}_TOK_STRIDE": kind.tok_stride,
            f"{prefix}_HEAD_STRIDE": kind.head_stride, f"{prefix}_HEAD0": kind.head0,
            f"{prefix}_BLOCK_R": kind.block_r, f"{prefix}_BLOCK_C": kind.block_c,
        })
    return params


def _launch(plan: _Plan, k_buffers, page_ids: torch.Tensor, chunk: torch.Tensor,
            pack: bool) -> None:
    n = page_ids.numel()
    if n == 0:
        return
    unit = _UNITS[plan.unit_bytes]
    if chunk.data_ptr() % plan.unit_bytes:
        raise ValueError(f"the chunk's address must be a multiple of {plan.unit_bytes} bytes "
                         f"(the KV rows' alignment), got {chunk.data_ptr():#x}")
    base = k_buffers[plan.layers[0]].view(unit)  # layer offsets count from its start
    err = _err_flag(plan.device)
    with device_guard(plan.device):  # Triton launches on the current device otherwise
        _wait_ready(plan)
        _copy_pages_kernel[(n, plan.num_copies)](
            base, plan.layer_offs, page_ids, chunk.view(unit), n, plan.num_pages,
            err, **kernel_params(plan, pack), num_warps=_NUM_WARPS,
        )


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
    scheduler slice per region.  A 128 MiB pack (32 layers, page_size 1/16/64) took a
    median of 29-996 ms with one op per layer and K/V (64 regions) against 15-64 ms with
    one op, quiet and loaded, same runs, 2-core CPU at load 5-6, 2026-11-30
    (bench/results/cpu-2026-11-30-contention.md, bench/pack_contention.py).  Offsets need not
    be equal strides: every row sits a multiple of ``pitch`` (the gcd of all offsets
    and strides) from the storage's start, so any layout in one storage is one view."""
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
        out.append(_Rows(views[0], pitch, seg, last // pitch + 1,
                         [x // pitch for x in starts], sp // pitch,
                         [x // pitch for x in within]))
    return out


def _torch_copy(plan: _Plan, k_buffers, v_buffers, page_ids: torch.Tensor,
                chunk: torch.Tensor, pack: bool) -> None:
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
        idx = (np.asarray(g.starts, dtype=np.int64)[:, None, None]
               + ids_np[None, :, None] * g.page_step
               + np.asarray(g.within, dtype=np.int64)[None, None, :]).reshape(-1)
        nbytes = idx.shape[0] * g.seg
        align = math.gcd(g.pitch, math.gcd(g.seg, chunk.data_ptr() + off))
        word = next(w for w in _WORDS if align % w.itemsize == 0)
        item = g.base.element_size()
        rows = g.base.as_strided((g.num_rows, g.seg // item), (g.pitch // item, 1), 0)
        rows = rows.view(word)
        dst = chunk[off:off + nbytes].view(word).view(idx.shape[0], -1)
        idx_t = torch.from_numpy(idx)
        if pack:
            torch.index_select(rows, 0, idx_t, out=dst)
        else:
            rows.index_put_((idx_t,), dst)
        off += nbytes


def _torch_copy_per_layer(plan: _Plan, k_buffers, v_buffers, ids: torch.Tensor,
                          chunk: torch.Tensor, pack: bool) -> None:
    """CPU path for buffers in separate storages: one index_select / index_put_ of whole
    page rows per layer and per K/V."""
    n = ids.numel()
    h0, h1 = plan.heads
    off = 0
    for bufs in ((k_buffers, v_buffers) if plan.has_v else (k_buffers,)):
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
            dst = chunk[off:off + nbytes].view(word).view((n,) + tuple(sel_w.shape[1:]))
            if pack:
                torch.index_select(sel_w, 0, ids, out=dst)
            else:  # index_put_ (2 threads here): 1.3-1.5x index_copy_, and 1.2-1.4x
                # NumPy row assignment for chunks past the cache (64 layers x 1024 tokens);
                # NumPy wins in cache only.  2-core CPU, 2026-11-30.
                sel_w.index_put_((ids,), dst)
            off += nbytes


# ----------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------
def pack_buffers(k_buffers, v_buffers, page_ids, *, page_size=None, layers=None, heads=None,
                 out=None, check=True) -> torch.Tensor:
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


def unpack_buffers(buf, k_buffers, v_buffers, page_ids, *, page_size=None, layers=None,
                   heads=None, check=True) -> None:
    """Write a packed chunk back into pages of per-layer K/V tensors (inverse of
    :func:`pack_buffers`; same arguments).  ``page_ids`` must be distinct."""
    plan = make_plan(k_buffers, v_buffers, page_size, layers, heads)
    run_unpack(plan, buf, k_buffers, v_buffers, page_ids, check=check)


def run_pack(plan: _Plan, k_buffers, v_buffers, page_ids, *, out=None,
             check=True) -> torch.Tensor:
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


def _run(plan: _Plan, k_buffers, v_buffers, ids: torch.Tensor, chunk: torch.Tensor, *,
         pack: bool, check: bool) -> None:
    if check or not is_async_device(ids):
        _validate_page_ids(ids, plan.num_pages, unique=not pack,
                           what="pack" if pack else "unpack")
    if use_triton(ids):
        _launch(plan, k_buffers, ids, chunk, pack)
    else:
        _torch_copy(plan, k_buffers, v_buffers, ids, chunk, pack)


# ----------------------------------------------------------------------------------------
# References (plain torch, written for obvious correctness; tests compare against them)
# ----------------------------------------------------------------------------------------
def _ref_pieces(k_buffers, v_buffers, page_ids, page_size, layers, heads):
    k_views = [_as_pages(b, page_size, "k") for b in k_buffers]
    v_views = [_as_pages(b, page_size, "v") for b in (v_buffers or [])]
    layers = range(len(k_views)) if layers is None else layers
    h0, h1 = heads if heads is not None else (0, k_views[0].shape[2])
    for views in (k_views, v_views):
        for l in (layers if views else []):
            for p in [int(p) for p in page_ids]:
                yield views[l][p, :, h0:h1, :]


def pack_buffers_ref(k_buffers, v_buffers, page_ids, *, page_size=None, layers=None,
                     heads=None) -> torch.Tensor:
    pieces = [piece.contiguous().view(-1).view(torch.uint8) for piece in
              _ref_pieces(k_buffers, v_buffers, page_ids, page_size, layers, heads)]
    if not pieces:
        return torch.empty(0, dtype=torch.uint8, device=k_buffers[0].device)
    return torch.cat(pieces)


def unpack_buffers_ref(buf, k_buffers, v_buffers, page_ids, *, page_size=None, layers=None,
                       heads=None) -> None:
    off = 0
    for piece in _ref_pieces(k_buffers, v_buffers, page_ids, page_size, layers, heads):
        nbytes = piece.numel() * piece.element_size()
        piece.copy_(buf[off:off + nbytes].view(piece.dtype).view(piece.shape))
        off += nbytes
