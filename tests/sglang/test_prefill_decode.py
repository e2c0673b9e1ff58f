"""Against a real decode: when the prefill aborts a KV sender (a
client abort, or the adapter's transfer timeout), is the decode side told?

``scenario_prefill_decode.py`` stands up, in one process per flag, a real PD prefill
scheduler over a real prefill-side ``NixlKVManager`` and ``NixlKVSender``s, a real
decode-side ``NixlKVManager`` with one ``NixlKVReceiver`` per request, and sglang's
bootstrap server, over NIXL/UCX on DRAM; the decode pre-allocates and publishes its pages
for each request, and the prefill aborts each one in another state (Transferring,
WaitingForInput, Bootstrapping; and WaitingForInput past the transfer timeout).

Stock sglang 0.5.23 tells the decode nothing: ``CommonKVSender.abort`` only marks the
room Failed on the prefill (common/conn.py:2458), so each decode receiver stays
WaitingForInput, its pages and metadata slot held, until its own
``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (3 s here, 300 s by default).  With the flag the
decode's receiver reports Failed within milliseconds of the abort, with the prefill's
reason, and the prefill's ABORT_ACK lets it free the pages at once
(``kvmem_sglang.notify``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang.sglang_env import run_both

SCRIPT = Path(__file__).parent / "scenario_prefill_decode.py"
WAITING_TIMEOUT_S = 3.0  # the scenario's decode waiting timeout
RIDS = ("xfer", "wait", "boot", "late")
# KVPoll: Failed 0, Bootstrapping 1, WaitingForInput 2, Transferring 3
STATES = {"xfer": 3, "wait": 2, "boot": 1, "late": 2}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    """{"off": stock's report, "on": kvmem's}; both processes run at once."""
    return run_both(SCRIPT, timeout=240)  # loaded machines: the fork server alone took 55 s


def test_the_scenario_ran_on_real_transfers(runs):
    """Both runs reached the same states over real NIXL transfers: the first chunk of
    ``xfer`` landed in the decode's pages (the pattern the prefill 'computed'), its last
    chunk did not; every request was answered once and nothing is left held on either
    side."""
    for key in ("off", "on"):
        run = runs[key]
        assert run["senders"] == ["NixlKVSender"]
        assert run["states_at_abort"] == STATES, (key, run["states_at_abort"])
        assert run["xfer_decode_pages"] == {
            "chunk1_k": [7.0],
            "chunk1_v": [-3.0],
            "chunk2_k": [0.0],
        }, (key, run)
        assert run["queues_before_abort"] == {
            "bootstrap": ["boot"],
            "waiting": [],
            "inflight": ["late", "xfer", "wait"],
        }
        for rid in RIDS:
            assert len(run["answers"][rid]) == 1, (key, rid, run["answers"])
        assert run["prefill_held"] == {"kv_tokens": 0, "req_slots": 0, "meta_slots": 0}
        assert run["prefill_queues"] == {"bootstrap": [], "waiting": [], "inflight": []}
        assert run["decode_pages_held_at_end"] == 0, (key, run)


def test_decode_learns_of_a_prefill_abort(runs):
    off, on = runs["off"], runs["on"]
    print(
        f"decode receiver Failed, s after the decode published its pages: "
        f"stock {off['decode_failed_after_publish_s']}, "
        f"kvmem {on['decode_failed_after_publish_s']}; s after the prefill's abort: "
        f"stock {off['decode_failed_after_abort_s']}, kvmem {on['decode_failed_after_abort_s']}"
    )
    # stock: only the decode's own waiting timeout ends its wait, in every state
    for rid in RIDS:
        assert off["decode_failed_after_publish_s"][rid] >= WAITING_TIMEOUT_S - 0.05, rid
        assert "timed out after" in off["decode_reasons"][rid], off["decode_reasons"]
    # kvmem: told at the abort, with the prefill's reason
    for rid in ("xfer", "wait", "boot"):
        assert on["decode_failed_after_abort_s"][rid] < 1.0, on
    # the adapter's transfer timeout (1.2 s) aborted "late" before the decode's own
    assert on["decode_failed_after_publish_s"]["late"] < WAITING_TIMEOUT_S - 0.5, on
    assert on["answers"]["late"] == [["stream", 504]]
    assert on["transfer_timeouts"] == 1
    for rid in ("xfer", "wait", "late"):
        assert on["decode_reasons"][rid].startswith("Prefill aborted the KV transfer"), on
    assert "while bootstrapping" in on["decode_reasons"]["boot"]
    # the decode gets the adapter's own reason where the adapter decided the abort
    assert "Prefill KV transfer timed out" in on["decode_reasons"]["late"], on
    assert on["notify"] == {"told": 3, "told_late": 1, "not_told_writing": 0, "early_aborts": 0}


def test_decode_frees_its_preallocated_pages_at_the_abort(runs):
    """The decode's deferred KV release frees a failed request's pages and metadata slot
    once every prefill rank acknowledged its ABORT (``is_abort_release_safe``): stock at
    the waiting timeout, kvmem right after the prefill's abort."""
    off, on = runs["off"], runs["on"]
    print(
        f"decode release safe, s after publishing: stock "
        f"{off['decode_release_safe_after_publish_s']}, kvmem "
        f"{on['decode_release_safe_after_publish_s']}"
    )
    for rid in RIDS:
        assert off["decode_release_safe_after_publish_s"][rid] >= WAITING_TIMEOUT_S - 0.05
        assert on["decode_release_safe_after_publish_s"][rid] < WAITING_TIMEOUT_S - 0.5


