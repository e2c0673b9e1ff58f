"""kvmem's send path under sglang's NIXL prefill (kvmem_sglang.transfer,
``SGLANG_KVMEM_TRANSFER=kvmem``) against sglang's own send, a STOCK decode on the other
side, real classes over NIXL/UCX in two processes (tests/sglang/scenario_transfer.py has
the rounds).  Three runs at once: the flag on with kvmem's path, the flag on with
sglang's send (``SGLANG_KVMEM_TRANSFER=sglang``), the flag off.

What must hold: every room ends as sglang's own send ends it (Success, or Failed for the
room a fault hits), on both sides; every byte lands (every plane of every page checked on
the stock decode); with kvmem's path the chunks queued together went as one merged write
(fewer descriptors than sglang's one per page and plane); a room sent ahead of its turn
and then aborted gets its decode's ABORT_ACK only after its write settled; a write that
failed leaves the rooms sent ahead in it to be sent again; a write its owner's wait gave
up on is waited for by the rooms sent ahead in it, which then end Success; a write posted
and then refused leaves no ABORT_ACK for any room in it; a merged write split into
several NIXL writes and cut short after its first piece was posted keeps every room in it
counted, and its decode without an ABORT_ACK, until that piece settles (the owner fails,
poisoned; the rooms sent ahead end Success only after it settled); nothing stays counted
but what sglang itself keeps counted; after a release and a resume the sends work over
the new registration.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from testkit.child import Child, child_env, last_json
from tests.sglang.sglang_env import ROOT, fork_server, transfer_runs
from tests.sglang.sglang_env import all_are as _all

SCRIPT = ROOT / "tests" / "sglang" / "scenario_transfer.py"
WAITING, SUCCESS, FAILED = 2, 4, 0
PLANES, PAGES16, PAGES1 = 4, 4, 64  # the scenario's 2 layers; 64 tokens at page 16 and 1


@pytest.fixture(scope="module")
def runs() -> dict:
    # sglang's own send with the flag on: the lifecycle rounds at page 16 only (page 1's
    # counts are sglang's, as with the flag off)
    envs = {
        "kvmem": {"SGLANG_KVMEM": "1", "SGLANG_KVMEM_TRANSFER": "kvmem"},
        "sglang": {
            "SGLANG_KVMEM": "1",
            "SGLANG_KVMEM_TRANSFER": "sglang",
            "KVMEM_TEST_PAGES": "16",
        },
        "off": {"SGLANG_KVMEM": "0"},
    }
    children = {
        key: Child(
            script=SCRIPT,
            cwd=ROOT,
            fork=fork_server(),
            env=child_env(
                extra,
                drop=("SGLANG_KVMEM", "KVMEM_TEST_PAGES"),
                paths=[ROOT / "integration" / "sglang"],
            ),
        )
        for key, extra in envs.items()
    }
    return transfer_runs(children)


@pytest.mark.parametrize("rnd", ["plain16", "plain1"])
def test_stock_decode_receives_every_byte(runs, rnd):
    for key in ("kvmem", "sglang", "off"):
        if rnd not in runs[key]:
            continue
        r = runs[key][rnd]
        assert _all(r["prefill"], SUCCESS) and _all(r["decode"], SUCCESS), (key, r)
        assert r["bad_rows"] == 0, (key, r["bad_rows"])
        assert r["outstanding"] == {}, key


@pytest.mark.parametrize("rnd", ["plain16", "plain1", "both16"])
def test_every_descriptor_lies_inside_one_registration_on_both_sides(runs, rnd):
    # NIXL refuses a descriptor across two registrations; a kvmem pool registers one
    # region per physical chunk (256 KiB chunks here: the scenario's pools have one per
    # layer), so merged runs must stay inside one chunk on both sides
    for key in ("kvmem", "sglang", "off"):
        if rnd not in runs[key]:
            continue
        g = runs[key][rnd]["regions"]
        assert g["descriptors"] > 0 and g["local_outside"] == g["remote_outside"] == 0, (key, g)
        if key != "off":
            assert g["kv_regions"] == 2, (key, g)  # the prefill's pool: 2 chunks
    g = runs["kvmem"]["both16"]["regions"]
    assert runs["kvmem"]["both16"]["decode_kvmem_pool"] and g["decode_kv_regions"] == 2, g
    r = runs["kvmem"]["both16"]
    assert _all(r["prefill"], SUCCESS) and _all(r["decode"], SUCCESS), r
    assert r["bad_rows"] == 0 and r["outstanding"] == {}
    assert r["stats"]["descriptors"] == PLANES  # one run per plane, each inside its chunk


@pytest.mark.parametrize("rnd, pages", [("plain16", PAGES16), ("plain1", PAGES1)])
def test_queued_chunks_go_as_one_merged_write(runs, rnd, pages):
    # sglang: one descriptor per page and plane of each request (none adjacent)
    for key in ("sglang", "off"):
        if rnd in runs[key]:
            assert runs[key][rnd]["descriptors"] == pages * PLANES, key
    st = runs["kvmem"][rnd]["stats"]
    rooms = len(runs["kvmem"][rnd]["prefill"])
    assert st["batches"] == 1 and st["chunks"] == rooms and st["sent_ahead"] == rooms - 1
    assert st["ahead_done"] == rooms - 1 and st["resent"] == 0 and st["fallbacks"] == 0
    assert st["index_pairs"] == rooms * pages * PLANES
    # the requests' pages interleave (request r has pages 1 + r + j R): together they
    # are every page from 1 to R x pages, one run per plane
    assert st["descriptors"] == PLANES
    assert st["writes"] <= 4 and st["unsettled"] == 0


def test_abort_of_a_room_sent_ahead_waits_for_its_write(runs):
    k, s = runs["kvmem"]["abort"], runs["sglang"]["abort"]
    want = [SUCCESS, SUCCESS, FAILED, SUCCESS, SUCCESS, SUCCESS]
    for r in (k, s):
        assert r["prefill"] == want and r["decode"] == want, r
        assert r["safe"][2], "the aborted room's decode never got its ABORT_ACK"
        assert r["bad_rows"] == 0 and r["outstanding"] == {}
    assert k["stats"]["sent_ahead"] >= 2 and k["ahead_state"] == WAITING
    # the aborted room's bytes were in a write held PROC until hold_end: no ACK before it
    assert k["ack_after_abort_s"] >= k["hold_end_after_abort_s"] > 0.3, k
    assert k["decode_safe_after_abort_s"] >= k["hold_end_after_abort_s"]
    # the rooms behind it are not held back by it
    assert k["stats"]["ahead_done"] == 4


def test_failed_write_fails_its_owner_and_resends_the_rooms_sent_ahead(runs):
    want = [FAILED] + [SUCCESS] * 5
    for key in ("kvmem", "sglang"):
        r = runs[key]["err"]
        assert r["prefill"] == want and r["decode"] == want, (key, r)
        assert r["bad_rows"] == 0 and r["outstanding"] == {}
        assert r["safe"][0], key  # settled ERR: the decode may free the pages
    st = runs["kvmem"]["err"]["stats"]
    # the first room to be reached again is sent on its own account, the others ahead
    # of their turn again, in its write
    assert st["sent_ahead"] == 5 + 4 and st["resent"] == 1 and st["ahead_done"] == 4


def test_refused_write_fails_its_owner_only(runs):
    want = [FAILED] + [SUCCESS] * 5
    for key in ("kvmem", "sglang"):
        r = runs[key]["refused"]
        assert r["prefill"] == want and r["decode"] == want, (key, r)
        assert r["bad_rows"] == 0 and r["outstanding"] == {}
    st = runs["kvmem"]["refused"]["stats"]
    assert st["ahead_done"] == st["sent_ahead"] == 4  # sent ahead by the next owner


def test_write_the_owner_gave_up_on_is_waited_for_by_the_rooms_sent_ahead_in_it(runs):
    # the owner's wait gives up on its write (its state could not be read): sglang fails
    # the owner and keeps it counted for ever (it cannot prove the write over); the rooms
    # sent ahead in that write wait for it themselves when the worker reaches them, end
    # Success once it reads DONE, and are uncounted: none is held in Transferring
    want = [FAILED] + [SUCCESS] * 5
    for key in ("kvmem", "sglang"):
        r = runs[key]["unreadable"]
        assert r["prefill"] == want and r["decode"][1:] == want[1:], (key, r)
        assert r["bad_rows"] == 0, key
        assert r["outstanding"] == {r["rooms"][0]: 1}, (key, r["outstanding"])
    st = runs["kvmem"]["unreadable"]["stats"]
    assert st["unsettled"] == 1 and st["sent_ahead"] == 5 and st["resent"] == 0, st
    assert st["ahead_done"] == 4, st  # the first room reached waited on the write itself


def test_write_posted_then_refused_leaves_no_abort_ack_for_any_room_in_it(runs):
    # sglang poisons the room whose post NIXL refused (its writes may still land: no
    # ABORT_ACK, the decode falls back to its timeout); with kvmem's path the rooms sent
    # ahead in that write are poisoned too, uncounted, and sent again on their own turn
    want = [FAILED] + [SUCCESS] * 5
    for key in ("kvmem", "sglang"):
        r = runs[key]["post_refused"]
        assert r["prefill"] == want and r["decode"][1:] == want[1:], (key, r)
        assert r["bad_rows"] == 0 and r["outstanding"] == {}, (key, r)
    assert runs["sglang"]["post_refused"]["poisoned"] == sorted(
        runs["sglang"]["post_refused"]["rooms"][:1]
    )
    r = runs["kvmem"]["post_refused"]
    assert r["poisoned"] == sorted(r["rooms"]), r
    # counted once posted: the refused write counts none, the next owner's 4
    assert r["stats"]["sent_ahead"] == 4 and r["stats"]["ahead_done"] == 4


@pytest.mark.parametrize("rnd", ["split_create_fails", "split_post_refused"])
def test_split_write_cut_short_keeps_its_rooms_held_until_its_posted_piece_settles(runs, rnd):
    # the first merged write goes as several NIXL writes; the first is posted and stays
    # PROC past sglang's settle bound, the second cannot be created (or its post is
    # refused): while the first may still write into the decode's pages, no room of the
    # write may be given back to its decode (no ABORT_ACK) or uncounted, and none may end
    # Success (its prefill pages freed, its decode pages reused) before it settled
    r = runs["kvmem"][rnd]
    rooms, owner = r["rooms"], r["rooms"][0]
    assert r["pieces"] >= 2, r
    assert r["acked_before_settle"] == [], r
    assert r["unprotected_while_held"] == [] and r["uncounted_while_held"] == [], r
    assert r["ok_before_settle"] == [], r
    # the held piece was waited for until it settled, past the owner's bounded wait
    assert r["held_s"] is not None, "the posted piece was never read again: dropped"
    assert r["held_s"] > r["settle_timeout_s"], r
    # the owner fails, poisoned, and stays counted (sglang's rule for a write it gave up on)
    assert r["prefill"][0] == FAILED and owner in r["poisoned"], r
    assert r["outstanding"].get(owner) == 1, r
    # the rooms sent ahead: Success once the piece settled (sent again), or, should the
    # first of them reach a wait that gives up too, Failed and poisoned
    for i, room in enumerate(rooms[1:], 1):
        ok = r["prefill"][i] == r["decode"][i] == SUCCESS
        assert ok or (r["prefill"][i] == FAILED and room in r["poisoned"]), (i, r)
    assert r["prefill"][2:] == [SUCCESS] * 4 and r["decode"][2:] == [SUCCESS] * 4, r
    assert set(r["outstanding"]) <= {owner, rooms[1]}, r
    assert r["bad_rows"] == 0, r
    st = r["stats"]
    assert st.get("cut_short") == 1 and st["unsettled"] >= 1 and st["resent"] >= 1, st


def test_sends_after_release_and_resume(runs):
    for key in ("kvmem", "sglang"):
        r = runs[key]["release"]
        assert _all(r["prefill"], SUCCESS) and _all(r["decode"], SUCCESS), (key, r)
        assert r["bad_rows"] == 0 and r["outstanding"] == {}
        assert r["registrations"] == 2  # the kvmem pool's 2 regions (chunks), registered again
        assert r["prepared_lists"] >= 2  # kvmem_sglang.nixl prepared them again
    assert runs["kvmem"]["release"]["stats"]["batches"] == 1


def test_run_addresses_merge_the_pairs_of_all_chunks_sorted_by_source():
    from kvmem_sglang.transfer import run_addresses

    def runs_of(*pairs):
        # one plane at address 0 on both sides, one byte a page: addresses are page ids
        one, zero = np.ones(1, np.uint64), np.zeros(1, np.uint64)
        sa, da, nb, n = run_addresses(
            zero, zero, one, [(np.array(s), np.array(d)) for s, d in pairs]
        )
        return list(zip(sa.tolist(), da.tolist(), nb.tolist())), n

    assert runs_of(([5, 1, 3, 2], [50, 10, 30, 20])) == (
        [(1, 10, 1), (2, 20, 1), (3, 30, 1), (5, 50, 1)],
        4,
    )
    assert runs_of(([3, 1, 2, 7], [13, 11, 12, 9])) == ([(1, 11, 3), (7, 9, 1)], 4)
    # a source page shared by two rooms (a prefix) goes to both destinations
    assert runs_of(([1, 1, 2], [5, 9, 10])) == ([(1, 5, 1), (1, 9, 2)], 3)
    # chunks of several rooms: sorted by source page before merging
    assert runs_of(([1, 3], [11, 13]), ([2, 4], [12, 14])) == ([(1, 11, 4)], 4)
    # two planes: one descriptor per run and plane, plane-major
    sa, da, nb, n = run_addresses(
        np.array([1000, 5000], np.uint64),
        np.array([9000, 7000], np.uint64),
        np.array([8, 2], np.uint64),
        [(np.array([3, 4, 9]), np.array([0, 1, 5]))],
    )
    assert (sa.tolist(), da.tolist(), nb.tolist(), n) == (
        [1024, 1072, 5006, 5018],
        [9000, 9040, 7000, 7010],
        [16, 8, 4, 2],
        3,
    )


def test_chunks_in_names_the_chunks_with_a_page_in_some_descriptors():
    from kvmem_sglang.transfer import chunks_in, run_addresses

    # chunk 0: source pages 1, 2 (runs with chunk 1's 3 on both sides); chunk 1: 3 and 9;
    # chunk 2: 5 -> runs (1..3), (5), (9), on each of 2 planes: descriptors 0-2, then 3-5
    pairs = [
        (np.array([2, 1]), np.array([11, 10])),
        (np.array([9, 3]), np.array([40, 12])),
        (np.array([5]), np.array([30])),
    ]
    one, zero = np.ones(2, np.uint64), np.zeros(2, np.uint64)
    assert run_addresses(zero, zero, one, pairs)[0].size == 6
    assert chunks_in(pairs, 0, 1) == {0, 1}  # the run shared by two chunks
    assert chunks_in(pairs, 1, 2) == {2}
    assert chunks_in(pairs, 2, 3) == {1}
    assert chunks_in(pairs, 4, 6) == {1, 2}  # the second plane's runs
    assert chunks_in(pairs, 0, 6) == {0, 1, 2} and chunks_in(pairs, 3, 3) == set()


def test_small_batches_go_as_one_write_large_ones_split():
    from kvmem_sglang.transfer import SPLIT, SPLIT_MIN_BYTES, split_pieces

    assert split_pieces(48, 3 * 1024) == 1  # the e2e tier's sends: a few KiB
    assert split_pieces(1, 1 << 30) == 1  # one descriptor cannot be split
    assert split_pieces(64, 2 * SPLIT_MIN_BYTES) == 2
    assert split_pieces(64, 1 << 30) == SPLIT
    assert split_pieces(3, 1 << 30) == 3  # never a write without a descriptor
    assert split_pieces(0, 0) == 1


def test_a_childs_result_is_read_past_what_ucx_prints_after_it():
    # UCX writes its errors to stdout; one came after a child's JSON line under load
    ucx = (
        "[1796286547.272837] [vm:13079:0]          tcp_ep.c:1234 UCX  ERROR try to "
        'increase "net.core.somaxconn" ... UCX_TCP_MAX_CONN_RETRIES (=25)'
    )
    assert last_json('log line\n{"rooms": [1, 2]}\n' + ucx + "\n") == {"rooms": [1, 2]}
    assert last_json('[{"a": 1}]') == [{"a": 1}]
    with pytest.raises(ValueError, match="no JSON line"):
        last_json(ucx)


def test_transfer_counters_add_up_across_threads():
    # every transfer worker thread adds to the same counters
    import threading

    from kvmem_sglang.transfer_records import Stats

    stats, n, threads = Stats(), 20000, 4
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        workers = [
            threading.Thread(target=lambda: [stats.add(waits=1, naps=2) for _ in range(n)])
            for _ in range(threads)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(switch)
    assert stats.as_dict()["waits"] == n * threads and stats.naps == 2 * n * threads


def test_a_chunk_uncounted_leaves_no_negative_or_dead_count():
    from collections import defaultdict
    from types import SimpleNamespace

    from kvmem_sglang.transfer_ahead import uncount
    from kvmem_sglang.transfer_records import Ahead

    def mgr(counts, live):
        return SimpleNamespace(
            _staging_outstanding=defaultdict(int, counts),
            request_status=dict.fromkeys(live, 2),
            enable_deferred_decode_kv_release=False,
        )

    def counts_after(m, room, drop=False):
        uncount(m, Ahead(room, "peer", np.empty(0), np.empty(0)), drop=drop)
        return dict(m._staging_outstanding)

    # the worker dropped the room's whole count (it skipped the room: cleared, or Failed)
    assert counts_after(mgr({}, [7]), 7) == {} and counts_after(mgr({}, []), 7) == {}
    # a room gone: its last count goes with its entry (nothing else would drop it)
    assert counts_after(mgr({7: 1}, []), 7) == {}
    # a live room keeps its entry for the worker to drop; other counts stay
    assert counts_after(mgr({7: 1}, [7]), 7) == {7: 0}
    assert counts_after(mgr({7: 2}, [7]), 7) == {7: 1}
    # an entry made for this count goes with it
    assert counts_after(mgr({7: 1}, [7]), 7, drop=True) == {}
    # counted once: a second uncount changes nothing
    m, rec = mgr({7: 2}, [7]), Ahead(7, "peer", np.empty(0), np.empty(0))
    uncount(m, rec)
    uncount(m, rec)
    assert dict(m._staging_outstanding) == {7: 1}
