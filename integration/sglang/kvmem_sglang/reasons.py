"""A request's answer, decided once, and the status it carries to the decode side.

The lifecycle hooks decide a request's fate by keeping a reason for it (:func:`decide`,
:func:`reason_of`: a ``FINISH_ABORT`` with the message and HTTP status, in
``kvmem_sglang.state.REASON``) and let sglang's own paths free it; the output streamer's
hook (``kvmem_sglang.prefill.stream_output``) puts that reason on
the one answer that leaves the scheduler.  When the request's KV sender is aborted, the
same message and status go to its decode (:mod:`kvmem_sglang.notify`), tagged so that a
decode with the flag on answers the status instead of its generic 500
(:mod:`kvmem_sglang.decode`).

A reason with no status is a client's abort (``/abort_request``: sglang's
``FINISH_ABORT()``); :func:`tag` marks it as one, and so does :mod:`kvmem_sglang.notify`
for sglang's own abort records (:data:`ABORTED`) before it tells the decode.  Both servers
answer a failure :func:`is_abort` finds in its reason as sglang answers an aborted request
outside PD, with no error status, so that sglang's router, which retries a 500, does not
send an aborted request again.
"""

from __future__ import annotations

import re
from http import HTTPStatus

from kvmem.disagg.outcome import Ending
from kvmem_sglang import state

_TAG = re.compile(r"\(kvmem-sglang HTTP (\d{3})\)")
_ABORT_MARK = "(kvmem-sglang abort)"

# The failure reasons of an abort: what sglang's KV sender and receiver record when
# ``/abort_request`` aborted them (``CommonKVSender.abort`` and ``CommonKVReceiver.abort``,
# ``disaggregation/common/conn.py``), what a prefill records when its decode's ABORT came
# first (``NixlKVManager._handle_abort_notification``, ``disaggregation/nixl/conn.py``),
# and what the adapter records when that ABORT came even before the request
# (``kvmem_sglang.notify.abort_notification``).  sglang's failure paths write
# "... with exception KVTransferError(bootstrap_room=N): <reason>", so a message that ends
# with one of these is that abort.
EARLY_ABORT = "Aborted by decode-side abort notification (received before the request)."
ABORTED = ("Aborted by AbortReq.", "Aborted by decode-side abort notification.", EARLY_ABORT)


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


def decide(req, reason) -> bool:
    """Give ``req`` its answer unless it already has one; True if this one holds."""
    if state.REASON.get(req) is not None:
        return False
    state.REASON.set(req, reason)
    sender = getattr(req, "disagg_kv_sender", None)
    if sender is not None:  # what notify.py tells the decode when the sender is aborted
        state.ABORT_WHY.set(sender, tag(reason.message, reason.status_code))
    return True


def tag(message: str, status) -> str:
    """``message`` with the HTTP status the prefill answered, for the decode side; with no
    status (a client's abort) marked as an abort instead (:func:`is_abort`).  The mark is
    added even to a message that ends like an abort already: the decode reads it inside
    sglang's own text ("... in Transferring (<message>)"), where only the mark survives."""
    # in the text, not a field as in kvmem.disagg's ABORT: sglang tells the decode a text only
    if status:
        return f"{message} (kvmem-sglang HTTP {int(status)})"
    return message if _ABORT_MARK in message else f"{message} {_ABORT_MARK}"


def status_of(message) -> int | None:
    """The status :func:`tag` put into ``message``, or None."""
    m = _TAG.search(message) if isinstance(message, str) else None
    return int(m.group(1)) if m else None


def is_abort(message) -> bool:
    """True if ``message`` is the failure reason of an abort (module docstring): marked by
    :func:`tag`, or ending with one of :data:`ABORTED`."""
    return isinstance(message, str) and (
        _ABORT_MARK in message or message.rstrip().endswith(ABORTED)
    )
