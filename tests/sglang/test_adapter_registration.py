"""NIXL registrations of sglang's KV buffers, stock (``SGLANG_KVMEM=0``) and on kvmem
(``SGLANG_KVMEM=1``), counted on a real NIXL agent (UCX, DRAM).

Each flag runs ``scripts/nixl_registration.py`` in a process of its own (sglang's hooks
cannot be undone in-process; the plugin is loaded by sglang's ``load_plugins()``).  There
sglang's real ``NixlKVManager.register_buffer_to_engine`` registers a real CPU
``MHATokenToKVPool``; a spy on the agent's bound ``register_memory`` /
``deregister_memory`` counts the descriptors; the KV memory is then released and resumed
through sglang's ``SchedulerWeightUpdaterManager`` (tag ``kv_cache``), whose prefill queue
registers again.  A second agent WRITEs into the pool after each registration: NIXL
refuses a target outside registered memory, so a landed write proves coverage.

The target: after a release and a resume, at most ``len(pool.regions())``
registrations, against 2 x layers for stock sglang.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.sglang.sglang_env import run_both

SCRIPT = Path(__file__).parent / "scripts" / "nixl_registration.py"


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    """{"off": stock's report, "on": kvmem's}; both processes run at once."""
    out = run_both(SCRIPT, timeout=120)
    return out


def test_stock_registers_one_entry_per_layer_and_kv(runs):
    off = runs["off"]
    assert not off["kvmem_pool"], "flag off: sglang's buffers must stay its own"
    layers = off["layers"]
    for when in ("first", "after_resume"):
        reg = off[when]
        assert reg["kv_entries"] == reg["kv_descs"] == 2 * layers, (
            f"stock sglang ({when}): {reg['kv_entries']} KV entries registered on NIXL, "
            f"expected 2 x {layers} layers"
        )
        assert reg["kv_ranges"] == off["per_layer_ranges"]


def test_kvmem_registers_the_pool_regions(runs):
    on, off = runs["on"], runs["off"]
    assert on["kvmem_pool"], "flag on: sglang's buffers are not views of a kvmem pool"
    regions, first = on["regions"], on["first"]
    counts = (
        f"NIXL KV registrations: stock {off['first']['kv_entries']} "
        f"(2 x {off['layers']} layers), kvmem {first['kv_entries']} "
        f"(pool regions {len(regions)})"
    )
    print(counts)
    assert first["kv_entries"] == first["kv_descs"] <= len(regions), counts
    assert first["kv_entries"] < off["first"]["kv_entries"], counts
    assert sorted(first["kv_ranges"]) == sorted(regions), (
        f"registered {first['kv_ranges']}, the pool's regions are {regions}"
    )
    assert first["kv_args_per_layer"], (
        "kv_args.kv_data_ptrs/lens were not put back: transfers must still address each layer"
    )


def test_after_release_and_resume_kvmem_registers_the_regions_again(runs):
    on, off = runs["on"], runs["off"]
    regions, again = on["regions"], on["after_resume"]
    counts = (
        f"after release + resume, NIXL KV registrations: stock "
        f"{off['after_resume']['kv_entries']}, kvmem {again['kv_entries']} "
        f"(pool regions {len(regions)})"
    )
    print(counts)
    assert again["kv_entries"] == again["kv_descs"] <= len(regions), counts
    assert sorted(again["kv_ranges"]) == sorted(regions), counts
    assert again["kv_args_per_layer"]
    # the release and resume were kvmem's, physically: memory gone, then back at the
    # same addresses, epoch + 1
    before, released, resumed = on["pool_before"], on["pool_released"], on["pool_resumed"]
    assert before["resident"] == before["nbytes"] > 0
    assert released == {"released": True, "resident": 0}, released
    assert resumed["released"] is False and resumed["epoch"] == before["epoch"] + 1
    assert resumed["resident"] == before["nbytes"]  # SGLANG_KVMEM_PREFAULT=1, the default
    assert again["ptrs_kept"], "a K/V buffer moved across release/resume"
    assert on["device_syncs"] == 1  # sglang's release ran to its end


@pytest.mark.parametrize("when", ["first", "after_resume"])
def test_writes_land_in_per_layer_buffers_covered_by_regions(runs, when):
    """kvmem: a peer's writes into layer 0's K, the last layer's V, and across layer 0's
    K into its V all land.  Stock: the per-buffer writes land, the one across K and V is
    refused (no single registration covers it), which shows NIXL checks coverage."""
    for rec in runs["on"][when]["writes"]:
        assert (rec["state"], rec.get("landed")) == ("DONE", True), rec
    stock = {r["where"]: r for r in runs["off"][when]["writes"]}
    for where, rec in stock.items():
        if where.endswith("into-V"):
            assert rec["state"] == "REFUSED", rec
        else:
            assert (rec["state"], rec.get("landed")) == ("DONE", True), rec


def test_no_registration_of_the_pool_outlives_a_release(runs):
    """kvmem releases the pool's memory right after sglang's release: NIXL must not hold
    it registered then (on an RDMA NIC a live registration pins the old pages, and a
    peer's write lands in them instead of the resumed memory), nor hold two
    registrations of it after the resume.  sglang 0.5.23's NixlKVManager has no
    ``deregister_buffer_to_engine`` (the prefill queue's release calls it when present),
    so stock sglang keeps every registration and adds 2 x layers at each resume.

    Probe on NIXL itself: after the resume, drop the registration the resume made; a
    write into the pool must then be refused."""
    on, off = runs["on"], runs["off"]
    regions, again = on["regions"], on["after_resume"]
    print(
        f"live NIXL KV registrations after release + resume: stock "
        f"{off['after_resume']['live_kv_entries']}, kvmem {again['live_kv_entries']} "
        f"(pool regions {len(regions)})"
    )
    assert again["live_kv_at_release"] == [0], (
        f"{again['live_kv_at_release'][0]} KV registration(s) still live on NIXL when "
        "kvmem released the pool's memory (NixlKVManager has no "
        "deregister_buffer_to_engine; the adapter must add one)"
    )
    assert again["live_kv_entries"] <= len(regions), (
        f"{again['live_kv_entries']} live KV registrations after release + resume, the "
        f"pool has {len(regions)} region(s)"
    )
    probe = again["write_after_dropping_current"]
    assert probe["state"] == "REFUSED", (
        f"a write into the pool still landed after the current registration was dropped: "
        f"a registration from before the release is live ({probe})"
    )
