"""The chunk plan: where a pool's layer planes sit in its address range, and where that
range is cut into physical allocations (chunks).

A transfer engine registers one region per physical allocation, and NIXL refuses a
descriptor that spans two registrations (``NIXL_ERR_NOT_FOUND``, checked with
nixl-cu12 1.5.1, also for two adjacent ones).  So a chunk boundary must never fall inside
anything the engine or sglang may address: a page of a layer, a run of a layer's pages,
a layer's whole plane, or, in sglang's layout, a layer's K|V block (sglang's kernels
reach V from K's base by a fixed offset).  The plan guarantees it by construction:

* *items* are the units nothing may cut: ``layout="kvmem"``: each K plane, then each V
  plane (``[num_pages, page_size, heads, head_dim]`` of one layer); ``layout="sglang"``:
  each layer's K|V block (K then V immediately after it, ``spec.k_layer_bytes`` apart);
* items are laid out in order, each on a :data:`LAYER_ALIGN` boundary, and grouped into
  chunks of up to ``target`` bytes; an item bigger than ``target`` is a chunk of its own;
* a chunk starts on the allocation granularity (CUDA: ``cuMemGetAllocationGranularity``,
  2 MiB on current GPUs; host: the 2 MiB huge page), so its allocation is
  ``chunk.nbytes`` rounded up to the granularity and the padding sits after the chunk's
  last item, never inside one.

Picture (``layout="kvmem"``, 3 layers, room for two planes a chunk)::

    chunk 0                        chunk 1                        chunk 2
    [K 0][K 1]......padding........[K 2][V 0]......padding........[V 1][V 2]..
    ^ granularity boundary          ^ granularity boundary         ^

With one chunk (a pool up to ``target``) the offsets are those of a single range,
padded to 512 bytes only.  Both backends (``host``, ``cuda_vmm``) take their chunks from
a plan, so the CPU test suite sees the GPU's boundaries.

Units: bytes, offsets from the start of the pool's range.  What plans of real pools
cost (driver calls, padding): docs/pool.md, "Physical chunks".
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass

from kvmem.spec import KVSpec

# Each plane starts on a 512-byte boundary inside a chunk: 16-byte vector accesses need
# 16, and 512 is what CUDA's caching allocator gives separate tensors, so kvmem's and
# sglang's buffers behave alike in the kernels.
LAYER_ALIGN = 512

LAYOUTS = ("kvmem", "sglang")

# Default chunk target: docs/pool.md, "Physical chunks" (what it costs a 64 GiB pool).
CHUNK_BYTES = 2 << 30

# Environment variable with the chunk target in bytes, read when a backend is made
# without an explicit ``chunk_bytes`` (the test suite sets a small one, so small pools
# have several chunks; see tests/conftest.py).
CHUNK_ENV = "KVMEM_CHUNK_BYTES"

# Chunks one plain range may have: 2**20 is 2 PiB at the default target, and 2 TiB at
# the smallest (one 2 MiB granule a chunk); past it the range could not be reserved
# anyway, and its plan alone would take gigabytes.
MAX_CHUNKS = 1 << 20


def _round_up(x: int, a: int) -> int:
    return -(-x // a) * a


def chunk_target(chunk_bytes: int | None = None) -> int:
    """The chunk target in bytes: ``chunk_bytes`` when given, else ``$KVMEM_CHUNK_BYTES``,
    else :data:`CHUNK_BYTES`.

    Raises:
        ValueError: the value (argument or environment variable, named) is not an
            int > 0.
    """
    if chunk_bytes is not None:
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be an int > 0, got {chunk_bytes!r}")
        return chunk_bytes
    raw = os.environ.get(CHUNK_ENV, "").strip()
    if not raw:
        return CHUNK_BYTES
    try:
        value = int(raw, 0)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{CHUNK_ENV}={raw!r}: must be a number of bytes > 0")
    return value


@dataclass(frozen=True)
class Chunk:
    """One physical allocation of a range.

    ``offset``: where it starts (a multiple of the plan's alignment); ``nbytes``: the bytes
    its items use from there (what a transfer engine registers); ``size``: the bytes
    allocated (``nbytes`` rounded up to the granularity; ``size - nbytes`` is padding)."""

    offset: int
    nbytes: int
    size: int


@dataclass(frozen=True)
class ChunkPlan:
    """Chunks of a range, and for a pool where each layer's K and V start.

    Attributes:
        granularity: allocation granularity the chunks are aligned to.
        target: bytes of items grouped into one chunk at most (``None``: one chunk).
        chunks: ``(Chunk, ...)`` in address order; ``chunks[i + 1].offset ==
            chunks[i].offset + chunks[i].size`` (they tile the range).
        k_offsets, v_offsets: byte offset of each layer's K and V (empty for a plain
            range; ``v_offsets`` empty for a K-only spec).
        nbytes: bytes of the range the views use, ``chunks[-1].offset +
            chunks[-1].nbytes``.
        content: bytes of the items themselves (``spec.pool_bytes(num_pages)`` for a pool).
    """

    granularity: int
    target: int | None
    chunks: tuple
    k_offsets: tuple = ()
    v_offsets: tuple = ()
    nbytes: int = 0
    content: int = 0

    @property
    def size(self) -> int:
        """Bytes allocated: the sum of the chunks' sizes."""
        last = self.chunks[-1]
        return last.offset + last.size

    @property
    def padding(self) -> int:
        """Bytes allocated that hold no item: 512-byte alignment inside chunks and the
        round-up of every chunk to the granularity."""
        return self.size - self.content

    def chunk_of(self, offset: int) -> int:
        """Index of the chunk whose ``[offset, offset + nbytes)`` holds ``offset``.

        Raises:
            ValueError: ``offset`` lies in padding or outside the range.
        """
        i = bisect.bisect_right([c.offset for c in self.chunks], offset) - 1
        if i < 0 or offset >= self.chunks[i].offset + self.chunks[i].nbytes:
            raise ValueError(
                f"offset {offset} is not inside a chunk's items (chunks "
                f"{[(c.offset, c.nbytes) for c in self.chunks][:4]}...)"
            )
        return i


