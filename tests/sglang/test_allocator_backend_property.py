"""Random sequences of the scheduler's allocator calls, on KvmemTokenToKVPoolAllocator and
sglang 0.5.23's own allocator side by side (hypothesis): new requests, chunked
continuations, decode steps, page-aligned allocs, releases through every free path, free
groups, and out-of-memory calls.  After every call: the same available_size as sglang,
both or neither out of memory, and, on kvmem's side, no slot held by two requests, no
page leaked (the pages the requests hold are exactly kvmem's allocated pages), and
kvmem's own invariants."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.util import examples

import pytest
from tests.sglang.test_allocator_backend import CASE_IDS, CASES, decode, extend, ours, split, stock

POOL_PAGES = 24
OPS = 30
FREE_METHODS = ["segments", "slots", "page_ids", "truncate"]


class Side:
    """One allocator and the slot rows (int32, like req_to_token) of its requests."""

    def __init__(self, alloc):
        self.a = alloc
        self.rows: dict[int, torch.Tensor] = {}


def _release(side: Side, ps: int, rid: int, method: str, cut: int, in_group: bool):
    """Free request ``rid``'s slots the way ``method`` says (``cut`` picks a split)."""
    a, row = side.a, side.rows[rid]
    n_pages = -(-len(row) // ps)
    if method == "truncate" and n_pages > 1:  # over-allocated tail, from a page boundary
        keep = 1 + cut % (n_pages - 1)
        a.free_segment(row[keep * ps :], start_pos=keep * ps)
        side.rows[rid] = row[: keep * ps]
        return
    del side.rows[rid]
    if method == "slots" and in_group and len(row) > 1:
        j = 1 + cut % (len(row) - 1)  # two calls that may share a page: freed once
        a.free(row[:j])
        a.free(row[j:])
    elif method == "slots":
        a.free(row)
    elif method == "page_ids":
        a.free_page_ids(row[::ps].long() // ps)
    else:  # segments (free_kv_row), truncate of a one-page request
        a.free_segments([(row, 0)])


def _check(mine: Side, theirs: Side, ps: int):
    assert mine.a.available_size() == theirs.a.available_size()
    assert sorted(len(r) for r in mine.rows.values()) == sorted(
        len(r) for r in theirs.rows.values()
    )
    held: set[int] = set()
    n_slots = 0
    for row in mine.rows.values():
        pages = set((row.long() // ps).tolist())
        assert not pages & held, "a page is held by two requests"
        held |= pages
        n_slots += len(row)
    slots = torch.cat(list(mine.rows.values())) if mine.rows else torch.empty(0)
    assert torch.unique(slots).numel() == n_slots, "a slot handed out twice"
    assert set(mine.a.page_allocator.allocated_pages().tolist()) == held, "a page leaked"
    assert set(mine.a.get_all_free_pages().tolist()).isdisjoint(held)
    mine.a.page_allocator.check_invariants()


@pytest.mark.parametrize("ps,need_sort", CASES, ids=CASE_IDS)
@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_calls_match_sglang(ps, need_sort, data):
    size = POOL_PAGES * ps
    mine, theirs = Side(ours(size, ps, need_sort)), Side(stock(size, ps, need_sort))
    next_rid = 0
    empty = torch.empty(0, dtype=torch.int32)
    for _ in range(OPS):
        live = sorted(mine.rows)
        op = data.draw(
            st.sampled_from(
                ["extend", "decode", "alloc", "free", "group"] if live else ["extend", "alloc"]
            )
        )
        avail = mine.a.available_size()
        if op in ("extend", "decode", "alloc"):
            if op == "extend":
                cont = data.draw(
                    st.lists(st.sampled_from(live), unique=True, max_size=3)
                    if live
                    else st.just([])
                )
                n_new = data.draw(st.integers(0 if cont else 1, 3))
                rids = cont + list(range(next_rid, next_rid + n_new))
                lens = [data.draw(st.integers(1, 3 * ps)) for _ in rids]
            elif op == "decode":
                rids = data.draw(st.lists(st.sampled_from(live), unique=True, min_size=1))
                lens = [1] * len(rids)
            else:
                rids, lens = [next_rid], [ps * data.draw(st.integers(1, 4))]
            outs = []
            for side in (mine, theirs):
                rows = [side.rows.get(r, empty) for r in rids]
                if op == "extend":
                    outs.append(extend(side.a, ps, rows, lens))
                elif op == "decode":
                    outs.append(decode(side.a, ps, rows))
                else:
                    outs.append(side.a.alloc(lens[0]))
            assert (outs[0] is None) == (outs[1] is None), (op, rids, lens)
            if outs[0] is None:  # out of memory: nothing changed
                event(f"{op} out of memory")
                assert mine.a.available_size() == avail
            else:
                next_rid = max([next_rid] + [r + 1 for r in rids])
                for side, out in zip((mine, theirs), outs):
                    for r, part in zip(rids, split(out, lens)):
                        side.rows[r] = torch.cat((side.rows.get(r, empty), part))
        else:
            k = 1 if op == "free" else data.draw(st.integers(1, min(3, len(live))))
            picks = data.draw(st.lists(st.sampled_from(live), unique=True, min_size=k, max_size=k))
            plan = [
                (r, data.draw(st.sampled_from(FREE_METHODS)), data.draw(st.integers(0, 99)))
                for r in picks
            ]
            for side in (mine, theirs):
                if op == "group":
                    side.a.free_group_begin()
                for r, method, cut in plan:
                    _release(side, ps, r, method, cut, op == "group")
                if op == "group":
                    assert side.a.available_size() == avail  # held until the end
                    side.a.free_group_end()
        _check(mine, theirs, ps)
