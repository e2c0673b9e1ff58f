"""The wait on the writes of kvmem's NIXL send path (:mod:`kvmem_sglang.transfer`),
AROUND ``NixlKVManager._await_handles``: sglang's contract (wait while every handle is
healthy; once one failed, at most ``NIXL_ERR_SETTLE_TIMEOUT_S`` more; an unreadable state
fails), with growing sleeps between polls instead of ``sleep(0)``, over sglang's own NIXL
handles and the path's merged writes (:class:`~kvmem_sglang.transfer_records.Batch`, its
handles expanded) alike.  A wait that sees a merged write settle concludes it (DONE or
ERR) and uncounts its chunks sent ahead; one that gives up on it poisons their rooms
(:mod:`kvmem_sglang.transfer_ahead`).  A write cut short by a post NIXL refused raises
sglang's ``_NixlPostError`` at the worker's wait once the pieces posted settled, so that
sglang's worker treats its room as it treats the owner of a refused post.
"""

from __future__ import annotations

import logging
import time

from kvmem_sglang.transfer_ahead import uncount
from kvmem_sglang.transfer_records import STATS, Batch, Settled

logger = logging.getLogger("kvmem.sglang")

# Sleeps between polls of a healthy write: from NAP_MIN_S doubling to NAP_MAX_S.  A
# write of 128 MiB takes 15-50 ms on the CPU here, 1 MiB under 1 ms: the first polls come
# fast, and a long write costs at most NAP_MAX_S of extra latency.  Guesses.
NAP_MIN_S = 20e-6
NAP_MAX_S = 1e-3


def await_handles(original, mgr, handles, *, failure_seen):
    """AROUND ``NixlKVManager._await_handles``: ``(settled, any_failed)`` as sglang's,
    over NIXL handles, :class:`Batch` and :class:`Settled` handles alike (a Batch an
    earlier wait concluded is not read again).  A write in ``handles`` that a refused post
    cut short, once its pieces posted settled: at the worker's barrier (``failure_seen``
    False) this raises sglang's ``_NixlPostError``, and the worker poisons the room and
    uncounts it, as for its own refused post; in the wait of the worker's failure path
    (which must not raise) after some other error, the write reads as unsettled, and the
    worker poisons the room and keeps it counted."""
    from sglang.srt.disaggregation.nixl import conn

    STATS.add(waits=1)
    natives, batches, bounded, failed, until = [], [], False, False, None
    for h in handles:
        if isinstance(h, Settled):
            continue
        if isinstance(h, Batch):
            if h in batches:
                continue
            batches.append(h)
            if h.state != "PROC":
                failed = failed or h.state == "ERR"
                continue
            natives += h.natives
            bounded = bounded or h.failed
            if h.until is not None:
                until = h.until if until is None else min(until, h.until)
                h.until = None
            continue
        natives.append(h)
    settled, any_failed, states = _settle(mgr, natives, failure_seen, bounded, until)
    for b in batches:
        _conclude(mgr, b, states)
        failed = failed or b.state == "ERR"
    refused = [b for b in batches if b.refused is not None and not b.raised]
    if settled and refused:
        if failure_seen:
            return False, True
        for b in refused:
            b.raised = True
        raise conn._NixlPostError(f"KVSender failed to post transfer: {refused[0]!r}") from refused[
            0
        ].refused
    return settled, failed or any_failed


# -- the wait ---------------------------------------------------------------------------------


def _settle(
    mgr, handles: list, failure_seen: bool, bounded: bool = False, until: float | None = None
) -> tuple[bool, bool, dict]:
    """Poll NIXL ``handles`` until each is DONE or ERR: ``(settled, any_failed, states by
    id)``.  sglang's rules (``NixlKVManager._await_handles``): unbounded while none failed;
    from the first ERR (or ``failure_seen``) at most ``NIXL_ERR_SETTLE_TIMEOUT_S``, polled
    every ``NIXL_ERR_SETTLE_POLL_S``; a state that cannot be read ends the wait as failed
    and unsettled (it does not prove the write is over).  ``bounded``: the same bound from
    the start, without counting as a failure (a write an earlier wait gave up on: failed
    only if a handle now reads ERR or still does not settle).  ``until`` (``time.time()``):
    the bound ends then instead (once read, however early)."""
    from sglang.srt.disaggregation.nixl import conn

    states: dict[int, str] = {}
    pending = list(handles)
    failed = failure_seen
    deadline: float | None
    if until is not None:
        deadline = until
    else:
        deadline = time.time() + conn.NIXL_ERR_SETTLE_TIMEOUT_S if failure_seen or bounded else None
    nap = NAP_MIN_S
    naps = 0  # counted once the wait ends: nothing but the sleep between polls
    try:
        while True:
            try:
                still = []
                for h in pending:
                    s = mgr.agent.check_xfer_state(h)
                    if s in ("DONE", "ERR"):
                        states[id(h)] = s
                        failed = failed or s == "ERR"
                    else:
                        still.append(h)
                pending = still
            except Exception as e:  # noqa: BLE001 - sglang's rule: unreadable counts as running
                logger.warning("Failed to read NIXL transfer state: %s", e)
                return False, True, states
            if not pending:
                return True, failed, states
            if not failed and deadline is None:
                naps += 1
                time.sleep(nap)
                nap = min(2 * nap, NAP_MAX_S)
                continue
            if deadline is None:
                deadline = time.time() + conn.NIXL_ERR_SETTLE_TIMEOUT_S
            elif time.time() >= deadline:
                return False, True, states
            time.sleep(conn.NIXL_ERR_SETTLE_POLL_S)
    finally:
        STATS.add(naps=naps)


def _conclude(mgr, batch: Batch, states: dict) -> None:
    """After a wait on ``batch``: DONE or ERR once every handle settled (ERR if it was
    cut short), and its chunks sent ahead uncounted; else it stays PROC, marked failed (a
    later wait on it is bounded), and their rooms poisoned (no ABORT_ACK: nothing proves
    the write over) but still counted, as sglang keeps a room whose write it gave up on.
    Unlike sglang's own handles, the batch is waited for again when the worker reaches
    each of those rooms (:func:`wait_again`): the wait that sees it settle uncounts them,
    so a room sent ahead in it ends Success (DONE) or is sent again (ERR) instead of
    staying Transferring until its transfer timeout."""
    if batch.state != "PROC":
        return
    got = [states.get(id(h)) for h in batch.natives]
    if any(s is None for s in got):
        batch.failed = True
        STATS.add(unsettled=1)
        for a in batch.ahead:
            if a.counted:
                mgr.poison_deferred_ack_room(a.room)
        return
    batch.state = "ERR" if batch.cut_short is not None or "ERR" in got else "DONE"
    batch.failed = batch.state == "ERR"
    for a in batch.ahead:
        uncount(mgr, a)


def wait_again(mgr, batch: Batch) -> None:
    """The worker reached a room sent ahead in ``batch``, a write its owner's wait gave
    up on: wait for it (at most ``NIXL_ERR_SETTLE_TIMEOUT_S``) and conclude it.  Still
    unsettled: ``batch.until`` is now, so the worker's own wait on it reads it once and
    gives up (the room waits one bound in all, as sglang's does)."""
    _, _, states = _settle(mgr, batch.natives, False, bounded=True)
    _conclude(mgr, batch, states)
    if batch.state == "PROC":
        batch.until = time.time()
