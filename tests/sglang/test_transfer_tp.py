"""sglang's PD transfer at TP 2 under the flag (kvmem's pool and send path on every
rank), real classes over NIXL/UCX and over Mooncake's engine on TCP (both at once, one
child each), each rank a process of its own with its half of the KV heads
(tests/sglang/scenario_transfer_tp.py has the pairs and the round).

What must hold: with a TP 1 decode, each prefill rank's heads land in every row of the
decode's pool (sglang's per-token slices: on NIXL sglang's own send, which the flag
leaves to sglang as kvmem's merged path needs equal TP; on Mooncake the same slices
posted by ``kvmem_sglang.mooncake_slice``, one chunk a request); with a TP 2 decode,
each prefill rank's heads land in its decode rank's pool, sent on kvmem's path (merged,
fewer descriptors or slices than one per page and plane); every room ends Success on
every rank of both sides.
"""

from __future__ import annotations

import pytest

from testkit.child import Child, child_env, run_children
from testkit.sglang_pair import E2E_PYTHON
from tests.sglang.sglang_env import ADAPTER, ROOT, e2e_env, e2e_fork_server, fork_server
from tests.sglang.sglang_env import all_are as _all

SCRIPT = ROOT / "tests" / "sglang" / "scenario_transfer_tp.py"
SUCCESS = 4
PLANES, TOKENS, PAGES = 4, 64, 4  # the scenario's 2 layers, 64 tokens at page size 16
REQUESTS = 4  # the scenario's


BACKENDS = ("nixl", "mooncake")


@pytest.fixture(scope="module")
def runs() -> dict:
    if not E2E_PYTHON.exists():
        pytest.fail(
            f"{E2E_PYTHON} is missing: Mooncake's engine is installed there "
            "(make venv-e2e; make test builds it)"
        )
    flag = {"SGLANG_KVMEM": "1", "SGLANG_KVMEM_TRANSFER": "kvmem"}
    children = {
        "nixl": Child(
            script=SCRIPT,
            cwd=ROOT,
            fork=fork_server(),
            env=child_env(
                flag | {"KVMEM_TEST_BACKEND": "nixl"},
                drop=("SGLANG_KVMEM", "KVMEM_TEST_BACKEND"),
                paths=[ADAPTER],
            ),
        ),
        "mooncake": Child(
            script=SCRIPT,
            cwd=ROOT,
            python=str(E2E_PYTHON),
            fork=e2e_fork_server(),
            env=e2e_env(flag | {"KVMEM_TEST_BACKEND": "mooncake"}, drop=("KVMEM_TEST_BACKEND",)),
        ),
    }
    out = {key: reply.value for key, reply in run_children(children, timeout=900).items()}
    assert all(out[b]["kvmem_path"] for b in BACKENDS)
    return out


def _all_success(r: dict) -> bool:
    return all(_all(states, SUCCESS) for states in r["prefill"] + r["decode"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_unequal_tp_lands_each_rank_heads_in_every_row(runs, backend):
    r = runs[backend]["2x1"]
    assert len(r["prefill"]) == 2 and len(r["decode"]) == 1, r
    assert _all_success(r) and r["bad_rows"] == 0, r
    # sglang's slice send: one descriptor (slice) per token, plane and prefill rank
    assert r["descriptors"] == TOKENS * PLANES * 2, r
    assert r["stats"].get("sends", 0) == 0, r["stats"]
    # rank 0's chunks (one a request) on Mooncake go through the flag's slice send
    want = REQUESTS if backend == "mooncake" else 0
    assert r["stats"].get("slice_sends", 0) == want, r["stats"]
    if backend == "mooncake":
        assert r["stats"]["slices"] == TOKENS * PLANES * REQUESTS, r["stats"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_equal_tp_sends_each_rank_on_kvmem_path(runs, backend):
    r = runs[backend]["2x2"]
    assert len(r["prefill"]) == 2 and len(r["decode"]) == 2 and r["kvmem_pool"], r
    assert _all_success(r) and r["bad_rows"] == 0, r
    assert r["stats"]["sends"] > 0 and r["stats"]["fallbacks"] == 0, r["stats"]
    assert r["descriptors"] < PAGES * PLANES * 2, r
