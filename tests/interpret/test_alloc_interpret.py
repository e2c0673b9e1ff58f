"""The allocator's Triton kernels on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1 KVMEM_FORCE_TRITON=1``): kernels against the ``*_ref``
references, the allocator driven through them against the torch path, and the
check=False device-flag path (errors recorded on the device, raised at the next
synchronising call, state rebuilt).  Tiny grids: the interpreter is slow."""

from __future__ import annotations

import random

import pytest
import torch

from kvmem.allocator import PageAllocator
from kvmem.errors import AllocCode, DoubleFreeError, KVMemError
from kvmem.kernels import alloc as K
from kvmem.kernels.alloc import triton as alloc_triton


def i64(*xs):
    return torch.tensor(xs, dtype=torch.int64)


def fresh_err():
    return i64(0, 0, K.NO_BAD, K.NO_BAD)


# -- kernels against the references ----------------------------------------------------


@pytest.mark.parametrize("flag", [False, True])
@pytest.mark.parametrize("head,n", [(0, 3), (5, 6), (7, 8)])
def test_take_pages_kernel(head, n, flag):
    ring = torch.randperm(8, generator=torch.Generator().manual_seed(n)) + 1
    owned = torch.zeros(9, dtype=torch.int32)
    err = fresh_err()
    want_pages, want_owned = K.take_pages_ref(ring, owned, head, n)
    got = K.take_pages_triton(ring, owned, err, head, n, flag=flag)
    assert torch.equal(got, want_pages) and torch.equal(owned, want_owned)
    assert torch.equal(err, fresh_err())


def test_take_pages_kernel_flags_an_owned_page():
    ring, owned, err = i64(3, 1, 2), torch.tensor([0, 0, 1, 0], dtype=torch.int32), fresh_err()
    K.take_pages_triton(ring, owned, err, 0, 3, flag=True)
    assert err[:2].tolist() == [AllocCode.ERR_TAKE_OWNED, 2]


BATCHES = {  # (prefix_lens, seq_lens) as functions of page_size
    "fresh": lambda P: ([0, 0, 0], [1, P, 2 * P + 1]),
    "mid_page": lambda P: ([P + 1, 1, 2 * P - 1], [3 * P + 2, P, 2 * P]),
    "empty_and_boundaries": lambda P: ([3, P, 0, 2 * P], [3, 3 * P, 0, 2 * P + 1]),
}


def _last_locs(pre, ps):
    return [(7 + i) * ps + (p - 1) % ps if p > 0 else -1 for i, p in enumerate(pre)]


@pytest.mark.parametrize("flag", [False, True])
@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("ps", [1, 4, 16], ids=lambda p: f"P{p}")
def test_extend_slots_kernel(ps, kind, flag):
    pre, seq = BATCHES[kind](ps)
    dtype = torch.int32 if flag else torch.int64
    t = lambda x: torch.tensor(x, dtype=dtype)  # noqa: E731
    num_new, total = (int(v) for v in K.extend_counts(t(pre), t(seq), ps))
    new_pages = torch.randperm(60, generator=torch.Generator().manual_seed(1))[:num_new] + 1
    err = fresh_err()
    want = K.extend_slots_ref(t(pre), t(seq), t(_last_locs(pre, ps)), new_pages, ps)
    got = K.extend_slots_triton(
        t(pre), t(seq), t(_last_locs(pre, ps)), new_pages, ps, total, err, flag=flag
    )
    assert torch.equal(got, want)
    assert torch.equal(err, fresh_err())


@pytest.mark.parametrize("flag", [False, True])
@pytest.mark.parametrize("ps", [1, 4], ids=lambda p: f"P{p}")
def test_decode_slots_kernel(ps, flag):
    seq = [1, 2, ps + 1, 3 * ps, 2 * ps + 1, 7, 5 * ps + 1]
    last = [(9 + i) * ps + (s - 2) % ps for i, s in enumerate(seq)]
    num_new = int(K.decode_counts(i64(*seq), ps))
    new_pages = torch.randperm(40, generator=torch.Generator().manual_seed(2))[:num_new] + 1
    err = fresh_err()
    want = K.decode_slots_ref(i64(*seq), i64(*last), new_pages, ps)
    got = K.decode_slots_triton(i64(*seq), i64(*last), new_pages, ps, err, flag=flag)
    assert torch.equal(got, want) and torch.equal(err, fresh_err())


