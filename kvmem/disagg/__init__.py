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

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmem.lazy import lazy_names

if TYPE_CHECKING:
    from kvmem.disagg.counters import Metrics
    from kvmem.disagg.decode import DecodeFaults, DecodeSide
    from kvmem.disagg.ledger import Ledger
    from kvmem.disagg.model import Forward, Verifier
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

# Where each name above is defined: the module is imported when the name is first asked
# for (PEP 562), so that importing one submodule (the sglang adapter imports
# kvmem.disagg.outcome) does not load both sides and what they import.
_HOME = {
    "KVPoll": "kvmem.disagg.outcome",
    "Outcome": "kvmem.disagg.outcome",
    "Ending": "kvmem.disagg.outcome",
    "Reason": "kvmem.disagg.outcome",
    "ProtocolError": "kvmem.disagg.outcome",
    "OK": "kvmem.disagg.outcome",
    "CLIENT_CLOSED": "kvmem.disagg.outcome",
    "INTERNAL_ERROR": "kvmem.disagg.outcome",
    "SERVICE_UNAVAILABLE": "kvmem.disagg.outcome",
    "GATEWAY_TIMEOUT": "kvmem.disagg.outcome",
    "Ledger": "kvmem.disagg.ledger",
    "Metrics": "kvmem.disagg.counters",
    "PrefillSide": "kvmem.disagg.prefill",
    "Faults": "kvmem.disagg.prefill",
    "DecodeSide": "kvmem.disagg.decode",
    "DecodeFaults": "kvmem.disagg.decode",
    "Forward": "kvmem.disagg.model",
    "Verifier": "kvmem.disagg.model",
}

if not TYPE_CHECKING:  # for mypy the names are the imports above, and no others
    __getattr__, __dir__ = lazy_names(__name__, _HOME)
