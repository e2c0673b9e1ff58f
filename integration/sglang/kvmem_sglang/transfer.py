"""kvmem's send path under sglang 0.5.23's NIXL prefill (``SGLANG_KVMEM_TRANSFER=kvmem``,
the default; ``sglang`` leaves sglang's own path).

Names below are of the installed ``sglang/srt/disaggregation/nixl/conn.py``, methods of
its ``NixlKVManager`` unless said otherwise.

What sglang does.  A prefill's KV sends run on one transfer worker thread per queue, and
every room going to one decode lands in the same queue (``add_transfer_request`` shards by
the sum of the decode sessions' ports).  Per chunk the worker posts one NIXL write with one
descriptor per page and plane (``send_kvcache`` -> ``_send_kvcache_generic``'s prepared
path), spins on it (``_await_handles`` polls with ``time.sleep(0)``) and only then takes
the next chunk.  Pages of one request that are not adjacent cost one descriptor each,
whatever lies next to them.

What this module changes: how the bytes of those sends move, nothing else.  Three hooks
(AROUND) on ``NixlKVManager``:

* ``transfer_worker``: remembers which queue the calling thread serves; no change.
* ``send_kvcache``, the narrowest call that moves KV (``transfer_worker`` calls it for MHA
  and MLA at equal attention TP).  It takes the chunk handed to it (the *owner*) and the
  chunks queued behind it on the same worker for the same decode (the checks at the top of
  ``transfer_worker``'s loop hold for them now), up to :data:`BATCH_BYTES`, pairs every
  page ``(source, destination)`` of them all, sorts the pairs by source page and merges
  runs adjacent on both sides: one descriptor per run and plane.  Pages of different
  requests are often adjacent where the pages of one are not (an allocator serving a batch
  interleaves or abuts them).  The descriptors go out as up to :data:`SPLIT` NIXL writes
  (of at least :data:`SPLIT_MIN_BYTES` each) posted together (``initialize_xfer`` over the
  live registrations; no prepared list, so nothing here outlives a release), and one handle
  for them all is returned.  A run never leaves one plane (one of sglang's per-layer K or V
  buffers, page ids below its page count): on a kvmem side that buffer lies inside one pool
  region, i.e. one physical chunk (kvmem's chunk plan keeps a layer's K|V block in one
  chunk, and the registration is per region), on a stock side it is a registration of its
  own; so no descriptor spans two registrations, which NIXL refuses.
* ``_await_handles``: sglang's contract (wait while every handle is healthy; once one
  failed, at most ``NIXL_ERR_SETTLE_TIMEOUT_S`` more; an unreadable state fails), with
  growing sleeps between polls instead of ``sleep(0)``, and the handles above expanded.
  One addition: the worker's wait on a write cut short by a post NIXL refused (below)
  raises sglang's ``_NixlPostError`` once the pieces posted settled, so that sglang's
  worker treats its room as it treats the owner of a refused post.

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

A write cut short (NIXL refuses to create or to post one of its pieces).  Before any
piece was posted nothing is in flight: the error goes to the owner as sglang's own send
raises it, and the rooms sent ahead are uncounted and sent again on their own turn
(poisoned first if NIXL refused a post: its writes may still land, and sglang never ACKs
the room of such a post, ``transfer_worker``).  Once a piece was posted, nothing posted is
dropped (sglang never abandons a posted handle either): the pieces posted are the write,
which ends ERR once they settle (it carries only part of the pages).  The owner's wait
waits for them (bounded, as after a sibling's ERR): settled, the owner fails and is
uncounted (its decode may free its pages); unsettled, it fails as sglang fails a room
whose write it gave up on (poisoned, counted).  The rooms sent ahead stay counted until
the pieces settle, as above, and are then sent again on their own turn.  After a refused
post every room of the write is poisoned: the rooms sent ahead at once, the owner by
sglang's own rule for a refused post (the owner's wait raises ``_NixlPostError`` once the
pieces posted settled).

Served geometry (anything else, e.g. pipeline parallelism, DCP relayout, hybrid MLA,
mixed memory kinds, heterogeneous TP or staging, goes to sglang's own ``send_kvcache``):
the decode registered the same planes as the prefill (count, layer ids and bytes per
page), one memory kind each side.

Why it never packs.  kvmem's own PD (``kvmem.disagg``) packs a chunk's scattered pages
into one buffer when its calibration says that is faster than the descriptors, and the
decode unpacks it.  Here the receiving side is sglang's decode, stock or with the flag,
whose contract is KV at the page slots it published: a packed buffer would need a decode
that unpacks, i.e. a change to sglang's decode protocol.  So every chunk goes direct,
with runs merged where both sides are adjacent; on DRAM that already moves as fast as a
raw NIXL write of the same bytes (docs/sglang.md, "PD transfer speed").

Descriptor counts, writes and bytes are in :data:`STATS`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import ClassVar

import numpy as np

from kvmem.transfer import runs
from kvmem_sglang import audit, state

logger = logging.getLogger("kvmem.sglang")


# Bytes of KV one merged write may carry (the owner always goes, even when larger).  A
# room waits for the whole write it is in, so this bounds how long the first room of a
# burst waits for the others; 1 GiB is 8 requests of 1,024 tokens of the 32 x 8 x 128
# bf16 model.  A guess, not a measurement: bench/bench_sglang_transfer.py shows the
# throughput at this value.
BATCH_BYTES = 1 << 30
# NIXL writes one merged batch is posted as (several in flight: sglang's prefill agent
# has 8 UCX threads (``NixlKVManager.__init__``), each taking a write).  A guess, see above.
SPLIT = 4
# Fewest bytes a piece of a split write carries: a smaller batch goes as fewer writes (a
# KV chunk of a few KiB as one).  At several GB/s 4 MiB is well under a millisecond, where
# each extra write is one more handle to create, post and poll, with nothing to overlap
# (the e2e tier's tiny model split 3 KiB sends into 4 writes of 768 bytes).  A guess.
SPLIT_MIN_BYTES = 4 << 20
# Sleeps between polls of a healthy write: from NAP_MIN_S doubling to NAP_MAX_S.  A
# write of 128 MiB takes 15-50 ms on the CPU here, 1 MiB under 1 ms: the first polls come
# fast, and a long write costs at most NAP_MAX_S of extra latency.  Guesses.
NAP_MIN_S = 20e-6
NAP_MAX_S = 1e-3


@dataclass
class Stats:
    """What the path did in this process (all managers); the transfer workers of every
    manager add to it, under one lock."""

    sends: int = 0  # send_kvcache calls served here
    fallbacks: int = 0  # send_kvcache calls left to sglang (geometry not served)
    batches: int = 0  # merged writes (each posted as <= SPLIT NIXL writes)
    writes: int = 0  # engine writes posted: NIXL writes, Mooncake batch calls
    chunks: int = 0  # chunks carried by the merged writes (owners + ahead)
    sent_ahead: int = 0  # of those, chunks sent ahead of their turn
    ahead_done: int = 0  # send_kvcache calls answered by a settled write
    resent: int = 0  # chunks sent again because their ahead write failed
    index_pairs: int = 0  # (page, plane) pairs moved: sglang's descriptor count
    descriptors: int = 0  # descriptors posted after merging runs
    bytes: int = 0
    waits: int = 0  # _await_handles calls
    naps: int = 0  # sleeps inside them
    unsettled: int = 0  # waits that gave up on a write (rooms poisoned)
    cut_short: int = 0  # merged writes cut short once a piece was posted (not in batches)

    _lock: ClassVar[threading.Lock] = threading.Lock()

    def as_dict(self) -> dict:
        with self._lock:
            return asdict(self)

    def add(self, **counts: int) -> None:
        """Add to the named counters, here and in ``kvmem_sglang_transfer_total{what}``
        (sglang's ``/metrics``, where prometheus_client imports; its counters lock
        themselves)."""
        with self._lock:
            for what, n in counts.items():
                setattr(self, what, getattr(self, what) + n)
        if _COUNTER is not None:
            for what, n in counts.items():
                if n:
                    _COUNTER.labels(what=what).inc(n)


_COUNTER = audit.prometheus_counter(
    "kvmem_sglang_transfer",
    "What kvmem's NIXL send path did in this sglang process "
    "(what: sends, fallbacks to sglang's own send, writes, descriptors, bytes, ...; "
    "the fields of kvmem_sglang.transfer.Stats)",
    "what",
)
STATS = Stats()
_TLS = threading.local()  # .queue: the FastQueue the calling worker thread serves


class Batch:
    """One merged write: its NIXL handles (those posted) and the chunks sent ahead in it.

    ``state``: "PROC" until every handle settled, then "DONE" or "ERR".  ``failed``: a
    handle was seen ERR, or a wait gave up on it, or it was cut short (a wait on it is
    then bounded).  ``cut_short``: why a piece after the first posted one never went (the
    write then ends ERR); ``refused``: that reason was a post NIXL refused (its writes
    may still land); ``raised``: a wait raised sglang's post error for it.  ``until``: a
    wait in ``send_kvcache`` gave up on it then; the worker's wait that follows reads it
    once, without a bound of its own."""

    def __init__(self, natives: list, ahead: list, nbytes: int, descs: int):
        self.natives, self.ahead = natives, ahead
        self.nbytes, self.descs = nbytes, descs
        self.state, self.failed = "PROC", False
        self.cut_short: str | None = None
        self.refused: BaseException | None = None
        self.raised = False
        self.until: float | None = None

    def __repr__(self):
        cut = f", cut short: {self.cut_short}" if self.cut_short else ""
        return (
            f"kvmem Batch({len(self.natives)} NIXL write(s), {self.descs} descriptor(s), "
            f"{self.nbytes} bytes, {len(self.ahead)} chunk(s) sent ahead, "
            f"{self.state}{cut})"
        )


class Settled:
    """The handle of a chunk sent ahead whose write is DONE: nothing left to wait for."""

    state = "DONE"

    def __init__(self, batch: Batch):
        self.batch = batch

    def __repr__(self):
        return f"kvmem Settled({self.batch!r})"


@dataclass
class _Ahead:
    room: int
    peer: str
    src: np.ndarray  # the chunk's own prefill_kv_indices object (identity is the key)
    dst: np.ndarray
    batch: Batch | None = None
    counted: bool = True


@dataclass(frozen=True)
class _Geometry:
    src_ptrs: np.ndarray  # uint64 [planes]
    dst_ptrs: np.ndarray  # uint64 [planes]
    item: np.ndarray  # uint64 [planes]: bytes of one page of a plane (both sides)
    src_kind: str
    dst_kind: str
    src_dev: int
    dst_dev: int


class _State:
    """Per manager: the chunks sent ahead, by the identity of their index array."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ahead: dict[int, _Ahead] = {}

    def take(self, src) -> _Ahead | None:
        with self.lock:
            rec = self.ahead.get(id(src))
            if rec is not None and rec.src is src:
                del self.ahead[id(src)]
                return rec
            return None

    def sent_ahead(self, src) -> bool:
        """Whether the chunk of ``src`` is in a write that has not failed (a chunk whose
        write failed may go ahead again, in a later write)."""
        with self.lock:
            rec = self.ahead.get(id(src))
            return (
                rec is not None
                and rec.src is src
                and (rec.batch is None or rec.batch.state != "ERR")
            )

    def put(self, rec: _Ahead) -> None:
        with self.lock:
            self.ahead[id(rec.src)] = rec

    def sweep(self, mgr) -> None:
        """Forget records of rooms the manager no longer knows (cleared, or never to be
        reached by the worker) whose write settled."""
        with self.lock:
            for key, rec in list(self.ahead.items()):
                if (
                    rec.room not in mgr.request_status
                    and rec.batch is not None
                    and rec.batch.state != "PROC"
                ):
                    del self.ahead[key]


