"""On a CUDA device (bench/gpu_check.sh): the allocator's Triton kernels, driven through
PageAllocator, give the same pages and slots as the CPU allocator for the same sequence
of calls, and the check=False device-flag path raises at the next synchronising call."""

from __future__ import annotations

import random

import pytest
import torch

import kvmem
from kvmem.errors import DoubleFreeError

DEV = torch.device("cuda")


def _same_calls(alloc_a, alloc_b, ps, seed, check):
    rng = random.Random(seed)
    held_a, held_b = [], []
    for _ in range(200):
        op = rng.random()
        if op < 0.3 and alloc_a.num_free:
            n = rng.randint(1, min(8, alloc_a.num_free))
            a, b = alloc_a.alloc(n, check=check), alloc_b.alloc(n, check=check)
            assert torch.equal(a.cpu(), b)
            held_a.append(a)
            held_b.append(b)
        elif op < 0.55 and held_a:
            i = rng.randrange(len(held_a))
            alloc_a.free(held_a.pop(i), check=check)
            alloc_b.free(held_b.pop(i), check=check)
        elif op < 0.85:
            bs = rng.randint(1, 6)
            seq = torch.tensor([rng.randint(1, 3 * ps) for _ in range(bs)], dtype=torch.int64)
            pre = torch.zeros(bs, dtype=torch.int64)
            last = torch.full((bs,), -1, dtype=torch.int64)
            need = int((-(-seq // ps)).sum())
            if need > alloc_a.num_free:
                continue
            kw = dict(
                prefix_lens_cpu=pre, seq_lens_cpu=seq, extend_num_tokens=int(seq.sum()), check=check
            )
            a = alloc_a.alloc_extend(pre.to(DEV), seq.to(DEV), last.to(DEV), **kw)
            b = alloc_b.alloc_extend(pre, seq, last, **kw)
            assert torch.equal(a.cpu(), b)
            pages = torch.unique(b // ps)
            held_a.append(pages.to(DEV))
            held_b.append(pages)
        else:
            alloc_a.check_invariants()
            alloc_b.check_invariants()
    alloc_a.check_invariants()


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("ps", [1, 16, 64])
def test_cuda_allocator_matches_cpu(ps, check):
    _same_calls(kvmem.PageAllocator(257, ps, DEV), kvmem.PageAllocator(257, ps), ps, ps, check)


def test_alloc_decode_matches_cpu():
    for ps in (1, 16):
        a, b = kvmem.PageAllocator(65, ps, DEV), kvmem.PageAllocator(65, ps)
        seq = torch.tensor([1, 2, ps + 1, 3], dtype=torch.int64)
        pre, last = torch.zeros(4, dtype=torch.int64), torch.full((4,), -1, dtype=torch.int64)
        kw = dict(prefix_lens_cpu=pre, seq_lens_cpu=seq - 1, extend_num_tokens=int((seq - 1).sum()))
        sa = a.alloc_extend(pre.to(DEV), (seq - 1).to(DEV), last.to(DEV), **kw)
        sb = b.alloc_extend(pre, seq - 1, last, **kw)
        assert torch.equal(sa.cpu(), sb)
        ends = torch.cumsum(seq - 1, 0)
        last = torch.where(seq > 1, sb[(ends - 1).clamp(min=0)], torch.full_like(seq, -1))
        da = a.alloc_decode(seq.to(DEV), last.to(DEV), seq_lens_cpu=seq, check=False)
        db = b.alloc_decode(seq, last, seq_lens_cpu=seq)
        assert torch.equal(da.cpu(), db)
        a.check_invariants()


def test_unchecked_double_free_raised_at_next_sync():
    alloc = kvmem.PageAllocator(33, 16, DEV)
    pages = alloc.alloc(4)
    alloc.free(pages[:2], check=False)
    alloc.free(pages[:1], check=False)  # page freed twice: found on the device
    with pytest.raises(DoubleFreeError, match="rebuilt from the ownership map"):
        alloc.synchronize()
    alloc.check_invariants()
    assert alloc.num_allocated == 2  # the bad call changed nothing
    alloc.free(pages[2:])
    assert alloc.num_allocated == 0


def test_checked_errors_leave_state_unchanged():
    alloc = kvmem.PageAllocator(9, 4, DEV)
    pages = alloc.alloc(3)
    with pytest.raises(kvmem.OutOfPagesError):
        alloc.alloc(6)
    with pytest.raises(DoubleFreeError):
        alloc.free(torch.tensor([int(pages[0]), 0], device=DEV))
    alloc.check_invariants()
    assert alloc.num_allocated == 3
