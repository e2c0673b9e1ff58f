"""A side's peers: their names, one control message to one of them (:func:`tell`),
the byte space of a peer's registration (:class:`RegionMap`) and the prepared block list
of its pool (:class:`PeerTable`).  The messages' format, the parser and the inbox:
:mod:`kvmem.disagg.protocol`."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

from kvmem.transfer.errors import TransferError, TransferInFlightError

if TYPE_CHECKING:
    from kvmem.disagg.counters import Metrics


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
            raise ValueError(
                f"RegionMap: bytes [{off}, +{nbytes}) outside the "
                f"{self.size} bytes of {len(self.regions)} region(s)"
            )
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
    raise ValueError(
        f"regions {shown}{' ...' if len(m.regions) > 4 else ''} do not tile the "
        f"{tensor.numel()}-byte buffer at {tensor.data_ptr():#x} in order"
    )


# Their format, the parser every received message goes through, and the inbox that counts
# refusals: kvmem.disagg.protocol.


def sole_peer(kind: str, peers, hint: str = "") -> str:
    """The one peer of ``kind`` ("prefill" or "decode") a side has; ValueError naming
    them when it has several (``hint`` ends the message)."""
    if len(peers) != 1:
        raise ValueError(
            f"{kind}_peer: this side has {len(peers)} {kind} peers {list(peers)}{hint}"
        )
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
        raise ValueError(
            f"{what}_peer or {what}_peers: give exactly one, got "
            f"{what}_peer={one!r}, {what}_peers={many!r}"
        )
    names = (one,) if one is not None else tuple(many) if not isinstance(many, str) else None
    if not names or any(not isinstance(n, str) or not n for n in names):
        raise ValueError(
            f"{what}_peers must be non-empty names (a sequence of str), got "
            f"{one if one is not None else many!r}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"{what}_peers names a peer twice: {list(names)}")
    return names


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