def _state(mgr) -> _State:
    return state.TRANSFERS.setdefault(mgr, _State)


# -- hooks ----------------------------------------------------------------------------------


def transfer_worker(original, mgr, queue, *args, **kwargs):
    """AROUND ``NixlKVManager.transfer_worker``: note the thread's queue, then run it."""
    _TLS.queue = queue
    return original(mgr, queue, *args, **kwargs)


def send_kvcache(
    original,
    mgr,
    peer_name,
    prefill_kv_indices,
    dst_kv_ptrs,
    dst_kv_indices,
    dst_gpu_id,
    dst_mem_kind="VRAM",
):
    """AROUND ``NixlKVManager.send_kvcache``: see the module docstring.  Returns a
    :class:`Batch` (posted, possibly cut short, or a write sent ahead that is still
    unsettled), a :class:`Settled` (sent ahead, DONE) or what sglang's own send returns."""
    st = _state(mgr)
    rec = st.take(prefill_kv_indices)
    if rec is not None:
        same = rec.peer == peer_name and np.array_equal(rec.dst, dst_kv_indices)
        batch = rec.batch if same else None
        if batch is not None and batch.state == "PROC":
            _wait_again(mgr, batch)  # its owner's wait gave up on it
            if batch.state == "PROC":
                return batch  # the worker's wait reads it once more, then gives up
            if batch.state == "DONE":
                return Settled(batch)
        elif batch is not None and batch.state == "DONE":
            STATS.add(ahead_done=1)
            return Settled(batch)
        STATS.add(resent=1)  # the write failed (or never went): send the chunk again
    geo = _geometry(mgr, peer_name, dst_kv_ptrs, dst_mem_kind, dst_gpu_id)
    if geo is None or len(prefill_kv_indices) != len(dst_kv_indices) or not len(dst_kv_indices):
        STATS.add(fallbacks=1)
        return original(
            mgr,
            peer_name,
            prefill_kv_indices,
            dst_kv_ptrs,
            dst_kv_indices,
            dst_gpu_id,
            dst_mem_kind=dst_mem_kind,
        )
    STATS.add(sends=1)
    src = np.asarray(prefill_kv_indices, dtype=np.int64)
    dst = np.asarray(dst_kv_indices, dtype=np.int64)
    per_page = int(geo.item.sum())
    budget = BATCH_BYTES - src.size * per_page
    ahead = _take_ahead(mgr, st, peer_name, budget, per_page, _nixl_peer) if budget > 0 else []
    try:
        return _post(mgr, geo, peer_name, [(src, dst)] + [(a.src, a.dst) for a in ahead], ahead)
    except Exception:
        for a in ahead:  # _post raises only before it posted anything: nothing in flight
            _uncount(mgr, a)
        raise


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


