"""sglang's heterogeneous-TP staging gather and scatter on kvmem's pack/unpack kernels.

With ``SGLANG_DISAGG_STAGING_BUFFER=1`` (prefill and decode at different attention-TP
sizes), sglang's mooncake and nixl backends move KV through a contiguous staging buffer
laid out as, per writer rank::

    for l in layers: K of layer l, [pages x page_size tokens, num_heads, head_dim]
    for l in layers: V of layer l, likewise

with a head slice ``[head_start, head_start + num_heads)`` of each token.  That is
kvmem's packed-chunk layout with ``heads=(head_start, head_start + num_heads)``, so the
two functions below keep sglang's signatures and streams and hand the copy to
:func:`kvmem.pack_buffers` / :func:`kvmem.unpack_buffers` (one launch for all layers).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

import kvmem
from kvmem_sglang import state


def _host_check() -> bool:
    """``SGLANG_KVMEM_CHECK=1``: validate page ids on the host (one sync per call)."""
    return state.PROCESS.options.is_active() and state.PROCESS.options.active().check


def _ids(page_indices, device: torch.device) -> torch.Tensor:
    if isinstance(page_indices, torch.Tensor):
        return page_indices.to(device)
    arr = np.ascontiguousarray(page_indices, dtype=np.int64)
    return torch.from_numpy(arr).to(device)


def _chunk_nbytes(k_buffers, v_buffers, num_pages: int, page_size: int, num_heads: int) -> int:
    tokens = num_pages * page_size
    item = k_buffers[0].element_size()
    dims = k_buffers[0].shape[-1] + (v_buffers[0].shape[-1] if v_buffers else 0)
    return len(k_buffers) * tokens * num_heads * dims * item


def gather_all_layers_to_staging(
    k_buffers,
    v_buffers,
    page_indices_np,
    staging_buffer,
    src_head_start: int,
    num_heads: int,
    page_size: int,
) -> int:
    """sglang's ``gather_all_layers_to_staging`` (same arguments, same result): the
    listed pages of every layer, heads ``[src_head_start, src_head_start + num_heads)``,
    packed at the start of ``staging_buffer.buffer``; returns the bytes written.  Runs
    on the staging buffer's gather stream after the caller's stream, and waits for it,
    as sglang's does."""
    device = k_buffers[0].device
    ids = _ids(page_indices_np, device)
    nbytes = _chunk_nbytes(k_buffers, v_buffers, ids.numel(), page_size, num_heads)
    if nbytes > staging_buffer.buffer.numel():
        raise ValueError(
            f"staging gather needs {nbytes} bytes, the staging buffer holds "
            f"{staging_buffer.buffer.numel()}"
        )
    out = staging_buffer.buffer[:nbytes]
    heads = (src_head_start, src_head_start + num_heads)
    if device.type == "cpu":
        kvmem.pack_buffers(
            k_buffers, v_buffers, ids, page_size=page_size, heads=heads, out=out, check=True
        )
        return nbytes
    stream = staging_buffer.get_gather_stream()
    stream.wait_stream(staging_buffer.producer_stream())
    with torch.cuda.device(device), torch.cuda.stream(stream):
        kvmem.pack_buffers(
            k_buffers,
            v_buffers,
            ids,
            page_size=page_size,
            heads=heads,
            out=out,
            check=_host_check(),
        )
    stream.synchronize()
    return nbytes


def scatter_staging_to_kv(
    staging_buffer_view,
    k_buffers,
    v_buffers,
    page_idx_tensor,
    page_size: int,
    prefill_attn_tp_size: int,
    decode_attn_tp_size: int,
    dst_tp_rank: int,
    total_kv_heads: int,
) -> None:
    """sglang's ``scatter_staging_to_kv`` (same arguments): each writer rank's region of
    the staging view (one region per prefill rank when the prefill has the larger TP)
    unpacked into its head slice of the listed pages, on the caller's current stream."""
    from sglang.srt.disaggregation.common.staging_buffer import compute_head_slice_params

    device = k_buffers[0].device
    ids = _ids(page_idx_tensor, device)
    writers = (
        prefill_attn_tp_size // max(1, decode_attn_tp_size)
        if prefill_attn_tp_size > decode_attn_tp_size
        else 1
    )
    base = 0
    for writer in range(writers):
        _, num_heads, dst_head_start, _ = compute_head_slice_params(
            prefill_attn_tp_size, decode_attn_tp_size, writer, dst_tp_rank, total_kv_heads
        )
        nbytes = _chunk_nbytes(k_buffers, v_buffers, ids.numel(), page_size, num_heads)
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            kvmem.unpack_buffers(
                staging_buffer_view[base : base + nbytes],
                k_buffers,
                v_buffers,
                ids,
                page_size=page_size,
                heads=(dst_head_start, dst_head_start + num_heads),
                check=_host_check() or device.type == "cpu",
            )
        base += nbytes
