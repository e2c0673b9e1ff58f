"""kvmem.transfer.runs: page pairs merged into runs, runs into descriptors.  What both PD
lifecycles rely on: expanding the runs gives back the pairs (in the order given, or sorted
by source); pairs adjacent on both sides merge; no run continues across a break on either
side; every merge the order allows is made; a descriptor covers its run's pages on one
plane and no other."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.util import examples

from kvmem.transfer.runs import PageRuns, descriptors, merge_runs

_ids = st.integers(min_value=0, max_value=40)
# pairs drawn as runs of adjacent pairs, so that merges are common, not luck
_pairs = st.lists(
    st.tuples(_ids, _ids, st.integers(min_value=1, max_value=5)), min_size=0, max_size=12
).map(
    lambda spans: (
        [s + i for s, _, n in spans for i in range(n)],
        [d + i for _, d, n in spans for i in range(n)],
    )
)


def _as_list(runs: PageRuns):
    return list(zip(runs.src.tolist(), runs.dst.tolist(), runs.length.tolist()))


def _check_maximal(runs: PageRuns) -> None:
    """Each run is at least one pair; no run continues the one before it on both sides."""
    assert (runs.length >= 1).all()
    assert int(runs.length.sum()) == runs.pairs
    end_s, end_d = runs.src[:-1] + runs.length[:-1], runs.dst[:-1] + runs.length[:-1]
    assert not ((end_s == runs.src[1:]) & (end_d == runs.dst[1:])).any()


@settings(max_examples=examples(300), deadline=None)
@given(_pairs)
def test_runs_in_order_expand_to_the_pairs_and_merge_all_they_can(pairs):
    src, dst = pairs
    runs = merge_runs(np.array(src, np.int64), np.array(dst, np.int64), by_source=False)
    es, ed = runs.expand()
    assert es.tolist() == src and ed.tolist() == dst
    _check_maximal(runs)
    # a break between two pairs (either side not +1) is always a run boundary
    breaks = sum(
        1 for i in range(1, len(src)) if src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1
    )
    assert len(runs) == (breaks + 1 if src else 0)


@settings(max_examples=examples(300), deadline=None)
@given(_pairs)
def test_runs_by_source_expand_to_the_pairs_sorted_stably(pairs):
    src, dst = pairs
    runs = merge_runs(np.array(src, np.int64), np.array(dst, np.int64), by_source=True)
    es, ed = runs.expand()
    assert list(zip(es.tolist(), ed.tolist())) == sorted(zip(src, dst), key=lambda p: p[0])
    assert (np.diff(runs.src) >= 0).all()
    _check_maximal(runs)


@settings(max_examples=examples(300), deadline=None)
@given(_pairs, st.integers(min_value=1, max_value=3), st.data())
def test_descriptors_cover_each_run_on_its_own_plane(pairs, planes, data):
    src, dst = pairs
    runs = merge_runs(src, dst, by_source=True)
    count = 64  # pages a plane: every id drawn is below it
    item = np.array(data.draw(st.lists(st.integers(1, 9), min_size=planes, max_size=planes)))
    item = item.astype(np.uint64)
    # planes back to back in memory: a run may end where the next plane begins
    base = (np.cumsum(item * count) - item * count + 4096).astype(np.uint64)
    sa, da, nb = descriptors(runs, base, base + np.uint64(1 << 20), item)
    assert sa.dtype == da.dtype == nb.dtype == np.uint64
    assert sa.shape == da.shape == nb.shape == (planes * len(runs),)
    for p in range(planes):
        cut = slice(p * len(runs), (p + 1) * len(runs))
        lo, hi = int(base[p]), int(base[p]) + count * int(item[p])
        assert ((sa[cut] >= lo) & (sa[cut] + nb[cut] <= hi)).all()  # never leaves plane p
        assert (sa[cut] == base[p] + runs.src.astype(np.uint64) * item[p]).all()
        gap = da[cut].astype(np.int64) - sa[cut].astype(np.int64)
        assert (gap == (1 << 20) + (runs.dst - runs.src) * int(item[p])).all()
        assert (nb[cut] == runs.length.astype(np.uint64) * item[p]).all()
    assert int(nb.sum()) == runs.pairs * int(item.sum())


def test_examples():
    def runs_of(src, dst, by_source):
        return _as_list(merge_runs(np.array(src), np.array(dst), by_source=by_source))

    assert runs_of([5, 1, 3, 2], [50, 10, 30, 20], True) == [
        (1, 10, 1),
        (2, 20, 1),
        (3, 30, 1),
        (5, 50, 1),
    ]
    assert runs_of([3, 1, 2, 7], [13, 11, 12, 9], True) == [(1, 11, 3), (7, 9, 1)]
    assert runs_of([3, 1, 2, 7], [13, 11, 12, 9], False) == [(3, 13, 1), (1, 11, 2), (7, 9, 1)]
    # adjacent on one side only: no merge
    assert runs_of([1, 2, 3], [7, 9, 10], False) == [(1, 7, 1), (2, 9, 2)]
    # a source page sent to two destinations (a shared prefix): both kept
    assert runs_of([1, 1, 2], [5, 9, 10], True) == [(1, 5, 1), (1, 9, 2)]
    # one side's runs: the ids paired with themselves
    assert runs_of([12, 13, 14, 15, 40], [12, 13, 14, 15, 40], False) == [
        (12, 12, 4),
        (40, 40, 1),
    ]
    # any integer dtype and plain sequences, read as int64
    r = merge_runs([4, 5], np.array([0, 1], np.int32), by_source=False)
    assert r.src.dtype == r.dst.dtype == r.length.dtype == np.int64 and _as_list(r) == [(4, 0, 2)]
    empty = merge_runs([], [], by_source=True)
    assert len(empty) == 0 and empty.pairs == 0
    assert [a.tolist() for a in empty.expand()] == [[], []]


def test_malformed_ids_are_refused():
    with pytest.raises(ValueError, match="2 source ids but 3 destination ids"):
        merge_runs([1, 2], [1, 2, 3], by_source=False)
    with pytest.raises(ValueError, match="must be integers"):
        merge_runs(np.array([1.0, 2.0]), [1, 2], by_source=False)
    with pytest.raises(ValueError, match="must be 1-D"):
        merge_runs(np.zeros((2, 2), np.int64), [1, 2], by_source=False)


def test_the_inputs_are_left_as_they_were():
    src, dst = np.array([3, 1, 2]), np.array([13, 11, 12])
    merge_runs(src, dst, by_source=True)
    assert src.tolist() == [3, 1, 2] and dst.tolist() == [13, 11, 12]
