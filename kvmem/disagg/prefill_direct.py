"""Direct writes of the prefill side (:class:`PrefillDirect`, a base class of
:class:`~kvmem.disagg.prefill_send.PrefillSending`; its methods use the side's fields):
the threshold, the prepared block list of this pool, whether a chunk goes direct and its
block indices, and the post of such a write.

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
    from kvmem.disagg.prefill_peers import PrefillPeers
    from typing import Any

log = logging.getLogger("kvmem.disagg.prefill")  # the side's logger (docs/logging.md)


class PrefillDirect:
    """The direct-write methods of :class:`~kvmem.disagg.prefill.PrefillSide` (not a side
    on its own: they read the side's requests, peers, engine and threshold)."""

    if TYPE_CHECKING:  # what PrefillSide (kvmem/disagg/prefill.py) provides
        engine: Any
        transfer_mode: str
        faults: Any
        direct_threshold: int | None
        _local_table: BlockTable | None
        peers: PrefillPeers

        @property
        def paused(self) -> bool: ...

        def _end(self, *args: Any, **kwargs: Any) -> Any: ...

    def set_direct_threshold(self, threshold: int | None) -> None:
        """Chunks whose merged page runs average at least ``threshold`` bytes per
        descriptor go direct from now on (None: all packed); e.g. a calibrated value
        (:func:`kvmem.disagg.calibrate.calibrate_direct`)."""
        if threshold is not None and (
            isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0
        ):
            raise ValueError(f"direct_threshold must be None or an int >= 0, got {threshold!r}")
        self.direct_threshold = threshold
        if self._local_table is None and not self.paused:
            self._prep_local()

    def _prep_local(self) -> None:
        self._local_table = None
        if self.direct_threshold is not None and self.engine.registrations()["kv"].layout:
            self._local_table = self.engine.prep_local("kv")

    def _direct_inputs(self, req: PrefillRequest) -> tuple[np.ndarray, BlockTable, int] | None:
        """``(the BOOT's page ids, the local list, the threshold)`` when a chunk of ``req``
        could be written direct now (push, a threshold, the BOOT's page ids and kv known,
        the local list prepared, the decode not pausing); None otherwise."""
        dpages, lt, threshold = req.dpages, self._local_table, self.direct_threshold
        if (
            self.transfer_mode != "push"
            or threshold is None
            or dpages is None
            or req.kv is None
            or lt is None
            or self.peers.get(req.peer).paused
        ):
            return None
        return dpages, lt, threshold

    def _may_go_direct(self, req: PrefillRequest) -> bool:
        """Whether a chunk of ``req`` could be written direct now (:meth:`_direct_inputs`)."""
        return self._direct_inputs(req) is not None

    def _direct_indices(self, req: PrefillRequest, first: int, last: int, src: np.ndarray):
        """``(local, remote)`` block indices when pages ``[first, last)`` go direct, else
        None (packed); ``src``: their page ids here (host).  Direct when the chunk's page
        runs, merged where adjacent on both sides, average at least ``direct_threshold``
        bytes per descriptor (one descriptor per merged run per layer and K|V).  A head
        range (heterogeneous TP) always packs: its rows are not whole pages (this side
        sends whole pages only)."""
        inputs = self._direct_inputs(req)
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
            rt = self.peers.get(req.peer).table.get()
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

    def _post_direct(self, req, st: _Staged) -> bool:
        """Post one direct write (pool pages to the decode's pool pages, prepared block
        lists); on failure end the request (500, or 503 when the decode's memory moved on)."""
        seq = req.seq
        req.seq += 1
        try:
            if self.faults.fail_send(req.rid, seq, False):
                raise TransferError(f"injected send failure of chunk {seq} (direct)")
            rt = self.peers.get(req.peer).table.get()
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
            li, ri = st.blocks
            h = self.engine.post_blocks(self._local_table, li, rt, ri, st.notif)
        except (StaleEpochError, TransferError) as e:
            return self._end_refused(req, e, f"chunk {seq} (direct)")
        req.handles.append(InFlight(h, None))
        return True

    def _end_refused(self, req: PrefillRequest, e: Exception, what: str) -> bool:
        """End ``req`` for a post of ``what`` that failed with ``e``: 503 when the decode
        released its KV memory since (StaleEpochError), else 500.  False: what a posting
        method returns then."""
        if isinstance(e, StaleEpochError):
            why = f"the decode side released its KV memory (epoch moved on): {e}"
            self._end(req, Reason(SERVICE_UNAVAILABLE, f"request {req.rid}: {why}"))
        else:
            self._end(req, Reason(INTERNAL_ERROR, f"request {req.rid}: send of {what} failed: {e}"))
        return False
