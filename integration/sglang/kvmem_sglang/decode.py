"""The PD decode server across a KV release, and the status a decode answers for a
transfer the kvmem prefill ended.

sglang 0.5.23 (file:line of the installed package, ``sglang/srt/``):

* ``release_memory_occupation`` asserts an idle scheduler
  (``managers/scheduler_components/weight_updater.py:339``).  On a decode server
  ``is_fully_idle`` (``managers/scheduler.py:5337``) also needs empty prealloc and
  transfer queues, no retracted requests and no deferred KV releases (:5377-5381): a
  release that comes while any request is bootstrapping, waiting for its KV, queued,
  decoding, or held for an ABORT_ACK raises ``AssertionError`` inside the scheduler loop,
  and the decode server dies.  RL frameworks release every engine, decode included.
  :func:`drain_for_release` (called by the adapter's release hook, before sglang's
  release) answers every such request 503 with the reason and frees what it holds,
  through sglang's own paths: a request whose KV the prefill may still be writing is
  aborted (its receiver sends ABORT to the prefill) and its pages are freed only at the
  prefill's ABORT_ACK (sglang's deferred release), or after
  ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`` as sglang arranges; the
  whole wait is bounded by ``SGLANG_KVMEM_DRAIN_TIMEOUT``.
* A request that reaches a decode whose KV cache is released would be given pages of
  the released pool when it leaves the prealloc queue (``pop_preallocated``,
  disaggregation/decode.py:1333), which on a GPU is an illegal address the moment the
  prefill writes there.  :func:`pop_preallocated` answers such requests 503 first and
  aborts their receivers (the prefill is told through sglang's ABORT and frees its
  side), so nothing is allocated until the resume.
* A transfer that fails is answered ``500 INTERNAL_SERVER_ERROR`` by the decode, whatever
  the prefill's reason (``disaggregation/decode.py:2885``, handshake :1171), and through
  sglang's router the client gets the decode's answer (the router returns the decode's
  status).  A kvmem prefill puts the status it answered into the reason it sends the
  decode (``kvmem_sglang.reasons.tag``: 503 for a request refused or aborted by a release, 504 for a
  timeout); with the flag on the decode too, :func:`prepare_abort` answers that status
  instead of 500, so the client sees what the prefill decided.  A stock decode still
  answers 500, promptly.
* The same 500 answers a request the user aborted with ``/abort_request`` while it was
  bootstrapping or waiting for its KV (the receiver's failure reason is "Aborted by
  AbortReq.", ``disaggregation/common/conn.py:2463``, :2960).  sglang's router retries
  a 500, so the user's abort re-sends the request, and when the client gave the request
  its own ``rid`` the retry is never answered (seen with sglang-router 0.3.2, stock and
  with the flag alike).  The prefill's own answer for the request, when the decode's
  ABORT reached it first, is the same 500 ("Aborted by decode-side abort
  notification.", ``disaggregation/nixl/conn.py:3324``), which the router retries too.
  So is the adapter's answer when that ABORT came even before the request
  (``kvmem_sglang.reasons.EARLY_ABORT``), and a decode's answer when a client aborted the
  request on the prefill alone, which the kvmem prefill tells its decode with the reason
  marked as an abort (``kvmem_sglang.reasons.tag``).  :func:`prepare_abort` answers all
  of them (``kvmem_sglang.reasons.is_abort``) as sglang answers an aborted request
  outside PD: finish reason ``abort``, no error status.
"""

from __future__ import annotations

import logging
import time
from http import HTTPStatus

from kvmem_sglang import options
from kvmem_sglang.reasons import decide, is_abort, status_of

logger = logging.getLogger("kvmem.sglang")

DRAIN_POLL_S = 0.002


def hooks() -> list[tuple[str, object, str]]:
    return [
        ("sglang.srt.disaggregation.utils.prepare_abort", prepare_abort, "AROUND"),
        ("sglang.srt.disaggregation.decode.DecodePreallocQueue.pop_preallocated",
         pop_preallocated, "AROUND"),
    ]


def _kv_released(sched) -> bool:
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

    wu = getattr(sched, "weight_updater", None)
    return wu is not None and GPU_MEMORY_TYPE_KV_CACHE in wu.offload_tags


