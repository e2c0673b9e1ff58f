"""The PD contract (kvmem/lifecycle.py) held against the sglang adapter: every case it
serves that a prefill scheduler meets, through sglang's real PD prefill scheduler
(``scenario_conformance.py``; stock beside the flag, in two processes).  The same cases
run against kvmem's own sides in tests/disagg/test_conformance.py.

Each case, with the flag: the request answered exactly once, with the case's ending
(sglang's status of it: an abort without an error status for a client's abort); the
decode told (the KV sender aborted) wherever the prefill ended a sender; nothing raised into the
scheduler loop; nothing held once the case settled (KV, request and metadata slots).
Stock's answers are recorded beside them and the cases where stock breaks the contract
listed (for the report, and so that a case stock already keeps is not claimed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmem.lifecycle import IMPLEMENTATIONS, cases_of, sglang_status
from tests.sglang.scenario_conformance import DRIVEN
from tests.sglang.sglang_env import run_both

SCRIPT = Path(__file__).parent / "scenario_conformance.py"
ENV = {
    "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT": "0.3",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "1",
    "SGLANG_KVMEM_DRAIN_TIMEOUT": "1.5",
}
ADAPTER = IMPLEMENTATIONS[1]
EMPTY = {"kv_tokens": 0, "req_slots": 0, "meta_slots": 0}

# The cases the adapter serves that this suite does not drive on a prefill scheduler, and
# where they are driven instead.
DRIVEN_ELSEWHERE = {
    "decode_abort-waiting": "a decode's abort, through both schedulers over real NIXL "
    "managers: tests/sglang/test_prefill_decode.py::test_a_decodes_aborts_on_the_prefill",
    "decode_abort-transferring": "as decode_abort-waiting",
    "decode_release-waiting": "a decode's release with requests in flight, on real "
    "servers: tests/e2e/test_pd.py::test_release_with_requests_in_flight (role decode)",
    "decode_release-transferring": "as decode_release-waiting",
}

SERVED = {c.id: c for c in cases_of(ADAPTER)}
DRIVEN_IDS = [f"{cause.name.lower()}-{state.name.lower()}" for cause, state in DRIVEN]


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    out = run_both(SCRIPT, env=ENV, timeout=240)
    assert out["on"]["kvmem"] and not out["off"]["kvmem"]
    return out


def test_every_served_case_is_driven_here_or_named():
    assert set(DRIVEN_IDS) <= set(SERVED), set(DRIVEN_IDS) - set(SERVED)
    assert set(SERVED) == set(DRIVEN_IDS) | set(DRIVEN_ELSEWHERE), (
        sorted(set(SERVED) - set(DRIVEN_IDS) - set(DRIVEN_ELSEWHERE)),
        sorted(set(DRIVEN_ELSEWHERE) - set(SERVED)),
    )


@pytest.mark.parametrize("cid", DRIVEN_IDS)
def test_case(runs, cid):
    c = SERVED[cid]
    got = runs["on"]["cases"][cid]
    assert not got["errors"], got["errors"]
    assert len(got["answers"]) == 1 and got["answers_settled"] == 1, got["answers"]
    (answer,) = got["answers"]
    want = sglang_status(c.ending)
    assert answer["type"] == "abort", answer
    assert answer["status"] == ("abort" if want is None else want), (c.ending, answer)
    # a sender the prefill ended is aborted: the decode is told.  One that failed by itself
    # (its bootstrap timed out, its write failed) is not aborted again: a real backend's
    # own failure path tells the decode (or the decode never reached this prefill), which
    # the harness's fake sender does not have; the real-server tier covers that path.
    if got["decode_told"] is not None and not got["sender_failed"]:
        assert got["decode_told"] >= 1, got
    assert got["held"] == EMPTY, got
    assert got["queues"] == {"bootstrap": [], "waiting": [], "inflight": []}, got


def test_stock_beside_the_flag(runs):
    """Stock sglang breaks the contract in some of these cases (answered with another
    status, never answered, an error in the loop, something held); the flag in none.
    Which ones is the report's."""
    broken = {}
    for cid in DRIVEN_IDS:
        got = runs["off"]["cases"][cid]
        want = sglang_status(SERVED[cid].ending)
        statuses = [a["status"] for a in got["answers"]]
        if statuses != ["abort" if want is None else want] or got["errors"] or got["held"] != EMPTY:
            broken[cid] = {"answers": statuses, "errors": len(got["errors"]), "held": got["held"]}
    print(f"stock breaks {len(broken)} of {len(DRIVEN_IDS)} cases: {broken}")
    assert broken, "stock keeps every case: the flag claims nothing here"
