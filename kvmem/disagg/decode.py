"""The decode side of PD disaggregation: receives exactly the bytes that were sent and
never frees a page a write may still land in.

A request's states (:class:`~kvmem.disagg.states.DecodeState`) and every edge between
them.  This drawing is the table the code checks at each change
(:data:`~kvmem.disagg.states.DECODE_EDGES`; tests/disagg/test_states.py compares the
two)::

    new          --REQ from the prefill-------------------------------------> WAITING
    new          --REQ, its BOOT withheld (DecodeFaults.withhold_boot)------> WITHHELD
    WAITING      --pages and a landing region allocated---------------------> BOOTING
    BOOTING      --their ids on the host: BOOT sent-------------------------> BOOTED
    WAITING      --abort here, or own timeout: ABORT_REQ sent---------------> QUARANTINED
    WITHHELD     --abort here, or own timeout: ABORT_REQ sent---------------> QUARANTINED
    BOOTING      --abort here, or own timeout: ABORT_REQ sent---------------> QUARANTINED
    BOOTED       --abort here, or own timeout: ABORT_REQ sent---------------> QUARANTINED
    WAITING      --ABORT from the prefill: forget---------------------------> FREED
    WITHHELD     --ABORT from the prefill: forget---------------------------> FREED
    BOOTING      --ABORT from the prefill, or this side's pause-------------> FREED
    BOOTED       --AUX (200), ABORT from the prefill, or this side's pause--> FREED
    QUARANTINED  --the prefill's ABORT, quarantine_timeout, or the pause----> FREED

* WAITING: no memory for it yet, retried each step (not while this side pauses).
* BOOTED: ``CHUNK``s land and are verified on arrival, then unpacked; the ``AUX`` is
  verified and completes it (its pages freed, 200).  An ``ABORT`` from the prefill means it
  has no write of the request in flight: free now.
* QUARANTINED: pages and landing region held, since a posted write may still land; the
  chunks that land are still verified (not unpacked).  Freed on the prefill's ``ABORT``
  (its acknowledgement: every write DONE/ERR), or after ``quarantine_timeout`` if it
  vanished.
* FREED: its pages and landing region are given back once the device work on them is
  done (below); the request is over (:attr:`DecodeSide.completed`).
* A request changes state only through the side's request tables
  (:class:`~kvmem.disagg.decode_request.DecodeRequests`: ``add``, ``set_state``,
  ``finish``; the side and its parts call them), which refuse an edge not drawn
  here (:class:`~kvmem.disagg.states.IllegalTransition`, a bug); a peer's message that
  does not fit the state is a ProtocolError before anything changes.  What else a
  request carries, and why it is not part of the state: :class:`DecodeRequest`.

Booting: the BOOT carries the request's page ids, which the allocator hands out on the
pool's device; the request is BOOTING until their copy to the host is done (at once on
the CPU, a step or so later on CUDA: :class:`~kvmem.disagg.device.HostCopy`, polled, never
waited on), then the BOOT goes out.  Booting, and the memory given back in device order:
:mod:`kvmem.disagg.decode_memory`; pause and
resume: :mod:`kvmem.disagg.decode_pause`.  What lands (``CHUNK``, packed into the landing
region or direct into the pool pages; ``AUX``; this side's reads of ``READY`` offers in
pull mode, answered ``PULLED``) and how it is checked: :mod:`kvmem.disagg.decode_receive`.

Every peer message is validated by :func:`kvmem.disagg.protocol.parse` first (types,
ranges, statuses); the handlers here then check what depends on state (request known,
page range within the request, size equal to the packed size, offset where that chunk
belongs, a PAUSE_ACK for this pause's epoch); a bad message raises
:class:`ProtocolError`, is counted and changes nothing.

Several prefill peers (``prefill_peers``): each request belongs to the prefill whose
``REQ`` created it, and messages about it from any other prefill are refused; request
ids and bootstrap rooms are unique across the prefills (a ``REQ`` whose id or room is
held by another prefill's request is refused).  A pause tells every prefill
(``PAUSING``) and completes once each has acknowledged (``PAUSE_ACK``), or could not be
told at all (it is gone: none of its writes can land); ``META`` goes to every prefill.
The prepared block list of each prefill's pool (pull) and the counters
(``metrics.peers``) are kept per prefill.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING


from kvmem.disagg.arena import Arena
from kvmem.disagg.counters import Metrics, now
from kvmem.disagg.device import Event, device_event
from kvmem.disagg.ledger import Ledger
from kvmem.disagg.outcome import (
    CLIENT_CLOSED,
    DEFAULT_TIMEOUT,
    GATEWAY_TIMEOUT,
    OK,
    ProtocolError,
    Reason,
    check_caller_args,
)
from kvmem.disagg.peers import peer_names
from kvmem.disagg.decode_context import DecodeConfig, DecodeContext
from kvmem.disagg.decode_memory import DecodeMemory
from kvmem.disagg.decode_pause import DecodePause
from kvmem.disagg.decode_peers import DecodePeers
from kvmem.disagg.decode_receive import DecodeReceiving
from kvmem.disagg.decode_request import DecodeRequest, DecodeRequests
from kvmem.disagg.protocol import (
    Abort,
    Aux,
    Chunk,
    Inbox,
    Meta,
    PauseAck,
    Ready,
    Req,
    apply_metadata,
    encode,
)
from kvmem.disagg.dispatch import Handlers, Message, Route
from kvmem.disagg.states import DecodeState, PausePhase
from kvmem.disagg.model import Verifier, prepare_model

if TYPE_CHECKING:
    from kvmem.allocator import PageAllocator
    from kvmem.pool import KVPool
    from kvmem.transfer.engine import TransferEngine

log = logging.getLogger("kvmem.disagg.decode")


class DecodeFaults:
    """Fault-injection points of the decode side (defaults inject nothing)."""

    def withhold_boot(self, rid: int) -> bool:
        """True: never answer this request's REQ (the prefill's bootstrap times out)."""
        return False


class DecodeSide:
    """One decode worker: a pool, its allocator, a landing buffer, a transfer engine, one
    or several prefill peers (``prefill_peer``: one agent name; or ``prefill_peers``).
    The side takes the prefills' requests and aborts, holds the dispatch table of their
    messages (:attr:`handlers`) and runs each step.  What its parts share it makes first
    and puts in their context (:attr:`ctx`, a
    :class:`~kvmem.disagg.decode_context.DecodeContext`): the ledger, the counters
    (:attr:`metrics`), the request tables (:attr:`requests`, a
    :class:`~kvmem.disagg.decode_request.DecodeRequests`), the prefill peers
    (:attr:`peers`, a :class:`~kvmem.disagg.decode_peers.DecodePeers`) and the settings.
    The rest is done by the parts, each owning its fields and handed the context and the
    parts built before it: :attr:`memory` (:class:`~kvmem.disagg.decode_memory.DecodeMemory`:
    the landing buffer, booting, freeing in device order), :attr:`receiving`
    (:class:`~kvmem.disagg.decode_receive.DecodeReceiving`: what lands and its checks)
    and :attr:`pause` (:class:`~kvmem.disagg.decode_pause.DecodePause`), built in that
    order."""

    def __init__(
        self,
        pool: KVPool,
        allocator: PageAllocator,
        engine: TransferEngine,
        verifier: Verifier,
        *,
        prefill_peer: str | None = None,
        prefill_peers: Sequence[str] | None = None,
        landing_bytes: int,
        timeout: float = DEFAULT_TIMEOUT,
        quarantine_timeout: float | None = None,
        clock: Callable[[], float] = now,
        faults: DecodeFaults | None = None,
        transfer_mode: str = "push",
        done_event: Callable[[], Event] | None = None,
    ):
        """``verifier``: what the landed KV is checked against
        (:class:`~kvmem.disagg.model.Verifier`).

        ``done_event``: ``() -> Event`` (``query()``), called after the device work of
        each landed chunk, AUX or read (checks, unpack); a request's pages and landing
        region are reused only once its last one says True.  Default
        :func:`~kvmem.disagg.device.device_event` of the pool's device (always True on
        the CPU, where that work is done when it returns)."""
        if transfer_mode not in ("push", "pull"):
            raise ValueError(f"transfer_mode must be 'push' or 'pull', got {transfer_mode!r}")
        self.pool, self.alloc, self.engine, self.verifier = pool, allocator, engine, verifier
        self.spec, self.clock = pool.spec, clock
        names = peer_names("prefill", prefill_peer, prefill_peers)
        self.faults = faults or DecodeFaults()
        prepare_model(verifier, Verifier, pool.device, "DecodeSide")  # its set-up on our device
        self.ledger = Ledger(allocator)
        self.metrics = Metrics("decode")
        self.requests = DecodeRequests(self.metrics)
        self.peers = DecodePeers(engine, names, self.metrics)
        self.ctx = DecodeContext(
            spec=self.spec,
            pool=pool,
            alloc=allocator,
            engine=engine,
            ledger=self.ledger,
            metrics=self.metrics,
            clock=clock,
            verifier=verifier,
            done_event=done_event or device_event(pool.device),
            requests=self.requests,
            peers=self.peers,
            config=DecodeConfig(
                transfer_mode=transfer_mode,  # pull: this side reads the offered pages
                timeout=timeout,
                quarantine_timeout=timeout if quarantine_timeout is None else quarantine_timeout,
            ),
        )
        # the parts, each handed the context and the parts built before it (never a later
        # one): the memory, the receiving, the pause
        self.memory = DecodeMemory(self.ctx, landing_bytes)
        self.receiving = DecodeReceiving(self.ctx, self.memory)
        self.pause = DecodePause(self.ctx, self.memory, self.receiving)
        # the one dispatch table: what a prefill sends (protocol.DECODE_RECEIVES)
        self.handlers = Handlers(
            "decode",
            "prefill",
            names,
            (
                Route(Req, self._on_req),
                Route(Chunk, self.receiving.on_chunk),
                Route(Aux, self.receiving.on_aux),
                Route(Abort, self._on_abort),
                Route(PauseAck, self.pause.on_ack),
                Route(Meta, self._on_meta),
                Route(Ready, self.receiving.on_ready),
            ),
        )
        self.inbox = Inbox(
            engine,
            peers=names,
            receiver="decode",
            handle=self.handle_message,
            metrics=self.metrics,
            log=log,
        )
        self.memory.register()
        self.receiving.prep_local()

    # --- what a caller reads or asks of the parts (docs/disagg.md, the demo), each over
    # the one that owns it; the rest is reached on the part itself ------------------------
    @property
    def arena(self) -> Arena:
        """The regions of the landing buffer (:attr:`memory`')."""
        return self.memory.arena

    def prefault(self) -> None:
        """Back the pool and the landing buffer with memory now, not at first touch."""
        self.memory.prefault()

    @property
    def chunk_modes(self) -> Counter:
        """What landed, by how: ``"packed"``, ``"direct"``, ``"pulled"`` (:attr:`receiving`')."""
        return self.receiving.chunk_modes

    @property
    def pausing(self) -> bool:
        """A pause began and its memory is not released yet (:attr:`pause`')."""
        return self.pause.pausing

    @property
    def paused(self) -> bool:
        """The memory is released; :meth:`resume` serves again (:attr:`pause`')."""
        return self.pause.paused

    def begin_pause(self) -> None:
        """Tell every prefill (``PAUSING``); ``step`` completes the pause once each has
        acknowledged.  :attr:`paused` is True once the memory is released."""
        self.pause.begin()

    def resume(self) -> None:
        """Serve again after a pause: the memory back, registered, published (``META``)."""
        self.pause.resume()

    # --- one iteration -----------------------------------------------------------------------
    def step(self) -> bool:
        """One iteration.  True when it made progress: a message was handled, one of this
        side's reads ended, a waiting request was booted, a request timed out or left the
        quarantine, or the pause completed.  False: nothing changed, what is left waits
        for the prefill or the clock, and the caller may back off
        (:class:`~kvmem.disagg.pacing.Backoff`)."""
        busy = self.inbox.drain() > 0
        busy = self.receiving.apply_checks() or busy
        busy = self.memory.drain_device() or busy
        if self.pause.phase is PausePhase.FREEING and not self.memory.draining:
            self.pause.complete()
            busy = True
        if self.ctx.config.transfer_mode == "pull":
            busy = self.receiving.poll_reads() or busy
            if self.pause.phase is PausePhase.READS and not self.reads_in_flight:
                self.pause.finish()
                busy = True
        if self.pause.phase is PausePhase.SERVING:
            for req in list(self.requests.active.values()):
                if req.state is DecodeState.WAITING:
                    busy = self.memory.boot(req) or busy
                elif req.state is DecodeState.BOOTING:
                    busy = self.memory.send_boot(req) or busy
        return self._check_timeouts() or busy

    def handle_message(self, msg: Message, peer: str | None = None) -> None:
        """Apply one validated message (:func:`kvmem.disagg.protocol.parse`) from prefill
        peer ``peer`` (may be left out when the side has one) with its handler of
        :attr:`handlers`; ProtocolError, before anything changed, when it does not fit
        the state here."""
        self.handlers(msg, self.peers.sole if peer is None else peer)

    def _on_meta(self, msg: Meta, peer: str) -> None:
        apply_metadata(self.engine, msg)

    # --- requests ------------------------------------------------------------------------------
    def _on_req(self, msg: Req, peer: str) -> None:
        rid, room, tokens = msg.rid, msg.room, msg.tokens
        if self.requests.find(rid) is not None:
            raise ProtocolError(f"REQ: request id {rid} is in use")
        done = self.requests.finished.get(rid)
        if done is not None and done.status == OK:
            # A replay: its KV was delivered.  (A request that ended otherwise may be asked
            # for again: the prefill re-sends REQ when this side paused under its BOOT.)
            raise ProtocolError(f"REQ for request {rid}: delivered already")
        holder = self.requests.room_holder(room)
        if holder is not None:
            raise ProtocolError(
                f"REQ for request {rid}: bootstrap room {room} is in use by request {holder}"
            )
        if tokens <= 0 or tokens > self.verifier.max_tokens:
            raise ProtocolError(
                f"REQ for request {rid}: {tokens} tokens outside [1, {self.verifier.max_tokens}]"
            )
        req = DecodeRequest(rid, room, tokens, peer, t_seen=self.ctx.clock())
        withheld = self.faults.withhold_boot(rid)
        self.requests.add(req, DecodeState.WITHHELD if withheld else DecodeState.WAITING)
        if req.state is DecodeState.WAITING and self.pause.phase is PausePhase.SERVING:
            self.memory.boot(req)

    def _on_abort(self, msg: Abort, peer: str) -> None:
        """The prefill ended the request and has no write of it in flight.  Status 200 only
        answers this side's ABORT_REQ (the prefill had delivered it already)."""
        req = self.requests.find(msg.rid)
        if req is None:
            if msg.rid in self.requests.finished:
                return  # both sides finished it already
            raise ProtocolError(f"ABORT for unknown request {msg.rid}")
        if req.peer != peer:
            raise ProtocolError(
                f"ABORT for request {msg.rid} from {peer!r}: the request is {req.peer!r}'s"
            )
        if msg.status == OK and req.state is not DecodeState.QUARANTINED:
            raise ProtocolError(
                f"ABORT for request {req.rid} with status 200: this side did "
                "not ask for it (200 only answers an ABORT_REQ)"
            )
        reason = req.reason or Reason(msg.status, msg.reason)
        if req.reads:  # (the prefill gave up waiting for our PULLED) our read targets the
            req.free_after_reads = (f"abort:{msg.status}", reason)  # pages: after it ends
            return
        self.memory.free(req, f"abort:{msg.status}", reason)

    def abort(self, rid: int, status: int = CLIENT_CLOSED, message: str | None = None) -> None:
        """A decode-side abort: the prefill is asked to stop (``ABORT_REQ``); the pages stay
        quarantined until it answers that no write of the request is in flight.
        ``status``: 499, 500, 503 or 504; anything else is a ValueError naming it, and
        nothing changes."""
        check_caller_args("abort", rid, status, message)
        req = self.requests.find(rid)
        if req is None:
            if rid in self.requests.finished:
                return
            raise ProtocolError(f"abort: unknown request id {rid!r}")
        if req.state is DecodeState.QUARANTINED:
            return
        req.reason = Reason(status, message or f"request {rid} aborted on the decode side")
        self.peers.tell(
            req.peer, encode("ABORT_REQ", rid=rid, status=status, reason=req.reason.message)
        )
        self.requests.set_state(req, DecodeState.QUARANTINED)
        req.t_quarantined = self.ctx.clock()
        self.ledger.quarantine(rid)

    def _check_timeouts(self) -> bool:
        """Abort the requests without news for ``timeout`` (504, quarantined), free the
        quarantined ones without an answer for ``quarantine_timeout``; True when either
        happened."""
        t, moved = self.ctx.clock(), False
        timeout, quarantine_s = self.ctx.config.timeout, self.ctx.config.quarantine_timeout
        for req in list(self.requests.active.values()):
            if req.state is DecodeState.QUARANTINED:
                if req.reads:
                    continue  # our own read still targets its pages: wait for DONE/ERR
                # both set on entering QUARANTINED
                assert req.t_quarantined is not None and req.reason is not None
                if t - req.t_quarantined > quarantine_s:
                    moved = True
                    log.error(
                        "decode: request %d: no answer from the prefill for %.1f s after "
                        "its abort; freeing its quarantined pages",
                        req.rid,
                        quarantine_s,
                    )
                    self.memory.free(req, "quarantine-expired", req.reason)
            elif t - req.t_seen > timeout:
                moved = True
                self.abort(
                    req.rid,
                    GATEWAY_TIMEOUT,
                    (
                        f"decode timeout (> {timeout:g} s without news from the prefill) "
                        f"for request {req.rid} (room {req.room})"
                    ),
                )
        return moved

    @property
    def reqs(self) -> Mapping[int, DecodeRequest]:
        """The active requests by id (read-only, live: the request tables')."""
        return self.requests.active

    @property
    def completed(self) -> Mapping[int, Reason]:
        """How each finished (FREED) request ended, by id (read-only, live)."""
        return self.requests.finished

    @property
    def idle(self) -> bool:
        """No request, no verdict on its way to the host, no memory waiting for device work."""
        return not self.requests.active and not self.receiving.checks and not self.memory.draining

    @property
    def reads_in_flight(self) -> bool:
        """Pull: True while a read this side posted is not seen DONE or ERR yet; it
        completes only when this side polls it, so a loop should not nap then."""
        return any(req.reads for req in self.requests.active.values())

    def audit(self) -> dict:
        return self.ledger.audit()

    def close(self) -> None:
        """Cancel this side's own reads (pull), deregister what it registered (the engine
        stays the caller's)."""
        for req in self.requests.active.values():
            for r in req.reads:
                self.engine.release(r.handle, abort=True)
            req.reads = []
        for key in ("kv", "landing"):
            if key in self.engine.registrations():
                self.engine.deregister(key)
