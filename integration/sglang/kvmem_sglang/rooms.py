"""A bounded record of bootstrap rooms, each with a value and the time it was recorded.

The adapter remembers rooms it learned something about before sglang asks (a decode's
ABORT that came before the request, a room refused before its decode's metadata came, a
failure's answer on its way from the listener thread to the scheduler).  Rooms come from
peers and clients: a table of them must not grow without bound or cost more per message
as it fills, whatever a peer sends.  :class:`Rooms` costs O(1) amortized per call: entries
are kept in the order they were recorded, which is also the order they expire in, so
expiry only ever looks at the oldest; past ``limit`` entries the oldest goes first.

Standard library only.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")

# How long the adapter keeps a remembered room: sglang's default bootstrap plus waiting
# timeouts (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT + SGLANG_DISAGGREGATION_WAITING_TIMEOUT,
# 300 s each), past which neither a request nor its decode's metadata is still coming.
KEEP_S = 600.0
# How many rooms one of its tables keeps at most (the oldest go first): at 8,192 rooms a
# table holds its records the whole KEEP_S up to 13 new rooms a second, and the 32 s of a
# decode's repeated ABORTs (kvmem_sglang.chase) up to 250 a second.  A guess at what a
# prefill serves, not a measurement; about 1 MiB a table when full.
ROOM_LIMIT = 8192


class Rooms(Generic[V]):
    """Room -> value, each kept at most ``keep_s`` seconds after it was recorded and at
    most ``limit`` of them (the oldest dropped first).  Every method is safe from any
    thread and costs O(1) amortized (one dict operation, plus the expired entries it
    drops, each dropped once).  ``clock``: monotonic seconds (tests pass their own)."""

    def __init__(
        self, keep_s: float, limit: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if keep_s <= 0 or limit <= 0:
            raise ValueError(f"keep_s and limit must be positive, got {keep_s} and {limit}")
        self.keep_s = float(keep_s)
        self.limit = int(limit)
        self._clock = clock
        self._entries: OrderedDict[int, tuple[float, V]] = OrderedDict()
        self._lock = threading.Lock()  # guards _entries
        # for a caller's steps that must not interleave with another thread's (a check of
        # this table and a change elsewhere); never taken by the methods here
        self.guard = threading.RLock()
        self.dropped = 0  # entries dropped for room (not by age), since made

    def _expire(self, now: float) -> None:
        entries = self._entries
        while entries:
            room, (when, _) = next(iter(entries.items()))
            if now - when <= self.keep_s:
                return
            del entries[room]

    def put(self, room: int, value: V) -> None:
        """Record ``room`` with ``value`` now (a room recorded again moves to the back)."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            self._entries.pop(room, None)
            self._entries[room] = (now, value)
            while len(self._entries) > self.limit:
                self._entries.popitem(last=False)
                self.dropped += 1

    def pop(self, room: int, default: V | None = None) -> V | None:
        """Forget ``room``; its value, or ``default`` when it is not recorded (or expired)."""
        with self._lock:
            self._expire(self._clock())
            entry = self._entries.pop(room, None)
            return default if entry is None else entry[1]

    def get(self, room: int, default: V | None = None) -> V | None:
        """The value of ``room``, or ``default``."""
        with self._lock:
            self._expire(self._clock())
            entry = self._entries.get(room)
            return default if entry is None else entry[1]

    def __contains__(self, room: object) -> bool:
        with self._lock:
            self._expire(self._clock())
            return room in self._entries

    def __len__(self) -> int:
        with self._lock:
            self._expire(self._clock())
            return len(self._entries)


def rooms_of(table, obj) -> Rooms:
    """The :class:`Rooms` ``table`` (a ``kvmem_sglang.state.SideTable``) keeps for
    ``obj``, made with :data:`KEEP_S` and :data:`ROOM_LIMIT` on first use."""
    return table.setdefault(obj, lambda: Rooms(KEEP_S, ROOM_LIMIT))
