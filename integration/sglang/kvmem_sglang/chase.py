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

:func:`chase` sends the same ABORT again at growing intervals (:data:`DELAYS_S`), so it
lands once the prefill knows the room; the prefill then fails the request as aborted by
its decode and answers it.  An ABORT for a room the prefill has already ended or never
knew is ignored there, so the repeats are harmless.  The repeats carry no return
address: the decode does not arm its ABORT_ACK tracker for a room it refused before
giving it any page, and the prefill sends no ACK without one.  One daemon thread sends
them, so no scheduler loop waits on a socket.
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

_LOCK = threading.Lock()
_WAKE = threading.Condition(_LOCK)
_DUE: list = []  # heap of (when, seq, room, targets, connect)
_SEQ = itertools.count()
_THREAD: threading.Thread | None = None


def chase(receiver) -> int:
    """Send ``receiver``'s ABORT again later (module docstring); the number of repeats
    scheduled (0 when the receiver does not know its prefill's address yet)."""
    infos = list(getattr(receiver, "bootstrap_infos", None) or ())
    room = getattr(receiver, "bootstrap_room", None)
    connect = getattr(receiver, "_connect_to_bootstrap_server", None)
    if not infos or room is None or connect is None:
        return 0
    now = time.monotonic()
    global _THREAD
    with _WAKE:
        for delay in DELAYS_S:
            heapq.heappush(_DUE, (now + delay, next(_SEQ), room, infos, connect))
        if _THREAD is None or not _THREAD.is_alive():
            _THREAD = threading.Thread(target=_run, name="kvmem-abort-chase", daemon=True)
            _THREAD.start()
        _WAKE.notify()
    return len(DELAYS_S)


def pending() -> int:
    """Repeats not sent yet (tests read it)."""
    with _LOCK:
        return len(_DUE)


def _run() -> None:
    while True:
        with _WAKE:
            while not _DUE or _DUE[0][0] > time.monotonic():
                _WAKE.wait(None if not _DUE else max(0.0, _DUE[0][0] - time.monotonic()))
            _, _, room, infos, connect = heapq.heappop(_DUE)
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
