"""A request's answer, decided once, and how the other server learns it: as data, never
read out of a text.

The lifecycle hooks decide a request's fate by keeping a reason for it (:func:`decide`,
:func:`reason_of`: a ``FINISH_ABORT`` with the message and HTTP status, in
``kvmem_sglang.state.REASON``) and let sglang's own paths free it; the output streamer's
hook (``kvmem_sglang.prefill.stream_output``) puts that reason on the one answer that
leaves the scheduler.

**Answers.**  What a failed PD request is answered, reduced to what may cross between
servers, is an :data:`Answer`: one of :data:`ANSWER_STATUSES` (the adapter's own
statuses: 500, 503, 504) or :data:`ABORT` (answered as sglang answers an aborted request
outside PD: finish reason ``abort``, no error status, so that sglang's router, which
retries a 500, does not send an aborted request again).

* When a kvmem prefill aborts a KV sender it tells the decode on sglang's status channel
  (:mod:`kvmem_sglang.notify`) with a human reason and, in a frame of its own after it,
  the answer (:func:`to_frame`).  sglang's status message is a list of frames (room,
  status, rank, reason, ``CommonKVManager._encode_kv_status_message``); its parser reads
  the first four and ignores the rest, so a stock decode answers its generic 500 as
  before, and a decode with the flag reads the answer frame (:func:`from_frame`: exactly
  one of the frames this module makes, anything else is no answer).
* sglang's own abort records (:data:`SGLANG_ABORTS`, compared whole:
  :func:`answer_of_record`) are answered :data:`ABORT` on either server.
* The answer reaches sglang's ``prepare_abort`` through the thread that reads the failure:
  sglang reads a failed room with ``failure_exception()`` and calls ``prepare_abort`` for
  its request right after, on the same thread (``disaggregation/decode.py``
  ``_update_handshake_waiters`` and ``pop_transferred``, ``prefill.py``
  ``handle_bootstrap_failure`` and ``handle_inflight_transfer_failure``); the hooks on
  ``failure_exception`` :func:`hand_over` the room's answer, and ``prepare_abort``'s hook
  :func:`take_answer`\\s it for that request's room only.

The message sglang builds around a failure holds the request's ``rid`` and its
``bootstrap_host``, which a client chooses: nothing is ever parsed out of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from types import MappingProxyType
from typing import Literal, Union

from kvmem.disagg.outcome import Ending
from kvmem_sglang import state

ABORT: Literal["abort"] = "abort"
# A status of ANSWER_STATUSES, or ABORT.
Answer = Union[int, Literal["abort"]]
# The statuses the adapter answers a failed PD request with (kvmem.disagg.outcome.Ending):
# a send failed or a peer is gone, a release, a timeout.  No other status crosses.
ANSWER_STATUSES = frozenset(e.status for e in (Ending.FAILED, Ending.RELEASED, Ending.TIMED_OUT))

_FRAME_PREFIX = b"kvmem-sglang answer "
_EVERY_ANSWER: tuple[Answer, ...] = (ABORT, *sorted(ANSWER_STATUSES))
_FRAMES: Mapping[Answer, bytes] = MappingProxyType(
    {a: _FRAME_PREFIX + str(a).encode("ascii") for a in _EVERY_ANSWER}
)
_BY_FRAME: Mapping[bytes, Answer] = MappingProxyType({f: a for a, f in _FRAMES.items()})

# The failure reasons sglang's KV senders and receivers record for an abort: what
# ``/abort_request`` records (``CommonKVSender.abort``, ``CommonKVReceiver.abort``,
# ``disaggregation/common/conn.py``), what a NIXL prefill records when its decode's ABORT
# came first (``NixlKVManager._handle_abort_notification``, ``nixl/conn.py``), and what
# the adapter records when that ABORT came even before the request
# (``kvmem_sglang.notify.manager_update_status``).  Compared whole, never searched for.
EARLY_ABORT = "Aborted by decode-side abort notification (received before the request)."
SGLANG_ABORTS = frozenset(
    {"Aborted by AbortReq.", "Aborted by decode-side abort notification.", EARLY_ABORT}
)


def http_status(ending: Ending) -> HTTPStatus:
    """The status of ``ending`` as sglang's answers carry it (an ``http.HTTPStatus``).
    ValueError for :attr:`~kvmem.disagg.outcome.Ending.CLIENT_ABORT` (499 is no
    ``HTTPStatus``): the adapter answers a client's abort with sglang's own status."""
    return HTTPStatus(ending.status)


def abort_reason(message: str, ending: Ending):
    """A ``FINISH_ABORT`` with ``message`` and the HTTP status of ``ending``."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return FINISH_ABORT(message, http_status(ending))


