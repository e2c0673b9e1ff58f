"""Prefill/decode disaggregation with every request's pages freed exactly once.

:class:`PrefillSide` and :class:`DecodeSide` (their module docstrings draw the state
machines), the control messages and the one parser every received message goes through
(:mod:`.protocol`), the counters and page ledger they share (:mod:`.common`), the
deterministic stand-in KV data the demo verifies (:mod:`.synth`), and the measurement of
the packed/direct threshold of push mode (:mod:`.calibrate`).

Transfer modes: push (the prefill writes each chunk: packed into the decode's landing
region, or direct from its pool pages into the decode's pool pages, chosen per chunk by
``direct_threshold``) and pull (``transfer_mode="pull"`` on both sides: the decode reads
the prefill's pool pages).  The lifecycle table holds in both.
"""

from kvmem.disagg.common import (
    CLIENT_CLOSED, GATEWAY_TIMEOUT, INTERNAL_ERROR, OK, SERVICE_UNAVAILABLE, KVPoll, Ledger,
    Metrics, Outcome, ProtocolError, Reason,
)
from kvmem.disagg.decode import DecodeFaults, DecodeSide
from kvmem.disagg.prefill import Faults, PrefillSide
from kvmem.demo.synth import Synth

__all__ = [
    "KVPoll", "Outcome", "Reason", "ProtocolError", "Ledger", "Metrics",
    "PrefillSide", "DecodeSide", "Faults", "DecodeFaults", "Synth",
    "OK", "CLIENT_CLOSED", "INTERNAL_ERROR", "SERVICE_UNAVAILABLE", "GATEWAY_TIMEOUT",
]
