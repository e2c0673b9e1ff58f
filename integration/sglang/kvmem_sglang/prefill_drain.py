"""A PD prefill's drain before sglang's ``release_memory_occupation``: every request it
holds answered 503 (or with its client's abort) and freed once, through sglang's own
paths, and the transfer workers' posted writes waited for, so that nothing reads or
writes the memory the release gives back.  Run by
:func:`kvmem_sglang.release.release_memory_occupation`; counts in
:data:`kvmem_sglang.prefill.STATS`.

What stock 0.5.23 does and what the drain changes (each function's docstring names
sglang's code):

==========================================  ==================================  ===========================
event                                       stock 0.5.23                        with SGLANG_KVMEM=1
==========================================  ==================================  ===========================
release_memory_occupation(kv_cache) with    AssertionError in the scheduler     each answered 503 with the
requests bootstrapping / waiting /          loop (under -O: dropped unanswered, reason, sender aborted, KV and
in flight                                   senders never aborted)              slots freed; release goes on
release with a request between the chunks   AssertionError in the scheduler     answered 503, sender aborted,
of a chunked prefill (sched.chunked_req)    loop                                KV + request and metadata slot
                                                                                freed, chunked_req cleared
release with a batch's result still queued  AssertionError in the scheduler     device synchronized; its
(overlap loop; also paused in place)        loop                                requests answered 503 and
                                                                                freed, the result dropped
release while a transfer worker still has   deregisters and releases under the  waits until they are DONE or ERR
writes posted (sglang's per-room count)     NIC's read                          (at most SGLANG_KVMEM_DRAIN_TIMEOUT)
==========================================  ==================================  ===========================
"""

from __future__ import annotations

import contextlib
import logging
import time

from kvmem_sglang import roles, state
from kvmem_sglang.prefill import STATS
from kvmem_sglang.reasons import decide as _decide
from kvmem_sglang.reasons import reason_of, released_while

logger = logging.getLogger("kvmem.sglang")

DRAIN_POLL_S = 0.001  # how often a release re-reads the transfer workers' counts
DRAIN_LOG_S = 5.0  # a release still waiting logs the rooms it waits for this often


