"""The PD decode server across a KV release, and the status a decode answers for a
transfer the kvmem prefill ended.

sglang 0.5.23 (the installed package; paths below are under ``sglang/srt/``); the drain
before a release, of a decode or a plain server, is :mod:`kvmem_sglang.decode_drain`'s:

* A request that reaches a decode whose KV cache is released would be given pages of the
  released pool when it leaves the prealloc queue
  (``DecodePreallocQueue.pop_preallocated``, disaggregation/decode.py), which on a GPU is
  an illegal address the moment the prefill writes there.  :func:`pop_preallocated` answers
  such requests 503 first and aborts their receivers (the prefill is told through sglang's
  ABORT and frees its side), so nothing is allocated until the resume.
* A transfer that fails is answered ``500 INTERNAL_SERVER_ERROR`` by the decode, whatever
  the prefill's reason (``DecodeTransferQueue.pop_transferred``,
  ``disaggregation/decode.py``; a failed handshake:
  ``DecodePreallocQueue._update_handshake_waiters``), and through sglang's router the
  client gets the decode's answer (the router returns the decode's status).  A kvmem
  prefill sends the answer it gave (503 for a request refused or aborted by a release, 504
  for a timeout, an abort) in a frame of its own after sglang's status message
  (:mod:`kvmem_sglang.reasons`); with the flag on the decode too, :func:`parse_status_message`
  keeps it for the room and :func:`prepare_abort` answers it instead of 500, so the client
  sees what the prefill decided.  A stock decode still answers 500, promptly.
* The same 500 answers a request the user aborted with ``/abort_request`` while it was
  bootstrapping or waiting for its KV (the receiver's failure reason is "Aborted by
  AbortReq.", ``CommonKVReceiver.abort`` and ``CommonKVSender.abort``,
  ``disaggregation/common/conn.py``).  sglang's router retries a 500, so the user's abort
  re-sends the request, and when the client gave the request its own ``rid`` the retry is
  never answered (seen with sglang-router 0.3.2, stock and with the flag alike).  The
  prefill's own answer for the request, when the decode's ABORT reached it first, is the
  same 500 ("Aborted by decode-side abort notification.",
  ``NixlKVManager._handle_abort_notification``, ``disaggregation/nixl/conn.py``; Mooncake
  records no reason), which the router retries too.  So is the adapter's answer when that
  ABORT came even before the request (``kvmem_sglang.reasons.EARLY_ABORT``), and a
  decode's answer when a client aborted the request on the prefill alone, which the kvmem
  prefill tells its decode with the answer "abort".  :func:`prepare_abort` answers all of
  them as sglang answers an aborted request outside PD: finish reason ``abort``, no error
  status.

What a failure is answered is data the adapter keeps per room (``state.ANSWERS``), handed
from sglang's ``failure_exception`` to the ``prepare_abort`` right after it
(:func:`kvmem_sglang.reasons.hand_over`): the message sglang writes around a failure holds
the request's ``rid``, which a client chooses, and nothing is read out of it.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from kvmem.disagg.outcome import Ending
from kvmem_sglang import roles, state
from kvmem_sglang.reasons import (
    ABORT,
    ANSWER_STATUSES,
    abort_reason,
    answer_of_record,
    decide,
    failure_answer,
    from_frame,
    hand_over,
    http_answer,
    reason_of,
    take_answer,
)
from kvmem_sglang.rooms import rooms_of

logger = logging.getLogger("kvmem.sglang")


def receiver_failure_exception(original, receiver, *args, **kwargs):
    """AROUND ``CommonKVReceiver.failure_exception`` on a decode: the room's answer
    (:func:`kvmem_sglang.reasons.failure_answer`) handed to the ``prepare_abort`` that
    follows (module docstring); at attention TP > 1 the ranks also share their reasons.

    Each prefill rank tells its own decode rank that a room failed (sglang's status
    channel; the kvmem prefill sends its reason and answer there), and the decode ranks
    combine their polls (MIN), so a rank can see Failed before its own notice arrived.
    sglang then raises "Failed due to an unknown reason from another rank"
    (``CommonKVReceiver.failure_exception``, ``disaggregation/common/conn.py``), and that
    rank answers 500 (``DecodeTransferQueue.pop_transferred``,
    ``disaggregation/decode.py``), which sglang's router retries, where the rank that had
    the notice answers the prefill's 503.  Seen on a TP 2 + TP 2 pair with the prefill
    released: 23 of 85 decode answers 500; rank 0's answer is the one the client gets,
    whichever rank saw the failure first.

    So the ranks share their reasons and answers: sglang calls this on every rank of the
    attention TP group for the same rooms in the same order (only after
    ``poll_and_all_reduce``, in ``DecodePreallocQueue._update_handshake_waiters`` and the
    transfer queue's poll), so an ``all_gather_object`` over that group's CPU group is in
    step; a rank with no reason of its own raises with the first rank's that has one, and
    takes its answer.  With pipeline parallelism (whose polls follow a PP consensus)
    sglang's own behaviour is kept."""
    try:
        return original(receiver, *args, **kwargs)
    except Exception as e:
        room = getattr(receiver, "bootstrap_room", None)
        answer = failure_answer(getattr(receiver, "kv_mgr", None), room, e)
        hand_over(room, answer)
        if int(getattr(getattr(receiver, "kv_mgr", None), "attn_tp_size", 1) or 1) <= 1:
            raise
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        if int(getattr(parallel, "pp_size", 1) or 1) > 1:
            raise
        import torch.distributed as dist

        mine = (
            None
            if getattr(e, "is_from_another_rank", False)
            else getattr(e, "failure_reason", None)
        )
        shared: list = [None] * int(receiver.kv_mgr.attn_tp_size)
        dist.all_gather_object(shared, (mine, answer), group=parallel.attn_tp_group.cpu_group)
        if mine is not None:
            raise
        found = next((r for r in shared if isinstance(r, tuple) and r[0]), None)
        if found is None:
            raise
        theirs = found[1] if found[1] == ABORT or found[1] in ANSWER_STATUSES else None
        hand_over(room, answer if answer is not None else theirs)
        from sglang.srt.disaggregation.common.conn import KVTransferError

        raise KVTransferError(
            receiver.bootstrap_room, found[0], is_from_another_rank=True
        ) from None


def parse_status_message(original, mgr, msg, *args, **kwargs):
    """AROUND ``CommonKVManager.parse_kv_status_message`` (a decode's listener thread,
    before ``apply_prefill_status``): a Failed status of a room this decode serves that
    carries a kvmem prefill's answer frame keeps that answer for the room
    (``state.ANSWERS``; module docstring).  A room that already failed here keeps its own
    answer when that was an abort (the prefill's reason replaces sglang's record of it).
    Never raises: a peer's message is not to end this thread."""
    parsed = original(mgr, msg, *args, **kwargs)
    try:
        if parsed is not None:
            _keep_answer(mgr, msg, parsed)
    except Exception:  # noqa: BLE001 - the decode then answers its own 500
        logger.exception("kvmem-sglang: reading a prefill's answer frame failed")
    return parsed


def _keep_answer(mgr, msg, parsed) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    room, status = parsed[0], parsed[1]
    if status != KVPoll.Failed:
        return
    now = mgr.request_status.get(room)
    if now is None:
        return  # a room this decode does not serve (sglang drops the status too)
    if now == KVPoll.Failed:
        own = answer_of_record(mgr.failure_records.get(room))
        if own is not None:
            rooms_of(state.ANSWERS, mgr).put(room, own)
        return
    frames = msg[1:] if mgr.kv_status_msg_tag is not None else msg
    answer = from_frame(frames[4]) if len(frames) > 4 else None
    if answer is not None:
        rooms_of(state.ANSWERS, mgr).put(room, answer)


def pop_preallocated(original, queue, *args, **kwargs):
    """While the decode's KV cache is released, every request waiting for pages is
    answered 503 and its receiver aborted before sglang's preallocation runs (module
    docstring); sglang's own pass then removes and answers them."""
    sched = queue.scheduler
    if not (queue.queue and roles.released(sched)):  # a pending request is in queue too
        return original(queue, *args, **kwargs)
    # sglang's pass resolves where pending requests' prefills are (and initialises their
    # receivers) before it preallocates (``pop_preallocated``): a request resolved there
    # would get pages of the released pool in the same pass (seen: a decode released before
    # its first request allocated it, and the prefill wrote to it).  So they are resolved
    # here, before the refusal below, and sglang's pass does not resolve again.
    queue._resolve_pending_reqs()
    queue._resolve_pending_reqs = _nothing
    try:
        _refuse_released(queue, sched)
        return original(queue, *args, **kwargs)
    finally:
        del queue._resolve_pending_reqs


def _nothing() -> None:
    return None


def _refuse_released(queue, sched) -> None:
    if queue.queue:  # the resolution above may have answered them all
        from sglang.srt.disaggregation.utils import prepare_abort as sglang_prepare_abort

        refused = []
        for decode_req in queue.queue:
            req = decode_req.req
            if reason_of(req) is not None:
                continue
            if not getattr(decode_req.kv_receiver, "bootstrap_infos", None):
                # not yet resolved where its prefill is: an abort now would reach no
                # prefill, which would then bootstrap the request alone until its
                # timeout; refused at a later pass (no page is given before then)
                continue
            decide(
                req,
                abort_reason(
                    f"{roles.server(sched)} has released its {roles.what_released(sched)} "
                    f"(release_memory_occupation); request {req.rid} refused until "
                    "resume_memory_occupation",
                    Ending.RELEASED,
                ),
            )
            sglang_prepare_abort(
                req, reason_of(req).message, status_code=reason_of(req).status_code
            )
            decode_req.kv_receiver.abort()
            state.PROCESS.chase.add(decode_req.kv_receiver)  # the prefill may not know the room yet
            refused.append(req.rid)
        if refused:
            logger.warning(
                "kvmem-sglang: decode KV cache released: %d request(s) refused "
                "503 until resume_memory_occupation: %s",
                len(refused),
                ", ".join(refused),
            )


def prepare_abort(original, req, error_message, *args, **kwargs):
    """The answer of a PD request that failed, as a client should see it: where sglang
    answers 500 and the failure sglang read just before on this thread has an answer of
    the adapter's (:func:`kvmem_sglang.reasons.take_answer`, module docstring), that
    answer:

    - a status of a kvmem prefill's (503, 504, 500) instead of the generic 500;
    - an abort (the user's ``/abort_request`` by rid or ``abort_all``, or, on the prefill,
      one its decode aborted: the decode has answered the client then) answered as an
      sglang server outside PD answers an aborted request: finish reason ``abort`` with
      no HTTP error status (sglang's ``FINISH_ABORT(message)``), not the 500 of a failed
      transfer.  A router retries a 500 from either server (sglang-router: 408, 429, 500,
      502-504), so stock's 500 re-sends a request that was aborted, and with the client's
      own rid that retry never ends (module docstring).

    ``error_message`` is passed on as it is and never read."""
    status = kwargs.get("status_code", args[0] if args else None)
    if status == HTTPStatus.INTERNAL_SERVER_ERROR:
        answer = take_answer(req)
        if answer is not None:
            status = http_answer(answer)
            if args:
                args = (status, *args[1:])
            else:
                kwargs["status_code"] = status
    return original(req, error_message, *args, **kwargs)


def is_decode(sched) -> bool:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return getattr(sched, "disaggregation_mode", None) == DisaggregationMode.DECODE
