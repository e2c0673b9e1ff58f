"""A decode's new registration after a release and a resume of its KV cache
(``kvmem_sglang.registrations.resend``), sent to two prefill ranks of which the first send
to one fails, with the flag on: a real sglang decode ``NixlKVManager`` (NIXL/UCX on DRAM)
and sglang's own send to a prefill rank (``CommonKVReceiver._connect_to_bootstrap_server``,
ZMQ), each rank a ZMQ socket where its bootstrap thread would listen;
``scripts/decode_resend.py`` has the setting.

What must hold: the registration call returns without waiting for the sends; each rank
ends with the decode's new registration, the one whose first send failed after a wait
(tried again, not given up after one failure), each once; every failed try is logged with
its rank and when the next comes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang.sglang_env import run_both

SCRIPT = Path(__file__).parent / "scripts" / "decode_resend.py"


@pytest.fixture(scope="module")
def run() -> dict:
    return run_both(SCRIPT, timeout=240, variants={"on": {"SGLANG_KVMEM": "1"}})["on"]


def test_a_rank_whose_first_send_failed_ends_with_the_new_registration(run):
    got = run["got"]
    for rank in ("a", "b"):
        assert len(got[rank]) == 1 and run["extra"][rank] == 0, (rank, run)
        msg = got[rank][0]
        assert msg["new"] and msg["kv_ptrs"], (rank, msg)  # the decode's registration now
    assert run["refused_left"] == 0  # b's first send did fail
    assert got["b"][0]["after_s"] >= run["first_s"] > got["a"][0]["after_s"], got  # tried again


def test_the_sends_leave_the_resume_at_once_and_each_failure_is_logged(run):
    assert run["register_s"] < run["first_s"], run["register_s"]
    port = run["ports"]["b"]
    failed = [line for line in run["lines"] if "failed (try" in line]
    assert len(failed) == 1 and f"prefill rank 127.0.0.1:{port} failed (try 1 of" in failed[0]
    assert "again in" in failed[0], failed
    assert any("new registration sent to 2 of 2 prefill rank(s)" in x for x in run["lines"])
