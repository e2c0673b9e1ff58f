"""TransferEngine: registrations, peers and one-sided writes between the registered memory
of two agents, under epochs.

This module owns the rules every engine obeys: the epoch rule and its tombstones, the
snapshot order of a peer's metadata, the checks made before anything is posted, and the
engine's state.  An engine subclass (:mod:`kvmem.transfer.nixl`) implements only the
``_t_*`` transport primitives (:mod:`kvmem.transfer.transport`).  The rules, what the
transport does not do, and the pause/resume ordering the PD lifecycle
(:mod:`kvmem.disagg`) follows are written out in docs/transfer.md.

An engine is driven by one thread (NIXL's agent is created without locking).

One class over one shared state (registrations, peers, epochs, tombstones, the in-flight
table, the prepared tables), under the invariants of the class docstring; only its
``__init__`` makes that state.  Two of its jobs are bases of their own, each declaring
what of the state it uses: the in-flight table (:mod:`kvmem.transfer.inflight`) and the
prepared block tables (:mod:`kvmem.transfer.tables`).  What needs none of the state lives
beside it (errors, ranges, layouts, records, the metadata envelope).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from kvmem.errors import ReleasedPoolError
from kvmem.transfer.envelope import decode_metadata, encode_metadata, parse_layout
from kvmem.transfer.errors import (
    EngineClosedError,
    MetadataError,
    StaleEpochError,
    TransferError,
    TransferInFlightError,
)
from kvmem.transfer.inflight import InFlight
from kvmem.transfer.layout import BlockLayout, pool_layout
from kvmem.transfer.ranges import RegionIndex, as_ranges, locate, pair_few, pair_ranges
from kvmem.transfer.records import (
    BlockTable,
    Registration,
    RemoteMemory,
    TransferHandle,
    XferState,
    mem_of,
)
from kvmem.transfer.tables import BlockTables


@dataclass
class _Peer:
    name: str
    incarnation: int
    version: int
    mems: dict  # key -> RemoteMemory
    index: dict = field(default_factory=dict)  # key -> RegionIndex of its live regions


# --- the engine ---------------------------------------------------------------------------


class TransferEngine(BlockTables, InFlight):
    """Registrations, peers and one-sided writes, with the epoch guard (docs/transfer.md).

    Invariants:
      * a key is live xor closed (tombstone) xor unknown; its epochs strictly grow;
      * live regions of all keys are disjoint; each key is one transport registration call
        of all its regions (``open_registrations()`` counts regions, O(regions) per resume);
      * a handle is in ``_handles`` from post until release; its state only moves
        PROC -> DONE | ERR;
      * every error leaves the engine unchanged.

    Subclasses implement the ``_t_*`` transport primitives only
    (:class:`~kvmem.transfer.transport.Transport`).
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
        self._index: RegionIndex | None = None  # of the live local regions; None: stale
        self._next_id = 1
        self._tables: dict[int, BlockTable] = {}
        self._closed = False

    # --- registrations ----------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise EngineClosedError(f"{what}: transfer engine {self.name!r} is closed")

    def register(
        self, key: str, regions, epoch: int, device="cpu", layout: BlockLayout | None = None
    ) -> Registration:
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
            raise ValueError(
                f"register: {key!r} is registered already (epoch "
                f"{self._regs[key].epoch}); deregister it first"
            )
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"register: epoch must be an int >= 0, got {epoch!r}")
        old = self._tombstones.get(key)
        if old is not None and epoch <= old.epoch:
            raise ValueError(
                f"register: {key!r} was registered at epoch {old.epoch}; a new "
                f"registration needs a newer epoch, got {epoch} (epochs of a key "
                "only grow, or stale peer metadata would become valid again)"
            )
        arr = as_ranges(regions, f"register {key!r}")
        mem, dev = mem_of(device)
        allr = np.concatenate(
            [arr]
            + [np.asarray(r.regions, dtype=np.int64).reshape(-1, 2) for r in self._regs.values()]
        )
        order = np.argsort(allr[:, 0], kind="stable")
        s, e = allr[order, 0], allr[order, 0] + allr[order, 1]
        clash = np.flatnonzero(e[:-1] > s[1:])
        if clash.size:
            i = int(clash[0])
            raise ValueError(
                f"register {key!r}: regions overlap: [{int(s[i]):#x}, {int(e[i]):#x}) "
                f"and [{int(s[i + 1]):#x}, {int(e[i + 1]):#x})"
            )
        reg = Registration(key, epoch, tuple((int(a), int(n)) for a, n in arr), mem, dev, layout)
        if layout is not None:
            idx = RegionIndex(reg.regions)
            for a, n in layout.spans():
                if idx.find(a, n) < 0:
                    raise ValueError(
                        f"register {key!r}: layout plane [{a:#x}, +{n}) is not "
                        "inside one of its regions"
                    )
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
            raise ReleasedPoolError(
                f"register_pool {key!r}: the pool is released (epoch {pool.epoch}); resume it first"
            )
        return self.register(key, pool.regions(), pool.epoch, pool.device, pool_layout(pool))

    def deregister(self, key: str) -> None:
        """Deregister ``key``'s regions (one transport call) and leave a tombstone at its
        epoch in the metadata.  Refused with :class:`TransferInFlightError` while a write
        this engine posted from them is in flight (an engine never writes into its own
        registrations: add_peer refuses its own metadata).  Writes *peers* posted into them
        are invisible here: the pause protocol drains those (docs/transfer.md).
        Deregistration does not revoke peers' access."""
        self._check_open("deregister")
        if key not in self._regs:
            state = (
                f"closed at epoch {self._tombstones[key].epoch}"
                if key in self._tombstones
                else "unknown"
            )
            raise ValueError(
                f"deregister: {key!r} is not registered ({state}; live: {sorted(self._regs)})"
            )
        busy = [
            h
            for h in self._handles.values()
            if key in h.local_keys and self._refresh(h) == XferState.PROC
        ]
        if busy:
            ids = [h.id for h in busy][:8]
            raise TransferInFlightError(
                f"deregister {key!r}", len(busy), f" (reading from it, handle ids {ids})"
            )
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
        notifications), in the envelope of :mod:`kvmem.transfer.envelope`.  Tombstones included."""
        self._check_open("local_metadata")
        regs = {}
        for k, r in self._tombstones.items():
            regs[k] = dict(epoch=r.epoch, live=False, mem=r.mem, dev=r.device_id, regions=[])
        for k, r in self._regs.items():
            regs[k] = dict(
                epoch=r.epoch,
                live=True,
                mem=r.mem,
                dev=r.device_id,
                regions=[list(x) for x in r.regions],
            )
            if r.layout is not None:
                regs[k]["layout"] = r.layout.as_json()
        header = dict(
            engine=self.kind,
            agent=self.name,
            incarnation=self.incarnation,
            version=self._version,
            regs=regs,
        )
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
            raise MetadataError(
                f"add_peer: metadata of a {header['engine']!r} engine, this is "
                f"a {self.kind!r} engine"
            )
        name = header["agent"]
        if name == self.name:
            raise MetadataError(f"add_peer: metadata is this engine's own ({name!r})")
        inc, ver = header["incarnation"], header["version"]
        mems = {
            k: RemoteMemory(
                name,
                k,
                r["epoch"],
                tuple((a, n) for a, n in r["regions"]),
                r["mem"],
                r["dev"],
                inc,
                r["live"],
                parse_layout(r["layout"], k, r["regions"]) if "layout" in r else None,
            )
            for k, r in header["regs"].items()
        }
        old = self._peers.get(name)
        if old is not None:
            if (inc, ver) < (old.incarnation, old.version):
                raise StaleEpochError(
                    name,
                    None,
                    f"incarnation {inc} version {ver}",
                    f"incarnation {old.incarnation} version {old.version}",
                    "add_peer",
                )
            if (inc, ver) == (old.incarnation, old.version):
                return dict(old.mems)
            if inc == old.incarnation:
                for k, m in old.mems.items():
                    if k not in mems or mems[k].order < m.order:
                        raise MetadataError(
                            f"add_peer: {name!r} version {ver} lost or rewound "
                            f"registration {k!r} ({m.describe()} before)"
                        )
        if old is not None and inc != old.incarnation:
            # A restarted peer: NIXL refuses to load it otherwise.  Should the transport
            # then refuse the new blob, the peer stays forgotten (its old process is gone).
            self._t_unload_peer(name)
            del self._peers[name]
        loaded = self._t_load_peer(blob)
        if loaded != name:
            if old is None:
                self._t_unload_peer(loaded)
            raise MetadataError(
                f"add_peer: header names agent {name!r}, transport metadata names {loaded!r}"
            )
        index = {k: RegionIndex(m.regions) for k, m in mems.items() if m.live}
        self._peers[name] = _Peer(name, inc, ver, mems, index)
        return dict(mems)

    def peers(self) -> list[str]:
        return sorted(self._peers)

    def remote(self, peer: str, key: str) -> RemoteMemory:
        """The newest RemoteMemory this engine knows for ``(peer, key)``."""
        p = self._peers.get(peer)
        if p is None or key not in p.mems:
            raise KeyError(
                f"remote: no registration {key!r} known for peer {peer!r} "
                f"(peers: {sorted(self._peers)})"
            )
        return p.mems[key]

    def check_fresh(self, remote: RemoteMemory, what: str = "post_write") -> None:
        """Raise :class:`StaleEpochError` unless ``remote`` is the newest, live state this
        engine knows for its (peer, key); ValueError when the peer is unknown here or
        ``remote`` is not what this engine loaded (e.g. learned by another engine)."""
        if not isinstance(remote, RemoteMemory):
            raise TypeError(f"{what}: remote must be a RemoteMemory, got {type(remote).__name__}")
        p = self._peers.get(remote.peer)
        if p is None:
            raise ValueError(
                f"{what}: peer {remote.peer!r} is not known to engine "
                f"{self.name!r}; add_peer(its metadata) first"
            )
        newest = p.mems.get(remote.key)
        if newest is None or p.incarnation != remote.incarnation:
            raise StaleEpochError(
                remote.peer,
                remote.key,
                remote.describe(),
                newest.describe()
                if newest
                else f"incarnation {p.incarnation} without {remote.key!r}",
                what,
            )
        if remote.order < newest.order or not newest.live:
            raise StaleEpochError(
                remote.peer, remote.key, remote.describe(), newest.describe(), what
            )
        if remote != newest:
            raise ValueError(
                f"{what}: {remote!r} is not the metadata engine {self.name!r} "
                f"loaded for {remote.peer!r} ({newest.describe()}); add_peer the "
                "bytes it came from"
            )

    # --- writes -----------------------------------------------------------------------
    def _local_index(self) -> RegionIndex:
        if self._index is None:
            regs = [(a, n, k) for k, r in self._regs.items() for a, n in r.regions]
            self._index = RegionIndex([(a, n) for a, n, _ in regs], [k for _, _, k in regs])
        return self._index

    def post_write(
        self, local_ranges, remote: RemoteMemory, remote_ranges, notif: bytes = b""
    ) -> TransferHandle:
        """Write the bytes of ``local_ranges`` (in this engine's live registrations) to
        ``remote_ranges`` (in ``remote.regions``), one byte stream, and deliver ``notif``
        to the peer once they landed (sent when a poll of this engine sees the write done).

        Raises (before posting, nothing changed): StaleEpochError (the epoch rule),
        ValueError (ranges outside registrations, an end past 2**63 - 1, unequal totals,
        mixed memory kinds), TransferError (the transport refused the request).

        Cost: the regions of both sides are indexed once (at register / add_peer), sorted.
        A write of up to 8 ranges a side given as Python ints is checked by bisect in
        Python; longer lists, and arrays, go through numpy, O(n log n) (figures:
        docs/transfer.md, "Costs").
        """
        self._check_open("post_write")
        self.check_fresh(remote)
        if not isinstance(notif, (bytes, bytearray)):
            raise ValueError(f"post_write: notif must be bytes, got {type(notif).__name__}")
        rindex = self._peers[remote.peer].index[remote.key]
        lindex = self._local_index()
        quick = pair_few(local_ranges, remote_ranges, lindex, rindex)
        if quick is not None:
            lo, ro, local_keys = quick
        else:
            lo, ro, local_keys = self._many(local_ranges, remote, remote_ranges, lindex, rindex)
        native, state = self._t_post(lo, self._regs[local_keys[0]], ro, remote, bytes(notif))
        state = XferState(state)
        h = TransferHandle(
            self._next_id,
            remote.peer,
            remote.key,
            local_keys,
            int(lo[:, 1].sum()),
            bytes(notif),
            state,
            None if state != XferState.ERR else "failed at post",
            native=native,
        )
        self._next_id += 1
        self._handles[h.id] = h
        return h

    def _many(self, local_ranges, remote, remote_ranges, lindex: RegionIndex, rindex: RegionIndex):
        loc = as_ranges(local_ranges, "post_write local")
        rem = as_ranges(remote_ranges, "post_write remote")
        li = locate(loc, lindex.starts, lindex.ends, "post_write local", f"engine {self.name!r}")
        local_keys = tuple(sorted({lindex.keys[i] for i in np.unique(li)}))
        kinds = {(self._regs[k].mem, self._regs[k].device_id) for k in local_keys}
        if len(kinds) != 1:
            raise ValueError(
                f"post_write: local ranges span memory kinds {sorted(kinds)} "
                f"(keys {local_keys}); one write reads one kind"
            )
        locate(
            rem,
            rindex.starts,
            rindex.ends,
            "post_write remote",
            f"peer {remote.peer!r} key {remote.key!r} ({remote.describe()})",
        )
        lo, ro = pair_ranges(loc, rem, "post_write")
        return lo, ro, local_keys

    # --- notifications ----------------------------------------------------------------
    def send_notif(self, peer: str, msg: bytes) -> None:
        """Send ``msg`` to ``peer`` (which must have been added: the transport needs its
        metadata to reach it)."""
        self._check_open("send_notif")
        if peer not in self._peers:
            raise ValueError(
                f"send_notif: peer {peer!r} is not known to engine {self.name!r}; "
                "add_peer(its metadata) first"
            )
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
        return (
            f"{type(self).__name__}({self.name!r}, regs={sorted(self._regs)}, "
            f"peers={sorted(self._peers)}, open_handles={len(self._handles)}, "
            f"closed={self._closed})"
        )
