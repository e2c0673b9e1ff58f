"""kvmem's ``take_ahead`` (kvmem_sglang.transfer_ahead) on a deep queue that several
decodes share: sglang's ``FastQueue``, ``TransferKVChunk`` and NIXL ``TransferInfo``, a
``NixlKVManager`` with sglang's own status methods; ``scripts/take_ahead_depth.py`` has the
world and the worker, and the scan it replaced (which looked at every queued chunk, per
send).

What must hold: the same chunks go ahead of their turn, in the same order, as with the
scan (budgets that leave chunks behind, rooms aborted while queued, events pending, writes
that fail or stay in flight); and a send looks at what it can take, not at the queue:
every chunk it looks at is taken, or must wait (an event pending, or a write in flight),
or is found never to go ahead again (once per chunk), where the scan looked at every
chunk queued, per send.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang.sglang_env import run_both

SCRIPT = Path(__file__).parent / "scripts" / "take_ahead_depth.py"


@pytest.fixture(scope="module")
def run() -> dict:
    return run_both(SCRIPT, timeout=240, variants={"run": {}})["run"]


def test_the_same_chunks_go_ahead_in_the_same_order_as_with_the_scan(run):
    index, scan = run["index"]["sends"], run["scan"]["sends"]
    assert [s[:2] for s in index] == [s[:2] for s in scan]
    # the world has what the test is about: writes full before the queue ends, chunks of
    # other decodes between, aborted rooms, pending events, chunks put back
    taken = [len(s[1]) for s in index]
    assert sum(taken) > len(index) and max(taken) >= 3, taken
    assert sum(s[3] for s in scan) > 0  # chunks seen waiting
    assert run["index"]["puts"] > run["index"]["queued"]


def test_a_send_looks_at_what_it_can_take_not_at_the_whole_queue(run):
    # queued: the chunks; puts: those and the ones put back (each read again)
    queued, puts, sends = run["index"]["queued"], run["index"]["puts"], run["index"]["sends"]
    taken = sum(len(s[1]) for s in sends)
    looked = sum(s[2] - s[3] for s in sends)  # less those that had to wait
    waited = sum(s[3] for s in sends)
    scan = sum(s[2] for s in run["scan"]["sends"])
    print(
        f"{queued} chunks of 4 decodes, {len(sends)} sends, {taken} chunks sent ahead: "
        f"looked at {looked} (+{waited} waiting) with the index, {scan} with the scan"
    )
    assert scan > len(sends) * queued / 4  # every chunk still queued, at every send
    assert looked <= taken + puts, (looked, taken, puts)
    stats = run["index"]["stats"]  # the path's own counters say the same
    assert stats["inspected"] == looked + waited, stats
    assert stats["indexed"] <= puts, stats  # each chunk read into the index once a put
