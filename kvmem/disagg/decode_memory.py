"""The decode side's memory (:class:`DecodeMemory`, a base class of
:class:`~kvmem.disagg.decode.DecodeSide`; its methods use the side's fields): the pool
and the landing buffer registered and published, a finished request's pages and landing
region given back in device order.

Device order: the check of a landed chunk and its unpack run on the pool device's stream
(asynchronously on CUDA), and an event (``done_event``) is recorded after them.  A NIXL
write is not ordered with that stream, so a request that ends gives its pages and landing
region back only once its last event is done (owner ``("device-busy", rid)`` in the ledger
meanwhile, quarantined); until then a new BOOT cannot have them.  A check's verdict is a
device tensor that reaches the counters through a HostCopy.  So ``step`` makes no host
sync on CUDA; :attr:`idle` also waits for verdicts and memory still in flight.

Pause and resume (the whole of it released, then back): the side's pause part,
:mod:`kvmem.disagg.decode_pause`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmem.disagg.outcome import Reason
from kvmem.disagg.decode_request import DecodeRequest
from kvmem.disagg.peers import buffer_map
from kvmem.disagg.protocol import meta_message
from kvmem.disagg.states import DecodeState

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    import torch

    from kvmem.disagg.arena import Arena
    from kvmem.disagg.counters import Metrics
    from kvmem.disagg.decode_receive import DecodeReceiving
    from kvmem.disagg.ledger import Ledger


@dataclass(frozen=True)
class _Drain:
    """Memory of an ended request that device work may still touch: the ledger's
    ``owner`` (released with reason ``why``) and the landing offset ``off`` (-1: none),
    given back once ``event`` is done (:meth:`DecodeMemory._drain_device`)."""

    event: Any  # a done event: query() -> bool
    owner: object
    why: str
    off: int


class DecodeMemory:
    """The memory methods of :class:`~kvmem.disagg.decode.DecodeSide` (not a side on its
    own: they read and change the side's requests, pool, landing buffer, ledger and
    engine)."""

    if TYPE_CHECKING:  # what DecodeSide (kvmem/disagg/decode.py) provides
        pool: Any
        alloc: Any
        engine: Any
        transfer_mode: str
        clock: Callable[[], float]
        ledger: Ledger
        metrics: Metrics
        arena: Arena
        landing: torch.Tensor
        _landing_mem: Any
        prefill_peers: tuple[str, ...]
        reqs: dict[int, Any]
        completed: dict[int, Any]
        _rooms: dict[int, int]
        _draining: list[_Drain]
        receiving: DecodeReceiving
        query: Any

        def _tell(self, peer: str, msg: bytes) -> bool: ...
        def _transition(self, *args: Any, **kwargs: Any) -> Any: ...

    def _register(self) -> None:
        # one region per physical chunk; the prefill's landing offsets (RegionMap of these
        # regions) are offsets into self.landing only when they tile it in order
        regions = self._landing_mem.regions()
        buffer_map(self.landing, regions)
        self.engine.register_pool(self.pool, "kv")
        self.engine.register("landing", regions, self.pool.epoch, self.pool.device)
        self.receiving.prep_local()  # pull: a deregister released the last one

    def publish_metadata(self) -> None:
        """``META`` with this side's current metadata, to every prefill."""
        msg = meta_message(self.engine)
        for name in self.prefill_peers:
            self._tell(name, msg)

    def _free(self, req: DecodeRequest, why: str, reason: Reason) -> None:
        """End ``req``: its pages and landing region go back now, or, while device work on
        them (an unpack, a check; CUDA runs it asynchronously) is still queued, once that
        work is done (:meth:`_drain_device`): a NIXL write is not ordered with the
        device's stream, so a page or region reused by a new BOOT at once could receive
        the new request's bytes before the old unpack ran."""
        busy, req.busy = req.busy, None
        if busy is not None and not busy.query():
            owner = ("device-busy", req.rid)
            if self.ledger.holds(req.rid):
                self.ledger.rename(req.rid, owner)
                self.ledger.quarantine(owner)
            self._draining.append(_Drain(busy, owner, why, req.landing_off))
        else:
            if self.ledger.holds(req.rid):
                self.ledger.release(req.rid, why)
            if req.landing_off >= 0:
                self.arena.free(req.landing_off)
        self._transition(req, DecodeState.FREED)
        del self.reqs[req.rid]
        del self._rooms[req.room]
        self.completed[req.rid] = reason
        self.metrics.requests[reason.outcome.value] += 1
        self.metrics.peer(req.peer).requests[reason.outcome.value] += 1

    def _drain_device(self) -> bool:
        """Give back the pages and landing regions of ended requests whose device work is
        done (polled, never waited on); True when some were."""
        keep = []
        for d in self._draining:
            if not d.event.query():
                keep.append(d)
                continue
            if self.ledger.holds(d.owner):
                self.ledger.release(d.owner, d.why)
            if d.off >= 0:
                self.arena.free(d.off)
        moved = len(keep) < len(self._draining)
        self._draining[:] = keep  # in place: the pause part reads this list
        return moved

    def prefault(self) -> None:
        """Back the pool and the landing buffer with memory now, not at first touch."""
        self.pool.prefault()
        self._landing_mem.prefault()
