"""release/resume_memory_occupation(kv_cache) through sglang's real
SchedulerWeightUpdaterManager: with the flag on the KV pool's memory really goes back
(resident bytes and the process's RSS drop), every address stays, the epoch moves, and
the pool serves a batch again after the resume.  With the flag off and no
torch_memory_saver, stock sglang keeps the memory."""

from __future__ import annotations

from tests.sglang.sglang_env import result_of, run_script

SCRIPT = """
import torch
from sglang.srt.managers.io_struct import (ReleaseMemoryOccupationReqInput,
                                           ResumeMemoryOccupationReqInput)
from tests.sglang.sglang_env import (alloc_scenario, build_pools, emit, publish, rss_anon,
                                     weight_updater)
from kvmem_sglang.kvpool import pool_of
publish(16)
# 64 layers x 2 x 2048 x 8 heads x 128 x 2 B = 1 GiB ... keep it at 256 MiB
req_pool, kv, alloc, tree = build_pools(page_size=16, size=16 * 1023, layers=8, heads=8,
                                        head_dim=128)
for b in kv.k_buffer + kv.v_buffer:
    b.fill_(1)  # touch every page, as a served batch would
ptrs = [b.data_ptr() for b in kv.k_buffer + kv.v_buffer]
pool = pool_of(kv)
m = weight_updater(req_pool, alloc, tree)
out = {"rss_before": rss_anon(), "pool": pool is not None}
if pool is not None:
    out["resident_before"], out["epoch_before"] = pool.resident_bytes(), pool.epoch
m.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=["kv_cache"]))
out["rss_released"] = rss_anon()
if pool is not None:
    out["resident_released"], out["released"] = pool.resident_bytes(), pool.released
m.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=["kv_cache"]))
out["ptrs_kept"] = ptrs == [b.data_ptr() for b in kv.k_buffer + kv.v_buffer]
if pool is not None:
    out["epoch_after"], out["released_after"] = pool.epoch, pool.released
out["free_after"] = int(alloc.available_size())
# the pool serves again: write and read back through sglang's own views
kv.k_buffer[3][16:32].fill_(7)
out["usable"] = bool((kv.k_buffer[3][16:32] == 7).all())
out["kv_bytes"] = sum(b.numel() * b.element_size() for b in kv.k_buffer + kv.v_buffer)
emit(out)
"""


def test_release_gives_memory_back_and_resume_keeps_addresses():
    on = result_of(run_script(SCRIPT, kvmem=True))
    off = result_of(run_script(SCRIPT, kvmem=False))
    kv = on["kv_bytes"]
    assert on["pool"] and not off["pool"]
    assert on["resident_before"] >= kv and on["resident_released"] == 0 and on["released"]
    assert on["rss_before"] - on["rss_released"] >= 0.9 * kv, (
        f"RSS dropped by {on['rss_before'] - on['rss_released']} of {kv} KV bytes"
    )
    assert on["ptrs_kept"] and on["epoch_after"] == on["epoch_before"] + 1
    assert not on["released_after"] and on["usable"]
    assert on["free_after"] == 16 * 1023
    # stock sglang with no torch_memory_saver keeps every byte
    assert off["rss_before"] - off["rss_released"] < 0.1 * kv
    assert off["ptrs_kept"] and off["usable"]
    print(
        f"KV {kv / 2**20:.0f} MiB; RSS drop on release: kvmem "
        f"{(on['rss_before'] - on['rss_released']) / 2**20:.0f} MiB, stock "
        f"{(off['rss_before'] - off['rss_released']) / 2**20:.0f} MiB"
    )


FRESH = """
from tests.sglang.sglang_env import build_pools, emit, publish
from kvmem_sglang.kvpool import pool_of
publish(16)
req_pool, kv, alloc, tree = build_pools(page_size=16, size=16 * 255, layers=4, heads=8,
                                        head_dim=128)
pool = pool_of(kv)
emit({"resident": pool.resident_bytes(), "nbytes": pool.nbytes,
      "zeros": all(bool((b == 0).all()) for b in kv.k_buffer + kv.v_buffer)})
"""


def test_a_fresh_host_pool_is_backed_when_made_unless_prefault_is_off():
    # sglang's torch.zeros buffers are backed when they are made; with
    # SGLANG_KVMEM_PREFAULT=1 (the default) so is kvmem's pool, else pages wait for
    # their first touch (the first forward, the first KV transfer into the pool)
    on = result_of(run_script(FRESH, kvmem=True, env={"SGLANG_KVMEM_BACKEND": "host"}))
    lazy = result_of(
        run_script(
            FRESH, kvmem=True, env={"SGLANG_KVMEM_BACKEND": "host", "SGLANG_KVMEM_PREFAULT": "0"}
        )
    )
    assert on["resident"] >= on["nbytes"] and on["zeros"], on
    assert lazy["resident"] <= 0.05 * lazy["nbytes"], lazy


PLAIN = """
import torch
from sglang.srt.managers.io_struct import (ReleaseMemoryOccupationReqInput,
                                           ResumeMemoryOccupationReqInput)
from tests.sglang.sglang_env import build_pools, emit, publish, weight_updater
from kvmem_sglang import prefill
from kvmem_sglang.kvpool import pool_of
publish(16)
req_pool, kv, alloc, tree = build_pools(page_size=16, size=16 * 63, layers=2, heads=2,
                                        head_dim=32)
slots = alloc.alloc(32)
m = weight_updater(req_pool, alloc, tree)
out = m.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=["kv_cache"]))
emit({"backend": pool_of(kv).backend, "answer": type(out).__name__,
      "offload_tags": sorted(m.offload_tags), "free": int(alloc.available_size()),
      "refused": prefill.STATS.refused_releases})
"""


def test_plain_backend_refuses_a_release_and_changes_nothing():
    """SGLANG_KVMEM_BACKEND=plain (one ordinary allocation) cannot give its memory back:
    a kv_cache release is refused before sglang's part runs (no flush, no tag recorded),
    with a log line naming the setting, instead of a NotImplementedError raised into the
    scheduler loop after sglang had already released."""
    proc = run_script(PLAIN, kvmem=True, env={"SGLANG_KVMEM_BACKEND": "plain"})
    got = result_of(proc)
    assert got == {
        "backend": "plain",
        "answer": "ReleaseMemoryOccupationReqOutput",
        "offload_tags": [],
        "free": 16 * 63 - 32,
        "refused": 1,
    }, got
    assert "SGLANG_KVMEM_BACKEND=plain" in proc.stderr and "nothing changed" in proc.stderr
