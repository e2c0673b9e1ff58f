"""``release_memory_occupation`` and ``resume_memory_occupation`` under sglang 0.5.23,
on every server role: what cannot be released or resumed is refused with a log line
(nothing changed); before a release of the KV cache or the weights the scheduler's
requests are answered and freed by its role's drain (:mod:`kvmem_sglang.prefill_drain`,
:func:`kvmem_sglang.decode_drain.drain`), and a prefill's release waits for the KV writes
already posted; the transfer engine's registrations are taken back at the release and
made once at the resume.  At TP 2 and more each refusal is one decision of every rank
(:mod:`kvmem_sglang.agree`): if one rank refuses, every rank refuses and leaves (or puts
back) its state as before.  Counts in :data:`kvmem_sglang.prefill.STATS`.

What stock 0.5.23 does and what these hooks change (each hook's docstring names sglang's code):

==========================================  ==================================  ===========================
event                                       stock 0.5.23                        with SGLANG_KVMEM=1
==========================================  ==================================  ===========================
release / resume on NIXL                    never deregisters; every resume     deregistered at release,
                                            registers the buffers again         registered once at resume
release twice / resume without release      flush again / KeyError in the       refused with a log line,
                                            scheduler loop                      nothing changed
a refusal on one TP rank (its transfer      refuses neither (the engine's code  every rank refuses; the
engine refused, its drain raised)           is ignored; no drain)               log line names the rank
==========================================  ==================================  ===========================
"""

from __future__ import annotations

import contextlib
import logging

from kvmem_sglang import agree, decode_drain, kvpool, roles, state
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


def _refused(call: str, tags, refused: agree.Refusal, outcome: str, level=logging.WARNING) -> None:
    """The one log line of a refusal, on every rank: which rank refused and why."""
    logger.log(
        level,
        "kvmem-sglang: %s(%s) refused%s: %s; %s",
        call,
        ",".join(tags),
        refused.by(),
        refused.reason,
        outcome,
    )


def _why(e: RegistrationError) -> str:
    return f"{e.reason}; {e.change}"


def release_memory_occupation(original, manager, recv_req, *args, **kwargs):
    """Refuse what cannot be released (a pool that cannot give memory back, a tag
    already released); else answer and free what the scheduler holds (its role's drain)
    when the release takes the KV cache or the weights, wait for posted KV writes and
    deregister the KV cache from the transfer engine when it takes the KV cache, then run
    sglang's release (its own deregistration then finds nothing left to do) with the
    queues its idle assertion counts but the drain keeps set aside (the grammar queue, the
    overlap loop's queued results).

    Each refusal is the decision of every TP rank (:mod:`kvmem_sglang.agree`), taken at
    three points, each before anything the next step changes: (1) what cannot be
    released, before anything; (2) a drain that raised, before anything is released; (3)
    a deregistration the transfer engine refused, before sglang's release runs: the ranks
    whose deregistration went through register again, so that no rank has released
    anything.  sglang's release then runs on every rank or on none (it barriers on the
    same group when it releases the weights).  After sglang's release of the KV cache,
    kvmem gives the pools' physical memory back (:func:`_release_then_give_back`)."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_WEIGHTS
    from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqOutput

    call = "release_memory_occupation"
    tags = _tags(recv_req)
    refused = agree.refusal(manager, _cannot_release(manager, tags))
    if refused is not None:
        STATS.refused_releases += 1
        _refused(call, tags, refused, "nothing changed")
        return ReleaseMemoryOccupationReqOutput()
    sched = manager.scheduler
    kv = GPU_MEMORY_TYPE_KV_CACHE in tags
    if sched is None:
        return _release_then_give_back(original, kv, manager, recv_req, *args, **kwargs)
    if kv or GPU_MEMORY_TYPE_WEIGHTS in tags:
        refused = agree.refusal(manager, _drained(sched, roles.describe(tags)))
        if refused is not None:
            STATS.refused_releases += 1
            _refused(
                call, tags, refused, "nothing released, the server keeps serving", logging.ERROR
            )
            return ReleaseMemoryOccupationReqOutput()
    if kv:
        if is_prefill(sched):
            await_posted_writes(sched)
        done, why = _deregister(sched)
        refused = agree.refusal(manager, why)
        if refused is not None:
            _register_again(done)
            STATS.refused_releases += 1
            _refused(call, tags, refused, "nothing released", logging.ERROR)
            return ReleaseMemoryOccupationReqOutput()
    with (
        _grammar_queue_set_aside(sched),
        queued_results_set_aside(sched),
        decode_drain.host_destinations_set_aside(sched),
    ):
        out = _release_then_give_back(original, kv, manager, recv_req, *args, **kwargs)
    if kv:
        state.EPOCH.set(sched, state.EPOCH.get(sched, 0) + 1)
    return out


def _release_then_give_back(original, kv: bool, *args, **kwargs):
    """sglang's release (it clears the bootstrap queue, flushes the cache, resets the
    allocator), then, when it took the KV cache, kvmem gives every KV pool's physical
    memory back (addresses kept)."""
    out = original(*args, **kwargs)
    if kv:
        kvpool.release_all()
    return out


def _cannot_release(manager, tags) -> str | None:
    """Why this rank cannot release ``tags`` (None: it can)."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

    fixed = [p for p in kvpool.live_pools() if not p.can_release]
    if GPU_MEMORY_TYPE_KV_CACHE in tags and fixed:
        return (
            f"the KV pool's memory backend {fixed[0].backend!r} cannot release its memory "
            "(SGLANG_KVMEM_BACKEND=plain; use SGLANG_KVMEM_BACKEND=auto to release the KV "
            "cache)"
        )
    again = [t for t in tags if t in manager.offload_tags]
    if again:
        return f"{','.join(again)} already released (call resume_memory_occupation first)"
    return None