def drain_for_release(sched, what: str = "KV cache") -> None:
    """Answer every PD request of ``sched`` with 503 and free what it holds, before
    sglang's release (which asserts an idle scheduler,
    ``SchedulerWeightUpdaterManager.release_memory_occupation``).  Never raises: sglang
    dispatches the release with no try/except (``Scheduler.process_input_requests``), so
    an exception here ends the scheduler loop.

    sglang 0.5.23 ingests a release at the top of a loop iteration (``ingest_requests``
    in the normal and the overlap loop, ``event_loop_normal_disagg_prefill`` and
    ``event_loop_overlap_disagg_prefill`` of ``SchedulerDisaggregationPrefillMixin``,
    disaggregation/prefill.py); what a request can be doing then:

    * bootstrapping, waiting, in flight: answered and freed through sglang's own paths;
    * ``chunked_req`` between two chunks (normal loop): its last chunk's forward and
      result are done (the normal loop processes a batch's result right after its
      forward, before the next ingest); it is in no forward.  Freed as sglang's
      ``Scheduler.process_pending_chunked_abort`` frees a chunked request: sender aborted,
      pending chunk send cleared, metadata slot, tree handle, KV pages and request slot;
      ``chunked_req`` cleared;
    * in a batch whose result is still queued (overlap loop only: a batch is launched and
      queued on ``result_queue`` and its result processed in the next iteration, so an
      ingest can come between; also while the engine is paused in place): its forward may
      still be writing the pages.  The device is synchronized first, then its requests are
      freed like the chunked one.  The queued results stay queued (set aside only during
      sglang's release, ``queued_results_set_aside``) and the loop processes them as
      usual, skipping these answered requests;
    * ``running_batch``: a PD prefill server never fills it (the mixin's
      ``get_next_disagg_prefill_batch_to_run`` passes it through), so only its live
      requests, if any, are freed like the others.

    A request already aborted by its client is answered with that abort."""
    # in one call, not kvmem.disagg's stepped pause: sglang asserts an idle scheduler after it
    from sglang.srt.disaggregation.prefill import maybe_release_metadata_buffer
    from sglang.srt.disaggregation.utils import prepare_abort
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.mem_cache.common import release_kv_cache

    server = roles.server(sched)

    def reason(req, where):
        return released_while(server, what, req.rid, where)

    queue = sched.disagg_prefill_bootstrap_queue
    waiting = getattr(sched, "waiting_queue", [])
    inflight_q = getattr(sched, "disagg_prefill_inflight_queue", [])
    inflight = set(map(id, inflight_q))
    chunked = getattr(sched, "chunked_req", None)
    pending = list(getattr(sched, "result_queue", None) or ())
    last = getattr(sched, "last_batch", None)
    answered = []
    for where, reqs in (("bootstrapping", queue.queue), ("waiting", waiting)):
        for req in list(reqs):
            _decide(req, reason(req, where))
            sched._release_aborted_request(req)
            sched.release_aborted_prefill_waiting_req(req)  # sender, metadata, KV
            prepare_abort(req, reason_of(req).message, status_code=reason_of(req).status_code)
            answered.append(req)
    queue.queue = []
    if answered:
        sched.waiting_queue = [r for r in waiting if r not in answered]
    for req in list(inflight_q):  # what sglang's inflight loop does for Failed
        if req.pending_bootstrap:  # prefilled before its bootstrap finished (optimistic)
            _decide(req, reason(req, "bootstrapping"))
            req.disagg_kv_sender.abort()
            sched.handle_bootstrap_failure(req)  # frees KV and metadata, answers it
        else:
            _decide(req, reason(req, "transferring its KV"))
            req.disagg_kv_sender.abort()
            sched.handle_inflight_transfer_failure(req)
            maybe_release_metadata_buffer(req, sched.req_to_metadata_buffer_idx_allocator)
        answered.append(req)  # streamed once: sglang skips an answer already sent
    if inflight_q:
        sched.disagg_prefill_inflight_queue = []
    # requests of a batch: the chunked one between chunks, those of a queued result
    batches = [getattr(sched, "running_batch", None), last] + [b for b, _ in pending]
    live, seen = [], set(map(id, answered)) | inflight
    for req in ([chunked] if chunked is not None else []) + [
        r for b in batches if b is not None for r in b.reqs
    ]:
        if id(req) not in seen and not req.finished():
            seen.add(id(req))
            live.append(req)
    if live and pending:  # a forward of the overlap loop may still write their pages
        # the scheduler's device (Scheduler.init_overlap, always run, sets device_module
        # from it); not torch.get_device_module(), which on a CUDA build of torch is
        # torch.cuda whatever the server runs on, and raises on a CPU server
        sched.device_module.synchronize()
    for req in live:
        if isinstance(req.to_finish, FINISH_ABORT):  # its client's abort, not yet applied
            _decide(req, req.to_finish)
        _decide(
            req,
            reason(
                req, "between the chunks of its prefill" if req is chunked else "in a prefill batch"
            ),
        )
        req.to_finish = None
        prepare_abort(req, reason_of(req).message, status_code=reason_of(req).status_code)
        sched.clear_pending_chunk_send(req)
        if req.disagg_kv_sender is not None:
            req.disagg_kv_sender.abort()
        maybe_release_metadata_buffer(req, sched.req_to_metadata_buffer_idx_allocator)
        req.pending_bootstrap = False
        sched._release_aborted_request(req)
        if req.kv.holds_kv or req.kv.holds_mamba:
            release_kv_cache(req, sched.tree_cache, checkpoint=False)
        answered.append(req)
    if chunked is not None and chunked.finished():
        sched.chunked_req = None
    if (
        getattr(sched, "_pending_chunked_abort_req", None) is not None
        and sched._pending_chunked_abort_req.finished()
    ):
        sched._pending_chunked_abort_req = None
    if answered:  # one answer per request, as the inflight queue streams its done ones
        STATS.released_aborts += len(answered)
        logger.warning(
            "kvmem-sglang: release_memory_occupation(kv_cache): %d request(s) "
            "answered 503 and their senders aborted: %s",
            len(answered),
            ", ".join(r.rid for r in answered),
        )
        sched.output_streamer.stream_output(answered, any(r.return_logprob for r in answered))
    if last is not None and last.reqs:
        last.filter_batch()  # drops finished requests: all of them are answered now


@contextlib.contextmanager
def queued_results_set_aside(sched):
    """The overlap loop's queued batch results and ``last_batch`` out of sight of
    sglang's release, which asserts an idle scheduler
    (``SchedulerWeightUpdaterManager.release_memory_occupation``;
    ``Scheduler.is_fully_idle`` counts both), and back afterwards.  ``drain_for_release``
    has answered and freed every request in them, so the loop then processes each result as
    it would have (``event_loop_overlap_disagg_prefill`` pops it from ``result_queue``): it
    skips an aborted request whose resources are gone (``is_aborted`` ->
    ``_retire_aborted_prefill_result`` in ``process_batch_result_disagg_prefill``,
    disaggregation/prefill.py).  The loop's own state (its local ``batch``, ``last_batch``,
    the queue) stays as stock left it, so no later iteration pops a result that is not
    there."""
    queued = list(getattr(sched, "result_queue", None) or ())
    if not queued:
        yield
        return
    last = sched.last_batch
    sched.result_queue.clear()
    sched.last_batch = None
    try:
        yield
    finally:
        sched.result_queue.extend(queued)
        sched.last_batch = last


