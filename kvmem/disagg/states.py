"""The request states of both PD sides, the edges between them, and the one check every
state change goes through (:func:`check_edge`); each side's pause phases and their
edges, checked the same way (:func:`set_phase`).

Each side's module docstring draws its edges (:mod:`kvmem.disagg.prefill`,
:mod:`kvmem.disagg.decode`); the tables here are what the code enforces, and
tests/disagg/test_states.py reads the drawings and compares them with these tables.  An
edge is ``(from, to)``; ``from`` is None for the state a request enters in.  A state is a
value of its side's enum; what a state waits for, and the fields that are data of a state
rather than part of it, are documented on the request classes of each side.
"""

from __future__ import annotations

import enum
import logging

from kvmem.disagg.outcome import KVPoll
from kvmem.errors import KVMemError


class PrefillState(enum.StrEnum):
    """A prefill request's state.  :attr:`poll` is the sglang ``KVPoll`` it reports."""

    BOOTSTRAPPING = "bootstrapping"  # REQ sent; waits for the decode's BOOT
    WAITING_FOR_INPUT = "waiting_for_input"  # booted; no chunk posted yet
    TRANSFERRING = "transferring"  # a chunk posted, not the last one
    KV_POSTED = "kv_posted"  # the last KV chunk posted; the AUX follows once they are DONE
    AUX_STAGED = "aux_staged"  # the AUX copied into staging, posted once that copy is done
    AUX_POSTED = "aux_posted"  # the AUX write posted; success once it is DONE
    ENDING = "ending"  # ended early; ABORT to the decode once no transfer is in flight
    SUCCEEDED = "succeeded"  # finished: KV and AUX delivered
    FAILED = "failed"  # finished early: the decode was told (ABORT)

    @property
    def poll(self) -> KVPoll:
        """The sglang state this one reports (``PrefillSide.state``)."""
        return _POLL[self]

    @property
    def ended(self) -> bool:
        """True from ENDING on: nothing more is scheduled, staged or posted for it."""
        return self in _PREFILL_ENDED


_POLL = {
    PrefillState.BOOTSTRAPPING: KVPoll.Bootstrapping,
    PrefillState.WAITING_FOR_INPUT: KVPoll.WaitingForInput,
    PrefillState.TRANSFERRING: KVPoll.Transferring,
    PrefillState.KV_POSTED: KVPoll.Transferring,
    PrefillState.AUX_STAGED: KVPoll.Transferring,
    PrefillState.AUX_POSTED: KVPoll.Transferring,
    PrefillState.ENDING: KVPoll.Failed,
    PrefillState.SUCCEEDED: KVPoll.Success,
    PrefillState.FAILED: KVPoll.Failed,
}
_PREFILL_ENDED = frozenset({PrefillState.ENDING, PrefillState.SUCCEEDED, PrefillState.FAILED})

_P = PrefillState
PREFILL_EDGES: frozenset = frozenset(
    {
        (None, _P.BOOTSTRAPPING),
        (_P.BOOTSTRAPPING, _P.WAITING_FOR_INPUT),
        (_P.WAITING_FOR_INPUT, _P.TRANSFERRING),
        (_P.TRANSFERRING, _P.TRANSFERRING),
        (_P.WAITING_FOR_INPUT, _P.KV_POSTED),
        (_P.TRANSFERRING, _P.KV_POSTED),
        (_P.KV_POSTED, _P.AUX_STAGED),
        (_P.AUX_STAGED, _P.AUX_POSTED),
        (_P.AUX_POSTED, _P.SUCCEEDED),
        *(
            (s, _P.ENDING)
            for s in (
                _P.BOOTSTRAPPING,
                _P.WAITING_FOR_INPUT,
                _P.TRANSFERRING,
                _P.KV_POSTED,
                _P.AUX_STAGED,
                _P.AUX_POSTED,
            )
        ),
        (_P.ENDING, _P.FAILED),
    }
)


class DecodeState(enum.StrEnum):
    """A decode request's state (its value is the name the docs and logs use)."""

    WAITING = "waiting"  # REQ seen; no memory for it yet (retried each step)
    WITHHELD = "withheld"  # never booted (DecodeFaults.withhold_boot): the prefill times out
    BOOTING = "booting"  # pages and landing region allocated; their ids on the way to the host
    BOOTED = "booted"  # BOOT sent: chunks land and are verified, the AUX completes it
    QUARANTINED = "quarantined"  # aborted here (ABORT_REQ sent): held until the prefill's ABORT
    FREED = "freed"  # finished: pages and landing region given back (once the device is done)


