"""Chunked prefill on a PD prefill server: a prompt longer than the chunk budget
(``chunked_prefill_size``) prefilled over several passes, driven through sglang's own
scheduling step (``get_next_disagg_prefill_batch_to_run``: ``process_pending_chunked_abort``,
``process_prefill_chunk`` sending the previous chunk, the admission making
``chunked_req``) and result handler (``process_batch_result_disagg_prefill``, its
middle-chunk branch), flag off and on in two processes (``scenario_prefill_chunked.py``).

Every case ends with no KV page, request slot or metadata slot held, no ``chunked_req``,
no entry in ``disagg_prefill_pending_chunk_rids``, and each request answered exactly once.
Statuses as in test_prefill_gaps: an ``abort`` with a ``status_code`` is that HTTP error,
one without is a client abort, ``length`` is a served prefill (200)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang.scenario_prefill_chunked import TRANSFER_TIMEOUT
from tests.sglang.sglang_env import one, run_both

SCRIPT = Path(__file__).parent / "scenario_prefill_chunked.py"
ENV = {"SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": str(TRANSFER_TIMEOUT)}
EMPTY = {"kv_tokens": 0, "req_slots": 0, "meta_slots": 0}
IDLE = {
    "held": EMPTY,
    "queues": {"bootstrap": [], "waiting": [], "inflight": []},
    "chunked": None,
    "pending_chunk_rids": [],
    "pending_chunked_abort": False,
}
CASES = (
    "complete",
    "abort_between",
    "abort_during",
    "abort_last",
    "middle_send_failed",
    "transfer_timeout",
    "release",
    "release_after_abort",
    "release_overlap",
)


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    """{"off": stock's report, "on": kvmem's}; both processes run at once."""
    out = run_both(SCRIPT, env=ENV, timeout=180)
    assert out["on"]["kvmem"] and not out["off"]["kvmem"]
    return out


@pytest.mark.parametrize("flag", ["off", "on"])
def test_every_case_ends_idle(runs, flag):
    """After each case (and its held senders let go) nothing is held or queued."""
    for case in CASES:
        assert runs[flag][case]["after"] == IDLE, (case, runs[flag][case]["after"])


@pytest.mark.parametrize("flag", ["off", "on"])
def test_chunked_request_completes(runs, flag):
    """21 tokens in 8-token passes: 3 forwards; chunks 1 and 2 (2 pages each) are sent at
    the start of the next iteration, the last (2 pages, 5 tokens) after its forward;
    200 once.  Stock and kvmem alike."""
    r = runs[flag]["complete"]
    assert one(r["a-ok"]["answer"]) == {"type": "length", "status": 200, "message": None}
    assert r["a-ok"]["sends"] == [[2, False], [2, False], [2, True]]
    assert r["a-ok"]["aborts"] == 0
    trace = r["trace"]
    assert [t["chunked"] for t in trace[:3]] == ["a-ok", "a-ok", None]
    assert [len(t["sends"]) for t in trace[:3]] == [0, 1, 3]
    assert trace[0]["held"] == {"kv_tokens": 8, "req_slots": 1, "meta_slots": 1}
    assert trace[1]["held"] == {"kv_tokens": 16, "req_slots": 1, "meta_slots": 1}
    assert trace[1]["pending_chunk_rids"] == ["a-ok"]  # a middle chunk sent, not concluded
    assert trace[3]["batch"] is None and r["end"] == IDLE


@pytest.mark.parametrize("flag", ["off", "on"])
def test_client_abort_between_chunks(runs, flag):
    """Abort after chunk 1 was sent and chunk 2 computed, before chunk 3's forward.
    Stock: ``abort_request`` marks it (``_pending_chunked_abort_req``); the next step's
    ``process_pending_chunked_abort`` aborts the sender, frees KV pages, request and
    metadata slot, clears ``chunked_req`` and the pending chunk send, and answers it as
    a client abort; chunk 2 is never sent, chunk 3 never computed.  kvmem: the same."""
    r = runs[flag]["abort_between"]
    assert r["at_abort"]["pending_chunked_abort"] and r["at_abort"]["chunked"] == "b-between"
    got = one(r["b-between"]["answer"])
    assert got["type"] == "abort" and got["status"] == "abort", got
    assert r["b-between"]["sends"] == [[2, False]]
    assert r["b-between"]["aborts"] == 1
    assert r["end"] == IDLE


@pytest.mark.parametrize("flag", ["off", "on"])
@pytest.mark.parametrize(
    "case, rid, sends",
    [
        ("abort_during", "b-during", [[2, False]]),  # during chunk 2 of 4
        ("abort_last", "b-last", [[2, False], [2, False]]),  # during the last chunk
    ],
)
def test_client_abort_during_a_chunk_forward(runs, flag, case, rid, sends):
    """Abort while a chunk's forward runs (the overlap loop's ingest).  Stock: a middle
    chunk's request is freed by the next step's ``process_pending_chunked_abort`` (the
    result handler's middle-chunk branch skips it); the last chunk's request is retired
    by the result handler (``_retire_aborted_prefill_result``) before its KV is sent.
    Answered once as a client abort, the sender aborted.  kvmem: the same."""
    r = runs[flag][case]
    got = one(r[rid]["answer"])
    assert got["type"] == "abort" and got["status"] == "abort", got
    assert r[rid]["sends"] == sends and r[rid]["aborts"] == 1
    assert not r["next_batch"] and r["end"] == IDLE


@pytest.mark.parametrize("flag", ["off", "on"])
def test_failed_send_of_a_middle_chunk(runs, flag):
    """The sender fails on chunk 2 of 4.  Stock: nothing polls the sender between chunks,
    so chunks 3 and 4 are still computed and handed to the failed sender; the request
    reaches the inflight queue after its last chunk and is answered 500 "Prefill
    transfer failed" with the failure, once, everything freed.  kvmem: the same (no
    lifecycle row changes it)."""
    r = runs[flag]["middle_send_failed"]
    got = one(r["c-fail"]["answer"])
    assert got["status"] == 500 and "Prefill transfer failed" in got["message"]
    assert "send of chunk 2 failed" in got["message"]
    assert r["c-fail"]["sends"] == [[2, False], [2, False], [2, False], [2, True]]
    assert r["steps"] == 4 and r["end"] == IDLE


def test_transfer_timeout_of_a_chunked_request(runs):
    """Every chunk sent, the sender then stays Transferring.  Stock: the request stays in
    the inflight queue for ever, unanswered, holding its 6 pages, request slot and
    metadata slot.  kvmem: after SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT, 504, sender
    aborted, everything freed."""
    off, on = runs["off"]["transfer_timeout"], runs["on"]["transfer_timeout"]
    for run in (off, on):
        assert run["d-stuck"]["sends"] == [[2, False], [2, False], [2, True]]
        assert run["in_flight"]["queues"]["inflight"] == ["d-stuck"]
        assert run["in_flight"]["held"] == {"kv_tokens": 24, "req_slots": 1, "meta_slots": 1}
    assert off["d-stuck"]["answer"] == [] and off["d-stuck"]["aborts"] == 0
    assert off["end"]["held"] == off["in_flight"]["held"]
    assert off["end"]["queues"]["inflight"] == ["d-stuck"]
    got = one(on["d-stuck"]["answer"])
    assert got["status"] == 504 and "timed out" in got["message"], got
    assert on["d-stuck"]["aborts"] == 1 and on["end"] == IDLE


def test_release_between_chunks(runs):
    """release_memory_occupation(kv_cache) while a request is mid-chunked-prefill
    (``chunked_req`` set between iterations; another request bootstrapping).  Stock:
    AssertionError "should be called only when server is idle" in the scheduler loop,
    which has no try/except (the worker dies); nothing released, nothing answered.
    kvmem: the chunked request is answered 503 with the reason, its sender aborted, its
    KV pages, request slot and metadata slot freed once, ``chunked_req`` and its pending
    chunk send cleared; the bootstrapping one 503 too; the release goes on, and after
    the resume a new chunked request is served."""
    off, on = runs["off"]["release"], runs["on"]["release"]
    for run in (off, on):
        assert run["before"]["chunked"] == "e-chunked"
        assert run["before"]["held"] == {"kv_tokens": 16, "req_slots": 1, "meta_slots": 1}
        assert run["before"]["pending_chunk_rids"] == ["e-chunked"]
    assert off["release"]["error"].startswith("AssertionError")
    assert "weight_updater.py" in off["release"]["where"]
    assert off["after_release"] == off["before"]
    assert off["held_at_flush"] == []  # stock never reaches its flush
    assert on["release"] == {"ok": True} and on["resume"] == {"ok": True}
    assert on["held_at_flush"] == [EMPTY]  # freed by the drain, once, before the flush
    assert on["after_release"] == IDLE
    for rid, where in (("e-chunked", "between the chunks"), ("e-boot", "bootstrapping")):
        got = one(on[rid]["answer"])
        assert (got["type"], got["status"]) == ("abort", 503), (rid, got)
        assert "release_memory_occupation" in got["message"] and where in got["message"]
        assert on[rid]["aborts"] == 1
    assert on["e-chunked"]["sends"] == [[2, False]]  # chunk 2 never sent
    assert one(on["e-after"]["answer"])["status"] == 200
    assert on["e-after"]["sends"] == [[2, False], [2, False], [2, True]]
    # answered once: nothing more came for them while the loop went on
    assert on["answers_settled"] == {
        rid: on[rid]["answer"] for rid in ("e-chunked", "e-boot", "e-after")
    }
    assert on["end"] == IDLE


def test_release_after_a_client_abort_of_the_chunked_request(runs):
    """The client aborted the chunked request; the abort is pending
    (``_pending_chunked_abort_req``, applied at the next step) when the release comes.
    Stock: AssertionError in the loop; the next step then applies the abort (one
    answer).  kvmem: answered once with the client's abort (not 503), freed, the pending
    marker cleared, so the next step answers nothing more."""
    off, on = runs["off"]["release_after_abort"], runs["on"]["release_after_abort"]
    for run in (off, on):
        assert run["before"]["pending_chunked_abort"]
        assert run["before"]["chunked"] == "e-aborted"
        got = one(run["e-aborted"]["answer"])
        assert got["type"] == "abort" and got["status"] == "abort", got
        assert run["answers_settled"] == run["e-aborted"]["answer"]
        assert run["e-aborted"]["sends"] == [[2, False]] and run["end"] == IDLE
    assert off["release"]["error"].startswith("AssertionError")
    assert on["release"] == {"ok": True} and on["after_release"] == IDLE
    assert on["e-aborted"]["aborts"] == 1


def test_release_with_a_chunk_result_queued(runs):
    """The overlap loop's state at an ingest: chunk 2 of a chunked request launched and
    queued with its result (``result_queue``), ``last_batch`` that batch.  Stock:
    AssertionError in the loop (not idle).  kvmem: the request is answered 503 and freed;
    the queued result and ``last_batch`` are set aside during sglang's release only, so
    the loop's state is as stock left it: it then processes the result, which skips the
    answered request (no second answer, nothing freed twice); the release goes on."""
    off, on = runs["off"]["release_overlap"], runs["on"]["release_overlap"]
    assert off["queued"] == on["queued"] == 1
    assert off["release"]["error"].startswith("AssertionError")
    assert off["held_at_flush"] == []
    assert on["release"] == {"ok": True} and on["resume"] == {"ok": True}
    assert on["held_at_flush"] == [EMPTY]
    assert on["after_release"] == {**IDLE, "queued": 1, "last_batch": True}
    got = one(on["f-chunked"]["answer"])
    assert got["status"] == 503 and "release_memory_occupation" in got["message"]
    assert on["f-chunked"]["aborts"] == 1 and on["f-chunked"]["sends"] == [[2, False]]
    assert on["answers_settled"] == on["f-chunked"]["answer"]
    assert runs["on"]["prefill_stats"]["released_aborts"] == 4
