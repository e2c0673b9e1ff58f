"""GPU: the adapter beside ``--enable-memory-saver`` (tests/e2e/test_memory_saver.py is
the CPU half).  With SGLANG_KVMEM=1 and torch_memory_saver (TMS) active in its preload
mode, sglang's KV pool is kvmem's (CUDA VMM, outside TMS's region) and TMS keeps what
sglang tags ``kv_cache`` besides it (the request-to-token table); a release through
sglang's real SchedulerWeightUpdaterManager gives back both (kvmem's pool and TMS's
part: the device's free memory rises by at least the pool), a resume maps both back
and the pool serves again.  Runs where sglang and torch_memory_saver import (not the
bare H200 image: bench/gpu_check.sh skips it there with that reason)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from testkit.child import Child, json_of, run

torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.memory_pool")
tms = pytest.importorskip("torch_memory_saver")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, torch
from sglang.srt.managers.io_struct import (ReleaseMemoryOccupationReqInput,
                                           ResumeMemoryOccupationReqInput)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.utils.torch_memory_saver_adapter import TorchMemorySaverAdapter
from tests.sglang.sglang_env import publish, weight_updater
from kvmem_sglang.kvpool import pool_of
publish(16, device="cuda", enable_memory_saver=True)
req_pool = ReqToTokenPool(size=64, max_context_len=4096, device="cuda",
                          enable_memory_saver=True)
kv = MHATokenToKVPool(16 * 65535, page_size=16, dtype=torch.bfloat16, head_num=8,
                      head_dim=128, layer_num=8, device="cuda", enable_memory_saver=True)
pool = pool_of(kv)
class _Alloc:  # the release flushes the allocator; these tests need only its clear()
    def clear(self): pass
class _Tree:
    def reset(self): pass
m = weight_updater(req_pool, _Alloc(), _Tree())
m.memory_saver_adapter = TorchMemorySaverAdapter.create(enable=True)
torch.cuda.synchronize()
free0 = torch.cuda.mem_get_info()[0]
m.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=["kv_cache"]))
torch.cuda.synchronize()
free1 = torch.cuda.mem_get_info()[0]
m.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=["kv_cache"]))
kv.k_buffer[3][16:32].fill_(7)
torch.cuda.synchronize()
print(json.dumps({"kvmem": pool is not None, "backend": pool.backend if pool else None,
                  "pool_bytes": pool.nbytes if pool else 0, "freed": free1 - free0,
                  "usable": bool((kv.k_buffer[3][16:32] == 7).all())}))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_release_gives_back_kvmem_pool_and_tms_part():
    env = dict(
        os.environ,
        SGLANG_KVMEM="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    with tms.configure_subprocess():  # TMS's preload hook (LD_PRELOAD) for the child
        env.update({k: v for k, v in os.environ.items() if k == "LD_PRELOAD"})
        proc = run(Child(code=SCRIPT, env=env, cwd=ROOT), timeout=240)  # fresh: TMS's preload
    got = json_of(proc, "the memory saver script")
    assert got["kvmem"] and got["backend"] == "cuda_vmm" and got["usable"], got
    assert got["freed"] >= got["pool_bytes"], got
