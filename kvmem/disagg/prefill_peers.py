"""The decode peers of the prefill side and what they send it (:class:`PrefillPeers`, a
part each :class:`~kvmem.disagg.prefill.PrefillSide` holds): what is kept per peer, the
one dispatch table of peer messages and their handlers, the acknowledgement of a peer's
pause.

* Several decode peers (``decode_peers``): each request is bound to one of them when it
  is added (``add_request(..., peer=)``: routing is the caller's), and everything about a
  peer is kept per peer (:class:`_DecodePeer`): its pause (``PAUSING`` ends and drains
  only the requests bound to it, ``PAUSE_ACK`` answers it alone, the others keep
  flowing), the BOOTs held for its ``META``, the prepared block list of its pool, and its
  counters (``metrics.peers``).  A message about a request from a peer it is not bound to
  is refused.  A peer that vanishes (its process killed) is found out by the lifecycle
  itself: its requests end by the bootstrap or transfer timeout (504) or by a failed
  write (500); the memory a write in flight may read stays held until that write is
  DONE or ERR.  A caller that knows a peer is dead (its process exited, a health check)
  says so (:meth:`PrefillSide.peer_gone <kvmem.disagg.prefill.PrefillSide.peer_gone>`):
  its requests end at once (500), their transfers given up, instead of holding pages,
  and a pause, for the transfer timeout.
  ``META`` after a pause of this side goes to every peer.
* Peer messages arrive validated (:mod:`kvmem.disagg.protocol`); the handlers here check
  what depends on state (and that the sender is the request's peer), before they change
  anything.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

import kvmem
from kvmem.disagg.outcome import INTERNAL_ERROR, OK, SERVICE_UNAVAILABLE, ProtocolError, Reason
from kvmem.disagg.peers import PeerTable, RegionMap, sole_peer, tell
from kvmem.disagg.prefill_request import Offer, PrefillRequest, PrefillRequests
from kvmem.transfer.records import XferState
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
from kvmem.disagg.dispatch import Handlers, Route
from kvmem.disagg.states import PrefillState

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from kvmem.disagg.counters import Metrics
    from kvmem.disagg.dispatch import Message

log = logging.getLogger("kvmem.disagg.prefill")  # the side's logger (docs/logging.md)


@dataclass
class _DecodePeer:
    """What the prefill side keeps about one decode peer."""

    name: str
    table: PeerTable  # prepared block list of its pool (direct writes), per epoch
    paused: bool = False  # it announced a pause (PAUSING); cleared by its live META
    pause_epoch: int | None = None  # its PAUSE_ACK is due once no write into it is in flight
    held_boots: dict = field(default_factory=dict)  # rid -> BOOT waiting for its META
    gone: bool = False  # the caller said it is dead (peer_gone): no request, no message


class PrefillPeers:
    """The decode peers of one prefill side.  It owns the peer table (:class:`_DecodePeer`
    per peer: its pause, the BOOTs held for its META, its prepared block list, whether it
    is gone) and the inbox of their messages, and it is how the side tells a peer
    (:meth:`tell`).  What its handlers act on is handed to it: the engine, the counters
    and the clock; the side's request tables (``requests``, read: the active requests and
    what is kept of the finished ones); and the side's calls that
    change a request: ``admit`` (scheduled once bootstrapped), ``abort`` (the caller's
    abort, which waits for a batch in flight), ``end`` (end it early) and
    ``maybe_finish`` (finish it once nothing is in flight).  Its dispatch table
    (``handlers``) routes each kind of message a decode sends
    (:data:`~kvmem.disagg.protocol.PREFILL_RECEIVES`) to its handler here."""

    def __init__(
        self,
        engine: Any,
        names: tuple[str, ...],
        *,
        spec: kvmem.KVSpec,
        clock: Callable[[], float],
        metrics: Metrics,
        requests: PrefillRequests,
        admit: Callable[[int], None],
        abort: Callable[[int, int, str], None],
        end: Callable[[PrefillRequest, Reason], None],
        maybe_finish: Callable[[PrefillRequest], None],
    ):
        self.engine, self.names, self.spec = engine, names, spec
        self.clock, self.metrics = clock, metrics
        self.requests = requests
        self.admit, self.abort, self.end, self.maybe_finish = admit, abort, end, maybe_finish
        self._peers = {n: _DecodePeer(n, PeerTable(engine, n)) for n in names}
        self.handlers = Handlers(
            "prefill",
            "decode",
            names,
            (
                Route(Boot, self._on_boot),
                Route(AbortReq, self._on_abort_req),
                Route(Pausing, self._on_pausing),
                Route(Meta, self._on_meta),
                Route(Pulled, self._on_pulled),
            ),
        )
        self.inbox = Inbox(
            engine,
            peers=names,
            receiver="prefill",
            handle=self.handle_message,
            metrics=metrics,
            log=log,
        )

    def bind(self, rid: int, peer: str | None) -> str:
        """The decode peer new request ``rid`` goes to: ``peer``, or the only one when it
        is None.  ValueError (naming the request) when it must be named, is not a decode
        peer of this side, or is gone."""
        if peer is None:
            if len(self.names) != 1:
                raise ValueError(
                    f"add_request: request {rid}: name its decode peer, one of {list(self.names)}"
                )
            peer = self.names[0]
        elif peer not in self._peers:
            raise ValueError(
                f"add_request: request {rid}: {peer!r} is not a decode peer of "
                f"this side ({list(self.names)})"
            )
        if self._peers[peer].gone:
            raise ValueError(f"add_request: request {rid}: decode {peer!r} is gone (peer_gone)")
        return peer

    def tell(self, peer: str, msg: bytes) -> bool:
        """Send ``msg`` to decode ``peer``; False when it did not go out (the peer is gone,
        or cannot be reached: logged and counted)."""
        if self._peers[peer].gone:
            return False  # peer_gone: the caller knows it is dead
        return tell(self.engine, peer, msg, self.metrics, log)

    def tell_all(self, msg: bytes) -> None:
        """Send ``msg`` to every decode peer."""
        for name in self.names:
            self.tell(name, msg)

    @property
    def sole(self) -> str:
        """The decode peer, when there is one (ValueError when there are several)."""
        return sole_peer("decode", self.names, "; name one")

    @property
    def any_paused(self) -> bool:
        """True while a decode peer is paused (announced PAUSING, no live META since)."""
        return any(p.paused for p in self._peers.values())

    def is_paused(self, peer: str) -> bool:
        """Whether decode peer ``peer`` is paused (a router sends new requests elsewhere)."""
        return self.get(peer).paused

    def get(self, name: str) -> _DecodePeer:
        """What is kept about decode peer ``name`` (ValueError when it is not one)."""
        try:
            return self._peers[name]
        except KeyError:
            raise ValueError(
                f"{name!r} is not a decode peer of this side (peers: {list(self.names)})"
            ) from None

    def requests_of(self, peer: str) -> int:
        """Active requests bound to decode peer ``peer``."""
        self.get(peer)
        return sum(1 for r in self.requests.active.values() if r.peer == peer)

    # --- control messages ---------------------------------------------------------------------
    def handle_notifs(self) -> bool:
        """Apply what the decodes sent, then the BOOTs held for their META; True when a
        message was handled (refused ones too) or a held BOOT was taken up."""
        moved = self.inbox.drain() > 0
        for peer in self._peers.values():
            if not peer.held_boots or peer.paused:
                continue
            held, peer.held_boots = peer.held_boots, {}
            for boot in held.values():
                try:
                    self._on_boot(boot, peer.name)
                except ProtocolError as e:
                    self.metrics.protocol_errors += 1
                    log.warning("prefill: refused a held BOOT from %s: %s", peer.name, e)
            # held again (its META is still on the way) is no progress
            moved = moved or any(rid not in peer.held_boots for rid in held)
        return moved

    def handle_message(self, msg: Message, peer: str | None = None) -> None:
        """Apply one validated message (:func:`kvmem.disagg.protocol.parse`) from decode
        peer ``peer`` (may be left out when the side has one) with its handler of
        :attr:`handlers`; ProtocolError, before anything changed, when it does not fit
        the state here."""
        self.handlers(msg, self.sole if peer is None else peer)

    def _bound(self, msg, peer: str) -> PrefillRequest | None:
        """The active request ``msg`` names (None when it finished here), after checking
        that ``peer`` is the decode it is bound to; ProtocolError for an unknown request
        or another peer's."""
        req = self.requests.find(msg.rid)
        bound = req.peer if req is not None else self.requests.finished_peer.get(msg.rid)
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
            fin = self.requests.finished[msg.rid]
            self.tell(peer, encode("ABORT", rid=msg.rid, status=fin.status, reason=fin.message))
            return
        self.abort(req.rid, msg.status, f"decode side: {msg.reason}")

    def _on_pausing(self, msg: Pausing, peer: str) -> None:
        try:
            landing = self.engine.remote(peer, "landing")
        except KeyError:
            raise ProtocolError(
                f"PAUSING epoch {msg.epoch} from {peer!r}: its landing buffer is not known here"
            ) from None
        if msg.epoch != landing.epoch:
            raise ProtocolError(
                f"PAUSING epoch {msg.epoch} from {peer!r}: its landing buffer "
                f"is at epoch {landing.epoch}"
            )
        p = self._peers[peer]
        p.paused = True
        p.pause_epoch = msg.epoch
        for req in list(self.requests.active.values()):
            # a BOOTSTRAPPING request's BOOT waits for the decode's META (held_boots)
            if req.peer == peer and req.state is not PrefillState.BOOTSTRAPPING:
                self.end(
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
        apply_metadata(self.engine, msg)
        try:
            landing = self.engine.remote(peer, "landing")
        except KeyError:
            landing = None
        p = self._peers[peer]
        if landing is not None and landing.live and p.pause_epoch is None:
            p.paused = False

    def peer_gone(self, peer: str, give_up: Callable[[PrefillRequest], None]) -> int:
        """The caller knows decode ``peer`` is dead (its process exited): every request
        bound to it ends now (500, "decode ... is gone"), nothing more is sent to it, and
        :meth:`add_request` refuses it (ValueError).  Its offered reads are given up and
        its posted writes cancelled (the engine's ``release(abort=True)``), so the pages
        they read are freed in this call: safe because a dead peer reads nothing more,
        and a cancelled write only reads this side's memory.  Returns the number of
        requests it ended; a second call ends none.  ValueError for a name that is not a
        decode peer of this side.  ``give_up(req)``: the sending part's, which cancels the
        request's posted writes and drops its offers."""
        p = self._peers.get(peer)
        if p is None:
            raise ValueError(
                f"peer_gone: {peer!r} is not a decode peer of this side ({list(self.names)})"
            )
        p.gone = True
        p.held_boots.clear()
        p.pause_epoch = None  # no PAUSE_ACK to send it
        ended = 0
        for req in [r for r in self.requests.active.values() if r.peer == peer]:
            give_up(req)
            if not req.state.ended:
                ended += 1
                self.end(
                    req,
                    Reason(
                        INTERNAL_ERROR,
                        (f"request {req.rid} (room {req.room}): decode {peer} is gone"),
                    ),
                )
            else:
                self.maybe_finish(req)
        return ended

    def maybe_ack_pause(self) -> None:
        """Answer each pausing decode (PAUSE_ACK) once none of this side's writes into it
        (nor reads it was offered) is in flight."""
        for p in self._peers.values():
            if p.pause_epoch is None:
                continue
            if any(req.handles for req in self.requests.active.values() if req.peer == p.name):
                continue  # writes into that decode still in flight: ack once drained
            self.tell(p.name, encode("PAUSE_ACK", epoch=p.pause_epoch))
            p.pause_epoch = None

    def _on_boot(self, msg: Boot, peer: str) -> None:
        req = self._bound(msg, peer)
        if req is None:
            fin = self.requests.finished[msg.rid]
            if fin.status != OK:
                # Ended here, nothing in flight: say so (again), or the decode holds the
                # pages it booted with until its own timeout (a replayed REQ, a BOOT that
                # crossed our ABORT: then this second ABORT is ignored there).
                self.tell(peer, encode("ABORT", rid=msg.rid, status=fin.status, reason=fin.message))
            return
        if msg.room != req.room:
            raise ProtocolError(f"BOOT for request {req.rid}: room {msg.room} != {req.room}")
        if req.state is not PrefillState.BOOTSTRAPPING:
            raise ProtocolError(
                f"BOOT for request {req.rid} in state {req.state.poll.name} ({req.state.name})"
            )
        p = self._peers[peer]
        if p.paused:
            p.held_boots[req.rid] = msg
            return
        try:
            remote = self.engine.remote(peer, "landing")
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
            self.tell(peer, encode("REQ", rid=req.rid, room=req.room, tokens=req.tokens))
            return
        need = kvmem.packed_nbytes(self.spec, -(-req.tokens // self.spec.page_size)) + AUX_BYTES
        landing_map = RegionMap(remote.regions)
        if msg.nbytes < need or msg.off + msg.nbytes > landing_map.size:
            raise ProtocolError(
                f"BOOT for request {req.rid}: landing region [{msg.off}, "
                f"+{msg.nbytes}) does not hold {need} bytes within "
                f"{landing_map.size}"
            )
        n_pages = -(-req.tokens // self.spec.page_size)
        dpages = np.array(decode_runs(msg.pages, n_pages), dtype=np.int64)
        if dpages.size != n_pages:
            raise ProtocolError(
                f"BOOT for request {req.rid}: {dpages.size} decode pages for its {n_pages} pages"
            )
        try:
            kv = self.engine.remote(peer, "kv")
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
        self.requests.set_state(req, PrefillState.WAITING_FOR_INPUT)
        req.t_bootstrapped = self.clock()
        self.admit(req.rid)

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
