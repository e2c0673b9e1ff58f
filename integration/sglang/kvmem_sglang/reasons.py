"""A request's answer, decided once, and the status it carries to the decode side.

The lifecycle hooks decide a request's fate by giving it ``req._kvmem_reason`` (a
``FINISH_ABORT`` with the message and HTTP status) and let sglang's own paths free it;
the output streamer's hook (``kvmem_sglang.prefill.stream_output``) puts that reason on
the one answer that leaves the scheduler.  When the request's KV sender is aborted, the
same message and status go to its decode (:mod:`kvmem_sglang.notify`), tagged so that a
decode with the flag on answers the status instead of its generic 500
(:mod:`kvmem_sglang.decode`).
"""

from __future__ import annotations

import re

_TAG = re.compile(r"\(kvmem-sglang HTTP (\d{3})\)")


def abort_reason(message: str, status):
    """A ``FINISH_ABORT`` with ``message`` and the HTTP ``status``."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return FINISH_ABORT(message, status)


def decide(req, reason) -> bool:
    """Give ``req`` its answer unless it already has one; True if this one holds."""
    if getattr(req, "_kvmem_reason", None) is not None:
        return False
    req._kvmem_reason = reason
    sender = getattr(req, "disagg_kv_sender", None)
    if sender is not None:  # what notify.py tells the decode when the sender is aborted
        sender._kvmem_abort_why = tag(reason.message, reason.status_code)
    return True


def tag(message: str, status) -> str:
    """``message`` with the HTTP status the prefill answered, for the decode side."""
    return f"{message} (kvmem-sglang HTTP {int(status)})" if status else message


def status_of(message) -> int | None:
    """The status :func:`tag` put into ``message``, or None."""
    m = _TAG.search(message) if isinstance(message, str) else None
    return int(m.group(1)) if m else None
