"""How a prefill request ends (:class:`PrefillEnding`, a base class of
:class:`~kvmem.disagg.prefill.PrefillSide`; its methods use the side's fields): early
(ENDING: its pages freed once no transfer reads them, then FAILED with ``ABORT`` to the
decode), or done (the AUX staged after the last chunk, then SUCCEEDED); the bootstrap
and transfer timeouts (504).  The edges are drawn in :mod:`kvmem.disagg.prefill`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmem.disagg.outcome import GATEWAY_TIMEOUT, OK, KVPoll, Reason
from kvmem.disagg.prefill_request import PrefillRequest
from kvmem.disagg.protocol import encode
from kvmem.disagg.states import PrefillState

if TYPE_CHECKING:
    from kvmem.disagg.prefill_peers import PrefillPeers
    from collections.abc import Callable
    from typing import Any

    from kvmem.disagg.counters import Metrics
    from kvmem.disagg.ledger import Ledger
    from kvmem.disagg.prefill_schedule import PrefillScheduler
    from kvmem.disagg.prefill_send import PrefillSending


class PrefillEnding:
    """The ending methods of :class:`~kvmem.disagg.prefill.PrefillSide` (not a side on
    its own: they read and change the side's requests, ledger, staging and counters)."""

    if TYPE_CHECKING:  # what PrefillSide (kvmem/disagg/prefill.py) provides
        clock: Callable[[], float]
        bootstrap_timeout: float
        transfer_timeout: float
        on_finish: Any
        ledger: Ledger
        metrics: Metrics
        sending: PrefillSending
        reqs: dict[int, Any]
        finished: dict[int, Reason]
        finished_peer: dict[int, str]
        _rooms: set[int]
        scheduler: PrefillScheduler

        peers: PrefillPeers

        def _transition(self, *args: Any, **kwargs: Any) -> Any: ...

    def _maybe_finish(self, req: PrefillRequest) -> None:
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
            self.sending.send_aux(req)
        elif st is PrefillState.AUX_POSTED:
            self._finish(
                req, PrefillState.SUCCEEDED, Reason(OK, f"request {req.rid}: KV delivered")
            )

    def _end(self, req: PrefillRequest, reason: Reason) -> None:
        """End ``req`` early (ENDING; nothing when it has ended already): its pages are
        freed now, or once the transfer reading them is DONE or ERR; once no transfer of it
        is in flight the decode side is told (ABORT) and the client gets ``reason``."""
        if req.state.ended:
            return
        self._transition(req, PrefillState.ENDING)
        req.reason = reason
        req.pending.clear()
        if req.staged is not None:  # packed, never posted: the slot is free again
            if req.staged.off is not None:
                self.sending.arena.free(req.staged.off)
            req.staged = None
        # a direct write or an offered read reading these pages: freed by _maybe_finish
        # once it is DONE or ERR
        if not any(t.reads_pages for t in req.handles) and self.ledger.holds(req.rid):
            self.ledger.release(req.rid, f"ended:{reason.status}")
        self._maybe_finish(req)

    def _finish(self, req: PrefillRequest, to: PrefillState, reason: Reason) -> None:
        """``req`` is over (``to``: FAILED, the decode told with ABORT, or SUCCEEDED)."""
        self._transition(req, to)
        req.reason = reason
        if to is PrefillState.FAILED:
            self.peers.tell(
                req.peer, encode("ABORT", rid=req.rid, status=reason.status, reason=reason.message)
            )
        del self.reqs[req.rid]
        self.scheduler.drop(req.rid)
        self._rooms.discard(req.room)
        self.finished[req.rid] = reason
        self.finished_peer[req.rid] = req.peer
        self.metrics.requests[reason.outcome.value] += 1
        self.metrics.peer(req.peer).requests[reason.outcome.value] += 1
        if self.on_finish is not None:
            self.on_finish(req.rid, reason)

    def _check_timeouts(self) -> bool:
        """End the requests whose bootstrap or transfer took too long (504); True when one
        ended."""
        t, ended = self.clock(), False
        for req in list(self.reqs.values()):
            poll = req.state.poll
            if poll == KVPoll.Bootstrapping and t - req.t_created > self.bootstrap_timeout:
                ended = True
                self._end(
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
                self._end(
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
