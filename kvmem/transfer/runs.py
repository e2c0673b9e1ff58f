"""Page runs: page pairs ``(source, destination)`` merged where both sides are adjacent,
and the byte ranges (descriptors) such runs cover on planes of pages.

A *page id* is the index of a page within one *plane*: a buffer of page-sized slots (one
layer's K, V or K|V block), ``0 <= id < pages of the plane``.  A *run* is ``length >= 1``
pairs ``(s + i, d + i)`` for ``i < length``: source pages ``s .. s + length - 1`` go to
destination pages ``d .. d + length - 1``.  Runs are of page ids, so a run never leaves
its plane: the descriptor of a run on plane ``p`` is ``[ptr[p] + s * item[p],
ptr[p] + (s + length) * item[p])``, inside that plane's buffer for ids below its page
count, and never merged with a run of another plane, even one that starts where this
plane ends in memory.  Where each plane lies inside one registration on its side (a
kvmem pool region, or a registration of its own), no descriptor spans two registrations
(which NIXL refuses: NIXL_ERR_NOT_FOUND).

Both PD lifecycles merge through :func:`merge_runs`: kvmem's own prefill counts the runs
of a chunk to choose between a direct write and a packed one, and encodes the page ids of
an offer as runs; the sglang adapter posts the runs of its batched chunks as descriptors
(:func:`descriptors`).  Pure functions over NumPy arrays, on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Ids = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]


@dataclass(frozen=True)
class PageRuns:
    """Merged runs, one entry per run in each array (int64 ``[runs]``).

    ``src[i]`` and ``dst[i]``: the first source and destination page of run ``i``;
    ``length[i] >= 1``: its pages; ``pairs == length.sum()``: the pairs merged.  Two
    consecutive runs ``i, i + 1`` never continue each other on both sides at once
    (``src[i] + length[i] == src[i + 1]`` and ``dst[i] + length[i] == dst[i + 1]`` is
    never true): every merge that the order allows was made."""

    src: Ids
    dst: Ids
    length: Ids
    pairs: int

    def __len__(self) -> int:
        return int(self.length.size)

    def expand(self) -> tuple[Ids, Ids]:
        """The pairs the runs hold, run after run: ``(source ids, destination ids)``,
        int64 ``[pairs]`` each.  The inverse of :func:`merge_runs` (of its sorted input
        when ``by_source``)."""
        run = np.repeat(np.arange(len(self), dtype=np.int64), self.length)
        heads = np.cumsum(self.length) - self.length  # index of each run's first pair
        offset = np.arange(self.pairs, dtype=np.int64) - heads[run]
        return self.src[run] + offset, self.dst[run] + offset


def _ids(a, what: str) -> Ids:
    arr = np.asarray(a)
    if arr.ndim != 1:
        raise ValueError(f"merge_runs: {what} page ids must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"merge_runs: {what} page ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def merge_runs(src, dst, *, by_source: bool) -> PageRuns:
    """The runs of the pairs ``(src[i], dst[i])``: integer ids (1-D, equal lengths; any
    integer dtype, read as int64; a NumPy array or a sequence on the host).

    ``by_source=False``: the pairs in the order given, each merged into the run before
    it when it continues that run on both sides (what NIXL's prepared lists do with the
    blocks of one post).  ``by_source=True``: the pairs first sorted by source id (a
    stable sort: pairs of equal source keep their order), then merged the same way;
    ``expand()`` gives back the sorted pairs.  No pairs: no runs.  ValueError when the
    ids are not 1-D integers of equal lengths.  The inputs are not modified."""
    s, d = _ids(src, "source"), _ids(dst, "destination")
    if s.size != d.size:
        raise ValueError(f"merge_runs: {s.size} source ids but {d.size} destination ids")
    if by_source:
        order = np.argsort(s, kind="stable")
        s, d = s[order], d[order]
    if s.size == 0:
        return PageRuns(s[:0], d[:0], np.zeros(0, np.int64), 0)
    brk = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], brk))
    lens = np.diff(np.concatenate((starts, [s.size])))
    return PageRuns(s[starts], d[starts], lens.astype(np.int64, copy=False), int(s.size))


def descriptors(runs: PageRuns, src_ptrs: U64, dst_ptrs: U64, item: U64) -> tuple[U64, U64, U64]:
    """The descriptors of ``runs`` on planes at ``src_ptrs`` / ``dst_ptrs`` (the planes'
    base addresses) with ``item[p]`` bytes a page on plane ``p`` (both sides; uint64
    ``[planes]`` each): ``(source addresses, destination addresses, bytes)``, uint64
    ``[planes * runs]`` each, plane-major (plane ``p``'s runs at ``[p * runs, (p + 1) *
    runs)``, in the order of ``runs``).  One descriptor per run and plane, each inside its
    plane (module docstring) when the ids are below the planes' page counts, which the
    caller guarantees (nothing here knows them)."""
    col = item[:, None]
    src_addr = (src_ptrs[:, None] + runs.src.astype(np.uint64)[None, :] * col).reshape(-1)
    dst_addr = (dst_ptrs[:, None] + runs.dst.astype(np.uint64)[None, :] * col).reshape(-1)
    nbytes = (runs.length.astype(np.uint64)[None, :] * col).reshape(-1)
    return src_addr, dst_addr, nbytes
