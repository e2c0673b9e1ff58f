"""Prefill/decode disaggregation with every request's pages freed exactly once.

:class:`PrefillSide` and :class:`DecodeSide` (their module docstrings draw the state
machines), what they need of the model (:mod:`.model`: the prefill's :class:`Forward`,
the decode's :class:`Verifier`), the control messages and the one parser every received
message goes through (:mod:`.protocol`), how a request ends and its status
(:mod:`.outcome`, shared with the sglang adapter), the counters and page ledger they
share (:mod:`.counters`, :mod:`.ledger`), those counters for Prometheus (:mod:`.metrics`),
and the measurement
of the packed/direct threshold of push mode (:mod:`.calibrate`).  Nothing here imports
:mod:`kvmem.demo`, the app that runs these sides with a stand-in model.

Transfer modes: push (the prefill writes each chunk: packed into the decode's landing
region, or direct from its pool pages into the decode's pool pages, chosen per chunk by
``direct_threshold``) and pull (``transfer_mode="pull"`` on both sides: the decode reads
the prefill's pool pages).  The lifecycle table holds in both.
"""

from kvmem.disagg.counters import Metrics
from kvmem.disagg.ledger import Ledger
from kvmem.disagg.outcome import (
    CLIENT_CLOSED,
    GATEWAY_TIMEOUT,
    INTERNAL_ERROR,
    OK,
    SERVICE_UNAVAILABLE,
    Ending,
    KVPoll,
    Outcome,
    ProtocolError,
    Reason,
)
from kvmem.disagg.decode import DecodeFaults, DecodeSide
from kvmem.disagg.model import Forward, Verifier
from kvmem.disagg.prefill import Faults, PrefillSide

__all__ = [
    "KVPoll",
    "Outcome",
    "Ending",
    "Reason",
    "ProtocolError",
    "Ledger",
    "Metrics",
    "PrefillSide",
    "DecodeSide",
    "Faults",
    "DecodeFaults",
    "Forward",
    "Verifier",
    "OK",
    "CLIENT_CLOSED",
    "INTERNAL_ERROR",
    "SERVICE_UNAVAILABLE",
    "GATEWAY_TIMEOUT",
]
