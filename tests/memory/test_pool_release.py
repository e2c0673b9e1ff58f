"""pool.release() / pool.resume() on the host backend: the physical effect, measured."""

from __future__ import annotations

import pytest
import torch

import kvmem
from tests.kv_cases import fill_random
from tests.util import vm_rss

SPEC = kvmem.KVSpec(num_layers=4, num_kv_heads=4, head_dim=128, page_size=16, dtype=torch.bfloat16)
PAGES = 513  # 4 layers x 2 x 513 pages x 16 KiB = 64 MiB


@pytest.fixture
def pool():
    p = kvmem.KVPool(SPEC, num_pages=PAGES)
    fill_random(p._mem.tensor, torch.Generator().manual_seed(5))
    return p


def _ptrs(pool):
    return [b.data_ptr() for b in pool.k_buffer + pool.v_buffer], pool.regions()


def test_release_returns_memory_and_keeps_addresses(pool):
    assert pool.backend == "host" and pool.can_release
    ptrs = _ptrs(pool)
    resident = pool.resident_bytes()
    assert resident >= pool.nbytes  # every page was touched by the fill
    rss = vm_rss()
    pool.release()
    assert pool.released and pool.epoch == 0
    assert pool.resident_bytes() <= 0.05 * pool.nbytes
    assert rss - vm_rss() >= 0.95 * pool.nbytes  # the process gave the pages back
    pool.resume(prefault=True)
    assert not pool.released and pool.epoch == 1
    assert pool.resident_bytes() >= pool.nbytes  # pre-faulted: all back, measured
    assert _ptrs(pool) == ptrs


def test_contents_are_gone_after_release(pool):
    """A private mapping's released pages come back zero-filled: the memory went back to
    the system (a shared mapping would only leave this process's RSS and keep them)."""
    assert bool(pool._mem.tensor.any())
    pool.release()
    pool.resume(prefault=False)
    assert pool.resident_bytes() <= 0.05 * pool.nbytes  # lazily faulted, not yet touched
    assert not bool(pool._mem.tensor.any())


def test_released_pool_refuses_every_entry_point(pool):
    ids = torch.tensor([1, 2])
    chunk = kvmem.pack_pages(pool, ids)
    pool.release()
    for call in (
        lambda: pool.k_buffer,
        lambda: pool.v_buffer,
        lambda: kvmem.pack_pages(pool, ids),
        lambda: kvmem.unpack_pages(chunk, pool, ids),
        lambda: pool.as_cupy(),
    ):
        with pytest.raises(kvmem.ReleasedPoolError, match=r"released \(epoch 0\).*resume\(\)"):
            call()
    assert pool.resident_bytes() <= 0.05 * pool.nbytes  # nothing touched the range
    pool.resume()
    kvmem.unpack_pages(chunk, pool, ids)
    assert torch.equal(kvmem.pack_pages(pool, ids), chunk)


def test_release_twice_and_resume_live_are_no_ops(pool):
    pool.resume()
    assert pool.epoch == 0 and not pool.released
    pool.release()
    pool.release()
    assert pool.released
    pool.resume()
    pool.resume()
    assert pool.epoch == 1 and not pool.released


def test_kernels_and_allocator_work_after_resume(pool):
    pool.release()
    pool.resume()
    alloc = kvmem.PageAllocator(num_pages=PAGES, page_size=SPEC.page_size)
    pages = alloc.alloc(5)
    src = torch.randint(0, 256, (kvmem.packed_nbytes(SPEC, 5),), dtype=torch.uint8)
    kvmem.unpack_pages(src, pool, pages)
    assert torch.equal(kvmem.pack_pages(pool, pages), src)
    alloc.free(pages)
    alloc.check_invariants()


def test_fifty_cycles_do_not_grow_rss(pool):
    ids = torch.arange(1, 33)
    chunk = torch.randint(0, 256, (kvmem.packed_nbytes(SPEC, 32),), dtype=torch.uint8)
    for cycle in range(50):
        pool.release()
        pool.resume(prefault=cycle % 2 == 0)
        kvmem.unpack_pages(chunk, pool, ids)
        if cycle == 4:
            base_rss = vm_rss()
    assert pool.epoch == 50
    # At most a few MiB of drift (allocator caches), never a pool's worth.
    assert vm_rss() - base_rss < 8 << 20
    assert torch.equal(kvmem.pack_pages(pool, ids), chunk)


def test_plain_backend_cannot_release():
    p = kvmem.KVPool(SPEC, num_pages=4, backend="plain")
    assert not p.can_release
    with pytest.raises(NotImplementedError, match="plain memory backend cannot release"):
        p.release()
    assert not p.released


def test_backend_device_mismatch_is_refused():
    with pytest.raises(ValueError, match="cuda_vmm backend needs a cuda device"):
        kvmem.KVPool(SPEC, num_pages=4, backend="cuda_vmm")
