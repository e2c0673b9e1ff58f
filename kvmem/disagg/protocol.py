"""The control messages of the PD lifecycle, and the one place where a peer's message is
validated: :func:`parse` turns raw notification bytes into a typed message or raises
:class:`~kvmem.disagg.outcome.ProtocolError`.  Both sides use it (through :class:`Inbox`);
the handlers then check only what depends on their state (is the request known, is the
page range its own), before they change anything.

Wire format: a NIXL notification holding one UTF-8 JSON object, at most
``MAX_MESSAGE_BYTES``, with a ``"t"`` (type) field and exactly that type's fields::

    type        from      fields (every int in [0, 2**63))                  receiver
    REQ         prefill   rid, room, tokens (>= 1)                          decode
    BOOT        decode    rid, room, off, nbytes (>= 1), epoch, pages       prefill
                          (str: the request's decode pages as runs
                          "page:count,page:count", see encode_runs)
    CHUNK       prefill   rid, first, last, off, nbytes (>= 1), final       decode
                          (bool), direct (bool: the pages were written
                          straight into the decode's pool pages, not
                          packed into its landing region), first < last
    AUX         prefill   rid, off, nbytes (>= 1)                           decode
    ABORT       prefill   rid, status (200 | 499 | 500 | 503 | 504),        decode
                          reason (str, at most MAX_REASON characters)
    ABORT_REQ   decode    rid, status (499 | 500 | 503 | 504), reason       prefill
    PAUSING     decode    epoch                                             prefill
    PAUSE_ACK   prefill   epoch                                             decode
    READY       prefill   rid, first, last, pages (runs: the prefill's      decode
                          pages holding them), epoch (of the prefill's
                          pool), final (bool), first < last: pull mode,
                          "read these pages now"
    PULLED      decode    rid, first, last, ok (bool): the decode's read    prefill
                          of that READY is DONE (ok) or ERR / refused
    META        either    md: standard base64 (strict) of a kvmem transfer  either
                          metadata envelope whose agent is the sender

ABORT carries 200 only as the prefill's answer to an ABORT_REQ for a request that it had
already delivered (the decode side checks that it asked).  A status outside the table,
a bool where an int is due, a missing or extra field, a message of the other direction,
a META naming another agent, bytes that are not JSON (or nest deeper than
``MAX_DEPTH``): each is a ProtocolError, counted by the receiving side, never fatal.
"""

from __future__ import annotations

import base64
import binascii
import collections
import json
import logging
import re
from dataclasses import dataclass

from kvmem.disagg.outcome import END_STATUSES, OK, ProtocolError
from kvmem.disagg.peers import peer_names
from kvmem.transfer.envelope import decode_metadata

# The extra state written after a request's last KV chunk (first output token, lengths):
# its size in the decode's landing region and in the prefill's staging buffer.
AUX_BYTES = 64
from kvmem.transfer.errors import MetadataError, StaleEpochError, TransferError
from kvmem.transfer.runs import merge_runs

MAX_MESSAGE_BYTES = 4 << 20  # a META with a NIXL blob is a few KiB; nothing else is near
MAX_REASON = 4096  # characters of an abort reason
MAX_DEPTH = 4  # a control message is a flat object; JSON nesting deeper is refused unread
INT_MAX = (1 << 63) - 1
MAX_RUNS_CHARS = 1 << 20  # a BOOT's page runs: 64k pages of 15-digit ids, far above any pool
_RUNS = re.compile(r"[0-9]{1,18}:[0-9]{1,18}(,[0-9]{1,18}:[0-9]{1,18})*")

ABORT_STATUSES = END_STATUSES | {OK}


# --- typed messages -----------------------------------------------------------------------
@dataclass(frozen=True)
class Req:
    rid: int
    room: int
    tokens: int
    t = "REQ"


@dataclass(frozen=True)
class Boot:
    rid: int
    room: int
    off: int
    nbytes: int
    epoch: int
    pages: str  # runs of decode page ids (decode_runs)
    t = "BOOT"


@dataclass(frozen=True)
class Chunk:
    rid: int
    first: int
    last: int
    off: int
    nbytes: int
    final: bool
    direct: bool
    t = "CHUNK"


@dataclass(frozen=True)
class Aux:
    rid: int
    off: int
    nbytes: int
    t = "AUX"


