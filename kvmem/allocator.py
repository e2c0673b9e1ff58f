"""PageAllocator: the KV pages of one pool, handed out and taken back on the pool's
device, with sglang 0.5.23's token-slot semantics for alloc_extend / alloc_decode.

One class over one state: its methods keep the invariants the class docstring states;
what they launch and check lives in kvmem/kernels/alloc/, the refusals in
kvmem/errors.py.  Two of its jobs are bases of their own, each declaring what of the
state it uses: the token slots (alloc_extend, alloc_decode and their checks:
kvmem/allocator_slots.py) and its CUDA stream (kvmem/allocator_stream.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from kvmem._ids import as_int, as_page_ids
from kvmem.allocator_slots import TokenSlots
from kvmem.allocator_stream import StreamBound, on_own_stream, own_stream
from kvmem.errors import OutOfPagesError, alloc_error
from kvmem.kernels import alloc as K
from kvmem.kernels._dispatch import force_triton, is_async_device


class PageAllocator(TokenSlots, StreamBound):
    """Hands out the pages ``1 .. num_pages - 1`` of a KV pool and takes them back, on the
    pool's device, in sglang 0.5.23's order and with its token-slot semantics
    (``PagedTokenToKVPoolAllocator``, ``need_sort=True``).

    ``num_pages`` counts the padding page 0 (sglang's ``size // page_size + 1``).  State,
    all on ``device`` (cap = num_pages - 1)::

        _ring  : int64 [cap]        the free pages are _ring[(_head + k) % cap], k < num_free:
                                    the first _sorted ascend (handed out from the head),
                                    the rest were freed since the last sort (staged)
        _owned : int32 [num_pages]  1 = allocated, 0 = free; the source of truth (a view
                                    of _owned_ext, one entry longer, that entry always 0)
        _err   : int64 [4]          what check=False calls found on the device (layout:
                                    kvmem.kernels.alloc)

    with ``_head``, ``_sorted``, ``num_free`` and ``num_allocated`` host ints.

    Invariants (``check_invariants()`` asserts them):

    - a page is free xor owned: the live ring entries are exactly the pages
      ``1 .. num_pages - 1`` with ``_owned == 0``, each once;
    - ``num_free + num_allocated == num_pages - 1``, always;
    - page 0 is never handed out and never owned;
    - ``0 <= _sorted <= num_free`` and the first ``_sorted`` live entries ascend.

    Contracts:

    - A call that raises has changed nothing (but for the deferred check=False errors
      below): ``OutOfPagesError`` (pages asked, pages free), ``DoubleFreeError`` (the
      page and why: out of range, page 0, not allocated, listed twice; nothing of that
      free is applied), ``ValueError`` for bad arguments or batches.  The refusals and
      their messages: ``kvmem.errors.AllocCode``.
    - Order: a new or ``reset()`` allocator hands out 1, 2, 3, ...; a free is staged at
      once (free, counted, not handed out before the next sort); when a call may need
      more pages than the sorted part holds, every free page is sorted first.
    - ``check=True`` (the default) validates before changing anything: one host sync on
      CUDA, none on the CPU.  ``check=False`` on the Triton path (CUDA, or CPU tensors
      under ``KVMEM_FORCE_TRITON=1``) makes no sync and checks on the device; what it
      finds is raised at the next synchronising call (any ``check=True`` call,
      ``check_invariants()``, ``synchronize()``), after the free list is rebuilt from
      ``_owned``, and results in between are unreliable.  On the CPU path every check
      always runs.
    - CUDA: every call runs on the allocator's device and its one stream (``stream=``,
      else the device's current stream at construction), ordered against the caller's
      stream without a host sync; the state above is allocated on that stream too, so
      dropping an allocator whose stream still has work queued frees nothing the
      caller's stream could reuse before that work ends.  CPU: no stream; ``stream=`` is
      refused.
    - Not thread-safe (the counts are host ints): one thread, or the caller's lock.  Two
      allocators share nothing.

    What each call costs, the order in detail, streams and check=False:
    docs/allocator.md.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        device: str | torch.device = "cpu",
        *,
        stream: torch.cuda.Stream | None = None,
    ):
        num_pages = as_int("num_pages", num_pages)
        page_size = as_int("page_size", page_size)
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is padding), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._stream = own_stream(device, stream)
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = device
        self._cap = num_pages - 1
        self._on_cuda = device.type == "cuda"
        # The state is made on the allocator's stream, as all its later work runs: CUDA's
        # caching allocator ties a block to the stream it was allocated on and hands it
        # out again on that stream once freed, so state made on the caller's stream
        # could be reused there while this allocator's stream still wrote it (after the
        # allocator is dropped with work queued).
        with self._on_stream():
            self._ring = torch.empty(self._cap, dtype=torch.int64, device=device)
            # One entry more than there are pages, always 0, which the CPU free check
            # uses (kvmem.kernels.alloc.free_pages_cpu); _owned is the map proper.
            self._owned_ext = torch.zeros(num_pages + 1, dtype=torch.int32, device=device)
            self._err = torch.empty(4, dtype=torch.int64, device=device)
        self._owned = self._owned_ext[:num_pages]
        # CPU: numpy views of the state (zero copy) for the take/free bookkeeping
        # (Any: None on CUDA, and only the CPU paths read them)
        ring_np: Any = self._ring.numpy() if device.type == "cpu" else None
        owned_np: Any = self._owned_ext.numpy() if device.type == "cpu" else None
        self._ring_np, self._owned_np = ring_np, owned_np
        # the Triton kernels on CUDA, and on CPU tensors under KVMEM_FORCE_TRITON=1 as it
        # was when the allocator was made (not read per call: _triton)
        self._use_triton = self._on_cuda or force_triton()
        # CPU without Triton: memoryviews of the ring and of the map proper, for a free of
        # a short Python list (kvmem.kernels.alloc.free_pages_list)
        cpu_py = device.type == "cpu" and not self._use_triton
        self._ring_mv: Any = memoryview(ring_np) if cpu_py else None
        self._owned_mv: Any = memoryview(owned_np[:num_pages]) if cpu_py else None
        # CPU free's scratch (kvmem.kernels.alloc.free_pages_cpu), this allocator's own
        self._marks: Any = K.free_marks(min(self._cap, 1024)) if device.type == "cpu" else None
        self._group: list[tuple[torch.Tensor, bool]] | None = None
        self.reset()

    # -- counts -------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages that alloc can hand out now (host int, no sync)."""
        return self._count

    @property
    def num_allocated(self) -> int:
        """Pages handed out and not freed (host int, no sync)."""
        return self._allocated

    def __repr__(self) -> str:
        return (
            f"PageAllocator(num_pages={self.num_pages}, page_size={self.page_size}, "
            f"device={str(self.device)!r}, num_free={self._count})"
        )

    # -- whole-state operations -----------------------------------------------------

    @on_own_stream
    def reset(self) -> None:
        """Every page free again, handed out as 1, 2, 3, ... from now on.  Discards any
        error a check=False call left on the device, and the frees collected so far by
        an open free_group (the group stays open)."""
        torch.arange(1, self.num_pages, dtype=torch.int64, device=self.device, out=self._ring)
        self._owned_ext.zero_()
        self._reset_err()
        self._head = 0
        self._count = self._cap
        self._sorted = self._cap
        self._allocated = 0
        self._parity = 0
        self._pending = False  # a check=False call may have recorded an error in _err
        if self._group is not None:
            self._group.clear()

    @on_own_stream
    def synchronize(self) -> None:
        """Wait for the allocator's device work (its stream, on CUDA) and raise any
        error a check=False call recorded on the device (after rebuilding the free
        list)."""
        if self._pending:
            self._read_device(None)
        elif self._stream is not None:
            self._stream.synchronize()

    @on_own_stream
    def check_invariants(self) -> None:
        """Raise AssertionError naming the first violated invariant (copies the state
        to the host; raises a pending device error first, like synchronize())."""
        self.synchronize()
        cap = self._cap
        assert 0 <= self._count <= cap, f"num_free {self._count} outside [0, {cap}]"
        assert 0 <= self._head < cap, f"ring head {self._head} outside [0, {cap})"
        assert self._count + self._allocated == cap, (
            f"num_free + num_allocated = {self._count} + {self._allocated} != num_pages - 1 = {cap}"
        )
        owned = self._owned.cpu()
        ring = self._ring.cpu()
        assert int(owned[0]) == 0, "page 0 is owned"
        values = set(torch.unique(owned).tolist())
        assert values <= {0, 1}, f"ownership map holds values {sorted(values)}, not 0/1"
        n_owned = int(owned.sum())
        assert n_owned == self._allocated, (
            f"{n_owned} pages owned but num_allocated is {self._allocated}"
        )
        live = ring[(self._head + torch.arange(self._count)) % cap]
        bad = live[(live < 1) | (live >= self.num_pages)]
        assert bad.numel() == 0, f"free list holds {bad[0].item()}, not a page id"
        assert torch.unique(live).numel() == live.numel(), "free list holds a page twice"
        both = live[owned[live] != 0]
        assert both.numel() == 0, f"page {both[0].item()} is both free and owned"
        # So the live entries are _count distinct unowned pages, and the map has
        # cap - num_allocated == _count unowned pages: they are exactly the free ones.
        assert int(self._owned_ext[-1]) == 0, "the ownership map's end marker is not 0"
        assert 0 <= self._sorted <= self._count, (
            f"sorted part {self._sorted} outside [0, num_free = {self._count}]"
        )
        head = live[: self._sorted]
        assert bool((head[1:] > head[:-1]).all()), (
            "the sorted part of the free list is not ascending"
        )

    @on_own_stream
    def allocated_pages(self) -> torch.Tensor:
        """int64 [num_allocated]: the pages handed out and not freed, ascending (from the
        ownership map; copies it: for audits, not the hot path)."""
        return torch.nonzero(self._owned == 1).flatten().to(torch.int64)

    # -- alloc / free ---------------------------------------------------------------

    @on_own_stream
    def alloc(self, n: int, check: bool = True) -> torch.Tensor:
        """int64 [n]: n free pages, now allocated (a new tensor).  OutOfPagesError,
        with nothing changed, when fewer than n are free."""
        if type(n) is not int:
            n = as_int("n", n)
        if n < 0:
            raise ValueError(f"alloc: n must be >= 0, got {n}")
        if check and self._pending:
            self._read_device(None)
        if n > self._count:
            raise OutOfPagesError(n, self._count, "alloc")
        return self._take(n, self._flag(check), n)

    @on_own_stream
    def free(self, pages, check: bool = True) -> None:
        """Put ``pages`` (page ids, never token slots: ``int [n]``, an integer tensor on
        the allocator's device, a NumPy array or a Python sequence of ints; see
        ``kvmem._ids.as_page_ids``) back on the free list at once, or, in a free_group,
        at its outermost exit.  DoubleFreeError, with nothing freed, if one is out of
        range, page 0, not allocated, or listed twice; ValueError, with nothing freed,
        for ids that are not integers (bool and float included)."""
        if (
            type(pages) is list
            and 0 < len(pages) <= K.PY_FREE_MAX
            and self._owned_mv is not None
            and self._group is None
        ):
            # a few pages on the CPU: plain Python (kvmem.kernels.alloc.free_pages_list);
            # anything it does not take goes the general way, which reports it
            if K.free_pages_list(
                pages, self._ring_mv, self._owned_mv, (self._head + self._count) % self._cap
            ):
                self._count += len(pages)
                self._allocated -= len(pages)
                return
        p = as_page_ids(
            pages, self.device, what="free: pages", where="the allocator", int64=not self._on_cuda
        )
        if self._group is not None:
            if p.numel():
                # a copy, unless p is a tensor of our own making (from a Python sequence):
                # the caller may change its tensor or array before the group applies
                fresh = isinstance(pages, Sequence) and not isinstance(pages, (str, bytes))
                self._group.append((p if fresh else p.clone(), check))
            return
        self._free_now(p, check)

    @contextlib.contextmanager
    def free_group(self) -> Iterator[PageAllocator]:
        """Collect the frees made inside and apply them at exit as one batched free
        (one validation, one ring write).  Nested groups apply at the outermost exit.
        The frees are applied even when the body raised; if the batch holds a page that
        may not be freed, DoubleFreeError is raised and nothing of the group is freed.
        The batch is checked unless every free in it passed check=False."""
        outer = self._group is None
        if outer:
            self._group = []
        try:
            yield self
        finally:
            if outer:
                group, self._group = self._group, None
                if group:
                    with self._on_stream():
                        pages = (
                            group[0][0]
                            if len(group) == 1
                            else torch.cat([g[0].to(torch.int64) for g in group])
                        )
                        self._free_now(pages, any(g[1] for g in group))

    # -- internals ------------------------------------------------------------------

    def _triton(self) -> bool:
        """kvmem.kernels._dispatch.use_triton for the allocator's device (every tensor a
        call touches is on it), decided when the allocator was made: a read per call is
        a measurable part of an alloc+free on the CPU (docs/kernels.md, "Measured on the CPU")."""
        return self._use_triton

    def _flag(self, check: bool) -> bool:
        """True when this call defers its checks to the device (check=False on the
        Triton path); it may then leave an error in _err."""
        if check or not self._triton():
            return False
        self._pending = True
        return True

    def _take(self, n: int, flag: bool, bound: int) -> torch.Tensor:
        """The next n pages off the ring (n <= num_free), now owned; ``bound`` >= n is
        what the call may need by sglang's bound: if the sorted part holds fewer, every
        free page is sorted first (class docstring, "Order")."""
        if bound > self._sorted and self._sorted < self._count:
            self._sort_free()
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        self._sorted -= n
        if self._triton():
            pages = K.take_pages_triton(
                self._ring, self._owned, self._err, self._head, n, flag=flag
            )
        else:
            pages = K.take_pages_cpu(self._ring_np, self._owned_np, self._head, n)
        self._head = (self._head + n) % self._cap
        self._count -= n
        self._allocated += n
        return pages

    def _sort_free(self) -> None:
        """Sort every free page (sorted part and staged part) into ring[0:num_free],
        ascending, with head 0.  CPU: when at least 1/6 of the pages are free, read them
        off the ownership map in page order (O(num_pages); on the CPU every free is
        checked, so the map and the ring always hold the same free pages); else NumPy's
        default sort of the live entries.  Triton path: torch ops on the device, no host
        sync; after a refused check=False free the ring may hold 0s, which then lead:
        the take kernel flags them, and the free's own error, recorded first, is what
        gets raised."""
        head, count, cap = self._head, self._count, self._cap
        end = head + count
        if self._ring_np is not None and not self._triton():
            ring = self._ring_np
            # 1/6, where the map scan overtakes np.sort (docs/kernels.md, "Measured on the CPU")
            if count * 6 >= self.num_pages:
                free = np.flatnonzero(self._owned_np[1 : self.num_pages] == 0)
                assert free.shape[0] == count, "the free list and the map disagree"
                np.add(free, 1, out=ring[:count])
            else:
                live = (
                    ring[head:end]
                    if end <= cap
                    else np.concatenate((ring[head:], ring[: end - cap]))
                )
                ring[:count] = np.sort(live)
        else:
            ring = self._ring
            live = ring[head:end] if end <= cap else torch.cat((ring[head:], ring[: end - cap]))
            ring[:count] = torch.sort(live).values
        self._head = 0
        self._sorted = count

    def _free_now(self, p: torch.Tensor, check: bool) -> None:
        n = p.shape[0]
        if n == 0:
            if check and self._pending:
                self._read_device(None)
            return
        tail = (self._head + self._count) % self._cap
        triton = self._triton()
        if not check and triton and self._count + n <= self._cap:
            # checked on the device; an error is raised at the next synchronising call
            self._pending = True
            K.free_pages_triton(
                p, self._ring, self._owned, self._err, tail, self._parity, flag=True
            )
            self._parity ^= 1
        else:
            if triton:
                bad = self._free_checked_triton(p, tail)
            else:
                if n > self._marks.shape[0] and n <= self._cap:
                    self._marks = K.free_marks(min(self._cap, 2 * n))
                bad = K.free_pages_cpu(p.numpy(), self._ring_np, self._owned_np, tail, self._marks)
            if bad is not None:
                first, code = bad
                raise alloc_error(code, int(p[first]), self.num_pages)
        self._count += n
        self._allocated -= n

    def _free_checked_triton(self, p: torch.Tensor, tail: int) -> tuple[int, int] | None:
        """Validate, then apply with the Triton kernel if clean; ``(position, code)`` of
        the first offending page otherwise, with nothing changed."""
        if is_async_device(p):  # one sync: the validation and any pending device error
            first, code = self._read_device(K.free_errors_torch(p, self._owned))
            if first >= 0:
                return first, code
        else:  # CPU tensors under KVMEM_FORCE_TRITON=1
            if self._pending:
                self._read_device(None)
            bad = K.free_errors_cpu(p.numpy(), self._owned.numpy())
            if bad is not None:
                return bad
        K.free_pages_triton(p, self._ring, self._owned, self._err, tail, self._parity, flag=False)
        return None

    def _reset_err(self) -> None:
        """err = [0, 0, NO_BAD, NO_BAD] with two fills on the device (no host copy, so
        no sync: a copy from pageable host memory would wait for the stream)."""
        self._err[:2].zero_()
        self._err[2:].fill_(K.NO_BAD)

    def _read_device(self, t: torch.Tensor | None, raise_pending: bool = True) -> list[int]:
        """``t.tolist()``, and, if a check=False call may have left an error and
        ``raise_pending``, that error, read in the same host sync: if there is one, the
        free list is rebuilt and the error raised (``t`` is then not used).  The read
        waits for the current stream, which is the allocator's (every caller runs under
        _on_stream), so it follows all of the allocator's work."""
        if not (raise_pending and self._pending):
            return [] if t is None else t.tolist()
        head = self._err[:2]
        vals = (head if t is None else torch.cat((head, t.to(torch.int64)))).tolist()
        self._pending = False
        if vals[0] != 0:
            self._raise_device_error(vals[0], vals[1])
        return vals[2:]

    def _rebuild_from_owned(self) -> int:
        """Make the ring hold exactly the unowned pages (ascending) and the host counts
        match the ownership map.  Returns num_free."""
        self._owned[0] = 0
        free = torch.nonzero(self._owned[1:] == 0).flatten() + 1
        n = free.numel()
        self._ring[:n] = free
        self._head = 0
        self._count = n
        self._sorted = n
        self._allocated = self._cap - n
        self._parity = 0
        self._reset_err()
        return n

    def _raise_device_error(self, code: int, value: int):
        n_free = self._rebuild_from_owned()
        rebuilt = (
            f"found on the device after a check=False call; the free list was "
            f"rebuilt from the ownership map ({n_free} pages free)"
        )
        raise alloc_error(code, value, self.num_pages, rebuilt=rebuilt)
