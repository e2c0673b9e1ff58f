"""Seeded randomized soak: thousands of requests with every fault of the plan and pause /
resume cycles on both sides, ending with audit() empty on both sides and every landed byte
verified (successful requests byte for byte)."""

from __future__ import annotations

import collections
import os

import pytest

from kvmem.disagg import Outcome
from kvmem.demo.faults import FAMILIES, FaultPlan
from tests.disagg.harness import Pair

REQUESTS = int(os.environ.get("KVMEM_SOAK_REQUESTS", "2000"))


@pytest.mark.slow  # 10-40 s each here: make test, not make check
@pytest.mark.parametrize("chunks", ["packed", "direct", "mixed", "pull"])
def test_soak_every_fault_and_pauses(chunks):
    """Push with ``chunks``: every chunk packed, every chunk direct (pool pages to pool
    pages), or chosen per chunk by its merged page runs (threshold of two pages of a layer:
    chunks whose pages are scattered on either side pack, the others go direct); or pull
    (the decode reads the prefill's pool pages)."""
    threshold = {"packed": None, "direct": 0, "mixed": 2 * 16 * 2 * 64 * 2, "pull": None}[chunks]
    pair = Pair(
        num_pages=193,
        chunk_tokens=64,
        max_tokens=256,
        bootstrap_timeout=1.0,
        transfer_timeout=1.0,
        decode_timeout=5.0,
        staging_chunks=16,
        direct_threshold=threshold,
        transfer_mode="pull" if chunks == "pull" else "push",
    )
    plan = FaultPlan(
        seed=1234,
        rates={"abort": 0.15, "timeout": 0.06, "fail": 0.09},
        chunk_tokens=64,
        max_tokens=256,
        wait=0.02,
    )
    pair.faults = plan
    pair.prefill.faults = plan
    pair.decode.faults = plan
    pre, dec = pair.prefill, pair.decode
    next_rid, in_flight_cap, pause_every, pauses = 0, 24, max(REQUESTS // 6, 50), 0
    kinds = collections.Counter()
    steps = 0
    while len(pair.finished) < REQUESTS:
        steps += 1
        assert steps < 200 * REQUESTS, "soak made no progress"
        while (
            next_rid < REQUESTS
            and len(pre.reqs) < in_flight_cap
            and not pre.paused
            and not pre.pausing
        ):
            pre.add_request(next_rid, plan.tokens(next_rid))
            kinds[plan.kind(next_rid)] += 1
            next_rid += 1
        plan.drive(pre, pair.clock())
        pair.step()
        pair.clock.advance(0.01)
        if len(pair.finished) >= (pauses + 1) * pause_every and not (pre.paused or dec.paused):
            pauses += 1
            side = pre if pauses % 2 else dec
            side.begin_pause()
            pair.run_until(lambda: side.paused, max_steps=2000)
            side.resume()
    pair.run_idle(max_steps=5000)

    outcomes = collections.Counter(r.outcome for r in pair.finished.values())
    assert sum(outcomes.values()) == REQUESTS
    assert set(kinds) >= {
        "none",
        "abort_bootstrapping",
        "abort_waiting",
        "abort_transferring",
        "abort_in_batch",
        "bootstrap_timeout",
        "timeout_waiting",
        "timeout_transferring",
        "fail_first",
        "fail_middle",
        "fail_last",
    }
    # every fault ended its request the way its row of the table says
    want = {
        kind: outcome
        for fam, outcome in (
            ("abort", Outcome.ABORTED),
            ("timeout", Outcome.TIMED_OUT),
            ("fail", Outcome.FAILED),
        )
        for kind in FAMILIES[fam]
    }
    paused_aborts = 0
    for rid, reason in pair.finished.items():
        k = plan.kind(rid)
        if reason.status == 503:
            paused_aborts += 1
            continue
        if k == "none":
            assert reason.outcome == Outcome.SUCCEEDED, (rid, reason)
        else:
            assert reason.outcome == want[k], (rid, k, reason)
    assert outcomes[Outcome.SUCCEEDED] > REQUESTS // 2
    assert pre.metrics.pauses + dec.metrics.pauses == pauses >= 4
    # nothing leaked, nothing corrupt, every landed byte verified
    pair.assert_clean()
    m = dec.metrics
    assert m.bytes_landed == m.bytes_verified > 0 and m.bytes_corrupt == 0
    assert pre.metrics.protocol_errors == 0 and m.protocol_errors == 0
    modes = pre.chunk_modes
    if chunks == "packed":
        assert modes["direct"] == 0 < modes["packed"]
    elif chunks == "direct":
        assert modes["packed"] == 0 < modes["direct"]
    elif chunks == "pull":
        assert set(modes) == {"pulled"} and dec.chunk_modes["pulled"] > 0
    else:
        assert modes["packed"] > 0 and modes["direct"] > 0, modes
    assert dec.chunk_modes["direct"] <= modes["direct"]  # a chunk lands once at most
    pair.close()
