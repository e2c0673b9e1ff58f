"""TransferEngine: one-sided writes between registered memory of two agents, under epochs.

This module holds the rules every transfer engine obeys (registrations, metadata, the
epoch guard, range checks, the in-flight table); an engine subclass (``kvmem.transfer.nixl``)
only moves bytes.  The PD lifecycle (``kvmem.disagg``) drives it.

Vocabulary::

    registration   a named set of local regions: key -> (epoch, [(addr, nbytes)], mem, device)
                   e.g. "kv" = a KVPool's regions() (few, large), "staging" = a packed buffer
    metadata       local_metadata(): bytes a peer needs to write into us (our agent name,
                   incarnation, snapshot version, every registration with its epoch, and
                   the transport's own blob).  Published out of band (bootstrap, notif).
    RemoteMemory   one registration of a peer as this engine learned it (add_peer)
    handle         one posted write; poll() -> "PROC" | "DONE" | "ERR"

The epoch rule
--------------
A registration's epoch is the epoch of the memory behind it (``KVPool.epoch``: +1 on every
resume).  Per key, epochs only grow: ``register(key, .., epoch)`` refuses an epoch not
newer than the key's last one, and ``deregister(key)`` leaves a *tombstone* ("key closed
at epoch e") in the metadata until the key is registered again.  A metadata snapshot is
ordered by ``(incarnation, version)``: ``incarnation`` is the engine's creation time in
ns (a restarted peer with the same name supersedes the old one), ``version`` grows on
every register/deregister.  An engine remembers, per peer, the newest snapshot it was
given; ``post_write`` refuses with :class:`StaleEpochError`, *before anything is posted*,
a RemoteMemory that is not the newest one this engine knows for that (peer, key): an
older epoch, an older incarnation, or a key whose newest entry is a tombstone.
``add_peer`` refuses a snapshot older than the one it holds.

What the transport does not do (NIXL over UCX, checked on this machine)
-----------------------------------------------------------------------
* Deregistration revokes nothing.  A write built from a peer's old metadata still lands
  after the peer deregistered (and again after it re-registered), and the initiator's
  NIXL keeps the sections of a region the peer dropped (loading newer metadata merges).
  A target cannot refuse a one-sided write.  So the guard is on the initiator (the epoch
  rule above) and on ordering (below); raw NIXL calls bypass it.
* The epoch guard acts on what the initiator *knows*: the pause path must make sure every
  peer has applied the tombstone (and acknowledged) before the memory is released.
* Cancelling an in-flight write (``release(h, abort=True)``) does not tell whether its
  bytes landed; its target pages must be treated as written (quarantined), and its
  notification is never delivered.
* A write's notification leaves when the initiator's poll sees the write complete, not
  by itself: the sender polls its writes (``in_flight()`` once per loop step, or
  ``drain``), or the target never hears of them.  PROC does not mean "not landed".

Ordering the pause path must follow (``kvmem.disagg`` owns it)
---------------------------------------------------------------
Pause, on the engine B that owns the memory::

    1. stop posting writes from the pool (abort / hold requests)
    2. B.drain(timeout): every write B posted is DONE or ERR
    3. B.deregister(key)      (refused while B's writes from it are in flight)
    4. send every peer B.local_metadata() (now a tombstone for key); each peer A:
         A.add_peer(tombstone)   -> A's posts into key are refused from here on
         A.drain(peer=B.name)    -> A's writes into B are DONE/ERR
         A acknowledges (send_notif); B waits for every ack (or the peer's timeout)
    5. pool.release()

Resume::

    6. pool.resume()          (epoch + 1)
    7. B.register_pool(pool, key)   one call, O(regions), never O(layers)
    8. send every peer B.local_metadata(); A.add_peer() it; only then do A's writes land

Deregistering (3) before the peers stop (4) is safe because deregistration revokes
nothing: a late peer write still lands in memory that is not released yet.  What matters
is that no peer write can be in flight when 5 runs.

Ranges are ``(addr, nbytes)`` pairs (a list, or an ``[n, 2]`` integer array).  The local
and remote lists of one write are two views of the same byte stream: their totals must be
equal, and they are cut at each other's boundaries (a packed chunk as one local range can
fill ``2 * layers * pages`` remote page ranges).  Every local range must lie inside a live
registration of this engine, every remote range inside the RemoteMemory's regions.

An engine is driven by one thread (NIXL's agent is created without locking).
"""

from __future__ import annotations

import abc
import bisect
import hashlib
import json
import struct
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvmem.errors import KVMemError, ReleasedPoolError

STATES = ("PROC", "DONE", "ERR")
INT64_MAX = (1 << 63) - 1  # every address and end (addr + nbytes) must fit: ranges are int64
# Blocks one prepared table may hold.  NIXL (nixl-cu12 1.5.1) reads make_prepped_xfer's
# indices as int32, whatever dtype they are given in: an index past 2**31 - 1 is refused
# once it wraps negative, and past 2**32 it silently names another block (checked here:
# index 2**32 + 5 of a strided table moved block 5).  So a larger table is refused, and
# only packed transfers move such a pool.  The 64 GiB shapes of 80-layer models stay far
# below it: 33.5 M blocks (bf16 MHA, page_size 1), 119 M (MLA 576 fp8, page_size 1).
MAX_TABLE_BLOCKS = (1 << 31) - 1


# --- errors ------------------------------------------------------------------------------

class StaleEpochError(KVMemError):
    """A write (or a metadata snapshot) was built from a peer's memory that this engine
    knows is gone: an older epoch, an older incarnation, or a closed registration.
    Nothing was posted; nothing changed."""

    def __init__(self, peer: str, key: str | None, have, newest, what: str = "post_write"):
        self.peer, self.key, self.have, self.newest = peer, key, have, newest
        where = f"{peer!r}" + (f" key {key!r}" if key is not None else "")
        super().__init__(
            f"{what}: stale metadata of {where}: built from {have}, newest known is {newest}; "
            "nothing was posted (ask the peer for its current metadata)")


class TransferInFlightError(KVMemError):
    """Writes are still in flight (PROC) where the operation needs none.  Nothing changed."""

    def __init__(self, what: str, count: int, detail: str = ""):
        self.count = count
        super().__init__(
            f"{what}: {count} posted write(s) still in flight{detail}; "
            "poll them to DONE/ERR (engine.drain(timeout)) first")


class MetadataError(KVMemError, ValueError):
    """Bytes given to add_peer are not a usable metadata snapshot.  Nothing changed; the
    transport never saw them."""


class TransferError(KVMemError):
    """The transport refused or failed an operation kvmem had validated."""


class EngineClosedError(KVMemError):
    """The engine was closed."""


# --- data types -------------------------------------------------------------------------

