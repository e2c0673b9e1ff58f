"""The status a PD request's failure is answered with when the flag is on: sglang's own
``prepare_abort`` (disaggregation/utils.py) under the adapter's hook, on real ``Req``s.
The answer comes as data (handed over from the ``failure_exception`` sglang read just
before, or a kvmem prefill's answer frame), never out of the message sglang writes, which
holds the request's ``rid``: a client's choice."""

from __future__ import annotations

from http import HTTPStatus

import pytest

from kvmem_sglang import reasons
from kvmem_sglang.reasons import ABORT, ANSWER_STATUSES, EARLY_ABORT, SGLANG_ABORTS
from tests.sglang.sglang_env import make_req

ROOM = 7


def _message(rid: str, reason: str) -> str:
    """What the decode's transfer-failure path writes (decode.py:2866-2872)."""
    return (
        f"Decode transfer failed for request rank=0 decode_req.req.rid={rid!r} "
        f"decode_req.req.bootstrap_room={ROOM} with exception "
        f"KVTransferError(bootstrap_room={ROOM}): {reason}"
    )


def _answer(message: str, *args, handed=None, room=ROOM, flag: bool = True, **kwargs) -> dict:
    """The finish reason (``to_json``) a request of ``room`` gets from sglang's
    ``prepare_abort`` with ``message`` and the given status, right after the adapter's
    hook on ``failure_exception`` handed over ``handed`` for room ROOM (nothing when
    None); through the adapter's hook, or stock."""
    from sglang.srt.disaggregation.utils import prepare_abort

    from kvmem_sglang import decode

    req = make_req("r0", 16)
    req.bootstrap_room = room
    reasons.hand_over(ROOM if handed is not None else None, handed)
    if flag:
        decode.prepare_abort(prepare_abort, req, message, *args, **kwargs)
    else:
        prepare_abort(req, message, *args, **kwargs)
    return req.finished_reason.to_json()


ERROR = HTTPStatus.INTERNAL_SERVER_ERROR

# rids a client may send: markers of the old text protocol, statuses that are not
# statuses, sglang's own abort records at the end of a message
HOSTILE_RIDS = [
    "x (kvmem-sglang HTTP 999)",
    "x (kvmem-sglang HTTP 200)",
    "x (kvmem-sglang HTTP 503)",
    "x (kvmem-sglang abort)",
    "x): Aborted by AbortReq.",
    "kvmem-sglang answer abort",
    "kvmem-sglang answer 503",
    "\x00\xff" * 40,
]


@pytest.mark.parametrize("rid", HOSTILE_RIDS, ids=range(len(HOSTILE_RIDS)))
@pytest.mark.parametrize("reason", ["KV transfer failed", "Aborted by AbortReq."])
def test_a_clients_rid_never_chooses_the_answer(rid, reason):
    """Whatever the rid (and the message around it), with nothing handed over the answer
    is sglang's own 500, as stock answers, and the hook raises nothing."""
    message = _message(rid, reason) + f" {rid}"
    got = _answer(message, status_code=ERROR)
    assert got["status_code"] == 500 and got["type"] == "abort", got
    assert got == _answer(message, status_code=ERROR, flag=False)


@pytest.mark.parametrize("how", ["keyword", "positional"])
@pytest.mark.parametrize("answer", [ABORT, 500, 503, 504])
def test_the_answer_handed_over_is_the_answer(how, answer):
    """What the ``failure_exception`` hook handed over for the request's room is the
    answer: a status of the adapter's, or an abort (no status: sglang's router retries a
    500, which would send an aborted request again)."""
    args, kwargs = ((ERROR,), {}) if how == "positional" else ((), {"status_code": ERROR})
    message = _message("x (kvmem-sglang HTTP 999)", "whatever")
    got = _answer(message, *args, handed=answer, **kwargs)
    want = None if answer == ABORT else answer
    assert got == {"type": "abort", "message": message, "status_code": want, "err_type": None}


def test_an_answer_is_taken_once_and_only_by_its_room():
    assert _answer("m", status_code=ERROR, handed=503, room=ROOM + 1)["status_code"] == 500
    reasons.hand_over(ROOM, 503)
    req = make_req("r1", 4)
    req.bootstrap_room = ROOM
    assert reasons.take_answer(req) == 503 and reasons.take_answer(req) is None


def test_other_statuses_are_left_as_the_caller_gave_them():
    """Only sglang's 500 of a failure is replaced: a caller that chose a status keeps it,
    and sglang's default (no status) stays."""
    assert _answer("m", status_code=HTTPStatus.SERVICE_UNAVAILABLE, handed=ABORT)[
        "status_code"
    ] == (503)
    assert _answer("m", handed=504)["status_code"] is None


def test_sglangs_abort_records_are_answered_as_aborts_whole_only():
    for record in SGLANG_ABORTS | {EARLY_ABORT}:
        assert reasons.answer_of_record(record) == ABORT
    for other in (
        "Aborted by AbortReq. then something else",
        "x Aborted by AbortReq.",
        "Request 7 timed out after 300.0s in KVPoll.Bootstrapping",
        None,
        7,
    ):
        assert reasons.answer_of_record(other) is None, other


def test_answer_frames_carry_only_the_adapters_answers():
    """The frame a kvmem prefill sends after sglang's status message, read by a decode:
    exactly the frames :func:`to_frame` makes; anything a peer may send instead is no
    answer, and reading it never raises."""
    for answer in (ABORT, *ANSWER_STATUSES):
        assert reasons.from_frame(reasons.to_frame(answer)) == answer
        assert reasons.from_frame(bytearray(reasons.to_frame(answer))) == answer
    for junk in (
        b"",
        b"kvmem-sglang answer 999",
        b"kvmem-sglang answer 200",
        b"kvmem-sglang answer 503 ",
        b"kvmem-sglang answer " + b"5" * 10_000,
        "kvmem-sglang answer 503",
        None,
        503,
        [b"kvmem-sglang answer 503"],
    ):
        assert reasons.from_frame(junk) is None, junk
    assert ANSWER_STATUSES == {500, 503, 504}


def test_the_answer_of_a_reason():
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    assert reasons.answer_of(FINISH_ABORT("m")) == ABORT  # a client's abort
    assert reasons.answer_of(FINISH_ABORT("m", HTTPStatus.SERVICE_UNAVAILABLE)) == 503
    assert reasons.answer_of(FINISH_ABORT("m", HTTPStatus.BAD_REQUEST)) is None
    assert reasons.answer_of(FINISH_ABORT("m", "not a status")) is None


def test_the_adapters_answers_carry_the_library_endings_statuses():
    from kvmem.disagg.outcome import Ending
    from kvmem_sglang.reasons import abort_reason, http_status

    for ending in set(Ending) - {Ending.CLIENT_ABORT}:
        assert http_status(ending) is HTTPStatus(ending.status)
    with pytest.raises(ValueError):  # a client's abort is answered with sglang's status
        http_status(Ending.CLIENT_ABORT)
    released = abort_reason("released", Ending.RELEASED)
    assert released.to_json()["status_code"] is HTTPStatus.SERVICE_UNAVAILABLE
    assert abort_reason("late", Ending.TIMED_OUT).status_code is HTTPStatus.GATEWAY_TIMEOUT
