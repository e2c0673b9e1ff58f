"""The search structure under kvmem's send path's queue index
(kvmem_sglang/transfer_queue.py, ``PeerChunks``): one peer's queued chunks in queue order,
searched for the first at or after a position with at most a number of pages.  Checked
against a plain scan of the same chunks over a seeded run of appends, departures from the
head, forgotten chunks and searches, with the structure's invariants after every step.
(The index over sglang's real queue: tests/sglang/test_take_ahead_depth.py.)"""

from __future__ import annotations

import random

import pytest

from kvmem_sglang.transfer_queue import NEVER, PeerChunks


def _check(pc: PeerChunks) -> None:
    size, tree = pc._size, pc._tree
    assert pc.base <= pc.head <= pc.base + len(pc.chunks) <= pc.base + size
    assert tree[size : size + len(pc.pages)] == pc.pages
    assert all(v == NEVER for v in tree[size + len(pc.pages) :])
    assert all(tree[j] == min(tree[2 * j], tree[2 * j + 1]) for j in range(1, size))
    assert all(p == NEVER for p in pc.pages[: pc.head - pc.base])  # gone


def _first(pages: dict, head: int, start: int, limit: int) -> int:
    return next((p for p in sorted(pages) if p >= max(start, head) and pages[p] <= limit), -1)


@pytest.mark.parametrize("seed", range(4))
def test_the_search_finds_what_a_scan_finds(seed):
    rng = random.Random(seed)
    pc, pages, head, end = PeerChunks(), {}, 0, 0  # pages: position -> count, as a scan sees
    for _ in range(1500):
        op = rng.random()
        if op < 0.4:
            n = rng.randint(1, 40)
            assert pc.append(f"chunk {end}", n) == end
            pages[end] = n
            end += 1
        elif op < 0.6 and head < end:
            pc.gone(head)  # the worker took this peer's first chunk
            pages[head] = NEVER
            head += 1
        elif op < 0.7 and head < end:
            pos = rng.randrange(head, end)
            pc.forget(pos)
            pages[pos] = NEVER
        else:
            start, limit = rng.randrange(0, end + 2), rng.randint(0, 45)
            got = pc.first(start, limit)
            assert got == _first(pages, head, start, limit), (start, limit)
            if got >= 0:
                assert pc.chunk(got) == f"chunk {got}"
        _check(pc)
    assert pc.head == head
