"""The pack/unpack references: plain torch, written for obvious correctness, one piece
per (layer, page); the tests compare both paths against them.  Layout:
``kvmem.kernels.pack``."""

from __future__ import annotations

import torch

from kvmem.kernels.pack.plan import _as_pages


def _ref_pieces(k_buffers, v_buffers, page_ids, page_size, layers, heads):
    k_views = [_as_pages(b, page_size, "k") for b in k_buffers]
    v_views = [_as_pages(b, page_size, "v") for b in (v_buffers or [])]
    layers = range(len(k_views)) if layers is None else layers
    h0, h1 = heads if heads is not None else (0, k_views[0].shape[2])
    for views in (k_views, v_views):
        for l in layers if views else []:
            for p in [int(p) for p in page_ids]:
                yield views[l][p, :, h0:h1, :]


def pack_buffers_ref(
    k_buffers, v_buffers, page_ids, *, page_size=None, layers=None, heads=None
) -> torch.Tensor:
    pieces = [
        piece.contiguous().view(-1).view(torch.uint8)
        for piece in _ref_pieces(k_buffers, v_buffers, page_ids, page_size, layers, heads)
    ]
    if not pieces:
        return torch.empty(0, dtype=torch.uint8, device=k_buffers[0].device)
    return torch.cat(pieces)


def unpack_buffers_ref(
    buf, k_buffers, v_buffers, page_ids, *, page_size=None, layers=None, heads=None
) -> None:
    off = 0
    for piece in _ref_pieces(k_buffers, v_buffers, page_ids, page_size, layers, heads):
        nbytes = piece.numel() * piece.element_size()
        piece.copy_(buf[off : off + nbytes].view(piece.dtype).view(piece.shape))
        off += nbytes