def released_while(server: str, what: str, rid, where: str):
    """The ``FINISH_ABORT`` (503) of request ``rid``, which was ``where`` when ``server``
    released its ``what`` (``release_memory_occupation``): retry after the resume."""
    return abort_reason(
        f"{server} released its {what} (release_memory_occupation) while "
        f"request {rid} was {where}; aborted, retry after the resume",
        Ending.RELEASED,
    )


def reason_of(req):
    """The answer :func:`decide` gave ``req``, or None."""
    return state.REASON.get(req)


@dataclass(frozen=True)
class Told:
    """What a prefill tells a request's decode when it ends the request's transfer: a
    human ``message`` and the :data:`Answer` (None: none to give, the decode answers its
    own 500)."""

    message: str
    answer: Answer | None


def decide(req, reason) -> bool:
    """Give ``req`` its answer unless it already has one; True if this one holds."""
    if state.REASON.get(req) is not None:
        return False
    state.REASON.set(req, reason)
    sender = getattr(req, "disagg_kv_sender", None)
    if sender is not None:  # what notify.py tells the decode when the sender is aborted
        state.ABORT_WHY.set(sender, Told(reason.message, answer_of(reason)))
    return True


def answer_of(reason) -> Answer | None:
    """The :data:`Answer` of a ``FINISH_ABORT``: its status when the adapter answers with
    it, :data:`ABORT` when it has none (a client's abort), else None."""
    status = getattr(reason, "status_code", None)
    if not status:
        return ABORT
    try:
        code = int(status)
    except (TypeError, ValueError):
        return None
    return code if code in ANSWER_STATUSES else None


def answer_of_record(failure_reason) -> Answer | None:
    """:data:`ABORT` when ``failure_reason`` (what sglang's ``failure_exception`` raised
    with) is one of sglang's abort records, whole; else None."""
    return ABORT if isinstance(failure_reason, str) and failure_reason in SGLANG_ABORTS else None


def failure_answer(mgr, room, error) -> Answer | None:
    """The answer of the failure ``error`` that sglang's ``failure_exception`` raised for
    ``room`` of KV manager ``mgr``: what the adapter learned of the room before
    (``state.ANSWERS``, taken), else :func:`answer_of_record` of its reason."""
    rooms = state.ANSWERS.get(mgr) if mgr is not None else None
    known = rooms.pop(room) if rooms is not None else None
    return known if known is not None else answer_of_record(getattr(error, "failure_reason", None))


def to_frame(answer: Answer) -> bytes:
    """The frame that carries ``answer`` after sglang's status message."""
    return _FRAMES[answer]


def from_frame(frame) -> Answer | None:
    """The :data:`Answer` ``frame`` carries when it is exactly one :func:`to_frame`
    makes; None for anything else (never raises: the frame comes from a peer)."""
    if not isinstance(frame, (bytes, bytearray, memoryview)) or len(frame) > 64:
        return None
    return _BY_FRAME.get(bytes(frame))


def http_answer(answer: Answer) -> HTTPStatus | None:
    """The ``status_code`` sglang's ``prepare_abort`` gets for ``answer`` (None: an abort)."""
    return None if answer == ABORT else HTTPStatus(answer)


# -- from failure_exception to prepare_abort, on the thread that reads the failure -------------


def hand_over(room, answer: Answer | None) -> None:
    """The failure of ``room`` this thread just read is answered ``answer`` (None: no
    answer of the adapter's; sglang's own status stands)."""
    handed = state.PROCESS.handed
    handed.room, handed.answer = room, answer


def take_answer(req) -> Answer | None:
    """The answer handed over for ``req``'s room on this thread, once; None when the
    failure this thread read last was another room's, or had none."""
    handed = state.PROCESS.handed
    room, answer = getattr(handed, "room", None), getattr(handed, "answer", None)
    if room is None or room != getattr(req, "bootstrap_room", None):
        return None
    handed.room = handed.answer = None
    return answer
