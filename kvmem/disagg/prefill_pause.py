"""Pause and resume of the prefill side (:class:`PrefillPause`, a base class of
:class:`~kvmem.disagg.prefill.PrefillSide`; its methods use the side's fields): stop
posting, end every request (503), drain their transfers, then reset the allocator,
deregister and release; at resume the memory back, registered and published (``META``).
The pause phases' edges: :data:`~kvmem.disagg.states.PREFILL_PAUSE_EDGES`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmem.disagg.outcome import SERVICE_UNAVAILABLE, Reason
from kvmem.disagg.protocol import meta_message
from kvmem.disagg.states import PausePhase

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    from kvmem.disagg.counters import Metrics
    from kvmem.disagg.ledger import Ledger


class PrefillPause:
    """The pause methods of :class:`~kvmem.disagg.prefill.PrefillSide` (not a side on its
    own: they read and change the side's phase, requests, pool, allocator and engine)."""

    if TYPE_CHECKING:  # what PrefillSide (kvmem/disagg/prefill.py) provides
        pool: Any
        alloc: Any
        engine: Any
        transfer_mode: str
        clock: Callable[[], float]
        ledger: Ledger
        metrics: Metrics
        decode_peers: tuple[str, ...]
        reqs: dict[int, Any]
        phase: PausePhase
        _pause_t0: float

        def _tell(self, peer: str, msg: bytes) -> bool: ...
        def _phase(self, to: PausePhase) -> None: ...
        def _end(self, *args: Any, **kwargs: Any) -> Any: ...
        def _prep_local(self) -> None: ...

    def begin_pause(self) -> None:
        """Stop posting; ``step`` then drains, aborts (503), resets, deregisters and
        releases.  :attr:`paused` is True once the memory is released."""
        if self.phase is not PausePhase.SERVING:
            return
        self._phase(PausePhase.DRAINING)
        self._pause_t0 = self.clock()
        self.metrics.pauses += 1

    def _advance_pause(self) -> bool:
        """True once the pause is complete (memory released), False while writes drain.

        Every request ends (503) at once, not after the drain: one waiting for its next
        chunk would otherwise sit out the slowest transfer in flight (an offered read to a
        dead decode lasts the transfer timeout) and end 504 here and on its decode.  A
        request with a transfer in flight stays ENDING until it is DONE or ERR."""
        for req in list(self.reqs.values()):
            self._end(
                req,
                Reason(
                    SERVICE_UNAVAILABLE,
                    (
                        f"request {req.rid} (room {req.room}) aborted: prefill paused to release "
                        "its KV memory"
                    ),
                ),
            )
        if self.reqs:
            return False  # step() polls their transfers to DONE/ERR
        audit = self.ledger.audit()
        if audit["leaked"] or audit["unaccounted"]:
            raise AssertionError(
                f"prefill pause: pages still held after aborting every request: {audit}"
            )
        self.alloc.reset()
        self.engine.deregister("kv")
        if self.transfer_mode == "pull":  # the decodes refuse reads from the old pool now
            self._tell_all(meta_message(self.engine))
        self.pool.release()
        self._phase(PausePhase.PAUSED)
        return True

    def resume(self) -> None:
        if self.phase is not PausePhase.PAUSED:
            return
        self.pool.resume()
        self.engine.register_pool(self.pool, "kv")
        self._prep_local()  # deregister released the old list
        self._tell_all(meta_message(self.engine))
        self._phase(PausePhase.SERVING)
        self.metrics.pause_seconds += self.clock() - self._pause_t0

    def _tell_all(self, msg: bytes) -> None:
        for name in self.decode_peers:
            self._tell(name, msg)
