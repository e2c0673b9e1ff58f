"""A PD decode server's (or a plain server's) drain before sglang's
``release_memory_occupation``, run by the adapter's release hook
(:func:`kvmem_sglang.release.release_memory_occupation`).

sglang 0.5.23 (the installed package; paths below are under ``sglang/srt/``):

* ``SchedulerWeightUpdaterManager.release_memory_occupation``
  (``managers/scheduler_components/weight_updater.py``) asserts an idle scheduler.  On a
  decode server ``Scheduler.is_fully_idle`` (``managers/scheduler.py``) also needs empty
  prealloc and transfer queues, no retracted requests and no deferred KV releases: a
  release that comes while any request is bootstrapping, waiting for its KV, queued,
  decoding, or held for an ABORT_ACK raises ``AssertionError`` inside the scheduler loop,
  and the decode server dies.  RL frameworks release every engine, decode included.
  :func:`drain` (called by the adapter's release hook, before sglang's
  release) answers every such request 503 with the reason and frees what it holds,
  through sglang's own paths: a request whose KV the prefill may still be writing is
  aborted (its receiver sends ABORT to the prefill) and its pages are freed only at the
  prefill's ABORT_ACK (sglang's deferred release), or after
  ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`` as sglang arranges; the
  whole wait is bounded by ``SGLANG_KVMEM_DRAIN_TIMEOUT``.
"""

from __future__ import annotations

import contextlib
import logging
import time

from kvmem_sglang import roles, state
from kvmem_sglang.decode import is_decode
from kvmem_sglang.reasons import decide, reason_of, released_while

logger = logging.getLogger("kvmem.sglang")

DRAIN_POLL_S = 0.002


def drain(sched, what: str = "KV cache") -> list:
    """Answer what a decode (or plain, non-PD) scheduler holds and free it, so that
    sglang's release finds the scheduler idle; the requests answered.  Raises what
    sglang's paths raise (the release hook then refuses the release, which keeps the
    loop alive).

    A running engine's requests are all answered 503.  A paused engine
    (``pause_generation``) keeps what stock sglang keeps across a release
    (``release_memory_occupation`` asserts ``is_fully_idle(ignore_waiting=True)`` for a
    paused engine): its running requests are first retracted through sglang's own retract
    (a ``retract`` pause has done so already; an ``in_place`` pause, whose running batch
    stock cannot release, is retracted here the same way), so they wait, hold no KV, and
    run again after ``continue_generation`` (a decode's re-bootstrap theirs from the
    prefill); what still holds KV or waits for a transfer is answered 503."""
    answered = _drain(sched, what)
    if answered:
        logger.warning(
            "kvmem-sglang: release_memory_occupation: %d request(s) answered 503: %s",
            len(answered),
            ", ".join(r.rid for r in answered),
        )
    return answered


def _retract_paused(sched) -> None:
    """sglang's ``retract`` pause on a paused scheduler that still runs requests (an
    ``in_place`` pause): it processes the overlap loop's queued result, frees the KV of
    every running request and queues it again (a decode holds it for re-bootstrap)."""
    if not getattr(sched, "_engine_paused", False):
        return
    running = getattr(sched, "running_batch", None)
    last = getattr(sched, "last_batch", None)
    staged = is_decode(sched) and any(r.kv.holds_kv for r in sched.waiting_queue)
    if (
        (running is None or running.is_empty())
        and getattr(sched, "chunked_req", None) is None
        and (last is None or last.is_empty())
        and not staged
    ):
        return
    from sglang.srt.managers.io_struct import PauseGenerationReqInput

    sched.pause_generation(PauseGenerationReqInput(mode="retract"))
    logger.info(
        "kvmem-sglang: release_memory_occupation on an engine paused in place: "
        "its running requests were retracted as a retract pause does; they run "
        "again after continue_generation"
    )


