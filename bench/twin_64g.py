"""A 64 GiB CUDA-VMM-shaped pool on the CPU twin (issue 15's target): two host pools with
the GPU's chunk plan (2 GiB target, 2 MiB granularity), registered with real NIXL agents
(UCX, DRAM), every prepared descriptor inside one physical chunk, and every page of every
plane moved in direct (post_blocks WRITE), pull (post_blocks READ) and packed (pack into
staging, one write into a landing buffer, unpack) modes, verified byte for byte.

    python -m bench.twin_64g [--gib 64] [--shapes NAME ...] [--modes direct pull packed]
                             [--md FILE]

The machine this runs on may have less memory than the pools: the mappings take memory
only where touched (MAP_NORESERVE), each plane (or packed batch of pages) is written,
moved, compared and then given back (MADV_DONTNEED) before the next, so the peak is
about two layers' planes on each pool and one layer's packed chunk in staging and in
landing (packed mode moves the pool layer by layer: ``pack_pages(..., layers=[l])`` of
every page).  The default suite runs the same class at full
size on the pages next to every chunk boundary (tests/transfer/test_twin_64g.py).
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import time

import numpy as np
import torch

import kvmem
from bench import print_table
from kvmem.memory import host, make_backend
from kvmem.memory.plan import CHUNK_BYTES
from kvmem.transfer import NixlEngine

GiB = 1 << 30
SHAPES = {  # issue 15: 80 layers, page_size 1, 16 and 64, MLA 576
    "MHA8x128-bf16-P1": dict(num_kv_heads=8, head_dim=128, page_size=1),
    "MHA8x128-bf16-P16": dict(num_kv_heads=8, head_dim=128, page_size=16),
    "MHA8x128-bf16-P64": dict(num_kv_heads=8, head_dim=128, page_size=64),
    "MLA576-fp8-P1": dict(num_kv_heads=1, head_dim=576, page_size=1, v_head_dim=0,
                          dtype=torch.float8_e4m3fn),
}
_ids = itertools.count()


def spec_of(name: str) -> kvmem.KVSpec:
    return kvmem.KVSpec(num_layers=80, **SHAPES[name])


class Twin:
    """Pools ``a`` (the prefill's) and ``b`` (the decode's) of ``gib`` GiB with CUDA-sized
    chunks, engines, prepared tables, a staging buffer on ``a`` and a landing buffer on
    ``b`` of ``batch_bytes`` each (both registered one region per chunk)."""

    def __init__(self, spec: kvmem.KVSpec, layout: str = "kvmem", gib: int = 64,
                 batch_bytes: int = 256 << 20, huge_pages: bool = True):
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
        for lay, regions in ((self.lt.layout, self.pa.regions()), (self.rt.layout, self.pb.regions())):
            hits = [[i for i, (r, m) in enumerate(regions) if r <= s and s + n <= r + m]
                    for s, n in lay.spans()]
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
    out = [(max(a, r), min(a + n, r + m) - max(a, r)) for r, m in regions
           if max(a, r) < min(a + n, r + m)]
    assert sum(x for _, x in out) == n
    return out


# --- the full run ---------------------------------------------------------------------------

def run_direct_or_pull(t: Twin, mode: str) -> int:
    moved = 0
    for plane in range(len(t.planes)):
        first, last = 0, t.pages
        src = t.pa if mode == "direct" else t.pb
        t.stamp(src, plane, first, last, salt=1 if mode == "direct" else 2)
        ids = np.arange(first, last, dtype=np.int64)
        (t.direct if mode == "direct" else t.pull)([(plane, ids)])
        if not t.same(plane, first, last):
            raise AssertionError(f"{mode}: plane {plane} differs after the move")
        moved += t.planes[plane][first:last].nbytes
        t.forget(plane, first, last)
    return moved


def run_packed(t: Twin) -> int:
    """Layer by layer: every page of the layer's K and V planes packed into staging (the
    packed chunk layout, ``layers=[l]``), written into the landing buffer, unpacked into
    b, compared, given back."""
    ids = torch.arange(0, t.pages, dtype=torch.int64)
    per = len(t.planes) // t.spec.num_layers  # planes of a layer: K, or K and V
    moved = 0
    for layer in range(t.spec.num_layers):
        planes = [layer + j * t.spec.num_layers for j in range(per)]
        for plane in planes:
            t.stamp(t.pa, plane, 0, t.pages, salt=3)
        t.packed(ids, layers=[layer])
        for plane in planes:
            if not t.same(plane, 0, t.pages):
                raise AssertionError(f"packed: plane {plane} differs after the move")
            moved += t.planes[plane].nbytes
            t.forget(plane, 0, t.pages)
    return moved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=64)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--layout", default="kvmem", choices=["kvmem", "sglang"])
    ap.add_argument("--modes", nargs="*", default=["direct", "pull", "packed"])
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    rows = ["| shape | layout | pages | chunks | blocks | descriptors inside one chunk | "
            "mode | bytes moved and verified | seconds (under load) | GB/s |",
            "|" + "---|" * 10]
    for name in args.shapes:
        spec = spec_of(name)
        pages = (args.gib * GiB) // spec.page_bytes
        t = Twin(spec, args.layout, args.gib,
                 batch_bytes=kvmem.packed_nbytes(spec, pages, layers=[0]))
        try:
            inside = t.descriptors_inside_chunks()
            for mode in args.modes:
                t0 = time.perf_counter()
                moved = run_packed(t) if mode == "packed" else run_direct_or_pull(t, mode)
                dt = time.perf_counter() - t0
                rows.append(f"| {name} | {args.layout} | {t.pages} | {len(t.pa.regions())} | "
                            f"{t.lt.layout.blocks} | {inside} | {mode} | {moved} | "
                            f"{dt:.1f} | {moved / dt / 1e9:.2f} |")
                print(rows[-1], flush=True)
        finally:
            t.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    print_table([f"Every page of {args.gib} GiB host-twin pools moved and compared "
                 f"(peak RSS {peak / GiB:.1f} GiB)", ""] + rows, args.md)


if __name__ == "__main__":
    main()
