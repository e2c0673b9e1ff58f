"""Pause and resume of the decode side (:class:`DecodePause`, a part each
:class:`~kvmem.disagg.decode.DecodeSide` holds): tell the prefills (``PAUSING``); each
drains its writes into this side, aborts the requests bound here (503, ``ABORT`` each)
and acknowledges (``PAUSE_ACK``); then the allocator is reset, ``kv`` and ``landing``
are deregistered (their tombstones published in ``META``) and the memory released.
Resume: memory back, registered at the new epoch, ``META`` published: writes built from
the older metadata are refused by the prefill's engine before they are posted.  The pause
phases' edges: :data:`~kvmem.disagg.states.DECODE_PAUSE_EDGES`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvmem.disagg.outcome import SERVICE_UNAVAILABLE, ProtocolError, Reason
from kvmem.disagg.protocol import PauseAck, encode
from kvmem.disagg.states import DECODE_PAUSE_EDGES, DecodeState, PausePhase, set_phase

if TYPE_CHECKING:
    from kvmem.disagg.decode_context import DecodeContext
    from kvmem.disagg.decode_memory import DecodeMemory
    from kvmem.disagg.decode_receive import DecodeReceiving

log = logging.getLogger("kvmem.disagg.decode")  # the side's logger (docs/logging.md)

# the states that hold pages and a landing region (freed by this side's pause)
_HOLDING = frozenset({DecodeState.BOOTING, DecodeState.BOOTED, DecodeState.QUARANTINED})


class DecodePause:
    """The pause of one decode side.  It owns the pause phase (``phase``, moved along
    :data:`~kvmem.disagg.states.DECODE_PAUSE_EDGES` only), when the pause began (``t0``)
    and the prefills whose ``PAUSE_ACK`` it still waits for (``acks_due``); the side asks
    it where it is.  What it works on: the side's context (``ctx``: the pool, allocator,
    engine, ledger, counters and clock, the request tables (read), the prefills, how to
    tell them and publish this side's metadata), and the parts built before it:
    ``memory`` (a request's memory given back, the landing buffer released and
    registered again, the memory still waiting for device work) and ``receiving`` (the
    verdicts on their way, the local block list prepared again).  The last part built."""

    def __init__(self, ctx: DecodeContext, memory: DecodeMemory, receiving: DecodeReceiving):
        self.ctx, self.memory, self.receiving = ctx, memory, receiving
        self.phase = PausePhase.SERVING  # DECODE_PAUSE_EDGES
        self.t0 = 0.0  # when the current (or last) pause began
        self.acks_due: set = set()  # prefills whose PAUSE_ACK this pause still waits for

    @property
    def pausing(self) -> bool:
        """A pause began and its memory is not released yet."""
        return self.phase in (PausePhase.DRAINING, PausePhase.READS, PausePhase.FREEING)

    @property
    def paused(self) -> bool:
        """The memory is released; :meth:`resume` serves again."""
        return self.phase is PausePhase.PAUSED

    def _phase(self, to: PausePhase) -> None:
        set_phase("decode", DECODE_PAUSE_EDGES, self, to, log)

    def begin(self) -> None:
        """Tell every prefill (``PAUSING``); the rest follows their acknowledgements."""
        if self.phase is not PausePhase.SERVING:
            return
        ctx = self.ctx
        self._phase(PausePhase.DRAINING)
        self.t0 = ctx.clock()
        ctx.metrics.pauses += 1
        msg = encode("PAUSING", epoch=ctx.pool.epoch)
        # a prefill that cannot be told is gone (its process died, its connection broke):
        # none of its writes can land any more, so this pause does not wait for its ack
        self.acks_due = {n for n in ctx.peers.names if ctx.peers.tell(n, msg)}
        self._maybe_finish()

    def on_ack(self, msg: PauseAck, peer: str) -> None:
        """A prefill has no write into this side in flight: only an ack of *this* pause
        (its epoch) counts, once per prefill; when every prefill has answered the pages
        may be freed and the memory released."""
        if not self.pausing:
            raise ProtocolError(f"PAUSE_ACK epoch {msg.epoch}: this side is not pausing")
        if msg.epoch != self.ctx.pool.epoch:
            raise ProtocolError(
                f"PAUSE_ACK epoch {msg.epoch}: this pause is epoch {self.ctx.pool.epoch}"
            )
        if peer not in self.acks_due:
            raise ProtocolError(
                f"PAUSE_ACK epoch {msg.epoch} from {peer!r}: it answered this pause already"
            )
        self.acks_due.discard(peer)
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        if self.acks_due or self.phase is not PausePhase.DRAINING:
            return
        if any(r.reads for r in self.ctx.requests.active.values()):
            self._phase(PausePhase.READS)  # our own reads into the pool first (step polls)
            return
        self.finish()

    def finish(self) -> None:
        """The prefill acknowledged: none of its writes into this side is in flight.  The
        memory is released once the device work on it is done too (a later step, polled,
        when some is still queued)."""
        for req in list(self.ctx.requests.active.values()):
            if req.state in _HOLDING:
                self.memory.free(
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
        self.memory.drain_device()
        if self.memory.draining:
            self._phase(PausePhase.FREEING)  # the side's step completes it
            return
        self.complete()

    def complete(self) -> None:
        """Every page is free and no device work touches the memory: release it."""
        ctx = self.ctx
        self.receiving.apply_checks()
        audit = ctx.ledger.audit()
        if audit["leaked"] or audit["unaccounted"] or audit["quarantined"]:
            raise AssertionError(f"decode pause: pages still held: {audit}")
        ctx.alloc.reset()
        ctx.engine.deregister("landing")
        ctx.engine.deregister("kv")
        ctx.peers.publish_metadata()  # tombstones: any write built before is refused now
        self.memory.landing_mem.release()
        ctx.pool.release()
        self._phase(PausePhase.PAUSED)

    def resume(self) -> None:
        """The memory back, registered at the new epoch, published (``META``); nothing
        unless paused."""
        if self.phase is not PausePhase.PAUSED:
            return
        ctx = self.ctx
        ctx.pool.resume()
        self.memory.landing_mem.resume()
        self.memory.register()
        self.receiving.prep_local()  # pull: deregister released the old list
        ctx.peers.publish_metadata()
        self._phase(PausePhase.SERVING)
        ctx.metrics.pause_seconds += ctx.clock() - self.t0
