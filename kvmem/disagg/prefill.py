"""The prefill side of PD disaggregation: every request's pages freed exactly once.

A request's states (:class:`~kvmem.disagg.states.PrefillState`) and every edge between
them.  This drawing is the table the code checks at each change
(:data:`~kvmem.disagg.states.PREFILL_EDGES`; tests/disagg/test_states.py compares the
two)::

    new                --add_request: REQ to the decode--------------------> BOOTSTRAPPING
    BOOTSTRAPPING      --the decode's BOOT accepted------------------------> WAITING_FOR_INPUT
    WAITING_FOR_INPUT  --a chunk posted (pull: offered), not the last------> TRANSFERRING
    TRANSFERRING       --a chunk posted (pull: offered), not the last------> TRANSFERRING
    WAITING_FOR_INPUT  --its last chunk posted (pull: offered)-------------> KV_POSTED
    TRANSFERRING       --its last chunk posted (pull: offered)-------------> KV_POSTED
    KV_POSTED          --every transfer DONE: the AUX copied to staging----> AUX_STAGED
    AUX_STAGED         --that copy done: the AUX write posted--------------> AUX_POSTED
    AUX_POSTED         --the AUX write DONE--------------------------------> SUCCEEDED
    BOOTSTRAPPING      --abort, bootstrap timeout 504, pause 503-----------> ENDING
    WAITING_FOR_INPUT  --abort, transfer timeout 504, 503, 500-------------> ENDING
    TRANSFERRING       --abort, transfer timeout 504, 503, 500-------------> ENDING
    KV_POSTED          --abort, transfer timeout 504, 503, 500-------------> ENDING
    AUX_STAGED         --abort, transfer timeout 504, 503, 500-------------> ENDING
    AUX_POSTED         --abort, transfer timeout 504, 503, 500-------------> ENDING
    ENDING             --no transfer in flight: ABORT to the decode--------> FAILED

* sglang's KVPoll (:meth:`PrefillSide.state`): BOOTSTRAPPING is Bootstrapping,
  WAITING_FOR_INPUT is WaitingForInput, TRANSFERRING to AUX_POSTED are Transferring,
  SUCCEEDED is Success, ENDING and FAILED are Failed (outcome: aborted 499/503, timed_out
  504, failed 500).
* Ending early (ENDING): prefill pages freed now (or once the transfer reading them, a
  direct write or an offered read, is DONE or ERR), posted writes drain to DONE/ERR, then
  ``ABORT(reason)`` to the decode, which is also its acknowledgement.  503: a pause of this
  side, or the request's decode pausing (``PAUSING``: WAITING_FOR_INPUT on) or its memory
  moving on under a post (StaleEpochError); 500: a write refused at post or ERR when polled
  (any chunk, the AUX included), an offered read the decode failed or never answered; 504:
  the bootstrap timeout (BOOTSTRAPPING) or the transfer timeout (after the BOOT).  How a
  request ends, early or done: :mod:`kvmem.disagg.prefill_ending`.
* A request changes state only through the side's request tables
  (:class:`~kvmem.disagg.prefill_request.PrefillRequests`: ``add``, ``set_state``,
  ``finish``; the side and its parts call them), which refuse an edge not drawn
  here (:class:`~kvmem.disagg.states.IllegalTransition`, a bug); a peer's message that
  does not fit the state is a ProtocolError before anything changes.  What else a
  request carries, and why it is not part of the state:
  :class:`~kvmem.disagg.prefill_request.PrefillRequest`.
* "in the running batch": ``step`` allocates a chunk's pages, runs the forward (here:
  the model's ``fill``, :class:`~kvmem.disagg.model.Forward`), then :meth:`fill_batch`.  An
  abort arriving meanwhile is recorded and consumed first thing in ``fill_batch`` of the
  same step: pages freed, the chunk never packed, no KV exposed.
* Pages: allocated per chunk (``alloc_extend``, sglang semantics), held in the ledger under
  the request id, freed once: when the last chunk is packed (the packed copy is what is
  sent) or when the request ends early.  The packed copies live in the registered
  staging buffer until their write is DONE or ERR.
* Sending, from staging to posting to polling: direct chunks, pull offers, the order of
  pack and post on the device, physical chunks (:mod:`kvmem.disagg.prefill_send`; direct
  writes: :mod:`kvmem.disagg.prefill_direct`).
* Several decode peers (:mod:`kvmem.disagg.prefill_peers`), and the messages they send
  (:mod:`kvmem.disagg.prefill_messages`).
* The decode side is told of every early end by ``ABORT`` once no write (or offered read)
  of the request is in flight: that message is also its acknowledgement that it may free
  (un-quarantine) the request's decode pages.
* Pause (:meth:`begin_pause`) and resume of this side: :mod:`kvmem.disagg.prefill_pause`;
  a decode's pause (``PAUSING``, ``PAUSE_ACK``, its ``META``):
  :mod:`kvmem.disagg.prefill_messages`.
* No host sync in ``step`` on CUDA: :mod:`kvmem.disagg.prefill_schedule`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvmem.disagg.arena import Arena
from kvmem.disagg.counters import Metrics, now
from kvmem.disagg.device import Event, device_event
from kvmem.disagg.ledger import Ledger
from kvmem.disagg.outcome import (
    CLIENT_CLOSED,
    DEFAULT_TIMEOUT,
    OK,
    KVPoll,
    ProtocolError,
    Reason,
    check_id,
)
from kvmem.disagg.peers import peer_names
from kvmem.disagg.model import Forward, prepare_model
from kvmem.disagg.prefill_context import PrefillConfig, PrefillContext
from kvmem.disagg.prefill_messages import PrefillMessages
from kvmem.disagg.prefill_peers import PrefillPeers
from kvmem.disagg.prefill_request import Faults, PendingChunk, PrefillRequest, PrefillRequests
from kvmem.disagg.prefill_schedule import PrefillScheduler
from kvmem.disagg.prefill_ending import PrefillEnding
from kvmem.disagg.prefill_pause import PrefillPause
from kvmem.disagg.prefill_send import PrefillSending
from kvmem.disagg.prefill_staging import Staging
from kvmem.disagg.states import PausePhase, PrefillState
from kvmem.disagg.protocol import Inbox, encode

if TYPE_CHECKING:
    from kvmem.allocator import PageAllocator
    from kvmem.pool import KVPool
    from kvmem.transfer.engine import TransferEngine

log = logging.getLogger("kvmem.disagg.prefill")  # the side's logger (docs/logging.md)

# ``() -> object with query()``, called right after each pack into staging: on CUDA a
# ``torch.cuda.Event`` recorded on the pool device's current stream (where pack ran); on
# the CPU an object that is always ready (kvmem.disagg.device.device_event).
default_ready_event = device_event


class PrefillSide:
    """One prefill worker: a pool, its allocator, a transfer engine, one or several decode
    peers (``decode_peer``: one agent name; or ``decode_peers``: several, each request
    bound to one of them by :meth:`add_request`); ``model`` writes each chunk's KV
    (:class:`~kvmem.disagg.model.Forward`).  The side takes requests and runs each step.
    What its parts share it makes first and puts in their context (:attr:`ctx`, a
    :class:`~kvmem.disagg.prefill_context.PrefillContext`): the ledger, the counters
    (:attr:`metrics`), the request tables (:attr:`requests`, a
    :class:`~kvmem.disagg.prefill_request.PrefillRequests`), the decode peers' records
    (:attr:`peers`, a :class:`~kvmem.disagg.prefill_peers.PrefillPeers`), the staging
    buffer (:attr:`staging`, a :class:`~kvmem.disagg.prefill_staging.Staging`) and the
    settings.  The rest is done by the parts, each owning its fields and handed the
    context and the parts built before it: :attr:`scheduler`
    (:class:`~kvmem.disagg.prefill_schedule.PrefillScheduler`), :attr:`ending`
    (:class:`~kvmem.disagg.prefill_ending.PrefillEnding`), :attr:`sending`
    (:class:`~kvmem.disagg.prefill_send.PrefillSending`; direct writes: its ``direct``),
    :attr:`messages` (:class:`~kvmem.disagg.prefill_messages.PrefillMessages`) and
    :attr:`pause` (:class:`~kvmem.disagg.prefill_pause.PrefillPause`), built in that
    order."""

    def __init__(
        self,
        pool: KVPool,
        allocator: PageAllocator,
        engine: TransferEngine,
        model: Forward,
        *,
        decode_peer: str | None = None,
        decode_peers: Sequence[str] | None = None,
        chunk_tokens: int = 256,
        max_batch_tokens: int = 2048,
        staging_bytes: int | None = None,
        bootstrap_timeout: float = DEFAULT_TIMEOUT,
        transfer_timeout: float = DEFAULT_TIMEOUT,
        clock: Callable[[], float] = now,
        faults: Faults | None = None,
        on_finish: Callable[[int, Reason], object] | None = None,
        ready_event: Callable[[], Event] | None = None,
        direct_threshold: int | None = None,
        transfer_mode: str = "push",
        quarantine_timeout: float | None = None,
    ):
        spec = pool.spec
        if chunk_tokens <= 0 or chunk_tokens % spec.page_size:
            raise ValueError(
                f"chunk_tokens must be a positive multiple of page_size "
                f"{spec.page_size}, got {chunk_tokens}"
            )
        if transfer_mode not in ("push", "pull"):
            raise ValueError(f"transfer_mode must be 'push' or 'pull', got {transfer_mode!r}")
        self.pool, self.alloc, self.engine, self.model = pool, allocator, engine, model
        self.spec, self.clock = spec, clock
        names = peer_names("decode", decode_peer, decode_peers)
        self._faults = faults or Faults()
        prepare_model(model, Forward, pool.device, "PrefillSide")  # its set-up on our device
        self.ledger = Ledger(allocator)
        self.metrics = Metrics("prefill")
        self.requests = PrefillRequests(self.metrics, on_finish)
        self.peers = PrefillPeers(engine, names, self.metrics)
        self.staging = Staging(pool, engine, chunk_tokens, staging_bytes)  # registers it
        self.ctx = PrefillContext(
            spec=spec,
            pool=pool,
            alloc=allocator,
            engine=engine,
            ledger=self.ledger,
            metrics=self.metrics,
            clock=clock,
            faults=lambda: self._faults,
            ready_event=ready_event or device_event(pool.device),
            requests=self.requests,
            peers=self.peers,
            staging=self.staging,
            config=PrefillConfig(
                # push: this side writes each chunk (packed or direct); pull: it offers
                # the pages (READY) and the decode reads them; the AUX is written in both
                transfer_mode=transfer_mode,
                chunk_tokens=chunk_tokens,
                max_batch_tokens=max_batch_tokens,
                bootstrap_timeout=bootstrap_timeout,
                transfer_timeout=transfer_timeout,
                quarantine_timeout=(
                    transfer_timeout if quarantine_timeout is None else quarantine_timeout
                ),
            ),
        )
        # the parts, each handed the context and the parts built before it (never a later
        # one): the scheduler, the ending (every later part ends requests through it), the
        # sending, the decodes' messages, the pause
        self.scheduler = PrefillScheduler(self.ctx)
        self.ending = PrefillEnding(self.ctx, self.scheduler)
        self.sending = PrefillSending(self.ctx, self.scheduler, self.ending, direct_threshold)
        engine.register_pool(pool, "kv")
        self.sending.direct.prep_local()
        self.messages = PrefillMessages(self.ctx, self.scheduler, self.ending, self.sending)
        self.pause = PrefillPause(self.ctx, self.ending, self.sending.direct)

    @property
    def faults(self) -> Faults:
        """The fault-injection hooks; the parts call the ones set now (``ctx.faults()``)."""
        return self._faults

    @faults.setter
    def faults(self, faults: Faults) -> None:
        self._faults = faults

    # --- what a caller reads or asks of the parts (docs/disagg.md, docs/logging.md, the
    # demo), each over the one that owns it; the rest is reached on the part itself ------
    @property
    def inbox(self) -> Inbox:
        """The inbox of the decodes' messages (:attr:`messages`'): ``inbox.refused``."""
        return self.messages.inbox

    def peer_is_paused(self, peer: str) -> bool:
        """Whether decode peer ``peer`` is paused (a router sends new requests elsewhere);
        ValueError when it is not one (:attr:`peers`')."""
        return self.peers.is_paused(peer)

    def requests_of(self, peer: str) -> int:
        """Active requests bound to decode peer ``peer`` (ValueError when it is not one)."""
        self.peers.get(peer)
        return sum(1 for r in self.requests.active.values() if r.peer == peer)

    def peer_gone(self, peer: str) -> int:
        """Decode ``peer`` is dead: its requests end now (500), their transfers given up;
        how many ended (:meth:`~kvmem.disagg.prefill_messages.PrefillMessages.peer_gone`)."""
        return self.messages.peer_gone(peer)

    @property
    def arena(self) -> Arena:
        """The slots of the staging buffer (:attr:`staging`')."""
        return self.staging.arena

    @property
    def chunk_modes(self) -> Counter:
        """Chunks posted, by how: ``"packed"``, ``"direct"``, ``"pulled"`` (:attr:`sending`')."""
        return self.sending.chunk_modes

    def set_direct_threshold(self, threshold: int | None) -> None:
        """Chunks averaging at least ``threshold`` bytes per descriptor go direct from now on
        (None: all packed); e.g. :func:`kvmem.disagg.calibrate.calibrate_direct`'s."""
        self.sending.direct.set_threshold(threshold, prep=not self.paused)

    @property
    def bootstrap_timeout(self) -> float:
        """Seconds a request may wait for its BOOT (the settings')."""
        return self.ctx.config.bootstrap_timeout

    @property
    def transfer_timeout(self) -> float:
        """Seconds from its BOOT a request may take to transfer (the settings')."""
        return self.ctx.config.transfer_timeout

    @property
    def pausing(self) -> bool:
        """A pause began and its memory is not released yet (:attr:`pause`')."""
        return self.pause.pausing

    @property
    def paused(self) -> bool:
        """The memory is released; :meth:`resume` serves again (:attr:`pause`')."""
        return self.pause.paused

    def begin_pause(self) -> None:
        """Stop posting; ``step`` then drains, aborts (503), resets, deregisters and
        releases.  :attr:`paused` is True once the memory is released."""
        self.pause.begin()

    def resume(self) -> None:
        """Serve again after a pause: the memory back, registered, published (``META``)."""
        self.pause.resume()

    # --- the caller's API ------------------------------------------------------------------
    def add_request(
        self, rid: int, tokens: int, room: int | None = None, peer: str | None = None
    ) -> None:
        """A new request of ``tokens`` prompt tokens, bound to decode peer ``peer`` (may be
        left out when the side has one); tells that decode (``REQ``).  ValueError for a bad
        value (named), ProtocolError for an id or room in use; nothing changed either
        way.  Request ids and rooms must be unique among the prefills a decode serves (as
        sglang's bootstrap rooms are): a decode refuses a REQ whose id or room another
        prefill's request holds."""
        check_id("add_request", "rid", rid)
        peer = self.peers.bind(rid, peer)
        room = rid if room is None else room
        check_id("add_request", f"request {rid}: room", room)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
            raise ValueError(
                f"add_request: request {rid}: tokens must be an int > 0, got {tokens!r}"
            )
        if tokens > self.model.max_tokens:
            raise ValueError(
                f"add_request: request {rid}: {tokens} tokens > the "
                f"{self.model.max_tokens}-token maximum"
            )
        if self.requests.find(rid) is not None or rid in self.requests.finished:
            raise ProtocolError(f"add_request: request id {rid} is in use")
        if self.requests.room_holder(room) is not None:
            raise ProtocolError(f"add_request: request {rid}: bootstrap room {room} is in use")
        req = PrefillRequest(
            rid,
            room,
            tokens,
            peer,
            t_created=self.clock(),
            host_pages=np.zeros(-(-tokens // self.spec.page_size), np.int64),
        )
        self.requests.add(req, PrefillState.BOOTSTRAPPING)
        self.ledger.hold(rid, torch.empty(0, dtype=torch.int64, device=self.alloc.device))
        self.peers.tell(peer, encode("REQ", rid=rid, room=room, tokens=tokens))

    def abort(self, rid: int, status: int = CLIENT_CLOSED, message: str | None = None) -> None:
        """Abort ``rid`` from any state; aborting a finished request does nothing.
        ``status``: an early end of the lifecycle table (499, 500, 503, 504); anything else
        is a ValueError naming it, and nothing changes (the ending part's
        :meth:`~kvmem.disagg.prefill_ending.PrefillEnding.abort`)."""
        self.ending.abort(rid, status, message)

    def state(self, rid: int) -> KVPoll:
        """sglang's state of request ``rid`` (``PrefillState.poll`` while it is active);
        ProtocolError for an unknown id."""
        req = self.requests.find(rid)
        if req is not None:
            return req.state.poll
        fin = self.requests.finished.get(rid)
        if fin is not None:
            return KVPoll.Success if fin.status == OK else KVPoll.Failed
        raise ProtocolError(f"state: unknown request id {rid!r}")

    @property
    def reqs(self) -> Mapping[int, PrefillRequest]:
        """The active requests by id (read-only, live: the request tables')."""
        return self.requests.active

    @property
    def finished(self) -> Mapping[int, Reason]:
        """How each finished request ended, by id (read-only, live)."""
        return self.requests.finished

    @property
    def finished_peer(self) -> Mapping[int, str]:
        """The decode peer each finished request was bound to, by id (read-only, live)."""
        return self.requests.finished_peer

    @property
    def idle(self) -> bool:
        return not self.requests.active

    @property
    def writes_in_flight(self) -> bool:
        """True while a write this side posted is not seen DONE or ERR yet (a loop should
        not nap: :attr:`~kvmem.disagg.prefill_send.PrefillSending.writes_in_flight`)."""
        return self.sending.writes_in_flight

    # --- one scheduler iteration -------------------------------------------------------------
    def step(self) -> bool:
        """One iteration.  True when it made progress: a message from the decode was
        handled, a write (or an offered read) ended, a request ended or timed out, the
        pause completed, a chunk was staged or posted, or a batch ran its forward.  False:
        nothing changed; what is left waits for the peer, a posted write, free memory or
        the clock, and the caller may back off (:class:`~kvmem.disagg.pacing.Backoff`)."""
        moved = self.messages.handle_notifs()
        moved = self.sending.poll_writes() or moved
        self.messages.maybe_ack_pause()  # once no write into a pausing decode is in flight
        moved = self.ending.check_timeouts() or moved
        if self.pause.phase is PausePhase.DRAINING:
            return self.pause.advance() or moved
        if self.pause.phase is PausePhase.PAUSED:
            return moved
        moved = self.sending.flush_pending() or moved
        batch = self.scheduler.schedule()
        if batch:
            for req, *_ in batch:
                req.in_batch = True
            self._forward(batch)
            self.faults.during_forward(self, batch)
            self.fill_batch(batch)
            return True
        return moved

    def _forward(self, batch) -> None:
        """The model's forward pass: each chunk's KV into its pages."""
        for req, first, last in batch:
            self.model.fill(self.pool, req.rid, first, last, self.ledger.pages(req.rid)[first:last])

    def fill_batch(self, batch) -> None:
        """After the forward: for each request, consume a pending abort first (free its
        pages, tell the client and the decode side, expose no KV); else queue its finished
        chunk for packing and sending."""
        for req, first, last in batch:
            req.in_batch = False
            if req.abort_pending is not None:
                reason, req.abort_pending = req.abort_pending, None
                self.ending.end(req, reason)
                self.metrics.time_to_free.append(self.clock() - req.t_abort)
                continue
            req.pending.append(PendingChunk(first, last, req.done_tokens >= req.tokens))
        self.sending.flush_pending()

    # --- its memory ---------------------------------------------------------------------------
    def prefault(self) -> None:
        """Back the pool and the staging buffer with memory now, not at first touch."""
        self.pool.prefault()
        self.staging.mem.prefault()

    def close(self) -> None:
        """Deregister what this side registered (the engine stays the caller's)."""
        for key in ("kv", "staging"):
            if key in self.engine.registrations():
                self.engine.deregister(key)

    def audit(self) -> dict:
        return self.ledger.audit()
