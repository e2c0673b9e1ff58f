"""The dispatch table of a side's peer messages (:class:`Handlers`): each kind of message
the side receives and the bound method that applies it, one :class:`Route` each, built
once with the side's parts.  The messages and their parser: :mod:`kvmem.disagg.protocol`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from kvmem.disagg.outcome import ProtocolError


class Message(Protocol):
    """A typed control message (:mod:`kvmem.disagg.protocol`): ``t`` is its wire type."""

    t: ClassVar[str]


M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class Route(Generic[M]):
    """Messages of class ``kind`` go to ``handle(msg, peer)``; the two are typed together,
    so a handler takes exactly the kind routed to it."""

    kind: type[M]
    handle: Callable[[M, str], None]


class Handlers:
    """The dispatch table of one side (``receiver``: "prefill" or "decode"): message class
    -> the bound method that applies it, taking ``(msg, peer)``; one :class:`Route` per
    kind (typed there: the table itself cannot say which callable takes which class).
    Calling it applies one validated message (:func:`~kvmem.disagg.protocol.parse`) from
    ``peer``; ProtocolError, nothing changed, when ``peer`` is not one of ``peers`` (named
    as a ``sender`` peer) or no route takes the message's class (a message of the other
    direction).  O(1) a message."""

    def __init__(
        self,
        receiver: str,
        sender: str,
        peers: Collection[str],
        routes: tuple[Route[Any], ...],
    ):
        self.receiver, self.sender = receiver, sender
        self._peers = frozenset(peers)
        self._table: dict[type[Message], Callable[[Any, str], None]] = {
            r.kind: r.handle for r in routes
        }
        assert len(self._table) == len(routes), "a message kind routed twice"

    @property
    def kinds(self) -> frozenset[str]:
        """The wire types (``"REQ"``, ``"BOOT"``, ...) of the messages routed here."""
        return frozenset(kind.t for kind in self._table)

    def __call__(self, msg: Message, peer: str) -> None:
        if peer not in self._peers:
            raise ProtocolError(f"message from {peer!r}, not a {self.sender} peer of this side")
        handle = self._table.get(type(msg))
        if handle is None:
            raise ProtocolError(
                f"unexpected message {type(msg).__name__} on the {self.receiver} side"
            )
        handle(msg, peer)