# -- the send ---------------------------------------------------------------------------------


def _geometry(mgr, peer, dst_kv_ptrs, dst_kind, dst_gpu_id) -> _Geometry | None:
    """The planes of both sides, when this path serves the peer (module docstring)."""
    from sglang.srt.disaggregation.nixl import conn

    info = mgr.decode_kv_args_table.get(peer)
    args = mgr.kv_args
    src_ptrs, item = list(args.kv_data_ptrs), list(args.kv_item_lens)
    src_ids = list(getattr(args, "kv_layer_ids", None) or [])
    dst_ids = list(getattr(info, "dst_kv_layer_ids", None) or []) if info is not None else []
    if (
        info is None
        or getattr(mgr, "pp_size", 1) != 1
        or mgr.is_hybrid_mla_backend
        or info.requires_dcp_relayout
        or info.kv_xfer_segments is not None
        or not src_ptrs
        or mgr.src_mem_kind is None
        or mgr.enable_staging
        or len(set(args.kv_data_mem_kinds)) != 1
        or list(dst_kv_ptrs) != list(info.dst_kv_ptrs)
        or len(info.dst_kv_ptrs) != len(src_ptrs)
        or list(info.dst_kv_item_lens) != item
        or (src_ids and dst_ids and src_ids != dst_ids)
        or len(set(info.dst_kv_mem_kinds or [dst_kind])) != 1
    ):
        return None
    if not (mgr.is_mla_backend or info.decode_tp_size == mgr.attn_tp_size):
        return None
    return _Geometry(
        np.array(src_ptrs, dtype=np.uint64),
        np.array(dst_kv_ptrs, dtype=np.uint64),
        np.array(item, dtype=np.uint64),
        mgr.src_mem_kind,
        dst_kind,
        conn._nixl_device_id(mgr.src_mem_kind, args.gpu_id),
        conn._nixl_device_id(dst_kind, dst_gpu_id),
    )


