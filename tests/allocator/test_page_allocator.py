"""PageAllocator on CPU: behaviour, every error with the state unchanged afterwards,
free_group, reset, page 0, and the CPU implementations of kvmem.kernels.alloc against
their plain references (torch.equal) over page_size 1/16/64 and odd batches."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

import kvmem
from kvmem.allocator import PageAllocator
from kvmem.errors import AllocCode, DoubleFreeError, OutOfPagesError, alloc_error
from kvmem.kernels import alloc as K
from kvmem.kernels.alloc import triton as alloc_triton

# -- helpers ---------------------------------------------------------------------------


def snapshot(a: PageAllocator):
    return (
        a._ring.clone(),
        a._owned.clone(),
        a._err.clone(),
        a._head,
        a._count,
        a._sorted,
        a._allocated,
        a.num_free,
        a.num_allocated,
    )


def assert_same(a: PageAllocator, snap):
    now = snapshot(a)
    for x, y in zip(now, snap):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y)
        else:
            assert x == y
    a.check_invariants()


def i64(*xs):
    return torch.tensor(xs, dtype=torch.int64)


# -- construction, alloc ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_pages=1, page_size=4),
        dict(num_pages=0, page_size=4),
        dict(num_pages=9, page_size=0),
        dict(num_pages=9.0, page_size=4),
        dict(num_pages=9, page_size=True),
    ],
)
def test_bad_construction(kwargs):
    with pytest.raises(ValueError):
        PageAllocator(**kwargs)


def test_public_name():
    assert kvmem.PageAllocator is PageAllocator


def test_kvmem_source_never_imports_sglang():
    import pathlib
    import re

    root = pathlib.Path(kvmem.__file__).parent
    pattern = re.compile(r"^\s*(import|from)\s+sglang\b", re.M)
    offenders = [str(f) for f in root.rglob("*.py") if pattern.search(f.read_text())]
    assert not offenders


def test_fresh_order_and_page_zero():
    a = PageAllocator(num_pages=9, page_size=4)
    assert (a.num_free, a.num_allocated) == (8, 0)
    assert torch.equal(a.alloc(3), i64(1, 2, 3))
    assert torch.equal(a.alloc(5), i64(4, 5, 6, 7, 8))  # all of them; never page 0
    assert (a.num_free, a.num_allocated) == (0, 8)
    assert int(a._owned[0]) == 0
    a.check_invariants()


def test_alloc_zero_negative_and_type():
    a = PageAllocator(num_pages=5, page_size=2)
    empty = a.alloc(0)
    assert empty.dtype == torch.int64 and empty.numel() == 0
    snap = snapshot(a)
    for bad in (-1, 1.5, "2", None):
        with pytest.raises(ValueError):
            a.alloc(bad)
    assert_same(a, snap)
    assert a.alloc(np.int64(2)).tolist() == [1, 2]


def test_alloc_returns_a_copy():
    a = PageAllocator(num_pages=5, page_size=2)
    p = a.alloc(2)
    p += 100  # the caller's tensor is its own
    assert torch.equal(a._ring, i64(1, 2, 3, 4))
    p2 = a.alloc(2)
    a.free(p2)
    a.free([1, 2])
    assert p2.tolist() == [3, 4]  # ring slots were rewritten; the result is unchanged
    a.check_invariants()


def test_out_of_pages_changes_nothing():
    a = PageAllocator(num_pages=9, page_size=4)
    a.alloc(5)
    a.free([2, 4])
    snap = snapshot(a)
    with pytest.raises(OutOfPagesError) as e:
        a.alloc(6)
    assert (e.value.requested, e.value.available) == (6, 5)
    assert "6" in str(e.value) and "5" in str(e.value)
    assert_same(a, snap)
    assert a.alloc(5).tolist() == [2, 4, 6, 7, 8]  # sorted when the sorted part ran short


# -- free ------------------------------------------------------------------------------


def test_free_staged_until_sorted_part_runs_short():
    """sglang's need_sort order: freed pages wait (staged) until a call needs more than
    the sorted part holds; then every free page is sorted, so requests get ascending
    pages and runs of consecutive ones."""
    a = PageAllocator(num_pages=9, page_size=4)
    assert a.alloc(3).tolist() == [1, 2, 3]
    a.free(i64(2))  # staged at the ring's tail, which wraps to slot 0
    a.free([3, 1])
    assert a._sorted == 5 and a.num_free == 8
    assert a.alloc(5).tolist() == [4, 5, 6, 7, 8]  # the sorted part, no sort
    a.check_invariants()
    assert a.alloc(2).tolist() == [1, 2]  # short: sort [2, 3, 1]
    a.free(i64(7, 5))
    a.free(torch.tensor([8], dtype=torch.int32))
    a.free(np.array([1, 4]))
    assert a.alloc(5).tolist() == [1, 3, 4, 5, 7]  # [3] and the staged five, sorted
    a.check_invariants()


def test_sort_of_a_free_list_that_wraps():
    a = PageAllocator(num_pages=9, page_size=4)
    a.alloc(6)  # head 6: the sorted part [7, 8] sits at the ring's end
    a.free([5, 1, 3])  # staged in slots 0..2: the live entries wrap
    assert a.alloc(4).tolist() == [1, 3, 5, 7]
    assert a.alloc(1).tolist() == [8]
    a.check_invariants()


def test_runs_after_frees():
    """After interleaved frees a request's pages are runs where free pages are
    adjacent (FIFO reuse handed out [6, 2, 8, 4, 5, 3, 7] here)."""
    a = PageAllocator(num_pages=9, page_size=1)
    a.alloc(8)
    for p in ([6], [2], [8], [4, 5], [3], [7]):
        a.free(p)
    assert a.alloc(7).tolist() == [2, 3, 4, 5, 6, 7, 8]


@pytest.mark.parametrize(
    "pages,first,reason",
    [
        ([3, 0], 0, "page 0"),
        ([3, 9], 9, "out of range"),
        ([3, -1, 9], -1, "out of range"),
        ([3, 5, 6], 5, "not allocated"),
        ([3, 2, 3], 3, "listed twice"),
        ([3, 6, 6, 0], 6, "not allocated"),  # first offending entry in list order
        ([2, 3, 4, 4], 4, "listed twice"),
    ],
)
def test_free_refused_frees_nothing(pages, first, reason):
    a = PageAllocator(num_pages=9, page_size=4)
    a.alloc(4)
    a.free([1])
    snap = snapshot(a)
    for form in (pages, i64(*pages), torch.tensor(pages, dtype=torch.int32), np.array(pages)):
        with pytest.raises(DoubleFreeError) as e:
            a.free(form)
        assert e.value.page == first and reason in e.value.reason
        assert str(first) in str(e.value) and "nothing was freed" in str(e.value)
        assert_same(a, snap)


def test_double_free_across_calls():
    a = PageAllocator(num_pages=9, page_size=4)
    p = a.alloc(3)
    a.free(p[1:])
    snap = snapshot(a)
    with pytest.raises(DoubleFreeError) as e:
        a.free(p)
    assert e.value.page == 2
    assert_same(a, snap)


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros(2, 2, dtype=torch.int64),
        torch.tensor([1.0]),
        torch.tensor([True]),
        torch.tensor([1], device="meta"),
        "12",
        3,
        [1.5],
        np.array([[1]]),
        # short lists: the Python path hands them on, refused there
        [True],
        [1, False],
        [np.int64(1), 2.0],
    ],
)
def test_free_bad_input_is_valueerror(bad):
    a = PageAllocator(num_pages=5, page_size=2)
    a.alloc(2)
    snap = snapshot(a)
    with pytest.raises(ValueError):
        a.free(bad)
    assert_same(a, snap)


def test_free_empty_and_check_false_on_cpu_still_checks():
    a = PageAllocator(num_pages=5, page_size=2)
    a.alloc(2)
    a.free([])
    a.free(torch.empty(0, dtype=torch.int64))
    snap = snapshot(a)
    with pytest.raises(DoubleFreeError):
        a.free([3], check=False)  # CPU torch path: the checks always run
    assert_same(a, snap)
    a.free([2], check=False)
    assert a.num_free == 3


# -- free_group ------------------------------------------------------------------------


def test_free_group_applies_once_at_exit():
    a = PageAllocator(num_pages=9, page_size=4)
    p = a.alloc(6)
    with a.free_group() as g:
        assert g is a
        a.free(p[:2])
        a.free([5])
        assert a.num_free == 2  # nothing applied yet
        with a.free_group():  # nested: applied at the outermost exit
            a.free(p[2:3])
        assert a.num_free == 2
    assert a.num_free == 6
    assert a.alloc(6).tolist() == [1, 2, 3, 5, 7, 8]  # short: every free page sorted
    a.check_invariants()


def test_free_group_keeps_its_own_copy():
    a = PageAllocator(num_pages=9, page_size=4)
    p = a.alloc(4)
    with a.free_group():
        a.free(p[:2])
        p[:2] = torch.tensor([3, 4])  # the caller reuses its tensor
    assert a.num_free == 6 and a.alloc(6).tolist() == [1, 2, 5, 6, 7, 8]


def test_free_group_applies_when_body_raises():
    a = PageAllocator(num_pages=9, page_size=4)
    p = a.alloc(4)
    with pytest.raises(KeyError):
        with a.free_group():
            a.free(p[:3])
            raise KeyError("body failed")
    assert a.num_free == 7  # no leak
    a.check_invariants()


def test_free_group_error_frees_nothing():
    a = PageAllocator(num_pages=9, page_size=4)
    p = a.alloc(4)
    snap = snapshot(a)
    with pytest.raises(DoubleFreeError) as e:
        with a.free_group():
            a.free(p[:2])
            a.free([4, 2])  # 2 a second time in the group
    assert e.value.page == 2 and "twice" in e.value.reason
    assert_same(a, snap)
    assert a._group is None
    # also when the body raised: the DoubleFreeError wins, the body's error is its context
    with pytest.raises(DoubleFreeError) as e:
        with a.free_group():
            a.free([1, 7])
            raise KeyError("body failed")
    assert isinstance(e.value.__context__, KeyError)
    assert_same(a, snap)


def test_reset_inside_group_drops_collected_frees():
    a = PageAllocator(num_pages=5, page_size=2)
    p = a.alloc(4)
    with a.free_group():
        a.free(p[:2])
        a.reset()
        q = a.alloc(1)
        a.free(q)
    assert a.num_free == 4 and a.num_allocated == 0
    a.check_invariants()


# -- reset, check_invariants -----------------------------------------------------------


def test_reset_restores_fresh_order():
    a = PageAllocator(num_pages=7, page_size=1)
    a.alloc(4)
    a.free([3, 1])
    a.alloc(3)
    a.reset()
    assert (a.num_free, a.num_allocated) == (6, 0)
    assert a.alloc(6).tolist() == [1, 2, 3, 4, 5, 6]
    a.check_invariants()


@pytest.mark.parametrize(
    "corrupt,message",
    [
        (lambda a: a._owned.__setitem__(0, 1), "page 0 is owned"),
        (lambda a: a._owned.__setitem__(7, 1), "pages owned but num_allocated"),
        (lambda a: a._owned.__setitem__(2, 2), "not 0/1"),
        (lambda a: a._owned.__setitem__(2, 0), "pages owned but num_allocated"),
        (lambda a: a._ring.__setitem__(5, 7), "twice"),
        (lambda a: a._ring.__setitem__(5, 0), "not a page id"),
        (lambda a: (a._owned.__setitem__(7, 1), a._owned.__setitem__(2, 0)), "both free and owned"),
        (lambda a: setattr(a, "_allocated", 2), r"num_free \+ num_allocated"),
        (lambda a: (a._ring.__setitem__(4, 6), a._ring.__setitem__(5, 5)), "not ascending"),
        (lambda a: setattr(a, "_sorted", 6), "sorted part 6 outside"),
    ],
)
def test_check_invariants_catches(corrupt, message):
    a = PageAllocator(num_pages=9, page_size=4)
    a.alloc(3)  # ring live entries: slots 3..7 = pages 4..8
    a.check_invariants()
    corrupt(a)
    with pytest.raises(AssertionError, match=message):
        a.check_invariants()


# -- alloc_extend / alloc_decode: worked examples --------------------------------------


def test_extend_and_decode_worked_example():
    a = PageAllocator(num_pages=9, page_size=4)
    # three new requests: 5, 4 and 3 tokens
    slots = a.alloc_extend(i64(0, 0, 0), i64(5, 4, 3), i64(-1, -1, -1))
    assert slots.tolist() == [4, 5, 6, 7, 8, 12, 13, 14, 15, 16, 17, 18]
    assert a.num_allocated == 4
    # chunked prefill: request 0 goes 5 -> 11 (rest of page 2, then page 5), request 2
    # goes 3 -> 4 (fills its page 4), request 1 gains nothing
    slots = a.alloc_extend(
        i64(5, 4, 3),
        i64(11, 4, 4),
        i64(8, 15, 18),
        prefix_lens_cpu=i64(5, 4, 3),
        seq_lens_cpu=i64(11, 4, 4),
        extend_num_tokens=7,
    )
    assert slots.tolist() == [9, 10, 11, 20, 21, 22, 19]
    # decode: request 0 -> 12 (page 5), request 1 -> 5 (new page 6), request 2 -> 5 (page 7)
    slots = a.alloc_decode(i64(12, 5, 5), i64(22, 15, 19), seq_lens_cpu=i64(12, 5, 5))
    assert slots.tolist() == [23, 24, 28]
    assert (a.num_free, a.num_allocated) == (1, 7)
    a.check_invariants()


def test_page_size_one_slots_are_pages():
    a = PageAllocator(num_pages=10, page_size=1)
    assert a.alloc_extend(i64(0, 0), i64(3, 2), i64(-1, -1)).tolist() == [1, 2, 3, 4, 5]
    a.free([2, 4])
    assert a.alloc_decode(i64(4, 3), i64(3, 5)).tolist() == [6, 7]
    # sglang's bound: 3 tokens + 1 request + 1 = 5 > 2 sorted pages left: sort first
    assert a.alloc_extend(i64(4), i64(7), i64(6)).tolist() == [2, 4, 8]
    a.check_invariants()


def test_empty_batches():
    a = PageAllocator(num_pages=5, page_size=4)
    e = torch.empty(0, dtype=torch.int64)
    assert a.alloc_extend(e, e, e).numel() == 0
    assert a.alloc_decode(e, e).numel() == 0
    assert (
        a.alloc_extend(
            e, e, e, prefix_lens_cpu=e, seq_lens_cpu=e, extend_num_tokens=0, check=False
        ).numel()
        == 0
    )
    # extends of zero tokens
    assert a.alloc_extend(i64(0, 4), i64(0, 4), i64(-1, 7)).numel() == 0
    assert a.num_allocated == 0


def _prepared(ps=4):
    """An allocator with request A = 6 tokens in pages 1-2 (last_loc 9) and
    request B = 4 tokens in page 3 (last_loc 15)."""
    a = PageAllocator(num_pages=7, page_size=ps)
    assert a.alloc_extend(i64(0, 0), i64(6, 4), i64(-1, -1)).tolist() == [
        4,
        5,
        6,
        7,
        8,
        9,
        12,
        13,
        14,
        15,
    ]
    return a


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((i64(-1, 4), i64(6, 4), i64(9, 15)), {}, "request 0: prefix_len < 0"),
        ((i64(6, 5), i64(7, 4), i64(9, 15)), {}, "request 1: prefix_len > seq_len"),
        ((i64(6, 4), i64(7, 5), i64(8, 15)), {}, "request 0: last_loc is inconsistent"),
        ((i64(6, 4), i64(7, 5), i64(21, 15)), {}, "request 0: last_loc is not in an allocated"),
        ((i64(6, 4), i64(7, 5), i64(9, 15)), dict(extend_num_tokens=3), "extend_num_tokens=3"),
        (
            (i64(6, 4), i64(7, 5), i64(9, 15)),
            dict(prefix_lens_cpu=i64(6, 4), seq_lens_cpu=i64(7, 9)),
            "disagree",
        ),
        (
            (i64(6, 4), i64(7, 5), i64(9, 15)),
            dict(prefix_lens_cpu=i64(4, 6), seq_lens_cpu=i64(5, 7)),
            "disagree",
        ),  # same sums
        ((i64(6, 4), i64(7, 5), i64(9, 15)), dict(seq_lens_cpu=i64(7, 5)), "hints or none"),
        (
            (i64(6, 4), i64(7, 5), i64(9, 15)),
            dict(prefix_lens_cpu=i64(6), seq_lens_cpu=i64(7)),
            "shape",
        ),
        (
            (i64(6, 4), i64(7, 5), i64(9, 15)),
            dict(prefix_lens_cpu=i64(6, 4).float(), seq_lens_cpu=i64(7, 5)),
            "int32 or int64",
        ),
        ((i64(6, 4), i64(7, 5), i64(9)), {}, "differ in length"),
        ((i64(6, 4), i64(7, 5).float(), i64(9, 15)), {}, "int32 or int64"),
        ((i64(6, 4), i64(7, 5), i64(9, 15).reshape(1, 2)), {}, "1-D"),
        ((i64(6, 4), i64(7, 5), torch.tensor([9, 15], device="meta")), {}, "is on meta"),
        (([6, 4], i64(7, 5), i64(9, 15)), {}, "must be a tensor"),
    ],
)
@pytest.mark.parametrize("check", [True, False])
def test_extend_bad_inputs_change_nothing(args, kwargs, match, check):
    a = _prepared()
    snap = snapshot(a)
    with pytest.raises(ValueError, match=match):
        a.alloc_extend(*args, **kwargs, check=check)
    assert_same(a, snap)
    # the same batch, corrected, works
    assert a.alloc_extend(i64(6, 4), i64(7, 5), i64(9, 15)).tolist() == [10, 16]


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((i64(0, 5), i64(9, 15)), {}, "request 0: seq_len < 1"),
        ((i64(7, 5), i64(8, 15)), {}, "request 0: last_loc is inconsistent"),
        ((i64(7, 5), i64(21, 15)), {}, "request 0: last_loc is not in an allocated"),
        ((i64(7, 5), i64(9, 15)), dict(seq_lens_cpu=i64(9, 5)), "disagrees"),
        ((i64(7, 5), i64(9, 15)), dict(seq_lens_cpu=i64(5, 7)), "disagrees"),  # same count
        ((i64(7, 5), i64(9, 15, 1)), {}, "differ in length"),
        ((i64(7, 5), i64(9, 15)), dict(seq_lens_cpu=[7, 5]), "CPU tensor"),
    ],
)
@pytest.mark.parametrize("check", [True, False])
def test_decode_bad_inputs_change_nothing(args, kwargs, match, check):
    a = _prepared()
    snap = snapshot(a)
    with pytest.raises(ValueError, match=match):
        a.alloc_decode(*args, **kwargs, check=check)
    assert_same(a, snap)
    assert a.alloc_decode(i64(7, 5), i64(9, 15)).tolist() == [10, 16]


def test_extend_and_decode_out_of_pages_change_nothing():
    a = _prepared()  # 3 pages left
    snap = snapshot(a)
    with pytest.raises(OutOfPagesError) as e:
        a.alloc_extend(i64(6, 4), i64(13, 9), i64(9, 15))  # needs 2 + 2 pages
    assert (e.value.requested, e.value.available) == (4, 3)
    assert "alloc_extend" in str(e.value)
    assert_same(a, snap)
    a.alloc(2)
    snap = snapshot(a)
    with pytest.raises(OutOfPagesError) as e:
        a.alloc_decode(i64(9, 5), i64(15, 15), seq_lens_cpu=i64(9, 5), check=False)
    assert (e.value.requested, e.value.available) == (2, 1)
    assert_same(a, snap)


def test_extend_int32_inputs_and_hints():
    a = _prepared()
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    got = a.alloc_extend(
        i32(6, 4),
        i32(9, 5),
        i32(9, 15),
        prefix_lens_cpu=i32(6, 4),
        seq_lens_cpu=i32(9, 5),
        extend_num_tokens=4,
        check=False,
    )
    assert got.dtype == torch.int64 and got.tolist() == [10, 11, 16, 20]
    got = a.alloc_decode(i32(10, 6), i32(16, 20), seq_lens_cpu=i32(10, 6))
    assert got.tolist() == [17, 21]


def test_device_checked_calls_with_hints(monkeypatch):
    """The checked calls' device branch (CUDA's: problems read in one sync, the hints
    compared on the device) on CPU tensors: the same pages as the host branch, and hints
    that disagree refused.  Before it was run here, that branch called the imported
    ``agree`` after a local of the same name had shadowed it (UnboundLocalError at the
    first checked alloc_extend or alloc_decode with hints on a GPU)."""
    import kvmem.allocator_slots as slots_module

    host = _prepared()
    want = (
        host.alloc_extend(
            i64(6, 4),
            i64(9, 5),
            i64(9, 15),
            prefix_lens_cpu=i64(6, 4),
            seq_lens_cpu=i64(9, 5),
            check=True,
        ),
        host.alloc_decode(i64(10, 6), i64(16, 20), seq_lens_cpu=i64(10, 6), check=True),
    )
    monkeypatch.setattr(slots_module, "is_async_device", lambda t: True)
    dev = _prepared()
    got = (
        dev.alloc_extend(
            i64(6, 4),
            i64(9, 5),
            i64(9, 15),
            prefix_lens_cpu=i64(6, 4),
            seq_lens_cpu=i64(9, 5),
            check=True,
        ),
        dev.alloc_decode(i64(10, 6), i64(16, 20), seq_lens_cpu=i64(10, 6), check=True),
    )
    assert [t.tolist() for t in got] == [t.tolist() for t in want]
    snap = snapshot(dev)
    with pytest.raises(ValueError, match="disagree"):
        dev.alloc_extend(
            i64(6, 4),
            i64(9, 5),
            i64(9, 15),
            prefix_lens_cpu=i64(6, 3),
            seq_lens_cpu=i64(9, 5),
            check=True,
        )
    with pytest.raises(ValueError, match="disagrees"):
        dev.alloc_decode(i64(10, 6), i64(16, 20), seq_lens_cpu=i64(10, 7), check=True)
    assert_same(dev, snap)


# -- CPU implementations against the references ----------------------------------------


def _batch(kind: str, ps: int, rng: random.Random):
    """(prefix_lens, seq_lens) of a batch composition, as lists."""
    P = ps
    if kind == "fresh":  # prefix 0, assorted lengths incl. exact pages
        return [0, 0, 0, 0], [1, P, 3 * P, 2 * P + 1]
    if kind == "mid_page":  # prefix ends mid-page
        return [P + 1, 1, 2 * P - 1], [3 * P + 2, P, 2 * P]
    if kind == "boundaries":  # prefixes and ends on page boundaries
        return [P, 2 * P, 0], [2 * P, 2 * P + P, P]
    if kind == "empty_extends":  # zero-token extends between others
        return [3, 0, P, 5, 0], [3, 0, 3 * P, 5 + P, 2]
    if kind == "single":
        return [2 * P + 1], [2 * P + 2]
    if kind == "random":
        pre = [rng.randrange(0, 5 * P) for _ in range(13)]
        return pre, [p + rng.randrange(0, 4 * P + 3) for p in pre]
    raise AssertionError(kind)


KINDS = ["fresh", "mid_page", "boundaries", "empty_extends", "single", "random"]


def _last_locs(pre, ps, rng):
    """A consistent last_loc for each prefix: the slot of its last token in some page."""
    return [rng.randrange(1, 50) * ps + (p - 1) % ps if p > 0 else -1 for p in pre]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ps", [1, 16, 64], ids=lambda p: f"P{p}")
def test_extend_slots_torch_matches_ref(ps, kind, dtype):
    rng = random.Random(f"{ps}-{kind}")
    pre, seq = _batch(kind, ps, rng)
    last = _last_locs(pre, ps, rng)
    t = lambda x: torch.tensor(x, dtype=dtype)  # noqa: E731
    num_new, total = (int(v) for v in K.extend_counts(t(pre), t(seq), ps))
    new_pages = torch.randperm(1000, generator=torch.Generator().manual_seed(ps))[:num_new] + 1
    want = K.extend_slots_ref(t(pre), t(seq), t(last), new_pages, ps)
    got = K.extend_slots_torch(t(pre), t(seq), t(last), new_pages, ps, total)
    assert got.dtype == torch.int64
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["all_new", "none_new", "mixed", "random"])
@pytest.mark.parametrize("ps", [1, 16, 64], ids=lambda p: f"P{p}")
def test_decode_slots_torch_matches_ref(ps, kind):
    rng = random.Random(f"{ps}-{kind}")
    if kind == "all_new":
        seq = [1, ps + 1, 3 * ps + 1]
    elif kind == "none_new":
        seq = [2, ps + 2, ps] if ps > 2 else [1, 2, 3]
    elif kind == "mixed":
        seq = [1, 2, ps + 1, ps, 2 * ps + 1, 7]
    else:
        seq = [rng.randrange(1, 6 * ps + 2) for _ in range(17)]
    last = [rng.randrange(1, 50) * ps + (s - 2) % ps for s in seq]
    num_new = int(K.decode_counts(i64(*seq), ps))
    new_pages = torch.randperm(500, generator=torch.Generator().manual_seed(3))[:num_new] + 1
    want = K.decode_slots_ref(i64(*seq), i64(*last), new_pages, ps)
    got = K.decode_slots_torch(i64(*seq), i64(*last), new_pages, ps)
    assert torch.equal(got, want)


@pytest.mark.parametrize("head,n", [(0, 0), (0, 5), (3, 4), (6, 5), (7, 8), (2, 8)])
def test_take_pages_cpu_matches_ref(head, n):
    ring = torch.randperm(8, generator=torch.Generator().manual_seed(head)) + 1
    owned = torch.zeros(9, dtype=torch.int32)
    want_pages, want_owned = K.take_pages_ref(ring, owned, head, n)
    got = K.take_pages_cpu(ring.numpy(), owned.numpy(), head, n)
    assert torch.equal(got, want_pages) and torch.equal(owned, want_owned)


FREE_CASES = [
    [],
    [3],
    [3, 5, 1],
    [5, 3, 5],
    [0],
    [9],
    [-2, 3],
    [2],
    [4, 6, 6, 2],
    [1, 3, 4, 5, 6, 7, 8],
    [8, 7, 6, 5, 4, 3, 1],
]


@pytest.mark.parametrize("tail", [0, 5, 7])
@pytest.mark.parametrize("pages", FREE_CASES, ids=str)
def test_free_impls_match_ref(pages, tail):
    owned = torch.tensor([0, 1, 0, 1, 1, 1, 1, 1, 1], dtype=torch.int32)  # 2 is free
    ring = torch.arange(100, 108)
    want = K.free_pages_ref(pages, ring, owned, tail)
    want_err = K.free_errors_ref(pages, owned)
    p = i64(*pages)
    # device-style check (what CUDA runs for check=True), here on CPU tensors
    first, code = K.free_errors_torch(p, owned).tolist()
    assert (None if first < 0 else (first, code)) == want_err
    assert K.free_errors_cpu(p.numpy(), owned.numpy()) == want_err
    r, o_ext = ring.clone(), torch.cat((owned, torch.zeros(1, dtype=torch.int32)))
    o = o_ext[:-1]
    got = K.free_pages_cpu(p.numpy(), r.numpy(), o_ext.numpy(), tail)
    assert o_ext[-1] == 0
    if want_err is not None:
        assert got == want_err
        assert torch.equal(r, ring) and torch.equal(o, owned)
    else:
        assert got is None
        assert torch.equal(r, want[0]) and torch.equal(o, want[1])
    # the short-list path: the same result, or nothing changed and False when refused
    r, o = ring.clone(), owned.clone()
    took = K.free_pages_list(list(pages), memoryview(r.numpy()), memoryview(o.numpy()), tail)
    if want_err is not None or not pages:
        assert took is (not pages)
        assert torch.equal(r, ring) and torch.equal(o, owned)
    else:
        assert took is True
        assert torch.equal(r, want[0]) and torch.equal(o, want[1])


def test_free_short_list_path_and_long_lists_agree():
    """A free of a Python list takes the short path up to PY_FREE_MAX pages and the
    general one beyond: the same state either way, ring wrap included."""
    n = K.PY_FREE_MAX + 3
    states = []
    for split in (True, False):
        a = PageAllocator(num_pages=n + 2, page_size=2)
        pages = a.alloc(n + 1).tolist()
        a.free(pages[:3])
        a.alloc(3)  # the ring now wraps at its end
        order = pages[3:][::-1] + [pages[0]]
        if split:  # short lists
            for i in range(0, len(order), 5):
                a.free(order[i : i + 5])
        else:  # one list longer than PY_FREE_MAX
            a.free(order)
        a.check_invariants()
        states.append((a.alloc(a.num_free).tolist(), a.num_allocated))
    assert states[0] == states[1]


def test_free_short_list_takes_numpy_integers_via_the_general_path():
    a = PageAllocator(num_pages=5, page_size=2)
    a.alloc(3)
    a.free([np.int64(2), np.int32(1)])
    a.free([3])
    assert a.num_free == 4
    a.check_invariants()


def test_free_errors_impls_agree_on_random_lists():
    rng = random.Random(5)
    owned = torch.tensor([0] + [rng.randrange(2) for _ in range(40)], dtype=torch.int32)
    for _ in range(300):
        pages = [rng.randrange(-2, 44) for _ in range(rng.randrange(1, 9))]
        if rng.random() < 0.5:  # mostly valid lists
            pages = rng.sample([i for i in range(1, 41) if owned[i]], rng.randrange(1, 9))
            if rng.random() < 0.3:
                pages.append(rng.choice(pages))
        want = K.free_errors_ref(pages, owned)
        first, code = K.free_errors_torch(i64(*pages), owned).tolist()
        assert (None if first < 0 else (first, code)) == want, pages
        assert K.free_errors_cpu(np.array(pages, dtype=np.int64), owned.numpy()) == want


# -- the Triton kernels compile for the H200 (sm_90) with the installed Triton ---------
# The interpreter accepts code the compiler rejects (e.g. an atomic_cas whose operands do
# not match the pointer's type), so compile every kernel variant here, on the CPU.

_SIG = {
    "_take_pages_kernel": dict(
        ring_ptr="*i64",
        owned_ptr="*i32",
        out_ptr="*i64",
        err_ptr="*i64",
        head="i64",
        n="i32",
        cap="i32",
        num_pages="i32",
    ),
    "_free_apply_kernel": dict(
        pages_ptr="*i32",
        ring_ptr="*i64",
        owned_ptr="*i32",
        err_ptr="*i64",
        n="i32",
        pages_stride="i32",
        tail="i32",
        cap="i32",
        num_pages="i32",
        parity="i32",
    ),
    "_free_commit_kernel": dict(
        pages_ptr="*i64",
        ring_ptr="*i64",
        owned_ptr="*i32",
        err_ptr="*i64",
        n="i32",
        pages_stride="i32",
        tail="i64",
        cap="i32",
        num_pages="i32",
        parity="i32",
    ),
    "_extend_slots_kernel": dict(
        prefix_ptr="*i32",
        seq_ptr="*i64",
        last_loc_ptr="*i64",
        new_pages_ptr="*i64",
        out_ptr="*i64",
        err_ptr="*i64",
        bs="i32",
        num_new="i32",
        total="i32",
    ),
    "_decode_slots_kernel": dict(
        seq_ptr="*i64",
        last_loc_ptr="*i32",
        new_pages_ptr="*i64",
        out_ptr="*i64",
        err_ptr="*i64",
        bs="i32",
        num_new="i32",
    ),
}
_CONST = {
    "_take_pages_kernel": [dict(BLOCK=alloc_triton.TAKE_BLOCK, FLAG=f) for f in (False, True)],
    "_free_apply_kernel": [dict(BLOCK=alloc_triton.TAKE_BLOCK, FLAG=f) for f in (False, True)],
    "_free_commit_kernel": [dict(BLOCK=alloc_triton.TAKE_BLOCK)],
    "_extend_slots_kernel": [
        dict(
            PAGE_SIZE=ps,
            REQ_BLOCK=alloc_triton.REQ_BLOCK,
            TOKEN_BLOCK=alloc_triton.TOKEN_BLOCK,
            FLAG=f,
        )
        for ps, f in itertools.product((1, 16), (False, True))
    ],
    "_decode_slots_kernel": [
        dict(PAGE_SIZE=ps, BLOCK=alloc_triton.DECODE_BLOCK, FLAG=f)
        for ps, f in itertools.product((1, 64), (False, True))
    ],
}


@pytest.mark.parametrize("name", list(_SIG))
def test_kernels_compile_for_sm90(name):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(alloc_triton, name)
    for consts in _CONST[name]:
        sig = dict(_SIG[name], **{k: "constexpr" for k in consts})
        compiled = triton.compile(
            ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32)
        )
        ptx = compiled.asm["ptx"]
        assert ".target sm_90" in ptx
        if consts.get("FLAG") or name == "_free_commit_kernel":
            assert "atom.global" in ptx  # the device-side checks are really there


@pytest.mark.parametrize("code", list(AllocCode), ids=lambda c: c.name)
def test_every_refusal_code_raises_its_rows_exception_and_message(code):
    """kvmem.errors.AllocCode is the one table of refusals: whatever a host check returns
    or a kernel records becomes that row's exception, with its message and the value."""
    found_on_device = code.name.startswith("ERR_")
    e = alloc_error(
        code, 7, 11, call="alloc_extend", rebuilt="rebuilt from the map" if found_on_device else ""
    )
    assert type(e) is code.raises
    assert code.message in str(e) and "7" in str(e)
    assert ("rebuilt from the map" in str(e)) == found_on_device


