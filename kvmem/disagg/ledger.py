"""Who holds which pages of one allocator (:class:`Ledger`): every page freed exactly
once, and an audit against the allocator's own map."""

from __future__ import annotations

from collections import Counter

import torch

from kvmem.errors import KVMemError


class Ledger:
    """Who holds which pages of one allocator: an owner (a request id, or a name such as
    "prefix-cache") per set of pages.  Every allocation is recorded here and every free
    goes through :meth:`release`, which frees exactly once: a second release of the same
    owner is a bug and raises.  ``audit`` compares the ledger with the allocator's own
    ownership map."""

    def __init__(self, allocator):
        self.alloc = allocator
        self._held: dict[object, torch.Tensor] = {}
        self._quarantined: set = set()
        self.freed_by_reason: Counter = Counter()

    def hold(self, owner, pages: torch.Tensor) -> None:
        """Record ``pages`` (just allocated) as ``owner``'s; appends to what it holds."""
        if pages.numel() == 0:
            self._held.setdefault(owner, pages)
            return
        old = self._held.get(owner)
        self._held[owner] = pages if old is None or old.numel() == 0 else torch.cat((old, pages))

    def holds(self, owner) -> bool:
        return owner in self._held

    def pages(self, owner) -> torch.Tensor:
        return self._held[owner]

    def rename(self, owner, to) -> None:
        """Move what ``owner`` holds (and its quarantine) to ``to``, which holds nothing."""
        if owner not in self._held or to in self._held:
            raise KVMemError(f"ledger: cannot move the pages of {owner!r} to {to!r}")
        self._held[to] = self._held.pop(owner)
        if owner in self._quarantined:
            self._quarantined.discard(owner)
            self._quarantined.add(to)

    def quarantine(self, owner) -> None:
        """Mark ``owner``'s pages as possibly the target of a posted write: they are not
        freed until :meth:`release` (after DONE/ERR or the sender's ack)."""
        if owner in self._held:
            self._quarantined.add(owner)

    def release(self, owner, reason: str) -> int:
        """Free every page ``owner`` holds, once.  Returns the number of pages freed.  The
        free is unchecked on the device (no host sync on CUDA: a bad free is raised by the
        allocator's next synchronising call, e.g. :meth:`audit`); the CPU checks anyway."""
        if owner not in self._held:
            raise KVMemError(f"ledger: {owner!r} holds no pages (freed twice?)")
        pages = self._held.pop(owner)
        self._quarantined.discard(owner)
        if pages.numel():
            self.alloc.free(pages, check=False)
        self.freed_by_reason[reason] += int(pages.numel())
        return int(pages.numel())

    def owners(self) -> dict:
        """owner -> number of pages, for everything held now."""
        return {o: int(p.numel()) for o, p in self._held.items()}

    def audit(self) -> dict:
        """At idle: ``{"leaked": {owner: [pages]}, "quarantined": {owner: [pages]},
        "unaccounted": [pages]}``.  Every page held in the ledger at idle is leaked unless
        quarantined; ``unaccounted`` are pages the allocator counts as allocated that no
        owner holds (a free that bypassed the ledger)."""
        owned = set(self.alloc.allocated_pages().tolist())
        leaked: dict[object, list[int]] = {}
        quarantined: dict[object, list[int]] = {}
        for o, p in self._held.items():
            ids = sorted(int(x) for x in p.tolist())
            owned.difference_update(ids)
            (quarantined if o in self._quarantined else leaked)[o] = ids
        return {"leaked": leaked, "quarantined": quarantined, "unaccounted": sorted(owned)}
