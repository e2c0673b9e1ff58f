"""The PD contract's table (kvmem/lifecycle.py) is well formed, and the documents that
quote it quote it as it is now (tools/contract_tables.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvmem import lifecycle
from kvmem.disagg.outcome import Ending
from kvmem.lifecycle import CASES, IMPLEMENTATIONS, Cause, Serves, State

ROOT = Path(__file__).resolve().parents[1]


def test_each_cause_has_cases_and_each_case_is_unique():
    assert {c.cause for c in CASES} == set(Cause)
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
    # one ending and one text per cause: the table's line per cause holds for every state
    for cause in Cause:
        group = [c for c in CASES if c.cause is cause]
        assert len({(c.ending, c.prefill_frees, c.decode_frees) for c in group}) == 1, cause
    assert all(c.ending is not Ending.SUCCEEDED for c in CASES)


def test_only_a_release_meets_a_request_before_it_exists():
    assert {c.cause for c in CASES if c.state is State.ARRIVING} == {Cause.PREFILL_RELEASE}


def test_an_unserved_case_says_why_and_a_served_one_does_not():
    with pytest.raises(ValueError):
        Serves(False)
    with pytest.raises(ValueError):
        Serves(True, "because")
    for impl in IMPLEMENTATIONS:
        assert lifecycle.cases_of(impl), impl
        for c in CASES:
            s = c.served_by(impl)
            assert s.served or len(s.why) > 20, (impl, c.id)


def test_statuses_and_router_retries():
    assert lifecycle.sglang_status(Ending.CLIENT_ABORT) is None
    assert not lifecycle.router_retries(Ending.CLIENT_ABORT)
    for e in (Ending.FAILED, Ending.RELEASED, Ending.TIMED_OUT):
        assert lifecycle.sglang_status(e) == e.status and lifecycle.router_retries(e)
    with pytest.raises(KeyError):
        lifecycle.case(Cause.PEER_GONE, State.ARRIVING)
    assert lifecycle.case(Cause.SEND_FAILED, State.TRANSFERRING).ending is Ending.FAILED


def test_markdown_has_a_line_per_cause():
    table = lifecycle.markdown().splitlines()
    assert len(table) == 2 + len(Cause)
    assert all(line.count("|") == table[0].count("|") for line in table)


def test_the_documents_quote_the_table_as_it_is():
    p = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "contract_tables.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stdout + p.stderr
