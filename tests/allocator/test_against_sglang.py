"""kvmem's PageAllocator against sglang 0.5.23's own allocators, constructed for real on
CPU (where sglang runs its torch fallbacks ``alloc_extend_naive`` / ``alloc_decode_naive``):
from a fresh or reset allocator both hand out the same pages and token slots.

sglang is imported here only (``import kvmem`` never imports it)."""

from __future__ import annotations

import random

import pytest
import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.paged import alloc_decode_naive, alloc_extend_naive

from kvmem.allocator import PageAllocator
from kvmem.kernels import alloc as K


def sglang_paged(num_pages: int, ps: int) -> PagedTokenToKVPoolAllocator:
    # kvmem's num_pages counts the padding page: sglang's size is (num_pages - 1) * ps
    return PagedTokenToKVPoolAllocator(
        size=(num_pages - 1) * ps,
        page_size=ps,
        dtype=torch.bfloat16,
        device="cpu",
        kvcache=None,
        need_sort=True,
    )


def sglang_token(num_pages: int) -> TokenToKVPoolAllocator:
    return TokenToKVPoolAllocator(
        size=num_pages - 1, dtype=torch.bfloat16, device="cpu", kvcache=None, need_sort=True
    )


def as_slots(pages: torch.Tensor, ps: int) -> torch.Tensor:
    return (pages[:, None] * ps + torch.arange(ps)).reshape(-1)


@pytest.mark.parametrize("ps", [16, 64])
def test_alloc_matches_paged_allocator(ps):
    num_pages = 41
    ours, theirs = PageAllocator(num_pages, ps), sglang_paged(num_pages, ps)
    for round_ in range(2):
        held = []
        for n in [1, 3, 0, 7, 12, 17]:
            want = theirs.alloc(n * ps)
            if want is None:  # sglang: out of pages
                with pytest.raises(kvmem_out_of_pages()):
                    ours.alloc(n)
                continue
            got = ours.alloc(n)
            assert torch.equal(as_slots(got, ps), want)
            assert ours.num_free * ps == theirs.available_size()
            held.append((got, want))
        for got, want in held:  # free everything, then reset: same order again
            ours.free(got)
            theirs.free(want)
        assert ours.num_free * ps == theirs.available_size()
        ours.reset()
        theirs.clear()
        ours.check_invariants()


def test_alloc_matches_token_allocator():
    num_pages = 30
    ours, theirs = PageAllocator(num_pages, 1), sglang_token(num_pages)
    for round_ in range(2):
        for n in [1, 4, 0, 9, 20]:
            want = theirs.alloc(n)
            if want is None:
                with pytest.raises(kvmem_out_of_pages()):
                    ours.alloc(n)
                continue
            assert torch.equal(ours.alloc(n), want)
            assert ours.num_free == theirs.available_size()
        ours.reset()
        theirs.clear()


def kvmem_out_of_pages():
    from kvmem.errors import OutOfPagesError

    return OutOfPagesError


