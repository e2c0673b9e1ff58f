"""The status a PD request's failure is answered with when the flag is on: sglang's own
``prepare_abort`` (disaggregation/utils.py) under the adapter's hook, on real ``Req``s."""

from __future__ import annotations

from http import HTTPStatus

import pytest

from kvmem_sglang.reasons import EARLY_ABORT, is_abort, tag
from tests.sglang.sglang_env import abort_answer as _answer


# what the decode's transfer-failure path writes for a receiver /abort_request aborted
USER = (
    "Decode transfer failed for request rank=0 decode_req.req.rid='a-1' "
    "decode_req.req.bootstrap_room=7 with exception KVTransferError(bootstrap_room=7): "
    "Aborted by AbortReq."
)


# what the prefill's transfer-failure path writes when the decode's ABORT came first
BY_DECODE = (
    "Prefill transfer failed for request rank=0 req.rid='a-1' "
    "req.bootstrap_room=7 with exception KVTransferError(bootstrap_room=7): "
    "Aborted by decode-side abort notification."
)


# what the prefill's bootstrap-failure path writes when the decode's ABORT came before
# the request itself (kvmem_sglang.notify.manager_update_status fails the sender at once)
EARLY = (
    "Prefill bootstrap failed for request rank=0 req.rid='a-1' "
    f"req.bootstrap_room=7 with exception KVTransferError(bootstrap_room=7): {EARLY_ABORT}"
)
# what a decode's transfer-failure path writes when a client aborted the request on the
# kvmem prefill alone, which told the decode (kvmem_sglang.notify: the client's reason,
# sglang's FINISH_ABORT() "Aborted", tagged as an abort)
ON_PREFILL = (
    "Decode transfer failed for request rank=0 decode_req.req.rid='a-1' "
    "decode_req.req.bootstrap_room=7 with exception KVTransferError("
    "bootstrap_room=7): Prefill aborted the KV transfer of room 7 in "
    f"WaitingForInput ({tag('Aborted', None)})"
)

# the same when the request was in the prefill's running batch: sglang's own retire path
# aborted the sender, whose record ("Aborted by AbortReq.") the prefill tells the decode
# (seen on a real pair: the decode answered it 500, the router re-sent it, and it ran to
# its end); inside sglang's parentheses it no longer ends like an abort
IN_BATCH = (
    "Decode transfer failed for request rank=0 decode_req.req.rid='a-1' "
    "decode_req.req.bootstrap_room=7 with exception KVTransferError("
    "bootstrap_room=7): Prefill aborted the KV transfer of room 7 in "
    f"Transferring ({tag('Aborted by AbortReq.', None)})"
)


@pytest.mark.parametrize(
    "message",
    [USER, BY_DECODE, EARLY, ON_PREFILL, IN_BATCH],
    ids=["user", "by-decode", "early", "on-prefill", "in-batch"],
)
@pytest.mark.parametrize("how", ["keyword", "positional"])
def test_an_aborted_request_is_answered_as_an_abort_not_a_500(how, message):
    args, kwargs = (
        ((HTTPStatus.INTERNAL_SERVER_ERROR,), {})
        if how == "positional"
        else ((), {"status_code": HTTPStatus.INTERNAL_SERVER_ERROR})
    )
    out = _answer(message, *args, **kwargs)
    # as sglang answers an aborted request outside PD: no error status, so routers do
    # not retry it (sglang-router retries 500)
    assert out == {"type": "abort", "message": message, "status_code": None, "err_type": None}


def test_other_failures_keep_their_status():
    timeout = "Decode transfer failed for request rank=0: KVTransferError: timed out"
    assert _answer(timeout, status_code=HTTPStatus.INTERNAL_SERVER_ERROR)["status_code"] == 500
    # a reason a kvmem prefill tagged: its status, user abort or not
    tagged = tag("Prefill server 0 has released its KV cache; refused", 503)
    assert _answer(tagged, status_code=HTTPStatus.INTERNAL_SERVER_ERROR)["status_code"] == 503
    # a user abort whose caller chose a status of its own keeps it
    assert _answer(USER, status_code=HTTPStatus.SERVICE_UNAVAILABLE)["status_code"] == 503
    assert _answer(USER)["status_code"] is None  # sglang's default
    assert (
        _answer(
            "Aborted by AbortReq. then something else", status_code=HTTPStatus.INTERNAL_SERVER_ERROR
        )["status_code"]
        == 500
    )


def test_only_a_reason_without_status_is_tagged_as_an_abort():
    assert is_abort(tag("Aborted", None)) and is_abort(tag("Aborted", 0))
    assert tag(tag("Aborted", None), None) == tag("Aborted", None)  # once
    # sglang's own record is marked too: the decode reads it inside sglang's text
    assert tag("Aborted by AbortReq.", None).endswith("(kvmem-sglang abort)")
    assert not is_abort(tag("Aborted", 503))  # a client abort with a status keeps it
    assert not is_abort("Prefill KV transfer timed out") and not is_abort(None)
    assert not is_abort("Aborted by AbortReq. then something else")


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
