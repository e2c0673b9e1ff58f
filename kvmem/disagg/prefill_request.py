"""One request on the prefill side (:class:`PrefillRequest`) and the records of its
transfers: a chunk forwarded and not staged yet (:class:`PendingChunk`), its page ids on
their way to the host (:class:`IdsCopy`), a chunk or the AUX staged and not posted yet
(:class:`_Staged`, of the kinds :class:`_Send`), a transfer in flight
(:class:`InFlight`), a pull offer (:class:`Offer`).  The queued ones are frozen.  The
fault-injection points of the side (:class:`Faults`), and the side's request tables with
the one way a request changes state (:class:`PrefillRequests`).  Data and those tables
only: the side's modules change them (:mod:`kvmem.disagg.prefill` and its parts); nothing
here imports them.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np
import torch

from kvmem.disagg.device import Event, HostCopy
from kvmem.disagg.outcome import Reason
from kvmem.disagg.peers import RegionMap
from kvmem.disagg.requests import Requests
from kvmem.disagg.states import PREFILL_EDGES, PrefillState
from kvmem.transfer.records import TransferHandle, XferState

log = logging.getLogger("kvmem.disagg.prefill")  # the side's logger (docs/logging.md)


@dataclass(frozen=True)
class PendingChunk:
    """A chunk whose forward is done, not staged yet: pages ``[first, last)`` of the
    request; ``final``: its last chunk."""

    first: int
    last: int
    final: bool


@dataclass(frozen=True)
class IdsCopy:
    """The page ids of pages ``[first, last)`` of a request, on their way to the host."""

    first: int
    last: int
    copy: HostCopy


@dataclass
class Offer:
    """Pull mode: pages [first, last) offered to the decode (``READY``), which reads them
    from this side's pool.  ``state``: PROC until the decode's ``PULLED`` (DONE or ERR) or
    the quarantine timeout (ERR, logged), the words of a write's handle."""

    first: int
    last: int
    nbytes: int
    t_sent: float
    state: XferState = XferState.PROC
    error: str | None = None


class InFlight(NamedTuple):
    """A transfer of a request in flight (one at a time): ``op`` is the TransferHandle of
    a write this side posted (polled until DONE or ERR) or an :class:`Offer` (pull: the
    decode reads, and answers)."""

    op: TransferHandle | Offer
    staging_off: int | None  # the staging slot a packed chunk or the AUX is written from

    @property
    def reads_pages(self) -> bool:
        """No staging slot: the transfer reads the request's pool pages (a direct write, or
        the decode's read of an offer), so they stay held until it ends."""
        return self.staging_off is None


class _Send(enum.Enum):
    """What a staged transfer is."""

    PACKED = "packed"  # a chunk packed into a staging slot, written into the landing region
    DIRECT = "direct"  # a chunk written from this pool's pages into the decode's (post_blocks)
    OFFER = "offer"  # pull: a chunk offered (READY); the decode reads this pool's pages
    AUX = "aux"  # the extra state, copied into a staging slot, written after the last chunk


@dataclass(frozen=True)
class _Staged:
    """A transfer staged and not posted yet: posted once ``ready`` says the bytes it sends
    are written (the pack, the AUX copy or the forward is done on the device)."""

    kind: _Send
    nbytes: int
    remote_off: int  # offset within the request's landing region
    final: bool  # the request's last chunk
    ready: Event  # after the device work that writes the bytes it sends
    notif: bytes = b""  # CHUNK or AUX (PACKED, DIRECT, AUX)
    off: int | None = None  # staging offset (PACKED, AUX)
    # DIRECT: (local block indices, remote block indices)
    blocks: tuple[np.ndarray, np.ndarray] | None = None
    pages: tuple[int, int] | None = None  # OFFER: (first, last)

    @property
    def aux(self) -> bool:
        return self.kind is _Send.AUX


