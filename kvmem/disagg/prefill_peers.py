"""The decode peers of the prefill side (:class:`PrefillPeers`, made by
:class:`~kvmem.disagg.prefill.PrefillSide` before its parts, which reach it through their
context): what is kept about each one (:class:`DecodePeer`) and how to tell one.

Several decode peers (``decode_peers``): each request is bound to one of them when it is
added (``add_request(..., peer=)``: routing is the caller's), and everything about a peer
is kept per peer: its pause (``PAUSING`` ends and drains only the requests bound to it,
``PAUSE_ACK`` answers it alone, the others keep flowing), the BOOTs held for its
``META``, the prepared block list of its pool, whether it is gone, and its counters
(``metrics.peers``).  What the peers send, and the handlers that change these records:
:mod:`kvmem.disagg.prefill_messages`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmem.disagg.peers import PeerTable, sole_peer, tell

if TYPE_CHECKING:
    from kvmem.disagg.counters import Metrics
    from kvmem.transfer.engine import TransferEngine

log = logging.getLogger("kvmem.disagg.prefill")  # the side's logger (docs/logging.md)


@dataclass
class DecodePeer:
    """What the prefill side keeps about one decode peer."""

    name: str
    table: PeerTable  # prepared block list of its pool (direct writes), per epoch
    paused: bool = False  # it announced a pause (PAUSING); cleared by its live META
    pause_epoch: int | None = None  # its PAUSE_ACK is due once no write into it is in flight
    held_boots: dict = field(default_factory=dict)  # rid -> BOOT waiting for its META
    gone: bool = False  # the caller said it is dead (peer_gone): no request, no message


class PrefillPeers:
    """The decode peers of one prefill side (``names``, in the order given): a
    :class:`DecodePeer` each (iterating gives them in that order), and :meth:`tell`, the
    one way the side sends a decode a control message (through ``engine``; one that
    cannot go out is counted in ``metrics``).  Every call is O(1), but :meth:`tell_all`
    and :attr:`any_paused`, O(peers)."""

    def __init__(self, engine: TransferEngine, names: tuple[str, ...], metrics: Metrics):
        self.engine, self.names, self.metrics = engine, names, metrics
        self._peers = {n: DecodePeer(n, PeerTable(engine, n)) for n in names}

    def __iter__(self) -> Iterator[DecodePeer]:
        return iter(self._peers.values())

    def bind(self, rid: int, peer: str | None) -> str:
        """The decode peer new request ``rid`` goes to: ``peer``, or the only one when it
        is None.  ValueError (naming the request) when it must be named, is not a decode
        peer of this side, or is gone."""
        if peer is None:
            if len(self.names) != 1:
                raise ValueError(
                    f"add_request: request {rid}: name its decode peer, one of {list(self.names)}"
                )
            peer = self.names[0]
        elif peer not in self._peers:
            raise ValueError(
                f"add_request: request {rid}: {peer!r} is not a decode peer of "
                f"this side ({list(self.names)})"
            )
        if self._peers[peer].gone:
            raise ValueError(f"add_request: request {rid}: decode {peer!r} is gone (peer_gone)")
        return peer

    def tell(self, peer: str, msg: bytes) -> bool:
        """Send ``msg`` to decode ``peer``; False when it did not go out (the peer is gone,
        or cannot be reached: logged and counted)."""
        if self._peers[peer].gone:
            return False  # peer_gone: the caller knows it is dead
        return tell(self.engine, peer, msg, self.metrics, log)

    def tell_all(self, msg: bytes) -> None:
        """Send ``msg`` to every decode peer."""
        for name in self.names:
            self.tell(name, msg)

    @property
    def sole(self) -> str:
        """The decode peer, when there is one (ValueError when there are several)."""
        return sole_peer("decode", self.names, "; name one")

    @property
    def any_paused(self) -> bool:
        """True while a decode peer is paused (announced PAUSING, no live META since)."""
        return any(p.paused for p in self._peers.values())

    def is_paused(self, peer: str) -> bool:
        """Whether decode peer ``peer`` is paused (a router sends new requests elsewhere);
        ValueError when it is not one."""
        return self.get(peer).paused

    def get(self, name: str) -> DecodePeer:
        """What is kept about decode peer ``name`` (ValueError when it is not one)."""
        try:
            return self._peers[name]
        except KeyError:
            raise ValueError(
                f"{name!r} is not a decode peer of this side (peers: {list(self.names)})"
            ) from None

    def find(self, name: str) -> DecodePeer | None:
        """What is kept about decode peer ``name``; None when it is not one."""
        return self._peers.get(name)