@pytest.mark.parametrize("rebuilt", ["", "rebuilt from the map"])
def test_a_code_outside_the_table_is_a_device_error_not_a_crash(rebuilt):
    """A code no row names (a kernel that records something new) is still reported: a
    ValueError naming the code, with or without the rebuilt state."""
    code = max(AllocCode) + 100
    e = alloc_error(code, 7, 11, call="alloc_extend", rebuilt=rebuilt)
    assert type(e) is ValueError
    assert f"device error code {code}" in str(e) and "7" in str(e)


# -- the batch checks: numpy (CPU) and torch (what CUDA runs) agree --------------------


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_batch_checks_numpy_and_torch_agree(ps):
    from kvmem.kernels.alloc.checks import (
        decode_problems,
        decode_problems_np,
        extend_problems,
        extend_problems_np,
    )

    rng = random.Random(ps)
    num_pages = 12
    owned_ext = torch.zeros(num_pages + 1, dtype=torch.int32)
    owned_ext[1:num_pages:2] = 1  # odd pages allocated
    owned = owned_ext[:-1]
    seen_codes = set()
    for _ in range(300):
        bs = rng.randrange(0, 6)
        pre = [rng.randrange(-2, 3 * ps + 2) for _ in range(bs)]
        seq = [p + rng.randrange(-2, 2 * ps) for p in pre]
        # last_loc: mostly consistent, in an allocated page; sometimes not
        last = [
            rng.randrange(-1, num_pages + 2) * ps + (p - 1) % ps + (rng.random() < 0.2) for p in pre
        ]
        t = [torch.tensor(x, dtype=torch.int64) for x in (pre, seq, last)]
        want = extend_problems(*t, owned, ps).tolist()
        got = extend_problems_np(*(x.numpy() for x in t), owned_ext.numpy(), ps)
        assert got == want, (pre, seq, last)
        seen_codes.add(got[1])
        want = decode_problems(t[1], t[2], owned, ps).tolist()
        got = decode_problems_np(t[1].numpy(), t[2].numpy(), owned_ext.numpy(), ps)
        assert got == want, (seq, last)
        seen_codes.add(got[1])
    every = {
        0,
        AllocCode.LEN_NEGATIVE_PREFIX,
        AllocCode.LEN_PREFIX_OVER_SEQ,
        AllocCode.LEN_SEQ_BELOW_ONE,
    }
    if ps > 1:  # at page_size 1 no request has a partial last page
        every |= {AllocCode.LEN_LAST_LOC_OFFSET, AllocCode.LEN_LAST_PAGE_FREE}
    assert seen_codes >= every
