"""The GPU pool's physical layout on the CPU twin, at full size: 64 GiB pools shaped as
on the GPU (80 layers; 8 KV heads x 128 bf16 at page_size 1, 16 and 64; MLA 576 fp8 at page_size 1;
2 GiB chunks on 2 MiB), registered with real NIXL, every prepared descriptor inside one
physical chunk, and the blocks next to every chunk boundary (the first page of each
chunk's first plane, the last page of its last plane) moved in direct, pull and packed
modes and compared.  Memory: only the touched pages (MAP_NORESERVE, huge pages off for
these pools).  Every page of every plane: ``python -m bench.twin_64g``
(bench/results/cpu-2026-12-01-twin-64g.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from testkit.twin import Twin, spec_of

pytestmark = pytest.mark.nixl


def _edges(t: Twin) -> list[tuple[int, int]]:
    """(plane, page) of the blocks next to each chunk boundary."""
    regions = t.pa.regions()
    spans = t.lt.layout.spans()
    chunk = [next(i for i, (r, m) in enumerate(regions) if r <= s < r + m) for s, _ in spans]
    out = []
    for c in range(len(regions)):
        mine = [p for p, k in enumerate(chunk) if k == c]
        out += [(mine[0], 0), (mine[-1], t.pages - 1)]
    return out


@pytest.mark.parametrize(
    "name, layout",
    [
        ("MHA8x128-bf16-P1", "kvmem"),
        ("MHA8x128-bf16-P16", "sglang"),
        ("MHA8x128-bf16-P64", "kvmem"),
        ("MLA576-fp8-P1", "sglang"),
    ],
)
def test_64_gib_pool_moves_the_pages_at_every_chunk_boundary(name, layout):
    t = Twin(spec_of(name), layout, gib=64, batch_bytes=64 << 20, huge_pages=False)
    try:
        assert t.pa.nbytes > 63 << 30 and len(t.pa.regions()) >= 32
        assert t.a.open_registrations() == len(t.pa.regions()) + len(t.staging.regions())
        assert t.descriptors_inside_chunks()
        edges = _edges(t)
        items = [(p, np.array([g], dtype=np.int64)) for p, g in edges]
        for salt, (mode, src) in enumerate((("direct", t.pa), ("pull", t.pb)), 1):
            for p, g in edges:
                t.stamp(src, p, g, g + 1, salt)
            (t.direct if mode == "direct" else t.pull)(items)
            assert all(t.same(p, g, g + 1) for p, g in edges), mode
        ids = torch.tensor([0, t.pages - 1])
        for plane in range(len(t.planes)):
            for g in (0, t.pages - 1):
                t.stamp(t.pa, plane, g, g + 1, 3)
        t.packed(ids)
        assert all(t.same(p, g, g + 1) for p in range(len(t.planes)) for g in (0, t.pages - 1))
        assert t.pa.resident_bytes() < 64 << 20  # a few touched pages of 64 GiB
    finally:
        t.close()
