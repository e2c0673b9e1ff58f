"""The prefill peers of the decode side (:class:`DecodePeers`, made by
:class:`~kvmem.disagg.decode.DecodeSide` before its parts, which reach it through their
context): their names, the prepared block list of each one's pool, and how to tell one,
or all of them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvmem.disagg.peers import PeerTable, sole_peer, tell
from kvmem.disagg.protocol import meta_message

if TYPE_CHECKING:
    from kvmem.disagg.counters import Metrics
    from kvmem.transfer.engine import TransferEngine

log = logging.getLogger("kvmem.disagg.decode")  # the side's logger (docs/logging.md)


class DecodePeers:
    """The prefill peers of one decode side (``names``, in the order given): the prepared
    block list of each one's pool (``tables``: name -> :class:`~kvmem.disagg.peers.PeerTable`,
    what this side's reads use in pull mode), and :meth:`tell`, the one way the side sends
    a prefill a control message (through ``engine``; one that cannot go out is logged and
    counted in ``metrics``)."""

    def __init__(self, engine: TransferEngine, names: tuple[str, ...], metrics: Metrics):
        self.engine, self.names, self.metrics = engine, names, metrics
        self.tables = {n: PeerTable(engine, n) for n in names}

    def tell(self, peer: str, msg: bytes) -> bool:
        """Send ``msg`` to prefill ``peer``; False when it did not go out (it cannot be
        reached: logged and counted)."""
        return tell(self.engine, peer, msg, self.metrics, log)

    def publish_metadata(self) -> None:
        """``META`` with this side's current metadata, to every prefill."""
        msg = meta_message(self.engine)
        for name in self.names:
            self.tell(name, msg)

    @property
    def sole(self) -> str:
        """The prefill peer, when there is one (ValueError when there are several)."""
        return sole_peer("prefill", self.names)
