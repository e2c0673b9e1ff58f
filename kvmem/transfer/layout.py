"""Block layouts of kvmem.transfer: equal-sized blocks inside a registration, addressed by
index (:class:`BlockLayout`), the layout of a KVPool's pages (:func:`pool_layout`), and the
most blocks one prepared table may index (:data:`MAX_TABLE_BLOCKS`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Blocks one prepared table may hold.  NIXL (nixl-cu12 1.5.1) reads make_prepped_xfer's
# indices as int32, whatever dtype they are given in: an index past 2**31 - 1 is refused
# once it wraps negative, and past 2**32 it silently names another block (checked here:
# index 2**32 + 5 of a strided table moved block 5).  So a larger table is refused, and
# only packed transfers move such a pool.  The 64 GiB shapes of 80-layer models stay far
# below it: 33.5 M blocks (bf16 MHA, page_size 1), 119 M (MLA 576 fp8, page_size 1).
MAX_TABLE_BLOCKS = (1 << 31) - 1


@dataclass(frozen=True)
class BlockLayout:
    """Equal-sized blocks inside a registration, addressed by index: ``planes`` is
    ``((base, stride, nbytes), ...)``; block ``j * count + i`` is ``[base_j + i * stride_j,
    + nbytes_j)``.  For a KVPool (:func:`pool_layout`): one plane per layer for K, then one
    per layer for V, block ``i`` of a plane = page ``i`` of that layer::

        index(plane j, page p) = j * num_pages + p      j < L: K of layer j; else V of j - L
    """

    planes: tuple  # ((base, stride, nbytes), ...)
    count: int  # blocks per plane (a pool's num_pages)

    @property
    def blocks(self) -> int:
        """Blocks of the layout: ``len(planes) * count`` (indices ``0 .. blocks - 1``)."""
        return len(self.planes) * self.count

    def spans(self) -> list[tuple[int, int]]:
        """``(addr, nbytes)`` of each plane's whole span (first block to last byte)."""
        return [(b, (self.count - 1) * st + n) for b, st, n in self.planes]

    def descs(self) -> np.ndarray:
        """``[len(planes) * count, 2]`` int64 ``(addr, nbytes)`` of every block, by index.
        O(blocks) memory (16 bytes a block: 0.5 GB for the 33.5 M blocks of a 64 GiB
        80-layer pool at page_size 1): engines prepare tables from the planes (NIXL's
        strided lists, O(planes)) and expand only where the transport needs it."""
        i = np.arange(self.count, dtype=np.int64)
        out = np.empty((len(self.planes), self.count, 2), dtype=np.int64)
        for j, (b, st, n) in enumerate(self.planes):
            out[j, :, 0], out[j, :, 1] = b + i * st, n
        return out.reshape(-1, 2)

    def as_json(self) -> dict:
        return dict(planes=[list(p) for p in self.planes], count=self.count)


def pool_layout(pool) -> BlockLayout | None:
    """The block layout of a KVPool's pages (see :class:`BlockLayout`); None when a page of
    a layer is not one contiguous range (then only packed transfers can move it)."""
    planes = []
    for buf in list(pool.k_buffer) + list(pool.v_buffer):
        if buf.numel() == 0 or not buf[0].is_contiguous():
            return None
        es = buf.element_size()
        planes.append((int(buf.data_ptr()), int(buf.stride(0)) * es, int(buf[0].numel()) * es))
    return BlockLayout(tuple(planes), int(pool.num_pages)) if planes else None
