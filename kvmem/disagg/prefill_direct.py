"""Direct writes of the prefill side (:class:`PrefillDirect`, a part the sending part
:class:`~kvmem.disagg.prefill_send.PrefillSending` holds): the threshold, the prepared
block list of this pool, whether a chunk goes direct and its block indices, and the post
of such a write.

Direct chunks (``direct_threshold``; push): a chunk whose page runs, merged where
adjacent on both sides, average at least the threshold per descriptor is written from
this pool's pages straight into the decode's pool pages (prepared block lists, one
``post_blocks``); no pack, no staging slot.  Such a write reads the request's pages, so
they are freed once it is DONE or ERR, also when the request ends early.  A head range
(heterogeneous TP) always packs; this side sends whole pages only.  The decode's page
ids are those of its ``BOOT``'s kv epoch: a direct write is refused before posting
(StaleEpochError, the request ends 503) once the decode's kv registration is newer than
that BOOT's, as packed writes and pull offers are.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from kvmem.disagg.outcome import INTERNAL_ERROR, SERVICE_UNAVAILABLE, Reason
from kvmem.disagg.prefill_request import InFlight, PrefillRequest, _Staged
from kvmem.transfer.errors import StaleEpochError, TransferError
from kvmem.transfer.records import BlockTable
from kvmem.transfer.runs import merge_runs

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvmem.disagg.prefill_context import PrefillContext
    from kvmem.disagg.prefill_ending import PrefillEnding

log = logging.getLogger("kvmem.disagg.prefill")  # the side's logger (docs/logging.md)


class PrefillDirect:
    """The direct writes of one prefill side.  It owns the threshold (``threshold``) and
    the prepared block list of this side's pool (``local_table``).  What it uses: the
    side's context (``ctx``: the engine, the transfer mode, the fault hooks, what is kept
    about a decode peer: whether it is paused, its prepared block list) and the ending
    part (``ending``: a request whose write is refused ends there)."""

    def __init__(self, ctx: PrefillContext, ending: PrefillEnding, threshold: int | None):
        self.ctx, self.ending = ctx, ending
        # Direct writes (pool pages to the decode's pool pages, no pack) for chunks whose
        # page runs, merged where adjacent on both sides, are at least this many bytes per
        # descriptor; None: every chunk is packed.  Measured by kvmem.disagg.calibrate.
        self.threshold = threshold
        self.local_table: BlockTable | None = None  # prepared list of our pool ("kv")

    def set_threshold(self, threshold: int | None, *, prep: bool) -> None:
        """Chunks whose merged page runs average at least ``threshold`` bytes per
        descriptor go direct from now on (None: all packed); ``prep``: the pool is
        registered (not paused), so the local list is prepared now if it is not yet."""
        if threshold is not None and (
            isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0
        ):
            raise ValueError(f"direct_threshold must be None or an int >= 0, got {threshold!r}")
        self.threshold = threshold
        if self.local_table is None and prep:
            self.prep_local()

    def prep_local(self) -> None:
        """Prepare the block list of this side's pool (its ``kv`` registration) when there
        is a threshold; None otherwise."""
        self.local_table = None
        engine = self.ctx.engine
        if self.threshold is not None and engine.registrations()["kv"].layout:
            self.local_table = engine.prep_local("kv")

    def inputs(self, req: PrefillRequest) -> tuple[np.ndarray, BlockTable, int] | None:
        """``(the BOOT's page ids, the local list, the threshold)`` when a chunk of ``req``
        could be written direct now (push, a threshold, the BOOT's page ids and kv known,
        the local list prepared, the decode not pausing); None otherwise."""
        dpages, lt, threshold = req.dpages, self.local_table, self.threshold
        if (
            self.ctx.config.transfer_mode != "push"
            or threshold is None
            or dpages is None
            or req.kv is None
            or lt is None
            or self.ctx.peers.get(req.peer).paused
        ):
            return None
        return dpages, lt, threshold

    def may_go(self, req: PrefillRequest) -> bool:
        """Whether a chunk of ``req`` could be written direct now (:meth:`inputs`)."""
        return self.inputs(req) is not None

    def indices(self, req: PrefillRequest, first: int, last: int, src: np.ndarray):
        """``(local, remote)`` block indices when pages ``[first, last)`` go direct, else
        None (packed); ``src``: their page ids here (host).  Direct when the chunk's page
        runs, merged where adjacent on both sides, average at least ``threshold``
        bytes per descriptor (one descriptor per merged run per layer and K|V).  A head
        range (heterogeneous TP) always packs: its rows are not whole pages (this side
        sends whole pages only)."""
        inputs = self.inputs(req)
        if inputs is None:
            return None
        dpages, lt, threshold = inputs
        dst = dpages[first:last]
        n = last - first
        # in request order, not sorted: NIXL's prepared list merges the blocks as posted
        runs = len(merge_runs(src, dst, by_source=False))
        if n * int(lt.nbytes.min()) / runs < threshold:
            return None
        try:
            rt = self.ctx.peers.get(req.peer).table.get()
        except TransferError as e:  # NIXL refused to prepare the decode's list: pack
            log.warning("prefill: direct writes unavailable, packing: %s", e)
            return None
        if (
            rt is None
            or rt.nbytes.size != lt.nbytes.size
            or not np.array_equal(rt.nbytes, lt.nbytes)
        ):
            return None
        planes = np.arange(lt.nbytes.size, dtype=np.int64)[:, None]
        li = (planes * lt.layout.count + src).reshape(-1)
        ri = (planes * rt.layout.count + dst).reshape(-1)
        return li, ri

    def post(self, req, st: _Staged) -> bool:
        """Post one direct write (pool pages to the decode's pool pages, prepared block
        lists); on failure end the request (500, or 503 when the decode's memory moved on)."""
        seq = req.seq
        req.seq += 1
        try:
            if self.ctx.faults().fail_send(req.rid, seq, False):
                raise TransferError(f"injected send failure of chunk {seq} (direct)")
            rt = self.ctx.peers.get(req.peer).table.get()
            if rt is None or rt.remote != req.kv:
                # the decode's kv moved on since the BOOT that gave these page ids
                raise StaleEpochError(
                    req.peer,
                    "kv",
                    req.kv.describe(),
                    "closed" if rt is None else rt.remote.describe(),
                    "post_blocks (the BOOT's kv)",
                )
            assert st.blocks is not None  # a DIRECT's
            lt = self.local_table
            assert lt is not None  # a DIRECT is staged only with the local list (inputs)
            li, ri = st.blocks
            h = self.ctx.engine.post_blocks(lt, li, rt, ri, st.notif)
        except (StaleEpochError, TransferError) as e:
            return end_refused(self.ending.end, req, e, f"chunk {seq} (direct)")
        req.handles.append(InFlight(h, None))
        return True


def end_refused(
    end: Callable[[PrefillRequest, Reason], None], req: PrefillRequest, e: Exception, what: str
) -> bool:
    """End ``req`` (``end``) for a post of ``what`` that failed with ``e``: 503 when the
    decode released its KV memory since (StaleEpochError), else 500.  False: what a
    posting method returns then."""
    if isinstance(e, StaleEpochError):
        why = f"the decode side released its KV memory (epoch moved on): {e}"
        end(req, Reason(SERVICE_UNAVAILABLE, f"request {req.rid}: {why}"))
    else:
        end(req, Reason(INTERNAL_ERROR, f"request {req.rid}: send of {what} failed: {e}"))
    return False
