"""How a PD request ends: sglang's poll values, the outcomes, the HTTP-like statuses
an end carries and its :class:`Reason`; what a peer's bad message or a caller's bad
argument raises (:class:`ProtocolError`, the argument checks)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvmem.errors import KVMemError


class KVPoll(enum.IntEnum):
    """sglang's KVPoll values."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class Outcome(str, enum.Enum):
    """How a request ended; the four partition the requests."""

    SUCCEEDED = "succeeded"
    ABORTED = "aborted"  # client or decode-side abort, or a pause (503)
    TIMED_OUT = "timed_out"  # 504
    FAILED = "failed"  # 500: a send failed


# HTTP-like status codes carried by abort reasons.
OK = 200
CLIENT_CLOSED = 499
INTERNAL_ERROR = 500
SERVICE_UNAVAILABLE = 503
GATEWAY_TIMEOUT = 504

_OUTCOME_OF_STATUS = {
    OK: Outcome.SUCCEEDED,
    CLIENT_CLOSED: Outcome.ABORTED,
    SERVICE_UNAVAILABLE: Outcome.ABORTED,
    GATEWAY_TIMEOUT: Outcome.TIMED_OUT,
    INTERNAL_ERROR: Outcome.FAILED,
}


# Bootstrap, transfer and decode timeouts, seconds: sglang's default
# (SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT, docs/disagg.md).
DEFAULT_TIMEOUT = 600.0


# The statuses an early end of a request carries (docs/disagg.md, the lifecycle table): what a
# caller's abort and a peer's ABORT_REQ may give.
END_STATUSES = frozenset({CLIENT_CLOSED, INTERNAL_ERROR, SERVICE_UNAVAILABLE, GATEWAY_TIMEOUT})


@dataclass(frozen=True)
class Reason:
    """Why a request ended: an HTTP-like status and a message naming the request."""

    status: int
    message: str

    @property
    def outcome(self) -> Outcome:
        return _OUTCOME_OF_STATUS[self.status]


class ProtocolError(KVMemError, ValueError):
    """A control message from the peer that is malformed (kvmem.disagg.protocol.parse) or
    does not fit this side's state (an unknown request, a duplicate bootstrap room, pages
    out of range, sizes that do not match, an epoch of another pause); or a caller's call
    that names an unknown or busy request id.  Nothing was changed."""


# --- the caller's arguments -----------------------------------------------------------------
def check_id(what: str, name: str, v) -> None:
    """ValueError naming ``v`` unless it is an int in [0, 2**63) (a request id, a room)."""
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 63:
        raise ValueError(f"{what}: {name} must be an int in [0, 2**63), got {v!r}")


def check_caller_args(what: str, rid, status=None, message=None) -> None:
    """A caller's abort: ``rid`` an id, ``status`` one of :data:`END_STATUSES` (not OK: an
    abort is no success), ``message`` a str or None.  ValueError naming the value."""
    check_id(what, "rid", rid)
    if isinstance(status, bool) or not isinstance(status, int) or status not in END_STATUSES:
        raise ValueError(
            f"{what}: request {rid}: status must be one of "
            f"{sorted(END_STATUSES)} (an early end in the lifecycle table), "
            f"got {status!r}"
        )
    if message is not None and not isinstance(message, str):
        raise ValueError(
            f"{what}: request {rid}: message must be a str or None, got {type(message).__name__}"
        )
