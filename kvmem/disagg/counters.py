"""What each side counts (:class:`Metrics`, and per peer :class:`PeerCounts`): plain
fields the side increments, read by reports, log lines and
:func:`kvmem.disagg.metrics.register` (Prometheus)."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field

from kvmem.disagg.outcome import Outcome


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
        return {
            "requests": dict(self.requests),
            "bytes": self.bytes,
            "send_errors": self.send_errors,
        }


@dataclass
class Metrics:
    """Counters of one side, plain fields the side increments: for a report
    (:meth:`as_dict`), a log line (:meth:`log_line`) or a Prometheus scrape
    (:func:`kvmem.disagg.metrics.register` reads them through prometheus_client)."""

    side: str
    requests: Counter = field(default_factory=Counter)  # by outcome
    bytes_packed: int = 0
    bytes_sent: int = 0  # prefill: bytes of writes that completed DONE
    bytes_landed: int = 0  # decode: bytes of chunks whose notification arrived
    bytes_verified: int = 0  # decode: landed bytes equal to what was sent
    bytes_corrupt: int = 0  # decode: landed bytes that differ
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
        return (
            f"kvmem {self.side}: requests {req}; pages freed {freed or '-'}; "
            f"bytes packed={self.bytes_packed} sent={self.bytes_sent} "
            f"landed={self.bytes_landed} verified={self.bytes_verified} "
            f"corrupt={self.bytes_corrupt}; pauses={self.pauses} "
            f"({self.pause_seconds:.3f} s); protocol errors={self.protocol_errors} "
            f"send errors={self.send_errors}"
        )


def now() -> float:
    return time.monotonic()
