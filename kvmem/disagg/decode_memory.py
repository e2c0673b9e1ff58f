"""The decode side's memory (:class:`DecodeMemory`, a part each
:class:`~kvmem.disagg.decode.DecodeSide` holds): the pool and the landing buffer
registered, a request's pages and landing region allocated when it boots (``BOOT``
sent once their ids are on the host) and given back in device order when it ends.

Device order: the check of a landed chunk and its unpack run on the pool device's stream
(asynchronously on CUDA), and an event (``done_event``) is recorded after them.  A NIXL
write is not ordered with that stream, so a request that ends gives its pages and landing
region back only once its last event is done (owner ``("device-busy", rid)`` in the ledger
meanwhile, quarantined); until then a new BOOT cannot have them.  A check's verdict is a
device tensor that reaches the counters through a HostCopy.  So ``step`` makes no host
sync on CUDA; the side's ``idle`` also waits for verdicts and memory still in flight.

Pause and resume (the whole of it released, then back): the side's pause part,
:mod:`kvmem.disagg.decode_pause`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import kvmem
from kvmem.disagg.arena import Arena, ArenaFullError
from kvmem.disagg.decode_request import DecodeRequest
from kvmem.disagg.device import Event, HostCopy
from kvmem.disagg.outcome import Reason
from kvmem.disagg.peers import buffer_map
from kvmem.disagg.protocol import AUX_BYTES, encode, encode_runs
from kvmem.disagg.states import DecodeState
from kvmem.memory import make_backend

if TYPE_CHECKING:
    from kvmem.disagg.decode_context import DecodeContext


@dataclass(frozen=True)
class _Drain:
    """Memory of an ended request that device work may still touch: the ledger's
    ``owner`` (released with reason ``why``) and the landing offset ``off`` (-1: none),
    given back once ``event`` is done (:meth:`DecodeMemory.drain_device`)."""

    event: Event  # after the device work that may still touch it
    owner: object
    why: str
    off: int


class DecodeMemory:
    """The memory of one decode side.  It owns the landing buffer (``landing_mem``, its
    tensor ``landing``, of ``landing_bytes``), the arena of its regions (``arena``) and
    the memory of ended requests that device work may still touch (``draining``).  What
    it uses: the side's context (``ctx``: the pool, allocator, engine, ledger, counters
    and clock, how to tell a prefill (the BOOT), and the request tables: a request booted,
    a request finished when its memory goes back).  The first part built."""

    def __init__(self, ctx: DecodeContext, landing_bytes: int):
        self.ctx = ctx
        self.draining: list[_Drain] = []  # freed once the device work on it is done
        self.landing_mem = make_backend(landing_bytes, ctx.pool.device)
        landing = self.landing_mem.tensor
        assert landing is not None  # mapped until the backend is freed
        self.landing: torch.Tensor = landing
        self.arena = Arena(landing_bytes)

    def register(self) -> None:
        """Register the pool (``kv``) and the landing buffer (``landing``, at the pool's
        epoch) with the engine."""
        # one region per physical chunk; the prefill's landing offsets (RegionMap of these
        # regions) are offsets into self.landing only when they tile it in order
        ctx = self.ctx
        regions = self.landing_mem.regions()
        buffer_map(self.landing, regions)
        ctx.engine.register_pool(ctx.pool, "kv")
        ctx.engine.register("landing", regions, ctx.pool.epoch, ctx.pool.device)

    def boot(self, req: DecodeRequest) -> bool:
        """Allocate the request's pages and landing region and send BOOT (once their ids
        are on the host: at once on the CPU, at a later step on CUDA, BOOTING meanwhile);
        False (nothing changed) when there is no memory for it yet."""
        ctx = self.ctx
        n = -(-req.tokens // ctx.spec.page_size)
        nbytes = kvmem.packed_nbytes(ctx.spec, n) + AUX_BYTES
        if n > ctx.alloc.num_free:
            return False  # retried next step
        try:
            off = self.arena.alloc(nbytes)
        except ArenaFullError:
            return False
        pages = ctx.alloc.alloc(n, check=False)  # n <= num_free: no host sync on CUDA
        ctx.ledger.hold(req.rid, pages)
        req.landing_off, req.landing_nbytes = off, nbytes
        req.ids = HostCopy(pages)
        ctx.requests.set_state(req, DecodeState.BOOTING)
        req.t_seen = ctx.clock()
        self.send_boot(req)
        return True

    def send_boot(self, req: DecodeRequest) -> bool:
        """Send the BOOT of a booting request once its page ids are on the host; False
        while their copy is in flight."""
        assert req.ids is not None  # BOOTING: the copy boot started
        if not req.ids.ready():
            return False
        ctx = self.ctx
        req.host_pages, req.ids = req.ids.numpy(), None
        ctx.requests.set_state(req, DecodeState.BOOTED)
        req.t_seen = ctx.clock()
        ctx.peers.tell(
            req.peer,
            encode(
                "BOOT",
                rid=req.rid,
                room=req.room,
                off=req.landing_off,
                nbytes=req.landing_nbytes,
                epoch=ctx.pool.epoch,
                pages=encode_runs(req.host_pages),
            ),
        )
        return True

    def free(self, req: DecodeRequest, why: str, reason: Reason) -> None:
        """End ``req``: its pages and landing region go back now, or, while device work on
        them (an unpack, a check; CUDA runs it asynchronously) is still queued, once that
        work is done (:meth:`drain_device`): a NIXL write is not ordered with the
        device's stream, so a page or region reused by a new BOOT at once could receive
        the new request's bytes before the old unpack ran."""
        ledger = self.ctx.ledger
        busy, req.busy = req.busy, None
        if busy is not None and not busy.query():
            owner = ("device-busy", req.rid)
            if ledger.holds(req.rid):
                ledger.rename(req.rid, owner)
                ledger.quarantine(owner)
            self.draining.append(_Drain(busy, owner, why, req.landing_off))
        else:
            if ledger.holds(req.rid):
                ledger.release(req.rid, why)
            if req.landing_off >= 0:
                self.arena.free(req.landing_off)
        self.ctx.requests.set_state(req, DecodeState.FREED)
        self.ctx.requests.finish(req, reason)

    def drain_device(self) -> bool:
        """Give back the pages and landing regions of ended requests whose device work is
        done (polled, never waited on); True when some were."""
        keep, ledger = [], self.ctx.ledger
        for d in self.draining:
            if not d.event.query():
                keep.append(d)
                continue
            if ledger.holds(d.owner):
                ledger.release(d.owner, d.why)
            if d.off >= 0:
                self.arena.free(d.off)
        moved = len(keep) < len(self.draining)
        self.draining = keep
        return moved

    def prefault(self) -> None:
        """Back the pool and the landing buffer with memory now, not at first touch."""
        self.ctx.pool.prefault()
        self.landing_mem.prefault()
