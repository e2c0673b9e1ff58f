"""The sending half of the prefill side (:class:`PrefillSending`, a part each
:class:`~kvmem.disagg.prefill.PrefillSide` holds): the transfers of a request, from
staging to posting to polling, the AUX after the last chunk included.  A request's
chunks are packed into staging, written direct or offered (pull), one transfer in flight
at a time; the side's request tables own the requests and their states.

* Direct chunks (``direct_threshold``; push): :mod:`kvmem.disagg.prefill_direct`.
* Pull mode (``transfer_mode="pull"``): each chunk is offered (``READY``) instead of
  written; the decode reads it from this pool and answers ``PULLED``.  The offer is held
  like a write in flight (one per request at a time): the pages stay held until the
  answer, or until ``quarantine_timeout`` (logged as an error) if none comes: the
  quarantine is on this side.  A pause publishes the ``kv`` tombstone, so the decode
  refuses reads built from the older metadata before posting them.
* Pack, then post, in that order on the device too: ``pack_pages`` (and the AUX copy) is
  asynchronous on CUDA, and RDMA reads the staging buffer without waiting for the
  stream.  So each staged write carries a *ready* object (``ready_event()``, by default a
  ``torch.cuda.Event`` recorded on the pool device's current stream, the one pack ran on,
  right after the pack); ``step`` posts it once ``ready.query()`` is True, and never
  blocks on it.  On the CPU pack is done when it returns and ready at once.
* Physical chunks: NIXL refuses a descriptor that spans two registered regions, and a
  memory backend reports one region per physical allocation (the CUDA VMM backend: one
  per 2 GiB chunk).  The staging buffer is registered with its backend's regions, and a
  slot's bytes are posted as one local range per chunk they lie in
  (:class:`~kvmem.disagg.prefill_staging.Staging`); the landing region is addressed as an offset
  into the decode's ``landing`` registration, its regions concatenated in order
  (:class:`~kvmem.disagg.peers.RegionMap`), cut the same way.  A write that spans two
  chunks on either side is one write of several ranges.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np
import torch

import kvmem
from kvmem.disagg.arena import ArenaFullError
from kvmem.disagg.device import to_device
from kvmem.disagg.outcome import INTERNAL_ERROR, Reason
from kvmem.disagg.protocol import AUX_BYTES
from kvmem.disagg.protocol import encode, encode_runs
from kvmem.disagg.states import PrefillState
from kvmem.transfer.errors import StaleEpochError, TransferError
from kvmem.disagg.prefill_direct import PrefillDirect, end_refused
from kvmem.disagg.prefill_request import InFlight, Offer, PrefillRequest, _Send, _Staged
from kvmem.transfer.records import XferState

if TYPE_CHECKING:
    from kvmem.disagg.prefill_context import PrefillContext
    from kvmem.disagg.prefill_ending import PrefillEnding
    from kvmem.disagg.prefill_schedule import PrefillScheduler

log = logging.getLogger("kvmem.disagg.prefill")  # the side's logger (docs/logging.md)


class PrefillSending:
    """The sending of one prefill side.  It owns the count of chunks by how they went
    (``chunk_modes``) and the direct writes (``direct``, a
    :class:`~kvmem.disagg.prefill_direct.PrefillDirect`, made with the threshold given);
    a request's transfer in flight is kept on the request (``staged``, ``handles``).
    What it uses: the side's context (``ctx``: the pool, engine, ledger, counters, clock,
    fault hooks, ready events, settings, the request tables, the staging buffer it packs
    into and posts from, and the decode peers' records and how to tell one), and the
    parts built before it: ``scheduler`` (its order is the order requests are sent in)
    and ``ending`` (a request ended, or finished once nothing of it is in flight)."""

    def __init__(
        self,
        ctx: PrefillContext,
        scheduler: PrefillScheduler,
        ending: PrefillEnding,
        direct_threshold: int | None,
    ):
        self.ctx, self.scheduler, self.ending = ctx, scheduler, ending
        self.chunk_modes: Counter = Counter()  # chunks posted, "packed" / "direct" / "pulled"
        self.direct = PrefillDirect(ctx, ending, direct_threshold)

    @property
    def writes_in_flight(self) -> bool:
        """True while a write this side posted (a chunk, direct or packed, or an AUX) is
        not seen DONE or ERR yet.  Such a write completes, and sends its notification, only
        when this side polls it (no progress thread: see kvmem/transfer/nixl.py), so a
        loop should not nap then; an offered read (pull) is the decode's to finish."""
        return any(
            not isinstance(t.op, Offer)
            for req in self.ctx.requests.active.values()
            for t in req.handles
        )

    # --- sending ----------------------------------------------------------------------------
    def flush_pending(self) -> bool:
        # One write of a request in flight at a time.  NIXL sends a write's notification
        # (CHUNK, AUX) when the write completes: inside post_write for a write that is done
        # at once, else at the poll that sees it DONE.  So two writes of one request in
        # flight can announce themselves out of order (seen across two processes: a 64-byte
        # AUX overtook the 16 MiB chunk before it).  After DONE, the next write's
        # notification follows on the same endpoint, in order.  True when something was
        # staged or posted (or a request ended trying).
        moved = False
        for rid in list(self.scheduler.order):
            req = self.ctx.requests.find(rid)
            while (
                req is not None
                and not req.state.ended
                and not self.ctx.peers.get(req.peer).paused
                and not req.handles
            ):
                if req.staged is not None:
                    if not self._post_staged(req):
                        break  # its pack is still running: next step
                    moved = True
                    continue
                if not req.pending:
                    break
                nxt = req.pending[0]
                got = self._stage_chunk(req, nxt.first, nxt.last, nxt.final)
                if got == "full":
                    return moved  # staging full: retry next step, in order
                if got == "wait":
                    break  # its page ids are still on their way to the host: next step
                moved = True
                if req.pending and not req.state.ended:
                    req.pending.pop(0)
        return moved

    def _stage_chunk(self, req: PrefillRequest, first: int, last: int, final: bool) -> str:
        """Stage pages ``[first, last)`` of ``req``: packed into a staging slot, or as a
        direct write or a pull offer.  ``"staged"``; ``"full"`` when staging is full, or
        ``"wait"`` when the chunk needs its page ids on the host (pull, direct) and their
        copy is not done yet (nothing changed either way)."""
        ctx = self.ctx
        spec, pull = ctx.spec, ctx.config.transfer_mode == "pull"
        nbytes = kvmem.packed_nbytes(spec, last - first)
        host_ids = None
        if pull or self.direct.may_go(req):
            host_ids = self._host_ids(req, first, last)
            if host_ids is None:
                return "wait"
        if pull:  # offered once the forward's writes are done
            self.chunk_modes["pulled"] += 1
            req.staged = _Staged(
                _Send.OFFER,
                nbytes,
                kvmem.packed_nbytes(spec, first),
                final,
                ctx.ready_event(),
                pages=(first, last),
            )
            # final: the decode reads the pages; freed once its read is DONE or ERR, in
            # KV_POSTED (_last_write_done)
            return "staged"
        direct = None if host_ids is None else self.direct.indices(req, first, last, host_ids)
        if direct is not None:
            ready = ctx.ready_event()  # the forward's writes to these pages are done
            self.chunk_modes["direct"] += 1
            notif = encode(
                "CHUNK",
                rid=req.rid,
                first=first,
                last=last,
                off=kvmem.packed_nbytes(spec, first),
                nbytes=nbytes,
                final=final,
                direct=True,
            )
            req.staged = _Staged(
                _Send.DIRECT,
                nbytes,
                kvmem.packed_nbytes(spec, first),
                final,
                ready,
                notif,
                blocks=direct,
            )
            # final: the write reads the pages; freed once it is DONE or ERR, in KV_POSTED
            return "staged"
        try:
            off = ctx.staging.arena.alloc(nbytes)
        except ArenaFullError:
            return "full"
        self.chunk_modes["packed"] += 1
        # the ids came from this side's allocator: unchecked, no host sync on CUDA
        kvmem.pack_pages(
            ctx.pool,
            ctx.ledger.pages(req.rid)[first:last],
            out=ctx.staging.tensor[off : off + nbytes],
            check=False,
        )
        ready = ctx.ready_event()  # right after the pack, on the stream it ran on
        ctx.metrics.bytes_packed += nbytes
        if final:  # the packed copies are what is sent: the pages are free to go (a later
            # writer of these pages is ordered after the pack on the same stream)
            ctx.ledger.release(req.rid, "sent")
        chunk_off = kvmem.packed_nbytes(spec, first)
        notif = encode(
            "CHUNK",
            rid=req.rid,
            first=first,
            last=last,
            off=chunk_off,
            nbytes=nbytes,
            final=final,
            direct=False,
        )
        req.staged = _Staged(_Send.PACKED, nbytes, chunk_off, final, ready, notif, off=off)
        return "staged"

    def _host_ids(self, req: PrefillRequest, first: int, last: int) -> np.ndarray | None:
        """``int64 [last - first]``: the page ids of pages ``[first, last)`` of ``req`` on
        the host, once their copies (made by the scheduler, in chunk order) are done; None
        before.  Never waits."""
        while req.ids and req.ids[0].copy.ready():
            c = req.ids.pop(0)
            req.host_pages[c.first : c.last] = c.copy.numpy()
            req.ids_known = c.last
        return req.host_pages[first:last] if req.ids_known >= last else None

    def _last_write_done(self, req: PrefillRequest) -> None:
        """KV_POSTED and nothing of ``req`` in flight: its last chunk is DONE (or its
        offer answered), so the pages a direct write or an offered read was reading go
        back (ledger reason ``sent``) and its extra state follows (:meth:`send_aux`)."""
        ledger = self.ctx.ledger
        if ledger.holds(req.rid):
            ledger.release(req.rid, "sent")
        self.send_aux(req)

    def send_aux(self, req: PrefillRequest) -> None:
        """The last write carries the request's extra state (first output token, lengths)."""
        ctx = self.ctx
        try:
            off = ctx.staging.arena.alloc(AUX_BYTES)
        except ArenaFullError:  # never: sized with room for AUX slots; fail loudly
            self.ending.end(
                req, Reason(INTERNAL_ERROR, f"request {req.rid}: no staging for its extra state")
            )
            return
        aux = torch.zeros(AUX_BYTES, dtype=torch.uint8)
        aux[:16].view(torch.int64).copy_(torch.tensor([req.rid, req.tokens]))
        # through pinned memory on CUDA: asynchronous, ordered before ``ready`` below
        staging = ctx.staging.tensor
        staging[off : off + AUX_BYTES].copy_(to_device(aux, staging.device))
        ready = ctx.ready_event()
        aux_off = kvmem.packed_nbytes(ctx.spec, -(-req.tokens // ctx.spec.page_size))
        notif = encode("AUX", rid=req.rid, off=aux_off, nbytes=AUX_BYTES)
        req.staged = _Staged(_Send.AUX, AUX_BYTES, aux_off, False, ready, notif, off=off)
        ctx.requests.set_state(req, PrefillState.AUX_STAGED)
        self._post_staged(req)

    def _post_staged(self, req: PrefillRequest) -> bool:
        """Post ``req.staged`` if its ready object says the bytes it sends are written;
        False (nothing changed) when not yet."""
        st = req.staged
        if st is None or not st.ready.query():
            return False
        req.staged = None
        if st.kind is _Send.OFFER:
            posted = self._offer(req, st)
        elif st.kind is _Send.DIRECT:
            posted = self.direct.post(req, st)
        else:
            posted = self._post(req, st.off, st.nbytes, st.remote_off, st.notif, aux=st.aux)
        if not posted:
            return True  # the request ended (500 / 503); a staging slot is free again
        if st.aux:
            self.ctx.requests.set_state(req, PrefillState.AUX_POSTED)
            return True
        # KV_POSTED: the AUX is staged by _last_write_done once this write is DONE
        self.ctx.requests.set_state(
            req, PrefillState.KV_POSTED if st.final else PrefillState.TRANSFERRING
        )
        return True

    def _post(self, req, staging_off, nbytes, remote_off, notif, *, aux: bool) -> bool:
        """Post one write from staging to the request's landing region; on failure free the
        slot and end the request (500, or 503 when the decode's memory moved on)."""
        seq = req.seq
        req.seq += 1
        ctx = self.ctx
        local = ctx.staging.map.ranges(staging_off, nbytes)  # one range per chunk it spans
        what = "extra-state (last) chunk" if aux else f"chunk {seq}"
        try:
            if ctx.faults().fail_send(req.rid, seq, aux):
                raise TransferError(f"injected send failure of {what}")
            remote = req.landing_map.ranges(req.landing_off + remote_off, nbytes)
            h = ctx.engine.post_write(local, req.remote, remote, notif)
        except (StaleEpochError, TransferError) as e:
            ctx.staging.arena.free(staging_off)
            return end_refused(self.ending.end, req, e, what)
        req.handles.append(InFlight(h, staging_off))
        return True

    def _offer(self, req, st: _Staged) -> bool:
        """Pull mode: tell the decode to read pages ``[first, last)`` from this pool."""
        assert st.pages is not None  # an OFFER's
        first, last = st.pages
        ctx = self.ctx
        seq = req.seq
        req.seq += 1
        if ctx.faults().fail_send(req.rid, seq, False):
            self.ending.end(
                req,
                Reason(
                    INTERNAL_ERROR,
                    f"request {req.rid}: send of chunk {seq} "
                    "(a READY offer, pull) failed: injected send failure",
                ),
            )
            return False
        pages = req.host_pages[first:last]  # known on the host: _stage_chunk waited for them
        msg = encode(
            "READY",
            rid=req.rid,
            first=first,
            last=last,
            pages=encode_runs(pages),
            epoch=ctx.pool.epoch,
            final=st.final,
        )
        if not ctx.peers.tell(req.peer, msg):
            self.ending.end(
                req,
                Reason(
                    INTERNAL_ERROR,
                    f"request {req.rid}: the decode cannot be reached to read chunk {seq}",
                ),
            )
            return False
        req.handles.append(InFlight(Offer(first, last, st.nbytes, ctx.clock()), None))
        return True

    def poll_writes(self) -> bool:
        """Poll every posted write (this is also what sends its notification): DONE and
        ERR writes give their staging slot back; an ERR ends its request (500).  True when
        a write or an offered read ended."""
        ended, metrics = False, self.ctx.metrics
        for req in list(self.ctx.requests.active.values()):
            if not req.handles:
                continue
            keep, failed = [], None
            for t in req.handles:
                st = self._poll_offer(req, t.op) if isinstance(t.op, Offer) else self._poll_write(t)
                if st == "PROC":
                    keep.append(t)
                    continue
                ended = True
                if st == "DONE":
                    metrics.bytes_sent += t.op.nbytes
                    metrics.peer(req.peer).bytes += t.op.nbytes
                elif failed is None:
                    failed = t.op
            req.handles = keep
            if failed is not None and not req.state.ended:
                self.ending.end(
                    req,
                    Reason(
                        INTERNAL_ERROR,
                        f"request {req.rid}: write of {failed.nbytes} bytes failed: {failed.error}",
                    ),
                )
            elif not keep and req.state is PrefillState.KV_POSTED:
                self._last_write_done(req)
            else:
                self.ending.maybe_finish(req)
        return ended

    def _poll_write(self, w: InFlight) -> str:
        """The engine's state of write ``w``; once DONE or ERR its handle is released and
        its staging slot is free again."""
        assert not isinstance(w.op, Offer)  # a write's (offers: _poll_offer)
        st = self.ctx.engine.poll(w.op)
        if st != "PROC":
            self._release_write(w)
        return st

    def give_up(self, req: PrefillRequest) -> None:
        """Cancel ``req``'s posted writes and drop its offers (its decode is gone)."""
        for t in req.handles:  # an offer has nothing to give back: dropped with it
            if not isinstance(t.op, Offer):
                self._release_write(t, abort=True)
        req.handles = []

    def _release_write(self, w: InFlight, abort: bool = False) -> None:
        """Give back write ``w``'s handle (``abort``: cancel it if still in flight) and
        its staging slot."""
        assert not isinstance(w.op, Offer)  # a write's (an offer has nothing to give back)
        self.ctx.engine.release(w.op, abort=abort)
        if w.staging_off is not None:
            self.ctx.staging.arena.free(w.staging_off)

    def _poll_offer(self, req: PrefillRequest, offer: Offer) -> str:
        """``offer``'s state: the decode's answer (PULLED), or ERR (logged) once it has
        gone unanswered for ``quarantine_timeout``."""
        quarantine_s = self.ctx.config.quarantine_timeout
        if offer.state is XferState.PROC and self.ctx.clock() - offer.t_sent > quarantine_s:
            log.error(
                "prefill: request %d: no PULLED from the decode %.1f s after offering "
                "pages [%d, %d); freeing them",
                req.rid,
                quarantine_s,
                offer.first,
                offer.last,
            )
            offer.state, offer.error = XferState.ERR, "no PULLED within the quarantine timeout"
        return offer.state