def pop_preallocated(original, queue, *args, **kwargs):
    """While the decode's KV cache is released, every request waiting for pages is
    answered 503 and its receiver aborted before sglang's preallocation runs (module
    docstring); sglang's own pass then removes and answers them."""
    sched = queue.scheduler
    if not (queue.queue and _kv_released(sched)):  # a pending request is in queue too
        return original(queue, *args, **kwargs)
    # sglang's pass resolves where pending requests' prefills are (and initialises their
    # receivers) before it preallocates (decode.py:1346): a request resolved there would
    # get pages of the released pool in the same pass (seen: a decode released before its
    # first request allocated it, and the prefill wrote to it).  So they are resolved
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
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        refused = []
        for decode_req in queue.queue:
            req = decode_req.req
            if getattr(req, "_kvmem_reason", None) is not None:
                continue
            if not getattr(decode_req.kv_receiver, "bootstrap_infos", None):
                # not yet resolved where its prefill is: an abort now would reach no
                # prefill, which would then bootstrap the request alone until its
                # timeout; refused at a later pass (no page is given before then)
                continue
            decide(req, FINISH_ABORT(
                f"Decode server {getattr(sched, 'tp_rank', 0)} has released its KV cache "
                f"(release_memory_occupation); request {req.rid} refused until "
                "resume_memory_occupation", HTTPStatus.SERVICE_UNAVAILABLE))
            sglang_prepare_abort(req, req._kvmem_reason.message,
                                 status_code=req._kvmem_reason.status_code)
            decode_req.kv_receiver.abort()
            refused.append(req.rid)
        if refused:
            logger.warning("kvmem-sglang: decode KV cache released: %d request(s) refused "
                           "503 until resume_memory_occupation: %s", len(refused),
                           ", ".join(refused))


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


def drain_for_release(sched) -> None:
    """Answer every request of a decode (or plain, non-PD) scheduler 503 and free what it
    holds, so that sglang's release finds the scheduler idle.  Never raises: sglang dispatches the
    release with no try/except (``managers/scheduler.py:2253``)."""
    try:
        answered = _drain(sched)
    except Exception:  # noqa: BLE001 - sglang's release then asserts, as stock would
        logger.exception("kvmem-sglang: draining the scheduler for "
                         "release_memory_occupation failed")
        return
    if answered:
        logger.warning("kvmem-sglang: release_memory_occupation(kv_cache): %d request(s) "
                       "answered 503: %s", len(answered),
                       ", ".join(r.rid for r in answered))


def _drain(sched) -> list:
    from sglang.srt.disaggregation.utils import prepare_abort as sglang_prepare_abort
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.mem_cache.common import release_kv_cache

    role = "Decode server" if is_decode(sched) else "Server"

    def reason(req, where):
        return FINISH_ABORT(
            f"{role} released its KV cache (release_memory_occupation) while "
            f"request {req.rid} was {where}; aborted, retry after the resume",
            HTTPStatus.SERVICE_UNAVAILABLE)

    def answer(req, where) -> None:
        decide(req, reason(req, where))
        sglang_prepare_abort(req, req._kvmem_reason.message,
                             status_code=req._kvmem_reason.status_code)

    answered = []
    # the overlap loop's queued results first, as its next iteration would
    # (disaggregation/decode.py:3165, pop_and_process): their requests then finish or go
    # on decoding with their KV accounted as usual
    queued = getattr(sched, "result_queue", None)
    if queued:
        while queued:
            batch, result = queued.popleft()
            sched.process_batch_result(batch, result)
        # the loop pops a result whenever last_batch is set (decode.py:3216): none is left
        sched.last_batch = None
    # requests that hold their KV: running (decoding, or between the chunks of a chunked
    # prefill on a plain server), or waiting to run (a decode's hold their transferred KV)
    batches = [getattr(sched, "running_batch", None), getattr(sched, "last_batch", None)]
    chunked = getattr(sched, "chunked_req", None)
    live, seen = [], set()
    for req in ([chunked] if chunked is not None else []) + [
            r for b in batches if b is not None for r in b.reqs]:
        if id(req) not in seen and not req.finished():
            seen.add(id(req))
            live.append(req)
    for req in live:
        answer(req, "running")
        req.to_finish = None
        sched._release_aborted_request(req)
        if req.kv.holds_kv or req.kv.holds_mamba:
            release_kv_cache(req, sched.tree_cache, checkpoint=False)
        answered.append(req)
    if chunked is not None:
        sched.chunked_req = None
    for b in batches:
        if b is not None and b.reqs:
            b.filter_batch()
    for req in list(sched.waiting_queue):
        answer(req, "waiting to run")
        sched._release_aborted_request(req)
        if req.kv.holds_kv:  # a decode's transferred request; a plain server's holds none
            release_kv_cache(req, sched.tree_cache, checkpoint=True)
        answered.append(req)
    sched.waiting_queue = []
    if answered:
        sched.output_streamer.stream_output(answered, any(r.return_logprob for r in answered))
    if not is_decode(sched):
        return answered
    # requests before their KV arrived: sglang's own abort and queue paths answer them
    # (with the reason above, kvmem_sglang.prefill.stream_output) and free their pages,
    # at the prefill's ABORT_ACK where a write may still be in flight
    prealloc, transfer = sched.disagg_decode_prealloc_queue, sched.disagg_decode_transfer_queue
    for where, queue in (("bootstrapping", prealloc.queue), ("receiving its KV", transfer.queue)):
        for decode_req in list(queue):
            answer(decode_req.req, where)
            if not getattr(decode_req, "host_staged", False):
                decode_req.kv_receiver.abort()
            answered.append(decode_req.req)
    for req in list(prealloc.retracted_queue):
        from sglang.srt.disaggregation.decode import discard_kv_cache_backup
        from sglang.srt.disaggregation.utils import get_disagg

        discard_kv_cache_backup(req, sched.tree_cache,
                                get_disagg().disaggregation_decode_retraction_backup)
        answer(req, "retracted")
        sched.output_streamer.stream_output([req], req.return_logprob)
        answered.append(req)
    prealloc.retracted_queue = []
    _run_queues(sched, prealloc, transfer)
    return answered


