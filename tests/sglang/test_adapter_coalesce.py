"""``kvpool.coalesce`` (what ``SGLANG_KVMEM_REGISTER=regions`` hands
NIXL) on real sglang pools backed by kvmem pools of several physical chunks (the suite's
``KVMEM_CHUNK_BYTES``): each of sglang's per-layer ranges lies inside one chunk, so it is
replaced by that chunk's region, and a range across two chunks is refused instead of being
"covered by both" (NIXL refuses a descriptor across two registrations)."""

from __future__ import annotations

import pytest

from tests.sglang.sglang_env import result_of, run_script

SCRIPT = """
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from tests.sglang.sglang_env import emit, publish
from kvmem_sglang.kvpool import coalesce, pool_of
from kvmem_sglang.options import AdapterError
publish(16)

out = {}
mha = MHATokenToKVPool(16 * 64, page_size=16, layer_num=5, device="cpu", dtype=torch.bfloat16,
                       head_num=4, head_dim=64, enable_memory_saver=False)
mla = MLATokenToKVPool(16 * 64, page_size=16, dtype=torch.bfloat16, kv_lora_rank=512,
                       qk_rope_head_dim=64, layer_num=4, device="cpu", enable_memory_saver=False)
aux = torch.zeros(4096, dtype=torch.uint8)
for name, kv in (("mha", mha), ("mla", mla)):
    pool = pool_of(kv)
    ptrs, lens, _ = kv.get_contiguous_buf_infos()
    regions = pool.regions()
    a = aux.data_ptr()  # outside every pool: kept once; a zero-length range is dropped
    got = coalesce(list(ptrs) + [a, a, a + 8], list(lens) + [aux.numel(), aux.numel(), 0])
    (r0, n0), (r1, n1) = regions[:2]
    try:
        coalesce([r0 + n0 - 64], [r1 - (r0 + n0) + 128])  # from chunk 0 into chunk 1
        refused = None
    except AdapterError as e:
        refused = str(e)
    out[name] = {"regions": [list(r) for r in regions],
                 "got": [list(x) for x in zip(*got)],
                 "ranges": [[p, n] for p, n in zip(ptrs, lens)],
                 "aux": [aux.data_ptr(), aux.numel()], "refused": refused}
emit(out)
"""


@pytest.fixture(scope="module")
def result():
    return result_of(run_script(SCRIPT, kvmem=True))


@pytest.mark.parametrize("name", ["mha", "mla"])
def test_per_layer_ranges_become_their_chunks_regions(result, name):
    r = result[name]
    regions, got = r["regions"], r["got"]
    assert len(regions) >= 2, "the pool must span several chunks for this test to mean anything"
    for p, n in r["ranges"]:  # each sglang range lies inside exactly one region
        assert sum(a <= p and p + n <= a + m for a, m in regions) == 1, (p, n)
    assert got[:-1] == sorted(regions) and got[-1] == r["aux"]  # once each, aux kept


@pytest.mark.parametrize("name", ["mha", "mla"])
def test_a_range_across_two_chunks_is_refused(result, name):
    msg = result[name]["refused"]
    assert msg is not None and "is not inside one kvmem pool region" in msg
    assert "NIXL would refuse" in msg