@dataclass(frozen=True)
class Registration:
    """A live local registration.  ``regions``: ``((addr, nbytes), ...)``."""

    key: str
    epoch: int
    regions: tuple
    mem: str          # "DRAM" | "VRAM"
    device_id: int    # 0 for DRAM, the CUDA index for VRAM
    layout: "BlockLayout | None" = None  # the blocks inside (a pool's pages), if given


@dataclass(frozen=True)
class RemoteMemory:
    """One registration of a peer, as learned from its metadata (``add_peer``).

    ``live`` is False for a tombstone (the peer deregistered ``key`` at ``epoch``); its
    ``regions`` are empty and every write to it is refused as stale.
    """

    peer: str
    key: str
    epoch: int
    regions: tuple
    mem: str
    device_id: int
    incarnation: int
    live: bool = True
    layout: "BlockLayout | None" = None

    @property
    def order(self) -> tuple:
        """Total order of a (peer, key)'s states: a tombstone closes its epoch."""
        return (self.incarnation, self.epoch, 0 if self.live else 1)

    def describe(self) -> str:
        closed = "" if self.live else " (closed)"
        return f"epoch {self.epoch}{closed}, incarnation {self.incarnation}"


@dataclass
class TransferHandle:
    """A posted write.  ``state`` is the last state poll() saw; ``error`` says why ERR."""

    id: int
    peer: str
    remote_key: str
    local_keys: tuple
    nbytes: int
    notif: bytes
    state: str = "PROC"
    error: str | None = None
    released: bool = False
    native: object = field(default=None, repr=False)
    tables: tuple = ()   # ids of the prepared tables a post_blocks handle uses
    op: str = "WRITE"


@dataclass(frozen=True)
class BlockLayout:
    """Equal-sized blocks inside a registration, addressed by index: ``planes`` is
    ``((base, stride, nbytes), ...)``; block ``j * count + i`` is ``[base_j + i * stride_j,
    + nbytes_j)``.  For a KVPool (:func:`pool_layout`): one plane per layer for K, then one
    per layer for V, block ``i`` of a plane = page ``i`` of that layer::

        index(plane j, page p) = j * num_pages + p      j < L: K of layer j; else V of j - L
    """

    planes: tuple   # ((base, stride, nbytes), ...)
    count: int      # blocks per plane (a pool's num_pages)

    @property
    def blocks(self) -> int:
        """Blocks of the layout: ``len(planes) * count`` (indices ``0 .. blocks - 1``)."""
        return len(self.planes) * self.count

    def spans(self) -> list[tuple[int, int]]:
        """``(addr, nbytes)`` of each plane's whole span (first block to last byte)."""
        return [(b, (self.count - 1) * st + n) for b, st, n in self.planes]

    def descs(self) -> np.ndarray:
        """``[len(planes) * count, 2]`` int64 ``(addr, nbytes)`` of every block, by index.
        O(blocks) memory (16 bytes a block: 0.5 GB for the 33.5 M blocks of a 64 GiB
        80-layer pool at page_size 1): engines prepare tables from the planes (NIXL's
        strided lists, O(planes)) and expand only where the transport needs it."""
        i = np.arange(self.count, dtype=np.int64)
        out = np.empty((len(self.planes), self.count, 2), dtype=np.int64)
        for j, (b, st, n) in enumerate(self.planes):
            out[j, :, 0], out[j, :, 1] = b + i * st, n
        return out.reshape(-1, 2)

    def as_json(self) -> dict:
        return dict(planes=[list(p) for p in self.planes], count=self.count)


def pool_layout(pool) -> BlockLayout | None:
    """The block layout of a KVPool's pages (see :class:`BlockLayout`); None when a page of
    a layer is not one contiguous range (then only packed transfers can move it)."""
    planes = []
    for buf in list(pool.k_buffer) + list(pool.v_buffer):
        if buf.numel() == 0 or not buf[0].is_contiguous():
            return None
        es = buf.element_size()
        planes.append((int(buf.data_ptr()), int(buf.stride(0)) * es, int(buf[0].numel()) * es))
    return BlockLayout(tuple(planes), int(pool.num_pages)) if planes else None


@dataclass
class BlockTable:
    """A descriptor list prepared once (NIXL ``prep_xfer_dlist``) for every block of a
    layout, local (``key`` of this engine) or remote (``remote``: a peer's RemoteMemory).
    :meth:`TransferEngine.post_blocks` then names blocks by index.  A local table dies with
    its registration (deregister releases it); a remote one is refused as stale once the
    engine learns newer metadata of its (peer, key)."""

    id: int
    key: str
    epoch: int
    layout: BlockLayout
    remote: RemoteMemory | None = None
    nbytes: np.ndarray = field(default=None, repr=False)  # bytes of each plane's blocks
    native: object = field(default=None, repr=False)
    released: bool = False


@dataclass
class _Peer:
    name: str
    incarnation: int
    version: int
    mems: dict  # key -> RemoteMemory
    index: dict = field(default_factory=dict)  # key -> _RegionIndex of its live regions


class _RegionIndex:
    """Regions sorted by address (disjoint: register and add_peer refuse overlaps), built
    once per registration or snapshot: numpy arrays for long range lists, Python lists
    for bisect on the few ranges of a common write."""

    def __init__(self, regions, keys=None):
        order = sorted(range(len(regions)), key=lambda i: regions[i][0])
        self.starts_l = [int(regions[i][0]) for i in order]
        self.ends_l = [int(regions[i][0]) + int(regions[i][1]) for i in order]
        self.keys = None if keys is None else [keys[i] for i in order]
        self.starts = np.array(self.starts_l, dtype=np.int64)
        self.ends = np.array(self.ends_l, dtype=np.int64)

    def find(self, addr: int, nbytes: int) -> int:
        """Index of the region holding ``[addr, addr + nbytes)`` whole, or -1."""
        i = bisect.bisect_right(self.starts_l, addr) - 1
        return i if i >= 0 and addr + nbytes <= self.ends_l[i] else -1


_FEW = 8  # range lists up to this long take the pure-Python path of post_write


def _few_pairs(ranges):
    """``ranges`` as a list of (addr, nbytes) Python ints when it is a short list of
    valid pairs (both > 0, end within int64); None otherwise (the numpy path then checks
    and words the error)."""
    if not isinstance(ranges, (list, tuple)) or not 0 < len(ranges) <= _FEW:
        return None
    out = []
    for r in ranges:
        if not isinstance(r, (list, tuple)) or len(r) != 2:
            return None
        a, n = r
        if type(a) is not int or type(n) is not int or a <= 0 or n <= 0 or a > INT64_MAX - n:
            return None
        out.append((a, n))
    return out


