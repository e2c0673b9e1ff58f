"""On a real NIXL agent (UCX, DRAM): sglang 0.5.23's ``NixlKVManager`` has
no ``deregister_buffer_to_engine``, so every release/resume of the KV cache registers the
buffers once more; with the flag on, the release deregisters what was registered (KV, aux,
state) and the resume registers it once.  ``scenario_prefill_nixl.py`` drives 20
release/resume cycles through sglang's ``SchedulerWeightUpdaterManager`` on a real prefill
scheduler, one process per flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang.sglang_env import run_both

SCRIPT = Path(__file__).parent / "scenario_prefill_nixl.py"


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    """{"off": stock's report, "on": kvmem's}; both processes run at once."""
    out = run_both(SCRIPT, timeout=180)
    return out


def test_registrations_do_not_grow_over_20_cycles(runs):
    off, on = runs["off"], runs["on"]
    n_off, n_on = off["first"]["live_entries"], on["first"]["live_entries"]
    print(
        f"live NIXL registrations (entries) after each of 20 release/resume cycles: "
        f"stock {off['live_per_cycle']}, kvmem {on['live_per_cycle']}"
    )
    # stock: never deregisters; one more full registration per resume
    assert off["calls"]["deregister"] == 0
    assert off["live_per_cycle"] == [n_off * (c + 2) for c in range(20)], off["live_per_cycle"]
    # kvmem: deregistered at every release, registered once at every resume
    assert on["live_per_cycle"] == [n_on] * 20
    assert on["calls"]["deregister"] == on["calls"]["register"] - on["first"]["lists"]
    assert on["while_released"]["live_entries"] == 0
    assert off["while_released"]["live_entries"] == n_off
    for run in (off, on):
        assert run["after_answer"] == ["ok", 200]
        assert run["held_after"] == {"kv_tokens": 0, "req_slots": 0, "meta_slots": 0}


def test_writes_while_released(runs):
    """A peer that loads the prefill agent's metadata while the KV is released cannot
    write into it with the flag on (nothing is registered); stock keeps it registered.
    A peer holding metadata from before the release still writes on both (NIXL's
    deregistration revokes nothing already loaded, as docs/transfer.md records), which is why
    the adapter also refuses, before posting, chunk sends set up before the release
    (test_prefill_inputs)."""
    off, on = runs["off"]["while_released"], runs["on"]["while_released"]
    print(f"writes while released: stock {off}, kvmem {on}")
    assert on["write_new_metadata"]["state"] == "REFUSED", on
    assert off["write_new_metadata"]["state"] == "DONE", off
    assert off["write_old_metadata"]["state"] == "DONE"