def await_posted_writes(sched) -> None:
    """Wait until the transfer backend's workers hold no chunk: none dequeued and none
    with a write posted and not yet DONE or ERR.  sglang's ``CommonKVManager`` (NIXL and
    mooncake) counts exactly that per room in ``_staging_outstanding`` (made in its
    ``__init__``; a worker counts a chunk when it dequeues it and uncounts it once every
    handle it posted has settled, ``NixlKVManager.transfer_worker``).  The drain above
    aborted every sender, so a worker skips the chunks still queued (their room is Failed)
    and only the writes already posted remain: the NIC may still read the pool's pages, so
    neither the deregistration nor the release may run before they settle.

    Bounded by ``SGLANG_KVMEM_DRAIN_TIMEOUT`` seconds (progress logged every
    DRAIN_LOG_S): a handle that never settles (sglang then keeps its room counted for
    ever, "poisoned") must not hang the release.  Past it the release goes on, with an
    error naming the rooms; their decode falls back to its own release timeout, as sglang
    arranges for a poisoned room.  A later release does not wait for those rooms again
    (the memory under their writes was released already); it waits for the others."""
    mgr = getattr(getattr(sched, "disagg_prefill_bootstrap_queue", None), "kv_manager", None)
    counts = getattr(mgr, "_staging_outstanding", None)
    if not isinstance(counts, dict):
        return  # a backend without transfer workers (fake)

    # rooms an earlier release gave up on: that release went on under their writes, so
    # waiting for them again protects nothing (sglang keeps such a room counted for ever)
    given_up = state.DRAIN_GIVEN_UP.setdefault(mgr, set)
    given_up &= {room for room, n in dict(counts).items() if n > 0}

    def busy() -> dict:
        return {room: n for room, n in dict(counts).items() if n > 0 and room not in given_up}

    if given_up:
        logger.warning(
            "kvmem-sglang: release_memory_occupation(kv_cache) does not wait "
            "again for room(s) %s: an earlier release gave up on their writes",
            sorted(given_up),
        )
    rooms = busy()
    start = time.monotonic()
    deadline, next_log = start + state.PROCESS.options.active().drain_timeout, start + DRAIN_LOG_S
    _await_settle_window(mgr, deadline)
    if not rooms:
        return
    STATS.drain_waits += 1
    logger.info(
        "kvmem-sglang: release_memory_occupation(kv_cache) waits for the writes "
        "already posted for %d room(s) to settle: %s",
        len(rooms),
        rooms,
    )
    while rooms:
        now = time.monotonic()
        if now >= deadline:
            STATS.drain_timeouts += 1
            given_up.update(rooms)
            logger.error(
                "kvmem-sglang: release_memory_occupation(kv_cache): writes of "
                "room(s) %s still unsettled after %.1f s (SGLANG_KVMEM_DRAIN_"
                "TIMEOUT); releasing anyway: their decode side falls back to its "
                "release timeout",
                rooms,
                now - start,
            )
            return
        if now >= next_log:
            next_log = now + DRAIN_LOG_S
            logger.warning(
                "kvmem-sglang: release still waiting (%.1f s) for posted writes of room(s) %s",
                now - start,
                rooms,
            )
        time.sleep(DRAIN_POLL_S)
        rooms = busy()
        # a write that failed meanwhile opened its window before its room was uncounted
        _await_settle_window(mgr, deadline)
    logger.info(
        "kvmem-sglang: posted writes settled after %.3f s; releasing", time.monotonic() - start
    )


def _await_settle_window(mgr, deadline: float) -> None:
    """Wait (until ``deadline`` at most) for the settle window a transfer backend opened
    after a write that failed while parts of it may still be moving
    (``state.SETTLE_UNTIL``, monotonic seconds; set by ``kvmem_sglang.mooncake``):
    sglang's worker uncounts such a room at once, so the counts above cannot show it.
    Read before the counts and again after every poll of them: a write that fails while
    the release waits opens its window (``_poison_unsettled_send``) just before its room
    is uncounted, so the poll that finds the room settled finds the window too."""
    until = min(state.SETTLE_UNTIL.get(mgr) or 0.0, deadline)
    wait = until - time.monotonic()
    if wait > 0:
        logger.warning(
            "kvmem-sglang: release_memory_occupation(kv_cache) waits %.2f s for "
            "the slices of a failed transfer that may still move",
            wait,
        )
        time.sleep(wait)
