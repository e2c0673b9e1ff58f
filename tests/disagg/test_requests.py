"""Each side's request tables (kvmem/disagg/requests.py): the one owner of the active
requests, their rooms and what is kept of the finished ones.  What each call changes,
what it leaves alone, and that the views handed out cannot change the tables."""

from __future__ import annotations

import pytest

from kvmem.disagg import Reason
from kvmem.disagg.counters import Metrics
from kvmem.disagg.decode_request import DecodeRequest, DecodeRequests
from kvmem.disagg.prefill_request import PrefillRequest, PrefillRequests
from kvmem.disagg.states import DecodeState, IllegalTransition, PrefillState


def test_add_find_finish_keep_the_tables_and_count_once():
    seen = []
    metrics = Metrics("prefill")
    reqs = PrefillRequests(
        metrics, lambda rid, reason: seen.append((rid, reason, dict(reqs.active)))
    )
    a, b = PrefillRequest(1, 10, 64, "d0"), PrefillRequest(2, 20, 64, "d1")
    reqs.add(a, PrefillState.BOOTSTRAPPING)
    reqs.add(b, PrefillState.BOOTSTRAPPING)
    assert reqs.find(1) is a and reqs.find(3) is None
    assert (reqs.room_holder(10), reqs.room_holder(20), reqs.room_holder(30)) == (1, 2, None)
    assert a.state is PrefillState.BOOTSTRAPPING and dict(reqs.active) == {1: a, 2: b}

    reqs.set_state(a, PrefillState.ENDING)
    reqs.set_state(a, PrefillState.FAILED)
    why = Reason(499, "request 1 aborted")
    reqs.finish(a, why)
    assert dict(reqs.active) == {2: b} and reqs.room_holder(10) is None
    assert dict(reqs.finished) == {1: why} and dict(reqs.finished_peer) == {1: "d0"}
    assert metrics.requests == {"aborted": 1} and metrics.peer("d0").requests == {"aborted": 1}
    assert not metrics.peer("d1").requests
    # on_finish is called last: the tables already say it finished
    assert seen == [(1, why, {2: b})]


def test_finish_refuses_a_request_not_in_a_final_state_and_changes_nothing():
    reqs = DecodeRequests(Metrics("decode"))
    r = DecodeRequest(5, 5, 32, "p0")
    reqs.add(r, DecodeState.WAITING)
    with pytest.raises(AssertionError):
        reqs.finish(r, Reason(200, "not yet"))
    assert reqs.find(5) is r and reqs.room_holder(5) == 5 and not reqs.finished


def test_an_edge_off_the_table_is_refused_and_the_request_is_unchanged():
    reqs = DecodeRequests(Metrics("decode"))
    r = DecodeRequest(5, 5, 32, "p0")
    with pytest.raises(IllegalTransition):
        reqs.add(r, DecodeState.BOOTED)  # no entry edge into BOOTED
    assert r.state is None and reqs.find(5) is None and reqs.room_holder(5) is None
    reqs.add(r, DecodeState.WAITING)
    with pytest.raises(IllegalTransition):
        reqs.set_state(r, DecodeState.BOOTED)  # WAITING -> BOOTED skips BOOTING
    assert r.state is DecodeState.WAITING


def test_a_finished_id_added_again_is_forgotten_as_finished():
    """The decode side takes a REQ again for a request that ended early (the prefill asks
    again after this side's pause freed its BOOT): the new request is active, the old
    ending forgotten."""
    reqs = DecodeRequests(Metrics("decode"))
    old = DecodeRequest(7, 70, 32, "p0")
    reqs.add(old, DecodeState.WAITING)
    reqs.set_state(old, DecodeState.FREED)
    reqs.finish(old, Reason(503, "paused"))
    new = DecodeRequest(7, 71, 32, "p0")
    reqs.add(new, DecodeState.WAITING)
    assert reqs.find(7) is new and 7 not in reqs.finished and 7 not in reqs.finished_peer
    assert reqs.room_holder(70) is None and reqs.room_holder(71) == 7


def test_the_views_are_live_and_read_only():
    reqs = PrefillRequests(Metrics("prefill"))
    active = reqs.active
    r = PrefillRequest(1, 1, 64, "d0")
    reqs.add(r, PrefillState.BOOTSTRAPPING)
    assert active[1] is r
    with pytest.raises(TypeError):
        active[2] = r  # type: ignore[index]
    with pytest.raises(TypeError):
        del reqs.finished[1]  # type: ignore[attr-defined]