def _run_queues(sched, prealloc, transfer) -> None:
    """sglang's decode queue steps (``process_decode_queue``, disaggregation/decode.py:3458)
    until the aborted requests have left the prealloc and transfer queues and no
    deferred release is held, bounded by ``SGLANG_KVMEM_DRAIN_TIMEOUT``.  Every TP rank
    runs the same number of steps (the steps hold collectives): the stop condition is
    agreed across the attention-TP group."""
    from torch.distributed import ReduceOp

    from sglang.srt.disaggregation.utils import all_reduce_flags

    start = time.monotonic()
    deadline = start + options.active().drain_timeout
    steps = 0
    while True:
        busy = bool(prealloc.queue or transfer.queue or transfer.has_pending_deferred_releases())
        late = time.monotonic() >= deadline
        busy, late = all_reduce_flags([int(busy), int(late)], group=transfer.gloo_group,
                                      op=ReduceOp.MAX)
        if not busy:
            break
        if late:
            _give_up(sched, transfer, prealloc, time.monotonic() - start)
            break
        transfer.resolve_deferred_releases()
        req_conns, _ = prealloc.pop_preallocated()
        transfer.extend(req_conns)
        sched.waiting_queue.extend(transfer.pop_transferred())
        steps += 1
        time.sleep(DRAIN_POLL_S)
    if steps:
        logger.info("kvmem-sglang: decode queues drained for the release in %.3f s (%d "
                    "step(s))", time.monotonic() - start, steps)


def _give_up(sched, transfer, prealloc, waited: float) -> None:
    """Past SGLANG_KVMEM_DRAIN_TIMEOUT: release what still waits for a prefill's
    ABORT_ACK through sglang's own release (``_do_release``: its pages, request and
    metadata slots), as sglang's deferred release does at its own deadline
    (disaggregation/decode.py:3046), and drop what is still queued, so that sglang's
    release finds the scheduler idle instead of asserting.  The prefill may still write
    into those pages: the pool is deregistered and released right after, so such a
    write fails there (on an RDMA NIC) instead of landing in a page given to another
    request."""
    held = list(transfer._deferred_releases)
    rooms = [e[0].req.bootstrap_room for e in held]
    queued = [r.req.rid for r in list(prealloc.queue) + list(transfer.queue)]
    logger.error("kvmem-sglang: release_memory_occupation(kv_cache) on the decode: after "
                 "%.1f s (SGLANG_KVMEM_DRAIN_TIMEOUT) %d KV release(s) still wait for "
                 "their prefill's ABORT_ACK (rooms %s) and %d request(s) are still queued "
                 "(%s); releasing them anyway", waited, len(held), rooms, len(queued), queued)
    transfer._deferred_releases = []
    left = [(d, d.metadata_buffer_index) for d in transfer.queue]
    for decode_req, idx in [(e[0], e[3]) for e in held] + left:
        try:
            transfer._do_release(decode_req, idx)
        except Exception:  # noqa: BLE001 - the release must go on; the pool is reset next
            logger.exception("kvmem-sglang: releasing held room %s failed",
                             decode_req.req.bootstrap_room)
    unanswered = [d.req for d in list(prealloc.queue) + list(transfer.queue)
                  if not getattr(d.req, "finished_output", False)]
    dropped = {id(d) for d in prealloc.queue}
    for decode_req in prealloc.queue:
        if decode_req.kv_receiver is not None:
            decode_req.kv_receiver.clear()
    if hasattr(prealloc, "pending_reqs"):  # shares the DecodeRequests (decode.py:1397)
        prealloc.pending_reqs = [r for r in prealloc.pending_reqs if id(r) not in dropped]
    prealloc.queue.clear()
    transfer.queue.clear()
    if unanswered:  # answered with the reason decided above (prefill.stream_output)
        sched.output_streamer.stream_output(unanswered,
                                            any(r.return_logprob for r in unanswered))
