"""What the parts of one prefill side share (:class:`PrefillContext`) and the side's
settings (:class:`PrefillConfig`): made once by :class:`~kvmem.disagg.prefill.PrefillSide`
before its parts, and handed to each of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmem.allocator import PageAllocator
    from kvmem.disagg.counters import Metrics
    from kvmem.disagg.device import Event
    from kvmem.disagg.ledger import Ledger
    from kvmem.disagg.prefill_peers import PrefillPeers
    from kvmem.disagg.prefill_request import Faults, PrefillRequests
    from kvmem.disagg.prefill_staging import Staging
    from kvmem.pool import KVPool
    from kvmem.spec import KVSpec
    from kvmem.transfer.engine import TransferEngine


@dataclass(frozen=True)
class PrefillConfig:
    """The settings of one prefill side, as :class:`~kvmem.disagg.prefill.PrefillSide`
    took and checked them."""

    transfer_mode: str  # "push": this side writes each chunk; "pull": it offers them
    chunk_tokens: int  # tokens a chunk holds at most (a multiple of page_size)
    max_batch_tokens: int  # tokens one step forwards at most
    bootstrap_timeout: float  # seconds a request may wait for its BOOT
    transfer_timeout: float  # seconds from its BOOT a request may take to transfer
    quarantine_timeout: float  # pull: seconds offered pages stay held without a PULLED


@dataclass(frozen=True)
class PrefillContext:
    """What the parts of one prefill side share.  Each part holds this and the parts
    built before it, never a later one: the scheduler, the ending, the sending, the
    messages, the pause, in that order.

    ``faults()`` gives the side's fault hooks now (the caller may replace them:
    ``PrefillSide.faults``); ``ready_event()`` records an event after the device work
    queued so far (:func:`~kvmem.disagg.device.device_event`)."""

    spec: KVSpec
    pool: KVPool
    alloc: PageAllocator
    engine: TransferEngine
    ledger: Ledger  # who holds which pages of ``alloc``
    metrics: Metrics  # the side's counters
    clock: Callable[[], float]
    faults: Callable[[], Faults]
    ready_event: Callable[[], Event]
    requests: PrefillRequests  # the request tables, and their state changes
    peers: PrefillPeers  # the decode peers: what is kept about each, how to tell one
    staging: Staging  # the registered staging buffer and its slots
    config: PrefillConfig
