"""The scheduling of the prefill side (:class:`PrefillScheduler`, a part each
:class:`~kvmem.disagg.prefill.PrefillSide` holds): which chunks a step forwards, and
their pages, allocated with one ``alloc_extend`` (sglang semantics) and no host sync.

No host sync in the side's ``step`` on CUDA: alloc_extend with sglang's ``*_cpu`` hints
and ``check=False``, lengths and the AUX bytes through pinned memory, each request's
last slot kept on the device, pack with ``check=False``; the page ids a READY offer or a
direct write needs reach the host through a :class:`~kvmem.disagg.device.HostCopy` made
when they were allocated (:meth:`PrefillScheduler.schedule`), and such a chunk is staged
once it is there (a step or so later on CUDA, at once on the CPU).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvmem.disagg.device import HostCopy, to_device
from kvmem.disagg.prefill_request import IdsCopy
from kvmem.disagg.states import PrefillState

if TYPE_CHECKING:
    from kvmem.disagg.prefill_context import PrefillContext

# the states ``schedule`` runs forwards in (the next chunk while the last one's write flies)
_FORWARDING = frozenset({PrefillState.WAITING_FOR_INPUT, PrefillState.TRANSFERRING})


class PrefillScheduler:
    """Picks the chunks each step forwards and allocates their pages.  It owns the
    scheduling order (``order``: the bootstrapped requests, first come first served), the
    chunk and batch sizes and the no-slot tensor.  What it works on is the side's context
    (``ctx``): the allocator it allocates from and the ledger that holds the new pages,
    the request tables (read), whether a decode peer is paused (asked at each
    :meth:`schedule`), the fault hooks and the settings.  The first part built: the
    messages part admits requests here, the ending part drops them."""

    def __init__(self, ctx: PrefillContext):
        self.ctx = ctx
        self.chunk_tokens = ctx.config.chunk_tokens
        self.max_batch_tokens = max(ctx.config.max_batch_tokens, self.chunk_tokens)
        self.order: list[int] = []  # scheduling order (FIFO)
        # last_loc of a request with no token yet (alloc_extend's -1), on the device
        self._no_slot = torch.full((1,), -1, dtype=torch.int64, device=ctx.alloc.device)

    def admit(self, rid: int) -> None:
        """Request ``rid`` is bootstrapped: scheduled after those before it."""
        self.order.append(rid)

    def drop(self, rid: int) -> None:
        """Request ``rid`` is over: scheduled no more."""
        if rid in self.order:
            self.order.remove(rid)

    def schedule(self) -> list:
        """Pick chunks of WaitingForInput/Transferring requests whose decode is not paused
        and allocate their pages with one alloc_extend (sglang semantics).  Returns
        [(req, first_page, last_page)]."""
        ctx = self.ctx
        ps, alloc, faults = ctx.spec.page_size, ctx.alloc, ctx.faults()
        picked, budget, need_pages = [], self.max_batch_tokens, 0
        for rid in self.order:
            req = ctx.requests.find(rid)
            if (
                req is None
                or req.state not in _FORWARDING
                or req.done_tokens >= req.tokens
                or req.pending
                or ctx.peers.is_paused(req.peer)
            ):
                continue
            if faults.stall(rid, req.seq):
                continue
            n = min(self.chunk_tokens, req.tokens - req.done_tokens, budget)
            if n < req.tokens - req.done_tokens:
                n -= n % ps
            if n <= 0:
                break
            pages = -(-(req.done_tokens + n) // ps) - (-(-req.done_tokens // ps))
            if need_pages + pages > alloc.num_free:
                break  # memory pressure: the rest waits for frees
            picked.append((req, n))
            need_pages += pages
            budget -= n
        if not picked:
            return []
        # No host sync on CUDA: lengths go to the device through pinned memory, sglang's
        # *_cpu hints give the counts, check=False (errors surface at the allocator's next
        # synchronising call), and each request's last slot stays on the device.
        pre = torch.tensor([r.done_tokens for r, _ in picked], dtype=torch.int64)
        seq = pre + torch.tensor([n for _, n in picked], dtype=torch.int64)
        dev = alloc.device
        last = torch.cat([self._no_slot if r.last_loc is None else r.last_loc for r, _ in picked])
        slots = alloc.alloc_extend(
            to_device(pre, dev),
            to_device(seq, dev),
            last,
            prefix_lens_cpu=pre,
            seq_lens_cpu=seq,
            extend_num_tokens=int((seq - pre).sum()),
            check=False,
        )
        batch, off = [], 0
        for req, n in picked:
            s = slots[off : off + n]
            off += n
            first = req.done_tokens // ps
            new = s[(ps - req.done_tokens % ps) % ps :: ps] // ps  # pages that start here
            ctx.ledger.hold(req.rid, new)
            req.done_tokens += n
            req.last_loc = s[-1:]
            last_page = -(-req.done_tokens // ps)
            # Chunks start on a page boundary (all but a request's last are whole pages),
            # so the new pages are exactly pages [first, last_page) of the request; their
            # ids reach the host without a sync, for READY and direct descriptors.
            req.ids.append(IdsCopy(first, last_page, HostCopy(new)))
            batch.append((req, first, last_page))
        return batch
