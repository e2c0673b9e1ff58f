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

from http import HTTPStatus
from pathlib import Path

import pytest

from tests.sglang.sglang_env import abort_answer, run_both

SCRIPT = Path(__file__).parent / "scenario_prefill_decode.py"
WAITING_TIMEOUT_S = 3.0  # the scenario's decode waiting timeout
RIDS = ("xfer", "wait", "boot", "late")
# KVPoll: Failed 0, Bootstrapping 1, WaitingForInput 2, Transferring 3
STATES = {"xfer": 3, "wait": 2, "boot": 1, "late": 2}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    """{"off": stock's report, "on": kvmem's}; both processes run at once."""
    return run_both(SCRIPT, timeout=120)


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


def _decode_answer(error: str, flag: bool) -> dict:
    """The answer sglang's decode gives a request whose receiver failed with ``error``
    (decode.py:2885: its message and ``prepare_abort(..., 500)``), stock or through the
    adapter's hook."""
    message = (
        "Decode transfer failed for request rank=0 decode_req.req.rid='r0' "
        f"decode_req.req.bootstrap_room=7 with exception {error}"
    )
    return abort_answer(message, status_code=HTTPStatus.INTERNAL_SERVER_ERROR, flag=flag)


def test_the_decode_answers_a_client_abort_on_the_prefill_as_an_abort(runs):
    """A client aborted xfer, wait and boot on the prefill alone; the kvmem prefill told
    the decode with the reason marked as an abort.  A decode with the flag answers them as
    aborts, with no status (sglang's router retries a 500, which would send the aborted
    request again), and the adapter's transfer timeout keeps its 504.  Stock answers 500
    for every one of them (the reasons the real receivers got, over NIXL)."""
    on = runs["on"]["decode_errors"]
    assert sorted(on) == sorted(RIDS), on
    for rid in ("xfer", "wait", "boot"):
        got = _decode_answer(on[rid], flag=True)
        assert got["type"] == "abort" and got["status_code"] is None, (rid, got)
        assert _decode_answer(on[rid], flag=False)["status_code"] == 500
    assert _decode_answer(on["late"], flag=True)["status_code"] == 504
    for rid, error in runs["off"]["decode_errors"].items():  # stock: its own timeout
        assert _decode_answer(error, flag=True)["status_code"] == 500, rid
