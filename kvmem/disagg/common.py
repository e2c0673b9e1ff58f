"""What both sides of the PD lifecycle share: states, abort reasons, control messages,
the page ledger (who holds which page), the counters, and the device plumbing of the hot
path: host copies made without a host sync (:class:`HostCopy`, :func:`to_device`) and
the events that order host decisions after device work (:func:`device_event`)."""

from __future__ import annotations

import bisect
import dataclasses
import enum
import math
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from kvmem.errors import KVMemError
from kvmem.transfer.errors import TransferError, TransferInFlightError


class KVPoll(enum.IntEnum):
    """sglang's KVPoll values."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class Outcome(str, enum.Enum):
    """How a request ended; the four partition the requests."""

    SUCCEEDED = "succeeded"
    ABORTED = "aborted"      # client or decode-side abort, or a pause (503)
    TIMED_OUT = "timed_out"  # 504
    FAILED = "failed"        # 500: a send failed


# HTTP-like status codes carried by abort reasons.
OK = 200
CLIENT_CLOSED = 499
INTERNAL_ERROR = 500
SERVICE_UNAVAILABLE = 503
GATEWAY_TIMEOUT = 504

_OUTCOME_OF_STATUS = {
    OK: Outcome.SUCCEEDED, CLIENT_CLOSED: Outcome.ABORTED, SERVICE_UNAVAILABLE: Outcome.ABORTED,
    GATEWAY_TIMEOUT: Outcome.TIMED_OUT, INTERNAL_ERROR: Outcome.FAILED,
}


# The extra state written after a request's last KV chunk (first output token, lengths):
# its size in the decode's landing region and in the prefill's staging buffer.
AUX_BYTES = 64
# Bootstrap, transfer and decode timeouts, seconds: sglang's default
# (SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT, docs/disagg.md).
DEFAULT_TIMEOUT = 600.0


# The statuses an early end of a request carries (docs/disagg.md, the lifecycle table): what a
# caller's abort and a peer's ABORT_REQ may give.
END_STATUSES = frozenset({CLIENT_CLOSED, INTERNAL_ERROR, SERVICE_UNAVAILABLE, GATEWAY_TIMEOUT})


@dataclass(frozen=True)
class Reason:
    """Why a request ended: an HTTP-like status and a message naming the request."""

    status: int
    message: str

    @property
    def outcome(self) -> Outcome:
        return _OUTCOME_OF_STATUS[self.status]


class ProtocolError(KVMemError, ValueError):
    """A control message from the peer that is malformed (kvmem.disagg.protocol.parse) or
    does not fit this side's state (an unknown request, a duplicate bootstrap room, pages
    out of range, sizes that do not match, an epoch of another pause); or a caller's call
    that names an unknown or busy request id.  Nothing was changed."""


# --- the caller's arguments -----------------------------------------------------------------
def check_id(what: str, name: str, v) -> None:
    """ValueError naming ``v`` unless it is an int in [0, 2**63) (a request id, a room)."""
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 63:
        raise ValueError(f"{what}: {name} must be an int in [0, 2**63), got {v!r}")


def check_caller_args(what: str, rid, status=None, message=None) -> None:
    """A caller's abort: ``rid`` an id, ``status`` one of :data:`END_STATUSES` (not OK: an
    abort is no success), ``message`` a str or None.  ValueError naming the value."""
    check_id(what, "rid", rid)
    if isinstance(status, bool) or not isinstance(status, int) or status not in END_STATUSES:
        raise ValueError(f"{what}: request {rid}: status must be one of "
                         f"{sorted(END_STATUSES)} (an early end in the lifecycle table), "
                         f"got {status!r}")
    if message is not None and not isinstance(message, str):
        raise ValueError(f"{what}: request {rid}: message must be a str or None, got "
                         f"{type(message).__name__}")


# --- device and host, without a host sync ----------------------------------------------------
# On CUDA the sides' step() never waits for the device: what the host must know of device
# values (page ids for messages and descriptors, the stand-in's verdicts) comes through a
# HostCopy polled in later steps, host values go to the device through pinned memory, and
# host decisions that depend on device work finishing (post a packed chunk, reuse a
# landing slot) poll an event recorded after that work.  On the CPU every copy is done when
# it returns and every event is ready at once, so behaviour there is the same step for step.

class _Ready:
    """What :func:`device_event` gives on the CPU: device work is done when it returns."""

    @staticmethod
    def query() -> bool:
        return True


READY = _Ready()


def device_event(device):
    """``() -> object with query()``: on CUDA a ``torch.cuda.Event`` recorded on
    ``device``'s current stream (where the side's kernels and copies run) when called; on
    the CPU an object that is always ready.  Polled with ``query()``, never waited on."""
    device = torch.device(device)
    if device.type != "cuda":
        return lambda: READY

    def record():
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        return ev

    return record


class HostCopy:
    """A host copy of a device tensor made without a host sync: on CUDA a non-blocking
    copy into pinned host memory queued on the tensor's device's current stream (after
    the work that produced the tensor) and an event recorded after it; on the CPU the
    tensor itself (which must not change afterwards).

    ``t`` : any shape, a dtype NumPy has (``int64 [n]`` page ids, a 0-dim bool verdict).
    :meth:`ready` polls (never waits); :meth:`numpy` gives the copy once ready.  The one
    way the disagg sides read device values (tests/disagg/test_sync_free.py)."""

    __slots__ = ("_host", "_event")

    def __init__(self, t: torch.Tensor):
        if t.device.type == "cuda":
            with torch.cuda.device(t.device):
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(t.device))
            self._host, self._event = host, ev
        else:
            self._host, self._event = t, None

    def ready(self) -> bool:
        if self._event is not None and self._event.query():
            self._event = None
        return self._event is None

    def numpy(self) -> np.ndarray:
        """The copy (a NumPy view of host memory); RuntimeError while not :meth:`ready`."""
        if not self.ready():
            raise RuntimeError("HostCopy.numpy: the copy is still in flight; poll ready()")
        return self._host.numpy()


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """The CPU tensor ``t`` on ``device`` without a host sync: through pinned memory and a
    non-blocking copy on CUDA (torch's pinned-memory cache keeps the staging copy until
    the device has read it, so ``t`` may change at once); ``t`` itself on the CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


