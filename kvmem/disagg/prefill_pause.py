"""Pause and resume of the prefill side (:class:`PrefillPause`, a part each
:class:`~kvmem.disagg.prefill.PrefillSide` holds): stop posting, end every request (503)
at once, drain the posted writes of those ending, then reset the allocator, deregister
and release; at resume the memory back, registered and published (``META``).  The pause
phases' edges: :data:`~kvmem.disagg.states.PREFILL_PAUSE_EDGES`.

When a decode pauses instead (``PAUSING``), the requests bound to it are drained and
aborted (503) and ``PAUSE_ACK`` tells it no write is in flight; its ``META`` (new epoch)
lets requests flow again, and the engine refuses writes built from its older metadata
(StaleEpochError), which end the request with 503 (:mod:`kvmem.disagg.prefill_messages`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvmem.disagg.outcome import SERVICE_UNAVAILABLE, Reason
from kvmem.disagg.protocol import meta_message
from kvmem.disagg.states import PREFILL_PAUSE_EDGES, PausePhase, set_phase

if TYPE_CHECKING:
    from kvmem.disagg.prefill_context import PrefillContext
    from kvmem.disagg.prefill_direct import PrefillDirect
    from kvmem.disagg.prefill_ending import PrefillEnding

log = logging.getLogger("kvmem.disagg.prefill")  # the side's logger (docs/logging.md)


class PrefillPause:
    """The pause of one prefill side.  It owns the pause phase (``phase``, moved along
    :data:`~kvmem.disagg.states.PREFILL_PAUSE_EDGES` only) and when the pause began
    (``t0``); the side asks it where it is.  What it works on: the side's context
    (``ctx``: the pool, allocator, engine and ledger it resets and releases, the request
    tables, how to tell every decode), and the parts built before it: ``ending`` (every
    request ends, 503) and ``direct`` (the local block list prepared again at resume).
    The last part built."""

    def __init__(self, ctx: PrefillContext, ending: PrefillEnding, direct: PrefillDirect):
        self.ctx, self.ending, self.direct = ctx, ending, direct
        self.phase = PausePhase.SERVING  # PREFILL_PAUSE_EDGES
        self.t0 = 0.0  # when the current (or last) pause began

    @property
    def pausing(self) -> bool:
        """A pause began and its memory is not released yet."""
        return self.phase is PausePhase.DRAINING

    @property
    def paused(self) -> bool:
        """The memory is released; :meth:`resume` serves again."""
        return self.phase is PausePhase.PAUSED

    def _phase(self, to: PausePhase) -> None:
        set_phase("prefill", PREFILL_PAUSE_EDGES, self, to, log)

    def begin(self) -> None:
        """Stop posting; :meth:`advance` then drains, aborts (503), resets, deregisters and
        releases.  Nothing when a pause began already."""
        if self.phase is not PausePhase.SERVING:
            return
        self._phase(PausePhase.DRAINING)
        self.t0 = self.ctx.clock()
        self.ctx.metrics.pauses += 1

    def advance(self) -> bool:
        """True once the pause is complete (memory released), False while writes drain.

        Every request ends (503) at once, not after the drain: one waiting for its next
        chunk would otherwise sit out the slowest transfer in flight (an offered read to a
        dead decode lasts the transfer timeout) and end 504 here and on its decode.  A
        request with a transfer in flight stays ENDING until it is DONE or ERR."""
        ctx = self.ctx
        for req in list(ctx.requests.active.values()):
            self.ending.end(
                req,
                Reason(
                    SERVICE_UNAVAILABLE,
                    (
                        f"request {req.rid} (room {req.room}) aborted: prefill paused to release "
                        "its KV memory"
                    ),
                ),
            )
        if ctx.requests.active:
            return False  # the side's step polls their transfers to DONE/ERR
        audit = ctx.ledger.audit()
        if audit["leaked"] or audit["unaccounted"]:
            raise AssertionError(
                f"prefill pause: pages still held after aborting every request: {audit}"
            )
        ctx.alloc.reset()
        ctx.engine.deregister("kv")
        if ctx.config.transfer_mode == "pull":  # the decodes refuse reads from the old pool now
            ctx.peers.tell_all(meta_message(ctx.engine))
        ctx.pool.release()
        self._phase(PausePhase.PAUSED)
        return True

    def resume(self) -> None:
        """The memory back, registered and published (``META``); nothing unless paused."""
        if self.phase is not PausePhase.PAUSED:
            return
        ctx = self.ctx
        ctx.pool.resume()
        ctx.engine.register_pool(ctx.pool, "kv")
        self.direct.prep_local()  # deregister released the old list
        ctx.peers.tell_all(meta_message(ctx.engine))
        self._phase(PausePhase.SERVING)
        ctx.metrics.pause_seconds += ctx.clock() - self.t0