def _nixl_peer(req) -> str:
    return req.agent_name


def _take_ahead(mgr, st: _State, peer: str, budget: int, per_page: int, peer_of) -> list[_Ahead]:
    """The chunks queued behind the owner on this worker's queue that may go in its write
    now, each counted in ``_staging_outstanding``; at most ``budget`` bytes of KV,
    ``per_page`` bytes a page.  ``peer_of(req)``: the peer of one of a room's transfer
    infos, compared with ``peer`` (NIXL's agent name, Mooncake's session id).  Used by
    both backends' paths: their managers share these fields and this queue."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    queue = getattr(_TLS, "queue", None)
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
        rec = _Ahead(room, peer, src, np.empty(0, dtype=np.int64))
        try:
            ok = (
                room in mgr.request_status
                and mgr.check_status(room) != KVPoll.Failed
                and _dst_of(mgr, chunk, peer, rec, peer_of)
            )
        except Exception:  # noqa: BLE001 - a room being cleared meanwhile: not sent ahead
            ok = False
        if not ok:
            _uncount(mgr, rec, drop=fresh)
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


def _dst_of(mgr, chunk, peer: str, rec: _Ahead, peer_of) -> bool:
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


def _uncount(mgr, rec: _Ahead, drop: bool = False) -> None:
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


def run_addresses(src_ptrs: np.ndarray, dst_ptrs: np.ndarray, item: np.ndarray, pairs):
    """The descriptors of the page pairs of every chunk in ``pairs`` (``[(source ids,
    destination ids)]``), sorted by source page and merged where both sides are adjacent
    (:func:`kvmem.transfer.runs.merge_runs`), over planes at ``src_ptrs`` / ``dst_ptrs``
    with ``item`` bytes a page (uint64 [planes] each): ``(source addresses, destination
    addresses, bytes, page pairs)``, the first three uint64 [planes x runs], plane-major
    (:func:`kvmem.transfer.runs.descriptors`).  Both backends' paths post these."""
    src = np.concatenate([s for s, _ in pairs])
    dst = np.concatenate([d for _, d in pairs])
    # sorted by source: the chunks of several rooms interleave, and sorting finds the runs
    # their pages form together (kvmem's own PD merges in request order: one chunk a post)
    merged = runs.merge_runs(src, dst, by_source=True)
    return (*runs.descriptors(merged, src_ptrs, dst_ptrs, item), merged.pairs)


