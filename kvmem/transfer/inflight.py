"""The in-flight table: a transfer's handle from its post until its release.

Contract: :class:`InFlight` keeps ``_handles`` (the open handles by id) true to the
transport.  A handle's state only moves PROC -> DONE | ERR, and only here:
:meth:`InFlight._refresh` (which also turns a transport's exception or unknown state into
ERR with ``h.error`` saying why) and ``release(h, abort=True)``; ``poll``, ``in_flight``
and ``drain`` refresh, ``release`` frees.  Posting (which adds handles) and the engine's state belong to
:class:`~kvmem.transfer.engine.TransferEngine`, which this class is a base of.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvmem.transfer.errors import TransferError, TransferInFlightError
from kvmem.transfer.records import TransferHandle, XferState
from kvmem.transfer.transport import Transport


class InFlight(Transport):
    """Poll, release and drain the handles an engine posted."""

    if TYPE_CHECKING:  # what TransferEngine (kvmem/transfer/engine.py) provides
        name: str
        _handles: dict[int, TransferHandle]

        def _check_open(self, what: str) -> None: ...

    def _own(self, h: TransferHandle, what: str) -> TransferHandle:
        if not isinstance(h, TransferHandle) or self._handles.get(h.id) is not h:
            raise ValueError(
                f"{what}: {h!r} is not an open handle of engine {self.name!r}"
                + (" (released)" if isinstance(h, TransferHandle) and h.released else "")
            )
        return h

    def _refresh(self, h: TransferHandle) -> XferState:
        if h.state == XferState.PROC:
            try:
                st = self._t_state(h.native)
            except Exception as e:  # the transport reports some failures by raising
                st, h.error = XferState.ERR, f"{type(e).__name__}: {e}"
            try:
                st = XferState(st)
            except ValueError:
                st, h.error = XferState.ERR, f"unknown transport state {st!r}"
            if st == XferState.ERR and h.error is None:
                h.error = "transport reported ERR"
            h.state = st
        return h.state

    def poll(self, h: TransferHandle) -> XferState:
        """PROC, DONE or ERR (:class:`~kvmem.transfer.records.XferState`, equal to those
        strings; ERR also when the transport raised; see
        ``h.error``).  DONE: the bytes landed and the notification was sent.

        The initiator must keep polling its writes (``poll``, ``in_flight()`` or
        ``drain``): with NIXL a write's notification leaves only when a poll sees the
        write complete, so an unpolled write is never announced to its target."""
        self._check_open("poll")
        return self._refresh(self._own(h, "poll"))

    def release(self, h: TransferHandle, *, abort: bool = False) -> None:
        """Free a handle.  Refused while it is in flight unless ``abort``: then the
        transport cancels it, its state becomes ERR, its notification is never delivered,
        and whether its bytes landed is unknown (treat the target as written)."""
        self._check_open("release")
        self._own(h, "release")
        if self._refresh(h) == XferState.PROC and not abort:
            raise TransferInFlightError(
                "release",
                1,
                f" (handle {h.id} to {h.peer!r}); or release(h, abort=True) to cancel it",
            )
        was = h.state
        try:
            self._t_release(h.native)
        except Exception as e:
            raise TransferError(
                f"release: the transport could not free handle {h.id} "
                f"({was}): {type(e).__name__}: {e}"
            ) from None
        if was == XferState.PROC:
            h.state, h.error = XferState.ERR, "aborted by release(abort=True)"
        h.released, h.native = True, None
        del self._handles[h.id]

    def in_flight(self, peer: str | None = None) -> list[TransferHandle]:
        """Poll every open PROC handle (to ``peer`` when given) once; return those still
        PROC.  One call per step of an event loop keeps notifications flowing."""
        return [
            h
            for h in self._handles.values()
            if (peer is None or h.peer == peer) and self._refresh(h) == XferState.PROC
        ]

    def drain(self, timeout: float | None = None, peer: str | None = None) -> list[TransferHandle]:
        """Poll every open handle (to ``peer``) until none is PROC; return those that were
        in flight when called (PROC as last seen: posted and not yet seen to end), now
        DONE or ERR, not released, whether they ended at drain's first poll or later.
        TransferInFlightError after ``timeout`` seconds (None: wait forever), nothing
        released.  When the transport has no progress thread, the targets' owners must
        be progressing meanwhile (they are, in their own processes; two engines in one
        process: drive the other one)."""
        self._check_open("drain")
        drained = [
            h
            for h in self._handles.values()
            if (peer is None or h.peer == peer) and h.state == XferState.PROC
        ]
        todo = [h for h in drained if self._refresh(h) == XferState.PROC]
        deadline = None if timeout is None else time.monotonic() + timeout
        nap = 20e-6
        while todo:
            if deadline is not None and time.monotonic() >= deadline:
                raise TransferInFlightError(
                    f"drain({timeout})", len(todo), "" if peer is None else f" to {peer!r}"
                )
            time.sleep(nap)  # leave the CPU to the transport's progress thread
            nap = min(nap * 2, 1e-3)
            todo = [h for h in todo if self._refresh(h) == XferState.PROC]
        return drained

    def open_handles(self) -> int:
        return len(self._handles)
