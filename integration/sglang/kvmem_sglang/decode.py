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
  prefill puts the status it answered into the reason it sends the decode
  (``kvmem_sglang.reasons.tag``: 503 for a request refused or aborted by a release, 504 for
  a timeout); with the flag on the decode too, :func:`prepare_abort` answers that status
  instead of 500, so the client sees what the prefill decided.  A stock decode still
  answers 500, promptly.
* The same 500 answers a request the user aborted with ``/abort_request`` while it was
  bootstrapping or waiting for its KV (the receiver's failure reason is "Aborted by
  AbortReq.", ``CommonKVReceiver.abort`` and ``CommonKVSender.abort``,
  ``disaggregation/common/conn.py``).  sglang's router retries a 500, so the user's abort
  re-sends the request, and when the client gave the request its own ``rid`` the retry is
  never answered (seen with sglang-router 0.3.2, stock and with the flag alike).  The
  prefill's own answer for the request, when the decode's ABORT reached it first, is the
  same 500 ("Aborted by decode-side abort notification.",
  ``NixlKVManager._handle_abort_notification``, ``disaggregation/nixl/conn.py``), which the
  router retries too.  So is the adapter's answer when that ABORT came even before the
  request (``kvmem_sglang.reasons.EARLY_ABORT``), and a decode's answer when a client
  aborted the request on the prefill alone, which the kvmem prefill tells its decode with
  the reason marked as an abort (``kvmem_sglang.reasons.tag``).  :func:`prepare_abort`
  answers all of them (``kvmem_sglang.reasons.is_abort``) as sglang answers an aborted
  request outside PD: finish reason ``abort``, no error status.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from kvmem.disagg.outcome import Ending
from kvmem_sglang import roles, state
from kvmem_sglang.reasons import abort_reason, decide, is_abort, reason_of, status_of

logger = logging.getLogger("kvmem.sglang")


def receiver_failure_exception(original, receiver, *args, **kwargs):
    """AROUND ``CommonKVReceiver.failure_exception`` on a decode at attention TP > 1.

    Each prefill rank tells its own decode rank that a room failed (sglang's status
    channel; the kvmem prefill sends its reason and status there), and the decode ranks
    combine their polls (MIN), so a rank can see Failed before its own notice arrived.
    sglang then raises "Failed due to an unknown reason from another rank"
    (``CommonKVReceiver.failure_exception``, ``disaggregation/common/conn.py``), and that
    rank answers 500 (``DecodeTransferQueue.pop_transferred``,
    ``disaggregation/decode.py``), which sglang's router retries, where the rank that had
    the notice answers the prefill's 503.  Seen on a TP 2 + TP 2 pair with the prefill
    released: 23 of 85 decode answers 500; rank 0's answer is the one the client gets,
    whichever rank saw the failure first.

    So the ranks share their reasons: sglang calls this on every rank of the attention TP
    group for the same rooms in the same order (only after ``poll_and_all_reduce``, in
    ``DecodePreallocQueue._update_handshake_waiters`` and the transfer queue's poll), so an
    ``all_gather_object`` over that group's CPU group is in step; a rank with no reason of
    its own raises with the first rank's that has one.  With pipeline parallelism (whose
    polls follow a PP consensus) sglang's own behaviour is kept."""
    try:
        return original(receiver, *args, **kwargs)
    except Exception as e:
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
        reasons: list = [None] * int(receiver.kv_mgr.attn_tp_size)
        dist.all_gather_object(reasons, mine, group=parallel.attn_tp_group.cpu_group)
        if mine is not None:
            raise
        found = next((r for r in reasons if r), None)
        if found is None:
            raise
        from sglang.srt.disaggregation.common.conn import KVTransferError

        raise KVTransferError(receiver.bootstrap_room, found, is_from_another_rank=True) from None


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
    """The answer of a PD request that failed, as a client should see it:

    - a transfer a kvmem prefill ended with a status of its own answers that status
      instead of the generic 500 (module docstring);
    - a request the user aborted (``/abort_request`` by rid or ``abort_all``), or, on
      the prefill, one its decode aborted (the decode has answered the client then), is
      answered as an sglang server outside PD answers an aborted request: finish reason
      ``abort`` with no HTTP error status (sglang's ``FINISH_ABORT(message)``), not the
      500 of a failed transfer.  A router retries a 500 from either server
      (sglang-router: 408, 429, 500, 502-504), so stock's 500 re-sends a request that
      was aborted, and with the client's own rid that retry never ends (module
      docstring).
    """
    status = kwargs.get("status_code", args[0] if args else None)
    if status == HTTPStatus.INTERNAL_SERVER_ERROR:
        tagged = status_of(error_message)
        if tagged is not None:
            status = HTTPStatus(tagged)
        elif is_abort(error_message):
            status = None
        if args:
            args = (status, *args[1:])
        else:
            kwargs["status_code"] = status
    return original(req, error_message, *args, **kwargs)


def is_decode(sched) -> bool:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return getattr(sched, "disaggregation_mode", None) == DisaggregationMode.DECODE