def _drain(sched, what: str) -> list:
    from sglang.srt.disaggregation.utils import prepare_abort as sglang_prepare_abort
    from sglang.srt.mem_cache.common import release_kv_cache

    paused = bool(getattr(sched, "_engine_paused", False))
    server = roles.server(sched)

    def reason(req, where):
        return released_while(server, what, req.rid, where)

    def answer(req, where) -> None:
        decide(req, reason(req, where))
        sglang_prepare_abort(req, reason_of(req).message, status_code=reason_of(req).status_code)

    answered = []
    _retract_paused(sched)
    # the overlap loop's queued results first, as its next iteration would
    # (``pop_and_process`` in SchedulerDisaggregationDecodeMixin's
    # ``event_loop_overlap_disagg_decode``): their requests then finish or go on decoding
    # with their KV accounted as usual
    last = getattr(sched, "last_batch", None)
    queued = getattr(sched, "result_queue", None)
    if queued:
        while queued:
            batch, result = queued.popleft()
            sched.process_batch_result(batch, result)
        # the loop pops a result whenever last_batch is set: none is left
        sched.last_batch = None
    # requests that hold their KV: running (decoding, or between the chunks of a chunked
    # prefill on a plain server), in the last batch (an extend batch's requests join the
    # running batch only at the next iteration), or waiting to run (a decode's hold their
    # transferred KV)
    batches = [getattr(sched, "running_batch", None), last]
    chunked = getattr(sched, "chunked_req", None)
    live, seen = [], set()
    for req in ([chunked] if chunked is not None else []) + [
        r for b in batches if b is not None for r in b.reqs
    ]:
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
    kept = []
    for req in list(sched.waiting_queue):
        if paused and not req.kv.holds_kv:  # what stock keeps: it runs after continue
            kept.append(req)
            continue
        answer(req, "waiting to run")
        sched._release_aborted_request(req)
        if req.kv.holds_kv:  # a decode's transferred request; a plain server's holds none
            release_kv_cache(req, sched.tree_cache, checkpoint=True)
        answered.append(req)
    sched.waiting_queue = kept
    if kept:
        logger.info(
            "kvmem-sglang: release_memory_occupation on a paused engine keeps %d "
            "waiting request(s) (they hold no KV; they run after the resume and "
            "continue_generation): %s",
            len(kept),
            ", ".join(r.rid for r in kept),
        )
    if answered:
        sched.output_streamer.stream_output(answered, any(r.return_logprob for r in answered))
    if not is_decode(sched):
        return answered
    # requests before their KV arrived: sglang's own abort and queue paths answer them
    # (with the reason above, kvmem_sglang.prefill.stream_output) and free their pages, at
    # the prefill's ABORT_ACK where a write may still be in flight.  Those whose prefill is
    # not resolved yet are resolved first, as sglang's own pass does before it preallocates
    # (``pop_preallocated``): a receiver aborted before it knows its prefill sends no ABORT
    # (``CommonKVReceiver.ensure_abort_notified``), and that prefill would then bootstrap
    # the request alone until its bootstrap timeout while the router waits for it.
    prealloc, transfer = sched.disagg_decode_prealloc_queue, sched.disagg_decode_transfer_queue
    if getattr(prealloc, "pending_reqs", None):
        prealloc._resolve_pending_reqs()
    for where, queue in (("bootstrapping", prealloc.queue), ("receiving its KV", transfer.queue)):
        for decode_req in list(queue):
            answer(decode_req.req, where)
            if not getattr(decode_req, "host_staged", False):
                decode_req.kv_receiver.abort()
                if queue is prealloc.queue:  # its prefill may not know the room yet
                    state.PROCESS.chase.add(decode_req.kv_receiver)
            answered.append(decode_req.req)
    for req in list(prealloc.retracted_queue):
        from sglang.srt.disaggregation.decode import discard_kv_cache_backup
        from sglang.srt.disaggregation.utils import get_disagg

        discard_kv_cache_backup(
            req, sched.tree_cache, get_disagg().disaggregation_decode_retraction_backup
        )
        answer(req, "retracted")
        sched.output_streamer.stream_output([req], req.return_logprob)
        answered.append(req)
    prealloc.retracted_queue = []
    _run_queues(sched, prealloc, transfer)
    return answered


def _run_queues(sched, prealloc, transfer) -> None:
    """sglang's decode queue steps (``SchedulerDisaggregationDecodeMixin.process_decode_queue``)
    until the aborted requests have left the prealloc and transfer queues and no
    deferred release is held, bounded by ``SGLANG_KVMEM_DRAIN_TIMEOUT``.  Every TP rank
    runs the same number of steps (the steps hold collectives): the stop condition is
    agreed across the attention-TP group."""
    from torch.distributed import ReduceOp

    from sglang.srt.disaggregation.utils import all_reduce_flags

    host = transfer._is_host_destination  # held as sglang holds them (_give_up)
    start = time.monotonic()
    deadline = start + state.PROCESS.options.active().drain_timeout
    steps = 0
    while True:
        busy = bool(
            prealloc.queue
            or any(not host(d) for d in transfer.queue)
            or any(not host(e[0]) for e in transfer._deferred_releases)
        )
        late = time.monotonic() >= deadline
        busy, late = all_reduce_flags(
            [int(busy), int(late)], group=transfer.gloo_group, op=ReduceOp.MAX
        )
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
        logger.info(
            "kvmem-sglang: decode queues drained for the release in %.3f s (%d step(s))",
            time.monotonic() - start,
            steps,
        )


