"""The PD prefill lifecycle under sglang 0.5.23's scheduler: every request's KV freed
once, every request answered once, with the status of kvmem's lifecycle table (docs/disagg.md).

Split by job.  The hooks here take a request from its arrival to its answer: the
arrival while released, a client's abort, the answer's status, the bootstrap and
transfer timeouts, a stale chunk send, the idle audit.  :mod:`kvmem_sglang.release`
runs ``release_memory_occupation`` and ``resume_memory_occupation`` (every server
role), and :mod:`kvmem_sglang.prefill_drain` answers and frees what a prefill holds
before its release; all three count in :data:`STATS`.

What stock 0.5.23 does and what these hooks change (each hook's docstring names sglang's code):

==========================================  ==================================  ===========================
event                                       stock 0.5.23                        with SGLANG_KVMEM=1
==========================================  ==================================  ===========================
WaitingForInput/Transferring longer than    stays in the inflight queue for     sender aborted (decode told),
SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT      ever, KV and metadata slot held     KV + metadata slot freed, 504
a request arriving while released           queued; its bootstrap may run on    503 at once, until the resume
                                            deregistered buffers
a chunk send built before release/resume    posted                              refused before posting (sender
                                                                                aborted, 503)
bootstrap timeout                           500 "Prefill bootstrap failed"      504
other bootstrap failure                     500                                 500 (unchanged)
client abort while bootstrapping or         500 "Prefill bootstrap/transfer     the abort's finish reason and
in flight                                   failed"                             status
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

import logging
import time
from dataclasses import dataclass
from http import HTTPStatus

from kvmem.disagg.outcome import Ending
from kvmem_sglang import audit, decode, notify, roles, state
from kvmem_sglang.reasons import Told, answer_of, failure_answer, hand_over, http_status, reason_of
from kvmem_sglang.reasons import abort_reason as _abort_reason
from kvmem_sglang.reasons import decide as _decide
from kvmem_sglang.options import TRANSFER_TIMEOUT_VAR

logger = logging.getLogger("kvmem.sglang")


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


# -- helpers -----------------------------------------------------------------------------


def is_prefill(sched) -> bool:
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
        if is_prefill(sched):
            queue = getattr(sched, "disagg_prefill_bootstrap_queue", None)
            notify.refuse_room(
                getattr(queue, "kv_manager", None),
                getattr(req, "bootstrap_room", None),
                Told(msg, answer_of(FINISH_ABORT(msg, status))),
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
    if is_prefill(sched):
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


# -- a sender's failure: its answer, for the prepare_abort that follows ---------------------


def sender_failure_exception(original, sender, *args, **kwargs):
    """AROUND ``CommonKVSender.failure_exception`` on a prefill: the room's answer
    (:func:`kvmem_sglang.reasons.failure_answer`: an abort when the room's decode aborted
    it, or sglang recorded an abort) handed to the ``prepare_abort`` sglang calls right
    after (``handle_bootstrap_failure``, ``handle_inflight_transfer_failure``)."""
    try:
        return original(sender, *args, **kwargs)
    except Exception as e:
        room = getattr(sender, "bootstrap_room", None)
        hand_over(room, failure_answer(getattr(sender, "kv_mgr", None), room, e))
        raise


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
    """Why ``req``'s bootstrap failure is a timeout, or None: the request has been
    bootstrapping for at least the deadline sglang's senders apply (the manager's
    ``bootstrap_timeout``, ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``), counted from the
    sender's ``init_time``.  sglang's sender counts from the same moment or later
    (``CommonKVSender._check_bootstrap_timeout``), so every timeout it records is one here;
    its record's text, which may hold what a client chose, is not read."""
    from sglang.srt.environ import envs

    sender = req.disagg_kv_sender
    limit = getattr(getattr(sender, "kv_mgr", None), "bootstrap_timeout", None)
    if not isinstance(limit, (int, float)):
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
    timeout = state.PROCESS.options.active().transfer_timeout
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
