"""sglang's PD transfer at TP 2 under the flag (kvmem's pool and send path on every
rank), real classes over NIXL/UCX, each rank a process of its own with its half of the KV
heads (tests/sglang/scenario_transfer_tp.py has the pairs and the round).

What must hold: with a TP 1 decode, each prefill rank's heads land in every row of the
decode's pool (sglang's per-token slice send, which the flag leaves to sglang: kvmem's
path needs equal TP); with a TP 2 decode, each prefill rank's heads land in its decode
rank's pool, sent on kvmem's path (merged, fewer descriptors than one per page and
plane); every room ends Success on every rank of both sides.
"""

from __future__ import annotations

import pytest

from testkit.child import Child, child_env, run_children
from tests.sglang.sglang_env import ROOT, fork_server
from tests.sglang.sglang_env import all_are as _all

SCRIPT = ROOT / "tests" / "sglang" / "scenario_transfer_tp.py"
SUCCESS = 4
PLANES, TOKENS, PAGES = 4, 64, 4  # the scenario's 2 layers, 64 tokens at page size 16


@pytest.fixture(scope="module")
def run() -> dict:
    env = child_env({"SGLANG_KVMEM": "1", "SGLANG_KVMEM_TRANSFER": "kvmem"},
                    drop=("SGLANG_KVMEM",), paths=[ROOT / "integration" / "sglang"])
    child = Child(script=SCRIPT, cwd=ROOT, fork=fork_server(), env=env)
    out = run_children({"tp": child}, timeout=900)["tp"].value
    assert out["kvmem_path"]
    return out


def _all_success(r: dict) -> bool:
    return all(_all(states, SUCCESS) for states in r["prefill"] + r["decode"])


def test_unequal_tp_lands_each_rank_heads_in_every_row(run):
    r = run["2x1"]
    assert len(r["prefill"]) == 2 and len(r["decode"]) == 1, r
    assert _all_success(r) and r["bad_rows"] == 0, r
    # sglang's slice send: one descriptor per token, plane and prefill rank
    assert r["descriptors"] == TOKENS * PLANES * 2, r
    assert r["stats"].get("sends", 0) == 0, r["stats"]


def test_equal_tp_sends_each_rank_on_kvmem_path(run):
    r = run["2x2"]
    assert len(r["prefill"]) == 2 and len(r["decode"]) == 2 and r["kvmem_pool"], r
    assert _all_success(r) and r["bad_rows"] == 0, r
    assert r["stats"]["sends"] > 0 and r["stats"]["fallbacks"] == 0, r["stats"]
    assert r["descriptors"] < PAGES * PLANES * 2, r
