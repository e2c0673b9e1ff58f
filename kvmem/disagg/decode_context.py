"""What the parts of one decode side share (:class:`DecodeContext`) and the side's
settings (:class:`DecodeConfig`): made once by :class:`~kvmem.disagg.decode.DecodeSide`
before its parts, and handed to each of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmem.allocator import PageAllocator
    from kvmem.disagg.counters import Metrics
    from kvmem.disagg.decode_peers import DecodePeers
    from kvmem.disagg.decode_request import DecodeRequests
    from kvmem.disagg.device import Event
    from kvmem.disagg.ledger import Ledger
    from kvmem.disagg.model import Verifier
    from kvmem.pool import KVPool
    from kvmem.spec import KVSpec
    from kvmem.transfer.engine import TransferEngine


@dataclass(frozen=True)
class DecodeConfig:
    """The settings of one decode side, as :class:`~kvmem.disagg.decode.DecodeSide` took
    and checked them."""

    transfer_mode: str  # "push": the prefills write; "pull": this side reads their offers
    timeout: float  # seconds a request may go without news from its prefill
    quarantine_timeout: float  # seconds quarantined pages wait for the prefill's ABORT


@dataclass(frozen=True)
class DecodeContext:
    """What the parts of one decode side share.  Each part holds this and the parts built
    before it, never a later one: the memory, the receiving, the pause, in that order.

    ``done_event()`` records an event after the device work queued so far on a
    request's memory (:func:`~kvmem.disagg.device.device_event`)."""

    spec: KVSpec
    pool: KVPool
    alloc: PageAllocator
    engine: TransferEngine
    ledger: Ledger  # who holds which pages of ``alloc``
    metrics: Metrics  # the side's counters
    clock: Callable[[], float]
    verifier: Verifier  # what the landed KV is checked against
    done_event: Callable[[], Event]
    requests: DecodeRequests  # the request tables, and their state changes
    peers: DecodePeers  # the prefill peers: their block lists, how to tell one
    config: DecodeConfig