# --- addressing a peer's registration -------------------------------------------------------
class RegionMap:
    """A registration's regions as one byte space: offset ``o`` is byte ``o`` of the
    regions concatenated in their listed order (the decode's landing offsets are such
    offsets; on the CUDA VMM backend, one region per 2 GiB physical chunk, they are also
    the landing tensor's offsets).  :meth:`ranges` cuts a byte range at region boundaries,
    so a write that spans two regions becomes two remote ranges of one post_write (the
    engine requires each remote range to lie in one region).  O(log regions) a call."""

    def __init__(self, regions):
        self.regions = tuple((int(a), int(n)) for a, n in regions)
        self._starts = []
        pos = 0
        for _, n in self.regions:
            self._starts.append(pos)
            pos += n
        self.size = pos

    def ranges(self, off: int, nbytes: int) -> list[tuple[int, int]]:
        """``[(addr, n), ...]`` of bytes ``[off, off + nbytes)``; ValueError outside."""
        if off < 0 or nbytes <= 0 or off + nbytes > self.size:
            raise ValueError(f"RegionMap: bytes [{off}, +{nbytes}) outside the "
                             f"{self.size} bytes of {len(self.regions)} region(s)")
        i = bisect.bisect_right(self._starts, off) - 1
        out = []
        while nbytes:
            addr, n = self.regions[i]
            inner = off - self._starts[i]
            take = min(n - inner, nbytes)
            out.append((addr + inner, take))
            off, nbytes, i = off + take, nbytes - take, i + 1
        return out


def buffer_map(tensor: torch.Tensor, regions) -> RegionMap:
    """The :class:`RegionMap` of a buffer's own registration: ``regions`` (its memory
    backend's, one per physical chunk) must tile ``tensor`` (uint8 ``[nbytes]``) in order
    from its first byte, so that a byte offset into ``tensor`` is the same offset into the
    map and :meth:`RegionMap.ranges` cuts a slot at the chunk boundaries it crosses.
    ValueError naming the regions otherwise."""
    m = RegionMap(regions)
    pos = tensor.data_ptr()
    for addr, n in m.regions:
        if addr != pos:
            break
        pos += n
    else:
        if m.size == tensor.numel():
            return m
    shown = ", ".join(f"[{a:#x}, +{n})" for a, n in m.regions[:4])
    raise ValueError(f"regions {shown}{' ...' if len(m.regions) > 4 else ''} do not tile the "
                     f"{tensor.numel()}-byte buffer at {tensor.data_ptr():#x} in order")


