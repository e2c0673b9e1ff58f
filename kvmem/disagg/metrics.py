"""The PD sides' metrics for Prometheus, through ``prometheus_client``.

The PD sides (:class:`~kvmem.disagg.PrefillSide`, :class:`~kvmem.disagg.DecodeSide`)
count in plain Python fields (``side.metrics``, a :class:`~kvmem.disagg.Metrics`;
``side.ledger.freed_by_reason``; the allocator's ``num_free`` / ``num_allocated``).
:func:`register` puts a collector over those fields into a ``CollectorRegistry``: each
scrape reads them as they are then, so nothing is counted twice and the sides' hot paths
do not change.

Every sample carries ``side="prefill"`` or ``side="decode"``:

=============================  =========  ==========  ======================================
name                           type       labels      value (the field it reads)
=============================  =========  ==========  ======================================
kvmem_requests_total           counter    outcome     requests ended, by outcome
                                                      (succeeded, aborted, timed_out, failed)
kvmem_pages_freed_total        counter    reason      pages freed through the ledger, by
                                                      reason (sent, ended:503, abort:499, ...)
kvmem_transfer_bytes_total     counter    stage       bytes at each stage of the path:
                                                      packed, sent, landed, verified,
                                                      corrupt (``bytes_<stage>``; a side
                                                      counts some of them, the others stay
                                                      0).  Stages are points on one path,
                                                      not parts: never sum over ``stage``
kvmem_pauses_total             counter                pauses begun
kvmem_pause_seconds_total      counter                seconds paused, pauses ended
kvmem_protocol_errors_total    counter                peer messages refused
kvmem_send_errors_total        counter                control messages the peer could not
                                                      be sent
kvmem_abort_free_seconds       histogram              an abort in the running batch until
                                                      its pages are free (``time_to_free``;
                                                      the prefill's)
kvmem_pages                    gauge      state       pages of the allocator: free,
                                                      allocated (sum: its capacity)
kvmem_peer_requests_total      counter    peer,       requests ended, by the peer they were
                                          outcome     bound to (``peers``; they add up over
                                                      ``peer`` to kvmem_requests_total)
kvmem_peer_bytes_total         counter    peer        bytes moved with each peer (the
                                                      prefill: sent DONE; the decode: landed)
kvmem_peer_send_errors_total   counter    peer        control messages each peer could not
                                                      be sent
=============================  =========  ==========  ======================================

A ``peer`` label is the peer's agent name: a side that serves several peers (several
decodes of one prefill, several prefills of one decode) shows one series per peer.

The default registry is :data:`REGISTRY`, kvmem's own, not ``prometheus_client``'s global
one, so that tests and several kvmem instances in one process do not collide.  A host
exposes it as it exposes any registry::

    prometheus_client.generate_latest(kvmem.disagg.metrics.REGISTRY)    # the text, bytes
    prometheus_client.start_http_server(9400, registry=kvmem.disagg.metrics.REGISTRY)

or passes its own registry to :func:`register` (``prometheus_client.REGISTRY``, the one
most Python hosts serve).  One registry holds at most one side of each kind.

The collector reads the sides of its own process: prometheus_client's multiprocess mode
(a host serving ``/metrics`` from another process, as sglang does) does not gather it.

Scrapes may come from another thread (``start_http_server`` serves from one): the
collector copies each counter dict and list in one C-level call under the GIL before
reading it, and the allocator's counts are plain ints.
"""

from __future__ import annotations

import threading
import weakref

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvmem.disagg.outcome import Outcome

REGISTRY = CollectorRegistry()
"""kvmem's registry: :func:`register` uses it unless given another."""

OUTCOMES = tuple(o.value for o in Outcome)  # every one, 0 until it happens
STAGES = ("packed", "sent", "landed", "verified", "corrupt")  # Metrics.bytes_<stage>
SIDES = ("prefill", "decode")  # Metrics.side
# The Metrics fields the collector reads: every one but ``side`` (tests/disagg/test_metrics.py
# fails when Metrics gains a field that is not here).
FIELDS = frozenset(
    {
        "requests",
        *(f"bytes_{s}" for s in STAGES),
        "pauses",
        "pause_seconds",
        "protocol_errors",
        "send_errors",
        "time_to_free",
        "peers",
    }
)
# Seconds from an abort inside the running batch to its pages being free, 0.1 ms to 1 s
# around what the demo measured (docs/logging.md, "Metrics").
ABORT_FREE_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)


