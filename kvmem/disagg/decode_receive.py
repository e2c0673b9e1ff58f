"""What lands on the decode side and how it is checked (:class:`DecodeReceiving`, a part
each :class:`~kvmem.disagg.decode.DecodeSide` holds): a ``CHUNK`` (packed, verified in
the landing region and unpacked; or direct, verified in the pool pages), a ``READY``
read into the request's pages and polled (pull), the ``AUX`` that completes a request;
each check's verdict reaches the counters in order, without a host sync.  The landing
rules are drawn in :mod:`kvmem.disagg.decode`.

A packed chunk lands in the request's *landing region* (a registered buffer, one region
per request, sized for its whole KV plus the extra state) and its notification
(``CHUNK``) arrives after the bytes: the chunk is verified against what the prefill
computed (the verifier's ``verify``, :class:`~kvmem.disagg.model.Verifier`) and unpacked
into the request's pages with ``unpack_pages``.  A *direct* chunk (``CHUNK`` with
``direct``) was written straight into the request's pool pages (their ids went to the
prefill in ``BOOT``): it is verified there (the verifier's ``verify_pages``) and nothing
is unpacked.  The quarantine holds the request's pool pages and landing region alike:
both may be the target of a posted write.

Pull mode (``transfer_mode="pull"``): the prefill offers each chunk (``READY``: its own
page ids and pool epoch); this side reads them into the request's pool pages (one
``post_blocks`` READ, prepared block lists), verifies them in place once DONE and
answers ``PULLED`` (ok or failed).  A read built from the prefill's older metadata is
refused before it is posted (answered failed).  Pages that one of this side's own reads
targets are never freed before that read is DONE or ERR (an ``ABORT``, the quarantine
timeout and a ``PAUSE_ACK`` wait for it).  The extra state still arrives as the
prefill's AUX write.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

import kvmem
from kvmem.disagg.device import HostCopy, to_device
from kvmem.disagg.decode_request import DecodeRequest, Read
from kvmem.disagg.outcome import OK, ProtocolError, Reason
from kvmem.disagg.protocol import AUX_BYTES, Aux, Chunk, Ready, decode_runs, encode
from kvmem.disagg.states import DecodeState
from kvmem.transfer.errors import StaleEpochError, TransferError

if TYPE_CHECKING:
    from kvmem.disagg.decode_context import DecodeContext
    from kvmem.disagg.decode_memory import DecodeMemory
    from kvmem.transfer.records import BlockTable

log = logging.getLogger("kvmem.disagg.decode")  # the side's logger (docs/logging.md)

# the states CHUNK, AUX and READY may name (BOOT sent, not freed yet)
_RECEIVING = frozenset({DecodeState.BOOTED, DecodeState.QUARANTINED})


@dataclass(frozen=True)
class _Check:
    """A check's verdict on its way to the host (:meth:`DecodeReceiving.apply_checks`):
    ``nbytes`` of request ``rid``'s pages ``[first, last)``; ``bad``: what a mismatch
    means (logged), or None."""

    copy: HostCopy
    nbytes: int
    rid: int
    first: int
    last: int
    bad: str | None


class DecodeReceiving:
    """What lands on one decode side, and its checks.  It owns the verdicts on their way
    to the host (``checks``, in order), the count of what landed by how (``chunk_modes``)
    and, in pull mode, the prepared block list of this side's pool its reads write into
    (``local_table``, :meth:`prep_local`).  What it uses: the side's context (``ctx``: the
    pool, engine, verifier, counters, ledger, clock, done events and settings, the request
    tables, the prefills' prepared lists and how to tell one), and the part built before
    it, ``memory`` (the landing buffer; a request's memory given back when it ends)."""

    def __init__(self, ctx: DecodeContext, memory: DecodeMemory):
        self.ctx, self.memory = ctx, memory
        self.checks: list[_Check] = []  # verdicts on their way to the host, in order
        self.chunk_modes: Counter = Counter()  # landed: "packed" / "direct" / "pulled"
        self.local_table: BlockTable | None = None  # pull: prepared block list of our pool

    def prep_local(self) -> None:
        """Pull: prepare the block list of this side's pool (its ``kv`` registration,
        just registered); None otherwise."""
        self.local_table = None
        if self.ctx.config.transfer_mode == "pull":
            self.local_table = self.ctx.engine.prep_local("kv")

    def _known(self, msg, peer: str) -> DecodeRequest:
        req = self.ctx.requests.find(msg.rid)
        if req is None:
            raise ProtocolError(f"{msg.t} for unknown request {msg.rid}")
        if req.peer != peer:
            raise ProtocolError(
                f"{msg.t} for request {msg.rid} from {peer!r}: the request is {req.peer!r}'s"
            )
        if req.state not in _RECEIVING:
            raise ProtocolError(f"{msg.t} for request {req.rid} in state {req.state}")
        return req

    def _page_range(self, req: DecodeRequest, msg) -> tuple[int, int]:
        """``(first, last)`` of a CHUNK or READY: ProtocolError unless it is a non-empty
        range inside the request's pages."""
        n_pages = -(-req.tokens // self.ctx.spec.page_size)
        first, last = msg.first, msg.last
        if not 0 <= first < last <= n_pages:
            raise ProtocolError(
                f"{msg.t} for request {req.rid}: pages [{first}, {last}) "
                f"outside its {n_pages} pages"
            )
        return first, last

    def on_chunk(self, msg: Chunk, peer: str) -> None:
        ctx = self.ctx
        req = self._known(msg, peer)
        first, last = self._page_range(req, msg)
        nbytes = kvmem.packed_nbytes(ctx.spec, last - first)
        if msg.nbytes != nbytes:
            raise ProtocolError(
                f"CHUNK for request {req.rid}: {msg.nbytes} bytes, pages "
                f"[{first}, {last}) pack to {nbytes}"
            )
        if msg.off != kvmem.packed_nbytes(ctx.spec, first):
            raise ProtocolError(
                f"CHUNK for request {req.rid}: offset {msg.off} is not where "
                f"pages from {first} land"
            )
        if first != req.pages_done:
            raise ProtocolError(
                f"CHUNK for request {req.rid}: pages from {first}, expected from {req.pages_done}"
            )
        ctx.metrics.bytes_landed += nbytes
        ctx.metrics.peer(peer).bytes += nbytes
        if msg.direct:  # written straight into the request's pool pages: check them there
            self.chunk_modes["direct"] += 1
            ok = ctx.verifier.verify_pages(ctx.pool, req.rid, first, last, req.pages(first, last))
        else:
            self.chunk_modes["packed"] += 1
            start = req.landing_off + msg.off
            data = self.memory.landing[start : start + nbytes]
            ok = ctx.verifier.verify(req.rid, first, last, data)
        self._landed(req, first, last, nbytes, ok, "landed bytes differ from what was sent")
        if req.state is DecodeState.BOOTED and not msg.direct:  # own ids: unchecked, no sync
            kvmem.unpack_pages(data, ctx.pool, ctx.ledger.pages(req.rid)[first:last], check=False)
        req.busy = ctx.done_event()  # the check and the unpack read the region, write pages

    # --- pull mode --------------------------------------------------------------------------
    def on_ready(self, msg: Ready, peer: str) -> None:
        """Pull mode: read the offered pages, pool to pool, into the request's pages.  The
        answer (PULLED) goes once the read is DONE or ERR, or at once when it is refused
        (the prefill's pool moved on: the epoch guard, before posting)."""
        ctx = self.ctx
        if ctx.config.transfer_mode != "pull":
            raise ProtocolError("READY on a decode side in push mode")
        req = self._known(msg, peer)
        first, last = self._page_range(req, msg)
        if first != req.pages_done or req.reads:
            raise ProtocolError(
                f"READY for request {req.rid}: pages from {first}, expected "
                f"from {req.pages_done}" + (" (a read is in flight)" if req.reads else "")
            )
        src = np.array(decode_runs(msg.pages, last - first), dtype=np.int64)
        if src.size != last - first:
            raise ProtocolError(
                f"READY for request {req.rid}: {src.size} pages for [{first}, {last})"
            )
        ok = False
        try:
            if req.state is DecodeState.QUARANTINED:  # aborted here: nothing more is read
                raise TransferError(f"request {req.rid} is aborted on the decode side")
            rt = ctx.peers.tables[peer].get()
            if rt is None or rt.epoch != msg.epoch:
                raise StaleEpochError(
                    peer,
                    "kv",
                    f"epoch {msg.epoch}",
                    "closed" if rt is None else f"epoch {rt.epoch}",
                    "READY",
                )
            if src.min() < 1 or src.max() >= rt.layout.count:
                raise ProtocolError(
                    f"READY for request {req.rid}: prefill pages outside [1, {rt.layout.count})"
                )
            lt = self.local_table
            assert lt is not None  # prepared by prep_local in pull mode
            dst = req.pages(first, last)
            planes = np.arange(lt.nbytes.size, dtype=np.int64)[:, None]
            h = ctx.engine.post_blocks(
                lt,
                (planes * lt.layout.count + dst).reshape(-1),
                rt,
                (planes * rt.layout.count + src).reshape(-1),
                b"",
                op="READ",
            )
            req.reads.append(Read(h, first, last))
            req.t_seen = ctx.clock()
            ok = True
        except (StaleEpochError, TransferError) as e:
            log.warning(
                "decode: request %d: read of pages [%d, %d) refused: %s", req.rid, first, last, e
            )
        if not ok:
            ctx.peers.tell(peer, encode("PULLED", rid=req.rid, first=first, last=last, ok=False))

    def _landed(self, req, first: int, last: int, nbytes: int, ok, bad: str) -> None:
        """Pages ``[first, last)`` of ``req`` arrived and were checked (``ok``, a 0-dim
        bool tensor on the device): the bytes are counted verified or corrupt (``bad``
        logged) once the verdict is on the host, and the request moves on now."""
        self._verdict(ok, nbytes, req.rid, first, last, bad)
        req.pages_done = last
        req.t_seen = self.ctx.clock()

    def _verdict(self, ok, nbytes: int, rid: int, first: int, last: int, bad) -> None:
        """Queue a check's verdict (a 0-dim bool tensor) for the counters, in order; it
        counts at once when it is already on the host (the CPU: always)."""
        self.checks.append(_Check(HostCopy(ok), nbytes, rid, first, last, bad))
        self.apply_checks()

    def apply_checks(self) -> bool:
        """Count the verdicts that reached the host (in the order they were made; no wait);
        True when one did."""
        done, metrics = 0, self.ctx.metrics
        for c in self.checks:
            if not c.copy.ready():
                break
            done += 1
            if bool(c.copy.numpy()):
                metrics.bytes_verified += c.nbytes
            else:
                metrics.bytes_corrupt += c.nbytes
                if c.bad is not None:
                    log.error(
                        "decode: request %d pages [%d, %d): %s", c.rid, c.first, c.last, c.bad
                    )
        del self.checks[:done]
        return done > 0

    def poll_reads(self) -> bool:
        """Poll this side's reads; a DONE one is verified in place and acknowledged
        (PULLED ok), an ERR one acknowledged as failed.  True when one finished."""
        ctx, done = self.ctx, False
        for req in list(ctx.requests.active.values()):
            if not req.reads:
                continue
            keep = []
            for r in req.reads:
                first, last = r.first, r.last
                st = ctx.engine.poll(r.handle)
                if st == "PROC":
                    keep.append(r)
                    continue
                ctx.engine.release(r.handle)
                done = True
                if st == "DONE":
                    nbytes = kvmem.packed_nbytes(ctx.spec, last - first)
                    self.chunk_modes["pulled"] += 1
                    ctx.metrics.bytes_landed += nbytes
                    ctx.metrics.peer(req.peer).bytes += nbytes
                    ok = ctx.verifier.verify_pages(
                        ctx.pool, req.rid, first, last, req.pages(first, last)
                    )
                    req.busy = ctx.done_event()  # the check reads the pages
                    self._landed(
                        req,
                        first,
                        last,
                        nbytes,
                        ok,
                        "read bytes differ from what the prefill computed",
                    )
                ctx.peers.tell(
                    req.peer, encode("PULLED", rid=req.rid, first=first, last=last, ok=st == "DONE")
                )
            req.reads = keep
            if not keep and req.free_after_reads is not None:
                self.memory.free(req, *req.free_after_reads)
        return done

    def on_aux(self, msg: Aux, peer: str) -> None:
        ctx = self.ctx
        req = self._known(msg, peer)
        n_pages = -(-req.tokens // ctx.spec.page_size)
        if msg.off != kvmem.packed_nbytes(ctx.spec, n_pages) or msg.nbytes != AUX_BYTES:
            raise ProtocolError(
                f"AUX for request {req.rid}: [{msg.off}, +{msg.nbytes}) is not its extra-state slot"
            )
        if req.pages_done != n_pages:
            raise ProtocolError(
                f"AUX for request {req.rid} before its last chunk "
                f"({req.pages_done} of {n_pages} pages)"
            )
        # The slot follows the packed KV, so it is 8-byte aligned only when the packed size
        # is (odd head dims, fp8, small pages): compare bytes, never view them as int64 there.
        start = req.landing_off + msg.off
        want = torch.tensor([req.rid, req.tokens], dtype=torch.int64).view(torch.uint8)
        got = self.memory.landing[start : start + want.numel()]
        ctx.metrics.bytes_landed += AUX_BYTES
        ctx.metrics.peer(peer).bytes += AUX_BYTES
        ok = (got == to_device(want, got.device)).all()  # on the device: no host sync
        req.busy = ctx.done_event()  # the comparison reads the landing region
        self._verdict(ok, AUX_BYTES, req.rid, n_pages, n_pages, None)
        if req.state is DecodeState.QUARANTINED:
            return  # aborted here meanwhile: freed when the prefill's ABORT comes
        self.memory.free(req, "completed", Reason(OK, f"request {req.rid}: KV received"))
