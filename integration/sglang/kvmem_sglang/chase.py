"""A decode's ABORT sent again until its prefill can act on it.

sglang's router sends a PD request to the prefill and the decode at the same time.  A
decode that refuses the request at once (its KV cache is released) sends its prefill an
ABORT for the request's room (``CommonKVReceiver._send_abort_notification``), and that
ABORT often arrives before the prefill's scheduler has created the room: a stock
prefill ignores an ABORT for a room it does not know (``_handle_abort_notification`` of
``NixlKVManager``, nixl/conn.py, and of ``MooncakeKVManager``, mooncake/conn.py),
bootstraps the request alone until its bootstrap timeout (300 s by default), and the
router waits for its answer.  Seen on a real pair (stock prefill, decode with the flag,
decode released): 2 of 3 requests sent through the router got no answer in 40 s.  (A kvmem
prefill remembers such an early ABORT itself, ``kvmem_sglang.notify.abort_notification``.)

:meth:`Chase.add` sends the same ABORT again at growing intervals (:data:`DELAYS_S`), so
it lands once the prefill knows the room; the prefill then fails the request as aborted
by its decode and answers it.  An ABORT for a room the prefill has already ended or never
knew is ignored there, so the repeats are harmless.  The repeats carry no return
address: the decode does not arm its ABORT_ACK tracker for a room it refused before
giving it any page, and the prefill sends no ACK without one.  One daemon thread sends
them, so no scheduler loop waits on a socket.

The process's one :class:`Chase` is ``kvmem_sglang.state.PROCESS.chase``; this module
imports nothing of the adapter (the registry imports it).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time

logger = logging.getLogger("kvmem.sglang")

# Seconds after the first ABORT at which it is sent again: a prefill's scheduler takes a
# request from the router within one loop pass (milliseconds when idle; a busy forward
# on two loaded cores took up to a few seconds here), and the repeats stop well before
# sglang's default bootstrap timeout.  A guess tuned on the CPU tier, not a measurement.
DELAYS_S = (0.05, 0.2, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)


class Chase:
    """The repeats of this process's ABORTs (module docstring): a heap of those due, in
    the order they are due, and the one daemon thread that sends them, started on first
    use (and again if it is gone, as in a forked child).  The process has one,
    ``kvmem_sglang.state.PROCESS.chase``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _due and _thread
        self._wake = threading.Condition(self._lock)  # a new entry for the thread
        self._due: list = []  # heap of (when, seq, room, targets, connect)
        self._seq = itertools.count()  # orders equal due times
        self._thread: threading.Thread | None = None

    def add(self, receiver) -> int:
        """Send ``receiver``'s ABORT again later; the number of repeats scheduled (0
        when the receiver does not know its prefill's address yet)."""
        infos = list(getattr(receiver, "bootstrap_infos", None) or ())
        room = getattr(receiver, "bootstrap_room", None)
        connect = getattr(receiver, "_connect_to_bootstrap_server", None)
        if not infos or room is None or connect is None:
            return 0
        now = time.monotonic()
        with self._wake:
            for delay in DELAYS_S:
                heapq.heappush(self._due, (now + delay, next(self._seq), room, infos, connect))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="kvmem-abort-chase", daemon=True
                )
                self._thread.start()
            self._wake.notify()
        return len(DELAYS_S)

    def pending(self) -> int:
        """Repeats not sent yet (tests read it)."""
        with self._lock:
            return len(self._due)

    def _run(self) -> None:
        due = self._due
        while True:
            with self._wake:
                while not due or due[0][0] > time.monotonic():
                    self._wake.wait(None if not due else max(0.0, due[0][0] - time.monotonic()))
                _, _, room, infos, connect = heapq.heappop(due)
            _send(room, infos, connect)


def _send(room: int, infos: list, connect) -> None:
    from sglang.srt.disaggregation.common.conn import AbortNotification

    message = AbortNotification(room=room).to_zmq()
    for info in infos:
        try:  # best effort, as sglang's own ABORT
            sock, lock = connect(info)
            with lock:
                sock.send_multipart(message)
        except Exception as e:  # noqa: BLE001 - a dead prefill: nothing to tell
            logger.debug(
                "kvmem-sglang: ABORT of room %s to %s not sent again: %s",
                room,
                info.get("rank_ip"),
                e,
            )
