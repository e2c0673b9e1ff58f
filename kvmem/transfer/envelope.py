"""The metadata envelope of kvmem.transfer: the bytes ``local_metadata()`` publishes and
``add_peer`` reads, encoded and checked here (magic, lengths, digest, the JSON header and
every registration and layout in it) before the transport sees them."""

from __future__ import annotations

import hashlib
import json
import struct

from kvmem.transfer.errors import MetadataError
from kvmem.transfer.layout import BlockLayout
from kvmem.transfer.ranges import INT64_MAX, RegionIndex, check_regions

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
        raise MetadataError(
            f"add_peer: metadata field {what} must be an int in [{lo}, 2**63 - 1], got {x!r}"
        )
    return x


def decode_metadata(data) -> tuple[dict, bytes]:
    """Check and split an envelope: ``(header, blob)``.  Raises :class:`MetadataError`."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MetadataError(f"add_peer: metadata must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _HEAD.size:
        raise MetadataError(
            f"add_peer: metadata is {len(data)} bytes, shorter than the "
            f"{_HEAD.size}-byte kvmem envelope header"
        )
    magic, hlen, blen, digest = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise MetadataError(
            f"add_peer: not kvmem transfer metadata (magic {magic!r}, "
            f"expected {MAGIC!r}); pass engine.local_metadata() bytes"
        )
    if hlen > _MAX_HEADER or _HEAD.size + hlen + blen != len(data):
        raise MetadataError(
            f"add_peer: metadata length mismatch: envelope says "
            f"{_HEAD.size}+{hlen}+{blen} bytes, got {len(data)} (truncated?)"
        )
    hb = data[_HEAD.size : _HEAD.size + hlen]
    blob = data[_HEAD.size + hlen :]
    if _digest(hb, blob) != digest:
        raise MetadataError(
            "add_peer: metadata digest mismatch (damaged bytes); nothing was loaded"
        )
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
            raise MetadataError(
                f"add_peer: registration {key!r}: bad mem/live "
                f"({r.get('mem')!r}, {r.get('live')!r})"
            )
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
        parse_layout(lay, key, regions)
    return header, blob


def parse_layout(obj, key: str, regions) -> BlockLayout:
    """A registration's ``layout`` from metadata, checked: every plane's blocks inside one
    of its regions.  MetadataError otherwise."""
    planes = obj.get("planes") if isinstance(obj, dict) else None
    count = obj.get("count") if isinstance(obj, dict) else None
    if not isinstance(planes, list) or not planes or set(obj) != {"planes", "count"}:
        raise MetadataError(f"add_peer: registration {key!r}: bad layout {obj!r:.200}")
    count = _int(count, f"regs[{key!r}].layout.count", 1)
    out = []
    for pl in planes:
        if not (isinstance(pl, list) and len(pl) == 3):
            raise MetadataError(f"add_peer: registration {key!r}: bad layout plane {pl!r}")
        b, st, n = (
            _int(pl[0], "layout base", 1),
            _int(pl[1], "layout stride", 1),
            _int(pl[2], "layout nbytes", 1),
        )
        out.append((b, st, n))
    lay = BlockLayout(tuple(out), count)
    idx = RegionIndex([tuple(r) for r in regions])
    for a, n in lay.spans():
        if a > INT64_MAX - n or idx.find(a, n) < 0:
            raise MetadataError(
                f"add_peer: registration {key!r}: layout plane [{a:#x}, +{n}) "
                "is not inside one of its regions"
            )
    return lay
