"""KvmemTokenToKVPoolAllocator on CUDA (skipped without a GPU): the hot path makes no host
sync (torch's sync debug mode turns any into an error), and the slots equal those of
sglang's own allocator on the same device (its Triton kernels) and of the CPU run.
CPU twins: the same slots against sglang's allocator on the CPU
(``test_allocator_backend.py``), and a ``check=False`` double free raised at
``synchronize`` under the Triton interpreter (``tests/interpret/test_alloc_interpret.py``);
only the absence of a host sync needs a GPU."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.sglang.test_allocator_backend import ours, split, stock

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _on(device, size, ps, which):
    a = (ours if which == "kvmem" else stock)(size, ps)
    if device == "cpu":
        return a
    cls = type(a)
    if which == "kvmem":
        return cls(size, ps, torch.bfloat16, device, None, True)
    if ps == 1:
        return cls(size, torch.bfloat16, device, None, True)
    return cls(size, ps, torch.bfloat16, device, None, True)


class _NoSync:
    """Any host sync inside raises (torch.cuda.set_sync_debug_mode)."""

    def __enter__(self):
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")


def _sequence(a, ps, device, no_sync):
    """Allocs and sync-free frees; returns every alloc's slots (on the CPU)."""
    empty = torch.empty(0, dtype=torch.int32, device=device)
    outs = []

    def dev(rows):
        return [r.to(device) for r in rows]

    guard = _NoSync() if no_sync else contextlib.nullcontext()
    lens = [5, ps + 3, 2 * ps]
    with guard:
        out = extend_on(a, ps, [empty] * 3, lens, device)
    outs.append(out.cpu())
    rows = dev(split(out, lens))
    with guard:
        out = decode_on(a, ps, rows, device)
    outs.append(out.cpu())
    with guard:
        out = a.alloc(4 * ps)
        a.free_segments([(rows[0], 0)])
        a.free_segment(rows[1][ps:], start_pos=ps)
        a.free_page_ids(rows[2][::ps] // ps)
        a.free_group_begin()
        a.free_page_ids(out[::ps] // ps)
        a.free_group_end()
        avail = a.available_size()
    outs.append(out.cpu())
    return outs, avail


def extend_on(a, ps, rows, lens, device):
    if ps == 1:
        return a.alloc(sum(lens))
    pre_cpu = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    seq_cpu = pre_cpu + torch.tensor(lens, dtype=torch.int64)
    last = torch.tensor([-1] * len(rows), dtype=torch.int64, device=device)
    return a.alloc_extend(pre_cpu.to(device), pre_cpu, seq_cpu.to(device), seq_cpu, last, sum(lens))


def decode_on(a, ps, rows, device):
    if ps == 1:
        return a.alloc(len(rows))
    seq_cpu = torch.tensor([len(r) + 1 for r in rows], dtype=torch.int64)
    last = torch.stack([r[-1] for r in rows]).to(torch.int64)
    return a.alloc_decode(seq_cpu.to(device), seq_cpu, last)


@pytest.mark.parametrize("ps", [1, 16, 64])
def test_hot_path_has_no_host_sync_and_matches(ps):
    size = 64 * ps
    warm = _on("cuda", size, ps, "kvmem")
    _sequence(warm, ps, "cuda", no_sync=False)  # Triton compilation, caches
    mine = _on("cuda", size, ps, "kvmem")
    torch.cuda.synchronize()
    got, avail = _sequence(mine, ps, "cuda", no_sync=True)
    mine.synchronize()  # raises an error a check=False call left on the device
    mine.page_allocator.check_invariants()
    want, avail_cpu = _sequence(_on("cpu", size, ps, "kvmem"), ps, "cpu", no_sync=False)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert avail == avail_cpu
    theirs = _on("cuda", size, ps, "stock")
    stock_out, _ = _sequence(theirs, ps, "cuda", no_sync=False)
    assert all(torch.equal(g, w) for g, w in zip(got, stock_out))


def test_double_free_found_at_synchronize():
    from kvmem import DoubleFreeError

    a = _on("cuda", 16 * 16, 16, "kvmem")
    pages = a.alloc(4 * 16)[::16] // 16
    a.free_page_ids(pages[:2])
    # check=False: recorded on the device (a free of more pages than are allocated would
    # be refused at once instead, so this one frees fewer)
    a.free_page_ids(pages[:2])
    with pytest.raises(DoubleFreeError):
        a.synchronize()
    assert a.available_size() == 14 * 16  # pages[2:] still allocated, the rest free
    a.page_allocator.check_invariants()