class DisaggCollector(Collector):
    """The PD sides registered in one registry, read at each scrape; ``{kind: side}``
    with at most one side per kind ("prefill", "decode")."""

    def __init__(self):
        self._sides: dict = {}
        self._lock = threading.Lock()

    def add(self, side) -> None:
        kind = side.metrics.side
        if kind not in SIDES:
            raise ValueError(
                f"kvmem.disagg.metrics: side.metrics.side must be one of "
                f"{sorted(SIDES)}, got {kind!r}"
            )
        with self._lock:
            if kind in self._sides:
                which = "this same side" if self._sides[kind] is side else "another one"
                raise ValueError(
                    f"kvmem.disagg.metrics: a {kind} side is already registered in this registry "
                    f"({which}); unregister it first, or give each instance a registry of "
                    "its own"
                )
            self._sides[kind] = side

    def remove(self, side) -> None:
        kind = side.metrics.side
        with self._lock:
            if self._sides.get(kind) is not side:
                raise ValueError(
                    f"kvmem.disagg.metrics: this {kind} side is not registered in "
                    f"this registry (registered: {sorted(self._sides) or 'none'})"
                )
            del self._sides[kind]

    def __len__(self) -> int:
        return len(self._sides)

    def describe(self):
        """The families without samples: what the registry checks names against."""
        return self._families()

    def collect(self):
        with self._lock:
            sides = sorted(self._sides.items())
        fams = self._families()
        (
            requests,
            freed,
            moved,
            pauses,
            paused,
            refused,
            unsent,
            ttf,
            pages,
            peer_requests,
            peer_bytes,
            peer_unsent,
        ) = fams
        for kind, side in sides:
            m = side.metrics
            by_outcome = dict(m.requests)
            for o in OUTCOMES:
                requests.add_metric([kind, o], by_outcome.get(o, 0))
            for reason, n in sorted(dict(side.ledger.freed_by_reason).items()):
                freed.add_metric([kind, reason], n)
            for stage in STAGES:
                moved.add_metric([kind, stage], getattr(m, f"bytes_{stage}"))
            pauses.add_metric([kind], m.pauses)
            paused.add_metric([kind], m.pause_seconds)
            refused.add_metric([kind], m.protocol_errors)
            unsent.add_metric([kind], m.send_errors)
            seen = sorted(list(m.time_to_free))
            buckets, i = [], 0
            for le in ABORT_FREE_BUCKETS:
                while i < len(seen) and seen[i] <= le:
                    i += 1
                buckets.append((floatToGoString(le), i))
            buckets.append(("+Inf", len(seen)))
            ttf.add_metric([kind], buckets, sum_value=sum(seen))
            alloc = side.alloc
            pages.add_metric([kind, "free"], alloc.num_free)
            pages.add_metric([kind, "allocated"], alloc.num_allocated)
            for name, c in sorted(dict(m.peers).items()):
                by_outcome = dict(c.requests)
                for o in OUTCOMES:
                    peer_requests.add_metric([kind, name, o], by_outcome.get(o, 0))
                peer_bytes.add_metric([kind, name], c.bytes)
                peer_unsent.add_metric([kind, name], c.send_errors)
        return fams

    @staticmethod
    def _families():
        return [
            CounterMetricFamily(
                "kvmem_requests", "Requests ended, by outcome", labels=["side", "outcome"]
            ),
            CounterMetricFamily(
                "kvmem_pages_freed",
                "KV pages freed through the page ledger, by reason",
                labels=["side", "reason"],
            ),
            CounterMetricFamily(
                "kvmem_transfer_bytes",
                "Bytes of KV at each stage of the "
                "transfer path (packed, sent; landed, verified, corrupt); "
                "stages are points on one path, not parts",
                labels=["side", "stage"],
            ),
            CounterMetricFamily(
                "kvmem_pauses", "Pauses begun (pool memory released)", labels=["side"]
            ),
            CounterMetricFamily(
                "kvmem_pause_seconds", "Seconds paused, over the pauses that ended", labels=["side"]
            ),
            CounterMetricFamily(
                "kvmem_protocol_errors", "Peer control messages refused", labels=["side"]
            ),
            CounterMetricFamily(
                "kvmem_send_errors", "Control messages the peer could not be sent", labels=["side"]
            ),
            HistogramMetricFamily(
                "kvmem_abort_free_seconds",
                "Seconds from an abort in the running batch to its pages being free",
                labels=["side"],
            ),
            GaugeMetricFamily(
                "kvmem_pages",
                "KV pages of the side's allocator, free or allocated",
                labels=["side", "state"],
            ),
            CounterMetricFamily(
                "kvmem_peer_requests",
                "Requests ended, by the peer they were bound to and outcome",
                labels=["side", "peer", "outcome"],
            ),
            CounterMetricFamily(
                "kvmem_peer_bytes",
                "Bytes moved with each peer (prefill: sent, decode: landed)",
                labels=["side", "peer"],
            ),
            CounterMetricFamily(
                "kvmem_peer_send_errors",
                "Control messages each peer could not be sent",
                labels=["side", "peer"],
            ),
        ]


_COLLECTORS: "weakref.WeakKeyDictionary[CollectorRegistry, DisaggCollector]" = (
    weakref.WeakKeyDictionary()
)
_COLLECTORS_LOCK = threading.Lock()


def register(side, registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """Expose ``side``'s counters (a PrefillSide or DecodeSide: anything with ``metrics``,
    ``ledger`` and ``alloc``) in ``registry`` (default :data:`REGISTRY`), labelled
    ``side=side.metrics.side``; returns the registry.  The first side of a registry adds
    kvmem's collector to it: ValueError from prometheus_client if the registry already
    has another collector of these names.  ValueError if a side of the same kind is
    already registered there; nothing changes then."""
    registry = REGISTRY if registry is None else registry
    with _COLLECTORS_LOCK:
        col = _COLLECTORS.get(registry)
        if col is None:
            col = DisaggCollector()
            col.add(side)
            registry.register(col)  # raises on a name clash: col is dropped, nothing kept
            _COLLECTORS[registry] = col
        else:
            col.add(side)
    return registry


def unregister(side, registry: CollectorRegistry | None = None) -> None:
    """Stop exposing ``side`` in ``registry`` (default :data:`REGISTRY`); its counters
    leave the exposition (a scraper sees a counter reset if a side of that kind comes
    back).  The last side out removes kvmem's collector.  ValueError if ``side`` is not
    registered there."""
    registry = REGISTRY if registry is None else registry
    with _COLLECTORS_LOCK:
        col = _COLLECTORS.get(registry)
        if col is None:
            raise ValueError(
                f"kvmem.disagg.metrics: no kvmem side is registered in this "
                f"registry (this {side.metrics.side} side is not)"
            )
        col.remove(side)
        if not len(col):
            registry.unregister(col)
            del _COLLECTORS[registry]
