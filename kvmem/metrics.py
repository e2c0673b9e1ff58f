"""The former name of :mod:`kvmem.disagg.metrics` (the PD sides' counters for Prometheus),
kept so that ``import kvmem.metrics`` goes on working: the same objects, nothing of its
own."""

from kvmem.disagg.metrics import (
    ABORT_FREE_BUCKETS, FIELDS, OUTCOMES, REGISTRY, SIDES, STAGES, DisaggCollector, register,
    unregister,
)

__all__ = ["REGISTRY", "register", "unregister", "DisaggCollector", "FIELDS", "OUTCOMES",
           "STAGES", "SIDES", "ABORT_FREE_BUCKETS"]
