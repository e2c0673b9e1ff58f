"""The PD prefill lifecycle under sglang 0.5.23's scheduler: every request's KV freed
once, every request answered once, with the status of kvmem's lifecycle table (docs/disagg.md).

What stock 0.5.23 does and what these hooks change (each hook's docstring names sglang's code):

==========================================  ==================================  ===========================
event                                       stock 0.5.23                        with SGLANG_KVMEM=1
==========================================  ==================================  ===========================
WaitingForInput/Transferring longer than    stays in the inflight queue for     sender aborted (decode told),
SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT      ever, KV and metadata slot held     KV + metadata slot freed, 504
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
a request arriving while released           queued; its bootstrap may run on    503 at once, until the resume
                                            deregistered buffers
release / resume on NIXL                    never deregisters; every resume     deregistered at release,
                                            registers the buffers again         registered once at resume
a chunk send built before release/resume    posted                              refused before posting (sender
                                                                                aborted, 503)
bootstrap timeout                           500 "Prefill bootstrap failed"      504
other bootstrap failure                     500                                 500 (unchanged)
client abort while bootstrapping or         500 "Prefill bootstrap/transfer     the abort's finish reason and
in flight                                   failed"                             status
release twice / resume without release      flush again / KeyError in the       refused with a log line,
                                            scheduler loop                      nothing changed
abort of an unknown rid                     nothing (silently)                  nothing, one log line
idle scheduler holding pages or slots       invariant checker (test mode)       one log line + metric naming
                                                                                the owners (kvmem_sglang.audit)
==========================================  ==================================  ===========================

The hooks decide a request's fate by giving it a reason (``reasons.decide``: a
``FINISH_ABORT``) and let sglang's own paths free it (``handle_inflight_transfer_failure``,
``handle_bootstrap_failure``, ``release_aborted_prefill_waiting_req``); the one place
every answer leaves the scheduler, ``SchedulerOutputStreamer.stream_output``, puts that
reason on the answer.  Nothing here allocates or frees KV itself.

Tensor parallelism: each rank decides its transfer timeout on its own clock; the first
rank to abort a sender makes the poll all-reduce (MIN) report Failed on every rank in the
same step, so all ranks free the request together.  The answer the client gets is rank
0's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from http import HTTPStatus

from kvmem.disagg.outcome import Ending
from kvmem_sglang import audit, decode, kvpool, notify, options, roles, state
from kvmem_sglang.reasons import abort_reason as _abort_reason
from kvmem_sglang.reasons import decide as _decide
from kvmem_sglang.reasons import http_status, reason_of
from kvmem_sglang.reasons import tag
from kvmem_sglang.mooncake import RegistrationError
from kvmem_sglang.options import TRANSFER_TIMEOUT_VAR

logger = logging.getLogger("kvmem.sglang")

DRAIN_POLL_S = 0.001  # how often a release re-reads the transfer workers' counts
DRAIN_LOG_S = 5.0  # a release still waiting logs the rooms it waits for this often


@dataclass
class PrefillStats:
    """What the hooks did in this process (tests and operators read it)."""

    transfer_timeouts: int = 0
    bootstrap_timeouts: int = 0
    client_aborts: int = 0  # bootstrapping/inflight requests answered as aborts
    released_aborts: int = 0  # requests answered 503 by a release
    refused_while_released: int = 0  # requests answered 503 on arrival
    refused_stale_sends: int = 0
    refused_releases: int = 0
    refused_resumes: int = 0
    unknown_aborts: int = 0
    deregistrations: int = 0  # NIXL descriptor lists deregistered at release
    registrations_skipped: int = 0
    drain_waits: int = 0  # releases that waited for posted writes to settle
    drain_timeouts: int = 0  # releases that went on with writes still unsettled


STATS = PrefillStats()
_WARNED: set[str] = set()  # managers already warned about (once per class)


# -- helpers -----------------------------------------------------------------------------


def _is_prefill(sched) -> bool:
    return roles.role(sched) == "prefill"


def _matches(recv_req, req) -> bool:  # sglang's own rule in Scheduler.abort_request
    return recv_req.abort_all or req.rid.startswith(recv_req.rid)


# -- arrival: 503 while released; stamp the registration epoch ----------------------------


def add_request_to_queue(original, sched, req, *args, **kwargs):
    """A request that reaches the queues while the KV cache or the weights are released
    is answered 503 at once: a forward would read or write memory that is gone (on a GPU
    an illegal address).  That covers a request that arrives, one whose grammar became
    ready (sglang queues it from its grammar queue through this call) and one that
    ``continue_generation`` would schedule.  On a prefill its decode is told too
    (notify.refuse_room).  A decode refuses in its prealloc queue instead
    (kvmem_sglang.decode.pop_preallocated), where its receiver exists to tell the
    prefill.  A request that already ended (its client's abort) keeps its own answer."""
    if roles.released(sched) and not decode.is_decode(sched):
        from sglang.srt.disaggregation.utils import prepare_abort
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        msg = (
            f"{roles.server(sched)} has released its {roles.what_released(sched)} "
            f"(release_memory_occupation); request {req.rid} refused until "
            "resume_memory_occupation"
        )
        status = http_status(Ending.RELEASED)
        ended = req.finished_reason if isinstance(req.finished_reason, FINISH_ABORT) else None
        if ended is not None:
            msg, status = ended.message, ended.status_code
        else:
            STATS.refused_while_released += 1
            logger.warning("kvmem-sglang: %s", msg)
        if _is_prefill(sched):
            queue = getattr(sched, "disagg_prefill_bootstrap_queue", None)
            notify.refuse_room(
                getattr(queue, "kv_manager", None),
                getattr(req, "bootstrap_room", None),
                tag(msg, status),
            )
        sched._release_aborted_request(req)
        prepare_abort(req, msg, status_code=status)
        sched.output_streamer.stream_output([req], req.return_logprob)
        return None
    state.REQ_EPOCH.set(req, state.EPOCH.get(sched, 0))
    audit.track(req)
    state.BUSY.set(sched, True)
    return original(sched, req, *args, **kwargs)


# -- client abort -----------------------------------------------------------------------------


def abort_request(original, sched, recv_req, *args, **kwargs):
    """A client's abort of a bootstrapping or inflight request is answered as that abort
    (sglang answers it later through its failure paths, as a 500)."""
    if _is_prefill(sched):
        reason = _client_abort_reason(recv_req)
        queued = list(sched.disagg_prefill_bootstrap_queue.queue)
        inflight = list(sched.disagg_prefill_inflight_queue)
        hit = False
        for req in queued + inflight:
            if _matches(recv_req, req):
                hit = True
                if _decide(req, reason):
                    STATS.client_aborts += 1
        for req in inflight:  # its failure path then keeps the abort (and counts no
            if reason_of(req) is reason:  # transfer failure)
                req.finished_reason = reason
        others = list(sched.waiting_queue) + [
            r for r in sched.collect_inflight_reqs() if not r.finished()
        ]
        others += list(getattr(getattr(sched, "grammar_manager", None), "grammar_queue", ()))
        if sched.chunked_req is not None:
            others.append(sched.chunked_req)
        # abort_all names no request: nothing to be unknown (sglang's pause in "abort"
        # mode sends one every second while requests run)
        if not (hit or recv_req.abort_all or any(_matches(recv_req, r) for r in others)):
            STATS.unknown_aborts += 1
            logger.info(
                "kvmem-sglang: abort of rid %r (abort_all=%s): no such request on "
                "this prefill server (unknown, or already answered); nothing "
                "changed",
                recv_req.rid,
                recv_req.abort_all,
            )
    return original(sched, recv_req, *args, **kwargs)


def _client_abort_reason(recv_req):
    """The reason sglang gives a running request for the same AbortReq."""
    # sglang's statuses, not Ending.CLIENT_ABORT's 499: its router retries an error status
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    fr = recv_req.finished_reason
    if fr:
        return FINISH_ABORT(fr.get("message"), fr.get("status_code"), fr.get("err_type"))
    if recv_req.abort_message:
        return FINISH_ABORT(recv_req.abort_message, HTTPStatus.SERVICE_UNAVAILABLE)
    return FINISH_ABORT()


# -- every answer: the adapter's reason wins ----------------------------------------------


def stream_output(streamer, reqs, *args, **kwargs):
    for req in reqs:
        reason = reason_of(req)
        if reason is not None and req.finished() and req.finished_reason is not reason:
            req.finished_reason = reason
    return None


# -- bootstrap failure: a timeout is 504 ---------------------------------------------------


def handle_bootstrap_failure(sched, req, *args, **kwargs):
    if reason_of(req) is None:
        why = _bootstrap_timeout(req)
        if why is not None:
            _decide(
                req,
                _abort_reason(
                    f"Prefill bootstrap timed out ({why}) for request {req.rid} "
                    f"bootstrap_room={req.bootstrap_room}",
                    Ending.TIMED_OUT,
                ),
            )
            STATS.bootstrap_timeouts += 1
    return None


def _bootstrap_timeout(req):
    """Why ``req``'s bootstrap failure is a timeout, or None: the sender recorded a
    time-out (``CommonKVSender``), or the request has been bootstrapping for longer than
    ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``, the deadline sglang's senders apply."""
    from sglang.srt.environ import envs

    sender = req.disagg_kv_sender
    records = getattr(getattr(sender, "kv_mgr", None), "failure_records", None)
    if isinstance(records, dict):
        note = records.get(getattr(sender, "bootstrap_room", None))
        if isinstance(note, str) and "timed out" in note:
            return note
    limit = envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()
    start = getattr(sender, "init_time", None)
    if isinstance(start, (int, float)) and time.time() - start >= limit:
        return f"> {limit:g}s"
    return None


# -- inflight queue: transfer timeout, then the idle audit ---------------------------------


def process_inflight_queue(original, sched, *args, **kwargs):
    queue = sched.disagg_prefill_inflight_queue
    if queue:
        _expire_transfers(sched, queue)
    done = original(sched, *args, **kwargs)
    if state.BUSY.get(sched, False) and sched.is_fully_idle():
        state.BUSY.set(sched, False)
        audit.audit(sched)
    return done


def _expire_transfers(sched, queue) -> None:
    from sglang.srt.disaggregation.base import KVPoll

    now = time.monotonic()
    timeout = options.active().transfer_timeout
    for req in queue:
        if req.pending_bootstrap or reason_of(req) is not None:
            continue
        since = state.INFLIGHT_SINCE.get(req)
        if since is None:  # first seen in flight: the clock starts
            state.INFLIGHT_SINCE.set(req, now)
            continue
        if now - since <= timeout:
            continue
        polled = req.disagg_kv_sender.poll()
        if polled not in (KVPoll.WaitingForInput, KVPoll.Transferring):
            continue
        name = "WaitingForInput" if polled == KVPoll.WaitingForInput else "Transferring"
        msg = (
            f"Prefill KV transfer timed out (> {timeout:g}s in {name}, "
            f"{TRANSFER_TIMEOUT_VAR}) for request {req.rid} "
            f"bootstrap_room={req.bootstrap_room}; sender aborted, KV freed"
        )
        logger.error("kvmem-sglang: %s", msg)
        if _decide(req, _abort_reason(msg, Ending.TIMED_OUT)):
            req.finished_reason = reason_of(req)  # as prepare_abort: no 500 later
        STATS.transfer_timeouts += 1
        req.disagg_kv_sender.abort()  # Failed: sglang's failure path frees it this step


# -- chunk sends: refuse one built before a release ------------------------------------------


def send_kv_chunk(original, sched, req, *args, **kwargs):
    # releases counted here, not kvmem.transfer's epoch guard: sglang's agents post, with no epoch
    epoch = state.EPOCH.get(sched, 0)
    made = state.REQ_EPOCH.get(req, epoch)
    if made != epoch:
        msg = (
            f"KV chunk of request {req.rid} refused before posting: its transfer was "
            f"set up before release_memory_occupation (registration epoch {made}, now "
            f"{epoch}); sender aborted"
        )
        logger.error("kvmem-sglang: %s", msg)
        STATS.refused_stale_sends += 1
        _decide(req, _abort_reason(msg, Ending.RELEASED))
        req.disagg_kv_sender.abort()
        return None
    return original(sched, req, *args, **kwargs)


# -- release / resume ---------------------------------------------------------------------------


def _tags(recv_req) -> list[str]:
    from sglang.srt.constants import GPU_MEMORY_ALL_TYPES

    return list(recv_req.tags) if recv_req.tags else list(GPU_MEMORY_ALL_TYPES)


def release_memory_occupation(original, manager, recv_req, *args, **kwargs):
    """Refuse what cannot be released (a pool that cannot give memory back, a tag
    already released); else answer and free what the scheduler holds (its role's drain)
    when the release takes the KV cache or the weights, wait for posted KV writes when it
    takes a prefill's KV cache, and run sglang's release with the queues its idle
    assertion counts but the drain keeps set aside (the grammar queue, the overlap loop's
    queued results)."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_WEIGHTS
    from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqOutput

    tags = _tags(recv_req)
    fixed = [p for p in kvpool.live_pools() if not p.can_release]
    if GPU_MEMORY_TYPE_KV_CACHE in tags and fixed:
        STATS.refused_releases += 1
        logger.warning(
            "kvmem-sglang: release_memory_occupation(%s) refused: the KV pool's "
            "memory backend %r cannot release its memory "
            "(SGLANG_KVMEM_BACKEND=plain); nothing changed; use "
            "SGLANG_KVMEM_BACKEND=auto to release the KV cache",
            ",".join(tags),
            fixed[0].backend,
        )
        return ReleaseMemoryOccupationReqOutput()
    again = [t for t in tags if t in manager.offload_tags]
    if again:
        STATS.refused_releases += 1
        logger.warning(
            "kvmem-sglang: release_memory_occupation(%s) refused: %s already "
            "released (call resume_memory_occupation first); nothing changed",
            ",".join(tags),
            ",".join(again),
        )
        return ReleaseMemoryOccupationReqOutput()
    sched = manager.scheduler
    if sched is None:
        return original(manager, recv_req, *args, **kwargs)
    stops_forwards = GPU_MEMORY_TYPE_KV_CACHE in tags or GPU_MEMORY_TYPE_WEIGHTS in tags
    if stops_forwards and not _drained(sched, roles.describe(tags)):
        STATS.refused_releases += 1
        logger.error(
            "kvmem-sglang: release_memory_occupation(%s) refused: answering the "
            "requests in flight failed (logged above); nothing released, the "
            "server keeps serving",
            ",".join(tags),
        )
        return ReleaseMemoryOccupationReqOutput()
    if GPU_MEMORY_TYPE_KV_CACHE in tags and _is_prefill(sched):
        _await_posted_writes(sched)
    try:
        with (
            _grammar_queue_set_aside(sched),
            _queued_results_set_aside(sched),
            decode.host_destinations_set_aside(sched),
        ):
            out = original(manager, recv_req, *args, **kwargs)
    except RegistrationError as e:
        # sglang's release stopped at the transfer engine's deregistration (it marks the
        # tags released first): nothing was given back, so nothing is marked released
        manager.offload_tags.difference_update(tags)
        STATS.refused_releases += 1
        logger.error(
            "%s; release_memory_occupation(%s) refused, nothing released", e, ",".join(tags)
        )
        return ReleaseMemoryOccupationReqOutput()
    if GPU_MEMORY_TYPE_KV_CACHE in tags:
        state.EPOCH.set(sched, state.EPOCH.get(sched, 0) + 1)
    return out


def _drained(sched, what: str) -> bool:
    """Answer and free what ``sched`` holds before a release of the KV cache or the
    weights (a forward needs both), through the drain of its role; False if the drain
    raised (logged), in which case the release must not go on: sglang asserts an idle
    scheduler (``SchedulerWeightUpdaterManager.release_memory_occupation``) and dispatches
    the release with no try/except (``Scheduler.process_input_requests``), so an exception
    or a busy scheduler there ends its loop."""
    try:
        if _is_prefill(sched):
            _drain_for_release(sched, what)
        else:
            decode.drain(sched, what)
    except Exception:  # noqa: BLE001 - the release is refused instead of killing the loop
        logger.exception(
            "kvmem-sglang: draining the scheduler for release_memory_occupation failed"
        )
        return False
    return True


def resume_memory_occupation(original, manager, recv_req, *args, **kwargs):
    """Resume what was released.  With no tags (sglang: every tag) only the tags released
    now are resumed: after a release of the KV cache alone, a resume without tags brings
    the KV cache back (stock raises ``KeyError`` for the tags it never released).  Named
    tags that are not released refuse the whole resume, with a log line."""
    from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqOutput

    if not recv_req.tags:
        from sglang.srt.constants import GPU_MEMORY_ALL_TYPES

        held = [t for t in GPU_MEMORY_ALL_TYPES if t in manager.offload_tags]
        if not held:
            STATS.refused_resumes += 1
            logger.warning(
                "kvmem-sglang: resume_memory_occupation() refused: nothing is "
                "released; nothing changed"
            )
            return ResumeMemoryOccupationReqOutput()
        recv_req.tags = held
    tags = _tags(recv_req)
    missing = [t for t in tags if t not in manager.offload_tags]
    if missing:
        STATS.refused_resumes += 1
        logger.warning(
            "kvmem-sglang: resume_memory_occupation(%s) refused: %s not released; nothing changed",
            ",".join(tags),
            ",".join(missing),
        )
        return ResumeMemoryOccupationReqOutput()
    try:
        return original(manager, recv_req, *args, **kwargs)
    except RegistrationError as e:
        # the transfer engine refused the KV cache's registration (sglang resumes it
        # last): the KV cache stays released, so that nothing is served over memory no
        # peer can reach; what resumed before it stays resumed
        from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

        kvpool.release_all()
        manager.offload_tags.add(GPU_MEMORY_TYPE_KV_CACHE)
        STATS.refused_resumes += 1
        logger.error(
            "%s; resume_memory_occupation(%s) refused: the KV cache stays "
            "released (call resume_memory_occupation again)",
            e,
            ",".join(tags),
        )
        return ResumeMemoryOccupationReqOutput()


def continue_generation(original, sched, *args, **kwargs):
    """``continue_generation`` while the KV cache or the weights are still released
    (resumed neither): the requests a paused release kept would be scheduled onto memory
    that is gone, so they are answered 503 first, as a release without a pause answers
    them."""
    out = original(sched, *args, **kwargs)
    if roles.released(sched) and not _drained(sched, roles.what_released(sched)):
        logger.error(
            "kvmem-sglang: continue_generation with memory released: requests "
            "kept by the release could not be answered"
        )
    return out


@contextlib.contextmanager
def _grammar_queue_set_aside(sched):
    """Requests waiting for their grammar (``grammar_manager.grammar_queue``) out of
    sight of sglang's release and back afterwards.  sglang's idle assertion counts that
    queue (``Scheduler.is_fully_idle``, also under ``ignore_waiting``), and a paused loop
    never empties it, so a structured-output request whose grammar was still compiling
    when the engine paused killed the scheduler at the release (stock and the flag
    alike).  Such a request holds no KV and no request slot (it has not reached a queue
    that allocates): it is kept, and when its grammar is ready it enters the queues
    through ``_add_request_to_queue``, which answers it 503 while the memory is still
    released and serves it after the resume."""
    manager = getattr(sched, "grammar_manager", None)
    queue = getattr(manager, "grammar_queue", None)
    if not queue:
        yield
        return
    kept = list(queue)
    manager.grammar_queue = []
    logger.info(
        "kvmem-sglang: release_memory_occupation keeps %d request(s) waiting for their grammar: %s",
        len(kept),
        ", ".join(r.rid for r in kept),
    )
    try:
        yield
    finally:
        manager.grammar_queue = kept + manager.grammar_queue


def _drain_for_release(sched, what: str = "KV cache") -> None:
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
      sglang's release, ``_queued_results_set_aside``) and the loop processes them as
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
        return _abort_reason(
            f"{server} released its {what} (release_memory_occupation) while "
            f"request {req.rid} was {where}; aborted, retry after the resume",
            Ending.RELEASED,
        )

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
def _queued_results_set_aside(sched):
    """The overlap loop's queued batch results and ``last_batch`` out of sight of
    sglang's release, which asserts an idle scheduler
    (``SchedulerWeightUpdaterManager.release_memory_occupation``;
    ``Scheduler.is_fully_idle`` counts both), and back afterwards.  ``_drain_for_release``
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


def _await_posted_writes(sched) -> None:
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
    deadline, next_log = start + options.active().drain_timeout, start + DRAIN_LOG_S
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
    logger.info(
        "kvmem-sglang: posted writes settled after %.3f s; releasing", time.monotonic() - start
    )


def _await_settle_window(mgr, deadline: float) -> None:
    """Wait (until ``deadline`` at most) for the settle window a transfer backend opened
    after a write that failed while parts of it may still be moving
    (``state.SETTLE_UNTIL``, monotonic seconds; set by ``kvmem_sglang.mooncake``):
    sglang's worker uncounts such a room at once, so the counts above cannot show it."""
    until = min(state.SETTLE_UNTIL.get(mgr) or 0.0, deadline)
    wait = until - time.monotonic()
    if wait > 0:
        logger.warning(
            "kvmem-sglang: release_memory_occupation(kv_cache) waits %.2f s for "
            "the slices of a failed transfer that may still move",
            wait,
        )
        time.sleep(wait)


# -- transfer-engine registrations: every backend deregisters at release ---------------------


def queue_release(result, queue, *args, **kwargs):
    """After sglang's queue release, which calls ``deregister_buffer_to_engine`` where the
    backend has one (NIXL's is the adapter's, :mod:`kvmem_sglang.nixl`; mooncake has its
    own): a backend without one keeps its registrations across the release, which is
    logged once per backend (the fake backend registers nothing)."""
    mgr = queue.kv_manager
    name = type(mgr).__name__
    if (
        not hasattr(mgr, "deregister_buffer_to_engine")
        and name != "FakeKVManager"
        and name not in _WARNED
    ):
        _WARNED.add(name)
        logger.warning(
            "kvmem-sglang: the transfer backend's %s has no deregistration; "
            "what it registered stays registered across "
            "release_memory_occupation",
            name,
        )
    return None


def queue_resume(original, queue, *args, **kwargs):
    """Register once: only what the release deregistered (a NIXL manager still
    registered would otherwise hold two registrations of the same buffers)."""
    mgr = queue.kv_manager
    if (
        getattr(mgr, "agent", None) is not None
        and hasattr(mgr, "deregister_buffer_to_engine")
        and not state.DEREGISTERED.get(mgr, False)
    ):
        STATS.registrations_skipped += 1
        logger.warning(
            "kvmem-sglang: resume: the transfer engine still holds its "
            "registrations; not registering them twice"
        )
        return None
    return original(queue, *args, **kwargs)
