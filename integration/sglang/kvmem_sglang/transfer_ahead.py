"""The chunks a merged write of kvmem's send path carries ahead of their turn: the
worker thread's queue (AROUND ``NixlKVManager.transfer_worker`` and
``MooncakeKVManager.transfer_worker``), the chunks queued behind the owner that may go in
its write now, and their counts in sglang's ``_staging_outstanding``.  Both backends'
paths use them (:mod:`kvmem_sglang.transfer`, :mod:`kvmem_sglang.mooncake_send`).  The
chunks are found through the queue's index (:mod:`kvmem_sglang.transfer_queue`): a send
looks at the owner's peer's chunks only, and only at those that fit what is left of its
budget, so its cost does not grow with the depth of the queue.

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
from kvmem_sglang.transfer_queue import NEVER, CountedQueue, QueueIndex
from kvmem_sglang.transfer_records import STATS, Ahead, TransferState


def transfer_worker(original, mgr, queue, *args, **kwargs):
    """AROUND ``NixlKVManager.transfer_worker`` (and Mooncake's): note the thread's queue
    and its index, then run the worker on the queue with its gets counted
    (:class:`~kvmem_sglang.transfer_queue.CountedQueue`)."""
    index = state.QUEUES.setdefault(queue, QueueIndex)
    state.PROCESS.worker.queue = queue  # the FastQueue this worker thread serves
    return original(mgr, CountedQueue(queue, index), *args, **kwargs)


def take_ahead(
    mgr, st: TransferState, peer: str, budget: int, per_page: int, peer_of
) -> list[Ahead]:
    """The chunks queued behind the owner on this worker's queue that may go in its write
    now, in queue order, each counted in ``_staging_outstanding``; at most ``budget`` bytes
    of KV, ``per_page`` bytes a page.  ``peer_of(req)``: the peer of one of a room's
    transfer infos, compared with ``peer`` (NIXL's agent name, Mooncake's session id).
    Used by both backends' paths: their managers share these fields and this queue.

    Which chunks: in queue order, each chunk of ``peer`` that fits what is left of the
    budget, can be read now (:func:`_readable`), is in no write that has not failed, and
    whose room is live, not Failed, a one-peer room of ``peer`` with as many destination
    pages as the chunk has pages.  Found through the queue's index
    (:class:`~kvmem_sglang.transfer_queue.QueueIndex`): only ``peer``'s chunks that fit are
    looked at, and a chunk found never to go ahead again (its room gone or Failed, its
    write DONE, the checks above failed for good) is forgotten by the index.  Cost: the
    chunks put and got since the last call, plus, per chunk looked at, O(log n) for
    ``peer``'s n chunks queued; the chunks looked at are those taken, those whose write
    is still in flight or whose events are pending, and each other chunk once."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    queue = getattr(state.PROCESS.worker, "queue", None)
    index = state.QUEUES.get(queue) if queue is not None else None
    if index is None:
        return []
    st.sweep(mgr)
    STATS.add(indexed=index.read(queue, lambda chunk: _classify(mgr, chunk, peer_of)))
    chunks = index.peers.get(peer)
    out: list[Ahead] = []
    looked = 0
    pos = -1
    while chunks is not None:
        pos = chunks.first(pos + 1, budget // per_page if per_page > 0 else NEVER - 1)
        if pos < 0:
            break
        chunk = chunks.chunk(pos)
        looked += 1
        if not _readable(chunk):
            continue  # its events are pending: its own turn, or a later write
        src = chunk.prefill_kv_indices
        done = st.sent_ahead(src)
        if done is not None:  # in a write that has not failed
            if done:
                chunks.forget(pos)  # that write is DONE: the worker reaches it settled
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
            chunks.forget(pos)  # gone, Failed (for good) or not a chunk of this path
            continue
        budget -= len(src) * per_page
        out.append(rec)
    STATS.add(inspected=looked)
    return out


def _classify(mgr, chunk, peer_of) -> tuple[str | None, int]:
    """A queued item's ``(peer, pages)`` for the index: the peer of its room's one
    transfer info that is not a dummy (None if its room has none or several, or the item
    is no chunk: it can never go ahead of its turn)."""
    if chunk is None:  # the stop teardown queues (MooncakeKVManager.teardown)
        return None, 0
    infos = mgr.transfer_infos.get(chunk.room)
    reqs = [r for r in infos.values() if not r.is_dummy] if infos else []
    return (peer_of(reqs[0]) if len(reqs) == 1 else None), len(chunk.prefill_kv_indices)


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
