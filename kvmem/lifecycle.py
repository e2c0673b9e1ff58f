"""The PD lifecycle contract as data: every way a request ends early, in every state it can
meet the request in, how it ends (its :class:`~kvmem.disagg.outcome.Ending`, so its
status), whether sglang's router may send it again, and who frees which pages.

kvmem keeps this contract twice, by design: :mod:`kvmem.disagg` (kvmem's own prefill and
decode sides, which ``kvmem demo`` runs) and the sglang adapter (``integration/sglang``:
hooks on sglang's own PD queues, where sglang allocates and frees the pages).  Both are
held to :data:`CASES` by one conformance suite (``tests/conformance``), and the contract
tables of ``docs/disagg.md`` and of the adapter's README are :func:`markdown` of it (a
test compares them).  A case one implementation does not serve says so here
(:class:`Serves`, with why), not in a test.

How the two put an ending on the wire differs, and only there: kvmem's own sides carry
the status in their ``ABORT`` / ``ABORT_REQ`` messages (499 for a client's abort); the
adapter answers a client's abort as sglang answers an aborted request outside PD (HTTP
200, finish reason ``abort``: :func:`sglang_status` is None), every other ending with its
status, and carries it to the other server as data (a frame of its own), never in text.

States, by sglang's ``KVPoll`` names, and the two moments around them::

    arriving ─▶ Bootstrapping ─▶ WaitingForInput ─▶ Transferring ─▶ Success
                                      └──── in the running prefill batch ────┘

``arriving``: the request reached the server, no KV sender exists yet.  ``in the running
batch``: the request's forward runs (its pages are being written), between
WaitingForInput and its chunk's send.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from kvmem.disagg.outcome import Ending

__all__ = [
    "CASES",
    "IMPLEMENTATIONS",
    "ROUTER_RETRIES",
    "Case",
    "Cause",
    "Serves",
    "State",
    "case",
    "cases_of",
    "markdown",
    "router_retries",
    "sglang_status",
]

# kvmem's two implementations of the contract: its own sides, and the sglang adapter
IMPLEMENTATIONS = ("kvmem.disagg", "sglang adapter")


class Cause(enum.Enum):
    """What ends a request before its KV is delivered (the value: the tables' words)."""

    CLIENT_ABORT = "the client aborts it"
    DECODE_ABORT = "the decode aborts it (its own client, its timeout)"
    BOOTSTRAP_TIMEOUT = "no decode bootstraps it within the bootstrap timeout"
    TRANSFER_TIMEOUT = "its transfer is not done within the transfer timeout"
    SEND_FAILED = "a write of one of its KV chunks fails (first, middle or last)"
    EXTRA_STATE_FAILED = "the write of its extra state (after the last chunk) fails"
    PEER_GONE = "its decode is gone"
    PREFILL_RELEASE = "the prefill releases its KV memory (a pause)"
    DECODE_RELEASE = "the decode releases its KV memory (a pause)"
    STALE_SEND = "a send set up before a release reaches its write after it"


class State(enum.Enum):
    """Where the request is when its cause meets it."""

    ARRIVING = "arriving"
    BOOTSTRAPPING = "Bootstrapping"
    WAITING = "WaitingForInput"
    IN_BATCH = "in the running batch"
    TRANSFERRING = "Transferring"


@dataclass(frozen=True)
class Serves:
    """Whether an implementation serves a case: it does (``why`` empty), or not, and why."""

    served: bool = True
    why: str = ""

    def __post_init__(self):
        if self.served == bool(self.why):
            raise ValueError("a served case has no why; an unserved one must say why")


SERVED = Serves()


def _no(why: str) -> Serves:
    return Serves(False, why)


@dataclass(frozen=True)
class Case:
    """One cause meeting a request in one state: the ending both implementations give it,
    who frees what, and whether each implementation serves it."""

    cause: Cause
    state: State
    ending: Ending
    prefill_frees: str
    decode_frees: str
    serves: tuple[Serves, Serves]  # kvmem.disagg's, the sglang adapter's

    @property
    def id(self) -> str:
        """A test id: ``transfer_timeout-waiting``."""
        return f"{self.cause.name.lower()}-{self.state.name.lower()}"

    def served_by(self, implementation: str) -> Serves:
        return self.serves[IMPLEMENTATIONS.index(implementation)]


# sglang's router (sglang-router 0.3.2, its retry policy) sends a request again after one
# of these statuses
ROUTER_RETRIES = frozenset({408, 429, 500, 502, 503, 504})


def sglang_status(ending: Ending) -> int | None:
    """The error status the adapter's answer carries for ``ending`` (None: none, the
    request is answered as an abort, finish reason ``abort``)."""
    return None if ending is Ending.CLIENT_ABORT else ending.status


def router_retries(ending: Ending) -> bool:
    """Whether sglang's router sends a request ended so again (a client's abort: never)."""
    status = sglang_status(ending)
    return status is not None and status in ROUTER_RETRIES


_AFTER_ABORT = "once the prefill's ABORT tells it (no write of the prefill's left)"
_DRAINED = "now; the pages a posted write reads once it is done or failed"


def _cases(
    cause: Cause,
    states: Iterable[State],
    ending: Ending,
    prefill_frees: str,
    decode_frees: str,
    kvmem_disagg: dict[State, Serves] | Serves = SERVED,
    sglang: dict[State, Serves] | Serves = SERVED,
) -> list[Case]:
    def pick(s: dict[State, Serves] | Serves, state: State) -> Serves:
        return s.get(state, SERVED) if isinstance(s, dict) else s

    return [
        Case(
            cause,
            st,
            ending,
            prefill_frees,
            decode_frees,
            (pick(kvmem_disagg, st), pick(sglang, st)),
        )
        for st in states
    ]


_S = State
_BWTI = (_S.BOOTSTRAPPING, _S.WAITING, _S.TRANSFERRING, _S.IN_BATCH)

CASES: tuple[Case, ...] = tuple(
    _cases(
        Cause.CLIENT_ABORT,
        _BWTI,
        Ending.CLIENT_ABORT,
        _DRAINED + "; in the running batch, when the batch's result is processed (no KV "
        "of it is sent)",
        _AFTER_ABORT,
    )
    + _cases(
        Cause.DECODE_ABORT,
        (_S.WAITING, _S.TRANSFERRING),
        Ending.CLIENT_ABORT,
        _DRAINED,
        "its own pages are held (quarantined) until the prefill's ABORT says no write is left",
    )
    + _cases(
        Cause.BOOTSTRAP_TIMEOUT,
        (_S.BOOTSTRAPPING,),
        Ending.TIMED_OUT,
        "now (nothing was written)",
        _AFTER_ABORT + "; a decode that never reached the prefill, at its own timeout",
    )
    + _cases(
        Cause.TRANSFER_TIMEOUT,
        (_S.WAITING, _S.TRANSFERRING),
        Ending.TIMED_OUT,
        _DRAINED,
        _AFTER_ABORT,
    )
    + _cases(
        Cause.SEND_FAILED,
        (_S.TRANSFERRING,),
        Ending.FAILED,
        "now (the failed write is settled)",
        _AFTER_ABORT,
    )
    + _cases(
        Cause.EXTRA_STATE_FAILED,
        (_S.TRANSFERRING,),
        Ending.FAILED,
        "now (the failed write is settled)",
        _AFTER_ABORT,
        sglang=_no(
            "the extra state (a hybrid model's recurrent or sliding-window state, after "
            "the KV) is sglang's own send, which the adapter leaves as it is and which no "
            "model that runs on a CPU here has"
        ),
    )
    + _cases(
        Cause.PEER_GONE,
        (_S.BOOTSTRAPPING, _S.WAITING, _S.TRANSFERRING),
        Ending.FAILED,
        "now, its posted writes given up (no ABORT is sent to a dead peer)",
        "nothing: it is gone",
        sglang=_no(
            "sglang finds a dead decode with its own heartbeat and failure paths, which "
            "the adapter leaves as they are"
        ),
    )
    + _cases(
        Cause.PREFILL_RELEASE,
        (_S.ARRIVING, _S.BOOTSTRAPPING, _S.WAITING, _S.IN_BATCH, _S.TRANSFERRING),
        Ending.RELEASED,
        "before the memory goes: every posted write drained, then every page",
        _AFTER_ABORT,
        kvmem_disagg={
            _S.ARRIVING: _no(
                "kvmem's sides keep a request that arrives while paused (Bootstrapping, no "
                "page taken) and serve it after the resume"
            )
        },
    )
    + _cases(
        Cause.DECODE_RELEASE,
        (_S.WAITING, _S.TRANSFERRING),
        Ending.RELEASED,
        "now; the pages a posted write reads once it is done or failed (the decode's "
        "memory is released only then)",
        "before its memory goes, once the prefill says no write of its is in flight",
    )
    + _cases(
        Cause.STALE_SEND,
        (_S.WAITING, _S.TRANSFERRING, _S.IN_BATCH),
        Ending.RELEASED,
        "now (nothing of the stale setup is posted)",
        _AFTER_ABORT,
        kvmem_disagg={
            _S.IN_BATCH: _no("kvmem's sides check a send's epoch when they post its write")
        },
        sglang={
            s: _no("the adapter checks a send's epoch as its chunk leaves the batch")
            for s in (_S.WAITING, _S.TRANSFERRING)
        },
    )
)


def case(cause: Cause, state: State) -> Case:
    """The case of ``cause`` in ``state`` (KeyError: the contract has none)."""
    for c in CASES:
        if c.cause is cause and c.state is state:
            return c
    raise KeyError((cause, state))


def cases_of(implementation: str) -> list[Case]:
    """The cases ``implementation`` serves, in table order."""
    return [c for c in CASES if c.served_by(implementation).served]


def markdown() -> str:
    """The contract as a markdown table, one line per cause: the states it meets, the
    ending and its statuses, whether the router retries, who frees what, and which states
    each implementation serves (with why it does not)."""
    head = [
        "cause",
        "state",
        "ending (status: kvmem.disagg / sglang adapter)",
        "router retries",
        "prefill frees",
        "decode frees",
        *IMPLEMENTATIONS,
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cause in Cause:
        group = [c for c in CASES if c.cause is cause]
        first = group[0]
        sg = sglang_status(first.ending)
        serves = [_serves_cell(group, impl) for impl in IMPLEMENTATIONS]
        lines.append(
            "| "
            + " | ".join(
                [
                    cause.value,
                    ", ".join(c.state.value for c in group),
                    f"{first.ending.outcome.value} ({first.ending.status} / "
                    f"{sg if sg is not None else 'finish reason abort'})",
                    "yes" if router_retries(first.ending) else "no",
                    first.prefill_frees,
                    first.decode_frees,
                    *serves,
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def _serves_cell(group: list[Case], implementation: str) -> str:
    """``yes``, ``no: why``, or ``yes, not in STATES: why`` for one cause's cases."""
    nos = [c for c in group if not c.served_by(implementation).served]
    if not nos:
        return "yes"
    why = "; ".join(dict.fromkeys(c.served_by(implementation).why for c in nos))
    if len(nos) == len(group):
        return f"no: {why}"
    return f"yes, not {', '.join(c.state.value for c in nos)}: {why}"
