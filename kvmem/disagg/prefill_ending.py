"""How a prefill request ends (:class:`PrefillEnding`, a part each
:class:`~kvmem.disagg.prefill.PrefillSide` holds): early (ENDING: its pages freed once
no transfer reads them, then FAILED with ``ABORT`` to the decode), or done (the AUX
staged after the last chunk, then SUCCEEDED); the bootstrap and transfer timeouts (504).
The edges are drawn in :mod:`kvmem.disagg.prefill`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmem.disagg.outcome import GATEWAY_TIMEOUT, OK, KVPoll, Reason
from kvmem.disagg.prefill_request import PrefillRequest, PrefillRequests
from kvmem.disagg.protocol import encode
from kvmem.disagg.states import PrefillState

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvmem.disagg.arena import Arena
    from kvmem.disagg.counters import Metrics
    from kvmem.disagg.ledger import Ledger


class PrefillEnding:
    """How the requests of one prefill side end: it is the part that finishes them in the
    side's request tables (``requests``, which count each one and call the caller's
    ``on_finish``).  It owns the timeouts (``bootstrap_timeout``, ``transfer_timeout``).
    What else it uses is handed to it: the ledger (a request's pages freed), the staging arena (a packed slot never
    posted freed), the counters, the clock, the scheduler's ``drop``, how to tell a decode
    (``tell``) and the sending part's ``send_aux`` (a request's last write)."""

    def __init__(
        self,
        *,
        requests: PrefillRequests,
        ledger: Ledger,
        arena: Arena,
        metrics: Metrics,
        clock: Callable[[], float],
        drop: Callable[[int], None],
        tell: Callable[[str, bytes], bool],
        send_aux: Callable[[PrefillRequest], None],
        bootstrap_timeout: float,
        transfer_timeout: float,
    ):
        self.requests = requests
        self.ledger, self.arena, self.metrics, self.clock = ledger, arena, metrics, clock
        self.drop, self.tell, self.send_aux = drop, tell, send_aux
        self.bootstrap_timeout, self.transfer_timeout = bootstrap_timeout, transfer_timeout

    def maybe_finish(self, req: PrefillRequest) -> None:
        """Once no transfer of ``req`` is in flight: KV_POSTED and ENDING give back the
        pages a direct write or an offered read was reading (ledger reason ``sent``, or
        ``ended:<status>``); then ENDING finishes (FAILED, ABORT to the decode), KV_POSTED
        stages the AUX and AUX_POSTED finishes (SUCCEEDED).  Nothing in other states."""
        if req.handles:
            return
        st = req.state
        if st is PrefillState.ENDING:
            assert req.reason is not None  # set on entering ENDING
            if self.ledger.holds(req.rid):
                self.ledger.release(req.rid, f"ended:{req.reason.status}")
            self._finish(req, PrefillState.FAILED, req.reason)
        elif st is PrefillState.KV_POSTED:  # the last chunk is DONE: its extra state follows
            if self.ledger.holds(req.rid):
                self.ledger.release(req.rid, "sent")
            self.send_aux(req)
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
        self.requests.set_state(req, PrefillState.ENDING)
        req.reason = reason
        req.pending.clear()
        if req.staged is not None:  # packed, never posted: the slot is free again
            if req.staged.off is not None:
                self.arena.free(req.staged.off)
            req.staged = None
        # a direct write or an offered read reading these pages: freed by maybe_finish
        # once it is DONE or ERR
        if not any(t.reads_pages for t in req.handles) and self.ledger.holds(req.rid):
            self.ledger.release(req.rid, f"ended:{reason.status}")
        self.maybe_finish(req)

    def _finish(self, req: PrefillRequest, to: PrefillState, reason: Reason) -> None:
        """``req`` is over (``to``: FAILED, the decode told with ABORT, or SUCCEEDED):
        scheduled no more, finished in the request tables."""
        if to is PrefillState.FAILED:
            self.tell(
                req.peer, encode("ABORT", rid=req.rid, status=reason.status, reason=reason.message)
            )
        self.drop(req.rid)
        req.reason = reason
        self.requests.finish(req, to, reason)

    def check_timeouts(self) -> bool:
        """End the requests whose bootstrap or transfer took too long (504); True when one
        ended."""
        t, ended = self.clock(), False
        for req in list(self.requests.active.values()):
            poll = req.state.poll
            if poll == KVPoll.Bootstrapping and t - req.t_created > self.bootstrap_timeout:
                ended = True
                self.end(
                    req,
                    Reason(
                        GATEWAY_TIMEOUT,
                        (
                            f"prefill bootstrap timeout (> {self.bootstrap_timeout:g} s) for request "
                            f"{req.rid} (room {req.room})"
                        ),
                    ),
                )
            elif (
                poll in (KVPoll.WaitingForInput, KVPoll.Transferring)
                and req.t_bootstrapped is not None  # set by its BOOT, before these states
                and t - req.t_bootstrapped > self.transfer_timeout
            ):
                ended = True
                self.end(
                    req,
                    Reason(
                        GATEWAY_TIMEOUT,
                        (
                            f"prefill transfer timeout (> {self.transfer_timeout:g} s) in "
                            f"{poll.name} for request {req.rid} (room {req.room})"
                        ),
                    ),
                )
        return ended
