"""sglang's ``token_to_kv_pool_allocator`` on kvmem's PageAllocator (glue only).

:class:`KvmemTokenToKVPoolAllocator` maps sglang 0.5.23's ``BaseTokenToKVPoolAllocator``
interface (token slots) onto :class:`kvmem.PageAllocator` (page ids).  It holds no
allocator logic of its own: every page is handed out and taken back by kvmem.
"""

from __future__ import annotations

import numpy as np
import torch
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
from sglang.srt.utils import get_bool_env_var

from kvmem import OutOfPagesError, PageAllocator
from kvmem.kernels.alloc import PY_FREE_MAX


class KvmemTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """sglang's token-slot allocator interface over one :class:`kvmem.PageAllocator`.

    Constructed with sglang's ``PagedTokenToKVPoolAllocator`` arguments ``(size,
    page_size, dtype, device, kvcache, need_sort)`` for every page size (page_size 1
    replaces ``TokenToKVPoolAllocator``).  ``size`` counts token slots without the
    padding page, as in sglang; the kvmem allocator ``self.page_allocator`` has
    ``num_pages = size // page_size + 1`` pages (its page 0 is sglang's padding page,
    never handed out)::

        token slot s  <->  page s // page_size, offset s % page_size
        slots         : int64 [T] on the allocator's device (what alloc* return); the
                        frees also take int32 (sglang's req_to_token rows)
        page_ids      : int32 | int64 [n] on the allocator's device, in
                        1 .. size // page_size

    Invariants (kvmem's, which this class relies on and does not re-check):
    ``available_size() == page_allocator.num_free * page_size``, always (a host int);
    a page is free xor handed out; page 0 is never handed out.

    sglang's OOM contract.  ``alloc``, ``alloc_extend`` and ``alloc_decode`` return
    ``None`` when the pages do not fit and then change nothing (same available size,
    same free pages).  kvmem compares the pages a call needs with ``num_free`` on the
    host before it launches anything that changes its state: ``need_size //
    page_size`` for ``alloc``, the ``*_cpu`` hints for ``alloc_extend`` /
    ``alloc_decode``.  (With ``check=True`` on CUDA kvmem first validates the inputs
    on the device, read-only.)  kvmem's frees are immediate (validated, counted and
    available at once); kvmem stages the freed pages at its free list's tail and sorts
    them in itself when a call's bound exceeds its sorted part (sglang's own bounds),
    so "staged frees are merged before the capacity check" holds inside kvmem and
    ``merge_and_sort_free`` is a no-op.  ``need_sort`` is accepted and ignored: kvmem
    always keeps need_sort's order.

    Order.  With ``need_sort=True`` the slots are sglang's, call for call, from a new or
    ``clear()``-ed allocator and after frees too
    (tests/sglang/test_allocator_backend.py::test_after_frees_same_slots_as_sglang_need_sort),
    except after an alloc that found too few pages (sglang sorts before returning None;
    kvmem changes nothing).  With ``need_sort=False`` sglang puts freed pages first, so
    after frees the slots differ while the counts agree.

    Syncs.  ``check`` (default: sglang's ``SGLANG_DEBUG_MEMORY_POOL``, i.e. off) is
    passed to every kvmem call.  On the CPU nothing ever waits and kvmem checks
    everything at once whatever ``check`` says.  On CUDA with ``check=False``:

    =================================================  ====================================
    call                                               host syncs
    =================================================  ====================================
    alloc, alloc_extend, alloc_decode (with the hints  none
    sglang always passes), available_size
    free_segment(s), free_full_segment(s),             none (page count known on the host:
    free_page_ids                                      ceil(n / page_size))
    free(slots), free_full: page_size 1                none
    free(slots), free_full: page_size > 1              1: ``torch.unique`` of the pages, as
                                                       sglang's own ``free``
    free_group_end                                     1 if the group holds ``free(slots)``
                                                       calls at page_size > 1, else none
    clear, resize                                      none
    get_all_free_pages (debug census)                  1 (``nonzero``)
    synchronize                                        1, and raises a deferred error
    =================================================  ====================================

    With ``check=False`` kvmem checks on the device and raises a bad free (double free,
    page 0, out of range) or inconsistent alloc inputs at its next synchronising call;
    this class makes none on its hot path, so call :meth:`synchronize` where a sync is
    cheap (an idle scheduler) to surface them.  With ``check=True`` each kvmem call
    validates at once, at one sync per call on CUDA.  kvmem runs every call on one
    CUDA stream, the one current when this allocator was built (or resized); a call
    from another stream is ordered against it without a host sync (kvmem.PageAllocator).

    Deviations from sglang's allocators.  Freeing a page that is not handed out (a
    double free, page 0, out of range), or the same page twice in one call, raises
    ``kvmem.DoubleFreeError`` and frees nothing; sglang checks that only with
    ``SGLANG_DEBUG_MEMORY_POOL`` (paged, by assertion) or not at all (page_size 1).
    Inconsistent ``alloc_extend`` / ``alloc_decode`` inputs (``prefix_len > seq_len``, a
    ``last_loc`` not on the request's allocated partial page, hints that disagree with
    the device tensors) raise ValueError (sglang: debug assertion or wrong slots).
    ``alloc(need_size)`` with ``need_size`` not a multiple of ``page_size`` raises
    ValueError (sglang: debug assertion, else it returns fewer slots than asked).
    ``alloc_extend`` / ``alloc_decode`` also work at page_size 1 (sglang's page-size-1
    allocator has neither; the scheduler calls ``alloc`` there, as it does here).
    Nested ``free_group_begin`` raises RuntimeError (sglang: assertion).
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        device,
        kvcache,
        need_sort: bool,
        *,
        check: bool | None = None,
    ):
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)
        if check is None:
            check = get_bool_env_var("SGLANG_DEBUG_MEMORY_POOL")
        self.check = bool(check)
        # sglang's paged allocator's switch, read by callers that run their own checks
        # around it (SWATokenToKVPoolAllocator above page size 1): sglang's, unchanged
        self.debug_mode = get_bool_env_var("SGLANG_DEBUG_MEMORY_POOL")
        self._build(size)

    # -- state ------------------------------------------------------------------------

    def _build(self, size: int) -> None:
        """A new kvmem allocator for ``size`` token slots (every page free)."""
        ps = self.page_size
        self.size = size
        self.num_pages = size // ps  # sglang's count: pages 1 .. num_pages
        self.page_allocator = PageAllocator(self.num_pages + 1, ps, self.device)
        dev = self.page_allocator.device
        # offsets of the slots in a page, for alloc's page -> slot expansion
        self._offsets = torch.arange(ps, dtype=torch.int64, device=dev)
        # a CPU free of one row of up to this many slots goes to kvmem as a Python list
        # (its short path, kvmem.kernels.alloc.PY_FREE_MAX pages), no NumPy or torch op
        self._short_slots = PY_FREE_MAX * ps if dev.type == "cpu" else 0
        self.free_group: list | None = None  # None, or the token-slot frees of an open group
        self._group_page_ids: list[torch.Tensor] = []

    def clear(self) -> None:
        """Every page free again, handed out as 1, 2, 3, ... (sglang's order); closes an
        open free group and drops its frees (as sglang's ``clear``)."""
        self.page_allocator.reset()
        self.free_group = None
        self._group_page_ids = []

    def resize(self, config) -> None:
        """Rebuild for ``config.max_total_num_tokens`` token slots, every page free
        (sglang calls this once, after post-capture KV sizing).  ValueError, nothing
        changed, for a count that is not a positive whole number of slots."""
        total = config.max_total_num_tokens
        if isinstance(total, bool) or not isinstance(total, (int, np.integer)) or total <= 0:
            raise ValueError(
                f"resize: max_total_num_tokens must be a positive int, got "
                f"{total!r}; nothing changed"
            )
        self._build(int(total))

    def synchronize(self) -> None:
        """Wait for the allocator's device work and raise any error a ``check=False``
        call left on the device (kvmem rebuilds its free list first)."""
        self.page_allocator.synchronize()

    # -- counts -----------------------------------------------------------------------

    def available_size(self) -> int:
        """Free token slots: free pages x page_size (host int, no sync)."""
        return self.page_allocator.num_free * self.page_size

    def get_all_free_pages(self) -> torch.Tensor:
        """int64 [available_size() // page_size]: the free page ids, ascending (sglang's
        debug census; from kvmem's ownership map: 1 sync on CUDA, O(num_pages))."""
        pa = self.page_allocator
        free = torch.ones(pa.num_pages, dtype=torch.bool, device=pa.device)
        free[0] = False
        free[pa.allocated_pages()] = False
        return torch.nonzero(free).flatten()

    def merge_and_sort_free(self) -> None:
        """No-op: kvmem puts freed pages back at once, nothing is staged."""

    def debug_print(self) -> str:
        return repr(self.page_allocator)

    # -- alloc --------------------------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """int64 [need_size]: the slots of ``need_size // page_size`` new pages, each
        page's slots in order; None (nothing changed) when they do not fit.
        ``need_size`` must be a multiple of ``page_size`` (ValueError otherwise)."""
        ps = self.page_size
        if (
            isinstance(need_size, bool)
            or not isinstance(need_size, (int, np.integer))
            or need_size < 0
        ):
            raise ValueError(
                f"alloc: need_size must be an int >= 0, got {need_size!r}; nothing allocated"
            )
        if ps == 1:
            try:
                return self.page_allocator.alloc(need_size, check=self.check)
            except OutOfPagesError:
                return None
        n, rest = divmod(need_size, ps)
        if rest:
            raise ValueError(
                f"alloc: need_size {need_size} is not a multiple of page_size "
                f"{ps}; nothing allocated"
            )
        try:
            pages = self.page_allocator.alloc(n, check=self.check)
        except OutOfPagesError:
            return None
        return (pages[:, None] * ps + self._offsets).reshape(-1)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        num_new_pages: int | None = None,
    ) -> torch.Tensor | None:
        """int64 [extend_num_tokens]: slots extending request i from ``prefix_lens[i]``
        to ``seq_lens[i]`` tokens (the rest of its partial last page after
        ``last_loc[i]``, then new pages), requests in order; None (nothing changed)
        when the new pages do not fit.  ``prefix_lens``, ``seq_lens``, ``last_loc``:
        int32/int64 [bs] on the device; ``*_cpu``: the same lengths on the CPU.
        ``num_new_pages`` is accepted and not used (kvmem counts from the hints)."""
        try:
            return self.page_allocator.alloc_extend(
                prefix_lens,
                seq_lens,
                last_loc,
                prefix_lens_cpu=prefix_lens_cpu,
                seq_lens_cpu=seq_lens_cpu,
                extend_num_tokens=extend_num_tokens,
                check=self.check,
            )
        except OutOfPagesError:
            return None

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        """int64 [bs]: one slot per request, whose length becomes ``seq_lens[i]`` (a new
        page when ``(seq_lens[i] - 1) % page_size == 0``, else ``last_loc[i] + 1``);
        None (nothing changed) when the new pages do not fit."""
        try:
            return self.page_allocator.alloc_decode(
                seq_lens, last_loc, seq_lens_cpu=seq_lens_cpu, check=self.check
            )
        except OutOfPagesError:
            return None

    # -- free ---------------------------------------------------------------------------

    def free(self, free_index: torch.Tensor) -> None:
        """Free the pages holding the token slots ``free_index`` (int32/int64 [T], any
        order, several slots of one page allowed).  In a free group: at its end."""
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(self._copy_for_free_group(free_index))
            return
        self.page_allocator.free(self._pages_of_slots(free_index), check=self.check)

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        """Free exactly these pages (int32/int64 [n] on the device, each once).  In a
        free group: at its end."""
        if len(page_ids) == 0:
            return
        if self.free_group is not None:
            self._group_page_ids.append(self._copy_for_free_group(page_ids))
            return
        self.page_allocator.free(page_ids, check=self.check)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """Free ``kv_row[start_pos : start_pos + n]`` of one request (``free_index``:
        int32/int64 [n], ``start_pos`` a multiple of page_size): pages
        ``free_index[::page_size] // page_size``, the last one whole."""
        self.free_segments([(free_index, start_pos)])

    def free_segments(self, segments) -> None:
        """Free several ``(free_index, start_pos)`` segments of one request's kv row
        (ascending, no page shared: sglang's contract, which its base class asserts),
        in one kvmem free."""
        if type(segments) is list and len(segments) == 1 and self.free_group is None:
            # one short row on the CPU (the retire of an aborted request): one Python
            # list to kvmem, no NumPy or torch op
            free_index, start_pos = segments[0]
            if 0 < free_index.numel() <= self._short_slots:
                self.page_allocator.free(
                    self._segment_page_list(free_index, start_pos), check=self.check
                )
                return
        segments = list(self._page_disjoint(segments))
        if not segments:
            return
        pages = [self._segment_pages(f, s) for f, s in segments]
        self.free_page_ids(pages[0] if len(pages) == 1 else torch.cat(pages))

    def free_full_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """One pool, no SWA peer: ``free_segment``."""
        self.free_segment(free_index, start_pos=start_pos)

    def free_full_segments(self, segments) -> None:
        """One pool, no SWA peer: ``free_segments``."""
        self.free_segments(segments)

    def free_group_begin(self) -> None:
        """Hold the frees until ``free_group_end`` (groups do not nest)."""
        if self.free_group is not None:
            raise RuntimeError(
                "free_group_begin: a free group is open already (free groups cannot be nested)"
            )
        self.free_group = []
        self._group_page_ids = []

    def free_group_end(self) -> None:
        """Apply the group's frees as one kvmem free: the token-slot frees deduplicated
        to pages together (a page several of them touch is freed once, as in sglang),
        then the page-id frees.  On DoubleFreeError nothing of the group is freed; the
        group is closed either way.  Without an open group: nothing (as sglang)."""
        slots, page_ids = self.free_group, self._group_page_ids
        self.free_group, self._group_page_ids = None, []
        if slots is None:
            return
        parts = page_ids
        if slots:
            parts = [self._pages_of_slots(torch.cat(slots))] + page_ids
        if parts:
            self.page_allocator.free(
                parts[0] if len(parts) == 1 else torch.cat(parts), check=self.check
            )

    # -- copies (the KV cache's, as sglang's allocators) ---------------------------------

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        return self._kvcache.get_cpu_copy(
            indices, mamba_indices=mamba_indices, req_pool_index=req_pool_index
        )

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None):
        return self._kvcache.load_cpu_copy(
            kv_cache_cpu, indices, mamba_indices=mamba_indices, req_pool_index=req_pool_index
        )

    # translate_kv_indices_for_transfer: inherited identity (slots index the pool's
    # buffers directly).  Budget hooks (create_prefill_budget, check_decode_capacity,
    # evict_to_free_tokens, max_new_tokens_for_memory, prealloc_fits*, ...): inherited;
    # they read available_size() and page_size only.

    # -- slot -> page mapping -----------------------------------------------------------

    def _pages_of_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """int32/int64 [n] (the dtype of ``slots``): the distinct pages holding
        ``slots`` (page_size 1: the slots themselves, no dedup, as sglang; else
        ``torch.unique``: 1 sync on CUDA).  kvmem's free takes either dtype."""
        if self.page_size == 1:
            return slots
        return torch.unique(slots // self.page_size)

    def _page_aligned(self, start_pos: int) -> int:
        """page_size; ValueError when a segment's ``start_pos`` is not a multiple of it."""
        ps = self.page_size
        if start_pos % ps:
            raise ValueError(
                f"free_segment: start_pos {start_pos} is not a multiple of "
                f"page_size {ps}; nothing freed"
            )
        return ps

    def _segment_page_list(self, free_index: torch.Tensor, start_pos: int) -> list[int]:
        """``_segment_pages`` as a Python list, for a short CPU segment: one ``tolist``
        and no NumPy or torch op (each costs about 1 us whatever its size)."""
        ps = self._page_aligned(start_pos)
        if ps == 1:
            return free_index.tolist()
        return [s // ps for s in free_index.tolist()[::ps]]

    def _segment_pages(self, free_index: torch.Tensor, start_pos: int) -> torch.Tensor:
        """int32/int64 [ceil(n / page_size)] (int64 on CPU, else the dtype of
        ``free_index``): the pages of a page-aligned row segment, each page's first slot
        divided by page_size (no sync)."""
        ps = self._page_aligned(start_pos)
        if ps == 1:
            return free_index
        if free_index.device.type == "cpu":
            # one NumPy call straight to int64, cheaper than a torch op and kvmem's
            # int32 -> int64 widening (docs/allocator.md, "Costs")
            return torch.from_numpy(np.floor_divide(free_index.numpy()[::ps], ps, dtype=np.int64))
        return free_index[::ps] // ps
