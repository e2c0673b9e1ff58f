"""No hook of the adapter raises inside sglang's loops on what a client or a peer can send.

Every hook of the manifest is in one of two tables here: :data:`HOSTILE` names the tests
that feed it the worst inputs its callers can pass on (a client's ``rid``, ``bootstrap_room``
and ``bootstrap_host``; a peer's status messages and ABORTs; failure reasons made of
either), and :data:`NO_CLIENT_INPUT` says why a hook reads nothing a client or peer
chose.  A hook added to the manifest without a line here fails
:func:`test_every_hook_is_accounted_for`.

The fuzzed hooks run on sglang's real ``Req`` and ``prepare_abort`` (disaggregation/utils.py);
the peer-message hooks on real NIXL managers, in the scenario of test_prefill_decode.py.
"""

from __future__ import annotations

from http import HTTPStatus

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem_sglang import manifest, reasons
from kvmem_sglang.reasons import ABORT, ANSWER_STATUSES
from tests.sglang.sglang_env import make_req

# hook (manifest's "module:function") -> the tests that feed it hostile inputs
HOSTILE = {
    "decode:prepare_abort": [
        "test_prepare_abort_takes_no_answer_from_anything_a_client_chose",
        "test_adapter_abort_status.test_a_clients_rid_never_chooses_the_answer",
    ],
    "decode:parse_status_message": [
        "test_prefill_decode.test_the_decode_answers_what_its_prefill_sent_and_nothing_else",
    ],
    "decode:receiver_failure_exception": ["test_a_failures_answer_never_raises"],
    "prefill:sender_failure_exception": ["test_a_failures_answer_never_raises"],
    "notify:abort_notification": ["test_prefill_decode.test_a_decodes_aborts_on_the_prefill"],
    "notify:manager_update_status": [
        "test_prefill_decode.test_a_decodes_aborts_on_the_prefill",
        "test_prefill_decode.test_a_room_refused_while_its_metadata_comes_in",
    ],
    "prefill:add_request_to_queue": [
        "tests/e2e/test_pd.py::test_a_clients_rid_cannot_steer_the_servers",
    ],
    "prefill:abort_request": [
        "tests/e2e/test_pd.py::test_aborted_requests_with_client_rids_are_answered",
    ],
    # a timeout by the sender's clock; no record's text (a client's bootstrap host) is read
    "prefill:handle_bootstrap_failure": [
        "test_prefill_gaps.test_bootstrap_timeout_is_504_other_failures_stay_500",
    ],
}

# hook -> why nothing it reads was chosen by a client or a peer
NO_CLIENT_INPUT = {
    "hooks:mha_create_buffers": "pool build at start: sglang's model config",
    "hooks:mha_create_buffers_normal": "pool build at start: sglang's model config",
    "hooks:mla_create_buffers": "pool build at start: sglang's model config",
    "hooks:build_allocator": "allocator build at start; raising stops the server by design",
    "release:release_memory_occupation": "the operator's release (tags are sglang's enum); refusals are logged",
    "release:resume_memory_occupation": "the operator's resume (tags are sglang's enum); refusals are logged",
    "release:continue_generation": "the operator's continue_generation",
    "release:queue_release": "sglang's own queue at a release",
    "release:queue_resume": "sglang's own queue at a resume",
    "nixl:register_buffer_to_engine": "this server's own KV buffers",
    "mooncake:register_buffer_to_engine": "this server's own KV buffers",
    "mooncake:deregister_buffer_to_engine": "this server's own KV buffers",
    "mooncake:registerable_regions": "this server's own KV buffers",
    "mooncake:poison_unsettled_send": "a room sglang's own worker failed",
    "nixl:prepare_payload": "runs on the decode's registration (its own addresses), "
    "checked against this server's registrations before any descriptor is made",
    "nixl:add_remote_peer": "a decode's registration, handed to sglang's own code first",
    "registrations:register_kv_args": "this decode's own registration",
    "transfer_ahead:transfer_worker": "chunks sglang's scheduler queued",
    "transfer:send_kvcache": "chunks sglang's scheduler queued, to a registered peer",
    "mooncake_send:send_kvcache": "chunks sglang's scheduler queued, to a registered peer",
    "mooncake_slice:send_kvcache_slice": "chunks sglang's scheduler queued, to a registered "
    "peer; sglang's own code makes the slices",
    "transfer_wait:await_handles": "handles this server's own agent posted",
    "prefill:stream_output": "requests leaving the scheduler; reads only the adapter's table",
    "prefill:process_inflight_queue": "sglang's own inflight queue and the adapter's clock",
    "prefill:send_kv_chunk": "the adapter's epochs of sglang's own requests",
    "notify:sender_abort": "sglang's own senders; the notification is caught and logged",
    "decode:pop_preallocated": "sglang's own prealloc queue while released",
    "hooks:gather_all_layers_to_staging": "sglang's staging path: this server's own pages",
    "hooks:scatter_staging_to_kv": "sglang's staging path: this server's own pages",
}


