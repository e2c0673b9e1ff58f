"""sglang's KV pools with the flag on are views of one kvmem pool in sglang's layout:
the same shapes, dtypes and strides as stock sglang's buffers, V reached from K's base
by the same block offset, MLA's latent buffers too; with the flag off the buffers are
sglang's own.  One process per flag."""

from __future__ import annotations

import pytest

from tests.sglang.sglang_env import result_of, run_script

SCRIPT = """
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from tests.sglang.sglang_env import emit, publish
from kvmem_sglang.kvpool import pool_of
publish(16)

def describe(bufs):
    return [[list(b.shape), list(b.stride()), str(b.dtype)] for b in bufs]

out = {}
cases = {
    "mha-bf16": dict(dtype=torch.bfloat16, head_num=4, head_dim=64),
    "mha-fp8": dict(dtype=torch.float8_e4m3fn, head_num=2, head_dim=128),
    "mha-v-narrower": dict(dtype=torch.float16, head_num=2, head_dim=96, v_head_dim=64),
}
for name, kw in cases.items():
    p = MHATokenToKVPool(16 * 40, page_size=16, layer_num=3, device="cpu",
                         enable_memory_saver=False, **kw)
    pool = pool_of(p)
    k0, v0 = p.k_buffer[0], p.v_buffer[0]
    out[name] = {
        "k": describe(p.k_buffer), "v": describe(p.v_buffer),
        "v_minus_k": v0.data_ptr() - k0.data_ptr(),
        "in_pool": pool is not None and all(
            any(a <= b.data_ptr() and b.data_ptr() + b.numel() * b.element_size() <= a + n
                for a, n in pool.regions()) for b in p.k_buffer + p.v_buffer),
        "regions": None if pool is None else len(pool.regions()),
        # each layer's K|V block inside one region (one physical chunk): sglang's kernels
        # reach V from K's base, and its transfers address page runs of each buffer
        "kv_one_region": pool is not None and all(
            sum(a <= k.data_ptr() and v.data_ptr() + v.numel() * v.element_size() <= a + n
                for a, n in pool.regions()) == 1 for k, v in zip(p.k_buffer, p.v_buffer)),
        "zeros": bool(all((b.view(torch.uint8) == 0).all() for b in p.k_buffer + p.v_buffer)),
        "buf_infos": len(p.get_contiguous_buf_infos()[0]),
    }
m = MLATokenToKVPool(16 * 40, page_size=16, dtype=torch.bfloat16, kv_lora_rank=512,
                     qk_rope_head_dim=64, layer_num=2, device="cpu", enable_memory_saver=False)
out["mla"] = {"kv": describe(m.kv_buffer), "in_pool": pool_of(m) is not None,
              "buf_infos": [list(x) for x in m.get_contiguous_buf_infos()[1:]]}
emit(out)
"""


@pytest.fixture(scope="module")
def both():
    return {flag: result_of(run_script(SCRIPT, kvmem=flag)) for flag in (False, True)}


@pytest.mark.parametrize("name", ["mha-bf16", "mha-fp8", "mha-v-narrower"])
def test_mha_views_match_stock_buffers(both, name):
    stock, ours = both[False][name], both[True][name]
    assert ours["k"] == stock["k"] and ours["v"] == stock["v"]
    assert ours["in_pool"] and not stock["in_pool"] and ours["kv_one_region"]
    assert 1 <= ours["regions"] <= 3  # one per physical chunk, never one per buffer
    assert ours["zeros"] and ours["buf_infos"] == stock["buf_infos"]
    rows, heads, dim = stock["k"][0][0]
    if name == "mha-bf16":  # K and V halves of one block in both: the same block offset
        item = 2
        assert stock["v_minus_k"] == ours["v_minus_k"] == rows * heads * dim * item


def test_mla_latent_buffers_match_stock(both):
    stock, ours = both[False]["mla"], both[True]["mla"]
    assert ours["kv"] == stock["kv"] and ours["buf_infos"] == stock["buf_infos"]
    assert ours["in_pool"] and not stock["in_pool"]
