"""A NIXL prefill with two decode peers, one of which cannot be prepared, across a release
and a resume of its KV registration (``kvmem_sglang.nixl.prepare_peers``), with the flag
on: real sglang ``NixlKVManager`` and ``KVArgsRegisterInfo``, real NIXL agents (UCX, DRAM);
``scripts/nixl_peers.py`` has the setting.

What must hold: the peer NIXL refuses to prepare is left with nothing prepared of its own
(no half-prepared peer) and its sends build descriptors per transfer; the other peer keeps
its prepared list over the new registration, and so does the local list every peer shares
(made by the failing peer's attempt); both writes land.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang.sglang_env import run_both

SCRIPT = Path(__file__).parent / "scripts" / "nixl_peers.py"


@pytest.fixture(scope="module")
def run() -> dict:
    return run_both(SCRIPT, timeout=240, variants={"on": {"SGLANG_KVMEM": "1"}})["on"]


def test_a_peer_that_cannot_be_prepared_leaves_the_others_prepared(run):
    for when in ("registered", "resumed"):
        lists = run[when]
        assert lists["shared"] == [""], (when, lists)  # made by decode-b's attempt, kept
        assert lists["peers"] == {"decode-b": [], "decode-a": ["kv"]}, (when, lists)
    assert run["released"] == {"shared": [], "peers": {"decode-b": [], "decode-a": []}}
    failed = "preparing NIXL transfer lists for decode peer {} after the resume failed"
    assert failed.format("decode-b") in run["stderr"], run["stderr"][-2000:]
    assert failed.format("decode-a") not in run["stderr"]


def test_each_peer_is_sent_to_on_its_own_path(run):
    a, b = run["writes"]["decode-a"], run["writes"]["decode-b"]
    assert a == {"calls": {"prepared": 1, "per_transfer": 0}, "state": "DONE", "landed": True}
    assert b == {"calls": {"prepared": 0, "per_transfer": 1}, "state": "DONE", "landed": True}
