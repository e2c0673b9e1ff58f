"""Random sequences of alloc / free / free_group / alloc_extend / alloc_decode / reset
against a plain Python model (the set of owned pages; per request its length and pages;
the order pages are handed out in: sglang's need_sort, a sorted list and the staged
frees, sorted in when a call's bound exceeds the sorted list), with check_invariants()
after every step.  Derandomized, so CI sees the same sequences
every run."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from kvmem.allocator import PageAllocator
from kvmem.errors import DoubleFreeError, OutOfPagesError
from tests.util import examples


class Req:
    def __init__(self):
        self.len = 0
        self.pages: dict[int, int] = {}  # page index in the request -> page id

    def last_loc(self, ps: int) -> int:
        if self.len == 0:
            return -1
        return self.pages[(self.len - 1) // ps] * ps + (self.len - 1) % ps


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(ps=st.sampled_from([1, 2, 4]), num_pages=st.integers(2, 40))
    def setup(self, ps, num_pages):
        self.ps, self.N = ps, num_pages
        self.a = PageAllocator(num_pages, ps)
        self.reset_model()

    def reset_model(self):
        self.sorted_part = list(range(1, self.N))  # handed out from the front
        self.staged: list[int] = []  # freed since the last sort
        self.owned: set[int] = set()
        self.chunks: list[list[int]] = []  # what alloc(n) handed out, not freed yet
        self.reqs: list[Req] = []

    # -- checks against the model ----------------------------------------------------

    @invariant()
    def consistent(self):
        self.a.check_invariants()
        assert self.a.num_allocated == len(self.owned)
        assert self.a.num_free == self.N - 1 - len(self.owned)
        owned = set(torch.nonzero(self.a._owned).flatten().tolist())
        assert owned == self.owned

    def expect(self, n: int, bound: int) -> list[int]:
        """The n pages the order model hands out to a call whose bound is ``bound``."""
        if bound > len(self.sorted_part) and self.staged:
            self.sorted_part = sorted(self.sorted_part + self.staged)
            self.staged = []
        out, self.sorted_part = self.sorted_part[:n], self.sorted_part[n:]
        return out

    def take_new(self, pages, bound):
        """Pages just handed out: real pages, distinct, none owned before, in the order
        model's order."""
        assert pages == self.expect(len(pages), bound)
        assert len(set(pages)) == len(pages)
        for p in pages:
            assert 1 <= p < self.N and p not in self.owned
        self.owned.update(pages)

    # -- alloc / free ------------------------------------------------------------------

    @rule(n=st.integers(0, 6), check=st.booleans())
    def alloc(self, n, check):
        if n > self.a.num_free:
            free = self.a.num_free
            try:
                self.a.alloc(n, check=check)
                raise AssertionError("no OutOfPagesError")
            except OutOfPagesError as e:
                assert (e.requested, e.available) == (n, free)
            return
        pages = self.a.alloc(n, check=check).tolist()
        assert len(pages) == n
        self.take_new(pages, n)
        if pages:
            self.chunks.append(pages)

    def pick_frees(self, data, k):
        """Up to k lists of pages to free: whole alloc chunks or finished requests."""
        out = []
        for _ in range(k):
            choices = len(self.chunks) + len(self.reqs)
            if choices == 0:
                break
            i = data.draw(st.integers(0, choices - 1))
            if i < len(self.chunks):
                out.append(self.chunks.pop(i))
            else:
                req = self.reqs.pop(i - len(self.chunks))
                out.append(sorted(req.pages.values()))
        return out

    def spoil(self, data, pages):
        """A copy of ``pages`` with one entry that may not be freed."""
        unowned = [p for p in range(1, self.N) if p not in self.owned]
        bad = data.draw(
            st.sampled_from(
                ["zero", "out_of_range"]
                + (["twice"] if pages else [])
                + (["not_allocated"] if unowned else [])
            )
        )
        extra = {
            "zero": 0,
            "out_of_range": self.N,
            "twice": pages[0] if pages else 0,
            "not_allocated": unowned[0] if unowned else 0,
        }[bad]
        pos = data.draw(st.integers(0, len(pages)))
        return pages[:pos] + [extra] + pages[pos:]

    @rule(data=st.data(), check=st.booleans(), spoil=st.booleans())
    def free(self, data, check, spoil):
        lists = self.pick_frees(data, 1)
        if not lists:
            return
        pages = lists[0]
        if spoil:
            try:
                self.a.free(self.spoil(data, pages), check=check)
                raise AssertionError("no DoubleFreeError")
            except DoubleFreeError:
                pass
            self.chunks.append(pages)  # still owned; free it later
            return
        self.a.free(
            torch.tensor(pages, dtype=torch.int64) if data.draw(st.booleans()) else pages,
            check=check,
        )
        self.owned.difference_update(pages)
        self.staged += pages

    @rule(data=st.data(), k=st.integers(0, 3), spoil=st.booleans(), body_raises=st.booleans())
    def free_group(self, data, k, spoil, body_raises):
        lists = self.pick_frees(data, k)
        to_free = list(lists)
        if spoil and lists:
            to_free[-1] = self.spoil(data, lists[-1])
        try:
            with self.a.free_group():
                for pages in to_free:
                    with self.a.free_group():  # nesting changes nothing
                        self.a.free(pages)
                    assert self.a.num_allocated == len(self.owned)  # nothing applied yet
                if body_raises:
                    raise KeyError("body")
            assert not body_raises
        except DoubleFreeError:
            assert spoil and lists
            self.chunks.extend(lists)  # nothing was freed
            return
        except KeyError:
            assert body_raises
        for pages in lists:
            self.owned.difference_update(pages)
            self.staged += pages

    # -- requests --------------------------------------------------------------------

    @rule(data=st.data(), n_fresh=st.integers(0, 3), check=st.booleans(), hints=st.booleans())
    def extend(self, data, n_fresh, check, hints):
        ps = self.ps
        old = (
            data.draw(st.lists(st.sampled_from(range(len(self.reqs))), unique=True, max_size=3))
            if self.reqs
            else []
        )
        batch = [self.reqs[i] for i in old] + [Req() for _ in range(n_fresh)]
        pre = [r.len for r in batch]
        seq = [p + data.draw(st.integers(0, 2 * ps + 1)) for p in pre]
        last = [r.last_loc(ps) for r in batch]
        need = sum(-(-s // ps) - -(-p // ps) for p, s in zip(pre, seq))
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        kw = dict(prefix_lens_cpu=t(pre), seq_lens_cpu=t(seq)) if hints else {}
        if need > self.a.num_free:
            try:
                self.a.alloc_extend(t(pre), t(seq), t(last), check=check, **kw)
                raise AssertionError("no OutOfPagesError")
            except OutOfPagesError as e:
                assert e.requested == need
            return
        slots = self.a.alloc_extend(t(pre), t(seq), t(last), check=check, **kw).tolist()
        assert len(slots) == sum(seq) - sum(pre)
        new_pages = []
        k = 0
        for r, p, s in zip(batch, pre, seq):
            for pos in range(p, s):
                page, off = divmod(slots[k], ps)
                k += 1
                assert off == pos % ps
                if pos // ps in r.pages:  # the request's partial last page
                    assert page == r.pages[pos // ps]
                else:
                    assert pos % ps == 0  # a new page starts at a page boundary
                    r.pages[pos // ps] = page
                    new_pages.append(page)
            r.len = s
        assert len(new_pages) == need
        self.take_new(new_pages, (sum(seq) - sum(pre)) // ps + len(batch) + 1)
        self.reqs += batch[len(old) :]

    @rule(data=st.data(), check=st.booleans(), hints=st.booleans())
    def decode(self, data, check, hints):
        ps = self.ps
        live = [r for r in self.reqs if r.len > 0]
        if not live:
            return
        batch = data.draw(st.lists(st.sampled_from(live), unique_by=id, min_size=1, max_size=4))
        seq = torch.tensor([r.len + 1 for r in batch])
        last = torch.tensor([r.last_loc(ps) for r in batch])
        need = sum(1 for r in batch if r.len % ps == 0)
        kw = dict(seq_lens_cpu=seq) if hints else {}
        if need > self.a.num_free:
            try:
                self.a.alloc_decode(seq, last, check=check, **kw)
                raise AssertionError("no OutOfPagesError")
            except OutOfPagesError:
                pass
            return
        slots = self.a.alloc_decode(seq, last, check=check, **kw).tolist()
        new_pages = []
        for r, slot in zip(batch, slots):
            page, off = divmod(slot, ps)
            pos = r.len
            assert off == pos % ps
            if pos % ps == 0:
                r.pages[pos // ps] = page
                new_pages.append(page)
            else:
                assert page == r.pages[pos // ps] and slot == r.last_loc(ps) + 1
            r.len += 1
        self.take_new(new_pages, len(batch))

    @rule(roll=st.integers(0, 7))
    def reset(self, roll):
        if roll:  # rarely: a reset wipes out the state the other rules build up
            return
        self.a.reset()
        self.reset_model()
        assert self.a.alloc(min(3, self.N - 1)).tolist() == list(range(1, min(3, self.N - 1) + 1))
        self.a.reset()


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(
    max_examples=examples(300),
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    database=None,
)


def test_machine_finds_a_planted_bug(monkeypatch):
    """The machine can fail: with an allocator that hands out a freed page twice (it
    forgets to mark pages owned), some sequence trips the model or the invariants."""
    from kvmem.kernels import alloc as K

    def broken_take(ring, owned, head, n):  # numpy views, as the allocator passes them
        idx = [(head + k) % ring.shape[0] for k in range(n)]
        return torch.from_numpy(ring[idx].copy())

    monkeypatch.setattr(K, "take_pages_cpu", broken_take)
    quick = settings(
        max_examples=20,
        stateful_step_count=10,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    with pytest.raises(AssertionError):
        run_state_machine_as_test(AllocatorMachine, settings=quick)
