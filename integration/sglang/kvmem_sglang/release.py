"""``release_memory_occupation`` and ``resume_memory_occupation`` under sglang 0.5.23,
on every server role: what cannot be released or resumed is refused with a log line
(nothing changed); before a release of the KV cache or the weights the scheduler's
requests are answered and freed by its role's drain (:mod:`kvmem_sglang.prefill_drain`,
:func:`kvmem_sglang.decode_drain.drain`), and a prefill's release waits for the KV writes
already posted; the transfer engine's registrations are taken back at the release and
made once at the resume.  Counts in :data:`kvmem_sglang.prefill.STATS`.

What stock 0.5.23 does and what these hooks change (each hook's docstring names sglang's code):

==========================================  ==================================  ===========================
event                                       stock 0.5.23                        with SGLANG_KVMEM=1
==========================================  ==================================  ===========================
release / resume on NIXL                    never deregisters; every resume     deregistered at release,
                                            registers the buffers again         registered once at resume
release twice / resume without release      flush again / KeyError in the       refused with a log line,
                                            scheduler loop                      nothing changed
==========================================  ==================================  ===========================
"""

from __future__ import annotations

import contextlib
import logging

from kvmem_sglang import decode_drain, kvpool, roles, state
from kvmem_sglang.mooncake import RegistrationError
from kvmem_sglang.prefill import STATS, is_prefill
from kvmem_sglang.prefill_drain import (
    await_posted_writes,
    drain_for_release,
    queued_results_set_aside,
)

logger = logging.getLogger("kvmem.sglang")


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
    if GPU_MEMORY_TYPE_KV_CACHE in tags and is_prefill(sched):
        await_posted_writes(sched)
    try:
        with (
            _grammar_queue_set_aside(sched),
            queued_results_set_aside(sched),
            decode_drain.host_destinations_set_aside(sched),
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
        if is_prefill(sched):
            drain_for_release(sched, what)
        else:
            decode_drain.drain(sched, what)
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
        and name not in state.PROCESS.warned
    ):
        state.PROCESS.warned.add(name)
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
