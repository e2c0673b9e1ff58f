"""The need_sort order on a CUDA allocator (skipped without CUDA): the sort of the free
list when the sorted part runs short is torch ops on the device, and check=False calls
around it make no host sync; the pages handed out are the CPU allocator's."""

from __future__ import annotations

import pytest
import torch

from kvmem.allocator import PageAllocator

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"
)  # tests/gpu: bench/gpu_check.sh


def _sequence(device: str, no_sync: bool) -> list[torch.Tensor]:
    a = PageAllocator(65, 16, device)
    outs = []
    order = torch.randperm(60, generator=torch.Generator().manual_seed(0)).to(device)
    if no_sync:
        torch.cuda.set_sync_debug_mode("error")
    try:
        held = a.alloc(60, check=False)  # 4 sorted pages left
        a.free(held.index_select(0, order[:50]), check=False)  # staged, scrambled
        outs.append(a.alloc(30, check=False))  # 30 > 4: the free list is sorted first
        outs.append(a.alloc(10, check=False))  # from the sorted part
        a.free(outs[0][::2], check=False)
        outs.append(a.alloc(20, check=False))  # short again, the live entries wrap
    finally:
        if no_sync:
            torch.cuda.set_sync_debug_mode("default")
    a.synchronize()
    a.check_invariants()
    return [o.cpu() for o in outs]


def test_sort_on_the_device_has_no_host_sync_and_matches_cpu():
    _sequence("cuda", no_sync=False)  # warm-up: Triton compilation, caches
    torch.cuda.synchronize()
    got = _sequence("cuda", no_sync=True)
    want = _sequence("cpu", no_sync=False)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    for g in got:
        assert bool((g[1:] > g[:-1]).all())  # every call's pages ascend
