"""The request tables of one PD side and the one way its requests change state
(:class:`Requests`).  Each side has one, of its own kind (``PrefillRequests`` in
:mod:`kvmem.disagg.prefill_request`, ``DecodeRequests`` in
:mod:`kvmem.disagg.decode_request`), and the side's parts reach the requests through it:
no other object keeps a table of requests."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar, Generic, Protocol, TypeVar

from kvmem.disagg.states import transition

if TYPE_CHECKING:
    from kvmem.disagg.counters import Metrics
    from kvmem.disagg.outcome import Reason


class Request(Protocol):
    """What the tables need of a request (both sides' request classes have it)."""

    @property
    def rid(self) -> int: ...

    @property
    def room(self) -> int: ...

    @property
    def peer(self) -> str: ...

    @property
    def state(self) -> enum.Enum: ...


R = TypeVar("R", bound=Request)
S = TypeVar("S", bound=enum.Enum)


class Requests(Generic[R, S]):
    """The requests of one side: the active ones by id (:attr:`active`), the bootstrap
    room each holds (:meth:`room_holder`), and of each finished one how it ended
    (:attr:`finished`) and the peer it was bound to (:attr:`finished_peer`); and the one
    way a request changes state (:meth:`set_state`), along the side's drawn ``edges``.

    Always true: a request is in :attr:`active` from :meth:`add` to :meth:`finish`, and
    its room is held exactly as long; an id is never both active and finished (a finished
    id added again is forgotten as finished); a state changes only along ``edges``
    (:class:`~kvmem.disagg.states.IllegalTransition` otherwise, the request unchanged),
    and a request leaves :attr:`active` only in a final state (one no edge leaves).
    Every call is O(1).  The three mappings are read-only views, live."""

    side: ClassVar[str]  # "prefill" or "decode": named in errors and the DEBUG log
    edges: ClassVar[frozenset]  # the side's drawn edges, (from, to); from None: entry
    logger: ClassVar[logging.Logger]  # the side's logger (docs/logging.md)

    def __init__(self, metrics: Metrics, on_finish: Callable[[int, Reason], object] | None = None):
        """``metrics``: the side's counters (a finished request is counted there by
        outcome, in total and for its peer); ``on_finish(rid, reason)``: the caller's,
        called as each request finishes, last."""
        self._metrics, self._on_finish = metrics, on_finish
        # the states no edge leaves: a request finishes in one of them
        self._final = frozenset(b for _, b in self.edges) - {a for a, _ in self.edges}
        self._active: dict[int, R] = {}
        self._rooms: dict[int, int] = {}  # room -> id of the active request holding it
        self._finished: dict[int, Reason] = {}
        self._finished_peer: dict[int, str] = {}
        self.active: Mapping[int, R] = MappingProxyType(self._active)
        self.finished: Mapping[int, Reason] = MappingProxyType(self._finished)
        self.finished_peer: Mapping[int, str] = MappingProxyType(self._finished_peer)

    def find(self, rid: int) -> R | None:
        """The active request ``rid``; None when there is none."""
        return self._active.get(rid)

    def room_holder(self, room: int) -> int | None:
        """The id of the active request holding bootstrap room ``room``; None when free."""
        return self._rooms.get(room)

    def add(self, req: R, to: S) -> None:
        """Enter ``req`` (new: no state yet) in state ``to`` along an entry edge, and make
        it active; an earlier finished request of its id is forgotten.  The side has
        refused an id or a room in use before (with the error its caller is owed)."""
        assert req.rid not in self._active and req.room not in self._rooms, (req.rid, req.room)
        self.set_state(req, to)
        self._active[req.rid] = req
        self._rooms[req.room] = req.rid
        self._finished.pop(req.rid, None)
        self._finished_peer.pop(req.rid, None)

    def set_state(self, req: R, to: S) -> None:
        """Move ``req`` to ``to`` along a drawn edge (logged at DEBUG:
        ``prefill: request 3: TRANSFERRING -> KV_POSTED``); IllegalTransition naming the
        request and both states, ``req`` unchanged, for any other."""
        transition(self.side, self.edges, req, to, self.logger)

    def finish(self, req: R, reason: Reason) -> None:
        """``req``, moved to a final state already (:meth:`set_state`), is over: no longer
        active, its room free, ``reason`` kept as how it ended (and its peer), counted by
        outcome in the side's counters (in total and for its peer); then ``on_finish``."""
        assert req.state in self._final, (req.rid, req.state)  # the caller's set_state
        del self._active[req.rid]
        del self._rooms[req.room]
        self._finished[req.rid] = reason
        self._finished_peer[req.rid] = req.peer
        self._metrics.requests[reason.outcome.value] += 1
        self._metrics.peer(req.peer).requests[reason.outcome.value] += 1
        if self._on_finish is not None:
            self._on_finish(req.rid, reason)