def _kv_managers(sched) -> list:
    """The transfer managers whose registrations sglang's release of the KV cache takes
    back and its resume makes again (``SchedulerWeightUpdaterManager`` calls the queues'
    ``release_memory_occupation`` / ``resume_memory_occupation``, which deregister or
    register their ``kv_manager`` where it has the method): a prefill's bootstrap queue's,
    a decode's prealloc queue's; none on a plain server."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    mode = getattr(sched, "disaggregation_mode", None)
    name = {
        DisaggregationMode.PREFILL: "disagg_prefill_bootstrap_queue",
        DisaggregationMode.DECODE: "disagg_decode_prealloc_queue",
    }.get(mode)
    queue = getattr(sched, name, None) if name else None
    mgr = getattr(queue, "kv_manager", None)
    return [mgr] if mgr is not None else []


def _deregister(sched) -> tuple[list, str | None]:
    """Deregister the KV cache from the transfer engine ahead of sglang's release (its
    own call then finds the manager deregistered, :func:`kvmem_sglang.mooncake.
    deregister_buffer_to_engine` and :func:`kvmem_sglang.nixl.deregister`): (the managers
    deregistered, why the engine refused, or None).  A refused Mooncake deregistration
    has registered its regions again already."""
    done: list = []
    for mgr in _kv_managers(sched):
        if not hasattr(mgr, "deregister_buffer_to_engine") or state.DEREGISTERED.get(mgr, False):
            continue
        try:
            mgr.deregister_buffer_to_engine()
        except RegistrationError as e:
            return done, _why(e)
        done.append(mgr)
    return done, None


def _register_again(managers) -> None:
    """After a release refused by another rank's transfer engine (or by this one's for a
    later manager): register again what this rank deregistered."""
    for mgr in managers:
        try:
            mgr.register_buffer_to_engine()
        except RegistrationError as e:
            logger.error(
                "kvmem-sglang: registering the KV cache again after a refused release "
                "failed: %s; this rank's transfers fail until a release and a resume "
                "register it",
                _why(e),
            )


def _drained(sched, what: str) -> str | None:
    """Answer and free what ``sched`` holds before a release of the KV cache or the
    weights (a forward needs both), through the drain of its role; None, or what the
    drain raised (its traceback logged), in which case the release must not go on: sglang
    asserts an idle scheduler (``SchedulerWeightUpdaterManager.release_memory_occupation``)
    and dispatches the release with no try/except (``Scheduler.process_input_requests``),
    so an exception or a busy scheduler there ends its loop."""
    try:
        if is_prefill(sched):
            drain_for_release(sched, what)
        else:
            decode_drain.drain(sched, what)
    except Exception as e:  # noqa: BLE001 - the release is refused instead of killing the loop
        logger.exception(
            "kvmem-sglang: draining the scheduler for release_memory_occupation failed"
        )
        return (
            f"answering the requests in flight raised {type(e).__name__}: {e} (its "
            f"traceback in the log of {roles.server(sched)})"
        )
    return None


def resume_memory_occupation(original, manager, recv_req, *args, **kwargs):
    """Resume what was released.  With no tags (sglang: every tag) only the tags released
    now are resumed: after a release of the KV cache alone, a resume without tags brings
    the KV cache back (stock raises ``KeyError`` for the tags it never released).  Named
    tags that are not released refuse the whole resume, with a log line.

    Each refusal is the decision of every TP rank (:mod:`kvmem_sglang.agree`), taken at
    two points: (1) what cannot be resumed, before anything; (2) after sglang's resume,
    whether the transfer engine refused the KV cache's registration (kvmem maps the KV
    pools' memory back first, at the same addresses; sglang registers the KV cache last,
    after its own barrier for the weights): if it did on any rank, every rank keeps
    the KV cache released (the ranks whose registration went through deregister it
    again), so that nothing is served over memory a peer cannot reach; what resumed
    before it (the weights) stays resumed, on every rank."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
    from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqOutput

    call = "resume_memory_occupation"
    refused = agree.refusal(manager, _cannot_resume(manager, recv_req))
    if refused is not None:
        STATS.refused_resumes += 1
        _refused(call, recv_req.tags or [], refused, "nothing changed")
        return ResumeMemoryOccupationReqOutput()
    tags = _tags(recv_req)
    if GPU_MEMORY_TYPE_KV_CACHE in tags:  # memory back (same addresses, epoch + 1) before
        kvpool.resume_all(state.PROCESS.options.active().prefault)  # sglang registers it
    failed = None
    try:
        out = original(manager, recv_req, *args, **kwargs)
    except RegistrationError as e:
        failed = e
    refused = agree.refusal(manager, None if failed is None else _why(failed))
    if refused is None:
        return out
    _keep_kv_released(manager, registered=failed is None)
    STATS.refused_resumes += 1
    _refused(
        call,
        tags,
        refused,
        "the KV cache stays released (call resume_memory_occupation again)",
        logging.ERROR,
    )
    return ResumeMemoryOccupationReqOutput()


