"""KvmemTokenToKVPoolAllocator against sglang 0.5.23's own allocators, side by side on
CPU: PagedTokenToKVPoolAllocator (need_sort True and False) at page_size 16 and 64,
TokenToKVPoolAllocator at page_size 1, both driven by the calls sglang's scheduler makes
(``alloc`` at page_size 1, ``alloc_extend`` / ``alloc_decode`` above; frees through
``free_segments`` on release, ``free``, ``free_page_ids``, free groups).

What is compared: from a new or cleared allocator, the same slots call for call; after
frees, with need_sort (sglang's default), the same slots call for call too (kvmem stages
its frees and sorts them in when its sorted part runs short, at sglang's bounds:
``test_after_frees_same_slots_as_sglang_need_sort``); without need_sort only counts and
sets (sglang puts freed pages first, kvmem keeps need_sort's order);
available_size after every call, always.  Where kvmem is stricter than sglang (double
frees, unaligned alloc) the test says so.  sglang's allocator modules import without a
published ServerArgs, so no conftest is needed."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

from kvmem import DoubleFreeError
from kvmem_sglang.allocator import KvmemTokenToKVPoolAllocator

# (page_size, need_sort): page_size 1 is TokenToKVPoolAllocator's, above it the paged one
CASES = [(1, True), (1, False), (16, True), (16, False), (64, True), (64, False)]
CASE_IDS = [f"P{ps}-{'sort' if s else 'nosort'}" for ps, s in CASES]


def stock(size: int, ps: int, need_sort: bool = True) -> BaseTokenToKVPoolAllocator:
    if ps == 1:
        a = TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", None, need_sort)
    else:
        a = PagedTokenToKVPoolAllocator(size, ps, torch.bfloat16, "cpu", None, need_sort)
    # the adapter's hooks replace sglang's classes in a process where they are applied:
    # the baseline must be sglang's own
    assert not isinstance(a, KvmemTokenToKVPoolAllocator), "sglang's allocator is replaced"
    assert type(a).__module__.startswith("sglang.srt.mem_cache.allocator.")
    return a


def ours(size: int, ps: int, need_sort: bool = True, **kw) -> KvmemTokenToKVPoolAllocator:
    return KvmemTokenToKVPoolAllocator(size, ps, torch.bfloat16, "cpu", None, need_sort, **kw)


# -- the scheduler's calls, the same for both allocators ---------------------------------


def extend(a, ps: int, rows: list[torch.Tensor], new_lens: list[int]):
    """What alloc_for_extend calls: ``alloc(extend_num_tokens)`` at page_size 1,
    ``alloc_extend`` (positional, sglang's order) above.  rows: each request's slots so
    far (int32, like req_to_token)."""
    total = sum(new_lens)
    if ps == 1:
        return a.alloc(total)
    pre = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    seq = pre + torch.tensor(new_lens, dtype=torch.int64)
    last = torch.tensor([int(r[-1]) if len(r) else -1 for r in rows], dtype=torch.int32)
    return a.alloc_extend(pre, pre.clone(), seq, seq.clone(), last, total)


def decode(a, ps: int, rows: list[torch.Tensor]):
    """What alloc_for_decode calls: ``alloc(bs)`` at page_size 1, ``alloc_decode``."""
    if ps == 1:
        return a.alloc(len(rows))
    seq = torch.tensor([len(r) + 1 for r in rows], dtype=torch.int64)
    last = torch.tensor([int(r[-1]) for r in rows], dtype=torch.int32)
    return a.alloc_decode(seq, seq.clone(), last)


def split(out: torch.Tensor, lens: list[int]) -> list[torch.Tensor]:
    return [p.to(torch.int32) for p in torch.split(out, lens)]


def grow_rows(rows: list, idx: list[int], out: torch.Tensor, lens: list[int]) -> None:
    """Add each request's new slots (``out`` split by ``lens``) to its int32 row:
    ``rows[i]`` extended, or a new row where ``i`` is past the end."""
    for i, part in zip(idx, split(out, lens)):
        if i < len(rows):
            rows[i] = torch.cat((rows[i], part))
        else:
            rows.append(part)


def free_set(a) -> set[int]:
    return set(a.get_all_free_pages().tolist())


def all_pages(size: int, ps: int) -> set[int]:
    return set(range(1, size // ps + 1))


# -- construction ---------------------------------------------------------------------


def test_constructor_takes_sglang_paged_arguments():
    theirs = list(inspect.signature(PagedTokenToKVPoolAllocator.__init__).parameters)
    mine = list(inspect.signature(KvmemTokenToKVPoolAllocator.__init__).parameters)
    assert mine[: len(theirs)] == theirs
    a = ours(160, 16)
    assert isinstance(a, BaseTokenToKVPoolAllocator)
    assert a.page_allocator.num_pages == 160 // 16 + 1  # kvmem counts the padding page
    assert a.num_pages == stock(160, 16).num_pages == 10
    assert a.size == a.size_full == 160 and a.available_size() == 160


# -- same slots from a new allocator ----------------------------------------------------


@pytest.mark.parametrize("ps,need_sort", CASES, ids=CASE_IDS)
def test_fresh_allocator_same_slots_as_sglang(ps, need_sort):
    """New requests, chunked continuations that start mid-page, decode steps across page
    boundaries and page-aligned allocs: the same slots as sglang's, and again after
    clear()."""
    size = 48 * ps
    mine, theirs = ours(size, ps, need_sort), stock(size, ps, need_sort)
    for _round in range(2):
        rows_m: list[torch.Tensor] = []
        rows_t: list[torch.Tensor] = []
        empty = torch.empty(0, dtype=torch.int32)

        def step(kind, *args):
            if kind == "extend":
                idx, lens = args
                got = extend(mine, ps, [rows_m[i] if i < len(rows_m) else empty for i in idx], lens)
                want = extend(
                    theirs, ps, [rows_t[i] if i < len(rows_t) else empty for i in idx], lens
                )
            elif kind == "decode":
                (idx,) = args
                got = decode(mine, ps, [rows_m[i] for i in idx])
                want = decode(theirs, ps, [rows_t[i] for i in idx])
                lens = [1] * len(idx)
            else:  # page-aligned alloc (HiCache load-back, PD decode prealloc at P1)
                (n,) = args
                got, want = mine.alloc(n * ps), theirs.alloc(n * ps)
                idx, lens = [len(rows_m)], [n * ps]
            assert want is not None
            assert torch.equal(got, want), (kind, args)
            assert got.dtype == torch.int64
            assert mine.available_size() == theirs.available_size()
            grow_rows(rows_m, idx, got, lens)
            grow_rows(rows_t, idx, want, lens)

        step("extend", [0, 1, 2], [5, ps + 3, 2 * ps])  # three new requests
        step("extend", [0, 3], [ps, 7])  # a chunk after a partial page
        step("decode", [0, 1, 2, 3])
        step("decode", [1, 2, 3])
        step("alloc", 3)
        step("extend", [4, 5], [ps + 1, 1])
        for _ in range(ps + 1):  # decode across a page boundary
            step("decode", [0, 5])
        mine.clear()
        theirs.clear()
        assert mine.available_size() == theirs.available_size() == size


@pytest.mark.parametrize("ps", [1, 16, 64])
def test_after_frees_same_slots_as_sglang_need_sort(ps):
    """A seeded random mix of new requests, decode steps over random subsets and frees of
    whole requests (token slots, as sglang's release does), 400 calls, the pool often
    near full so that the sorted part runs short many times: the same slots as sglang's
    need_sort allocator after every call, frees included."""
    import random

    size = 40 * ps
    mine, theirs = ours(size, ps, True), stock(size, ps, True)
    rng = random.Random(ps)
    rows_m: list[torch.Tensor] = []
    rows_t: list[torch.Tensor] = []
    empty = torch.empty(0, dtype=torch.int32)
    pa, sorts = mine.page_allocator, []
    sort_free = pa._sort_free
    pa._sort_free = lambda: (sorts.append(pa.num_free), sort_free())
    for _ in range(400):
        free_pages = mine.available_size() // ps
        op = rng.random()
        if op < 0.45:
            lens = [rng.randint(1, 3 * ps) for _ in range(rng.randint(1, 3))]
            if sum(-(-n // ps) for n in lens) + len(lens) + 1 > free_pages:
                continue
            idx = list(range(len(rows_m), len(rows_m) + len(lens)))
            got = extend(mine, ps, [empty] * len(lens), lens)
            want = extend(theirs, ps, [empty] * len(lens), lens)
        elif op < 0.75 and rows_m:
            idx = rng.sample(range(len(rows_m)), rng.randint(1, len(rows_m)))
            if len(idx) > free_pages:
                continue
            got = decode(mine, ps, [rows_m[i] for i in idx])
            want = decode(theirs, ps, [rows_t[i] for i in idx])
            lens = [1] * len(idx)
        elif rows_m:
            i = rng.randrange(len(rows_m))
            mine.free(rows_m.pop(i))
            theirs.free(rows_t.pop(i))
            assert mine.available_size() == theirs.available_size()
            continue
        else:
            continue
        assert want is not None
        assert torch.equal(got, want)
        assert mine.available_size() == theirs.available_size()
        grow_rows(rows_m, idx, got, lens)
        grow_rows(rows_t, idx, want, lens)
    assert mine.available_size() < size  # the run ended with requests held
    assert len(sorts) >= 10, sorts  # the staged frees were sorted in, many times over
    mine.page_allocator.check_invariants()


@pytest.mark.parametrize("ps", [16, 64])
def test_alloc_extend_keyword_call(ps):
    """PD decode's prealloc calls alloc_extend by keyword, with int64 last_loc."""
    mine, theirs = ours(8 * ps, ps), stock(8 * ps, ps)
    kw = dict(
        prefix_lens=torch.tensor([0]),
        prefix_lens_cpu=torch.tensor([0]),
        seq_lens=torch.tensor([ps + 2]),
        seq_lens_cpu=torch.tensor([ps + 2]),
        last_loc=torch.tensor([-1]),
        extend_num_tokens=ps + 2,
    )
    assert torch.equal(mine.alloc_extend(**kw), theirs.alloc_extend(**kw))
    assert torch.equal(
        mine.alloc_extend(**kw, num_new_pages=2), theirs.alloc_extend(**kw, num_new_pages=2)
    )


def test_alloc_extend_and_decode_at_page_size_1():
    """sglang's page-size-1 allocator has neither (the scheduler calls alloc); kvmem's
    work and hand out what alloc would."""
    mine, theirs = ours(64, 1), stock(64, 1)
    pre, seq = torch.tensor([0, 0]), torch.tensor([3, 5])
    got = mine.alloc_extend(pre, pre, seq, seq, torch.tensor([-1, -1]), 8)
    assert torch.equal(got, theirs.alloc(8))
    got = mine.alloc_decode(seq + 1, seq + 1, torch.tensor([got[2], got[7]]))
    assert torch.equal(got, theirs.alloc(2))
    assert mine.available_size() == theirs.available_size() == 54
    with pytest.raises(NotImplementedError):
        theirs.alloc_extend(pre, pre, seq, seq, torch.tensor([-1, -1]), 8)


# -- OOM --------------------------------------------------------------------------------


@pytest.mark.parametrize("ps,need_sort", CASES, ids=CASE_IDS)
def test_out_of_memory_returns_none_and_changes_nothing(ps, need_sort):
    size = 10 * ps
    mine, theirs = ours(size, ps, need_sort), stock(size, ps, need_sort)
    empty = torch.empty(0, dtype=torch.int32)
    rows = {}
    # 3 + 3 pages; at page_size > 1 request 0's last page has 1 slot left
    lens = [3 * ps - 1, 2 * ps + 1] if ps > 1 else [3, 3]
    for a in (mine, theirs):
        rows[id(a)] = split(extend(a, ps, [empty, empty], lens), lens)
        a.free_segments([(rows[id(a)][1], 0)])  # staged in sglang with need_sort
    assert mine.available_size() == theirs.available_size() == 7 * ps
    before = free_set(mine)

    def unchanged():
        assert mine.available_size() == theirs.available_size() == 7 * ps
        assert free_set(mine) == before

    # alloc: 8 pages, 7 free
    assert mine.alloc(8 * ps) is None and theirs.alloc(8 * ps) is None
    unchanged()
    # alloc_extend: a continuation (no new page for its partial page's 1 slot) and new
    # requests needing 8 new pages in all
    for a in (mine, theirs):
        r = rows[id(a)][0]
        assert extend(a, ps, [r, empty, empty], [1, 4 * ps, 3 * ps + 1]) is None
    unchanged()
    # alloc_decode: 8 requests each starting a page, 7 pages free
    for a in (mine, theirs):
        seq = torch.full((8,), ps + 1, dtype=torch.int64)
        last = torch.arange(8, dtype=torch.int32) * ps + ps - 1  # slots of no consequence
        if ps == 1:
            assert a.alloc(8) is None
        else:
            assert a.alloc_decode(seq, seq.clone(), last) is None
    unchanged()
    # what fits still fits, and is the same on both
    r_m, r_t = rows[id(mine)][0], rows[id(theirs)][0]
    fill = 7 * ps + (1 if ps > 1 else 0)  # the partial page's slot, then 7 pages
    got, want = extend(mine, ps, [r_m], [fill]), extend(theirs, ps, [r_t], [fill])
    assert got is not None and want is not None
    assert len(set(got.tolist()) | set(r_m.tolist())) == len(got) + len(r_m)
    assert mine.available_size() == theirs.available_size() == 0
    assert free_set(mine) == set()


# -- frees --------------------------------------------------------------------------------


def _three_requests(a, ps):
    empty = torch.empty(0, dtype=torch.int32)
    lens = [2 * ps + 3, ps, 3 * ps - 1]
    return split(extend(a, ps, [empty] * 3, lens), lens)


@pytest.mark.parametrize("ps,need_sort", CASES, ids=CASE_IDS)
def test_free_segments_short_and_long_rows_match_sglang(ps, need_sort):
    """free_segments of rows on either side of the adapter's short-row path (one segment
    of up to PY_FREE_MAX pages goes to kvmem as a Python list; longer rows and rows in two
    segments as a tensor) frees the same pages as sglang's."""
    from kvmem.kernels.alloc import PY_FREE_MAX

    lens = [PY_FREE_MAX * ps, PY_FREE_MAX * ps + 1, 3 * ps - 1, 2 * PY_FREE_MAX * ps + 5]
    size = (sum(lens) // ps + 8) * ps
    mine, theirs = ours(size, ps, need_sort), stock(size, ps, need_sort)
    empty = torch.empty(0, dtype=torch.int32)
    rm = split(extend(mine, ps, [empty] * 4, lens), lens)
    rt = split(extend(theirs, ps, [empty] * 4, lens), lens)
    for i in (1, 0, 3, 2):
        cut = (len(rm[i]) // ps // 2) * ps
        for a, r in ((mine, rm[i]), (theirs, rt[i])):
            a.free_segments([(r[:cut], 0), (r[cut:], cut)] if i % 2 else [(r, 0)])
        assert mine.available_size() == theirs.available_size()
        assert free_set(mine) == set(theirs.get_all_free_pages().tolist())
    assert mine.available_size() == size
    mine.page_allocator.check_invariants()


@pytest.mark.parametrize("ps,need_sort", CASES, ids=CASE_IDS)
def test_free_paths_match_sglang(ps, need_sort):
    """Each free path frees the same pages as sglang's (same history, so the same sets)."""
    size = 40 * ps
    mine, theirs = ours(size, ps, need_sort), stock(size, ps, need_sort)
    rm, rt = _three_requests(mine, ps), _three_requests(theirs, ps)

    def same():
        assert mine.available_size() == theirs.available_size()
        assert free_set(mine) == set(theirs.get_all_free_pages().tolist())

    # the tail of request 0 from a page boundary (release of over-allocated slots)
    mine.free_segment(rm[0][ps:], start_pos=ps)
    theirs.free_segment(rt[0][ps:], start_pos=ps)
    same()
    # token slots, a page touched by several of them, in any order
    mine.free(rm[0][:ps].flip(0))
    theirs.free(rt[0][:ps].flip(0))
    same()
    # page ids
    mine.free_page_ids(torch.unique(rm[1].long() // ps))
    theirs.free_page_ids(torch.unique(rt[1].long() // ps))
    same()
    # segments of one row, the release path (free_kv_row -> free_segments)
    cut = ps  # page-aligned split
    mine.free_segments([(rm[2][:cut], 0), (rm[2][cut:], cut)])
    theirs.free_segments([(rt[2][:cut], 0), (rt[2][cut:], cut)])
    same()
    assert mine.available_size() == size
    # the full-side variants (one pool, no SWA peer)
    rm, rt = _three_requests(mine, ps), _three_requests(theirs, ps)
    for a, r in ((mine, rm), (theirs, rt)):
        a.free_full(r[0])
        a.free_full_segment(r[1], start_pos=0)
        a.free_full_segments([(r[2][:ps], 0), (r[2][ps:], ps)])
    same()
    # empty frees do nothing
    for a in (mine, theirs):
        for call in (a.free, a.free_page_ids, a.free_full):
            call(torch.empty(0, dtype=torch.int64))
        a.free_segment(torch.empty(0, dtype=torch.int32), start_pos=0)
        a.free_segments([])
    same()
    assert mine.available_size() == size


@pytest.mark.parametrize("ps", [16, 64])
def test_free_segment_unaligned_start_raises(ps):
    mine = ours(8 * ps, ps)
    (r, *_), before = _three_requests(mine, ps), None
    before = mine.available_size()
    with pytest.raises(ValueError, match="not a multiple of page_size"):
        mine.free_segment(r[1:], start_pos=1)
    assert mine.available_size() == before


@pytest.mark.parametrize("ps,need_sort", CASES, ids=CASE_IDS)
def test_free_group_matches_sglang(ps, need_sort):
    size = 40 * ps
    mine, theirs = ours(size, ps, need_sort), stock(size, ps, need_sort)
    rm, rt = _three_requests(mine, ps), _three_requests(theirs, ps)
    start = mine.available_size()
    for a, r in ((mine, rm), (theirs, rt)):
        a.free_group_begin()
        # two token-slot frees touching the same page: freed once at the group's end
        a.free(r[0][: ps + 1])
        a.free(r[0][ps + 1 :])
        a.free_segments([(r[1], 0)])  # page ids
        a.free_page_ids(torch.unique(r[2].long() // ps))
        assert a.available_size() == start  # nothing freed yet
    for a in (mine, theirs):
        a.free_group_end()
    assert mine.available_size() == theirs.available_size() == size
    assert free_set(mine) == all_pages(size, ps)
    # an empty group, and an end without a group: nothing
    for a in (mine, theirs):
        a.free_group_begin()
        a.free_group_end()
        a.free_group_end()
    assert mine.available_size() == size


def test_free_group_does_not_nest():
    mine = ours(64, 16)
    mine.free_group_begin()
    with pytest.raises(RuntimeError, match="cannot be nested"):
        mine.free_group_begin()
    mine.free_group_end()


def test_free_group_copies_what_it_holds():
    """A tensor freed in a group may be changed by its caller before the group ends."""
    mine = ours(64, 16)
    slots = mine.alloc(32)
    row = slots.clone()
    mine.free_group_begin()
    mine.free(row)
    mine.free_page_ids(torch.tensor([1]))  # not allocated: the group's end raises
    row.fill_(0)
    with pytest.raises(DoubleFreeError):
        mine.free_group_end()
    assert mine.available_size() == 32  # nothing of the group was freed
    mine.free(slots)
    assert mine.available_size() == 64


# -- double frees (kvmem raises; sglang checks only in debug mode, or never) ------------


@pytest.mark.parametrize("ps", [1, 16, 64])
def test_double_free_raises_and_changes_nothing(ps):
    size = 16 * ps
    mine = ours(size, ps)
    r = _three_requests(mine, ps)
    mine.free_segments([(r[1], 0)])
    avail, before = mine.available_size(), free_set(mine)
    page_of_r1 = int(r[1][0]) // ps
    attempts = [
        lambda: mine.free(r[1]),  # freed already
        lambda: mine.free_segment(r[1], start_pos=0),
        lambda: mine.free_page_ids(torch.tensor([page_of_r1])),
        lambda: mine.free_page_ids(torch.tensor([int(r[0][0]) // ps] * 2)),  # twice in one
        lambda: mine.free_page_ids(torch.tensor([0])),  # the padding page
        lambda: mine.free_page_ids(torch.tensor([size // ps + 1])),  # out of range
        lambda: mine.free_segments([(r[0], 0), (r[1], len(r[0]) + ps - len(r[0]) % ps)]),
    ]
    for attempt in attempts:
        with pytest.raises(DoubleFreeError):
            attempt()
        assert mine.available_size() == avail
        assert free_set(mine) == before
    # in a group: raised at its end, nothing of the group freed
    mine.free_group_begin()
    mine.free(r[0])
    mine.free(r[1])
    with pytest.raises(DoubleFreeError):
        mine.free_group_end()
    assert mine.available_size() == avail and free_set(mine) == before
    assert mine.free_group is None  # the group is closed
    mine.page_allocator.check_invariants()


@pytest.mark.parametrize("ps", [1, 16])
def test_sglang_accepts_a_double_free_outside_debug_mode(ps, monkeypatch):
    """The deviation documented in the class docstring: sglang counts the page twice."""
    monkeypatch.delenv("SGLANG_DEBUG_MEMORY_POOL", raising=False)
    theirs = stock(8 * ps, ps)
    slots = theirs.alloc(ps)
    theirs.free(slots)
    theirs.free(slots)
    assert theirs.available_size() == 9 * ps  # more than the pool holds


# -- clear, resize, and what passes through -----------------------------------------------


@pytest.mark.parametrize("ps,need_sort", CASES, ids=CASE_IDS)
def test_clear(ps, need_sort):
    size = 20 * ps
    mine, theirs = ours(size, ps, need_sort), stock(size, ps, need_sort)
    for a in (mine, theirs):
        r = _three_requests(a, ps)
        a.free_segments([(r[1], 0)])
        a.free_group_begin()
        a.free(r[0])  # dropped by clear, as in sglang
        a.clear()
        assert a.free_group is None
        assert a.available_size() == size
    assert free_set(mine) == all_pages(size, ps)
    assert torch.equal(mine.alloc(3 * ps), theirs.alloc(3 * ps))  # pages 1, 2, 3 again
    mine.page_allocator.check_invariants()


@pytest.mark.parametrize("ps", [1, 16])
def test_resize(ps):
    mine, theirs = ours(40 * ps, ps), stock(40 * ps, ps)
    mine.alloc(4 * ps)
    theirs.alloc(4 * ps)
    config = SimpleNamespace(max_total_num_tokens=24 * ps)
    mine.resize(config)
    theirs.resize(config)
    assert mine.size == theirs.size == 24 * ps
    assert mine.available_size() == theirs.available_size() == 24 * ps
    assert mine.page_allocator.num_pages == 25
    assert torch.equal(mine.alloc(24 * ps), theirs.alloc(24 * ps))
    assert mine.alloc(ps) is None and theirs.alloc(ps) is None


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("bad", [-16, 2.5, True, "16"], ids=["negative", "float", "bool", "str"])
def test_bad_alloc_size_names_the_callers_value(ps, bad):
    """The caller's need_size in the error (not kvmem's page count), nothing changed."""
    mine = ours(8 * ps, ps)
    with pytest.raises(ValueError, match=f"need_size must be an int >= 0, got {bad!r}"):
        mine.alloc(bad)
    assert mine.available_size() == 8 * ps


@pytest.mark.parametrize("bad", [40.7, 0, -8, None])
def test_resize_refuses_a_bad_size(bad):
    mine = ours(40, 1)
    mine.alloc(4)
    with pytest.raises(
        ValueError, match=f"max_total_num_tokens must be a positive int, got {bad!r}"
    ):
        mine.resize(SimpleNamespace(max_total_num_tokens=bad))
    assert mine.size == 40 and mine.available_size() == 36


@pytest.mark.parametrize("ps", [16, 64])
def test_unaligned_alloc_raises(ps):
    """sglang asserts alignment only in debug mode (else it hands out fewer slots)."""
    mine = ours(8 * ps, ps)
    with pytest.raises(ValueError, match="not a multiple of page_size"):
        mine.alloc(ps + 1)
    assert mine.available_size() == 8 * ps


class _RecordingKVCache:
    def __init__(self):
        self.calls = []

    def get_cpu_copy(self, *args, **kw):
        self.calls.append(("get", args, kw))
        return "copy"

    def load_cpu_copy(self, *args, **kw):
        self.calls.append(("load", args, kw))


def test_passthrough_and_budget_hooks_match_sglang():
    ps, size = 16, 64 * 16
    kv_m, kv_t = _RecordingKVCache(), _RecordingKVCache()
    mine = KvmemTokenToKVPoolAllocator(size, ps, torch.bfloat16, "cpu", kv_m, True)
    theirs = PagedTokenToKVPoolAllocator(size, ps, torch.bfloat16, "cpu", kv_t, True)
    idx = mine.alloc(2 * ps)
    theirs.alloc(2 * ps)
    for a in (mine, theirs):
        assert a.get_kvcache() is (kv_m if a is mine else kv_t)
        assert a.translate_kv_indices_for_transfer(idx) is idx
        assert a.get_cpu_copy(idx, mamba_indices=None, req_pool_index=3) == "copy"
        a.load_cpu_copy("cpu-kv", idx, req_pool_index=3)
        a.merge_and_sort_free()
        assert a.evict_to_free_tokens(None, 10) is None
        a.set_hicache_transfer_done_event("key", None)
    assert kv_m.calls == kv_t.calls
    for n in (0, 100, 62 * ps, 62 * ps + 1):
        assert mine.check_decode_capacity(
            num_tokens=n, tree_cache=None
        ) == theirs.check_decode_capacity(num_tokens=n, tree_cache=None)
    kw = dict(token_capacity=size, sliding_window_size=None, chunk_size=None)
    assert mine.max_new_tokens_for_memory(100, 500, **kw) == theirs.max_new_tokens_for_memory(
        100, 500, **kw
    )
    assert mine.request_slot_reserve(has_req_pool_slot=True) == 0
    assert mine.verify_byte_accounting() == [] and mine.mamba_full_cache_donor() is None
    assert mine.prealloc_fits(None, 10, 0, full_budget_tokens=10)


def test_check_mode_follows_sglang_debug_switch(monkeypatch):
    monkeypatch.setenv("SGLANG_DEBUG_MEMORY_POOL", "1")
    assert ours(64, 16).check is True
    monkeypatch.delenv("SGLANG_DEBUG_MEMORY_POOL")
    assert ours(64, 16).check is False
    assert ours(64, 16, check=True).check is True
    ours(64, 16).synchronize()  # nothing pending: returns


def test_inconsistent_extend_inputs_raise():
    """sglang would hand out wrong slots (its check is a debug assertion)."""
    mine = ours(8 * 16, 16)
    pre, seq = torch.tensor([5]), torch.tensor([9])
    with pytest.raises(ValueError):  # prefix 5, but last_loc's page is not allocated
        mine.alloc_extend(pre, pre, seq, seq, torch.tensor([20]), 4)
    with pytest.raises(ValueError):  # extend_num_tokens disagrees
        mine.alloc_extend(torch.tensor([0]), torch.tensor([0]), seq, seq, torch.tensor([-1]), 5)
    assert mine.available_size() == 8 * 16
