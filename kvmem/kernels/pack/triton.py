"""The pack/unpack Triton kernel (one body for both directions, ``PACK`` a
``tl.constexpr``) and its launcher.  Layouts: ``kvmem.kernels.pack``; the plan it
launches with: ``plan.py``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmem.kernels._dispatch import device_guard
from kvmem.kernels.pack.plan import _UNITS, _Plan, _err_flag, _wait_ready

_NUM_WARPS = 4  # guess, unmeasured (see _TILE)


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
def _chunk_offset(t, j, n, NUM_K: tl.constexpr, K_UNITS: tl.constexpr, V_UNITS: tl.constexpr):
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
    K_ROWS: tl.constexpr,
    K_NH: tl.constexpr,
    K_SEG: tl.constexpr,
    K_PAGE_STRIDE: tl.constexpr,
    K_TOK_STRIDE: tl.constexpr,
    K_HEAD_STRIDE: tl.constexpr,
    K_HEAD0: tl.constexpr,
    K_BLOCK_R: tl.constexpr,
    K_BLOCK_C: tl.constexpr,
    V_ROWS: tl.constexpr,
    V_NH: tl.constexpr,
    V_SEG: tl.constexpr,
    V_PAGE_STRIDE: tl.constexpr,
    V_TOK_STRIDE: tl.constexpr,
    V_HEAD_STRIDE: tl.constexpr,
    V_HEAD0: tl.constexpr,
    V_BLOCK_R: tl.constexpr,
    V_BLOCK_C: tl.constexpr,
):
    # Every address product is int64: a chunk's K half passes 2^31 units at 8 GiB of
    # bf16, and an int32 product there would wrap (tests/kernels/test_ptx_sm90.py checks the PTX).
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
        _copy_page(
            base,
            layer_off,
            page,
            chunk,
            chunk_off,
            valid,
            PACK,
            K_ROWS,
            K_NH,
            K_SEG,
            K_PAGE_STRIDE,
            K_TOK_STRIDE,
            K_HEAD_STRIDE,
            K_HEAD0,
            K_BLOCK_R,
            K_BLOCK_C,
        )
    else:
        _copy_page(
            base,
            layer_off,
            page,
            chunk,
            chunk_off,
            valid,
            PACK,
            V_ROWS,
            V_NH,
            V_SEG,
            V_PAGE_STRIDE,
            V_TOK_STRIDE,
            V_HEAD_STRIDE,
            V_HEAD0,
            V_BLOCK_R,
            V_BLOCK_C,
        )


def kernel_params(plan: _Plan, pack: bool) -> dict:
    """The kernel's constexpr parameters for a plan (the PTX test compiles with these)."""
    v = plan.v or plan.k  # K-only: the V branch is never taken; any valid values do
    params = dict(PACK=pack, NUM_K=len(plan.layers), ALIGN=plan.align)
    for prefix, kind in (("K", plan.k), ("V", v)):
        params.update(
            {
                f"{prefix}_ROWS": kind.rows,
                f"{prefix}_NH": kind.nh,
                f"{prefix}_SEG": kind.seg,
                f"{prefix}_PAGE_STRIDE": kind.page_stride,
                f"{prefix}_TOK_STRIDE": kind.tok_stride,
                f"{prefix}_HEAD_STRIDE": kind.head_stride,
                f"{prefix}_HEAD0": kind.head0,
                f"{prefix}_BLOCK_R": kind.block_r,
                f"{prefix}_BLOCK_C": kind.block_c,
            }
        )
    return params


def _launch_args(plan: _Plan, pack: bool) -> dict:
    """The launch's keyword arguments (``kernel_params`` and ``num_warps``) for a plan and
    direction: made once, kept in ``plan.launch`` (a launch then builds no dict)."""
    args = plan.launch.get(pack)
    if args is None:
        args = plan.launch[pack] = dict(kernel_params(plan, pack), num_warps=_NUM_WARPS)
    return args


def _launch(
    plan: _Plan, k_buffers, page_ids: torch.Tensor, chunk: torch.Tensor, pack: bool
) -> None:
    n = page_ids.numel()
    if n == 0:
        return
    unit = _UNITS[plan.unit_bytes]
    if chunk.data_ptr() % plan.unit_bytes:
        raise ValueError(
            f"the chunk's address must be a multiple of {plan.unit_bytes} bytes "
            f"(the KV rows' alignment), got {chunk.data_ptr():#x}"
        )
    base = k_buffers[plan.layers[0]].view(unit)  # layer offsets count from its start
    err = _err_flag(plan.device)
    with device_guard(plan.device):  # Triton launches on the current device otherwise
        _wait_ready(plan)
        _copy_pages_kernel[(n, plan.num_copies)](
            base,
            plan.layer_offs,
            page_ids,
            chunk.view(unit),
            n,
            plan.num_pages,
            err,
            **_launch_args(plan, pack),
        )
