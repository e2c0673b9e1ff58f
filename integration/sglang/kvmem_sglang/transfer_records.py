"""What kvmem's send paths (:mod:`kvmem_sglang.transfer` on NIXL,
:mod:`kvmem_sglang.mooncake_send` on Mooncake) keep: their counters (:data:`STATS`, also
in sglang's ``/metrics``), a merged write (:class:`Batch`) and the handle of a chunk whose
write is DONE (:class:`Settled`), a chunk sent ahead of its turn (``Ahead``) and a
manager's chunks sent ahead (``TransferState``, in the side table ``state.TRANSFERS``), and the
planes of a pair the NIXL path serves (``Geometry``).  No hooks.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import ClassVar

import numpy as np

from kvmem_sglang import audit, state


@dataclass
class Stats:
    """What the path did in this process (all managers); the transfer workers of every
    manager add to it, under one lock."""

    sends: int = 0  # send_kvcache calls served here
    fallbacks: int = 0  # send_kvcache calls left to sglang (geometry not served)
    batches: int = 0  # merged writes (each posted as <= SPLIT NIXL writes)
    writes: int = 0  # engine writes posted: NIXL writes, Mooncake batch calls
    chunks: int = 0  # chunks carried by the merged writes (owners + ahead)
    sent_ahead: int = 0  # of those, chunks sent ahead of their turn
    ahead_done: int = 0  # send_kvcache calls answered by a settled write
    resent: int = 0  # chunks sent again because their ahead write failed
    index_pairs: int = 0  # (page, plane) pairs moved: sglang's descriptor count
    descriptors: int = 0  # descriptors posted after merging runs
    bytes: int = 0
    waits: int = 0  # _await_handles calls
    naps: int = 0  # sleeps inside them
    unsettled: int = 0  # waits that gave up on a write (rooms poisoned)
    cut_short: int = 0  # merged writes cut short once a piece was posted (not in batches)
    indexed: int = 0  # queued chunks read into a worker queue's index (each once)
    inspected: int = 0  # queued chunks take_ahead looked at (the index found them)
    slice_sends: int = 0  # Mooncake chunks sent as per-head slices (unequal TP)
    slice_calls: int = 0  # batch_transfer_sync calls they were posted as
    slices: int = 0  # their slices (one per token and plane)
    slice_bytes: int = 0

    _lock: ClassVar[threading.Lock] = threading.Lock()

    def as_dict(self) -> dict:
        with self._lock:
            return asdict(self)

    def add(self, **counts: int) -> None:
        """Add to the named counters, here and in ``kvmem_sglang_transfer_total{what}``
        (sglang's ``/metrics``, where prometheus_client imports; its counters lock
        themselves)."""
        with self._lock:
            for what, n in counts.items():
                setattr(self, what, getattr(self, what) + n)
        if _COUNTER is not None:
            for what, n in counts.items():
                if n:
                    _COUNTER.labels(what=what).inc(n)


_COUNTER = audit.prometheus_counter(
    "kvmem_sglang_transfer",
    "What kvmem's NIXL send path did in this sglang process "
    "(what: sends, fallbacks to sglang's own send, writes, descriptors, bytes, ...; "
    "the fields of kvmem_sglang.transfer_records.Stats)",
    "what",
)
STATS = Stats()


class Batch:
    """One merged write: its NIXL handles (those posted) and the chunks sent ahead in it.

    ``state``: "PROC" until every handle settled, then "DONE" or "ERR".  ``failed``: a
    handle was seen ERR, or a wait gave up on it, or it was cut short (a wait on it is
    then bounded).  ``cut_short``: why a piece after the first posted one never went (the
    write then ends ERR); ``refused``: that reason was a post NIXL refused (its writes
    may still land); ``raised``: a wait raised sglang's post error for it.  ``until``: a
    wait in ``send_kvcache`` gave up on it then; the worker's wait that follows reads it
    once, without a bound of its own."""

    def __init__(self, natives: list, ahead: list, nbytes: int, descs: int):
        self.natives, self.ahead = natives, ahead
        self.nbytes, self.descs = nbytes, descs
        self.state, self.failed = "PROC", False
        self.cut_short: str | None = None
        self.refused: BaseException | None = None
        self.raised = False
        self.until: float | None = None

    def __repr__(self):
        cut = f", cut short: {self.cut_short}" if self.cut_short else ""
        return (
            f"kvmem Batch({len(self.natives)} NIXL write(s), {self.descs} descriptor(s), "
            f"{self.nbytes} bytes, {len(self.ahead)} chunk(s) sent ahead, "
            f"{self.state}{cut})"
        )


class Settled:
    """The handle of a chunk sent ahead whose write is DONE: nothing left to wait for."""

    state = "DONE"

    def __init__(self, batch: Batch):
        self.batch = batch

    def __repr__(self):
        return f"kvmem Settled({self.batch!r})"


@dataclass
class Ahead:
    room: int
    peer: str
    src: np.ndarray  # the chunk's own prefill_kv_indices object (identity is the key)
    dst: np.ndarray
    batch: Batch | None = None
    counted: bool = True


@dataclass(frozen=True)
class Geometry:
    src_ptrs: np.ndarray  # uint64 [planes]
    dst_ptrs: np.ndarray  # uint64 [planes]
    item: np.ndarray  # uint64 [planes]: bytes of one page of a plane (both sides)
    src_kind: str
    dst_kind: str
    src_dev: int
    dst_dev: int


class TransferState:
    """Per manager: the chunks sent ahead, by the identity of their index array.

    Records of rooms the worker will never reach are dropped by :meth:`sweep`, which
    looks at every record only once the records doubled since its last look (so a send
    pays O(1) for it, amortized)."""

    # records below which sweep never looks (a handful of rooms costs nothing to keep)
    SWEEP_MIN = 64

    def __init__(self):
        self.lock = threading.Lock()
        self.ahead: dict[int, Ahead] = {}
        self._kept = 0  # records left by the last sweep that looked

    def take(self, src) -> Ahead | None:
        with self.lock:
            rec = self.ahead.get(id(src))
            if rec is not None and rec.src is src:
                del self.ahead[id(src)]
                return rec
            return None

    def sent_ahead(self, src) -> bool | None:
        """Whether the chunk of ``src`` is in a write that has not failed: True once that
        write is DONE, False while it is in flight; None when it is in none, or in one
        that failed (it may go ahead again, in a later write)."""
        with self.lock:
            rec = self.ahead.get(id(src))
            if rec is None or rec.src is not src:
                return None
            if rec.batch is None or rec.batch.state == "PROC":
                return False
            return True if rec.batch.state == "DONE" else None

    def put(self, rec: Ahead) -> None:
        with self.lock:
            self.ahead[id(rec.src)] = rec

    def sweep(self, mgr) -> None:
        """Forget records of rooms the manager no longer knows (cleared, or never to be
        reached by the worker) whose write settled; looks only once the records reached
        twice what the last look left, and :data:`SWEEP_MIN` (class docstring)."""
        with self.lock:
            if len(self.ahead) < max(self.SWEEP_MIN, 2 * self._kept):
                return
            for key, rec in list(self.ahead.items()):
                if (
                    rec.room not in mgr.request_status
                    and rec.batch is not None
                    and rec.batch.state != "PROC"
                ):
                    del self.ahead[key]
            self._kept = len(self.ahead)


def transfer_state(mgr) -> TransferState:
    return state.TRANSFERS.setdefault(mgr, TransferState)
