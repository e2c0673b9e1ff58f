"""Unequal attention TP over Mooncake's TCP transport, past its queue: sglang's per-head
slice send (``SGLANG_KVMEM_TRANSFER=sglang``, i.e. stock's send) against kvmem's
(``kvmem_sglang.mooncake_slice``, the flag's default), real classes over Mooncake's engine
on TCP, every rank a process of its own, Mooncake's default queue of 1,024 transfers per
peer (tests/sglang/scenario_transfer_tp_queue.py has the pair and the round).  Two runs
at once, in ``.venv-e2e``.

What must hold: at TP 2 -> TP 1, a request of 4,096 tokens that sglang posts as calls of
4,096 slices (one per token of a plane) fails there (the engine rejects the call, the
decode's session is marked failed, every room of the round fails);
on kvmem's path the same slices go as calls of at most the queue's size and every room
ends Success on every rank of both sides, every head of every row landed.
"""

from __future__ import annotations

import pytest

from tests.sglang.sglang_env import ROOT, mooncake_queue_runs
from tests.sglang.sglang_env import all_are as _all

SCRIPT = ROOT / "tests" / "sglang" / "scenario_transfer_tp_queue.py"
SUCCESS, FAILED = 4, 0
TCP_QUEUE = 1024  # Mooncake's default, set in both runs
PLANES, TOKENS = 4, 4096  # the scenario's 2 layers; tokens a request
LAYOUTS = ("2x1",)


@pytest.fixture(scope="module")
def runs() -> dict:
    out = mooncake_queue_runs(SCRIPT, TCP_QUEUE)
    for key in out:  # the times, for a report (no test reads them)
        r = out[key]["2x1"]
        print(f"{key}: round {r['seconds']:.3f} s, {r['nbytes']} B; raw write {r.get('raw')}")
    return out


def _ranks(r: dict) -> list[list[int]]:
    return r["prefill"] + r["decode"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sglang_slice_send_past_the_queue_fails_the_session(runs, layout):
    s = runs["sglang"][layout]
    # one call per plane and request, one slice per token: past the queue
    kv_calls = [n for n in s["calls"] if n > 1]
    assert kv_calls and max(kv_calls) == TOKENS, s["calls"]
    assert all(_all(states, FAILED) for states in _ranks(s)), s
    assert s["marked_failed"], s
    assert s["stats"].get("slice_sends", 0) == 0, s["stats"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kvmem_slice_send_stays_within_the_queue_and_lands(runs, layout):
    k = runs["kvmem"][layout]
    assert all(_all(states, SUCCESS) for states in _ranks(k)), k
    assert k["bad_rows"] == 0 and k["marked_failed"] == [], k
    assert max(k["calls"]) <= TCP_QUEUE, k["calls"]
    st = k["stats"]
    # rank 0's slices: every token of every plane of both requests, one chunk each
    assert st["slices"] == 2 * TOKENS * PLANES, st
    assert st["slice_calls"] == st["slices"] // TCP_QUEUE, st
    assert st["slice_sends"] == 2, st
