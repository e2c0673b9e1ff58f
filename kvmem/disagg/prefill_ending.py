"""How a prefill request ends (:class:`PrefillEnding`, a part each
:class:`~kvmem.disagg.prefill.PrefillSide` holds): the caller's or a decode's abort (at
once, or after the request's running batch), early (ENDING: its pages freed once no
transfer reads them, then FAILED with ``ABORT`` to the decode), or done (SUCCEEDED once
its AUX write is DONE; the AUX itself is the sending part's); the bootstrap and transfer
timeouts (504).  The edges are drawn in :mod:`kvmem.disagg.prefill`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmem.disagg.outcome import (
    CLIENT_CLOSED,
    GATEWAY_TIMEOUT,
    OK,
    KVPoll,
    ProtocolError,
    Reason,
    check_caller_args,
)
from kvmem.disagg.prefill_request import PrefillRequest
from kvmem.disagg.protocol import encode
from kvmem.disagg.states import PrefillState

if TYPE_CHECKING:
    from kvmem.disagg.prefill_context import PrefillContext
    from kvmem.disagg.prefill_schedule import PrefillScheduler


class PrefillEnding:
    """How the requests of one prefill side end: it is the part that ends them early and
    finishes them in the request tables (which count each one and call the caller's
    ``on_finish``).  What it uses: the side's context (``ctx``: the timeouts of its
    settings, the request tables, the ledger that frees a request's pages, the staging
    arena that frees a slot staged and never posted, the clock, how to tell a decode) and
    the part built before it, ``scheduler`` (a finished request scheduled no more).  Built
    second, so that every later part may end or finish a request through it."""

    def __init__(self, ctx: PrefillContext, scheduler: PrefillScheduler):
        self.ctx, self.scheduler = ctx, scheduler

    def abort(self, rid: int, status: int = CLIENT_CLOSED, message: str | None = None) -> None:
        """Abort ``rid`` from any state; aborting a finished request does nothing.
        ``status``: an early end of the lifecycle table (499, 500, 503, 504); anything else
        is a ValueError naming it, and nothing changes.  A request whose chunk's forward
        is running ends in that step's ``fill_batch``, before its chunk is packed; any
        other ends now (:meth:`end`)."""
        check_caller_args("abort", rid, status, message)
        requests = self.ctx.requests
        req = requests.find(rid)
        if req is None:
            if rid in requests.finished:
                return
            raise ProtocolError(f"abort: unknown request id {rid!r}")
        if req.state.ended:
            return
        reason = Reason(status, message or f"request {rid} (room {req.room}) aborted by the client")
        if req.in_batch:  # consumed by fill_batch of this step
            if req.abort_pending is None:
                req.abort_pending = reason
                req.t_abort = self.ctx.clock()
            return
        self.end(req, reason)

    def maybe_finish(self, req: PrefillRequest) -> None:
        """Once no transfer of ``req`` is in flight: ENDING gives back the pages a direct
        write or an offered read was reading (ledger reason ``ended:<status>``) and
        finishes (FAILED, ABORT to the decode); AUX_POSTED finishes (SUCCEEDED).  Nothing
        in other states (KV_POSTED's AUX is the sending part's)."""
        if req.handles:
            return
        st = req.state
        if st is PrefillState.ENDING:
            assert req.reason is not None  # set on entering ENDING
            ledger = self.ctx.ledger
            if ledger.holds(req.rid):
                ledger.release(req.rid, f"ended:{req.reason.status}")
            self._finish(req, PrefillState.FAILED, req.reason)
        elif st is PrefillState.AUX_POSTED:
            self._finish(
                req, PrefillState.SUCCEEDED, Reason(OK, f"request {req.rid}: KV delivered")
            )

    def end(self, req: PrefillRequest, reason: Reason) -> None:
        """End ``req`` early (ENDING; nothing when it has ended already): its pages are
        freed now, or once the transfer reading them is DONE or ERR; once no transfer of it
        is in flight the decode side is told (ABORT) and the client gets ``reason``."""
        if req.state.ended:
            return
        self.ctx.requests.set_state(req, PrefillState.ENDING)
        req.reason = reason
        req.pending.clear()
        if req.staged is not None:  # packed, never posted: the slot is free again
            if req.staged.off is not None:
                self.ctx.staging.arena.free(req.staged.off)
            req.staged = None
        # a direct write or an offered read reading these pages: freed by maybe_finish
        # once it is DONE or ERR
        ledger = self.ctx.ledger
        if not any(t.reads_pages for t in req.handles) and ledger.holds(req.rid):
            ledger.release(req.rid, f"ended:{reason.status}")
        self.maybe_finish(req)

    def _finish(self, req: PrefillRequest, to: PrefillState, reason: Reason) -> None:
        """``req`` is over (``to``: FAILED, the decode told with ABORT, or SUCCEEDED):
        scheduled no more, finished in the request tables."""
        requests = self.ctx.requests
        requests.set_state(req, to)
        req.reason = reason
        if to is PrefillState.FAILED:
            self.ctx.peers.tell(
                req.peer, encode("ABORT", rid=req.rid, status=reason.status, reason=reason.message)
            )
        self.scheduler.drop(req.rid)
        requests.finish(req, reason)

    def check_timeouts(self) -> bool:
        """End the requests whose bootstrap or transfer took too long (504); True when one
        ended."""
        t, ended = self.ctx.clock(), False
        boot_s, transfer_s = self.ctx.config.bootstrap_timeout, self.ctx.config.transfer_timeout
        for req in list(self.ctx.requests.active.values()):
            poll = req.state.poll
            if poll == KVPoll.Bootstrapping and t - req.t_created > boot_s:
                ended = True
                self.end(
                    req,
                    Reason(
                        GATEWAY_TIMEOUT,
                        (
                            f"prefill bootstrap timeout (> {boot_s:g} s) for request "
                            f"{req.rid} (room {req.room})"
                        ),
                    ),
                )
            elif (
                poll in (KVPoll.WaitingForInput, KVPoll.Transferring)
                and req.t_bootstrapped is not None  # set by its BOOT, before these states
                and t - req.t_bootstrapped > transfer_s
            ):
                ended = True
                self.end(
                    req,
                    Reason(
                        GATEWAY_TIMEOUT,
                        (
                            f"prefill transfer timeout (> {transfer_s:g} s) in "
                            f"{poll.name} for request {req.rid} (room {req.room})"
                        ),
                    ),
                )
        return ended