class Requests:
    """Per-request lengths and token slots, driven through two allocators at once."""

    def __init__(self, ps: int, rng: random.Random):
        self.ps, self.rng = ps, rng
        self.lens: list[int] = []
        self.slots: list[list[int]] = []

    def extend_batch(self, n_new: int, n_old: int, max_len: int):
        """A batch of n_new fresh requests and n_old continued ones (chunked prefill)."""
        old = self.rng.sample(range(len(self.lens)), min(n_old, len(self.lens)))
        pre, seq, last, who = [], [], [], []
        for i in old:
            pre.append(self.lens[i])
            seq.append(self.lens[i] + self.rng.randrange(0, max_len))
            last.append(self.slots[i][-1] if self.slots[i] else -1)
            who.append(i)
        for _ in range(n_new):
            self.lens.append(0)
            self.slots.append([])
            pre.append(0)
            seq.append(self.rng.randrange(0, max_len))
            last.append(-1)
            who.append(len(self.lens) - 1)
        return who, torch.tensor(pre), torch.tensor(seq), torch.tensor(last)

    def record_extend(self, who, pre, seq, out):
        k = 0
        for i, p, s in zip(who, pre.tolist(), seq.tolist()):
            self.slots[i] += out[k : k + s - p].tolist()
            self.lens[i] = s
            k += s - p

    def decode_batch(self):
        who = [i for i in range(len(self.lens)) if self.lens[i] > 0]
        seq = torch.tensor([self.lens[i] + 1 for i in who], dtype=torch.int64)
        last = torch.tensor([self.slots[i][-1] for i in who], dtype=torch.int64)
        return who, seq, last

    def record_decode(self, who, out):
        for i, s in zip(who, out.tolist()):
            self.slots[i].append(s)
            self.lens[i] += 1


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("ps", [1, 16, 64])
def test_extend_and_decode_match_sglang(ps, seed):
    """Rounds of extend (fresh and chunked requests) and decode steps; each call's slots
    equal those of sglang's PagedTokenToKVPoolAllocator (for page_size 1, whose decode
    sglang serves with TokenToKVPoolAllocator, that one's alloc); then everything is
    reset and it starts again."""
    num_pages = 400
    rng = random.Random(seed)
    ours, theirs = PageAllocator(num_pages, ps), sglang_paged(num_pages, ps)
    token = sglang_token(num_pages) if ps == 1 else None
    for round_ in range(2):
        reqs = Requests(ps, rng)
        for step in range(8):
            if step % 3 == 2:
                who, seq, last = reqs.decode_batch()
                got = ours.alloc_decode(seq, last, seq_lens_cpu=seq, check=step % 2 == 0)
                if token is not None:
                    want = token.alloc(len(who))
                    theirs.free_pages = theirs.free_pages[len(who) :]  # keep it in step
                else:
                    want = theirs.alloc_decode(seq, seq, last)
                assert torch.equal(got, want)
                reqs.record_decode(who, got)
            else:
                who, pre, seq, last = reqs.extend_batch(rng.randrange(1, 5), 3, 3 * ps + 5)
                total = int((seq - pre).sum())
                hints = dict(prefix_lens_cpu=pre, seq_lens_cpu=seq) if step % 2 else {}
                got = ours.alloc_extend(
                    pre, seq, last, extend_num_tokens=total, **hints, check=step % 4 != 1
                )
                want = theirs.alloc_extend(pre, pre, seq, seq, last, total)
                if token is not None:
                    assert torch.equal(token.alloc(total), want)
                assert torch.equal(got, want)
                reqs.record_extend(who, pre, seq, got)
            assert ours.num_free * ps == theirs.available_size()
            ours.check_invariants()
        # every page of every request back, then both reset
        pages = sorted({s // ps for r in reqs.slots for s in r})
        ours.free(torch.tensor(pages))
        assert ours.num_allocated == 0
        ours.reset()
        theirs.clear()
        if token is not None:
            token.clear()


@pytest.mark.parametrize("ps", [1, 4, 16, 64])
def test_extend_slots_match_alloc_extend_naive(ps):
    """The slot computation alone, against sglang's alloc_extend_naive, for random
    batches and a shuffled free list (any order of new pages)."""
    rng = random.Random(ps)
    for trial in range(25):
        bs = rng.randrange(1, 12)
        pre = [rng.choice([0, rng.randrange(0, 5 * ps + 1)]) for _ in range(bs)]
        seq = [p + rng.choice([0, 1, ps, rng.randrange(0, 4 * ps + 2)]) for p in pre]
        last = [rng.randrange(1, 90) * ps + (p - 1) % ps if p else -1 for p in pre]
        pre_t, seq_t, last_t = (torch.tensor(x, dtype=torch.int64) for x in (pre, seq, last))
        free_pages = torch.randperm(400, generator=torch.Generator().manual_seed(trial)) + 1
        num_new, total = (int(v) for v in K.extend_counts(pre_t, seq_t, ps))
        want = torch.empty(total, dtype=torch.int64)
        alloc_extend_naive(pre_t, seq_t, last_t, free_pages, want, ps, "cpu")
        got = K.extend_slots_torch(pre_t, seq_t, last_t, free_pages[:num_new], ps, total)
        assert torch.equal(got, want), (pre, seq)
        assert torch.equal(K.extend_slots_ref(pre_t, seq_t, last_t, free_pages[:num_new], ps), want)


@pytest.mark.parametrize("ps", [4, 16, 64])
def test_decode_slots_match_alloc_decode_naive(ps):
    rng = random.Random(ps)
    for trial in range(25):
        bs = rng.randrange(1, 20)
        seq = [rng.choice([1, ps + 1, rng.randrange(1, 6 * ps)]) for _ in range(bs)]
        last = [rng.randrange(1, 90) * ps + (s - 2) % ps for s in seq]
        seq_t, last_t = torch.tensor(seq), torch.tensor(last)
        free_pages = torch.randperm(300, generator=torch.Generator().manual_seed(trial)) + 1
        num_new = int(K.decode_counts(seq_t, ps))
        want = torch.empty(bs, dtype=torch.int64)
        alloc_decode_naive(seq_t, last_t, free_pages, want, ps, num_new)
        got = K.decode_slots_torch(seq_t, last_t, free_pages[:num_new], ps)
        assert torch.equal(got, want), seq
