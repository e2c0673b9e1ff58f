"""kvmem's send path under sglang's Mooncake prefill (kvmem_sglang.mooncake_send,
``SGLANG_KVMEM_TRANSFER=kvmem``) against sglang's own send (``SGLANG_KVMEM_TRANSFER=sglang``),
a STOCK decode on the other side, real classes over Mooncake's engine on TCP in two
processes, at Mooncake's default TCP queue (tests/sglang/scenario_transfer_mooncake.py
has the rounds).  Two runs at once, in ``.venv-e2e`` (the environment with Mooncake's
engine; ``make test`` builds it).

What must hold: every room ends as sglang's own send ends it, on both sides; every byte
lands; the chunks queued together go as one merged call; a chunk whose page ids or
pages a GPU is still writing (its CUDA events pending) is not read before they complete;
a room sent ahead of its turn
and then aborted gets its decode's ABORT_ACK only after its write; a failed call leaves
every room with slices in it without an ABORT_ACK (they may still move), and every room it
never posted with one at once; after a release and
a resume the sends work over the new registration; and a request whose pages are
scattered, which sglang posts as one call past Mooncake's TCP queue (its rooms fail),
goes as calls within it and lands.
"""

from __future__ import annotations

import pytest

from tests.sglang.sglang_env import ROOT, mooncake_queue_runs
from tests.sglang.sglang_env import all_are as _all

SCRIPT = ROOT / "tests" / "sglang" / "scenario_transfer_mooncake.py"
SUCCESS, FAILED = 4, 0
PLANES, PAGES = 4, 4  # the small rounds: 2 layers, 64 tokens at page size 16
SCATTERED_SLICES = 64 * 64  # 1,024 tokens at page 16, 32 layers: sglang's slices a request
TCP_QUEUE = 1024  # Mooncake's default, set in both runs


@pytest.fixture(scope="module")
def runs() -> dict:
    return mooncake_queue_runs(SCRIPT, TCP_QUEUE)


def test_stock_decode_receives_every_byte(runs):
    for key in ("kvmem", "sglang"):
        r = runs[key]["plain"]
        assert _all(r["prefill"], SUCCESS) and _all(r["decode"], SUCCESS), (key, r)
        assert r["bad_rows"] == 0 and r["outstanding"] == {}, (key, r)


def test_queued_chunks_go_as_one_merged_call(runs):
    # sglang: one call per request, one slice per page and plane (none adjacent)
    r = runs["sglang"]["plain"]
    assert r["slices_per_request"] == PAGES * PLANES, r
    assert r["stats"]["sends"] == 0 and r["stats"]["writes"] == 0, r
    st = runs["kvmem"]["plain"]["stats"]
    rooms = len(runs["kvmem"]["plain"]["prefill"])
    assert st["batches"] == 1 and st["writes"] == 1 and st["fallbacks"] == 0, st
    assert st["chunks"] == rooms and st["sent_ahead"] == st["ahead_done"] == rooms - 1, st
    assert st["index_pairs"] == rooms * PAGES * PLANES
    # the requests' pages interleave: together they are one run per plane
    assert st["descriptors"] == PLANES, st


def test_abort_of_a_room_sent_ahead_waits_for_its_write(runs):
    want = [SUCCESS, SUCCESS, FAILED, SUCCESS, SUCCESS, SUCCESS]
    for key in ("kvmem", "sglang"):
        r = runs[key]["abort"]
        assert r["prefill"] == want and r["decode"] == want, (key, r)
        assert r["safe"][2], (key, "the aborted room's decode never got its ABORT_ACK")
        assert r["bad_rows"] == 0 and r["outstanding"] == {}, (key, r)
    k = runs["kvmem"]["abort"]
    # sent ahead in the first room's write (counted, still WaitingForInput), which was
    # held until hold_end: no ACK before it
    assert k["ahead_state"] == 2 and k["stats"]["sent_ahead"] >= 2, k
    assert k["ack_after_abort_s"] >= k["hold_end_after_abort_s"] > 0.3, k


def test_failed_call_leaves_no_abort_ack_for_any_room_in_it(runs):
    # sglang fails the owner (poisoned: its slices may still move) and, the session marked
    # failed, every room behind it; kvmem's path sent those rooms ahead in the failed
    # call, so each is poisoned too: none gets an ABORT_ACK, none ends Success
    for key in ("kvmem", "sglang"):
        r = runs[key]["err"]
        assert _all(r["prefill"], FAILED) and _all(r["decode"], FAILED), (key, r)
        assert r["rooms"][0] in r["poisoned"] and not r["safe"][0], (key, r)
    k = runs["kvmem"]["err"]
    assert k["poisoned"] == sorted(k["rooms"]) and not any(k["safe"]), k
    assert k["stats"]["cut_short"] == 1 and k["stats"]["batches"] == 0, k


