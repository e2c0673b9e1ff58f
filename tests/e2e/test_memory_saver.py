"""The flag beside ``--enable-memory-saver``: kvmem owns the KV pool, torch_memory_saver
keeps the rest (weights, CUDA graphs, and the request-to-token table sglang also tags
``kv_cache``).

sglang allocates its KV buffers inside ``memory_saver_adapter.region("kv_cache")``
(``srt/mem_cache/memory_pool.py:2581``), so that torch_memory_saver (TMS) pauses them at a
release.  With the flag the adapter replaces that allocation (``_create_buffers_normal``):
the KV pool is kvmem's, made outside TMS's region, and released by kvmem's hook after
sglang's release (which still pauses what TMS holds under the tag).  Nothing is
allocated twice and nothing is paused by both.

On this CPU host TMS imports but cannot run (its region needs its LD_PRELOAD hook, which
needs ``libcuda.so.1``), which makes the split visible: stock sglang cannot even build a
KV pool with the memory saver on (TMS refuses), while with the flag the KV pool is built
without TMS.  The GPU run is a step of bench/gpu_check.sh, which needs sglang there.
"""

from __future__ import annotations

import pytest

from tests.sglang.sglang_env import result_of, run_script

SCRIPT = """
import torch
from tests.sglang.sglang_env import emit, publish
publish(16, enable_memory_saver=True)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
try:
    p = MHATokenToKVPool(16 * 40, page_size=16, layer_num=2, device="cpu",
                         enable_memory_saver=True, dtype=torch.bfloat16, head_num=2,
                         head_dim=32)
except Exception as e:
    emit({"built": False, "error": f"{type(e).__name__}: {e}"[:300]})
else:
    from kvmem_sglang.kvpool import pool_of
    emit({"built": True, "kvmem": pool_of(p) is not None,
          "saver": type(p.memory_saver_adapter).__name__})
"""


@pytest.fixture(scope="module")
def runs():
    return {flag: result_of(run_script(SCRIPT, kvmem=flag)) for flag in (False, True)}


def test_stock_kv_pool_goes_through_torch_memory_saver(runs):
    stock = runs[False]
    assert not stock["built"] and "LD_PRELOAD" in stock["error"], stock


def test_flag_kv_pool_is_kvmem_not_torch_memory_saver(runs):
    ours = runs[True]
    assert ours == {"built": True, "kvmem": True, "saver": "_TorchMemorySaverAdapterReal"}, ours
