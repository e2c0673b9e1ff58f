"""One request on the decode side (:class:`DecodeRequest`), and the side's request tables
with the one way a request changes state (:class:`DecodeRequests`): data and those tables
only; the side's modules change them (:mod:`kvmem.disagg.decode` and its parts), and
nothing here imports them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
import numpy as np

from kvmem.disagg.device import Event, HostCopy
from kvmem.disagg.outcome import Reason
from kvmem.disagg.requests import Requests
from kvmem.disagg.states import DECODE_EDGES, DecodeState
from kvmem.transfer.records import TransferHandle

log = logging.getLogger("kvmem.disagg.decode")  # the side's logger (docs/logging.md)


@dataclass(frozen=True)
class Read:
    """Pull mode: this side's read of pages ``[first, last)`` of a request from the
    prefill's pool, in flight as ``handle``."""

    handle: TransferHandle
    first: int
    last: int


@dataclass
class DecodeRequest:
    """One request on the decode side.  ``state`` is the whole of where it is in the
    lifecycle (:mod:`kvmem.disagg.decode`'s docstring draws the edges); only
    :meth:`DecodeRequests.set_state` changes it.  None of the other fields is part of it:

    * ``free_after_reads``: the prefill's ``ABORT`` arrived while one of this side's own
      reads (pull) targets the pages, a deferred event rather than a state: the request
      stays BOOTED or QUARANTINED (the pages are still that read's target, and
      everything else holds as there) until the reads end, then it is FREED with it.
    * ``reads``: this side's reads in flight (pull), the work queue of BOOTED and
      QUARANTINED.
    * ``busy``: the event after the last device work on its memory (device order, below):
      when it is FREED, its memory waits for that event, whatever the state was.
    * ``reason``: data of QUARANTINED: this side's own abort reason (kept when freed).
    * ``ids`` (BOOTING), ``host_pages`` (from BOOTED), sizes, times, ``pages_done``: data.
    """

    rid: int
    room: int
    tokens: int
    peer: str = ""  # the prefill whose REQ created it
    # None until its REQ enters it (WAITING, WITHHELD): never None in the side's active
    # requests, so typed as what every reader sees
    state: DecodeState = None  # type: ignore[assignment]
    landing_off: int = -1
    landing_nbytes: int = 0
    t_seen: float = 0.0  # last message about this request
    t_quarantined: float | None = None
    pages_done: int = 0  # pages landed and verified, in order
    reason: Reason | None = None
    reads: list[Read] = field(default_factory=list)  # pull: its reads in flight
    free_after_reads: tuple | None = None  # (why, reason) of a free waiting for our reads
    ids: HostCopy | None = None  # booting: its page ids on their way to the host
    host_pages: np.ndarray | None = None  # int64 [pages]: its page ids, on the host
    busy: Event | None = None  # after the last device work on its pages / landing region

    def pages(self, first: int, last: int) -> np.ndarray:
        """Its page ids ``[first, last)`` (int64, on the host), known from BOOTED on;
        RuntimeError before."""
        if self.host_pages is None:
            raise RuntimeError(f"request {self.rid}: page ids asked for before its BOOT")
        return self.host_pages[first:last]


class DecodeRequests(Requests[DecodeRequest, DecodeState]):
    """The decode side's request tables (:class:`~kvmem.disagg.requests.Requests`); its
    edges are those the module docstring of :mod:`kvmem.disagg.decode` draws
    (:data:`~kvmem.disagg.states.DECODE_EDGES`)."""

    side = "decode"
    edges = DECODE_EDGES
    logger = log
