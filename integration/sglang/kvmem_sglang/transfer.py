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

What this path changes: how the bytes of those sends move, nothing else.  Three hooks
(AROUND) on ``NixlKVManager``:

* ``transfer_worker`` (:mod:`kvmem_sglang.transfer_ahead`): remembers which queue the
  calling thread serves, and hands the worker that queue with its gets counted (for the
  queue's index, :mod:`kvmem_sglang.transfer_queue`); nothing else changes.
* ``send_kvcache`` (here), the narrowest call that moves KV (``transfer_worker`` calls it
  for MHA and MLA at equal attention TP).  It takes the chunk handed to it (the *owner*) and the
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
* ``_await_handles`` (:mod:`kvmem_sglang.transfer_wait`): sglang's contract (wait while
  every handle is healthy; once one failed, at most ``NIXL_ERR_SETTLE_TIMEOUT_S`` more; an
  unreadable state fails), with growing sleeps between polls instead of ``sleep(0)``, and
  the handles above expanded.  One addition: the worker's wait on a write cut short by a
  post NIXL refused (below) raises sglang's ``_NixlPostError`` once the pieces posted
  settled, so that sglang's worker treats its room as it treats the owner of a refused
  post.

Split by job: this module sends (the served geometry, the merged runs, the post);
:mod:`kvmem_sglang.transfer_ahead` takes the chunks sent ahead of their turn (that
module's docstring: how they are counted, waited for and sent again), finding them through
the worker queue's index (:mod:`kvmem_sglang.transfer_queue`), and
:mod:`kvmem_sglang.transfer_wait` waits for the writes; what they share (the counters,
a merged write, a chunk sent ahead) is in :mod:`kvmem_sglang.transfer_records`.

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

Descriptor counts, writes and bytes are in :data:`kvmem_sglang.transfer_records.STATS`.
"""

from __future__ import annotations

import logging

import numpy as np

from kvmem.transfer import runs
from kvmem_sglang.transfer_ahead import take_ahead, uncount
from kvmem_sglang.transfer_records import STATS, Batch, Settled, Ahead, Geometry, transfer_state
from kvmem_sglang.transfer_wait import wait_again

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


# -- the hook -------------------------------------------------------------------------------


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
    st = transfer_state(mgr)
    rec = st.take(prefill_kv_indices)
    if rec is not None:
        same = rec.peer == peer_name and np.array_equal(rec.dst, dst_kv_indices)
        batch = rec.batch if same else None
        if batch is not None and batch.state == "PROC":
            wait_again(mgr, batch)  # its owner's wait gave up on it
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
    ahead = take_ahead(mgr, st, peer_name, budget, per_page, _nixl_peer) if budget > 0 else []
    try:
        return _post(mgr, geo, peer_name, [(src, dst)] + [(a.src, a.dst) for a in ahead], ahead)
    except Exception:
        for a in ahead:  # _post raises only before it posted anything: nothing in flight
            uncount(mgr, a)
        raise


# -- the send ---------------------------------------------------------------------------------


def _geometry(mgr, peer, dst_kv_ptrs, dst_kind, dst_gpu_id) -> Geometry | None:
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
    return Geometry(
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


def chunks_in(pairs, lo: int, hi: int) -> set[int]:
    """The chunks (indices into ``pairs``) with a page in descriptors ``lo .. hi - 1`` of
    :func:`run_addresses` of the same ``pairs``: their runs are found again as it finds
    them, and descriptor ``d`` is run ``d % runs`` of plane ``d // runs``."""
    src = np.concatenate([s for s, _ in pairs]).astype(np.int64)
    dst = np.concatenate([d for _, d in pairs])
    merged = runs.merge_runs(src, dst, by_source=True)
    n = len(merged)
    if hi <= lo or n == 0:
        return set()
    chunk = np.repeat(np.arange(len(pairs)), [len(s) for s, _ in pairs])
    order = np.argsort(src, kind="stable")  # the pairs as merge_runs sorted them
    run_of = np.repeat(np.arange(n), merged.length)  # the run of each, in that order
    touched = np.unique(np.arange(lo, hi) % n)
    return set(chunk[order[np.isin(run_of, touched)]].tolist())


def split_pieces(descriptors: int, nbytes: int) -> int:
    """How many NIXL writes a merged batch of ``descriptors`` descriptors and ``nbytes``
    bytes is posted as: up to SPLIT, none with fewer than one descriptor or (past the
    first) SPLIT_MIN_BYTES bytes."""
    return max(1, min(SPLIT, descriptors, nbytes // SPLIT_MIN_BYTES))


def _post(mgr, geo: Geometry, peer: str, pairs, ahead: list[Ahead]) -> Batch:
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
    st = transfer_state(mgr)
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