def test_every_hook_is_accounted_for():
    names = {h.hook for h in manifest.HOOKS}
    assert set(HOSTILE) | set(NO_CLIENT_INPUT) == names, (
        sorted(names - set(HOSTILE) - set(NO_CLIENT_INPUT)),
        sorted((set(HOSTILE) | set(NO_CLIENT_INPUT)) - names),
    )
    assert not set(HOSTILE) & set(NO_CLIENT_INPUT)
    import importlib

    here = globals()
    for tests in HOSTILE.values():
        for name in tests:
            if name.startswith("tests/e2e/"):
                path, func = name.split("::")
                assert f"def {func}(" in open(path).read(), name
            elif "." in name:
                module, func = name.split(".")
                found = importlib.import_module(f"tests.sglang.{module}")
                assert callable(getattr(found, func, None)), name
            else:
                assert callable(here.get(name)), name


_statuses = st.sampled_from(
    [None, 0, 200, 500, 503, 504, 999, -1, HTTPStatus.INTERNAL_SERVER_ERROR, "500"]
)
_answers = st.sampled_from([None, ABORT, *sorted(ANSWER_STATUSES)])
_rooms = st.one_of(st.none(), st.integers(min_value=-(2**70), max_value=2**70))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rid=st.text(max_size=200),
    message=st.text(max_size=300),
    status=_statuses,
    handed=_answers,
    handed_room=_rooms,
    room=_rooms,
)
def test_prepare_abort_takes_no_answer_from_anything_a_client_chose(
    rid, message, status, handed, handed_room, room
):
    """Any rid, message (where sglang puts the rid), status and room: the hook answers
    what sglang's own ``prepare_abort`` answers, except where sglang answers 500 and the
    failure read just before on this thread, of this request's room, had an answer of
    the adapter's.  Nothing raises that stock does not raise."""
    from sglang.srt.disaggregation.utils import prepare_abort

    from kvmem_sglang import decode

    def answer(flag: bool):
        req = make_req("r", 4)
        req.rid, req.bootstrap_room = rid, room
        reasons.hand_over(handed_room, handed)
        try:
            if flag:
                decode.prepare_abort(prepare_abort, req, message, status_code=status)
            else:
                prepare_abort(req, message, status_code=status)
        except Exception as e:  # noqa: BLE001 - compared with stock's below
            return ("raised", type(e).__name__)
        return req.finished_reason.to_json()

    stock, ours = answer(False), answer(True)
    takes = (
        status == HTTPStatus.INTERNAL_SERVER_ERROR
        and handed is not None
        and handed_room is not None
        and handed_room == room
    )
    if not takes:
        assert ours == stock
    else:
        assert ours["status_code"] == (None if handed == ABORT else handed), ours
        assert {k: v for k, v in ours.items() if k != "status_code"} == {
            k: v for k, v in stock.items() if k != "status_code"
        }


_reasons = st.one_of(
    st.none(),
    st.text(max_size=300),
    st.sampled_from(sorted(reasons.SGLANG_ABORTS)),
    st.integers(),
    st.binary(max_size=50),
)


@settings(max_examples=200, deadline=None)
@given(failure_reason=_reasons, room=_rooms, with_manager=st.booleans())
def test_a_failures_answer_never_raises(failure_reason, room, with_manager):
    """What ``failure_exception`` raised (its reason: a peer's text, sglang's record, or
    anything) gives an answer or none, never an exception; an abort only for sglang's own
    abort records, compared whole."""
    from sglang.srt.disaggregation.common.conn import KVTransferError

    class Manager:  # takes a weak reference, as sglang's managers do; holds no table yet
        pass

    error = KVTransferError(0, "x")
    error.failure_reason = failure_reason
    got = reasons.failure_answer(Manager() if with_manager else None, room, error)
    assert got == (ABORT if failure_reason in reasons.SGLANG_ABORTS else None)