def _cannot_resume(manager, recv_req) -> str | None:
    """Why this rank cannot resume (None: it can); with no tags, the tags released now
    become the request's."""
    if not recv_req.tags:
        from sglang.srt.constants import GPU_MEMORY_ALL_TYPES

        held = [t for t in GPU_MEMORY_ALL_TYPES if t in manager.offload_tags]
        if not held:
            return "nothing is released"
        recv_req.tags = held
    missing = [t for t in _tags(recv_req) if t not in manager.offload_tags]
    if missing:
        return f"{','.join(missing)} not released"
    return None


def _keep_kv_released(manager, *, registered: bool) -> None:
    """After sglang's resume of the KV cache, refused on some rank: the KV cache as
    before the resume on this one (deregistered if this rank registered it, memory given
    back, sglang's memory saver paused for it, its tag released).  If the engine refuses
    that deregistration (it has registered the regions again then), the pool keeps its
    memory and its registration, and only the tag is released: the rank refuses requests
    as the others do, and its next resume registers nothing twice."""
    from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE

    keep = False
    if registered:
        for mgr in _kv_managers(manager.scheduler):
            if not hasattr(mgr, "deregister_buffer_to_engine"):
                continue
            try:
                mgr.deregister_buffer_to_engine()
            except RegistrationError as e:
                keep = True
                logger.error(
                    "kvmem-sglang: deregistering the KV cache after a refused resume "
                    "failed: %s; this rank keeps its KV memory (released for requests "
                    "only) until the next resume",
                    _why(e),
                )
    if not keep:
        kvpool.release_all()
    manager.memory_saver_adapter.pause(GPU_MEMORY_TYPE_KV_CACHE)
    manager.offload_tags.add(GPU_MEMORY_TYPE_KV_CACHE)


def continue_generation(original, sched, *args, **kwargs):
    """``continue_generation`` while the KV cache or the weights are still released
    (resumed neither): the requests a paused release kept would be scheduled onto memory
    that is gone, so they are answered 503 first, as a release without a pause answers
    them."""
    out = original(sched, *args, **kwargs)
    if roles.released(sched) and _drained(sched, roles.what_released(sched)) is not None:
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