def split_pieces(descriptors: int, nbytes: int) -> int:
    """How many NIXL writes a merged batch of ``descriptors`` descriptors and ``nbytes``
    bytes is posted as: up to SPLIT, none with fewer than one descriptor or (past the
    first) SPLIT_MIN_BYTES bytes."""
    return max(1, min(SPLIT, descriptors, nbytes // SPLIT_MIN_BYTES))


def _post(mgr, geo: _Geometry, peer: str, pairs, ahead: list[_Ahead]) -> Batch:
    """Post the merged runs of ``pairs`` as up to SPLIT NIXL writes; the Batch, whose
    chunks sent ahead are recorded.  A piece NIXL refuses (not created, or its post
    refused) before any was posted: the error is raised as sglang's own send raises it
    (rooms sent ahead poisoned first if a post was refused).  After one was posted: the
    Batch of the pieces posted, cut short (module docstring); nothing waits here."""
    from sglang.srt.disaggregation.nixl import conn

    src_addr, dst_addr, nbytes, npairs = run_addresses(geo.src_ptrs, geo.dst_ptrs, geo.item, pairs)
    planes = geo.item.size
    ld = np.stack([src_addr, nbytes, np.full_like(src_addr, geo.src_dev)], axis=1)
    rdsc = np.stack([dst_addr, nbytes, np.full_like(dst_addr, geo.dst_dev)], axis=1)
    agent = mgr.agent
    posted = []
    pieces = split_pieces(int(ld.shape[0]), int(nbytes.sum()))
    cut = None
    try:
        for lpart, rpart in zip(np.array_split(ld, pieces), np.array_split(rdsc, pieces)):
            h = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs(lpart, geo.src_kind),
                agent.get_xfer_descs(rpart, geo.dst_kind),
                peer,
            )
            if not h:
                raise RuntimeError("KVSender failed to create transfer")
            mgr._post_xfer(h, "KVSender failed to post transfer")
            posted.append(h)
    except Exception as e:
        if isinstance(e, conn._NixlPostError):
            # that post's writes may still land (sglang's transfer_worker never ACKs its
            # room for it): nor the rooms sent ahead in it
            for a in ahead:
                mgr.poison_deferred_ack_room(a.room)
        if not posted:
            raise  # nothing in flight: send_kvcache uncounts the rooms sent ahead
        cut = e
    batch = Batch(posted, ahead, int(nbytes.sum()), int(ld.shape[0]))
    st = _state(mgr)
    for a in ahead:
        a.batch = batch
        st.put(a)
    if cut is not None:
        batch.cut_short = f"piece {len(posted) + 1} of {pieces}: {cut}"
        batch.refused = cut if isinstance(cut, conn._NixlPostError) else None
        batch.failed = True
        logger.warning(
            "kvmem-sglang: a merged write to %s was cut short after %d of %d "
            "NIXL write(s) were posted (%s); the rooms in it are held until "
            "those settle",
            peer,
            len(posted),
            pieces,
            cut,
        )
        STATS.add(cut_short=1, writes=len(posted))
        return batch
    STATS.add(
        batches=1,
        writes=len(posted),
        chunks=1 + len(ahead),
        sent_ahead=len(ahead),
        index_pairs=npairs * planes,
        descriptors=int(ld.shape[0]),
        bytes=batch.nbytes,
    )
    return batch


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
    each of those rooms (:func:`_wait_again`): the wait that sees it settle uncounts them,
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
        _uncount(mgr, a)


def _wait_again(mgr, batch: Batch) -> None:
    """The worker reached a room sent ahead in ``batch``, a write its owner's wait gave
    up on: wait for it (at most ``NIXL_ERR_SETTLE_TIMEOUT_S``) and conclude it.  Still
    unsettled: ``batch.until`` is now, so the worker's own wait on it reads it once and
    gives up (the room waits one bound in all, as sglang's does)."""
    _, _, states = _settle(mgr, batch.natives, False, bounded=True)
    _conclude(mgr, batch, states)
    if batch.state == "PROC":
        batch.until = time.time()
