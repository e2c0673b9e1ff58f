"""How a PD request ends: sglang's poll values, the outcomes, the endings with the
HTTP-like status each carries (:class:`Ending`, shared with the sglang adapter) and a
request's :class:`Reason`; what a peer's bad message or a caller's bad argument raises
(:class:`ProtocolError`, the argument checks)."""

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


class Ending(enum.Enum):
    """How a request ends, by cause; the value is the HTTP-like status its answer carries
    (:attr:`status`, an int), one status per cause.  Both PD lifecycles end requests with
    these: kvmem's own sides (the status of a :class:`Reason`, on the wire in ``ABORT``
    and ``ABORT_REQ``) and the sglang adapter (the status of sglang's ``FINISH_ABORT``,
    as an ``http.HTTPStatus``)."""

    SUCCEEDED = 200  # the KV was delivered
    CLIENT_ABORT = 499  # a caller's abort, on either side (the default of abort())
    FAILED = 500  # a send failed, or the peer is gone
    # a side released (or is releasing) its KV memory, or the request's transfer was set up
    # before such a release: retry after the resume
    RELEASED = 503
    TIMED_OUT = 504  # bootstrap, transfer or decode past its timeout

    @property
    def status(self) -> int:
        return int(self.value)

    @property
    def outcome(self) -> Outcome:
        return _OUTCOME[self]


_OUTCOME = {
    Ending.SUCCEEDED: Outcome.SUCCEEDED,
    Ending.CLIENT_ABORT: Outcome.ABORTED,
    Ending.RELEASED: Outcome.ABORTED,
    Ending.TIMED_OUT: Outcome.TIMED_OUT,
    Ending.FAILED: Outcome.FAILED,
}

# The endings' statuses as ints, by their HTTP names (what kvmem.disagg's sides write).
OK = Ending.SUCCEEDED.status
CLIENT_CLOSED = Ending.CLIENT_ABORT.status
INTERNAL_ERROR = Ending.FAILED.status
SERVICE_UNAVAILABLE = Ending.RELEASED.status
GATEWAY_TIMEOUT = Ending.TIMED_OUT.status


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
    def ending(self) -> Ending:
        """The ending of this status; ValueError for a status no ending has."""
        return Ending(self.status)

    @property
    def outcome(self) -> Outcome:
        return self.ending.outcome


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
