"""The gaps sglang 0.5.23's PD prefill still has, each driven through a real
prefill scheduler (``prefill_env.PrefillHarness``) with the flag off and on, in two
processes (sglang's hooks cannot be undone in-process; ``scenario_prefill_gaps.py`` runs
every case in one scheduler per flag).  Each test states stock's wrong behaviour as
observed with the flag off, then the lifecycle table's behaviour with the flag on.

Statuses are what sglang's tokenizer turns the finish reason into: an ``abort`` with a
``status_code`` is that HTTP error; an abort without one is an aborted (not failed)
request; ``length`` is a served prefill (200)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang.scenario_prefill_gaps import SETTLE_S
from tests.sglang.sglang_env import one, run_both

SCRIPT = Path(__file__).parent / "scenario_prefill_gaps.py"
ENV = {
    "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": "0.3",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "1",
    "SGLANG_KVMEM_DRAIN_TIMEOUT": "1.5",
}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    """{"off": stock's report, "on": kvmem's}; both processes run at once."""
    out = run_both(SCRIPT, env=ENV, timeout=180)
    assert out["on"]["kvmem"] and not out["off"]["kvmem"]
    return out


EMPTY = {"kv_tokens": 0, "req_slots": 0, "meta_slots": 0}


def test_transfer_timeout(runs):
    off, on = runs["off"]["transfer_timeout"], runs["on"]["transfer_timeout"]
    for rid in ("t-transferring", "t-waiting"):
        # stock: no prefill-side transfer timeout; the request stays in flight, unanswered,
        # its KV pages, request slot and metadata slot held, its sender never aborted
        assert off[rid]["answer"] == [] and off[rid]["aborts"] == 0, off[rid]
        assert rid in off["queues"]["inflight"]
        # kvmem: 504, sender aborted (the decode side is told)
        got = one(on[rid]["answer"])
        assert (got["type"], got["status"]) == ("abort", 504), got
        assert (
            "timed out" in got["message"]
            and "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT" in got["message"]
        )
        assert on[rid]["aborts"] == 1
    assert off["held"] == {"kv_tokens": 24, "req_slots": 2, "meta_slots": 2}, off["held"]
    assert on["held"] == EMPTY and on["queues"]["inflight"] == []
    assert on["after"]["held"] == EMPTY


def test_bootstrap_timeout_is_504_other_failures_stay_500(runs):
    off, on = runs["off"]["bootstrap"], runs["on"]["bootstrap"]
    for run in (off, on):
        got = one(run["b-failed"]["answer"])
        assert (got["type"], got["status"]) == ("abort", 500), got
        assert "closed the connection" in got["message"]
    stock = one(off["b-timeout"]["answer"])
    assert (stock["status"], "Prefill bootstrap failed" in stock["message"]) == (500, True)
    got = one(on["b-timeout"]["answer"])
    assert (got["type"], got["status"]) == ("abort", 504), got
    assert "timed out" in got["message"]
    assert on["held"] == EMPTY and off["held"] == EMPTY


def test_client_abort_is_answered_as_an_abort(runs):
    off, on = runs["off"]["client_abort"], runs["on"]["client_abort"]
    stock = {rid: one(off[rid]["answer"]) for rid in ("c-boot", "c-fly")}
    assert (
        stock["c-boot"]["status"] == 500
        and "Prefill bootstrap failed" in stock["c-boot"]["message"]
    )
    assert (
        stock["c-fly"]["status"] == 500 and "Prefill transfer failed" in stock["c-fly"]["message"]
    )
    for rid in ("c-boot", "c-fly"):
        got = one(on[rid]["answer"])
        # FINISH_ABORT(): the finish reason and status sglang gives a running request's abort
        assert got == {"type": "abort", "status": "abort", "message": "Aborted"}, got
        assert on[rid]["aborts"] >= 1 and off[rid]["aborts"] >= 1
    assert on["held"] == EMPTY


def test_release_with_requests_in_flight(runs):
    off, on = runs["off"]["release"], runs["on"]["release"]
    assert (
        off["before"]["queues"]
        == on["before"]["queues"]
        == {"bootstrap": ["r-boot"], "waiting": ["r-wait"], "inflight": ["r-fly"]}
    )
    # stock: the scheduler loop would die on this AssertionError; nothing is answered
    assert not off["release"]["ok"] and off["release"]["error"].startswith("AssertionError")
    assert off["answers"]["r-boot"] == [] and off["aborts"]["r-boot"] == 0
    # ... and a resume without the release that failed raises KeyError in the loop too
    assert not off["resume"]["ok"] and "KeyError" in off["resume"]["error"]
    # kvmem: every queued, waiting and inflight request answered 503 with the reason,
    # its sender aborted, everything it held freed; then the release goes on
    assert on["release"]["ok"] and on["resume"]["ok"]
    for rid, where in (
        ("r-boot", "bootstrapping"),
        ("r-wait", "waiting"),
        ("r-fly", "transferring"),
    ):
        got = one(on["answers"][rid])
        assert (got["type"], got["status"]) == ("abort", 503), (rid, got)
        assert "release_memory_occupation" in got["message"] and where in got["message"]
        assert on["aborts"][rid] == 1, (rid, on["aborts"])
    assert on["after_release"]["held"] == EMPTY
    assert on["after_release"]["queues"] == {"bootstrap": [], "waiting": [], "inflight": []}
    # a request arriving while released: 503 at once, not queued
    late = one(on["answers"]["r-late"])
    assert (late["status"], "refused until resume" in late["message"]) == (503, True)
    assert on["late_queued"]["bootstrap"] == []
    # after the resume requests are served again
    assert one(on["answers"]["r-after"])["status"] == 200
    assert on["answers_settled"] == on["answers"]  # answered once, nothing more later
    assert on["after"]["held"] == EMPTY


def test_release_under_python_O_drops_requests_unanswered(runs):
    """stock with the idle assertion stripped (``python -O``): the bootstrap queue is
    cleared, its request never answered (its client hangs) and its sender never
    aborted.  kvmem: answered 503, sender aborted."""
    off, on = runs["off"]["release_without_assert"], runs["on"]["release_without_assert"]
    assert off["release"]["ok"] and off["queues"]["bootstrap"] == []
    assert off["answer"] == [] and off["aborts"] == 0
    got = one(on["answer"])
    assert got["status"] == 503 and on["aborts"] == 1


def test_release_waits_for_posted_writes(runs):
    """The lifecycle table's pause row: wait until every posted write is DONE or ERR
    before deregistering and releasing.  Stock deregisters while sglang's transfer
    worker still counts a chunk with a write posted (the NIC may still read the pool);
    kvmem waits for it, and a write that never settles holds the release no longer than
    SGLANG_KVMEM_DRAIN_TIMEOUT (1.5 s here), then the release goes on; a later release
    does not wait for that write again."""
    off, on = runs["off"]["posted_writes"], runs["on"]["posted_writes"]
    for run in (off, on):
        assert run["release"]["ok"] and run["resume"]["ok"], run
        assert run["stuck_release"]["ok"] and run["stuck_resume"]["ok"], run
        assert run["after"]["held"] == EMPTY
    assert not off["deregistered_after_settle"]
    assert on["deregistered_after_settle"] and on["release_s"] >= SETTLE_S
    assert 1.5 <= on["stuck_release_s"] < 6
    # the next release waits for the new room's write only, not again for the one the
    # stuck release gave up on (sglang keeps it counted for ever)
    assert on["again_release"]["ok"] and on["again_resume"]["ok"], on
    assert on["again_deregistered_after_settle"] and SETTLE_S <= on["again_release_s"] < 1.5
    assert on["stats"] == {"drain_waits": 3, "drain_timeouts": 1}


def test_release_keeps_a_request_waiting_for_its_grammar(runs):
    """A structured-output request whose grammar still compiles waits in sglang's grammar
    queue, which the release's idle assertion counts (also while paused): stock's
    scheduler loop dies on it.  kvmem: the release goes on and keeps the request there
    (it holds nothing of the pool); the request that reached the queues is answered 503."""
    off, on = runs["off"]["grammar"], runs["on"]["grammar"]
    assert not off["release"]["ok"] and off["release"]["error"].startswith("AssertionError")
    assert on["release"]["ok"] and on["resume"]["ok"], on
    assert on["kept"] == ["g-compiling"] and on["answers"]["g-compiling"] == []
    assert one(on["answers"]["g-ready"])["status"] == 503
    assert on["after"]["held"] == EMPTY


def test_a_drain_that_raises_refuses_the_release_and_keeps_the_loop(runs):
    """An exception from sglang's paths while the release drains (planted in
    ``handle_inflight_transfer_failure``) must not end the scheduler loop (sglang runs
    the release with no try/except): kvmem refuses the release, nothing is released, and
    the request is answered by the next loop step.  Stock's release asserts."""
    off, on = runs["off"]["drain_raises"], runs["on"]["drain_raises"]
    assert not off["release"]["ok"]
    assert on["release"]["ok"] and on["released"] == [], on
    assert on["refused_releases"] >= 1
    assert len(on["answer"]) == 1, on["answer"]
    assert on["after"]["held"] == EMPTY


