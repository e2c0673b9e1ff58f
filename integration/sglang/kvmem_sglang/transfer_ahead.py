"""The chunks a merged write of kvmem's send path carries ahead of their turn: the
worker thread's queue (AROUND ``NixlKVManager.transfer_worker`` and
``MooncakeKVManager.transfer_worker``), the chunks queued behind the owner that may go in
its write now, and their counts in sglang's ``_staging_outstanding``.  Both backends'
paths use them (:mod:`kvmem_sglang.transfer`, :mod:`kvmem_sglang.mooncake_send`).

Chunks sent ahead of their turn.  Such a chunk is counted in the manager's
``_staging_outstanding`` before it is checked (as ``transfer_worker`` counts a chunk at
dequeue) and uncounted when its write settles, so sglang's abort ACK to the decode
(``_maybe_ack_drained_abort``) and the adapter's release drain wait for that write.  The
owner's wait covers it (same write), and the queue is FIFO: when the worker reaches it,
its write has settled, and ``send_kvcache`` returns a settled handle without moving
anything (DONE), or sends it again on its own (the write failed).  If the owner's wait
gives up on the write (a state that cannot be read, or a sibling ERR and the rest still
in flight after ``NIXL_ERR_SETTLE_TIMEOUT_S``), the rooms sent ahead in it are poisoned as
sglang poisons such a room (no ABORT_ACK; the decode falls back to its release timeout)
and stay counted.  When the worker reaches each, ``send_kvcache`` waits for that write
again (at most ``NIXL_ERR_SETTLE_TIMEOUT_S``), and the wait that sees it settle uncounts
them: the room ends Success if it is DONE and is sent again if it is ERR.  Still
unsettled, it goes to the worker, whose wait reads it once more: the room then fails as
sglang fails a room whose write it gave up on (poisoned, counted).  Only a write that
never settles keeps them counted.  Statuses are not touched: a room sent ahead stays
WaitingForInput until the worker reaches it and runs sglang's own code for it
(Transferring, aux, Success or Failed, notifications).
"""

from __future__ import annotations

import numpy as np

from kvmem_sglang import state
from kvmem_sglang.transfer_records import Ahead, TransferState


def transfer_worker(original, mgr, queue, *args, **kwargs):
    """AROUND ``NixlKVManager.transfer_worker``: note the thread's queue, then run it."""
    state.PROCESS.worker.queue = queue  # the FastQueue this worker thread serves
    return original(mgr, queue, *args, **kwargs)


def take_ahead(
    mgr, st: TransferState, peer: str, budget: int, per_page: int, peer_of
) -> list[Ahead]:
    """The chunks queued behind the owner on this worker's queue that may go in its write
    now, each counted in ``_staging_outstanding``; at most ``budget`` bytes of KV,
    ``per_page`` bytes a page.  ``peer_of(req)``: the peer of one of a room's transfer
    infos, compared with ``peer`` (NIXL's agent name, Mooncake's session id).  Used by
    both backends' paths: their managers share these fields and this queue."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    queue = getattr(state.PROCESS.worker, "queue", None)
    if queue is None or not hasattr(queue, "_buf"):
        return []
    st.sweep(mgr)
    with queue._cond:  # FastQueue (disaggregation/common/utils.py): a deque and a condition
        queued = list(queue._buf)
    out = []
    for chunk in queued:
        if not _readable(chunk):
            continue
        src = chunk.prefill_kv_indices
        n = len(src)
        if n == 0 or n * per_page > budget or st.sent_ahead(src):
            continue
        room = chunk.room
        counts = mgr._staging_outstanding
        fresh = room not in counts
        counts[room] += 1  # before the checks, as transfer_worker counts at dequeue
        rec = Ahead(room, peer, src, np.empty(0, dtype=np.int64))
        try:
            ok = (
                room in mgr.request_status
                and mgr.check_status(room) != KVPoll.Failed
                and _dst_of(mgr, chunk, peer, rec, peer_of)
            )
        except Exception:  # noqa: BLE001 - a room being cleared meanwhile: not sent ahead
            ok = False
        if not ok:
            uncount(mgr, rec, drop=fresh)
            continue
        budget -= n * per_page
        out.append(rec)
    return out


def _readable(chunk) -> bool:
    """Whether a queued chunk may be read now, as its worker reads it at dequeue
    (``MooncakeKVManager.transfer_worker``, mooncake/conn.py): no CUDA event of its own
    pending (``wait_event``: the forward still writing its pages under the overlap
    schedule, recorded by
    ``SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk`` in
    disaggregation/prefill.py; ``indices_event``: the copy of its page ids to the host,
    recorded by the mixin's ``_send_kv_chunk``), read with ``query()``, which never blocks.
    A chunk whose events completed is given what the worker would give it: the events
    dropped, a host tensor of page ids made a numpy array (the object by which the chunk is
    found again when the worker reaches it).  NIXL's chunks carry neither
    (``NixlKVManager.add_transfer_request`` queues them without)."""
    for name in ("wait_event", "indices_event"):
        ev = getattr(chunk, name, None)
        try:
            if ev is not None and not ev.query():
                return False
        except Exception:  # noqa: BLE001 - an event that cannot be read: its own turn
            return False
    for name in ("wait_event", "indices_event"):
        if getattr(chunk, name, None) is not None:
            setattr(chunk, name, None)
    src = chunk.prefill_kv_indices
    if not isinstance(src, np.ndarray):
        if not hasattr(src, "numpy"):
            return False
        chunk.prefill_kv_indices = src.numpy()
    return True


def _dst_of(mgr, chunk, peer: str, rec: Ahead, peer_of) -> bool:
    """Set ``rec.dst`` to the chunk's destination pages as the worker would take them
    (``NixlKVManager.transfer_worker``: ``req.dst_kv_indices[kv_chunk.index_slice]``);
    False when the room is not a one-peer room of ``peer`` or its page counts differ (the
    worker then handles it itself)."""
    infos = mgr.transfer_infos.get(chunk.room)
    if not infos:
        return False
    reqs = [r for r in infos.values() if not r.is_dummy]
    if len(reqs) != 1 or peer_of(reqs[0]) != peer:
        return False
    dst = np.asarray(reqs[0].dst_kv_indices[chunk.index_slice], dtype=np.int64)
    if dst.size != len(chunk.prefill_kv_indices):
        return False
    rec.src = chunk.prefill_kv_indices
    rec.dst = dst
    return True


def uncount(mgr, rec: Ahead, drop: bool = False) -> None:
    """Undo a chunk's count (its write settled or never went); send a pending ABORT_ACK
    that waited for it.  No entry is made or left below zero: the worker drops a room's
    whole count when it skips the room (cleared, or Failed: the checks at the top of
    ``NixlKVManager.transfer_worker``'s loop), and then there is nothing of this chunk's
    left to undo; an entry that reaches zero is dropped where the room is gone (nothing
    would drop it) or ``drop`` (made for this count).  Runs on the worker thread that
    counts the room's chunks."""
    if not rec.counted:
        return
    rec.counted = False
    counts = mgr._staging_outstanding
    n = counts.get(rec.room)
    if n is not None:
        if n > 1:
            counts[rec.room] = n - 1
        elif drop or rec.room not in mgr.request_status:
            counts.pop(rec.room, None)
        else:
            counts[rec.room] = 0
    if mgr.enable_deferred_decode_kv_release:
        mgr._maybe_ack_drained_abort(rec.room)