def _give_up(sched, transfer, prealloc, waited: float) -> None:
    """Past SGLANG_KVMEM_DRAIN_TIMEOUT: release what still waits for a prefill's ABORT_ACK
    through sglang's own release (``_do_release``: its pages, request and metadata slots),
    as sglang's deferred release does at its own deadline
    (``DecodeTransferQueue.resolve_deferred_releases``), and drop what is still queued, so
    that sglang's release finds the scheduler idle instead of asserting.  The prefill may
    still write into those pages: the pool is deregistered and released right after, so
    such a write fails there (on an RDMA NIC) instead of landing in a page given to another
    request.

    Host destinations (``host_staged``: the KV lands in host memory, outside the pool)
    are not released here: sglang never times their release out
    (``resolve_deferred_releases``: "a timeout cannot prove that a remote write has
    stopped"), and releasing the KV pool protects nothing of theirs.  They stay held, set
    aside while sglang's release runs (:func:`host_destinations_set_aside`), and are
    released at their ABORT_ACK as sglang does."""
    host = transfer._is_host_destination
    held = [e for e in transfer._deferred_releases if not host(e[0])]
    queued = [r.req.rid for r in list(prealloc.queue) + list(transfer.queue) if not host(r)]
    logger.error(
        "kvmem-sglang: release_memory_occupation(kv_cache) on the decode: after "
        "%.1f s (SGLANG_KVMEM_DRAIN_TIMEOUT) %d KV release(s) still wait for "
        "their prefill's ABORT_ACK (rooms %s) and %d request(s) are still queued "
        "(%s); releasing them anyway",
        waited,
        len(held),
        [e[0].req.bootstrap_room for e in held],
        len(queued),
        queued,
    )
    transfer._deferred_releases = [e for e in transfer._deferred_releases if host(e[0])]
    left = [(d, d.metadata_buffer_index) for d in transfer.queue if not host(d)]
    for decode_req, idx in [(e[0], e[3]) for e in held] + left:
        try:
            transfer._do_release(decode_req, idx)
        except Exception:  # noqa: BLE001 - the release must go on; the pool is reset next
            logger.exception(
                "kvmem-sglang: releasing held room %s failed", decode_req.req.bootstrap_room
            )
    kept = [d for d in transfer.queue if host(d)]
    unanswered = [
        d.req
        for d in list(prealloc.queue) + list(transfer.queue)
        if not getattr(d.req, "finished_output", False)
    ]
    dropped = {id(d) for d in prealloc.queue}
    for decode_req in prealloc.queue:
        if decode_req.kv_receiver is not None:
            decode_req.kv_receiver.clear()
    if hasattr(prealloc, "pending_reqs"):  # shares the DecodeRequests (see pop_preallocated)
        prealloc.pending_reqs = [r for r in prealloc.pending_reqs if id(r) not in dropped]
    prealloc.queue.clear()
    transfer.queue[:] = kept
    if kept or transfer._deferred_releases:
        logger.warning(
            "kvmem-sglang: %d host-staged request(s) stay held until their "
            "prefill's ABORT_ACK (their KV is not in the pool)",
            len(kept) + len(transfer._deferred_releases),
        )
    if unanswered:  # answered with the reason decided above (prefill.stream_output)
        sched.output_streamer.stream_output(unanswered, any(r.return_logprob for r in unanswered))


@contextlib.contextmanager
def host_destinations_set_aside(sched):
    """A decode's requests whose KV goes to host memory (``host_staged``) and that still
    wait for their transfer or their prefill's ABORT_ACK, out of sight of sglang's
    release and back afterwards: the release asserts an idle scheduler, and these hold
    nothing of the KV pool it releases (:func:`_give_up`)."""
    transfer = getattr(sched, "disagg_decode_transfer_queue", None) if is_decode(sched) else None
    host = getattr(transfer, "_is_host_destination", None)
    if host is None:
        yield
        return
    queued = [d for d in transfer.queue if host(d)]
    deferred = [e for e in transfer._deferred_releases if host(e[0])]
    if not (queued or deferred):
        yield
        return
    transfer.queue[:] = [d for d in transfer.queue if not host(d)]
    transfer._deferred_releases = [e for e in transfer._deferred_releases if not host(e[0])]
    try:
        yield
    finally:
        transfer.queue[:] = queued + list(transfer.queue)
        transfer._deferred_releases = deferred + list(transfer._deferred_releases)
