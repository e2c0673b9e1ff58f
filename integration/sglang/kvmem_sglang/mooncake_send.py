"""kvmem's send path under sglang 0.5.23's Mooncake prefill (``SGLANG_KVMEM_TRANSFER=kvmem``,
the default; ``sglang`` leaves sglang's own path).

Names below are of the installed ``sglang/srt/disaggregation/mooncake/conn.py``, methods
of its ``MooncakeKVManager``.

What sglang does.  As on NIXL (:mod:`kvmem_sglang.transfer`), every room going to one
decode lands in one transfer worker's queue (``add_transfer_request`` shards by the sum
of the decode sessions' ports), and the worker sends its chunks one at a time.  Per chunk
``send_kvcache`` merges the chunk's own pages adjacent on both sides
(``group_concurrent_contiguous``) and posts one ``batch_transfer_sync`` of one slice per
run and plane (``_send_kvcache_generic``), which returns when every slice landed or
failed.  Pages of one request that are not adjacent cost one slice each.  Over TCP a batch
has a ceiling besides: Mooncake's TCP transport queues at most
``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` transfers per peer (1,024 by default, 4,096 at
most); past it the engine logs "TCP lane queue-full rejection", the call returns -1, and
sglang marks the decode's session failed (measured with mooncake-transfer-engine-non-cuda
0.3.13.post1: a chunk of 4,096 slices fails at the default, one of 2,048 passes), so a
long request whose pages are scattered fails with nothing wrong but its layout.

What this module changes: how the bytes of those sends move, nothing else.  Two hooks
(AROUND) on ``MooncakeKVManager``:

* ``transfer_worker``: remembers which queue the calling thread serves, and hands the
  worker that queue with its gets counted
  (:func:`kvmem_sglang.transfer_ahead.transfer_worker`, shared with NIXL).
* ``send_kvcache`` (``transfer_worker`` calls it for MHA and MLA at equal attention TP).
  It takes the chunk handed to it (the *owner*) and the chunks queued behind it on the
  same worker for the same decode session, up to :data:`kvmem_sglang.transfer.BATCH_BYTES`
  (:func:`kvmem_sglang.transfer_ahead.take_ahead`: the worker's own checks, each counted in
  ``_staging_outstanding`` as the worker counts a chunk at dequeue; a chunk a GPU is
  still writing, its page ids or its pages, waits for its own turn:
  :func:`kvmem_sglang.transfer_ahead._readable`), pairs every page of them all, sorts the
  pairs by source page and merges runs adjacent on both sides
  (:func:`kvmem_sglang.transfer.run_addresses`): one slice per run and plane, a run
  never leaving its plane (one registration on either side, as on NIXL).  The slices go out as
  ``batch_transfer_sync`` calls of at most :func:`max_slices` each, one after the other
  (each waits for its slices; a failed call stops the rest), and the owner gets 0 or the
  first failed call's code, as from sglang's own send.

Chunks sent ahead.  Their bytes have landed when the owner's call returns 0; each is
uncounted then, so an ABORT_ACK held for it (``_maybe_ack_drained_abort``) goes only
after its write.  When the worker reaches one, ``send_kvcache`` returns 0 without moving
anything, and sglang's own code runs for the room from there (the aux write,
Success, notifications): a room sent ahead stays WaitingForInput until then.  A failed
call fails them all (their write ends ERR).  Mooncake returns -1 while slices of that call
may still move (:mod:`kvmem_sglang.mooncake`), so each room sent ahead with a slice in that
call is poisoned as sglang poisons the owner (``_poison_unsettled_send``: no ABORT_ACK, its
decode falls back to its release timeout) before it is uncounted.  A room whose slices were
all in calls that returned 0 (landed) or in calls after the failed one (never posted) is
not poisoned: nothing of it can still move, and its decode's ABORT is acknowledged once it
is uncounted.  A call that raises counts as failed with its slices posted; an error before
the first call poisons no room sent ahead.  The owner's failure marks the session failed
(sglang's ``transfer_worker``, on a non-zero return), and the worker then fails the rooms
behind it as it fails any room of a failed session; should the session be usable again by
then, the room is sent again on its own turn.

Served geometry (anything else goes to sglang's own ``send_kvcache``): no pipeline
parallelism, hybrid MLA, custom memory pool, unified memory or HiSparse device indices;
the decode registered as many planes as the prefill with the same bytes per page (where
it published them) and the same layer ids (where both did); equal attention TP or MLA.

Counters: :data:`kvmem_sglang.transfer_records.STATS` (``writes`` counts ``batch_transfer_sync``
calls, ``descriptors`` their slices).
"""

