"""A 64 GiB CUDA-VMM-shaped pool on the CPU twin (the sizes kvmem is written for): two host pools with
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
import resource
import time

import numpy as np
import torch

import kvmem
from bench import print_table
from testkit.twin import GiB, SHAPES, Twin, spec_of


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
    rows = [
        "| shape | layout | pages | chunks | blocks | descriptors inside one chunk | "
        "mode | bytes moved and verified | seconds (under load) | GB/s |",
        "|" + "---|" * 10,
    ]
    for name in args.shapes:
        spec = spec_of(name)
        pages = (args.gib * GiB) // spec.page_bytes
        t = Twin(
            spec, args.layout, args.gib, batch_bytes=kvmem.packed_nbytes(spec, pages, layers=[0])
        )
        try:
            inside = t.descriptors_inside_chunks()
            for mode in args.modes:
                t0 = time.perf_counter()
                moved = run_packed(t) if mode == "packed" else run_direct_or_pull(t, mode)
                dt = time.perf_counter() - t0
                rows.append(
                    f"| {name} | {args.layout} | {t.pages} | {len(t.pa.regions())} | "
                    f"{t.lt.layout.blocks} | {inside} | {mode} | {moved} | "
                    f"{dt:.1f} | {moved / dt / 1e9:.2f} |"
                )
                print(rows[-1], flush=True)
        finally:
            t.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    print_table(
        [
            f"Every page of {args.gib} GiB host-twin pools moved and compared "
            f"(peak RSS {peak / GiB:.1f} GiB)",
            "",
        ]
        + rows,
        args.md,
    )


if __name__ == "__main__":
    main()