def _check_granularity(granularity) -> int:
    if (
        isinstance(granularity, bool)
        or not isinstance(granularity, int)
        or granularity <= 0
        or granularity & (granularity - 1)
    ):
        raise ValueError(f"granularity must be a power of two > 0, got {granularity!r}")
    return max(granularity, LAYER_ALIGN)


def _check_target(target) -> int | None:
    if target is not None and (
        isinstance(target, bool) or not isinstance(target, int) or target <= 0
    ):
        raise ValueError(f"target must be None or an int > 0, got {target!r}")
    return target


def plan_pool(
    spec: KVSpec, num_pages: int, layout: str, granularity: int, target: int | None
) -> ChunkPlan:
    """The chunk plan of a pool (see the module docstring).

    Args:
        spec, num_pages, layout: the pool's (``layout`` in :data:`LAYOUTS`).
        granularity: allocation granularity, a power of two (chunks start on
            ``max(granularity, LAYER_ALIGN)``).
        target: bytes of items per chunk at most; ``None``: one chunk.

    Raises:
        ValueError: an unknown layout, a bad granularity or target.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown KVPool layout {layout!r} (known: {', '.join(LAYOUTS)})")
    align = _check_granularity(granularity)
    target = _check_target(target)
    k_bytes, v_bytes = spec.k_layer_bytes(num_pages), spec.v_layer_bytes(num_pages)
    n = spec.num_layers
    # items: (bytes, [(buffer kind, layer, offset inside the item)])
    if layout == "sglang":
        items = [
            (k_bytes + v_bytes, [("k", l, 0)] + ([("v", l, k_bytes)] if spec.has_v else []))
            for l in range(n)
        ]
    else:
        items = [(k_bytes, [("k", l, 0)]) for l in range(n)]
        if spec.has_v:
            items += [(v_bytes, [("v", l, 0)]) for l in range(n)]
    chunks: list[Chunk] = []
    k_off, v_off = [0] * n, [0] * (n if spec.has_v else 0)
    start, used = 0, 0  # the open chunk: its offset, bytes used from there
    for nbytes, parts in items:
        at = _round_up(used, LAYER_ALIGN)
        # an item takes its padding to LAYER_ALIGN with it: a chunk's bytes, padding
        # included, stay within the target unless one item alone exceeds it
        if used and target is not None and _round_up(at + nbytes, LAYER_ALIGN) > target:
            size = _round_up(used, align)
            chunks.append(Chunk(start, used, size))
            start, used, at = start + size, 0, 0
        for kind, layer, rel in parts:
            (k_off if kind == "k" else v_off)[layer] = start + at + rel
        used = _round_up(at + nbytes, LAYER_ALIGN)
    chunks.append(Chunk(start, used, _round_up(used, align)))
    content = spec.pool_bytes(num_pages)
    return ChunkPlan(
        granularity, target, tuple(chunks), tuple(k_off), tuple(v_off), start + used, content
    )


def plan_range(nbytes: int, granularity: int, target: int | None) -> ChunkPlan:
    """The chunk plan of a plain range of ``nbytes`` (a staging or landing buffer): chunks
    of ``target`` rounded up to the granularity (one chunk with ``target=None``), the last
    one shorter.  The chunks' used bytes tile the range with no gap, so byte ``o`` of the
    regions listed in order is byte ``o`` of the range.  Nothing inside such a range is
    placed for the caller: whoever cuts it
    into slots must keep a slot inside one chunk (or split its writes at the chunks)."""
    align = _check_granularity(granularity)
    target = _check_target(target)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes must be an int > 0, got {nbytes!r}")
    step = nbytes if target is None else max(align, _round_up(target, align))
    if -(-nbytes // step) > MAX_CHUNKS:
        raise OverflowError(
            f"a range of {nbytes} bytes in chunks of {step} would be "
            f"{-(-nbytes // step)} chunks, more than {MAX_CHUNKS}"
        )
    chunks = tuple(
        Chunk(off, min(step, nbytes - off), _round_up(min(step, nbytes - off), align))
        for off in range(0, nbytes, step)
    )
    return ChunkPlan(granularity, target, chunks, (), (), nbytes, nbytes)
