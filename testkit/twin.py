"""A 64 GiB CUDA-VMM-shaped pool on the CPU twin (the sizes kvmem is written for): two host pools with
the GPU's chunk plan (2 GiB target, 2 MiB granularity), registered with real NIXL agents
(UCX, DRAM), prepared tables over every chunk, and blocks moved in direct (post_blocks
WRITE), pull (post_blocks READ) and packed (pack into staging, one write into a landing
buffer, unpack) modes.  :class:`Twin` is shared by ``python -m bench.twin_64g`` (every
page of every plane, moved and verified) and tests/transfer/test_twin_64g.py (the pages
next to every chunk boundary).
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import torch

import kvmem
from kvmem.memory import host, make_backend
from kvmem.memory.plan import CHUNK_BYTES
from kvmem.transfer import NixlEngine

GiB = 1 << 30
SHAPES = {  # what kvmem is written for: 80 layers, page_size 1, 16 and 64, MLA 576
    "MHA8x128-bf16-P1": dict(num_kv_heads=8, head_dim=128, page_size=1),
    "MHA8x128-bf16-P16": dict(num_kv_heads=8, head_dim=128, page_size=16),
    "MHA8x128-bf16-P64": dict(num_kv_heads=8, head_dim=128, page_size=64),
    "MLA576-fp8-P1": dict(
        num_kv_heads=1, head_dim=576, page_size=1, v_head_dim=0, dtype=torch.float8_e4m3fn
    ),
}
_ids = itertools.count()


def spec_of(name: str) -> kvmem.KVSpec:
    return kvmem.KVSpec(num_layers=80, **SHAPES[name])


class Twin:
    """Pools ``a`` (the prefill's) and ``b`` (the decode's) of ``gib`` GiB with CUDA-sized
    chunks, engines, prepared tables, a staging buffer on ``a`` and a landing buffer on
    ``b`` of ``batch_bytes`` each (both registered one region per chunk)."""

    def __init__(
        self,
        spec: kvmem.KVSpec,
        layout: str = "kvmem",
        gib: int = 64,
        batch_bytes: int = 256 << 20,
        huge_pages: bool = True,
    ):
        self.spec = spec
        self.pages = (gib * GiB) // spec.page_bytes
        self.pa = kvmem.KVPool(spec, self.pages, layout=layout, chunk_bytes=CHUNK_BYTES)
        self.pb = kvmem.KVPool(spec, self.pages, layout=layout, chunk_bytes=CHUNK_BYTES)
        if not huge_pages:  # a touched byte then costs 4 KiB, not a 2 MiB huge page
            for p in (self.pa, self.pb):
                mapped = -(-p.nbytes // host.PAGE) * host.PAGE  # the chunks tile it
                host._madvise(p._mem.tensor.data_ptr(), mapped, 15)  # MADV_NOHUGEPAGE
        tag = f"{os.getpid()}-{next(_ids)}"
        self.a = NixlEngine(f"twin-a-{tag}", progress_thread=False)
        self.b = NixlEngine(f"twin-b-{tag}", progress_thread=False)
        cpu = torch.device("cpu")
        self.staging = make_backend(batch_bytes, cpu)
        self.landing = make_backend(batch_bytes, cpu)
        self.a.register_pool(self.pa)
        self.b.register_pool(self.pb)
        self.a.register("staging", self.staging.regions(), 0)
        self.b.register("landing", self.landing.regions(), 0)
        mems = self.a.add_peer(self.b.local_metadata())
        self.b.add_peer(self.a.local_metadata())
        self.remote_kv, self.remote_landing = mems["kv"], mems["landing"]
        self.lt, self.rt = self.a.prep_local("kv"), self.a.prep_remote(self.remote_kv)
        self.planes = list(self.pa.k_buffer) + list(self.pa.v_buffer)
        self.planes_b = list(self.pb.k_buffer) + list(self.pb.v_buffer)

    # --- checks ---------------------------------------------------------------------------
    def descriptors_inside_chunks(self) -> bool:
        """Every block of both prepared tables lies inside one chunk (each plane's whole
        span inside one region), and the tables use every chunk."""
        for lay, regions in (
            (self.lt.layout, self.pa.regions()),
            (self.rt.layout, self.pb.regions()),
        ):
            hits = [
                [i for i, (r, m) in enumerate(regions) if r <= s and s + n <= r + m]
                for s, n in lay.spans()
            ]
            if any(len(h) != 1 for h in hits) or {h[0] for h in hits} != set(range(len(regions))):
                return False
        return True

    # --- data -------------------------------------------------------------------------------
    def stamp(self, pool: kvmem.KVPool, plane: int, first: int, last: int, salt: int) -> None:
        """Distinct bytes in blocks ``[first, last)`` of ``plane``: a fill byte of
        (plane, salt), and each block's first and last 8 bytes its global index."""
        buf = (list(pool.k_buffer) + list(pool.v_buffer))[plane]
        rows = buf[first:last].view(torch.uint8).reshape(last - first, -1)
        rows.fill_((plane * 31 + salt) % 251)
        if rows.shape[1] % 8 == 0:
            idx = torch.arange(first, last, dtype=torch.int64) + plane * pool.num_pages
            words = rows.view(torch.int64)
            words[:, 0], words[:, -1] = idx, ~idx

    def same(self, plane: int, first: int, last: int) -> bool:
        x = self.planes[plane][first:last].view(torch.uint8)
        y = self.planes_b[plane][first:last].view(torch.uint8)
        return torch.equal(x, y)

    def forget(self, plane: int, first: int, last: int) -> None:
        """Give back the memory of blocks ``[first, last)`` of ``plane`` on both pools (the
        OS pages they touch, rounded outwards: only done or untouched blocks share them)."""
        for bufs in (self.planes, self.planes_b):
            b = bufs[plane]
            a0 = b[first].data_ptr() // host.PAGE * host.PAGE
            a1 = -(-(b[last - 1].data_ptr() + b[last - 1].nbytes) // host.PAGE) * host.PAGE
            host._madvise(a0, a1 - a0, host.MADV_DONTNEED)

    # --- moves --------------------------------------------------------------------------------
    def _wait(self, h) -> None:
        while self.a.poll(h) == "PROC":
            self.b.get_notifs()
        if h.state != "DONE":
            raise RuntimeError(f"transfer ended {h.state}: {h.error}")
        self.a.release(h)

    def blocks(self, plane: int, pages: np.ndarray, table) -> np.ndarray:
        return plane * table.layout.count + pages

    def direct(self, items) -> None:
        """``items``: [(plane, page ids)]: those blocks of a into the same blocks of b."""
        li = np.concatenate([self.blocks(p, ids, self.lt) for p, ids in items])
        ri = np.concatenate([self.blocks(p, ids, self.rt) for p, ids in items])
        self._wait(self.a.post_blocks(self.lt, li, self.rt, ri))

    def pull(self, items) -> None:
        """The same blocks read from b into a."""
        li = np.concatenate([self.blocks(p, ids, self.lt) for p, ids in items])
        ri = np.concatenate([self.blocks(p, ids, self.rt) for p, ids in items])
        self._wait(self.a.post_blocks(self.lt, li, self.rt, ri, op="READ"))

    def packed(self, page_ids: torch.Tensor, layers=None) -> None:
        """Pack ``page_ids`` of ``layers`` of a into staging, write it into b's landing
        buffer (both cut at their chunks), unpack it into the same pages of b."""
        n = kvmem.packed_nbytes(self.spec, len(page_ids), layers)
        slot = self.staging.tensor[:n]
        kvmem.pack_pages(self.pa, page_ids, layers=layers, out=slot)
        local = _cut((slot.data_ptr(), n), self.staging.regions())
        remote = _cut((self.landing.tensor.data_ptr(), n), self.landing.regions())
        self._wait(self.a.post_write(local, self.remote_landing, remote))
        kvmem.unpack_pages(self.landing.tensor[:n], self.pb, page_ids, layers=layers)

    def close(self) -> None:
        for e in (self.a, self.b):
            e.close()
        for m in (self.pa, self.pb, self.staging, self.landing):
            m.close()


def _cut(rng: tuple[int, int], regions) -> list[tuple[int, int]]:
    """The byte stream ``rng`` as ranges cut at the regions it crosses."""
    a, n = rng
    out = [
        (max(a, r), min(a + n, r + m) - max(a, r))
        for r, m in regions
        if max(a, r) < min(a + n, r + m)
    ]
    assert sum(x for _, x in out) == n
    return out