def test_resume_without_tags_resumes_what_was_released(runs):
    """A release of the KV cache alone, then a resume with no tags (sglang: every tag):
    stock raises KeyError in the loop for the tags it never released and leaves the KV
    cache released; kvmem resumes what is released and serves."""
    off, on = runs["off"]["resume_no_tags"], runs["on"]["resume_no_tags"]
    assert off["release"]["ok"] and not off["resume"]["ok"]
    assert "KeyError" in off["resume"]["error"]
    assert on["release"]["ok"] and on["resume"]["ok"] and on["released_after"] == []
    assert one(on["answer"])["status"] == 200
    assert on["after"]["held"] == EMPTY


def test_abort_all_with_nothing_running_is_not_an_unknown_rid(runs):
    """sglang's pause in ``abort`` mode sends ``abort_all`` every second while requests
    run; with none left it names no request, so it is no "unknown rid" (no log line, no
    count)."""
    before, after = runs["on"]["abort_all_idle"]["unknown_aborts"]
    assert before == after


def test_release_waits_out_the_settle_window_of_a_failed_transfer(runs):
    """A Mooncake write that failed may still be moving for a while (its batch returned
    -1 with slices in flight) while sglang has already uncounted its room: the adapter's
    Mooncake hook opens a settle window, and a release waits it out before it
    deregisters and gives the memory back.  Stock releases at once."""
    off, on = runs["off"]["settle_window"], runs["on"]["settle_window"]
    assert off["release"]["ok"] and on["release"]["ok"] and on["resume"]["ok"]
    assert off["release_s"] < SETTLE_S
    assert SETTLE_S <= on["release_s"] < 1.5, on


def test_a_write_that_fails_while_the_release_waits_gets_its_settle_window(runs):
    """A Mooncake write posted before the release fails while the release waits for it:
    sglang's worker poisons the room (the adapter's hook opens the settle window) and
    uncounts it at once.  The release then waits the window out before it deregisters
    (before, it read the window once, before waiting, and released at the uncount, while
    the failed write's slices could still land)."""
    got = runs["on"]["failed_while_waiting"]
    assert got["release"]["ok"] and got["resume"]["ok"], got
    assert got["release_s"] >= got["failed_s"] + got["window_s"] - 0.05, got
