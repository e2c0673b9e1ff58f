"""Physical chunks of a 64 GiB pool: driver calls of release and resume, the
padding the plan costs, and what it takes to prepare a pool's block tables.

    python -m bench.chunk_plan [--gib 64] [--md FILE] [--nixl]

For 80-layer 8B/70B-class shapes (8 KV heads x 128, bf16 and fp8) and MLA (576, K only,
bf16 = 1152-byte tokens and fp8 = 576-byte tokens), page_size 1, 16 and 64, both layouts:

- the plan (:func:`kvmem.memory.plan.plan_pool`, granularity 2 MiB as on an H200, the
  default 2 GiB target): chunks, planes per chunk, padding bytes;
- driver calls: the real ``CudaVmmBackend`` run against the test suite's fake driver
  (``tests/memory/test_cuda_vmm_fake_driver.py``, here with a 2 MiB granularity: it counts every
  call) for one release and one resume; the host twin's ``madvise`` calls;
- "old cut": pages the previous fixed 2 GiB chunks cut in two (what NIXL then refused);
- descriptor tables: blocks (pages x planes), the strided rows kvmem now prepares
  (one per plane), and the bytes one row per block would take (the previous lists).

``--nixl`` also registers two such host pools with real NIXL engines (UCX, DRAM) and
times ``register_pool``, ``add_peer``, ``prep_local`` + ``prep_remote`` and their RSS.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import kvmem
from bench import print_table
from kvmem.memory.cuda_vmm import CudaVmmBackend
from kvmem.memory.plan import CHUNK_BYTES, plan_pool

GRAN = 2 << 20  # cuMemGetAllocationGranularity on current NVIDIA GPUs (H100/H200)


def shapes():
    for name, heads, dim, vdim in (("MHA 8x128", 8, 128, None), ("MLA 576", 1, 576, 0)):
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            for ps in (1, 16, 64):
                spec = kvmem.KVSpec(
                    num_layers=80,
                    num_kv_heads=heads,
                    head_dim=dim,
                    page_size=ps,
                    dtype=dtype,
                    v_head_dim=vdim,
                )
                yield name, spec


def driver_calls(spec, pages: int, layout: str) -> tuple[int, int, int]:
    """(release calls, resume calls, chunks) of the real cuda_vmm backend, against the
    test suite's fake driver (it counts every call; its reservation is address space
    only until touched, and nothing is touched here)."""
    from tests.memory.test_cuda_vmm_fake_driver import FakeDriver

    drv = FakeDriver(capacity=1 << 62, address_space=1 << 62, granularity=GRAN)
    pool = kvmem.KVPool(
        spec,
        pages,
        "cpu",
        layout=layout,
        backend=CudaVmmBackend.factory(driver=drv, chunk_bytes=CHUNK_BYTES),
    )
    before = dict(drv.calls)
    pool.release()
    mid = dict(drv.calls)
    pool.resume()
    after = dict(drv.calls)
    chunks = len(pool.plan.chunks)
    pool.close()

    def diff(a, b):
        return sum(b.get(k, 0) - a.get(k, 0) for k in b)

    return diff(before, mid), diff(mid, after), chunks


def old_cuts(spec, pages: int, layout: str) -> tuple[int, int]:
    """(planes, pages) the previous fixed 2 GiB chunks cut in two (single-range layout):
    a cut plane cannot be registered with its layout (item 1), a cut page cannot be
    prepared at all (item 2)."""
    plan = plan_pool(spec, pages, layout, 1, None)
    k, v = spec.k_layer_bytes(pages), spec.v_layer_bytes(pages)
    planes = [(o, k, spec.k_page_bytes) for o in plan.k_offsets] + [
        (o, v, spec.v_page_bytes) for o in plan.v_offsets
    ]
    cut_planes = cut_pages = 0
    for c in range(CHUNK_BYTES, plan.nbytes, CHUNK_BYTES):
        for o, n, page in planes:
            if o < c < o + n:
                cut_planes += 1
                cut_pages += bool((c - o) % page)
    return cut_planes, cut_pages


def plan_rows(gib: int) -> list[str]:
    rows = [
        "| shape | dtype | page_size | layout | pages | plane (MiB) | chunks | planes / "
        "chunk | padding (bytes) | padding (% of pool) | release: driver calls | "
        "resume: driver calls | host twin: madvise per release | old cut: planes / pages split | "
        "blocks (pages x planes) | strided rows prepared | one row per block (MB) |",
        "|" + "---|" * 17,
    ]
    for name, spec in shapes():
        pages = (gib << 30) // spec.page_bytes
        for layout in ("kvmem", "sglang"):
            plan = plan_pool(spec, pages, layout, GRAN, CHUNK_BYTES)
            rel, res, chunks = driver_calls(spec, pages, layout)
            assert chunks == len(plan.chunks)
            planes = len(plan.k_offsets) + len(plan.v_offsets)
            units = spec.num_layers if layout == "sglang" else planes
            plane = spec.k_layer_bytes(pages) + (
                spec.v_layer_bytes(pages) if layout == "sglang" else 0
            )
            blocks = planes * pages
            dtype = "bf16" if spec.dtype == torch.bfloat16 else "fp8"
            rows.append(
                f"| {name} | {dtype} | {spec.page_size} | {layout} | {pages} | "
                f"{plane / 2**20:.1f} | {chunks} | {units / chunks:.1f} | {plan.padding} | "
                f"{100 * plan.padding / plan.size:.4f} | {rel} | {res} | {chunks} | "
                "{} / {} | ".format(*old_cuts(spec, pages, layout))
                + f"{blocks} | {planes} | "
                f"{blocks * 24 / 1e6:.0f} |"
            )
    return rows


def nixl_rows(gib: int) -> list[str]:
    from kvmem.transfer import NixlEngine
    from tests.util import vm_rss

    rows = [
        "| shape | dtype | page_size | layout | chunks | blocks | register_pool x2 (ms) | "
        "add_peer (ms) | prep_local + prep_remote (ms) | RSS growth (MiB) |",
        "|" + "---|" * 10,
    ]
    for name, spec in shapes():
        if spec.page_size == 16:
            continue
        pages = (gib << 30) // spec.page_bytes
        for layout in ("kvmem", "sglang"):
            pa = kvmem.KVPool(spec, pages, layout=layout, chunk_bytes=CHUNK_BYTES)
            pb = kvmem.KVPool(spec, pages, layout=layout, chunk_bytes=CHUNK_BYTES)
            tag = f"{os.getpid()}-{name.replace(' ', '')}-{spec.page_size}-{layout}"
            a = NixlEngine(f"a-{tag}", progress_thread=False)
            b = NixlEngine(f"b-{tag}", progress_thread=False)
            rss = vm_rss()
            t0 = time.perf_counter()
            a.register_pool(pa)
            b.register_pool(pb)
            t1 = time.perf_counter()
            remote = a.add_peer(b.local_metadata())["kv"]
            t2 = time.perf_counter()
            lt, rt = a.prep_local("kv"), a.prep_remote(remote)
            t3 = time.perf_counter()
            grew = vm_rss() - rss
            dtype = "bf16" if spec.dtype == torch.bfloat16 else "fp8"
            rows.append(
                f"| {name} | {dtype} | {spec.page_size} | {layout} | "
                f"{len(pa.regions())} | {lt.layout.blocks} | {(t1 - t0) * 1e3:.1f} | "
                f"{(t2 - t1) * 1e3:.1f} | {(t3 - t2) * 1e3:.2f} | {grew / 2**20:.1f} |"
            )
            a.release_table(rt)
            a.close()
            b.close()
            pa.close()
            pb.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=64)
    ap.add_argument("--md", default=None, help="append the tables to this Markdown file")
    ap.add_argument("--nixl", action="store_true", help="also time NIXL registration/prep")
    args = ap.parse_args()
    head = [
        f"{args.gib} GiB pools, 80 layers, granularity 2 MiB, chunk target "
        f"{CHUNK_BYTES >> 30} GiB (driver calls counted on the real cuda_vmm backend "
        "against a counting driver)",
        "",
    ]
    print_table(head + plan_rows(args.gib), args.md)
    if args.nixl:
        print_table(
            [f"NIXL (nixl-cu12, UCX, DRAM) on two {args.gib} GiB host pools (nothing touched)", ""]
            + nixl_rows(args.gib),
            args.md,
        )


if __name__ == "__main__":
    main()