def test_decode_slots_kernel_many_programs(monkeypatch):
    """More requests than one program holds: the rank carries across programs."""
    monkeypatch.setattr(alloc_triton, "DECODE_BLOCK", 4)
    seq = [1, 3, 5, 2, 9, 4, 1, 5, 6, 13, 2]
    last = [(9 + i) * 4 + (s - 2) % 4 for i, s in enumerate(seq)]
    num_new = int(K.decode_counts(i64(*seq), 4))
    new_pages = torch.arange(num_new) + 30
    err = fresh_err()
    got = K.decode_slots_triton(i64(*seq), i64(*last), new_pages, 4, err, flag=True)
    assert torch.equal(got, K.decode_slots_ref(i64(*seq), i64(*last), new_pages, 4))
    assert torch.equal(err, fresh_err())


def test_extend_slots_kernel_long_batch(monkeypatch):
    """Prefix sums over more requests than REQ_BLOCK, and extends longer than
    TOKEN_BLOCK: the kernels' loops, with small blocks."""
    monkeypatch.setattr(alloc_triton, "REQ_BLOCK", 4)
    monkeypatch.setattr(alloc_triton, "TOKEN_BLOCK", 8)
    rng = random.Random(3)
    pre = [rng.randrange(0, 12) for _ in range(11)]
    seq = [p + rng.randrange(0, 20) for p in pre]
    last = _last_locs(pre, 4)
    num_new, total = (int(v) for v in K.extend_counts(i64(*pre), i64(*seq), 4))
    new_pages = torch.arange(num_new) + 50
    err = fresh_err()
    got = K.extend_slots_triton(
        i64(*pre), i64(*seq), i64(*last), new_pages, 4, total, err, flag=True
    )
    assert torch.equal(got, K.extend_slots_ref(i64(*pre), i64(*seq), i64(*last), new_pages, 4))
    assert torch.equal(err, fresh_err())


@pytest.mark.parametrize("pages", [[3], [5, 3, 1], [8, 7, 6, 5, 4, 3, 1]], ids=str)
@pytest.mark.parametrize("tail", [0, 6])
@pytest.mark.parametrize("flag", [False, True])
def test_free_kernels_clean(pages, tail, flag):
    owned = torch.tensor([0, 1, 0, 1, 1, 1, 1, 1, 1], dtype=torch.int32)
    ring = torch.arange(100, 108)
    want_ring, want_owned = K.free_pages_ref(pages, ring, owned, tail)
    err = fresh_err()
    K.free_pages_triton(
        torch.tensor(pages, dtype=torch.int32), ring, owned, err, tail, 0, flag=flag
    )
    assert torch.equal(ring, want_ring) and torch.equal(owned, want_owned)
    assert torch.equal(err, fresh_err())


@pytest.mark.parametrize(
    "pages,code,page",
    [
        ([3, 5, 2], AllocCode.ERR_FREE_NOT_ALLOCATED_OR_TWICE, 2),
        ([3, 5, 3], AllocCode.ERR_FREE_NOT_ALLOCATED_OR_TWICE, 3),
        ([4, 0], AllocCode.FREE_PAGE_ZERO, 0),
        ([9, 4], AllocCode.FREE_OUT_OF_RANGE, 9),
    ],
    ids=str,
)
@pytest.mark.parametrize("parity", [0, 1])
def test_free_kernels_undo_a_bad_call(pages, code, page, parity):
    owned = torch.tensor([0, 1, 0, 1, 1, 1, 1, 1, 1], dtype=torch.int32)
    ring = torch.arange(100, 108)
    owned_before = owned.clone()
    err = fresh_err()
    err[2 + (1 - parity)] = 4  # left by an earlier bad free: cleared for the next one
    K.free_pages_triton(i64(*pages), ring, owned, err, 6, parity, flag=True)
    assert torch.equal(owned, owned_before)  # nothing freed
    want_ring = torch.arange(100, 108)
    want_ring[[(6 + i) % 8 for i in range(len(pages))]] = 0  # the call's slots zeroed
    assert torch.equal(ring, want_ring)
    assert err[:2].tolist() == [code, page]
    assert err[2 + (1 - parity)].item() == K.NO_BAD


