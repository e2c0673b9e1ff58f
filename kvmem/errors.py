"""kvmem's exceptions.  Each carries the values that explain it; a call that raises
one has changed nothing (the allocator's device-flag errors say what they restored)."""

from __future__ import annotations


class KVMemError(Exception):
    """Base class of kvmem's own errors."""


class OutOfPagesError(KVMemError):
    """An allocation asked for more pages than are free.  The allocator is unchanged."""

    def __init__(self, requested: int, available: int, what: str = "alloc"):
        self.requested = requested
        self.available = available
        super().__init__(
            f"{what}: out of KV pages: {requested} page(s) requested, {available} free"
        )


class DoubleFreeError(KVMemError):
    """A free named a page that is not allocated (freed already, never handed out,
    page 0, out of range, or listed twice in one free).  Nothing was freed."""

    def __init__(self, page: int, reason: str):
        self.page = page
        self.reason = reason
        super().__init__(f"free: page {page} {reason}; nothing was freed")


class ReleasedPoolError(KVMemError):
    """The pool's physical memory is released; touching it would fault."""
