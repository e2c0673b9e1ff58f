"""Token slots with sglang 0.5.23's semantics: the allocator's alloc_extend and
alloc_decode, and the checks of their batches.

Contract: :class:`TokenSlots` turns a batch of requests' lengths into token slots (page *
page_size + offset), taking the new pages through the allocator's own ``_take``; a
checked call validates the batch (and the ``*_cpu`` hints) before anything changes,
with one host sync on CUDA and numpy on the CPU, and raises ValueError or
OutOfPagesError with nothing changed.  The free list, the ownership map and the deferred
check=False errors belong to :class:`~kvmem.allocator.PageAllocator`, of which this class
is a base.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvmem._ids import as_int
from kvmem.allocator_stream import on_own_stream
from kvmem.errors import OutOfPagesError, alloc_error
from kvmem.kernels import alloc as K
from kvmem.kernels._dispatch import is_async_device
from kvmem.kernels.alloc.checks import (
    agree,
    check_batch,
    check_hints,
    decode_count_host,
    decode_problems,
    decode_problems_np,
    extend_counts_host,
    extend_problems,
    extend_problems_np,
)


class TokenSlots:
    """alloc_extend and alloc_decode of a :class:`~kvmem.allocator.PageAllocator`."""

    if TYPE_CHECKING:  # what PageAllocator (kvmem/allocator.py) provides
        device: torch.device
        num_pages: int
        page_size: int
        _count: int
        _pending: bool
        _owned: torch.Tensor
        _owned_np: Any
        _err: torch.Tensor

        def _flag(self, check: bool) -> bool: ...

        def _take(self, n: int, flag: bool, bound: int) -> torch.Tensor: ...

        def _read_device(self, t: torch.Tensor | None, raise_pending: bool = True) -> list[int]: ...

    @on_own_stream
    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor,
        *,
        prefix_lens_cpu: torch.Tensor | None = None,
        seq_lens_cpu: torch.Tensor | None = None,
        extend_num_tokens: int | None = None,
        check: bool = True,
    ) -> torch.Tensor:
        """Token slots (page * page_size + offset) for extending each request from
        ``prefix_lens[i]`` to ``seq_lens[i]`` tokens, sglang 0.5.23's
        PagedTokenToKVPoolAllocator.alloc_extend: first the rest of the request's
        partial last page (after ``last_loc[i]``, the slot of its last token), then new
        pages.  Inputs: int32/int64 [bs] on the allocator's device; the ``*_cpu`` hints
        are the same lengths on the CPU (both or neither); ``extend_num_tokens`` =
        sum(seq_lens - prefix_lens).  Returns int64 [extend_num_tokens], requests in
        order.  ValueError for bad inputs (negative lengths, prefix_len > seq_len,
        ``last_loc`` not the last slot of an allocated partial page, hints or
        extend_num_tokens that disagree with the device tensors) and OutOfPagesError,
        nothing changed.  With check=False on CUDA the count of new pages comes from
        the hints (no sync) and the inputs are checked on the device (class
        docstring)."""
        bs = check_batch(
            "alloc_extend",
            self.device,
            prefix_lens=prefix_lens,
            seq_lens=seq_lens,
            last_loc=last_loc,
        )
        hints = check_hints(
            "alloc_extend", bs, prefix_lens_cpu=prefix_lens_cpu, seq_lens_cpu=seq_lens_cpu
        )
        if extend_num_tokens is not None:
            extend_num_tokens = as_int("extend_num_tokens", extend_num_tokens)
        flag = self._flag(check)
        ps = self.page_size
        if not flag:
            num_new, total = self._checked_extend_counts(
                prefix_lens, seq_lens, last_loc, hints, extend_num_tokens, check
            )
        elif hints is not None:  # no sync
            num_new, total = extend_counts_host(hints[0], hints[1], ps)
            if extend_num_tokens is not None:
                total = extend_num_tokens
        else:  # one sync
            num_new, total = torch.stack(K.extend_counts(prefix_lens, seq_lens, ps)).tolist()
        if num_new < 0 or total < 0:
            raise ValueError(
                f"alloc_extend: the lengths ask for {num_new} new pages and "
                f"{total} tokens; prefix_len > seq_len somewhere"
            )
        if num_new > self._count:
            raise OutOfPagesError(num_new, self._count, "alloc_extend")
        new_pages = self._take(num_new, flag, total // ps + bs + 1)
        if bs == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if ps == 1 and not flag:  # checked inputs: every token is a new page, in order
            return new_pages
        return K.extend_slots(
            prefix_lens, seq_lens, last_loc, new_pages, ps, total, self._err, flag=flag
        )

    @on_own_stream
    def alloc_decode(
        self,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor,
        *,
        seq_lens_cpu: torch.Tensor | None = None,
        check: bool = True,
    ) -> torch.Tensor:
        """One token slot per request, whose length becomes ``seq_lens[i]`` (sglang
        0.5.23 alloc_decode): a new page when ``(seq_len - 1) % page_size == 0``, else
        ``last_loc[i] + 1``.  int64 [bs].  ValueError / OutOfPagesError, nothing
        changed."""
        bs = check_batch("alloc_decode", self.device, seq_lens=seq_lens, last_loc=last_loc)
        hints = check_hints("alloc_decode", bs, seq_lens_cpu=seq_lens_cpu)
        flag = self._flag(check)
        ps = self.page_size
        if not flag:
            num_new = self._checked_decode_count(seq_lens, last_loc, hints, check)
        elif hints is not None:  # no sync
            num_new = decode_count_host(hints[0], ps)
        else:  # one sync
            num_new = int(K.decode_counts(seq_lens, ps).item())
        if num_new > self._count:
            raise OutOfPagesError(num_new, self._count, "alloc_decode")
        new_pages = self._take(num_new, flag, bs)
        if bs == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if ps == 1 and not flag:  # checked inputs: every request starts a page
            return new_pages
        return K.decode_slots(seq_lens, last_loc, new_pages, ps, self._err, flag=flag)

    def _checked_extend_counts(
        self, prefix_lens, seq_lens, last_loc, hints, extend_num_tokens, check
    ) -> tuple[int, int]:
        """(new pages, tokens) of a checked alloc_extend; ValueError for bad inputs.
        CUDA: torch checks on the device and one sync; CPU: numpy."""
        ps = self.page_size
        if is_async_device(seq_lens):
            problems = extend_problems(prefix_lens, seq_lens, last_loc, self._owned, ps)
            if hints is not None:
                problems = torch.cat(
                    (problems, agree(prefix_lens, hints[0]), agree(seq_lens, hints[1]))
                )
            first, code, num_new, total, *agreed = self._read_device(problems, raise_pending=check)
        else:
            if check and self._pending:
                self._read_device(None)
            first, code, num_new, total = extend_problems_np(
                prefix_lens.numpy(), seq_lens.numpy(), last_loc.numpy(), self._owned_np, ps
            )
            agreed = (
                []
                if hints is None
                else [
                    np.array_equal(prefix_lens.numpy(), hints[0].numpy()),
                    np.array_equal(seq_lens.numpy(), hints[1].numpy()),
                ]
            )
        if first >= 0:
            raise alloc_error(code, first, self.num_pages, call="alloc_extend")
        if not all(agreed):
            raise ValueError(
                "alloc_extend: prefix_lens_cpu / seq_lens_cpu disagree with prefix_lens / seq_lens"
            )
        if extend_num_tokens is not None and extend_num_tokens != total:
            raise ValueError(
                f"alloc_extend: extend_num_tokens={extend_num_tokens} but "
                f"sum(seq_lens - prefix_lens) = {total}"
            )
        return num_new, total

    def _checked_decode_count(self, seq_lens, last_loc, hints, check) -> int:
        """New pages of a checked alloc_decode; ValueError for bad inputs."""
        ps = self.page_size
        if is_async_device(seq_lens):
            problems = decode_problems(seq_lens, last_loc, self._owned, ps)
            if hints is not None:
                problems = torch.cat((problems, agree(seq_lens, hints[0])))
            first, code, num_new, *agreed = self._read_device(problems, raise_pending=check)
        else:
            if check and self._pending:
                self._read_device(None)
            first, code, num_new = decode_problems_np(
                seq_lens.numpy(), last_loc.numpy(), self._owned_np, ps
            )
            agreed = [] if hints is None else [np.array_equal(seq_lens.numpy(), hints[0].numpy())]
        if first >= 0:
            raise alloc_error(code, first, self.num_pages, call="alloc_decode")
        if not all(agreed):
            raise ValueError("alloc_decode: seq_lens_cpu disagrees with seq_lens")
        return num_new
