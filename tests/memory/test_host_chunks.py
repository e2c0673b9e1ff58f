"""The host backend as the CPU twin of the CUDA chunks: one reserved range, one private
anonymous mapping per chunk of the pool's plan (the GPU's boundaries, on 2 MiB), one
region per chunk, release per chunk, every byte of the range (padding included) mapped,
and everything unmapped once the last view goes."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import kvmem
from kvmem.memory import host, make_backend
from kvmem.memory.plan import plan_pool, plan_range
from tests.kv_cases import fill_random

SPEC = kvmem.KVSpec(
    num_layers=3, num_kv_heads=1, head_dim=576, page_size=1, dtype=torch.float8_e4m3fn, v_head_dim=0
)  # MLA 576: 576-byte pages
TARGET = 200_000


def _maps() -> list[tuple[int, int, str]]:
    """This process's mappings: (start, end, perms)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            a, b = (int(x, 16) for x in span.split("-"))
            out.append((a, b, perms))
    return out


def _covered_rw(a: int, n: int) -> bool:
    """[a, a + n) is mapped read/write, as one or more adjacent mappings."""
    pos = a
    for s, e, perms in sorted(_maps()):
        if s <= pos < e:
            if not perms.startswith("rw"):
                return False
            pos = e
            if pos >= a + n:
                return True
    return False


@pytest.mark.parametrize("layout", ["kvmem", "sglang"])
def test_chunks_are_the_gpu_plan_on_huge_page_boundaries(layout):
    pool = kvmem.KVPool(SPEC, 301, layout=layout, chunk_bytes=TARGET)  # 173 KB planes
    want = plan_pool(SPEC, 301, layout, host.GRANULARITY, TARGET)
    assert pool.plan == want and len(want.chunks) == 3
    base = pool._mem.tensor.data_ptr()
    assert base % host.GRANULARITY == 0
    assert pool.regions() == [(base + c.offset, c.nbytes) for c in want.chunks]
    assert [b.data_ptr() - base for b in pool.k_buffer] == list(want.k_offsets)
    for c in want.chunks[:-1]:  # every allocation mapped whole, padding included
        assert _covered_rw(base + c.offset, c.size)
    assert _covered_rw(base + want.chunks[-1].offset, want.chunks[-1].nbytes)
    fill_random(pool._mem.tensor, torch.Generator().manual_seed(1))  # the whole range
    info = pool.memory_info()
    assert info["backend"] == "host" and info["chunks"] == 3 and not info["exportable"]
    assert info["granularity"] == host.GRANULARITY and info["target"] == TARGET
    assert info["padding"] == want.padding


def test_release_is_one_madvise_per_chunk_and_keeps_addresses(monkeypatch):
    pool = kvmem.KVPool(SPEC, 301, chunk_bytes=TARGET)
    fill_random(pool._mem.tensor, torch.Generator().manual_seed(2))
    assert pool.resident_bytes() >= pool.nbytes
    calls = []
    real = host._madvise
    monkeypatch.setattr(host, "_madvise", lambda a, n, adv: (calls.append(adv), real(a, n, adv)))
    ptrs, regions = [b.data_ptr() for b in pool.k_buffer], pool.regions()
    pool.release()
    assert calls == [host.MADV_DONTNEED] * 3
    assert pool.resident_bytes() == 0
    pool.resume(prefault=True)
    assert pool.resident_bytes() >= pool.nbytes  # every chunk populated whole
    assert not bool(pool._mem.tensor.any())  # contents gone, zero-filled
    assert [b.data_ptr() for b in pool.k_buffer] == ptrs and pool.regions() == regions


def test_a_plain_range_is_cut_every_target():
    mem = make_backend(5 << 20, torch.device("cpu"), chunk_bytes=2 << 20)
    base = mem.tensor.data_ptr()
    assert mem.plan == plan_range(5 << 20, host.GRANULARITY, 2 << 20)
    assert mem.regions() == [
        (base, 2 << 20),
        (base + (2 << 20), 2 << 20),
        (base + (4 << 20), 1 << 20),
    ]
    mem.tensor.fill_(7)
    mem.release()
    assert mem.resident_bytes() == 0
    mem.close()


def test_the_range_is_unmapped_once_the_last_view_goes(monkeypatch):
    unmapped = []
    real = host._munmap
    monkeypatch.setattr(host, "_munmap", lambda a, n: (unmapped.append((a, n)), real(a, n)))
    pool = kvmem.KVPool(SPEC, 301, chunk_bytes=TARGET)
    base = pool._mem.tensor.data_ptr()
    rng = weakref.ref(pool._mem._range)
    view = pool.k_buffer[2]
    pool.close()
    gc.collect()
    assert rng() is not None and _covered_rw(base, pool.plan.chunks[0].nbytes)  # kept
    del view
    gc.collect()
    assert rng() is None
    # the whole reservation went in one munmap (another mapping may take the addresses
    # at once, so /proc/self/maps cannot tell)
    assert (
        base,
        pool.plan.chunks[-1].offset + -(-pool.plan.chunks[-1].nbytes // host.PAGE) * host.PAGE,
    ) in unmapped


def test_a_64_gib_range_takes_no_memory_until_touched():
    """MAP_NORESERVE: the CUDA-shaped twin of a 64 GiB pool fits a machine with less
    memory; only what is touched becomes resident, and release gives it back."""
    spec = kvmem.KVSpec(num_layers=80, num_kv_heads=8, head_dim=128, page_size=16)
    pages = (64 << 30) // spec.page_bytes
    pool = kvmem.KVPool(spec, pages, chunk_bytes=2 << 30)
    try:
        assert pool.nbytes > 63 << 30 and len(pool.regions()) == 32
        assert pool.resident_bytes() == 0
        pool.k_buffer[79][pages - 1].fill_(1)
        assert 0 < pool.resident_bytes() <= host.GRANULARITY
        pool.release()
        assert pool.resident_bytes() == 0
    finally:
        pool.close()