def test_prefill_keeps_no_room_of_a_request_aborted_while_bootstrapping(runs):
    """Stock: the decode's metadata for a room aborted while bootstrapping re-creates the
    room in the prefill manager (``update_status(WaitingForInput)`` on a cleared room) with
    its transfer infos; nothing ever removes them.  kvmem answers that metadata Failed and
    drops it."""
    off, on = runs["off"]["prefill_rooms_left"], runs["on"]["prefill_rooms_left"]
    print(f"prefill rooms left: stock {off}, kvmem {on}")
    assert off["boot"]["transfer_infos"] is True and off["boot"]["status"] is not None
    for rid in RIDS:
        assert on[rid] == {"status": None, "transfer_infos": False}, (rid, on)
    for rid in ("xfer", "wait", "late"):
        assert off[rid] == {"status": None, "transfer_infos": False}, (rid, off)


def test_a_failing_notification_never_escapes_abort(runs):
    """Telling the decode is best effort: when it fails (here: the room's notify targets
    cannot be read) sglang's abort still returns, the sender is Failed and the request is
    answered once; the decode falls back to its waiting timeout."""
    for run in (runs["off"], runs["on"]):
        assert run["boom_abort"] == "returned", run["boom_abort"]
        assert run["boom_failed"] is True
        assert len(run["answers"]["boom"]) == 1, run["answers"]["boom"]


def test_the_decode_answers_a_client_abort_on_the_prefill_as_an_abort(runs):
    """A client aborted xfer, wait and boot on the prefill alone; the kvmem prefill told
    the decode with the answer "abort" in a frame of its own.  A decode with the flag
    answers them as aborts, with no status (sglang's router retries a 500, which would
    send the aborted request again), and the adapter's transfer timeout keeps its 504:
    the answers sglang's ``prepare_abort`` gave right after each real receiver's
    ``failure_exception``, over NIXL.  Stock answers 500 for every one of them."""
    on, off = runs["on"]["decode_answers"], runs["off"]["decode_answers"]
    assert sorted(on) == sorted(RIDS) and sorted(off) == sorted(RIDS), (on, off)
    for rid in ("xfer", "wait", "boot"):
        assert on[rid] == {"type": "abort", "status_code": None}, (rid, on[rid])
    assert on["late"]["status_code"] == 504, on["late"]
    for rid, got in off.items():  # stock: its own waiting timeout, 500
        assert got["status_code"] == 500, (rid, got)


def test_the_decode_answers_what_its_prefill_sent_and_nothing_else(runs):
    """Status messages into the decode's real listener over ZMQ.  A kvmem prefill's answer
    frame is the answer; every other frame a peer may put there (a status the adapter
    never sends, a near miss, 100 kB, an empty one) is no answer, so the decode answers
    sglang's own 500, and garbage never stops the listener.  A room that failed here for
    its own client's abort keeps that answer.  Stock: 500 for all of them."""
    on, off = runs["on"]["rooms"]["frames"], runs["off"]["rooms"]["frames"]
    assert on == {
        "answer-503": "503",
        "answer-504": "504",
        "answer-abort": "abort",
        "no-frame": "none",
        "status-999": "none",
        "status-200": "none",
        "spaced": "none",
        "huge": "none",
        "frames-after": "503",
        "empty": "none",
        "after-garbage": "504",
        "unserved-kept": "none",
        "own-abort-first": "abort",
    }, on
    assert set(off.values()) == {"none"}, off  # every room failed; sglang's 500 for each


def test_a_decodes_aborts_on_the_prefill(runs):
    """A decode's ABORT for a room the prefill does not know yet fails the sender that
    opens the room later (stock: the request would bootstrap alone until its timeout); one
    for a room that ended here leaves nothing behind, so a new sender of the room (PD
    retraction re-bootstraps a request under its room) bootstraps; one for a room in
    flight fails it, answered as an abort; a flood of them for unknown rooms keeps at most
    the table's bound."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from kvmem_sglang.reasons import EARLY_ABORT
    from kvmem_sglang.rooms import ROOM_LIMIT

    on, off = runs["on"]["rooms"]["aborts"], runs["off"]["rooms"]["aborts"]
    assert on["early"] == [KVPoll.Failed, EARLY_ABORT], on
    assert off["early"] == [KVPoll.Bootstrapping, None], off
    assert on["ended_then_reopened"] == off["ended_then_reopened"] == KVPoll.Bootstrapping
    assert on["in_flight"] == off["in_flight"] == KVPoll.Failed
    assert on["in_flight_answer"] == "abort"
    assert on["flood_kept"] == ROOM_LIMIT, on
    assert on["malformed_errors"] == off["malformed_errors"] == [], (on, off)


def test_a_room_refused_while_its_metadata_comes_in(runs):
    """A request refused on arrival (the KV cache released) whose decode's metadata is
    half stored by the bootstrap thread: the refusal leaves the room's metadata to that
    thread (dropping it there raised KeyError in the thread, which ended it: no request
    bootstrapped after), which tells the decode once the rest came; one refused after all
    of it came is told at once.  Either way the decode answers 503 and the prefill keeps
    nothing of the room."""
    got = runs["on"]["rooms"]["refused"]
    for name in ("partial", "complete"):
        assert got[name] == {
            "bootstrap_thread_error": None,
            "decode_told": True,
            "decode_answer": "503",
            "prefill_keeps": [False, False, False],
        }, (name, got[name])
