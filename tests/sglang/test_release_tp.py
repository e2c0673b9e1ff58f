"""Release and resume at TP 2 when one rank refuses: every rank takes the same decision.

sglang 0.5.23 broadcasts ``release_memory_occupation`` / ``resume_memory_occupation`` to
every TP rank and answers the client with rank 0's reply.  Before the fix each rank
refused on its own: with one rank's Mooncake deregistration refused, the other rank
released its KV cache (and refused requests) while this one kept serving, and the group's
next collective was entered by one rank only.  Now a refusal on any rank is every rank's,
and each rank puts back what it had changed (the kvmem_sglang.agree module docstring).

Two processes, one per TP rank of a PD prefill, in one gloo group, each sglang's real
scheduler parts and weight updater over a kvmem pool registered with Mooncake's real
transfer engine (tests/sglang/scenario_release_tp.py, in ``.venv-e2e``, which has the
engine); the engine refuses through the end-to-end tier's faults, armed on one rank.
"""

from __future__ import annotations

import pytest

from testkit.child import Child, run_children
from testkit.sglang_pair import E2E_PYTHON
from tests.sglang.sglang_env import ROOT, e2e_env, e2e_fork_server

SCRIPT = ROOT / "tests" / "sglang" / "scenario_release_tp.py"
KV = ["kv_cache"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Each rank's record of the steps (the scenario's docstring), rank 0 first, with
    its log (``stderr``)."""
    if not E2E_PYTHON.exists():
        pytest.fail(
            f"{E2E_PYTHON} is missing: Mooncake's engine is installed there "
            "(make venv-e2e; make test builds it)"
        )
    d = tmp_path_factory.mktemp("release-tp")
    children = {
        rank: Child(
            script=SCRIPT,
            cwd=ROOT,
            python=str(E2E_PYTHON),
            fork=e2e_fork_server(),
            env=e2e_env(
                {
                    "KVMEM_TEST_RANK": str(rank),
                    "KVMEM_TEST_STORE": str(d / "store"),
                    "KVMEM_E2E_FAULTS": str(d / f"faults-{rank}"),
                }
            ),
        )
        for rank in (0, 1)
    }
    replies = run_children(children, timeout=300)
    return [replies[r].value | {"stderr": replies[r].stderr} for r in (0, 1)]


def _state(rank: dict, step: str) -> tuple:
    """What must be the same on every rank after ``step``: the tags released, whether
    the pool is released, whether the manager is deregistered."""
    s = rank[step]
    return s["tags"], s["pool_released"], s["deregistered"]


def _fired(rank: dict, step: str, before: str) -> list[str]:
    """The faults that fired on ``rank`` during ``step`` (its notes since ``before``)."""
    return [n.split()[0] for n in rank[step]["fired"][len(rank[before]["fired"]) :]]


def test_a_release_refused_by_one_ranks_engine_is_refused_on_every_rank(ranks):
    """Rank 1's engine refuses a region's deregistration (-3): rank 0 had deregistered
    already and registers again, neither releases anything, and both still serve (the
    pool resident, registered).  Before the fix rank 0 released alone."""
    r0, r1 = ranks
    assert _fired(r1, "release_refused", "start") == ["fault:deregister-missing"]
    assert _fired(r0, "release_refused", "start") == []
    for r in ranks:
        assert _state(r, "release_refused") == ([], False, False), r["release_refused"]
        assert r["release_refused"]["resident"] >= r["pool_bytes"]
        assert r["release_refused"]["refused"][0] == 1
        assert r["release_refused"]["in_step"] == 2
    assert "refused on all 2 TP ranks, by TP rank 1: Mooncake deregistration" in r0["stderr"]
    # the next release and resume go through on both
    for r in ranks:
        assert _state(r, "release") == (KV, True, True)
        assert r["release"]["resident"] == 0
        assert _state(r, "resume") == ([], False, False)


def test_a_resume_refused_by_rank_0s_engine_keeps_the_kv_cache_released_everywhere(ranks):
    """Rank 0's engine refuses the registration (-7): rank 1, registered already,
    deregisters again and gives its memory back, so both stay released; the next resume
    goes through on both.  Before the fix rank 1 resumed alone."""
    r0, r1 = ranks
    assert _fired(r0, "resume_refused", "release_again") == ["fault:register-overlap"]
    for r in ranks:
        assert _state(r, "release_again") == (KV, True, True)
        assert _state(r, "resume_refused") == (KV, True, True), r["resume_refused"]
        assert r["resume_refused"]["resident"] == 0
        assert r["resume_refused"]["refused"][1] == 1
        assert r["resume_refused"]["in_step"] == 2
    assert "refused on all 2 TP ranks, by TP rank 0: Mooncake batch_register" in r1["stderr"]
    assert "the KV cache stays released" in r1["stderr"]


def test_a_drain_that_raises_on_one_rank_refuses_the_release_on_every_rank(ranks):
    for r in ranks:
        assert _state(r, "drain_refused") == ([], False, False), r["drain_refused"]
        assert r["drain_refused"]["in_step"] == 2
    assert (
        "refused on all 2 TP ranks, by TP rank 1: answering the requests in flight raised "
        "RuntimeError: planted: sglang's drain path raised (its traceback in the log of "
        "Prefill server (TP rank 1))" in ranks[0]["stderr"]
    )


def test_a_refused_deregistration_after_a_refused_resume_keeps_that_ranks_memory(ranks):
    """Rank 1's registration is refused and rank 0's engine then refuses the
    deregistration that would undo its own: rank 0 keeps its memory and its registration
    but refuses requests as rank 1 does (both hold the KV cache released); the next
    resume registers nothing twice on rank 0 and serves on both."""
    r0, r1 = ranks
    assert _fired(r1, "resume_kept", "release_for_kept") == ["fault:register-overlap"]
    assert _fired(r0, "resume_kept", "release_for_kept") == ["fault:deregister-missing"]
    assert _state(r1, "resume_kept") == (KV, True, True)
    assert _state(r0, "resume_kept") == (KV, False, False)  # registered, memory kept
    assert r0["resume_kept"]["resident"] >= r0["pool_bytes"]
    for r in ranks:
        assert _state(r, "resume_after") == ([], False, False), r["resume_after"]
        assert r["resume_after"]["resident"] >= r["pool_bytes"]
        assert _state(r, "release_last") == (KV, True, True)
        assert _state(r, "resume_last") == ([], False, False)
        assert r["resume_last"]["in_step"] == 2
    assert "deregistering the KV cache after a refused resume failed" in r0["stderr"]
