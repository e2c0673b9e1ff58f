"""kvmem.disagg.outcome: the endings of a request, the status each carries and its
outcome, as both PD lifecycles use them (kvmem's own sides and the sglang adapter), and as
docs/disagg.md's status table states them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvmem.disagg import outcome
from kvmem.disagg.outcome import END_STATUSES, Ending, Outcome, Reason

DOCS = Path(__file__).resolve().parents[2] / "docs" / "disagg.md"


def test_each_ending_has_its_own_status_and_an_outcome():
    assert {e: (e.status, e.outcome) for e in Ending} == {
        Ending.SUCCEEDED: (200, Outcome.SUCCEEDED),
        Ending.CLIENT_ABORT: (499, Outcome.ABORTED),
        Ending.FAILED: (500, Outcome.FAILED),
        Ending.RELEASED: (503, Outcome.ABORTED),
        Ending.TIMED_OUT: (504, Outcome.TIMED_OUT),
    }
    assert all(type(e.status) is int for e in Ending)  # plain ints, on the wire as such
    # an early end is every ending but success
    assert END_STATUSES == {e.status for e in Ending if e is not Ending.SUCCEEDED}


def test_a_reason_names_its_ending():
    r = Reason(outcome.SERVICE_UNAVAILABLE, "request 1: the decode released its KV memory")
    assert r.ending is Ending.RELEASED and r.outcome is Outcome.ABORTED
    assert Reason(504, "x").ending is Ending.TIMED_OUT
    with pytest.raises(ValueError):
        Reason(418, "no ending has this status").ending  # noqa: B018


def test_the_docs_status_table_is_the_endings():
    rows = re.findall(r"^\| (\d{3}) \| `(\w+)` \| (\w+)", DOCS.read_text(), re.M)
    assert len(rows) == len(Ending)
    for status, constant, result in rows:
        ending = Ending(int(status))
        assert getattr(outcome, constant) == ending.status
        assert ending.outcome.value == result
