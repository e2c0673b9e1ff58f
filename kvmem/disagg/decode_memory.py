"""The decode side's memory (:class:`DecodeMemory`, a base class of
:class:`~kvmem.disagg.decode.DecodeSide`; its methods use the side's fields): the pool
and the landing buffer registered and published, a finished request's pages and landing
region given back in device order, and the whole of it released in a pause and back at
resume.

Device order: the check of a landed chunk and its unpack run on the pool device's stream
(asynchronously on CUDA), and an event (``done_event``) is recorded after them.  A NIXL
write is not ordered with that stream, so a request that ends gives its pages and landing
region back only once its last event is done (owner ``("device-busy", rid)`` in the ledger
meanwhile, quarantined); until then a new BOOT cannot have them.  A check's verdict is a
device tensor that reaches the counters through a HostCopy.  So ``step`` makes no host
sync on CUDA; :attr:`idle` also waits for verdicts and memory still in flight.

Pause (:meth:`begin_pause`): tell the prefill (``PAUSING``); it drains its writes into
this side, aborts the requests bound here (503, ``ABORT`` each) and acknowledges
(``PAUSE_ACK``); then the allocator is reset, ``kv`` and ``landing`` are deregistered
(their tombstones published in ``META``) and the memory released.  Resume: memory back,
registered at the new epoch, ``META`` published: writes built from the older metadata
are refused by the prefill's engine before they are posted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmem.disagg.outcome import SERVICE_UNAVAILABLE, ProtocolError, Reason
from kvmem.disagg.decode_request import DecodeRequest
from kvmem.disagg.peers import buffer_map
from kvmem.disagg.protocol import PauseAck, encode, meta_message
from kvmem.disagg.states import DecodeState, PausePhase

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    import torch

    from kvmem.disagg.arena import Arena
    from kvmem.disagg.counters import Metrics
    from kvmem.disagg.ledger import Ledger

# the states that hold pages and a landing region (freed by this side's pause)
_HOLDING = frozenset({DecodeState.BOOTING, DecodeState.BOOTED, DecodeState.QUARANTINED})


@dataclass(frozen=True)
class _Drain:
    """Memory of an ended request that device work may still touch: the ledger's
    ``owner`` (released with reason ``why``) and the landing offset ``off`` (-1: none),
    given back once ``event`` is done (:meth:`DecodeMemory._drain_device`)."""

    event: Any  # a done event: query() -> bool
    owner: object
    why: str
    off: int


class DecodeMemory:
    """The memory methods of :class:`~kvmem.disagg.decode.DecodeSide` (not a side on its
    own: they read and change the side's requests, pool, landing buffer, ledger and
    engine)."""

    if TYPE_CHECKING:  # what DecodeSide (kvmem/disagg/decode.py) provides
        pool: Any
        alloc: Any
        engine: Any
        transfer_mode: str
        clock: Callable[[], float]
        ledger: Ledger
        metrics: Metrics
        arena: Arena
        landing: torch.Tensor
        _landing_mem: Any
        prefill_peers: tuple[str, ...]
        phase: PausePhase
        reqs: dict[int, Any]
        completed: dict[int, Any]
        _rooms: dict[int, int]
        _draining: list[_Drain]
        query: Any

        @property
        def pausing(self) -> bool: ...

        def _tell(self, peer: str, msg: bytes) -> bool: ...
        def _phase(self, to: PausePhase) -> None: ...
        def _transition(self, *args: Any, **kwargs: Any) -> Any: ...
        def _apply_checks(self) -> bool: ...

    def _register(self) -> None:
        # one region per physical chunk; the prefill's landing offsets (RegionMap of these
        # regions) are offsets into self.landing only when they tile it in order
        regions = self._landing_mem.regions()
        buffer_map(self.landing, regions)
        self.engine.register_pool(self.pool, "kv")
        self.engine.register("landing", regions, self.pool.epoch, self.pool.device)
        if self.transfer_mode == "pull":
            self._local_table = self.engine.prep_local("kv")

    def publish_metadata(self) -> None:
        """``META`` with this side's current metadata, to every prefill."""
        msg = meta_message(self.engine)
        for name in self.prefill_peers:
            self._tell(name, msg)

    def _on_pause_ack(self, msg: PauseAck, peer: str) -> None:
        """A prefill has no write into this side in flight: only an ack of *this* pause
        (its epoch) counts, once per prefill; when every prefill has answered the pages
        may be freed and the memory released."""
        if not self.pausing:
            raise ProtocolError(f"PAUSE_ACK epoch {msg.epoch}: this side is not pausing")
        if msg.epoch != self.pool.epoch:
            raise ProtocolError(
                f"PAUSE_ACK epoch {msg.epoch}: this pause is epoch {self.pool.epoch}"
            )
        if peer not in self._acks_due:
            raise ProtocolError(
                f"PAUSE_ACK epoch {msg.epoch} from {peer!r}: it answered this pause already"
            )
        self._acks_due.discard(peer)
        self._maybe_finish_pause()

    def _maybe_finish_pause(self) -> None:
        if self._acks_due or self.phase is not PausePhase.DRAINING:
            return
        if any(r.reads for r in self.reqs.values()):
            self._phase(PausePhase.READS)  # our own reads into the pool first (step polls)
            return
        self._finish_pause()

    def _free(self, req: DecodeRequest, why: str, reason: Reason) -> None:
        """End ``req``: its pages and landing region go back now, or, while device work on
        them (an unpack, a check; CUDA runs it asynchronously) is still queued, once that
        work is done (:meth:`_drain_device`): a NIXL write is not ordered with the
        device's stream, so a page or region reused by a new BOOT at once could receive
        the new request's bytes before the old unpack ran."""
        busy, req.busy = req.busy, None
        if busy is not None and not busy.query():
            owner = ("device-busy", req.rid)
            if self.ledger.holds(req.rid):
                self.ledger.rename(req.rid, owner)
                self.ledger.quarantine(owner)
            self._draining.append(_Drain(busy, owner, why, req.landing_off))
        else:
            if self.ledger.holds(req.rid):
                self.ledger.release(req.rid, why)
            if req.landing_off >= 0:
                self.arena.free(req.landing_off)
        self._transition(req, DecodeState.FREED)
        del self.reqs[req.rid]
        del self._rooms[req.room]
        self.completed[req.rid] = reason
        self.metrics.requests[reason.outcome.value] += 1
        self.metrics.peer(req.peer).requests[reason.outcome.value] += 1

    def _drain_device(self) -> bool:
        """Give back the pages and landing regions of ended requests whose device work is
        done (polled, never waited on); True when some were."""
        keep = []
        for d in self._draining:
            if not d.event.query():
                keep.append(d)
                continue
            if self.ledger.holds(d.owner):
                self.ledger.release(d.owner, d.why)
            if d.off >= 0:
                self.arena.free(d.off)
        moved = len(keep) < len(self._draining)
        self._draining = keep
        return moved

    # --- pause / resume ---------------------------------------------------------------------
    def begin_pause(self) -> None:
        if self.phase is not PausePhase.SERVING:
            return
        self._phase(PausePhase.DRAINING)
        self._pause_t0 = self.clock()
        self.metrics.pauses += 1
        msg = encode("PAUSING", epoch=self.pool.epoch)
        # a prefill that cannot be told is gone (its process died, its connection broke):
        # none of its writes can land any more, so this pause does not wait for its ack
        self._acks_due = {n for n in self.prefill_peers if self._tell(n, msg)}
        self._maybe_finish_pause()

    def _finish_pause(self) -> None:
        """The prefill acknowledged: none of its writes into this side is in flight.  The
        memory is released once the device work on it is done too (a later step, polled,
        when some is still queued)."""
        for req in list(self.reqs.values()):
            if req.state in _HOLDING:
                self._free(
                    req,
                    "abort:503",
                    req.reason
                    or Reason(
                        SERVICE_UNAVAILABLE,
                        (
                            f"request {req.rid} (room {req.room}) aborted: decode paused to release "
                            "its KV memory"
                        ),
                    ),
                )
        self._drain_device()
        if self._draining:
            self._phase(PausePhase.FREEING)  # step() completes it
            return
        self._complete_pause()

    def _complete_pause(self) -> None:
        """Every page is free and no device work touches the memory: release it."""
        self._apply_checks()
        audit = self.ledger.audit()
        if audit["leaked"] or audit["unaccounted"] or audit["quarantined"]:
            raise AssertionError(f"decode pause: pages still held: {audit}")
        self.alloc.reset()
        self.engine.deregister("landing")
        self.engine.deregister("kv")
        self.publish_metadata()  # tombstones: any write built before is refused now
        self._landing_mem.release()
        self.pool.release()
        self._phase(PausePhase.PAUSED)

    def resume(self) -> None:
        if self.phase is not PausePhase.PAUSED:
            return
        self._local_table = None  # deregister released it; _register prepares the new one
        self.pool.resume()
        self._landing_mem.resume()
        self._register()
        self.publish_metadata()
        self._phase(PausePhase.SERVING)
        self.metrics.pause_seconds += self.clock() - self._pause_t0

    def prefault(self) -> None:
        """Back the pool and the landing buffer with memory now, not at first touch."""
        self.pool.prefault()
        self._landing_mem.prefault()
