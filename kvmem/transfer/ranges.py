"""Range checks of kvmem.transfer: ``(addr, nbytes)`` pairs as int64 arrays, region sets that
must be disjoint and end within int64, the sorted region index a write's ranges are located
in, the cutting of a local and a remote list of one byte stream at each other's
boundaries, and the quick path of a common write of a few ranges.  Pure functions over
numbers; the engine (:mod:`kvmem.transfer.engine`) calls them."""

from __future__ import annotations

import bisect

import numpy as np

INT64_MAX = (1 << 63) - 1  # every address and end (addr + nbytes) must fit: ranges are int64


class RegionIndex:
    """Regions sorted by address (disjoint: register and add_peer refuse overlaps), built
    once per registration or snapshot: numpy arrays for long range lists, Python lists
    for bisect on the few ranges of a common write."""

    def __init__(self, regions, keys=None):
        order = sorted(range(len(regions)), key=lambda i: regions[i][0])
        self.starts_l = [int(regions[i][0]) for i in order]
        self.ends_l = [int(regions[i][0]) + int(regions[i][1]) for i in order]
        self.keys = None if keys is None else [keys[i] for i in order]
        self.starts = np.array(self.starts_l, dtype=np.int64)
        self.ends = np.array(self.ends_l, dtype=np.int64)

    def find(self, addr: int, nbytes: int) -> int:
        """Index of the region holding ``[addr, addr + nbytes)`` whole, or -1."""
        i = bisect.bisect_right(self.starts_l, addr) - 1
        return i if i >= 0 and addr + nbytes <= self.ends_l[i] else -1


# Range lists up to this long take the pure-Python path of post_write: a guess
# (docs/transfer.md, "Costs").
_FEW = 8


def few_pairs(ranges):
    """``ranges`` as a list of (addr, nbytes) Python ints when it is a short list of
    valid pairs (both > 0, end within int64); None otherwise (the numpy path then checks
    and words the error)."""
    if not isinstance(ranges, (list, tuple)) or not 0 < len(ranges) <= _FEW:
        return None
    out = []
    for r in ranges:
        if not isinstance(r, (list, tuple)) or len(r) != 2:
            return None
        a, n = r
        if type(a) is not int or type(n) is not int or a <= 0 or n <= 0 or a > INT64_MAX - n:
            return None
        out.append((a, n))
    return out


def check_regions(regions, what: str, error=ValueError) -> None:
    """``regions``: ``[(addr, nbytes)]`` Python ints.  ``error`` naming the first one
    that is not > 0, whose end passes 2**63 - 1, or that overlaps another."""
    for a, n in regions:
        if a <= 0 or n <= 0 or a > INT64_MAX - n:
            raise error(
                f"{what}: region (addr {a:#x}, nbytes {n}) must have addr > 0, "
                f"nbytes > 0 and addr + nbytes <= 2**63 - 1"
            )
    spans = sorted(regions)
    for (a0, n0), (a1, n1) in zip(spans, spans[1:]):
        if a0 + n0 > a1:
            raise error(
                f"{what}: regions overlap: [{a0:#x}, {a0 + n0:#x}) and [{a1:#x}, {a1 + n1:#x})"
            )


def as_ranges(ranges, what: str) -> np.ndarray:
    """``(addr, nbytes)`` pairs as an int64 ``[n, 2]`` array; ValueError when malformed."""
    try:
        arr = np.asarray(ranges)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what}: ranges must be (addr, nbytes) pairs: {e}") from None
    if arr.size == 0:
        raise ValueError(f"{what}: no ranges given")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what}: ranges must be integers, got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"{what}: ranges must be (addr, nbytes) pairs, got shape {arr.shape}")
    if arr.dtype == np.uint64 and (arr > np.iinfo(np.int64).max).any():
        raise ValueError(f"{what}: an address or size does not fit in int64")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr[:, 0] <= 0) | (arr[:, 1] <= 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"{what}: range {i} = (addr {int(arr[i, 0])}, nbytes {int(arr[i, 1])}): "
            "address and nbytes must be > 0"
        )
    over = np.flatnonzero(arr[:, 0] > INT64_MAX - arr[:, 1])
    if over.size:
        i = int(over[0])
        raise ValueError(
            f"{what}: range {i} = (addr {int(arr[i, 0]):#x}, nbytes "
            f"{int(arr[i, 1])}): addr + nbytes passes 2**63 - 1"
        )
    return arr


def locate(
    ranges: np.ndarray, starts: np.ndarray, ends: np.ndarray, what: str, where: str
) -> np.ndarray:
    """Index of the region (sorted, disjoint ``[starts, ends)``) holding each range whole;
    ValueError naming the first range that no single region holds."""
    idx = np.searchsorted(starts, ranges[:, 0], side="right") - 1
    ok = idx >= 0
    ok[ok] = ranges[ok, 0] + ranges[ok, 1] <= ends[idx[ok]]
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        a, n = int(ranges[i, 0]), int(ranges[i, 1])
        shown = ", ".join(f"[{int(s):#x}, {int(e):#x})" for s, e in zip(starts[:4], ends[:4]))
        more = "" if starts.size <= 4 else f", ... ({starts.size} regions)"
        raise ValueError(
            f"{what}: range {i} [{a:#x}, {a + n:#x}) is not inside one "
            f"registered region of {where} ({shown or 'none'}{more})"
        )
    return idx


def pair_ranges(local: np.ndarray, remote: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Cut two range lists of one byte stream at each other's boundaries: two ``[m, 2]``
    arrays whose i-th rows have equal sizes.  O(n log n) in numpy."""
    lt, rt = int(local[:, 1].sum()), int(remote[:, 1].sum())
    if lt != rt:
        raise ValueError(
            f"{what}: local ranges total {lt} bytes, remote ranges {rt} bytes; they must be equal"
        )
    lc = np.concatenate(([0], np.cumsum(local[:, 1])))
    rc = np.concatenate(([0], np.cumsum(remote[:, 1])))
    cuts = np.union1d(lc, rc)
    s, sizes = cuts[:-1], np.diff(cuts)
    li = np.searchsorted(lc, s, side="right") - 1
    ri = np.searchsorted(rc, s, side="right") - 1
    lo = np.stack([local[li, 0] + (s - lc[li]), sizes], axis=1)
    ro = np.stack([remote[ri, 0] + (s - rc[ri]), sizes], axis=1)
    return lo, ro


def pair_few(local_ranges, remote_ranges, lindex: RegionIndex, rindex: RegionIndex):
    """The common write (a few ranges a side, each inside one region, equal totals, one
    local key): ``(lo, ro, (key,))``; None for anything else, which the engine then checks
    in full (and words the error)."""
    loc, rem = few_pairs(local_ranges), few_pairs(remote_ranges)
    if loc is None or rem is None:
        return None
    keys = set()
    for a, n in loc:
        i = lindex.find(a, n)
        if i < 0:
            return None
        keys.add(lindex.keys[i])
    if len(keys) != 1:
        return None
    for a, n in rem:
        if rindex.find(a, n) < 0:
            return None
    if sum(n for _, n in loc) != sum(n for _, n in rem):
        return None
    lo, ro = np.array(loc, dtype=np.int64), np.array(rem, dtype=np.int64)
    if len(loc) > 1 or len(rem) > 1:
        lo, ro = pair_ranges(lo, ro, "post_write")
    return lo, ro, (keys.pop(),)
