"""On a CUDA device (bench/gpu_check.sh): the cuda_vmm backend's partial failures and
lifetime against the real driver, measured with ``torch.cuda.mem_get_info``.

- A resume under memory pressure from another allocation fails with PoolMemoryError,
  gives back what it had mapped, and succeeds once the other allocation is freed.
- An unmap that fails half-way (one driver call made to fail by a forwarding driver) maps
  the unmapped chunks back with their memory: the pool's contents survive.
- A dropped pool, and a closed one, give their memory back.

The same logic on CPU against a fake driver: tests/memory/test_cuda_vmm_fake_driver.py.
"""

from __future__ import annotations

import gc

import pytest
import torch

import kvmem
from kvmem.errors import ClosedPoolError, CudaDriverError, PoolMemoryError, ReleasedPoolError
from kvmem.memory.cuda_driver import default_driver
from kvmem.memory.cuda_vmm import CudaVmmBackend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = torch.device("cuda")
MiB = 1 << 20
CHUNK = 512 * MiB
SPEC = kvmem.KVSpec(num_layers=8, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
# 8 layers x (K + V) x 32 KiB: 512 KiB a page; 8192 pages = 4 GiB = 8 chunks of 512 MiB
PAGES = 8192


def _free_bytes() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def _pool(driver=None, pages: int = PAGES) -> kvmem.KVPool:
    return kvmem.KVPool(
        SPEC, pages, DEV, backend=CudaVmmBackend.factory(driver=driver, chunk_bytes=CHUNK)
    )


def _fill(pool: kvmem.KVPool, step: int = 16):
    """Write random bytes into every ``step``-th page (so every chunk holds some)."""
    ids = torch.arange(1, pool.num_pages, step, device=DEV)
    chunk = torch.randint(
        0,
        256,
        (kvmem.packed_nbytes(SPEC, len(ids)),),
        dtype=torch.uint8,
        device=DEV,
        generator=torch.Generator(DEV).manual_seed(1),
    )
    kvmem.unpack_pages(chunk, pool, ids)
    return ids, chunk


class _FailOnce:
    """Forwards to the real driver, except that the ``nth`` call of ``name`` returns
    ``code`` without reaching the driver."""

    def __init__(self, real, name: str, nth: int):
        self._real, self._name, self._nth, self.calls = real, name, nth, 0
        self.code = real.CUresult.CUDA_ERROR_UNKNOWN

    def __getattr__(self, attr):
        fn = getattr(self._real, attr)
        if attr != self._name:
            return fn

        def call(*args):
            self.calls += 1
            if self.calls == self._nth:
                return (self.code,)
            return fn(*args)

        return call


def test_resume_under_memory_pressure_then_retry():
    pool = _pool()
    assert len(pool.regions()) == 8
    ptrs = [b.data_ptr() for b in pool.k_buffer + pool.v_buffer]
    pool.release()
    assert pool.resident_bytes() == 0
    free = _free_bytes()
    # another allocation leaves room for about 5.5 of the pool's 8 chunks
    hog = torch.empty(free - 11 * CHUNK // 2, dtype=torch.uint8, device=DEV)
    pressured = _free_bytes()
    for _ in range(2):  # a retry under the same pressure fails the same clear way
        with pytest.raises(
            PoolMemoryError,
            match=r"CUDA_ERROR_OUT_OF_MEMORY.*chunk [2-8] of 8"
            r".*were unmapped and released again",
        ):
            pool.resume()
        assert pool.released and pool.epoch == 0 and pool.resident_bytes() == 0
        assert _free_bytes() >= pressured - 64 * MiB  # what it had mapped went back
        with pytest.raises(ReleasedPoolError):
            pool.k_buffer
    del hog
    _free_bytes()
    pool.resume()
    assert not pool.released and pool.epoch == 1 and pool.resident_bytes() >= pool.nbytes
    assert [b.data_ptr() for b in pool.k_buffer + pool.v_buffer] == ptrs
    ids, chunk = _fill(pool)
    assert torch.equal(kvmem.pack_pages(pool, ids), chunk)
    pool.close()


def test_unmap_failing_half_way_keeps_the_pool_and_its_contents():
    drv = _FailOnce(default_driver(), "cuMemUnmap", nth=4)
    pool = _pool(drv)
    ids, chunk = _fill(pool)
    with pytest.raises(
        CudaDriverError,
        match=r"cuMemUnmap failed: CUDA_ERROR_UNKNOWN.*"
        r"at chunk 4 of 8; the 3 chunk\(s\) this call had changed were mapped back",
    ):
        pool.release()
    assert not pool.released and pool.resident_bytes() >= pool.nbytes
    assert torch.equal(kvmem.pack_pages(pool, ids), chunk)  # same memory, same bytes
    free = _free_bytes()
    pool.release()  # the retry completes
    assert pool.released and _free_bytes() - free >= 0.95 * pool.nbytes
    pool.close()


def test_dropped_pool_gives_its_memory_back():
    free = _free_bytes()
    for _ in range(3):
        pool = _pool(pages=2049)  # about 1 GiB: 3 chunks
        _fill(pool)
        assert free - _free_bytes() >= 0.95 * pool.nbytes
        del pool
        assert _free_bytes() >= free - 64 * MiB  # freed, not leaked by a reference cycle


def test_close_gives_memory_back_and_refuses_use():
    free = _free_bytes()
    pool = _pool(pages=2049)
    ids, _ = _fill(pool)
    view = pool.k_buffer[0]  # held elsewhere: close() frees anyway (it must not be used)
    pool.close()
    assert _free_bytes() >= free - 64 * MiB
    pool.close()
    with pytest.raises(ClosedPoolError):
        kvmem.pack_pages(pool, ids)
    with pytest.raises(ClosedPoolError):
        pool.resume()
    del view
    assert _free_bytes() >= free - 64 * MiB