from __future__ import annotations

import os

import numpy as np

from kvmem_sglang import transfer, transfer_ahead, transfer_records
from kvmem_sglang.transfer_records import STATS


# Mooncake's TCP transport takes this many queued transfers per peer unless
# MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER says otherwise (module docstring).
TCP_QUEUE_DEFAULT = 1024


def max_slices(mgr=None, planes: int = 0, env=None) -> int:
    """Slices one ``batch_transfer_sync`` call carries at most: Mooncake's TCP queue per
    peer (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``, :data:`TCP_QUEUE_DEFAULT` when unset
    or not a positive integer), and, where the user bounded sglang's batches
    (``SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES``, read by the manager), that many pages
    of ``planes`` planes."""
    env = os.environ if env is None else env
    try:
        cap = int(env.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", ""))
    except ValueError:
        cap = 0
    cap = cap if cap > 0 else TCP_QUEUE_DEFAULT
    pages = int(getattr(mgr, "max_transfer_batch_indices", 0) or 0)
    if pages > 0 and planes > 0:
        cap = min(cap, pages * planes)
    return max(1, cap)


def send_kvcache(
    original,
    mgr,
    mooncake_session_id,
    prefill_kv_indices,
    dst_kv_ptrs,
    dst_kv_indices,
    executor,
    dst_layer_ids=None,
    dst_device_kv_indices=None,
    dst_kv_item_len=None,
    dst_attn_tp_size=None,
):
    """AROUND ``MooncakeKVManager.send_kvcache``: see the module docstring.  Returns 0 or
    the engine's code of the first failed call, as sglang's own send does."""
    session = mooncake_session_id
    st = transfer_records.transfer_state(mgr)
    rec = st.take(prefill_kv_indices)
    if rec is not None:
        if (
            rec.peer == session
            and np.array_equal(rec.dst, dst_kv_indices)
            and rec.batch is not None
            and rec.batch.state == "DONE"
        ):
            STATS.add(ahead_done=1)
            return 0
        STATS.add(resent=1)  # its write failed: send the chunk again
    geo = _geometry(mgr, session, dst_kv_ptrs, dst_layer_ids, dst_device_kv_indices)
    if geo is None or len(prefill_kv_indices) != len(dst_kv_indices) or not len(dst_kv_indices):
        STATS.add(fallbacks=1)
        return original(
            mgr,
            mooncake_session_id,
            prefill_kv_indices,
            dst_kv_ptrs,
            dst_kv_indices,
            executor,
            dst_layer_ids=dst_layer_ids,
            dst_device_kv_indices=dst_device_kv_indices,
            dst_kv_item_len=dst_kv_item_len,
            dst_attn_tp_size=dst_attn_tp_size,
        )
    STATS.add(sends=1)
    src_ptrs, dst_ptrs, item = geo
    src = np.asarray(prefill_kv_indices, dtype=np.int64)
    dst = np.asarray(dst_kv_indices, dtype=np.int64)
    per_page = int(item.sum())
    budget = transfer.BATCH_BYTES - src.size * per_page
    ahead = (
        transfer_ahead.take_ahead(mgr, st, session, budget, per_page, _mooncake_peer)
        if budget > 0
        else []
    )
    pairs = [(src, dst)] + [(a.src, a.dst) for a in ahead]
    posted: list[tuple[int, int]] = []  # the slices of each call made, in order
    try:
        src_addr, dst_addr, nbytes, npairs = transfer.run_addresses(src_ptrs, dst_ptrs, item, pairs)
        code, calls = write_calls(
            mgr, session, src_addr, dst_addr, nbytes, max_slices(mgr, int(item.size)), posted
        )
    except BaseException:
        batch = transfer_records.Batch([], ahead, 0, 0)
        _end_ahead(mgr, st, ahead, batch, _moving(pairs, posted))
        raise  # the rooms sent ahead end as after a failed call
    nbytes = int(nbytes.sum())
    batch = transfer_records.Batch([], ahead, nbytes, src_addr.size)
    _end_ahead(mgr, st, ahead, batch, _moving(pairs, posted) if code != 0 else None)
    STATS.add(writes=calls)
    if code == 0:
        STATS.add(
            batches=1,
            chunks=1 + len(ahead),
            sent_ahead=len(ahead),
            index_pairs=npairs * item.size,
            descriptors=src_addr.size,
            bytes=nbytes,
        )
    else:
        STATS.add(cut_short=1)
    return code


def _end_ahead(mgr, st, ahead, batch, moving: set[int] | None) -> None:
    """The calls carrying the chunks sent ahead returned: ``batch`` settled DONE
    (``moving`` None), or ERR: a call failed, and ``moving`` holds the chunks (indices into
    the write's pairs, the owner 0, ``ahead[i]`` at ``i + 1``) with slices in that call,
    which may still move.  The room of each chunk sent ahead that may still move is
    poisoned first; the others are not (their slices landed, in calls that returned 0, or
    were never posted, in calls after the failed one).  Each chunk recorded for the
    worker's turn and uncounted."""
    failed = moving is not None
    batch.state = "ERR" if failed else "DONE"
    batch.failed = failed
    for i, a in enumerate(ahead, 1):
        if moving is not None and i in moving:
            mgr._poison_unsettled_send(a.room)
        a.batch = batch
        st.put(a)
        transfer_ahead.uncount(mgr, a)


def _moving(pairs, posted: list[tuple[int, int]]) -> set[int]:
    """After a failed or raising call, the chunks of ``pairs`` whose slices may still move:
    those with a slice in the last call made (``posted``: each call's slices, in order; the
    calls before it returned 0, every slice landed), none if no call was made."""
    return transfer.chunks_in(pairs, *posted[-1]) if posted else set()


def _mooncake_peer(req) -> str:
    return req.mooncake_session_id


def _geometry(mgr, session, dst_kv_ptrs, dst_layer_ids, dst_device_kv_indices):
    """``(source plane pointers, destination plane pointers, bytes of a page per plane)``,
    uint64 arrays, when this path serves the peer (module docstring); else None."""
    from sglang.srt.disaggregation.mooncake import conn

    info = mgr.decode_kv_args_table.get(session)
    args = mgr.kv_args
    src_ptrs, item = list(args.kv_data_ptrs), list(args.kv_item_lens)
    src_ids = list(getattr(args, "kv_layer_ids", None) or [])
    dst_ids = list(dst_layer_ids or [])
    dst_item = list(getattr(info, "dst_kv_item_lens", None) or []) if info is not None else []
    if (
        info is None
        or dst_device_kv_indices is not None
        or not src_ptrs
        or getattr(mgr, "pp_size", 1) != 1
        or mgr.is_hybrid_mla_backend
        or mgr.enable_custom_mem_pool
        or conn.get_memory().enable_unified_memory
        or len(item) != len(src_ptrs)
        or list(dst_kv_ptrs) != list(info.dst_kv_ptrs)
        or len(dst_kv_ptrs) != len(src_ptrs)
        or (dst_item and dst_item != item)
        or (src_ids and dst_ids and src_ids != dst_ids)
    ):
        return None
    if not (mgr.is_mla_backend or info.dst_attn_tp_size == mgr.attn_tp_size):
        return None
    return (
        np.array(src_ptrs, dtype=np.uint64),
        np.array(dst_kv_ptrs, dtype=np.uint64),
        np.array(item, dtype=np.uint64),
    )


def write_calls(
    mgr, session: str, src_addr, dst_addr, nbytes, cap: int, posted: list[tuple[int, int]]
) -> tuple[int, int]:
    """Post the slices as ``batch_transfer_sync`` calls of at most ``cap`` each, one after
    the other: ``(code, calls)``, code 0 once every call returned 0, else the first
    non-zero code (no call after it).  Each call's slices ``(lo, hi)`` are appended to
    ``posted`` before it is made (so a call that raises is there too)."""
    calls = 0
    for lo in range(0, src_addr.size, cap):
        posted.append((lo, min(lo + cap, src_addr.size)))
        code = mgr.engine.batch_transfer_sync(
            session,
            src_addr[lo : lo + cap].tolist(),
            dst_addr[lo : lo + cap].tolist(),
            nbytes[lo : lo + cap].tolist(),
        )
        calls += 1
        if code != 0:
            return code, calls
    return 0, calls
