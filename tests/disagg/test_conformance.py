"""The PD contract (kvmem/lifecycle.py) held against kvmem's own sides: every case they
serve, in every transfer mode (tests/disagg/conftest.py's pair), driven by
``tests/disagg/conformance.py``.  The same cases run against the sglang adapter in
tests/sglang/test_conformance.py.

Each case: the request ends exactly once, with the case's ending (its status); the
decode side is told that status (a dead decode is not); every page either side took is
freed, the audit finds nothing leaked, quarantined or unaccounted, and nothing is left
allocated; the pair serves a request in full afterwards."""

from __future__ import annotations

import pytest

from kvmem.disagg.outcome import Ending
from kvmem.lifecycle import IMPLEMENTATIONS, Cause, cases_of
from tests.disagg.conformance import RID, TOKENS, run
from tests.disagg.harness import MODES, SPEC

DEMO = IMPLEMENTATIONS[0]
CASES = cases_of(DEMO)
PAGES = -(-TOKENS // SPEC.page_size)
# Every case in every transfer mode, but a stale send in pull mode: there the decode reads
# the prefill's pages into its own, and its own memory moves only in its pause, which
# tells the prefill first (decode_release).
COMBOS = [
    pytest.param(kw, c, id=f"{mode}-{c.id}")
    for mode, kw in MODES.items()
    for c in CASES
    if not (mode == "pull" and c.cause is Cause.STALE_SEND)
]


@pytest.mark.parametrize("pair, case", COMBOS, indirect=["pair"])
def test_case(pair, case):
    seen = run(pair, case)
    assert seen.status == case.ending.status, (seen.status, seen.message)
    assert not seen.held, seen.held
    if case.cause is Cause.PEER_GONE:
        assert seen.decode_told is None
    else:
        assert seen.decode_told == case.ending.status, seen
        # the decode's pages for the request, all of them, once (none if it never booted)
        assert sum(seen.decode_freed.values()) in (0, PAGES), seen.decode_freed
        # the pair serves again
        pair.prefill.add_request(RID + 1, TOKENS)
        pair.run_idle()
        assert pair.finished[RID + 1].status == Ending.SUCCEEDED.status
        pair.assert_clean()
