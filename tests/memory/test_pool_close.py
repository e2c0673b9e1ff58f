"""KVPool.close() and dropping a pool on the host backend: the memory and the mapping go
back at once, and a closed pool refuses every use.  (CUDA VMM: test_memory_cuda_vmm.py.)"""

from __future__ import annotations

import gc

import pytest
import torch

import kvmem
from kvmem.errors import ClosedPoolError
from tests.kv_cases import fill_random
from tests.util import assert_closed_pool_refuses, vm_rss

SPEC = kvmem.KVSpec(num_layers=4, num_kv_heads=4, head_dim=128, page_size=16, dtype=torch.bfloat16)
PAGES = 257  # about 32 MiB


def _mapped(addr: int) -> bool:
    """Whether ``addr`` lies in a mapping of this process (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def _filled_pool(layout="kvmem") -> kvmem.KVPool:
    pool = kvmem.KVPool(SPEC, PAGES, layout=layout)
    fill_random(pool._mem.tensor, torch.Generator().manual_seed(7))
    return pool


@pytest.mark.parametrize("layout", ["kvmem", "sglang"])
def test_close_gives_memory_and_mapping_back(layout):
    pool = _filled_pool(layout)
    addr = pool.k_buffer[0].data_ptr()
    rss = vm_rss()
    pool.close()
    assert rss - vm_rss() >= 0.95 * pool.nbytes
    gc.collect()
    assert not _mapped(addr)
    assert pool.closed and pool.released
    pool.close()  # idempotent


def test_close_with_a_view_held_elsewhere_frees_the_memory_then_the_mapping():
    pool = _filled_pool()
    view = pool.v_buffer[3]
    addr = view.data_ptr()
    rss = vm_rss()
    pool.close()
    assert rss - vm_rss() >= 0.95 * pool.nbytes  # the pages went back at once
    assert _mapped(addr)  # the address stays valid while a view can reach it ...
    del view
    gc.collect()
    assert not _mapped(addr)  # ... and goes with the last view


def test_closed_pool_refuses_every_use():
    pool = _filled_pool()
    ids = torch.tensor([1, 2])
    chunk = kvmem.pack_pages(pool, ids)
    pool.close()
    assert_closed_pool_refuses(pool, ids, chunk, check_live=pool.check_live)
    # a closed pool counts as released for code that only knows ReleasedPoolError
    assert issubclass(ClosedPoolError, kvmem.ReleasedPoolError)


def test_close_of_a_released_pool():
    pool = _filled_pool()
    addr = pool._mem.tensor.data_ptr()
    pool.release()
    pool.close()
    gc.collect()
    assert not _mapped(addr)


def test_dropped_pool_unmaps_its_range():
    pool = _filled_pool()
    kvmem.pack_pages(pool, torch.tensor([3, 4]))
    addr = pool._mem.tensor.data_ptr()
    rss = vm_rss()
    del pool
    gc.collect()
    assert not _mapped(addr)
    assert rss - vm_rss() >= 0.95 * SPEC.pool_bytes(PAGES)