@dataclass
class PrefillRequest:
    """One request on the prefill side.  ``state`` is the whole of where it is in the
    lifecycle (:mod:`kvmem.disagg.prefill`'s docstring draws the edges); only
    :meth:`PrefillRequests.set_state` changes it.  None of the other fields is part of it:

    * ``in_batch``: its chunk's forward is running (from ``step``'s schedule to
      ``fill_batch``).  Orthogonal: a WAITING_FOR_INPUT or TRANSFERRING request runs the
      forward of its next chunk while the write of the one before is in flight, and the
      state says what its transfers wait for, not the model.
    * ``abort_pending`` (and ``t_abort``): an abort that arrived while ``in_batch``, a
      deferred event rather than a state: the request stays where it is until
      ``fill_batch`` of the same step applies it (ENDING), before its chunk is packed.
    * ``pending``, ``staged``, ``handles``: its work queue, in order: chunks forwarded and
      not staged yet; the one transfer staged and not posted; the transfers in flight (one
      at a time).  What is queued, whatever the state.
    * ``reason``: data of ENDING, FAILED and SUCCEEDED: how it ends.
    * The rest: sizes, page ids, the BOOT's landing region and kv, counters: data.
    """

    rid: int
    room: int
    tokens: int
    peer: str = ""  # the decode peer the request is bound to
    # None until add_request enters it (BOOTSTRAPPING): never None in the side's active
    # requests, so typed as what every reader sees
    state: PrefillState = None  # type: ignore[assignment]
    t_created: float = 0.0
    t_bootstrapped: float | None = None
    done_tokens: int = 0  # tokens whose KV the forward produced
    last_loc: torch.Tensor | None = None  # int64 [1] on the device: slot of the last token
    # int64 [pages]: its page ids, known on the host up to ids_known
    host_pages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    ids_known: int = 0  # host_pages[:ids_known] are filled in
    ids: list[IdsCopy] = field(default_factory=list)  # chunks' page ids, in chunk order
    seq: int = 0  # chunks posted
    landing_off: int = -1
    landing_nbytes: int = 0
    remote: object = None  # RemoteMemory of the decode's landing buffer
    landing_map: RegionMap | None = None  # offsets of ``remote``'s regions
    staged: _Staged | None = None  # packed, waiting for its ready event to be posted
    handles: list[InFlight] = field(default_factory=list)  # transfers (one at a time)
    pending: list[PendingChunk] = field(default_factory=list)  # chunks to stage, in order
    in_batch: bool = False
    abort_pending: Reason | None = None
    t_abort: float | None = None
    reason: Reason | None = None  # ENDING, FAILED, SUCCEEDED: how it ends
    dpages: np.ndarray | None = None  # the decode's page ids of this request (its BOOT)
    kv: object = None  # RemoteMemory of the decode's kv those ids belong to (its BOOT's epoch)


class Aborts(Protocol):
    """What a fault hook is handed of the side: its ``abort``
    (:meth:`kvmem.disagg.prefill.PrefillSide.abort`)."""

    def abort(self, rid: int, status: int = ..., message: str | None = ...) -> None: ...


class Faults:
    """Fault-injection points (the demo and the tests override them); defaults inject
    nothing."""

    def fail_send(self, rid: int, seq: int, aux: bool) -> bool:
        """True: treat the write of chunk ``seq`` (or the AUX write) as refused."""
        return False

    def stall(self, rid: int, seq: int) -> bool:
        """True: do not schedule chunk ``seq`` of ``rid`` now (slow request)."""
        return False

    def during_forward(self, side: Aborts, batch: list) -> None:
        """Called while the batch's forward runs (aborts land here): ``side`` is the
        prefill side, ``batch`` its ``[(request, first_page, last_page)]``."""


class PrefillRequests(Requests[PrefillRequest, PrefillState]):
    """The prefill side's request tables (:class:`~kvmem.disagg.requests.Requests`); its
    edges are those the module docstring of :mod:`kvmem.disagg.prefill` draws
    (:data:`~kvmem.disagg.states.PREFILL_EDGES`)."""

    side = "prefill"
    edges = PREFILL_EDGES
    logger = log