def check_regions(regions, what: str, error=ValueError) -> None:
    """``regions``: ``[(addr, nbytes)]`` Python ints.  ``error`` naming the first one
    that is not > 0, whose end passes 2**63 - 1, or that overlaps another."""
    for a, n in regions:
        if a <= 0 or n <= 0 or a > INT64_MAX - n:
            raise error(f"{what}: region (addr {a:#x}, nbytes {n}) must have addr > 0, "
                        f"nbytes > 0 and addr + nbytes <= 2**63 - 1")
    spans = sorted(regions)
    for (a0, n0), (a1, n1) in zip(spans, spans[1:]):
        if a0 + n0 > a1:
            raise error(f"{what}: regions overlap: [{a0:#x}, {a0 + n0:#x}) and "
                        f"[{a1:#x}, {a1 + n1:#x})")


# --- metadata envelope ------------------------------------------------------------------
# MAGIC (8) | u32 header length | u32 blob length | blake2b-128 of header+blob (16) |
# header (UTF-8 JSON) | blob (the engine's own bytes, e.g. NIXL agent metadata).
# The digest matters: NIXL half-loads a truncated blob and is then unable to load that
# peer again, even after remove_remote_agent (checked, nixl-cu12 1.5.1), so damaged bytes
# must be refused before the transport sees them.

MAGIC = b"KVMEMTX1"
_HEAD = struct.Struct("<8sII16s")
_MAX_HEADER = 16 << 20


