"""The adapter's bounded record of rooms (kvmem_sglang/rooms.py): what it keeps, for how
long, how many, and that a call's cost does not grow with what it holds."""

from __future__ import annotations

import threading
from collections import OrderedDict

import pytest

from kvmem_sglang.rooms import Rooms


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_room_is_kept_until_it_is_taken_or_too_old():
    clock = Clock()
    rooms: Rooms[str] = Rooms(10.0, 100, clock)
    rooms.put(1, "a")
    clock.now = 5.0
    rooms.put(2, "b")
    assert (1 in rooms, rooms.get(2), len(rooms)) == (True, "b", 2)
    assert rooms.pop(1) == "a" and rooms.pop(1, "gone") == "gone"
    clock.now = 15.0
    assert 2 in rooms  # 10 s old
    clock.now = 15.01
    assert 2 not in rooms and rooms.get(2) is None and len(rooms) == 0


def test_a_room_recorded_again_is_kept_from_then():
    clock = Clock()
    rooms: Rooms[int] = Rooms(10.0, 100, clock)
    rooms.put(1, 1)
    rooms.put(2, 2)
    clock.now = 8.0
    rooms.put(1, 3)
    clock.now = 12.0
    assert rooms.get(1) == 3 and 2 not in rooms


def test_past_its_limit_the_oldest_rooms_go_first():
    rooms: Rooms[int] = Rooms(600.0, 3, Clock())
    for room in range(5):
        rooms.put(room, room)
    assert [r in rooms for r in range(5)] == [False, False, True, True, True]
    assert len(rooms) == 3 and rooms.dropped == 2


class CountingEntries(OrderedDict):
    """A table's entries that count how many times they were walked (``items()``)."""

    walked = 0

    def items(self):
        CountingEntries.walked += 1
        return super().items()


def test_a_message_costs_the_same_into_a_full_table_as_into_an_empty_one():
    """One more room, or one lookup, walks the entries the same number of times whatever
    the table holds (the tables the adapter kept before walked every entry on every
    message: 300 messages took 185-330 ms into 5,000-7,000 entries); counted, not
    timed."""

    def walks(held: int) -> int:
        rooms: Rooms[bool] = Rooms(600.0, 100_000, Clock())
        for r in range(held):
            rooms.put(r, True)
        rooms._entries = CountingEntries(rooms._entries)
        CountingEntries.walked = 0
        for r in range(held, held + 300):
            rooms.put(r, True)
            _ = r in rooms
        return CountingEntries.walked

    empty, full = walks(0), walks(50_000)
    assert full <= empty + 1 <= 601, (empty, full)  # the empty table skips its first walk


def test_expiry_drops_each_room_once():
    clock = Clock()
    rooms: Rooms[int] = Rooms(1.0, 10_000, clock)
    for r in range(5_000):
        rooms.put(r, r)
    clock.now = 2.0
    rooms.put(-1, 0)  # drops the 5,000 old ones now, once
    assert len(rooms._entries) == 1


def test_threads_never_break_it():
    rooms: Rooms[int] = Rooms(600.0, 1000)
    start = threading.Barrier(4)

    def work(k: int) -> None:
        start.wait()
        for i in range(5000):
            rooms.put(k * 10_000 + i, i)
            rooms.pop(k * 10_000 + i - 3)
            _ = (k * 10_000 + i - 1) in rooms

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(rooms) <= 1000


@pytest.mark.parametrize("keep_s, limit", [(0, 10), (10, 0), (-1, 10)])
def test_nonsense_sizes_are_refused(keep_s, limit):
    with pytest.raises(ValueError, match="must be positive"):
        Rooms(keep_s, limit)