# --- control messages ---------------------------------------------------------------------
# Their format, the parser every received message goes through, and the inbox that counts
# refusals: kvmem.disagg.protocol.


def sole_peer(kind: str, peers, hint: str = "") -> str:
    """The one peer of ``kind`` ("prefill" or "decode") a side has; ValueError naming
    them when it has several (``hint`` ends the message)."""
    if len(peers) != 1:
        raise ValueError(f"{kind}_peer: this side has {len(peers)} {kind} peers "
                         f"{list(peers)}{hint}")
    return peers[0]


def tell(engine, peer: str, msg: bytes, metrics: "Metrics", log) -> bool:
    """Send one control message; a peer that cannot be reached (its process died, its
    connection broke) is logged and counted (in total and for that peer), not raised: the
    timeouts on both sides end what it leaves behind.  Returns whether the message went
    out."""
    try:
        engine.send_notif(peer, msg)
        return True
    except TransferError as e:
        metrics.send_errors += 1
        metrics.peer(peer).send_errors += 1
        log.error("%s: cannot reach %s: %s", metrics.side, peer, e)
        return False


def peer_names(what: str, one, many) -> tuple[str, ...]:
    """The peers a side talks to, from its ``*_peer`` argument (``one``: one agent name)
    or its ``*_peers`` argument (``many``: a sequence of names): exactly one of the two
    given, every name a non-empty str, no name twice.  ValueError naming the values."""
    if (one is None) == (many is None):
        raise ValueError(f"{what}_peer or {what}_peers: give exactly one, got "
                         f"{what}_peer={one!r}, {what}_peers={many!r}")
    names = (one,) if one is not None else tuple(many) if not isinstance(many, str) else None
    if not names or any(not isinstance(n, str) or not n for n in names):
        raise ValueError(f"{what}_peers must be non-empty names (a sequence of str), got "
                         f"{one if one is not None else many!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"{what}_peers names a peer twice: {list(names)}")
    return names


# --- page ledger -----------------------------------------------------------------------------
class PeerTable:
    """The prepared block list of a peer's pool (``engine.prep_remote``) at the newest
    metadata the engine holds for it: prepared once per epoch; an older list is retired
    and released once no transfer uses it any more.

    ``table``: the current list, or None before the first :meth:`get` that found one."""

    def __init__(self, engine, peer: str):
        self.engine, self.peer = engine, peer
        self.table = None
        self._retired: list = []

    def get(self):
        """The current list; None when the peer's pool is closed (pausing) or unknown."""
        try:
            remote = self.engine.remote(self.peer, "kv")
        except KeyError:
            return None
        if not remote.live or remote.layout is None:
            return None
        t = self.table
        if t is None or t.remote != remote:
            if t is not None:
                self._retired.append(t)
            self.table = t = self.engine.prep_remote(remote)
        if self._retired:
            keep = []
            for old in self._retired:
                try:
                    self.engine.release_table(old)
                except TransferInFlightError:
                    keep.append(old)
            self._retired = keep
        return t


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
        leaked, quarantined = {}, {}
        for o, p in self._held.items():
            ids = sorted(int(x) for x in p.tolist())
            owned.difference_update(ids)
            (quarantined if o in self._quarantined else leaked)[o] = ids
        return {"leaked": leaked, "quarantined": quarantined, "unaccounted": sorted(owned)}


# --- counters -------------------------------------------------------------------------------
@dataclass
class PeerCounts:
    """What one side counts about one peer: the requests bound to it, by outcome (they
    add up, over the peers, to the side's own ``requests``), the bytes moved with it (the
    prefill: bytes of its writes and offered reads that completed DONE; the decode: bytes
    that landed from it), and the control messages it could not be sent."""

    requests: Counter = field(default_factory=Counter)
    bytes: int = 0
    send_errors: int = 0

    def as_dict(self) -> dict:
        return {"requests": dict(self.requests), "bytes": self.bytes,
                "send_errors": self.send_errors}


@dataclass
class Metrics:
    """Counters of one side, plain fields the side increments: for a report
    (:meth:`as_dict`), a log line (:meth:`log_line`) or a Prometheus scrape
    (:func:`kvmem.disagg.metrics.register` reads them through prometheus_client)."""

    side: str
    requests: Counter = field(default_factory=Counter)  # by outcome
    bytes_packed: int = 0
    bytes_sent: int = 0          # prefill: bytes of writes that completed DONE
    bytes_landed: int = 0        # decode: bytes of chunks whose notification arrived
    bytes_verified: int = 0      # decode: landed bytes equal to what was sent
    bytes_corrupt: int = 0       # decode: landed bytes that differ
    pauses: int = 0
    pause_seconds: float = 0.0
    protocol_errors: int = 0
    send_errors: int = 0  # control messages the peer could not be sent
    time_to_free: list = field(default_factory=list)  # seconds, abort in the running batch
    peers: dict = field(default_factory=dict)  # peer name -> PeerCounts (see peer())

    def peer(self, name: str) -> PeerCounts:
        """The counters about peer ``name`` (made on first use)."""
        c = self.peers.get(name)
        if c is None:
            c = self.peers[name] = PeerCounts()
        return c

    def as_dict(self) -> dict:
        """Every counter, JSON-ready (for reports); ``peers``: name -> ``PeerCounts.as_dict``."""
        out = dataclasses.asdict(self)
        out["requests"] = dict(self.requests)
        out["peers"] = {n: c.as_dict() for n, c in self.peers.items()}
        return out

    def log_line(self, freed_by_reason: Counter) -> str:
        req = " ".join(f"{o.value}={self.requests[o.value]}" for o in Outcome)
        freed = " ".join(f"{r}={n}" for r, n in sorted(freed_by_reason.items()))
        return (f"kvmem {self.side}: requests {req}; pages freed {freed or '-'}; "
                f"bytes packed={self.bytes_packed} sent={self.bytes_sent} "
                f"landed={self.bytes_landed} verified={self.bytes_verified} "
                f"corrupt={self.bytes_corrupt}; pauses={self.pauses} "
                f"({self.pause_seconds:.3f} s); protocol errors={self.protocol_errors} "
                f"send errors={self.send_errors}")


def now() -> float:
    return time.monotonic()


# --- pacing a polling loop ------------------------------------------------------------------
class Backoff:
    """Naps of a loop that polls (no NIXL progress thread): after ``spins`` steps in a row
    that made no progress the loop sleeps, ``first`` seconds, then twice as long each
    further step without progress, up to ``most``; a step that made progress ends the
    backoff at once (no nap after it, the next lack of progress starts from ``spins``
    again).  So real work never waits for a nap, and a loop that only waits for its peer
    (a PULLED, a CHUNK, a posted write) polls every ``most`` seconds or so instead of
    spinning on the core it shares with the peer and the transfers.

    ``pace(progressed)`` is called once per loop iteration; it returns the seconds it
    asked ``sleep`` for (0.0: no nap).  ``naps`` and ``napped`` count them."""

    def __init__(self, first: float, most: float, spins: int = 0, sleep=time.sleep):
        for name, v in (("first", first), ("most", most)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"Backoff: {name} must be a finite number of seconds, "
                                 f"got {v!r}")
        if not 0 < first <= most:
            raise ValueError(f"Backoff: need 0 < first <= most, got {first!r}, {most!r}")
        if isinstance(spins, bool) or not isinstance(spins, int) or spins < 0:
            raise ValueError(f"Backoff: spins must be an int >= 0, got {spins!r}")
        self.first, self.most, self.spins, self.sleep = first, most, spins, sleep
        self.idle_steps = 0  # steps in a row without progress
        self.nap = 0.0  # the last nap (0.0: none since the last progress)
        self.naps = 0
        self.napped = 0.0

    def pace(self, progressed: bool) -> float:
        if progressed:
            self.idle_steps, self.nap = 0, 0.0
            return 0.0
        self.idle_steps += 1
        if self.idle_steps <= self.spins:
            return 0.0
        self.nap = min(max(2 * self.nap, self.first), self.most)
        self.naps += 1
        self.napped += self.nap
        self.sleep(self.nap)
        return self.nap
