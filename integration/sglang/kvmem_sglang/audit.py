"""Leak audit of an idle PD prefill scheduler.

When sglang's scheduler has nothing queued, running or in flight, every KV page is free
or owned by the prefix cache, every request slot (``req_to_token_pool``) is free, and every
metadata slot (``req_to_metadata_buffer_idx_allocator``) is free.  :func:`audit` counts
what is held beyond that and names the owners it can find: the requests the adapter saw
enter the scheduler (:func:`track`) that still hold a ``req_to_token`` row, KV or a
metadata slot.  Anything held with no such request is owned by ``<no live request>``.

A leak is reported, never raised: one log line naming the owners, and the counters of
:data:`STATS` (and, where ``prometheus_client`` imports, the counter
``kvmem_sglang_prefill_leaked_total{kind=pages|req_slots|metadata_slots}``) grow by the
leaked amounts.  The server keeps running.

Invariant checked (idle scheduler, page_size P, allocator of S token slots):
``available_size + prefix-cache tokens == S`` and both slot pools fully free.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvmem_sglang import state

logger = logging.getLogger("kvmem.sglang")

NO_OWNER = "<no live request>"


@dataclass
class LeakReport:
    """What an idle scheduler still holds; all zero when nothing leaked."""

    pages: int = 0  # KV pages held outside the prefix cache
    req_slots: int = 0
    metadata_slots: int = 0
    page_owners: dict = field(default_factory=dict)  # rid -> pages
    req_slot_owners: list = field(default_factory=list)
    metadata_owners: list = field(default_factory=list)

    @property
    def leaked(self) -> bool:
        return bool(self.pages or self.req_slots or self.metadata_slots)

    def line(self) -> str:
        def owners(xs):
            return ", ".join(map(str, xs)) or NO_OWNER

        return (
            f"idle PD prefill scheduler holds {self.pages} KV page(s) "
            f"[{', '.join(f'{r}: {n}' for r, n in self.page_owners.items()) or NO_OWNER}], "
            f"{self.req_slots} request slot(s) [{owners(self.req_slot_owners)}], "
            f"{self.metadata_slots} metadata slot(s) [{owners(self.metadata_owners)}]"
        )


@dataclass
class AuditStats:
    """Counters the tests (and an operator, through prometheus) read."""

    audits: int = 0
    leaks: int = 0  # audits that found a leak
    leaked_pages: int = 0
    leaked_req_slots: int = 0
    leaked_metadata_slots: int = 0
    last: LeakReport | None = None


STATS = AuditStats()


def prometheus_counter(name: str, doc: str, label: str):
    """A prometheus_client Counter with one label (sglang's ``/metrics`` shows it as
    ``<name>_total``), or None where prometheus_client does not import or the name is
    registered already in this process (a module reloaded)."""
    try:
        from prometheus_client import Counter
    except ImportError:  # sglang runs without it too
        return None
    try:
        return Counter(name, doc, labelnames=[label])
    except ValueError:
        return None


_COUNTER = prometheus_counter(
    "kvmem_sglang_prefill_leaked",
    "KV pages, request slots and metadata slots an idle sglang PD prefill scheduler still held",
    "kind",
)


def track(req) -> None:
    state.LIVE.set(req, True)


def audit(scheduler) -> LeakReport:
    """Count what ``scheduler`` (idle) still holds; report a leak once (log + metric)."""
    # not kvmem.disagg's Ledger: sglang allocates and frees these pages itself; counted here
    alloc = scheduler.token_to_kv_pool_allocator
    page_size = max(int(getattr(alloc, "page_size", 1)), 1)
    tree = scheduler.tree_cache
    cached = 0
    for name in ("evictable_size", "protected_size"):
        fn = getattr(tree, name, None)
        if fn is not None:
            cached += int(fn())
    held_tokens = int(alloc.size) - int(alloc.available_size()) - cached
    req_pool = scheduler.req_to_token_pool
    meta = scheduler.req_to_metadata_buffer_idx_allocator
    rep = LeakReport(
        pages=max(held_tokens, 0) // page_size,
        req_slots=int(req_pool.size) - int(req_pool.available_size()),
        metadata_slots=int(meta.size) - int(meta.available_size()),
    )
    if rep.leaked:
        owned = 0
        for req in state.LIVE.objects():
            kv = getattr(req, "kv", None)
            if kv is None:
                continue
            if kv.req_pool_idx is not None:
                rep.req_slot_owners.append(req.rid)
                n = -(-int(kv.kv_allocated_len - kv.cache_protected_len) // page_size)
                if n > 0:
                    rep.page_owners[req.rid] = n
                    owned += n
            if getattr(req, "metadata_buffer_index", -1) >= 0:
                rep.metadata_owners.append(req.rid)
        if rep.pages > owned:
            rep.page_owners[NO_OWNER] = rep.pages - owned
    _record(rep)
    return rep


def _record(rep: LeakReport) -> None:
    STATS.audits += 1
    STATS.last = rep
    if not rep.leaked:
        return
    STATS.leaks += 1
    STATS.leaked_pages += rep.pages
    STATS.leaked_req_slots += rep.req_slots
    STATS.leaked_metadata_slots += rep.metadata_slots
    if _COUNTER is not None:
        for kind, n in (
            ("pages", rep.pages),
            ("req_slots", rep.req_slots),
            ("metadata_slots", rep.metadata_slots),
        ):
            if n:
                _COUNTER.labels(kind=kind).inc(n)
    logger.error("kvmem-sglang leak audit: %s", rep.line())