@dataclass(frozen=True)
class Abort:
    rid: int
    status: int
    reason: str
    t = "ABORT"


@dataclass(frozen=True)
class AbortReq:
    rid: int
    status: int
    reason: str
    t = "ABORT_REQ"


@dataclass(frozen=True)
class Pausing:
    epoch: int
    t = "PAUSING"


@dataclass(frozen=True)
class PauseAck:
    epoch: int
    t = "PAUSE_ACK"


@dataclass(frozen=True)
class Ready:
    rid: int
    first: int
    last: int
    pages: str
    epoch: int
    final: bool
    t = "READY"


@dataclass(frozen=True)
class Pulled:
    rid: int
    first: int
    last: int
    ok: bool
    t = "PULLED"


@dataclass(frozen=True)
class Meta:
    """``metadata``: the decoded envelope bytes (for ``engine.add_peer``); ``agent``,
    ``incarnation``, ``version``: from its header (already checked)."""

    metadata: bytes
    agent: str
    incarnation: int
    version: int
    t = "META"


# type -> (class, {field: kind}); kinds: "int" (0 <= v <= INT_MAX), "pos" (1 <= v),
# "bool", "reason" (a str of at most MAX_REASON characters), "b64" (META's md), "runs"
# (a str of "page:count" runs, see encode_runs).
_TYPES = {
    "REQ": (Req, {"rid": "int", "room": "int", "tokens": "pos"}),
    "BOOT": (
        Boot,
        {
            "rid": "int",
            "room": "int",
            "off": "int",
            "nbytes": "pos",
            "epoch": "int",
            "pages": "runs",
        },
    ),
    "CHUNK": (
        Chunk,
        {
            "rid": "int",
            "first": "int",
            "last": "pos",
            "off": "int",
            "nbytes": "pos",
            "final": "bool",
            "direct": "bool",
        },
    ),
    "AUX": (Aux, {"rid": "int", "off": "int", "nbytes": "pos"}),
    "ABORT": (Abort, {"rid": "int", "status": "int", "reason": "reason"}),
    "ABORT_REQ": (AbortReq, {"rid": "int", "status": "int", "reason": "reason"}),
    "PAUSING": (Pausing, {"epoch": "int"}),
    "PAUSE_ACK": (PauseAck, {"epoch": "int"}),
    "META": (Meta, {"md": "b64"}),
    "READY": (
        Ready,
        {
            "rid": "int",
            "first": "int",
            "last": "pos",
            "pages": "runs",
            "epoch": "int",
            "final": "bool",
        },
    ),
    "PULLED": (Pulled, {"rid": "int", "first": "int", "last": "pos", "ok": "bool"}),
}
TYPES = tuple(_TYPES)
PREFILL_RECEIVES = frozenset({"BOOT", "ABORT_REQ", "PAUSING", "META", "PULLED"})
DECODE_RECEIVES = frozenset({"REQ", "CHUNK", "AUX", "ABORT", "PAUSE_ACK", "META", "READY"})
FIELDS = {t: tuple(spec) for t, (_, spec) in _TYPES.items()}


def encode(t: str, **fields) -> bytes:
    """One control message, as this side sends it (the sender's own values: a mistake
    here is a bug, hence ValueError rather than ProtocolError)."""
    if t not in _TYPES:
        raise ValueError(f"encode: unknown message type {t!r}")
    want = FIELDS[t]
    if set(fields) != set(want):
        raise ValueError(f"encode {t}: fields {sorted(fields)}, expected {sorted(want)}")
    return json.dumps({"t": t, **fields}, separators=(",", ":")).encode()


def encode_runs(pages) -> str:
    """Page ids on the host (a sequence, a NumPy array or a CPU tensor, in request order)
    as runs of consecutive ids: ``"12:4,40:1"`` is pages 12, 13, 14, 15, 40.  (A CUDA
    tensor works too, but reading it waits for the device: the sides pass the host copies
    of their ids, :class:`~kvmem.disagg.device.HostCopy`.)"""
    ids = pages.tolist() if hasattr(pages, "tolist") else list(pages)
    runs = merge_runs(ids, ids, by_source=False)  # one side: each id paired with itself
    return ",".join(f"{a}:{n}" for a, n in zip(runs.src.tolist(), runs.length.tolist()))