# -- the allocator on the Triton path --------------------------------------------------


def _drive(a: PageAllocator, check: bool):
    """A fixed sequence of calls; returns everything they returned."""
    out = []
    out.append(a.alloc(3, check=check))
    out.append(
        a.alloc_extend(
            i64(0, 0, 0),
            i64(5, 4, 0),
            i64(-1, -1, -1),
            prefix_lens_cpu=i64(0, 0, 0),
            seq_lens_cpu=i64(5, 4, 0),
            check=check,
        )
    )
    a.free(out[0][1:], check=check)
    out.append(
        a.alloc_decode(
            i64(6, 5), i64(out[1][4].item(), out[1][8].item()), seq_lens_cpu=i64(6, 5), check=check
        )
    )
    with a.free_group():  # request 1's pages, and the first page alloc gave
        a.free([out[0][0].item()], check=check)
        a.free(torch.unique(out[1][5:9] // 4), check=check)
        a.free(out[2][1:] // 4, check=check)
    out.append(a.alloc_extend(i64(6), i64(13), i64(out[2][0].item()), check=check))
    out.append(a.alloc(4, check=check))
    a.synchronize()
    a.check_invariants()
    out.append(a._ring.clone())
    out.append(a._owned.clone())
    return out


@pytest.mark.parametrize("check", [True, False])
def test_allocator_triton_path_matches_torch_path(check, monkeypatch):
    got = _drive(PageAllocator(12, 4), check)
    monkeypatch.setenv("KVMEM_FORCE_TRITON", "0")  # the torch path, same process
    want = _drive(PageAllocator(12, 4), check)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def _with_allocated(n=6, num_pages=9, ps=4):
    a = PageAllocator(num_pages, ps)
    pages = a.alloc(n)
    return a, pages


def test_check_false_double_free_raised_at_synchronize():
    a, pages = _with_allocated()
    a.free(pages[:2], check=False)
    a.free(i64(5, 2), check=False)  # 2 is free already: the call is undone on the device
    assert a.num_free == 6  # the host counted the refused free too
    with pytest.raises(DoubleFreeError) as e:
        a.synchronize()
    assert e.value.page == 2 and "rebuilt from the ownership map" in str(e.value)
    assert (a.num_free, a.num_allocated) == (4, 4)  # 5 is still allocated
    assert a._owned.tolist() == [0, 0, 0, 1, 1, 1, 1, 0, 0]
    a.check_invariants()
    a.synchronize()  # raised once
    assert sorted(a.alloc(4).tolist()) == [1, 2, 7, 8]


def test_check_false_error_raised_by_next_checked_call_and_first_error_wins():
    a, pages = _with_allocated()
    a.free(i64(3, 3), check=False)  # listed twice
    # 4 > the 2 sorted pages left (7, 8): the free list is sorted first, so the two ring
    # slots the refused free zeroed come first
    got = a.alloc(4, check=False)
    assert got.tolist() == [0, 0, 7, 8]  # unreliable until the error is raised
    with pytest.raises(DoubleFreeError) as e:
        a.alloc(1)  # check=True: synchronising; the first error is the one raised
    assert e.value.page == 3 and "listed twice" in e.value.reason
    a.check_invariants()
    assert a.num_allocated == 8  # 1-6 and 7, 8; page 0 never
    a.free(pages)
    a.check_invariants()


@pytest.mark.parametrize("bad,page,reason", [(0, 0, "page 0"), (9, 9, "out of range")])
def test_check_false_bad_page_ids(bad, page, reason):
    a, pages = _with_allocated()
    a.free(i64(1, bad, 2), check=False)
    with pytest.raises(DoubleFreeError) as e:
        a.check_invariants()
    assert e.value.page == page and reason in e.value.reason
    assert a.num_allocated == 6
    a.check_invariants()


def test_check_false_free_group_is_one_device_checked_free():
    a, pages = _with_allocated()
    with a.free_group():
        a.free(pages[:2], check=False)
        a.free(torch.tensor([4, 2], dtype=torch.int32), check=False)  # 2 twice in the group
    assert a.num_free == 6  # counted, not yet checked
    with pytest.raises(DoubleFreeError) as e:
        a.synchronize()
    assert e.value.page == 2
    assert a.num_allocated == 6  # nothing of the group was freed
    with a.free_group():
        a.free(pages[:2], check=False)
        a.free(pages[3:], check=False)
    a.synchronize()
    assert a.num_allocated == 1 and a._owned[3].item() == 1
    a.check_invariants()


def test_check_false_free_overflowing_the_ring_is_checked_at_once():
    a, pages = _with_allocated(n=2)
    with pytest.raises(DoubleFreeError):
        a.free(i64(1, 2, 3, 4, 5, 6, 7), check=False)  # more than are allocated
    assert a.num_allocated == 2
    a.check_invariants()


def test_check_false_extend_with_wrong_hints_raised_at_synchronize():
    a = PageAllocator(9, 4)
    out = a.alloc_extend(
        i64(0, 0),
        i64(5, 4),
        i64(-1, -1),
        prefix_lens_cpu=i64(0, 0),
        seq_lens_cpu=i64(5, 3),
        check=False,
    )  # 8 tokens, not 9
    assert out.numel() == 8  # sized by the (wrong) hints
    with pytest.raises(ValueError, match="disagree with the device lengths"):
        a.synchronize()
    assert a.num_allocated == 3  # the pages it took stay allocated
    a.check_invariants()


def test_check_false_decode_bad_last_loc_raised_at_synchronize():
    a = PageAllocator(9, 4)
    a.alloc_extend(i64(0), i64(3), i64(-1))  # slots 4, 5, 6
    a.alloc_decode(i64(4), i64(7), seq_lens_cpu=i64(4), check=False)  # last_loc must be 6
    with pytest.raises(ValueError, match=r"request 0\); found on the device"):
        a.synchronize()
    a.check_invariants()


def test_check_false_decode_with_wrong_hint_raised_at_synchronize():
    a = PageAllocator(9, 4)
    a.alloc_extend(i64(0, 0), i64(3, 4), i64(-1, -1))  # slots 4-6 and 8-11
    # request 1 starts a page (seq_len 5); the hint says it does not: no page taken
    out = a.alloc_decode(i64(4, 5), i64(6, 11), seq_lens_cpu=i64(4, 6), check=False)
    assert out[0].item() == 7
    with pytest.raises(ValueError, match=r"seq_lens_cpu disagrees with seq_lens \(request 1\)"):
        a.synchronize()
    a.check_invariants()
    assert a.num_allocated == 2


def test_check_false_extend_bad_lengths_raised_at_synchronize():
    a = PageAllocator(9, 4)
    a.alloc_extend(i64(5), i64(3), i64(8), prefix_lens_cpu=i64(0), seq_lens_cpu=i64(0), check=False)
    with pytest.raises(ValueError, match=r"prefix_len > seq_len \(request 0\)"):
        a.synchronize()
    a.check_invariants()


def test_check_false_take_of_an_owned_page_is_flagged():
    a, _ = _with_allocated(n=2)
    a._ring[a._head] = 1  # corrupt the free list: page 1 is allocated
    a.alloc(1, check=False)
    with pytest.raises(KVMemError, match="allocated already"):
        a.synchronize()
    a.check_invariants()
    assert a.num_allocated == 2
