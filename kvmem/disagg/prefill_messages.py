"""What the decode peers send the prefill side, and its answers (:class:`PrefillMessages`,
a part each :class:`~kvmem.disagg.prefill.PrefillSide` holds): the inbox of their
messages, the one dispatch table and its handlers, the acknowledgement of a peer's
pause, and a peer known to be dead (``peer_gone``).  What is kept per peer:
:mod:`kvmem.disagg.prefill_peers`.

* A message about a request from a peer it is not bound to is refused.  A peer that
  vanishes (its process killed) is found out by the lifecycle itself: its requests end
  by the bootstrap or transfer timeout (504) or by a failed write (500); the memory a
  write in flight may read stays held until that write is DONE or ERR.  A caller that
  knows a peer is dead (its process exited, a health check) says so
  (:meth:`PrefillSide.peer_gone <kvmem.disagg.prefill.PrefillSide.peer_gone>`): its
  requests end at once (500), their transfers given up, instead of holding pages, and a
  pause, for the transfer timeout.  ``META`` after a pause of this side goes to every
  peer.
* Peer messages arrive validated (:mod:`kvmem.disagg.protocol`); the handlers here check
  what depends on state (and that the sender is the request's peer), before they change
  anything.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

import kvmem
from kvmem.disagg.dispatch import Handlers, Route
from kvmem.disagg.outcome import INTERNAL_ERROR, OK, SERVICE_UNAVAILABLE, ProtocolError, Reason
from kvmem.disagg.peers import RegionMap
from kvmem.disagg.prefill_request import Offer, PrefillRequest
from kvmem.disagg.protocol import (
    AUX_BYTES,
    AbortReq,
    Boot,
    Inbox,
    Meta,
    Pausing,
    Pulled,
    apply_metadata,
    decode_runs,
    encode,
)
from kvmem.disagg.states import PrefillState
from kvmem.transfer.records import XferState

if TYPE_CHECKING:
    from kvmem.disagg.dispatch import Message
    from kvmem.disagg.prefill_context import PrefillContext
    from kvmem.disagg.prefill_ending import PrefillEnding
    from kvmem.disagg.prefill_schedule import PrefillScheduler
    from kvmem.disagg.prefill_send import PrefillSending

log = logging.getLogger("kvmem.disagg.prefill")  # the side's logger (docs/logging.md)


class PrefillMessages:
    """The messages of one prefill side's decode peers.  It owns their inbox (``inbox``)
    and the dispatch table (``handlers``), which routes each kind a decode sends
    (:data:`~kvmem.disagg.protocol.PREFILL_RECEIVES`) to its handler here.  What the
    handlers act on: the side's context (``ctx``: the engine, the counters, the clock,
    the request tables and the decode peers' records), and the parts built before this
    one: ``scheduler`` (a bootstrapped request admitted), ``ending`` (an abort, a request
    ended early or finished) and ``sending`` (a dead peer's transfers given up)."""

    def __init__(
        self,
        ctx: PrefillContext,
        scheduler: PrefillScheduler,
        ending: PrefillEnding,
        sending: PrefillSending,
    ):
        self.ctx, self.scheduler, self.ending, self.sending = ctx, scheduler, ending, sending
        self.handlers = Handlers(
            "prefill",
            "decode",
            ctx.peers.names,
            (
                Route(Boot, self._on_boot),
                Route(AbortReq, self._on_abort_req),
                Route(Pausing, self._on_pausing),
                Route(Meta, self._on_meta),
                Route(Pulled, self._on_pulled),
            ),
        )
        self.inbox = Inbox(
            ctx.engine,
            peers=ctx.peers.names,
            receiver="prefill",
            handle=self.handle_message,
            metrics=ctx.metrics,
            log=log,
        )

    # --- control messages ---------------------------------------------------------------------
    def handle_notifs(self) -> bool:
        """Apply what the decodes sent, then the BOOTs held for their META; True when a
        message was handled (refused ones too) or a held BOOT was taken up."""
        moved = self.inbox.drain() > 0
        for peer in self.ctx.peers:
            if not peer.held_boots or peer.paused:
                continue
            held, peer.held_boots = peer.held_boots, {}
            for boot in held.values():
                try:
                    self._on_boot(boot, peer.name)
                except ProtocolError as e:
                    self.ctx.metrics.protocol_errors += 1
                    log.warning("prefill: refused a held BOOT from %s: %s", peer.name, e)
            # held again (its META is still on the way) is no progress
            moved = moved or any(rid not in peer.held_boots for rid in held)
        return moved

    def handle_message(self, msg: Message, peer: str | None = None) -> None:
        """Apply one validated message (:func:`kvmem.disagg.protocol.parse`) from decode
        peer ``peer`` (may be left out when the side has one) with its handler of
        :attr:`handlers`; ProtocolError, before anything changed, when it does not fit
        the state here."""
        self.handlers(msg, self.ctx.peers.sole if peer is None else peer)

    def _bound(self, msg, peer: str) -> PrefillRequest | None:
        """The active request ``msg`` names (None when it finished here), after checking
        that ``peer`` is the decode it is bound to; ProtocolError for an unknown request
        or another peer's."""
        requests = self.ctx.requests
        req = requests.find(msg.rid)
        bound = req.peer if req is not None else requests.finished_peer.get(msg.rid)
        if bound is None:
            raise ProtocolError(f"{msg.t} for unknown request {msg.rid}")
        if bound != peer:
            raise ProtocolError(
                f"{msg.t} for request {msg.rid} from {peer!r}: the request is bound to {bound!r}"
            )
        return req

    def _on_abort_req(self, msg: AbortReq, peer: str) -> None:
        req = self._bound(msg, peer)
        if req is None:
            # finished here already: nothing in flight; say so, so decode can free
            fin = self.ctx.requests.finished[msg.rid]
            self.ctx.peers.tell(
                peer, encode("ABORT", rid=msg.rid, status=fin.status, reason=fin.message)
            )
            return
        self.ending.abort(req.rid, msg.status, f"decode side: {msg.reason}")

    def _on_pausing(self, msg: Pausing, peer: str) -> None:
        try:
            landing = self.ctx.engine.remote(peer, "landing")
        except KeyError:
            raise ProtocolError(
                f"PAUSING epoch {msg.epoch} from {peer!r}: its landing buffer is not known here"
            ) from None
        if msg.epoch != landing.epoch:
            raise ProtocolError(
                f"PAUSING epoch {msg.epoch} from {peer!r}: its landing buffer "
                f"is at epoch {landing.epoch}"
            )
        p = self.ctx.peers.get(peer)
        p.paused = True
        p.pause_epoch = msg.epoch
        for req in list(self.ctx.requests.active.values()):
            # a BOOTSTRAPPING request's BOOT waits for the decode's META (held_boots)
            if req.peer == peer and req.state is not PrefillState.BOOTSTRAPPING:
                self.ending.end(
                    req,
                    Reason(
                        SERVICE_UNAVAILABLE,
                        (
                            f"request {req.rid} aborted: the decode side is pausing to release "
                            "its KV memory"
                        ),
                    ),
                )
        self.maybe_ack_pause()

    def _on_meta(self, msg: Meta, peer: str) -> None:
        apply_metadata(self.ctx.engine, msg)
        try:
            landing = self.ctx.engine.remote(peer, "landing")
        except KeyError:
            landing = None
        p = self.ctx.peers.get(peer)
        if landing is not None and landing.live and p.pause_epoch is None:
            p.paused = False

    def peer_gone(self, peer: str) -> int:
        """The caller knows decode ``peer`` is dead (its process exited): every request
        bound to it ends now (500, "decode ... is gone"), nothing more is sent to it, and
        the side's ``add_request`` refuses it (ValueError).  Its offered reads are given up and
        its posted writes cancelled (the engine's ``release(abort=True)``), so the pages
        they read are freed in this call: safe because a dead peer reads nothing more,
        and a cancelled write only reads this side's memory.  Returns the number of
        requests it ended; a second call ends none.  ValueError for a name that is not a
        decode peer of this side."""
        peers = self.ctx.peers
        p = peers.find(peer)
        if p is None:
            raise ValueError(
                f"peer_gone: {peer!r} is not a decode peer of this side ({list(peers.names)})"
            )
        p.gone = True
        p.held_boots.clear()
        p.pause_epoch = None  # no PAUSE_ACK to send it
        ended = 0
        for req in [r for r in self.ctx.requests.active.values() if r.peer == peer]:
            self.sending.give_up(req)
            if not req.state.ended:
                ended += 1
                self.ending.end(
                    req,
                    Reason(
                        INTERNAL_ERROR,
                        (f"request {req.rid} (room {req.room}): decode {peer} is gone"),
                    ),
                )
            else:
                self.ending.maybe_finish(req)
        return ended

    def maybe_ack_pause(self) -> None:
        """Answer each pausing decode (PAUSE_ACK) once none of this side's writes into it
        (nor reads it was offered) is in flight."""
        for p in self.ctx.peers:
            if p.pause_epoch is None:
                continue
            if any(req.handles for req in self.ctx.requests.active.values() if req.peer == p.name):
                continue  # writes into that decode still in flight: ack once drained
            self.ctx.peers.tell(p.name, encode("PAUSE_ACK", epoch=p.pause_epoch))
            p.pause_epoch = None

    def _on_boot(self, msg: Boot, peer: str) -> None:
        req = self._bound(msg, peer)
        if req is None:
            fin = self.ctx.requests.finished[msg.rid]
            if fin.status != OK:
                # Ended here, nothing in flight: say so (again), or the decode holds the
                # pages it booted with until its own timeout (a replayed REQ, a BOOT that
                # crossed our ABORT: then this second ABORT is ignored there).
                self.ctx.peers.tell(
                    peer, encode("ABORT", rid=msg.rid, status=fin.status, reason=fin.message)
                )
            return
        if msg.room != req.room:
            raise ProtocolError(f"BOOT for request {req.rid}: room {msg.room} != {req.room}")
        if req.state is not PrefillState.BOOTSTRAPPING:
            raise ProtocolError(
                f"BOOT for request {req.rid} in state {req.state.poll.name} ({req.state.name})"
            )
        ctx = self.ctx
        p = ctx.peers.get(peer)
        if p.paused:
            p.held_boots[req.rid] = msg
            return
        try:
            remote = ctx.engine.remote(peer, "landing")
        except KeyError:
            raise ProtocolError(
                f"BOOT for request {req.rid}: the decode's landing buffer is not known here"
            ) from None
        if remote.epoch < msg.epoch:
            p.held_boots[req.rid] = msg  # its META is on the way
            return
        if not remote.live:
            raise ProtocolError(
                f"BOOT for request {req.rid}: the decode's landing buffer is closed (it is pausing)"
            )
        if remote.epoch > msg.epoch:
            # Booted before the decode paused (which freed that region): ask again.
            ctx.peers.tell(peer, encode("REQ", rid=req.rid, room=req.room, tokens=req.tokens))
            return
        need = kvmem.packed_nbytes(ctx.spec, -(-req.tokens // ctx.spec.page_size)) + AUX_BYTES
        landing_map = RegionMap(remote.regions)
        if msg.nbytes < need or msg.off + msg.nbytes > landing_map.size:
            raise ProtocolError(
                f"BOOT for request {req.rid}: landing region [{msg.off}, "
                f"+{msg.nbytes}) does not hold {need} bytes within "
                f"{landing_map.size}"
            )
        n_pages = -(-req.tokens // ctx.spec.page_size)
        dpages = np.array(decode_runs(msg.pages, n_pages), dtype=np.int64)
        if dpages.size != n_pages:
            raise ProtocolError(
                f"BOOT for request {req.rid}: {dpages.size} decode pages for its {n_pages} pages"
            )
        try:
            kv = ctx.engine.remote(peer, "kv")
        except KeyError:
            kv = None
        if (
            kv is not None
            and kv.layout is not None
            and (dpages.min() < 1 or dpages.max() >= kv.layout.count)
        ):
            raise ProtocolError(
                f"BOOT for request {req.rid}: decode pages outside [1, {kv.layout.count})"
            )
        req.dpages = dpages
        # The page ids are the decode's pool pages at this BOOT's epoch: direct writes
        # target that registration only (None: it is not known here at that epoch, so
        # every chunk of the request packs)
        req.kv = kv if kv is not None and kv.live and kv.epoch == msg.epoch else None
        req.remote, req.landing_map = remote, landing_map
        req.landing_off, req.landing_nbytes = msg.off, msg.nbytes
        ctx.requests.set_state(req, PrefillState.WAITING_FOR_INPUT)
        req.t_bootstrapped = ctx.clock()
        self.scheduler.admit(req.rid)

    def _on_pulled(self, msg: Pulled, peer: str) -> None:
        req = self._bound(msg, peer)
        offer = (
            None
            if req is None
            else next(
                (
                    t.op
                    for t in req.handles
                    if isinstance(t.op, Offer)
                    and t.op.state is XferState.PROC
                    and (t.op.first, t.op.last) == (msg.first, msg.last)
                ),
                None,
            )
        )
        if offer is None:
            raise ProtocolError(
                f"PULLED for request {msg.rid} pages [{msg.first}, {msg.last}):"
                " no such read offered"
            )
        offer.state = XferState.DONE if msg.ok else XferState.ERR
        if not msg.ok:
            offer.error = "the decode's read failed or was refused"
