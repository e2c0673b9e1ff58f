"""kvmem's send of per-head slices at unequal attention TP under sglang 0.5.23's Mooncake
prefill (``SGLANG_KVMEM_TRANSFER=kvmem``, the default; ``sglang`` leaves sglang's own
send).

Names below are of the installed ``sglang/srt/disaggregation/mooncake/conn.py``, methods
of its ``MooncakeKVManager``.

What sglang does.  When the prefill's and the decode's attention TP differ (a TP 2
prefill beside a TP 1 decode, or the reverse) and no staging buffer is set up,
``transfer_worker`` sends each chunk with ``send_kvcache_slice``: a rank of the larger TP
holds part of every row of the other side, so each token of each plane is a slice of its
own, ``heads x head_dim`` bytes at the rank's head offset on either side, however the
pages lie (they never merge: consecutive tokens are a row apart on one side and a share
of a row apart on the other).  Per chunk it submits one ``batch_transfer_sync`` per
plane, each with one slice per token of the chunk (up to ``--chunked-prefill-size``,
4,096 tokens by default), to the worker's executor and waits for them all.  Over TCP a
call past Mooncake's queue of transfers per peer (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``,
1,024 by default) is rejected ("TCP lane queue-full rejection"): the call returns -1 and
sglang marks the decode's session failed, so that room fails and so does every later room
to that decode until the session is probed alive again.  A long chunk is enough (at the
default queue, calls of 4,096 slices were rejected on a CPU host over TCP loopback, calls
of 2,048 were not).

What this hook changes: how those slices are posted, nothing else.  AROUND
``send_kvcache_slice``: sglang's own function runs on a view of the manager
(:class:`_Recorder`) whose engine records each ``batch_transfer_sync`` it asks for
instead of posting it, and whose executor runs each submitted call at once; so the
slices (their addresses, lengths and order), the head arithmetic, the layer pairing and
every check are sglang's.  The recorded slices of every plane are then posted as
``batch_transfer_sync`` calls of at most :func:`kvmem_sglang.mooncake_send.max_slices`
each, one after the other (each waits for its slices; a failed call stops the rest), as
kvmem's equal-TP path posts its merged runs.  Every room of one decode is sent by one
transfer worker (sglang shards rooms by their decode sessions), so at most one such call
is in flight from this prefill rank to a decode rank.  The owner gets 0, or the code of
the first failed call, or the code sglang's function returned before asking for any call
(its checks), nothing posted.  A failed call is then treated by sglang's worker as after
its own send (the session marked failed, the room poisoned and failed).

Counters: :data:`kvmem_sglang.transfer_records.STATS` (``slice_sends`` chunks sent here,
``slice_calls`` calls made, ``slices`` their slices, ``slice_bytes``).
"""

from __future__ import annotations

import concurrent.futures

import numpy as np

from kvmem_sglang import mooncake_send
from kvmem_sglang.transfer_records import STATS


def send_kvcache_slice(
    original,
    mgr,
    mooncake_session_id,
    prefill_kv_indices,
    dst_kv_ptrs,
    dst_kv_indices,
    dst_tp_rank,
    dst_attn_tp_size,
    dst_kv_item_len,
    executor,
    dst_layer_ids=None,
):
    """AROUND ``MooncakeKVManager.send_kvcache_slice``: see the module docstring.
    Returns 0 or an engine's (or sglang's own) non-zero code, as sglang's send does."""
    rec = _Recorder(mgr)
    code = original(
        rec,
        mooncake_session_id,
        prefill_kv_indices,
        dst_kv_ptrs,
        dst_kv_indices,
        dst_tp_rank,
        dst_attn_tp_size,
        dst_kv_item_len,
        _Inline(),
        dst_layer_ids=dst_layer_ids,
    )
    if code != 0 or not rec.calls:
        return code
    src = np.concatenate([np.asarray(c[1], dtype=np.uint64) for c in rec.calls])
    dst = np.concatenate([np.asarray(c[2], dtype=np.uint64) for c in rec.calls])
    nbytes = np.concatenate([np.asarray(c[3], dtype=np.uint64) for c in rec.calls])
    code, calls = mooncake_send.write_calls(
        mgr, mooncake_session_id, src, dst, nbytes, mooncake_send.max_slices(mgr), []
    )
    STATS.add(slice_sends=1, slice_calls=calls)
    if code == 0:
        STATS.add(slices=int(src.size), slice_bytes=int(nbytes.sum()))
    return code


class _Recorder:
    """The manager as sglang's ``send_kvcache_slice`` sees it here: every attribute is
    the manager's, but ``engine`` records the calls asked of it (``calls``: ``(session,
    sources, destinations, lengths)`` in order) and answers 0 without posting."""

    def __init__(self, mgr):
        self._mgr = mgr
        self.calls: list[tuple] = []
        self.engine = self

    def batch_transfer_sync(self, session, buffers, peer_buffers, lengths):
        self.calls.append((session, buffers, peer_buffers, lengths))
        return 0

    def __getattr__(self, name):
        return getattr(self._mgr, name)


class _Inline:
    """An executor that runs each submitted call at once, in the calling thread."""

    def submit(self, fn, *args, **kwargs):
        future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller, as an executor does
            future.set_exception(e)
        return future