_D = DecodeState
DECODE_EDGES: frozenset = frozenset(
    {
        (None, _D.WAITING),
        (None, _D.WITHHELD),
        (_D.WAITING, _D.BOOTING),
        (_D.BOOTING, _D.BOOTED),
        *((s, _D.QUARANTINED) for s in (_D.WAITING, _D.WITHHELD, _D.BOOTING, _D.BOOTED)),
        *((s, _D.FREED) for s in (_D.WAITING, _D.WITHHELD, _D.BOOTING, _D.BOOTED, _D.QUARANTINED)),
    }
)


class PausePhase(enum.StrEnum):
    """Where a side is in a pause (each side's ``pause.phase``)."""

    SERVING = "serving"  # no pause: requests are scheduled, booted, sent
    DRAINING = "draining"  # prefill: its requests ended (503), their transfers draining;
    #                        decode: PAUSING sent, waiting for every prefill's PAUSE_ACK
    READS = "reads"  # decode, pull: acknowledged, its own reads into its pool draining
    FREEING = "freeing"  # decode: requests freed, device work on their memory still queued
    PAUSED = "paused"  # the memory is released; resume() serves again


_S = PausePhase
PREFILL_PAUSE_EDGES: frozenset = frozenset(
    {(_S.SERVING, _S.DRAINING), (_S.DRAINING, _S.PAUSED), (_S.PAUSED, _S.SERVING)}
)
DECODE_PAUSE_EDGES: frozenset = frozenset(
    {
        (_S.SERVING, _S.DRAINING),
        (_S.DRAINING, _S.READS),
        (_S.DRAINING, _S.FREEING),
        (_S.DRAINING, _S.PAUSED),
        (_S.READS, _S.FREEING),
        (_S.READS, _S.PAUSED),
        (_S.FREEING, _S.PAUSED),
        (_S.PAUSED, _S.SERVING),
    }
)


class IllegalPhase(KVMemError, RuntimeError):
    """A side tried to change its pause phase along an edge its table does not have (a
    bug in the side); ``side``, ``src``, ``dst``; the phase is unchanged."""

    def __init__(self, side: str, src: PausePhase, dst: PausePhase):
        self.side, self.src, self.dst = side, src, dst
        super().__init__(f"{side}: no pause phase edge {src.name} -> {dst.name}")


def set_phase(side: str, edges: frozenset, obj, to: PausePhase, log: logging.Logger) -> None:
    """Move ``obj.phase`` to ``to`` along an edge of ``edges`` (logged at DEBUG);
    :class:`IllegalPhase`, ``obj`` unchanged, for any other."""
    if (obj.phase, to) not in edges:
        raise IllegalPhase(side, obj.phase, to)
    log.debug("%s: pause phase %s, now %s", side, obj.phase.name, to.name)
    obj.phase = to


class IllegalTransition(KVMemError, RuntimeError):
    """A side tried to move a request along an edge its table does not have.  A bug in the
    side, never an answer to a peer: the handlers refuse a message that does not fit the
    state (ProtocolError) before they change anything.  ``side`` ("prefill" or "decode"),
    ``rid``, ``src`` (None: a new request) and ``dst``; the request is unchanged."""

    def __init__(self, side: str, rid: int, src, dst):
        self.side, self.rid, self.src, self.dst = side, rid, src, dst
        name = "(new)" if src is None else src.name
        super().__init__(
            f"{side}: request {rid}: no edge {name} -> {dst.name} in the {side}'s state table"
        )


def check_edge(side: str, edges: frozenset, rid: int, src, dst) -> None:
    """Raise :class:`IllegalTransition` unless ``(src, dst)`` is in ``edges``.  O(1)."""
    if (src, dst) not in edges:
        raise IllegalTransition(side, rid, src, dst)


def transition(side: str, edges: frozenset, req, to, log: logging.Logger) -> None:
    """Move ``req`` (a request of ``side``: its ``rid`` and ``state``, None while new) to
    ``to`` along an edge of ``edges``, and log the change on ``log`` at DEBUG
    (``prefill: request 3: TRANSFERRING -> KV_POSTED``); :class:`IllegalTransition`, ``req``
    unchanged, for any other."""
    check_edge(side, edges, req.rid, req.state, to)
    log.debug(
        "%s: request %d: %s -> %s",
        side,
        req.rid,
        "(new)" if req.state is None else req.state.name,
        to.name,
    )
    req.state = to