def _digest(header: bytes, blob: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(header)
    h.update(blob)
    return h.digest()


def encode_metadata(header: dict, blob: bytes) -> bytes:
    hb = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    return _HEAD.pack(MAGIC, len(hb), len(blob), _digest(hb, blob)) + hb + blob


def _int(x, what: str, lo: int = 0) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= INT64_MAX:
        raise MetadataError(f"add_peer: metadata field {what} must be an int in [{lo}, "
                            f"2**63 - 1], got {x!r}")
    return x


def decode_metadata(data) -> tuple[dict, bytes]:
    """Check and split an envelope: ``(header, blob)``.  Raises :class:`MetadataError`."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MetadataError(f"add_peer: metadata must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _HEAD.size:
        raise MetadataError(f"add_peer: metadata is {len(data)} bytes, shorter than the "
                            f"{_HEAD.size}-byte kvmem envelope header")
    magic, hlen, blen, digest = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise MetadataError(f"add_peer: not kvmem transfer metadata (magic {magic!r}, "
                            f"expected {MAGIC!r}); pass engine.local_metadata() bytes")
    if hlen > _MAX_HEADER or _HEAD.size + hlen + blen != len(data):
        raise MetadataError(f"add_peer: metadata length mismatch: envelope says "
                            f"{_HEAD.size}+{hlen}+{blen} bytes, got {len(data)} (truncated?)")
    hb = data[_HEAD.size:_HEAD.size + hlen]
    blob = data[_HEAD.size + hlen:]
    if _digest(hb, blob) != digest:
        raise MetadataError("add_peer: metadata digest mismatch (damaged bytes); "
                            "nothing was loaded")
    try:
        header = json.loads(hb)
    except ValueError as e:
        raise MetadataError(f"add_peer: metadata header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise MetadataError("add_peer: metadata header is not an object")
    for f in ("engine", "agent"):
        if not isinstance(header.get(f), str) or not header[f]:
            raise MetadataError(f"add_peer: metadata field {f!r} missing or empty")
    _int(header.get("incarnation"), "incarnation")
    _int(header.get("version"), "version")
    regs = header.get("regs")
    if not isinstance(regs, dict):
        raise MetadataError("add_peer: metadata field 'regs' must be an object")
    live, layouts = [], []
    for key, r in regs.items():
        if not isinstance(r, dict):
            raise MetadataError(f"add_peer: registration {key!r} is not an object")
        _int(r.get("epoch"), f"regs[{key!r}].epoch")
        _int(r.get("dev"), f"regs[{key!r}].dev")
        if r.get("mem") not in ("DRAM", "VRAM") or not isinstance(r.get("live"), bool):
            raise MetadataError(f"add_peer: registration {key!r}: bad mem/live "
                                f"({r.get('mem')!r}, {r.get('live')!r})")
        regions = r.get("regions")
        if not isinstance(regions, list) or (r["live"] and not regions):
            raise MetadataError(f"add_peer: registration {key!r}: bad regions {regions!r}")
        for reg in regions:
            if not (isinstance(reg, list) and len(reg) == 2):
                raise MetadataError(f"add_peer: registration {key!r}: bad region {reg!r}")
            _int(reg[0], f"regs[{key!r}] address", 1)
            _int(reg[1], f"regs[{key!r}] nbytes", 1)
            if r["live"]:
                live.append((reg[0], reg[1]))
        if "layout" in r:
            layouts.append((r["layout"], key, regions))
    check_regions(live, "add_peer: metadata registrations", MetadataError)
    for lay, key, regions in layouts:  # once the regions are known to be sane
        _layout(lay, key, regions)
    return header, blob


def _layout(obj, key: str, regions) -> BlockLayout:
    """A registration's ``layout`` from metadata, checked: every plane's blocks inside one
    of its regions.  MetadataError otherwise."""
    planes = obj.get("planes") if isinstance(obj, dict) else None
    count = obj.get("count") if isinstance(obj, dict) else None
    if not isinstance(planes, list) or not planes or set(obj) != {"planes", "count"}:
        raise MetadataError(f"add_peer: registration {key!r}: bad layout {obj!r:.200}")
    _int(count, f"regs[{key!r}].layout.count", 1)
    out = []
    for pl in planes:
        if not (isinstance(pl, list) and len(pl) == 3):
            raise MetadataError(f"add_peer: registration {key!r}: bad layout plane {pl!r}")
        b, st, n = (_int(pl[0], "layout base", 1), _int(pl[1], "layout stride", 1),
                    _int(pl[2], "layout nbytes", 1))
        out.append((b, st, n))
    lay = BlockLayout(tuple(out), count)
    idx = _RegionIndex([tuple(r) for r in regions])
    for a, n in lay.spans():
        if a > INT64_MAX - n or idx.find(a, n) < 0:
            raise MetadataError(f"add_peer: registration {key!r}: layout plane [{a:#x}, +{n}) "
                                "is not inside one of its regions")
    return lay


# --- ranges -----------------------------------------------------------------------------

def as_ranges(ranges, what: str) -> np.ndarray:
    """``(addr, nbytes)`` pairs as an int64 ``[n, 2]`` array; ValueError when malformed."""
    try:
        arr = np.asarray(ranges)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what}: ranges must be (addr, nbytes) pairs: {e}") from None
    if arr.size == 0:
        raise ValueError(f"{what}: no ranges given")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what}: ranges must be integers, got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise ValueError(f"{what}: ranges must be (addr, nbytes) pairs, got shape {arr.shape}")
    if arr.dtype == np.uint64 and (arr > np.iinfo(np.int64).max).any():
        raise ValueError(f"{what}: an address or size does not fit in int64")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr[:, 0] <= 0) | (arr[:, 1] <= 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{what}: range {i} = (addr {int(arr[i, 0])}, nbytes {int(arr[i, 1])}): "
                         "address and nbytes must be > 0")
    over = np.flatnonzero(arr[:, 0] > INT64_MAX - arr[:, 1])
    if over.size:
        i = int(over[0])
        raise ValueError(f"{what}: range {i} = (addr {int(arr[i, 0]):#x}, nbytes "
                         f"{int(arr[i, 1])}): addr + nbytes passes 2**63 - 1")
    return arr


def _locate(ranges: np.ndarray, starts: np.ndarray, ends: np.ndarray, what: str,
            where: str) -> np.ndarray:
    """Index of the region (sorted, disjoint ``[starts, ends)``) holding each range whole;
    ValueError naming the first range that no single region holds."""
    idx = np.searchsorted(starts, ranges[:, 0], side="right") - 1
    ok = idx >= 0
    ok[ok] = ranges[ok, 0] + ranges[ok, 1] <= ends[idx[ok]]
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        a, n = int(ranges[i, 0]), int(ranges[i, 1])
        shown = ", ".join(f"[{int(s):#x}, {int(e):#x})" for s, e in zip(starts[:4], ends[:4]))
        more = "" if starts.size <= 4 else f", ... ({starts.size} regions)"
        raise ValueError(f"{what}: range {i} [{a:#x}, {a + n:#x}) is not inside one "
                         f"registered region of {where} ({shown or 'none'}{more})")
    return idx


def pair_ranges(local: np.ndarray, remote: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Cut two range lists of one byte stream at each other's boundaries: two ``[m, 2]``
    arrays whose i-th rows have equal sizes.  O(n log n) in numpy."""
    lt, rt = int(local[:, 1].sum()), int(remote[:, 1].sum())
    if lt != rt:
        raise ValueError(f"{what}: local ranges total {lt} bytes, remote ranges {rt} bytes; "
                         "they must be equal")
    lc = np.concatenate(([0], np.cumsum(local[:, 1])))
    rc = np.concatenate(([0], np.cumsum(remote[:, 1])))
    cuts = np.union1d(lc, rc)
    s, sizes = cuts[:-1], np.diff(cuts)
    li = np.searchsorted(lc, s, side="right") - 1
    ri = np.searchsorted(rc, s, side="right") - 1
    lo = np.stack([local[li, 0] + (s - lc[li]), sizes], axis=1)
    ro = np.stack([remote[ri, 0] + (s - rc[ri]), sizes], axis=1)
    return lo, ro


def mem_of(device) -> tuple[str, int]:
    """``("DRAM", 0)`` for the CPU, ``("VRAM", index)`` for a CUDA device."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return "DRAM", 0
    if dev.type == "cuda":
        return "VRAM", dev.index if dev.index is not None else torch.cuda.current_device()
    raise ValueError(f"register: unsupported device {dev} (cpu or cuda)")


# --- the engine ---------------------------------------------------------------------------

class TransferEngine(abc.ABC):
    """Registrations, peers and one-sided writes, with the epoch guard (module docstring).

    Invariants:
      * a key is live xor closed (tombstone) xor unknown; its epochs strictly grow;
      * live regions of all keys are disjoint; each key is one transport registration call
        of all its regions (``open_registrations()`` counts regions, O(regions) per resume);
      * a handle is in ``_handles`` from post until release; its state only moves
        PROC -> DONE | ERR;
      * every error leaves the engine unchanged.

    Subclasses implement the ``_t_*`` transport primitives only.
    """

    kind = "abstract"

    def __init__(self, name: str):
        if not isinstance(name, str) or not name:
            raise ValueError(f"engine name must be a non-empty str, got {name!r}")
        self.name = name
        self.incarnation = time.time_ns()
        self._version = 0
        self._regs: dict[str, Registration] = {}
        self._native_regs: dict[str, object] = {}
        self._tombstones: dict[str, Registration] = {}
        self._peers: dict[str, _Peer] = {}
        self._handles: dict[int, TransferHandle] = {}
        self._index: _RegionIndex | None = None  # of the live local regions; None: stale
        self._next_id = 1
        self._tables: dict[int, BlockTable] = {}
        self._closed = False

    # --- transport primitives ---------------------------------------------------------
    @abc.abstractmethod
    def _t_register(self, reg: Registration) -> object: ...

    @abc.abstractmethod
    def _t_deregister(self, native) -> None: ...

    @abc.abstractmethod
    def _t_blob(self) -> bytes: ...

    @abc.abstractmethod
    def _t_load_peer(self, blob: bytes) -> str:
        """Load a peer's blob; return the peer name the transport read from it."""

    @abc.abstractmethod
    def _t_unload_peer(self, name: str) -> None: ...

    @abc.abstractmethod
    def _t_post(self, local: np.ndarray, lreg: Registration, remote: np.ndarray,
                rmem: RemoteMemory, notif: bytes) -> tuple[object, str]:
        """Post one write of paired ranges; return (native handle, initial state)."""

    @abc.abstractmethod
    def _t_state(self, native) -> str: ...

    @abc.abstractmethod
    def _t_release(self, native) -> None: ...

    @abc.abstractmethod
    def _t_send_notif(self, peer: str, msg: bytes) -> None: ...

    @abc.abstractmethod
    def _t_get_notifs(self) -> dict[str, list[bytes]]: ...

    @abc.abstractmethod
    def _t_close(self) -> None: ...

    # Prepared block lists (optional: an engine without them moves packed chunks only).
    def _t_prep(self, layout: BlockLayout, mem: str, device_id: int, peer: str | None) -> object:
        """Prepare every block of ``layout`` once (index ``plane * count + i``); ``peer``
        None: local.  Called only when :meth:`direct_refusal` found nothing."""
        raise TransferError(f"{type(self).__name__} has no prepared descriptor lists")

    def _t_prep_refusal(self, layout: BlockLayout) -> str | None:
        """The transport's own reason not to prepare ``layout`` (None: it can)."""
        return f"{type(self).__name__} has no prepared descriptor lists"

    def _t_unprep(self, native) -> None:
        pass

    def _t_post_blocks(self, op: str, local: object, lidx: np.ndarray, remote: object,
                       ridx: np.ndarray, peer: str, notif: bytes) -> tuple[object, str]:
        raise TransferError(f"{type(self).__name__} has no prepared descriptor lists")

    # --- registrations ----------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise EngineClosedError(f"{what}: transfer engine {self.name!r} is closed")

    def register(self, key: str, regions, epoch: int, device="cpu",
                 layout: BlockLayout | None = None) -> Registration:
        """Register ``regions`` (``(addr, nbytes)`` pairs, disjoint from every live
        registration) under ``key`` at ``epoch``, in one transport call.

        ``layout``: blocks inside the regions that peers may address by index (a pool's
        pages, :func:`pool_layout`); carried in the metadata.

        Raises ValueError: key live already, epoch not newer than the key's last one,
        malformed or overlapping regions, a layout plane outside the regions.
        """
        self._check_open("register")
        if not isinstance(key, str) or not key:
            raise ValueError(f"register: key must be a non-empty str, got {key!r}")
        if key in self._regs:
            raise ValueError(f"register: {key!r} is registered already (epoch "
                             f"{self._regs[key].epoch}); deregister it first")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"register: epoch must be an int >= 0, got {epoch!r}")
        old = self._tombstones.get(key)
        if old is not None and epoch <= old.epoch:
            raise ValueError(f"register: {key!r} was registered at epoch {old.epoch}; a new "
                             f"registration needs a newer epoch, got {epoch} (epochs of a key "
                             "only grow, or stale peer metadata would become valid again)")
        arr = as_ranges(regions, f"register {key!r}")
        mem, dev = mem_of(device)
        allr = np.concatenate([arr] + [np.asarray(r.regions, dtype=np.int64).reshape(-1, 2)
                                       for r in self._regs.values()])
        order = np.argsort(allr[:, 0], kind="stable")
        s, e = allr[order, 0], allr[order, 0] + allr[order, 1]
        clash = np.flatnonzero(e[:-1] > s[1:])
        if clash.size:
            i = int(clash[0])
            raise ValueError(f"register {key!r}: regions overlap: [{int(s[i]):#x}, {int(e[i]):#x}) "
                             f"and [{int(s[i + 1]):#x}, {int(e[i + 1]):#x})")
        reg = Registration(key, epoch, tuple((int(a), int(n)) for a, n in arr), mem, dev, layout)
        if layout is not None:
            idx = _RegionIndex(reg.regions)
            for a, n in layout.spans():
                if idx.find(a, n) < 0:
                    raise ValueError(f"register {key!r}: layout plane [{a:#x}, +{n}) is not "
                                     "inside one of its regions")
        self._native_regs[key] = self._t_register(reg)
        self._regs[key] = reg
        self._tombstones.pop(key, None)
        self._version += 1
        self._index = None
        return reg

    def register_pool(self, pool, key: str = "kv") -> Registration:
        """``register(key, pool.regions(), pool.epoch, pool.device, pool_layout(pool))``;
        refuses a released pool."""
        if getattr(pool, "released", False):
            raise ReleasedPoolError(f"register_pool {key!r}: the pool is released (epoch "
                                    f"{pool.epoch}); resume it first")
        return self.register(key, pool.regions(), pool.epoch, pool.device, pool_layout(pool))

    def deregister(self, key: str) -> None:
        """Deregister ``key``'s regions (one transport call) and leave a tombstone at its
        epoch in the metadata.  Refused with :class:`TransferInFlightError` while a write
        this engine posted from them is in flight (an engine never writes into its own
        registrations: add_peer refuses its own metadata).  Writes *peers* posted into them
        are invisible here: the pause protocol drains those (module docstring).
        Deregistration does not revoke peers' access."""
        self._check_open("deregister")
        if key not in self._regs:
            state = f"closed at epoch {self._tombstones[key].epoch}" if key in self._tombstones \
                else "unknown"
            raise ValueError(f"deregister: {key!r} is not registered ({state}; live: "
                             f"{sorted(self._regs)})")
        busy = [h for h in self._handles.values()
                if key in h.local_keys and self._refresh(h) == "PROC"]
        if busy:
            ids = [h.id for h in busy][:8]
            raise TransferInFlightError(f"deregister {key!r}", len(busy),
                                        f" (reading from it, handle ids {ids})")
        for t in [t for t in self._tables.values() if t.remote is None and t.key == key]:
            self._drop_table(t)
        self._t_deregister(self._native_regs[key])
        del self._native_regs[key]
        self._tombstones[key] = self._regs.pop(key)
        self._version += 1
        self._index = None

    def registrations(self) -> dict[str, Registration]:
        return dict(self._regs)

    def open_registrations(self) -> int:
        """Regions registered with the transport now (one per region, never per layer)."""
        return sum(len(r.regions) for r in self._regs.values())

    # --- metadata and peers -----------------------------------------------------------
    def local_metadata(self) -> bytes:
        """What a peer needs to write into this engine's registrations (and to send it
        notifications): see the module docstring.  Tombstones included."""
        self._check_open("local_metadata")
        regs = {}
        for k, r in self._tombstones.items():
            regs[k] = dict(epoch=r.epoch, live=False, mem=r.mem, dev=r.device_id, regions=[])
        for k, r in self._regs.items():
            regs[k] = dict(epoch=r.epoch, live=True, mem=r.mem, dev=r.device_id,
                           regions=[list(x) for x in r.regions])
            if r.layout is not None:
                regs[k]["layout"] = r.layout.as_json()
        header = dict(engine=self.kind, agent=self.name, incarnation=self.incarnation,
                      version=self._version, regs=regs)
        return encode_metadata(header, self._t_blob())

    def add_peer(self, metadata) -> dict[str, RemoteMemory]:
        """Learn a peer's metadata snapshot; return its registrations by key.

        Newer snapshot of a known peer: replaces what this engine knows (the transport
        reloads the peer; a new incarnation drops the old one's connection first).  Same
        snapshot: no-op.  Older snapshot: :class:`StaleEpochError`.  Bad bytes:
        :class:`MetadataError`, and the transport never sees them.
        """
        self._check_open("add_peer")
        header, blob = decode_metadata(metadata)
        if header["engine"] != self.kind:
            raise MetadataError(f"add_peer: metadata of a {header['engine']!r} engine, this is "
                                f"a {self.kind!r} engine")
        name = header["agent"]
        if name == self.name:
            raise MetadataError(f"add_peer: metadata is this engine's own ({name!r})")
        inc, ver = header["incarnation"], header["version"]
        mems = {k: RemoteMemory(name, k, r["epoch"], tuple((a, n) for a, n in r["regions"]),
                                r["mem"], r["dev"], inc, r["live"],
                                _layout(r["layout"], k, r["regions"]) if "layout" in r else None)
                for k, r in header["regs"].items()}
        old = self._peers.get(name)
        if old is not None:
            if (inc, ver) < (old.incarnation, old.version):
                raise StaleEpochError(name, None, f"incarnation {inc} version {ver}",
                                      f"incarnation {old.incarnation} version {old.version}",
                                      "add_peer")
            if (inc, ver) == (old.incarnation, old.version):
                return dict(old.mems)
            if inc == old.incarnation:
                for k, m in old.mems.items():
                    if k not in mems or mems[k].order < m.order:
                        raise MetadataError(f"add_peer: {name!r} version {ver} lost or rewound "
                                            f"registration {k!r} ({m.describe()} before)")
        if old is not None and inc != old.incarnation:
            # A restarted peer: NIXL refuses to load it otherwise.  Should the transport
            # then refuse the new blob, the peer stays forgotten (its old process is gone).
            self._t_unload_peer(name)
            del self._peers[name]
        loaded = self._t_load_peer(blob)
        if loaded != name:
            if old is None:
                self._t_unload_peer(loaded)
            raise MetadataError(f"add_peer: header names agent {name!r}, transport metadata "
                                f"names {loaded!r}")
        index = {k: _RegionIndex(m.regions) for k, m in mems.items() if m.live}
        self._peers[name] = _Peer(name, inc, ver, mems, index)
        return dict(mems)

    def peers(self) -> list[str]:
        return sorted(self._peers)

    def remote(self, peer: str, key: str) -> RemoteMemory:
        """The newest RemoteMemory this engine knows for ``(peer, key)``."""
        p = self._peers.get(peer)
        if p is None or key not in p.mems:
            raise KeyError(f"remote: no registration {key!r} known for peer {peer!r} "
                           f"(peers: {sorted(self._peers)})")
        return p.mems[key]

    def check_fresh(self, remote: RemoteMemory, what: str = "post_write") -> None:
        """Raise :class:`StaleEpochError` unless ``remote`` is the newest, live state this
        engine knows for its (peer, key); ValueError when the peer is unknown here or
        ``remote`` is not what this engine loaded (e.g. learned by another engine)."""
        if not isinstance(remote, RemoteMemory):
            raise TypeError(f"{what}: remote must be a RemoteMemory, got {type(remote).__name__}")
        p = self._peers.get(remote.peer)
        if p is None:
            raise ValueError(f"{what}: peer {remote.peer!r} is not known to engine "
                             f"{self.name!r}; add_peer(its metadata) first")
        newest = p.mems.get(remote.key)
        if newest is None or p.incarnation != remote.incarnation:
            raise StaleEpochError(remote.peer, remote.key, remote.describe(),
                                  newest.describe() if newest else
                                  f"incarnation {p.incarnation} without {remote.key!r}", what)
        if remote.order < newest.order or not newest.live:
            raise StaleEpochError(remote.peer, remote.key, remote.describe(), newest.describe(),
                                  what)
        if remote != newest:
            raise ValueError(f"{what}: {remote!r} is not the metadata engine {self.name!r} "
                             f"loaded for {remote.peer!r} ({newest.describe()}); add_peer the "
                             "bytes it came from")

    # --- writes -----------------------------------------------------------------------
    def _local_index(self) -> _RegionIndex:
        if self._index is None:
            regs = [(a, n, k) for k, r in self._regs.items() for a, n in r.regions]
            self._index = _RegionIndex([(a, n) for a, n, _ in regs], [k for _, _, k in regs])
        return self._index

    def post_write(self, local_ranges, remote: RemoteMemory, remote_ranges,
                   notif: bytes = b"") -> TransferHandle:
        """Write the bytes of ``local_ranges`` (in this engine's live registrations) to
        ``remote_ranges`` (in ``remote.regions``), one byte stream, and deliver ``notif``
        to the peer once they landed (sent when a poll of this engine sees the write done).

        Raises (before posting, nothing changed): StaleEpochError (the epoch rule),
        ValueError (ranges outside registrations, an end past 2**63 - 1, unequal totals,
        mixed memory kinds), TransferError (the transport refused the request).

        Cost: the regions of both sides are indexed once (at register / add_peer), sorted.
        A write of up to 8 ranges a side given as Python ints is checked by bisect in
        Python: 5 us a call for one range each with a no-op transport on this 2-core CPU
        (100-125 us before, when the index was rebuilt and numpy ran on every call).
        Longer lists go through numpy: 0.56-0.59 ms for 4096 ranges a side as ``[n, 2]``
        int64 arrays (1.23-1.29 ms before); a Python list of them costs about 2 ms more to
        convert.
        """
        self._check_open("post_write")
        self.check_fresh(remote)
        if not isinstance(notif, (bytes, bytearray)):
            raise ValueError(f"post_write: notif must be bytes, got {type(notif).__name__}")
        rindex = self._peers[remote.peer].index[remote.key]
        lindex = self._local_index()
        quick = self._few(local_ranges, remote_ranges, lindex, rindex)
        if quick is not None:
            lo, ro, local_keys = quick
        else:
            lo, ro, local_keys = self._many(local_ranges, remote, remote_ranges, lindex, rindex)
        native, state = self._t_post(lo, self._regs[local_keys[0]], ro, remote, bytes(notif))
        h = TransferHandle(self._next_id, remote.peer, remote.key, local_keys, int(lo[:, 1].sum()),
                           bytes(notif), state, None if state != "ERR" else "failed at post",
                           native=native)
        self._next_id += 1
        self._handles[h.id] = h
        return h

    @staticmethod
    def _few(local_ranges, remote_ranges, lindex: _RegionIndex, rindex: _RegionIndex):
        """The common write (a few ranges a side, each inside one region, equal totals, one
        local key): ``(lo, ro, (key,))``; None for anything else, which :meth:`_many`
        then checks in full (and words the error)."""
        loc, rem = _few_pairs(local_ranges), _few_pairs(remote_ranges)
        if loc is None or rem is None:
            return None
        keys = set()
        for a, n in loc:
            i = lindex.find(a, n)
            if i < 0:
                return None
            keys.add(lindex.keys[i])
        if len(keys) != 1:
            return None
        for a, n in rem:
            if rindex.find(a, n) < 0:
                return None
        if sum(n for _, n in loc) != sum(n for _, n in rem):
            return None
        lo, ro = np.array(loc, dtype=np.int64), np.array(rem, dtype=np.int64)
        if len(loc) > 1 or len(rem) > 1:
            lo, ro = pair_ranges(lo, ro, "post_write")
        return lo, ro, (keys.pop(),)

    def _many(self, local_ranges, remote, remote_ranges, lindex: _RegionIndex,
              rindex: _RegionIndex):
        loc = as_ranges(local_ranges, "post_write local")
        rem = as_ranges(remote_ranges, "post_write remote")
        li = _locate(loc, lindex.starts, lindex.ends, "post_write local", f"engine {self.name!r}")
        local_keys = tuple(sorted({lindex.keys[i] for i in np.unique(li)}))
        kinds = {(self._regs[k].mem, self._regs[k].device_id) for k in local_keys}
        if len(kinds) != 1:
            raise ValueError(f"post_write: local ranges span memory kinds {sorted(kinds)} "
                             f"(keys {local_keys}); one write reads one kind")
        _locate(rem, rindex.starts, rindex.ends, "post_write remote",
                f"peer {remote.peer!r} key {remote.key!r} ({remote.describe()})")
        lo, ro = pair_ranges(loc, rem, "post_write")
        return lo, ro, local_keys

    # --- prepared block tables ---------------------------------------------------------------
    def direct_refusal(self, layout: BlockLayout | None) -> str | None:
        """Why this engine cannot prepare a block table of ``layout`` (so neither direct
        writes nor pull reads of its blocks are possible, and only packed transfers can
        move them), or None when it can.  The PD layer asks this before choosing direct
        or pull: ``engine.direct_refusal(engine.registrations()["kv"].layout)`` for its
        own pool, ``engine.direct_refusal(engine.remote(peer, "kv").layout)`` for the
        peer's.  Reasons: no layout (a page of a layer is not one contiguous range), more
        than :data:`MAX_TABLE_BLOCKS` blocks (the transport's indices are int32), or a
        limit of the transport (:meth:`_t_prep_refusal`)."""
        if layout is None:
            return ("no block layout: a page of a layer is not one contiguous range, so "
                    "pages cannot be addressed as blocks")
        if layout.blocks > MAX_TABLE_BLOCKS:
            return (f"{layout.blocks} blocks ({len(layout.planes)} planes x {layout.count} "
                    f"pages) is more than the {MAX_TABLE_BLOCKS} a prepared table can index "
                    "(NIXL reads block indices as int32)")
        return self._t_prep_refusal(layout)

    def _prep_table(self, what: str, layout: BlockLayout | None, mem: str, device_id: int,
                    peer: str | None):
        why = self.direct_refusal(layout)
        if why is not None:
            raise TransferError(f"{what}: cannot prepare a block table: {why}; only packed "
                                "transfers can move these pages")
        return self._t_prep(layout, mem, device_id, peer)

    def prep_local(self, key: str) -> BlockTable:
        """Prepare every block of the live registration ``key``'s layout, once (NIXL
        ``prep_xfer_dlist`` of one strided descriptor per plane: O(planes)).  Released by
        ``deregister(key)``.

        Raises:
            ValueError: ``key`` is not live or has no layout.
            TransferError: the table cannot be prepared (:meth:`direct_refusal` says why,
                before the transport is asked), or the transport refused it.
        """
        self._check_open("prep_local")
        reg = self._regs.get(key)
        if reg is None or reg.layout is None:
            raise ValueError(f"prep_local: {key!r} is not a live registration with a layout "
                             f"(live: {sorted(self._regs)})")
        native = self._prep_table(f"prep_local {key!r}", reg.layout, reg.mem, reg.device_id,
                                  None)
        return self._new_table(key, reg.epoch, reg.layout, None, native)

    def prep_remote(self, remote: RemoteMemory) -> BlockTable:
        """Prepare every block of a peer registration's layout, once per (peer, key,
        epoch); refused as stale like a write (:meth:`check_fresh`), and as
        :meth:`prep_local` for a layout no table can hold."""
        self._check_open("prep_remote")
        self.check_fresh(remote, "prep_remote")
        if remote.layout is None:
            raise ValueError(f"prep_remote: {remote.peer!r} key {remote.key!r} carries no layout")
        native = self._prep_table(f"prep_remote {remote.peer!r} {remote.key!r}", remote.layout,
                                  remote.mem, remote.device_id, remote.peer)
        return self._new_table(remote.key, remote.epoch, remote.layout, remote, native)

    def _new_table(self, key, epoch, layout, remote, native) -> BlockTable:
        t = BlockTable(self._next_id, key, epoch, layout, remote,
                       np.array([n for _, _, n in layout.planes], dtype=np.int64), native)
        self._next_id += 1
        self._tables[t.id] = t
        return t

    def _drop_table(self, t: BlockTable) -> None:
        if not t.released:
            self._t_unprep(t.native)
            t.released, t.native = True, None
            self._tables.pop(t.id, None)

    def release_table(self, t: BlockTable) -> None:
        """Free a prepared table (refused while a write posted from it is in flight)."""
        busy = [h for h in self._handles.values()
                if t.id in h.tables and self._refresh(h) == "PROC"]
        if busy:
            raise TransferInFlightError("release_table", len(busy))
        self._drop_table(t)

    def post_blocks(self, local: BlockTable, local_idx, remote: BlockTable, remote_idx,
                    notif: bytes = b"", op: str = "WRITE") -> TransferHandle:
        """Move blocks ``local_idx`` of ``local`` to (``"WRITE"``) or from (``"READ"``)
        blocks ``remote_idx`` of ``remote`` (int64 arrays of equal length, i-th to i-th);
        ``notif`` delivered to the peer once done.  Adjacent blocks that are adjacent on
        both sides travel as one descriptor (NIXL merges them in prepared lists).

        Checks, before posting (nothing changed on error): the remote table's metadata is
        the newest known (StaleEpochError, the epoch rule), the local table's registration
        is live at its epoch, indices within the tables and sizes equal pairwise
        (ValueError).  Cost: a few numpy reductions over the indices, no range search
        (the blocks were checked inside their registrations when prepared): 10.6 us a call
        for 512 blocks (32 pages x 16 planes) with the transport stubbed, on the 2-core CPU
        machine at load 3.5.
        """
        self._check_open("post_blocks")
        if op not in ("WRITE", "READ"):
            raise ValueError(f"post_blocks: op must be 'WRITE' or 'READ', got {op!r}")
        for t, side in ((local, "local"), (remote, "remote")):
            if not isinstance(t, BlockTable) or self._tables.get(t.id) is not t:
                raise ValueError(f"post_blocks: {side} table {t!r} is not an open table of "
                                 f"engine {self.name!r}")
        if local.remote is not None or remote.remote is None:
            raise ValueError("post_blocks: needs a local table (prep_local) and a remote one "
                             "(prep_remote)")
        self.check_fresh(remote.remote, "post_blocks")
        reg = self._regs.get(local.key)
        if reg is None or reg.epoch != local.epoch:
            raise StaleEpochError(self.name, local.key, f"epoch {local.epoch}",
                                  "closed" if reg is None else f"epoch {reg.epoch}",
                                  "post_blocks (local table)")
        if not isinstance(notif, (bytes, bytearray)):
            raise ValueError(f"post_blocks: notif must be bytes, got {type(notif).__name__}")
        li = np.ascontiguousarray(local_idx, dtype=np.int64).reshape(-1)
        ri = np.ascontiguousarray(remote_idx, dtype=np.int64).reshape(-1)
        if li.size == 0 or li.size != ri.size:
            raise ValueError(f"post_blocks: {li.size} local and {ri.size} remote indices; "
                             "they must be equal in number and > 0")
        ln, rn = local.nbytes.size * local.layout.count, remote.nbytes.size * remote.layout.count
        if li.min() < 0 or li.max() >= ln or ri.min() < 0 or ri.max() >= rn:
            raise ValueError(f"post_blocks: an index outside the tables ({ln} local blocks, "
                             f"{rn} remote)")
        lb = local.nbytes[li // local.layout.count]
        if not np.array_equal(lb, remote.nbytes[ri // remote.layout.count]):
            raise ValueError("post_blocks: paired blocks differ in size")
        native, state = self._t_post_blocks(op, local.native, li, remote.native, ri,
                                            remote.remote.peer, bytes(notif))
        h = TransferHandle(self._next_id, remote.remote.peer, remote.key, (local.key,),
                           int(lb.sum()), bytes(notif), state,
                           None if state != "ERR" else "failed at post", native=native)
        h.tables = (local.id, remote.id)
        h.op = op
        self._next_id += 1
        self._handles[h.id] = h
        return h

    def _own(self, h: TransferHandle, what: str) -> TransferHandle:
        if not isinstance(h, TransferHandle) or self._handles.get(h.id) is not h:
            raise ValueError(f"{what}: {h!r} is not an open handle of engine {self.name!r}"
                             + (" (released)" if isinstance(h, TransferHandle) and h.released
                                else ""))
        return h

    def _refresh(self, h: TransferHandle) -> str:
        if h.state == "PROC":
            try:
                st = self._t_state(h.native)
            except Exception as e:  # the transport reports some failures by raising
                st, h.error = "ERR", f"{type(e).__name__}: {e}"
            if st not in STATES:
                st, h.error = "ERR", f"unknown transport state {st!r}"
            if st == "ERR" and h.error is None:
                h.error = "transport reported ERR"
            h.state = st
        return h.state

    def poll(self, h: TransferHandle) -> str:
        """``"PROC"`` | ``"DONE"`` | ``"ERR"`` (ERR also when the transport raised; see
        ``h.error``).  DONE: the bytes landed and the notification was sent.

        The initiator must keep polling its writes (``poll``, ``in_flight()`` or
        ``drain``): with NIXL a write's notification leaves only when a poll sees the
        write complete, so an unpolled write is never announced to its target."""
        self._check_open("poll")
        return self._refresh(self._own(h, "poll"))

    def release(self, h: TransferHandle, *, abort: bool = False) -> None:
        """Free a handle.  Refused while it is in flight unless ``abort``: then the
        transport cancels it, its state becomes ERR, its notification is never delivered,
        and whether its bytes landed is unknown (treat the target as written)."""
        self._check_open("release")
        self._own(h, "release")
        if self._refresh(h) == "PROC" and not abort:
            raise TransferInFlightError("release", 1, f" (handle {h.id} to {h.peer!r}); "
                                        "or release(h, abort=True) to cancel it")
        was = h.state
        try:
            self._t_release(h.native)
        except Exception as e:
            raise TransferError(f"release: the transport could not free handle {h.id} "
                                f"({was}): {type(e).__name__}: {e}") from None
        if was == "PROC":
            h.state, h.error = "ERR", "aborted by release(abort=True)"
        h.released, h.native = True, None
        del self._handles[h.id]

    def in_flight(self, peer: str | None = None) -> list[TransferHandle]:
        """Poll every open PROC handle (to ``peer`` when given) once; return those still
        PROC.  One call per step of an event loop keeps notifications flowing."""
        return [h for h in self._handles.values()
                if (peer is None or h.peer == peer) and self._refresh(h) == "PROC"]

    def drain(self, timeout: float | None = None, peer: str | None = None) -> list[TransferHandle]:
        """Poll every open handle (to ``peer``) until none is PROC; return those that were
        in flight (now DONE or ERR; not released).  TransferInFlightError after
        ``timeout`` seconds (None: wait forever), nothing released.  When the transport
        has no progress thread, the targets' owners must be progressing meanwhile (they
        are, in their own processes; two engines in one process: drive the other one)."""
        self._check_open("drain")
        todo = self.in_flight(peer)
        drained = list(todo)
        deadline = None if timeout is None else time.monotonic() + timeout
        nap = 20e-6
        while todo:
            if deadline is not None and time.monotonic() >= deadline:
                raise TransferInFlightError(f"drain({timeout})", len(todo),
                                            "" if peer is None else f" to {peer!r}")
            time.sleep(nap)   # leave the CPU to the transport's progress thread
            nap = min(nap * 2, 1e-3)
            todo = [h for h in todo if self._refresh(h) == "PROC"]
        return drained

    def open_handles(self) -> int:
        return len(self._handles)

    # --- notifications ----------------------------------------------------------------
    def send_notif(self, peer: str, msg: bytes) -> None:
        """Send ``msg`` to ``peer`` (which must have been added: the transport needs its
        metadata to reach it)."""
        self._check_open("send_notif")
        if peer not in self._peers:
            raise ValueError(f"send_notif: peer {peer!r} is not known to engine {self.name!r}; "
                             "add_peer(its metadata) first")
        if not isinstance(msg, (bytes, bytearray)):
            raise ValueError(f"send_notif: msg must be bytes, got {type(msg).__name__}")
        try:
            self._t_send_notif(peer, bytes(msg))
        except Exception as e:
            raise TransferError(f"send_notif to {peer!r}: {type(e).__name__}: {e}") from None

    def get_notifs(self) -> dict[str, list[bytes]]:
        """Notifications that arrived since the last call, by sender agent name, in
        arrival order per sender.  Each is returned once."""
        self._check_open("get_notifs")
        return {str(k): list(v) for k, v in self._t_get_notifs().items() if v}

    # --- lifetime ---------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float | None = 10.0) -> None:
        """Drain (TransferInFlightError after ``timeout``, nothing changed), release every
        handle, deregister every key, forget every peer, shut the transport down."""
        if self._closed:
            return
        self.drain(timeout)
        for h in list(self._handles.values()):
            self.release(h)
        for t in list(self._tables.values()):
            self._drop_table(t)
        for key in list(self._regs):
            self.deregister(key)
        for name in list(self._peers):
            self._t_unload_peer(name)
        self._peers.clear()
        self._t_close()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, regs={sorted(self._regs)}, "
                f"peers={sorted(self._peers)}, open_handles={len(self._handles)}, "
                f"closed={self._closed})")