def decode_runs(text: str, limit: int) -> list[int]:
    """The page ids of ``encode_runs`` output (already format-checked by :func:`parse`);
    ProtocolError when a count is 0 or the ids number more than ``limit``."""
    ids: list[int] = []
    for part in text.split(","):
        a, n = (int(v) for v in part.split(":"))
        if n < 1 or len(ids) + n > limit:
            raise ProtocolError(f"page runs {text[:60]!r}: a count of 0 or more than {limit} pages")
        ids.extend(range(a, a + n))
    return ids


def meta_message(engine) -> bytes:
    """``META`` with this engine's current metadata (new epochs, tombstones)."""
    return encode("META", md=base64.b64encode(engine.local_metadata()).decode())


def _depth_ok(text: str) -> bool:
    """True when brackets (outside strings) nest at most MAX_DEPTH deep: checked before
    json.loads, whose recursion a deep nesting would exhaust."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return True  # the common case: a flat object, a base64 META
    depth, in_str, esc = 0, False, False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number here")


def parse(raw, *, sender: str, receiver: str) -> object:
    """Validate one message that ``sender`` sent to the ``receiver`` side ("prefill" or
    "decode"); its typed form, or ProtocolError naming what is wrong.  ``raw``: the
    notification bytes, or an already decoded JSON object (tests)."""
    if receiver not in ("prefill", "decode"):
        raise ValueError(f"parse: receiver must be 'prefill' or 'decode', got {receiver!r}")
    if isinstance(raw, (bytes, bytearray, memoryview)):
        raw = bytes(raw)
        if len(raw) > MAX_MESSAGE_BYTES:
            raise ProtocolError(
                f"control message of {len(raw)} bytes, more than {MAX_MESSAGE_BYTES}"
            )
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ProtocolError(f"control message is not UTF-8: {raw[:80]!r} ({e})") from None
        if not _depth_ok(text):
            raise ProtocolError(f"control message nests deeper than {MAX_DEPTH}: {raw[:80]!r}")
        try:
            msg = json.loads(text, parse_constant=_refuse_constant)
        except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
            raise ProtocolError(
                f"control message is not JSON: {raw[:80]!r} ({type(e).__name__}: {str(e)[:200]})"
            ) from None
    else:
        msg = raw
    if not isinstance(msg, dict):
        raise ProtocolError(f"control message is not a JSON object: {_show(msg)}")
    t = msg.get("t")
    if not isinstance(t, str) or t not in _TYPES:
        raise ProtocolError(f"unknown control message type {_show(t)}")
    accepts = PREFILL_RECEIVES if receiver == "prefill" else DECODE_RECEIVES
    if t not in accepts:
        raise ProtocolError(f"unexpected message {t} on the {receiver} side")
    cls, spec = _TYPES[t]
    extra = sorted(str(k) for k in msg if k != "t" and k not in spec)
    if extra:
        raise ProtocolError(f"{t}: unexpected fields {_show(extra)}")
    values = {}
    for name, kind in spec.items():
        if name not in msg:
            raise ProtocolError(f"{t}: field {name!r} missing")
        values[name] = _field(t, name, kind, msg[name])
    if t in ("CHUNK", "READY", "PULLED") and values["first"] >= values["last"]:
        raise ProtocolError(f"{t}: pages [{values['first']}, {values['last']}) are empty")
    if t == "ABORT" and values["status"] not in ABORT_STATUSES:
        raise ProtocolError(
            f"ABORT: status {values['status']} is not one of {sorted(ABORT_STATUSES)}"
        )
    if t == "ABORT_REQ" and values["status"] not in END_STATUSES:
        raise ProtocolError(
            f"ABORT_REQ: status {values['status']} is not one of {sorted(END_STATUSES)}"
        )
    if t == "META":
        return _meta(values["md"], sender)
    return cls(**values)


def _field(t: str, name: str, kind: str, v):
    if kind in ("int", "pos"):
        lo = 1 if kind == "pos" else 0
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= INT_MAX:
            raise ProtocolError(
                f"{t}: field {name!r} must be an int in [{lo}, 2**63), got {_show(v)}"
            )
    elif kind == "bool":
        if not isinstance(v, bool):
            raise ProtocolError(f"{t}: field {name!r} must be a bool, got {_show(v)}")
    elif kind == "reason":
        if not isinstance(v, str) or len(v) > MAX_REASON:
            raise ProtocolError(
                f"{t}: field {name!r} must be a str of at most {MAX_REASON} "
                f"characters, got {_show(v)}"
            )
    elif kind == "runs":
        if not isinstance(v, str) or len(v) > MAX_RUNS_CHARS or not _RUNS.fullmatch(v):
            raise ProtocolError(
                f"{t}: field {name!r} must be runs 'page:count,...' (at most "
                f"{MAX_RUNS_CHARS} characters), got {_show(v)}"
            )
    elif kind == "b64":
        if not isinstance(v, str):
            raise ProtocolError(f"{t}: field {name!r} must be a base64 str, got {_show(v)}")
    return v


def _meta(md: str, sender: str) -> Meta:
    try:
        blob = base64.b64decode(md.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error, ValueError) as e:
        raise ProtocolError(f"META: md is not base64: {md[:60]!r} ({e})") from None
    try:
        header, _ = decode_metadata(blob)
    except MetadataError as e:
        raise ProtocolError(f"META: {e}") from None
    if header["agent"] != sender:
        raise ProtocolError(f"META from {sender!r} names agent {header['agent']!r}")
    return Meta(blob, header["agent"], header["incarnation"], header["version"])


def _show(v) -> str:
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def apply_metadata(engine, msg: Meta) -> None:
    """``engine.add_peer`` of a META; every refusal of the engine (an older snapshot, a
    rewound registration, a blob the transport refuses) as ProtocolError.  A refused
    snapshot changes nothing: add_peer validates before it loads."""
    try:
        engine.add_peer(msg.metadata)
    except (MetadataError, StaleEpochError, TransferError, ValueError) as e:
        raise ProtocolError(f"META from {msg.agent!r} refused: {e}") from None


# --- receiving ------------------------------------------------------------------------------
# A side's dispatch table (message class -> the bound method that applies it):
# kvmem.disagg.dispatch.


class Inbox:
    """Fetches one side's notifications, validates each (:func:`parse`) and hands the typed
    message and its sender to ``handle(msg, peer)``.  Only the side's peers (``peer``:
    one agent name, or ``peers``: several) may send; a message from any other agent is
    refused.  A message that is refused (by the parser or by ``handle``, as
    ProtocolError) is counted in ``metrics.protocol_errors`` (and by type in
    :attr:`refused`), logged, and the rest of the batch goes on.  Should ``handle`` raise
    anything else (a bug), the messages after it stay queued for the next :meth:`drain`
    and the exception propagates: none is lost."""

    def __init__(
        self,
        engine,
        *,
        peer: str | None = None,
        peers=None,
        receiver: str,
        handle,
        metrics,
        log: logging.Logger,
    ):
        self.engine, self.receiver = engine, receiver
        self.peers = frozenset(peer_names("inbox: sender", peer, peers))
        self.handle, self.metrics, self.log = handle, metrics, log
        self._queue: collections.deque = collections.deque()  # (peer, raw)
        self.refused: dict[str, int] = {}

    def drain(self) -> int:
        """Fetch and apply what arrived; the number of messages handled (refused ones
        included)."""
        for peer, msgs in self.engine.get_notifs().items():
            self._queue.extend((peer, raw) for raw in msgs)
        n = 0
        while self._queue:
            peer, raw = self._queue.popleft()
            n += 1
            self.deliver(peer, raw)
        return n

    def deliver(self, peer: str, raw) -> None:
        """Validate and apply one message; refusals counted, never raised."""
        try:
            if peer not in self.peers:
                raise ProtocolError(f"message from unknown peer {peer!r}")
            msg = parse(raw, sender=peer, receiver=self.receiver)
            self.handle(msg, peer)
        except ProtocolError as e:
            self.metrics.protocol_errors += 1
            kind = _kind_of(raw)
            self.refused[kind] = self.refused.get(kind, 0) + 1
            self.log.warning("%s: refused a message from %s: %s", self.receiver, peer, e)


def _kind_of(raw) -> str:
    """The type a refused message claimed, for the counters (best effort, never raises)."""
    if isinstance(raw, dict):
        t = raw.get("t")
        return t if isinstance(t, str) and t in _TYPES else "other"
    head = bytes(raw[:32]) if isinstance(raw, (bytes, bytearray, memoryview)) else b""
    for t in sorted(_TYPES, key=len, reverse=True):
        if head.startswith(b'{"t":"' + t.encode() + b'"'):
            return t
    return "other"
