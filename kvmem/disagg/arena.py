"""Arena: byte ranges of one registered buffer, handed out first-fit.

The prefill side packs chunks into slots of its registered staging buffer; the decode
side reserves, per request, a landing region of its registered landing buffer that the
prefill writes into.  Both are an :class:`Arena`.

Invariants: the free ranges are sorted, disjoint, coalesced (no two touch), and with the
allocated ones they tile ``[0, size)``; ``free_bytes + used_bytes == size``.  Costs are
O(free ranges) per call: a few dozen at most here.
"""

from __future__ import annotations

import bisect


class ArenaFullError(Exception):
    """No free range is large enough.  Nothing changed."""


class Arena:
    def __init__(self, size: int, align: int = 256):
        if size <= 0 or align <= 0 or align & (align - 1):
            raise ValueError(
                f"Arena: size must be > 0 and align a power of two, got {size}, {align}"
            )
        self.size = size - size % align
        self.align = align
        self._starts = [0]  # free ranges, sorted by start
        self._ends = [self.size]
        self._used: dict[int, int] = {}  # start -> length (aligned)

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    @property
    def free_bytes(self) -> int:
        return self.size - self.used_bytes

    def __len__(self) -> int:
        return len(self._used)

    def alloc(self, nbytes: int) -> int:
        """Offset of a free range of ``nbytes`` (rounded up to ``align``)."""
        if nbytes <= 0:
            raise ValueError(f"Arena.alloc: nbytes must be > 0, got {nbytes}")
        need = -(-nbytes // self.align) * self.align
        for i, (s, e) in enumerate(zip(self._starts, self._ends)):
            if e - s >= need:
                if e - s == need:
                    del self._starts[i], self._ends[i]
                else:
                    self._starts[i] = s + need
                self._used[s] = need
                return s
        largest = max((e - s for s, e in zip(self._starts, self._ends)), default=0)
        raise ArenaFullError(
            f"arena: {nbytes} bytes asked, largest free range is {largest} "
            f"of {self.free_bytes} free"
        )

    def free(self, offset: int) -> None:
        need = self._used.pop(offset, None)
        if need is None:
            raise ValueError(f"Arena.free: offset {offset} is not allocated")
        s, e = offset, offset + need
        i = bisect.bisect_left(self._starts, s)
        if i > 0 and self._ends[i - 1] == s:  # merge with the range before
            i -= 1
            s = self._starts[i]
            del self._starts[i], self._ends[i]
        if i < len(self._starts) and self._starts[i] == e:  # and the one after
            e = self._ends[i]
            del self._starts[i], self._ends[i]
        self._starts.insert(i, s)
        self._ends.insert(i, e)

    def check_invariants(self) -> None:
        spans = sorted(
            [(s, e, "free") for s, e in zip(self._starts, self._ends)]
            + [(s, s + n, "used") for s, n in self._used.items()]
        )
        pos = 0
        for s, e, _ in spans:
            assert s == pos and e > s, (
                f"arena ranges do not tile [0, {self.size}) at {pos}: {spans}"
            )
            pos = e
        assert pos == self.size, f"arena ranges end at {pos}, size {self.size}"
        for a, b in zip(self._ends, self._starts[1:]):
            assert a < b, f"free ranges touch or overlap at {a}"