def test_failed_call_poisons_only_the_rooms_it_posted(runs):
    # the merged write goes as calls of 8 slices (2 pages of the 4 planes), the first
    # carrying the first two rooms' pages only, and fails; nothing after it is posted.
    # sglang: one chunk at a time, the first room's first call fails: only it is poisoned
    for key in ("kvmem", "sglang"):
        r = runs[key]["err_posted"]
        assert _all(r["prefill"], FAILED) and _all(r["decode"], FAILED), (key, r)
        assert r["rooms"][0] in r["poisoned"] and not r["safe"][0], (key, r)
        # nothing of these was posted: not poisoned, and each ABORT acknowledged at once
        # (within the round's 5 s wait; a poisoned room's decode waits out its
        # deferred-release timeout, 30 s)
        assert r["safe"][2:] == [True] * 4, (key, r)
        assert not set(r["rooms"][2:]) & set(r["poisoned"]), (key, r)
    k = runs["kvmem"]["err_posted"]
    # kvmem: one merged write, the other five rooms sent ahead in it; the second room's
    # slices were in the failed call and may still move
    assert k["poisoned"] == sorted(k["rooms"][:2]) and not k["safe"][1], k
    assert k["calls"][0] == 8 and k["stats"]["sends"] == 1, k
    assert k["stats"]["cut_short"] == 1 and k["stats"]["writes"] == 1, k
    s = runs["sglang"]["err_posted"]
    assert s["poisoned"] == s["rooms"][:1] and s["safe"][1], s


def test_chunk_is_not_read_before_its_events_complete(runs):
    # the third room's page ids (a host tensor) are still being copied and the fourth
    # room's pages still being written (their events pending): neither goes ahead of its
    # turn while the worker cannot read it; the rooms whose events completed go ahead,
    # found again when the worker reaches them (none sent twice)
    for key in ("kvmem", "sglang"):
        r = runs[key]["events"]
        assert _all(r["prefill"], SUCCESS) and _all(r["decode"], SUCCESS), (key, r)
        assert r["bad_rows"] == 0 and r["outstanding"] == {}, (key, r)
    k = runs["kvmem"]["events"]
    assert k["at_wait"] is not None, "the worker never waited on the pending event"
    assert k["at_wait"]["sent_ahead"] == 3 and k["at_wait"]["chunks"] == 4, k  # 1, 4, 5
    st = k["stats"]
    assert st["resent"] == 0 and st["sent_ahead"] == st["ahead_done"] == 4, st
    assert st["sends"] == 2 and st["fallbacks"] == 0, st  # the first room and the third


def test_sends_after_release_and_resume(runs):
    for key in ("kvmem", "sglang"):
        r = runs[key]["release"]
        assert _all(r["prefill"], SUCCESS) and _all(r["decode"], SUCCESS), (key, r)
        assert r["bad_rows"] == 0 and r["outstanding"] == {}, (key, r)
    assert runs["kvmem"]["release"]["stats"]["batches"] == 1


def test_scattered_request_stays_within_the_tcp_queue(runs):
    # sglang posts each request as one call of 4,096 slices, past the TCP queue: the
    # engine rejects it, and every room fails
    s = runs["sglang"]["scattered"]
    assert max(s["calls"]) >= SCATTERED_SLICES, s["calls"]
    assert _all(s["prefill"], FAILED), s
    # kvmem's path: the same slices (nothing adjacent to merge) in calls of at most the
    # queue's size, every room Success, every byte checked
    k = runs["kvmem"]["scattered"]
    assert _all(k["prefill"], SUCCESS) and _all(k["decode"], SUCCESS), k
    assert k["bad_rows"] == 0 and k["outstanding"] == {}, k
    st = k["stats"]
    assert st["descriptors"] == st["index_pairs"] == 2 * SCATTERED_SLICES, st
    assert max(k["calls"]) <= TCP_QUEUE and st["writes"] >= 2 * SCATTERED_SLICES // TCP_QUEUE


def test_max_slices_follows_the_tcp_queue_and_sglangs_own_bound():
    from types import SimpleNamespace

    from kvmem_sglang.mooncake_send import TCP_QUEUE_DEFAULT, max_slices

    queue = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
    assert max_slices(env={}) == TCP_QUEUE_DEFAULT == TCP_QUEUE
    assert max_slices(env={queue: "4096"}) == 4096
    for bad in ("", "many", "0", "-3"):  # what Mooncake would not take: its default
        assert max_slices(env={queue: bad}) == TCP_QUEUE_DEFAULT, bad
    # SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES (the manager's field): pages per call
    bounded = SimpleNamespace(max_transfer_batch_indices=8)
    assert max_slices(bounded, planes=64, env={queue: "4096"}) == 8 * 64
    assert max_slices(bounded, planes=256, env={}) == TCP_QUEUE_DEFAULT
    assert max_slices(SimpleNamespace(max_transfer_batch_indices=0), planes=64, env={}) == 1024
