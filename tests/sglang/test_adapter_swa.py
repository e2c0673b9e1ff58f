"""sglang's hybrid sliding-window KV cache (``SWAKVPool`` and
``SWATokenToKVPoolAllocator``) with the flag on, against stock in another process: the
pool's two inner pools are kvmem pools, released and resumed together; the composite
allocator is sglang's own over two kvmem allocators, and the scheduler's calls on it
(requests extended and decoded past the window, the window's tokens freed from the SWA
side, requests freed, free groups) give the same full slots, the same full-to-SWA
mapping and the same free counts on both sides as on stock sglang, at page size 1, 16
and 64.  One process per flag (kvmem_sglang.swa)."""

from __future__ import annotations

import pytest

from tests.sglang.sglang_env import result_of, run_script

SCRIPT = """
import torch
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from tests.sglang.sglang_env import emit, publish, build_pools
PS = {ps}
WINDOW = 2 * PS  # tokens kept on the SWA side behind each request's end
publish(PS)
kv = SWAKVPool(size=64 * PS, size_swa=24 * PS, page_size=PS, dtype=torch.bfloat16,
               head_num=2, head_dim=16, swa_attention_layer_ids=[0],
               full_attention_layer_ids=[1], device="cpu")
_, kv, alloc, _ = build_pools(page_size=PS, size=64 * PS, kv=kv)
out = {{"types": [type(alloc).__name__, type(alloc.full_attn_allocator).__name__,
                  type(alloc.swa_attn_allocator).__name__], "calls": []}}

def note(what, slots=None):
    rec = {{"what": what, "full": alloc.full_available_size(),
            "swa": alloc.swa_available_size()}}
    if slots is not None:
        rec["slots"] = slots.tolist()
        rec["swa_slots"] = alloc.translate_loc_from_full_to_swa(slots.long()).tolist()
    out["calls"].append(rec)

rows, freed_swa = [], []  # each request's full slots; how many of them left the SWA side

def extend(idx, lens):
    pre = torch.tensor([len(rows[i]) if i < len(rows) else 0 for i in idx], dtype=torch.int64)
    seq = pre + torch.tensor(lens, dtype=torch.int64)
    if PS == 1:
        got = alloc.alloc(sum(lens))
    else:
        last = torch.tensor([int(rows[i][-1]) if i < len(rows) and len(rows[i]) else -1
                             for i in idx], dtype=torch.int64)
        got = alloc.alloc_extend(pre, pre.clone(), seq, seq.clone(), last, sum(lens))
    note(f"extend {{idx}} {{lens}}", got)
    for i, part in zip(idx, torch.split(got, lens)):
        if i < len(rows):
            rows[i] = torch.cat((rows[i], part))
        else:
            rows.append(part)
            freed_swa.append(0)

def decode(idx):
    if PS == 1:
        got = alloc.alloc(len(idx))
    else:
        seq = torch.tensor([len(rows[i]) + 1 for i in idx], dtype=torch.int64)
        last = torch.tensor([int(rows[i][-1]) for i in idx], dtype=torch.int64)
        got = alloc.alloc_decode(seq, seq.clone(), last)
    note(f"decode {{idx}}", got)
    for i, s in zip(idx, got):
        rows[i] = torch.cat((rows[i], s.view(1)))

def slide(i):
    # what sglang's scheduler does for a request past its window: the whole pages
    # behind it leave the SWA side (free_swa), their full slots stay
    keep_from = ((len(rows[i]) - WINDOW) // PS) * PS
    if keep_from > freed_swa[i]:
        alloc.free_swa(rows[i][freed_swa[i]:keep_from].long())
        freed_swa[i] = keep_from
        note(f"slide {{i}}")

def finish(i):
    # the request's end: the SWA side of what is left, then every full slot
    alloc.free_swa(rows[i][freed_swa[i]:].long())
    alloc.free_full(rows[i].long())
    rows[i] = rows[i][:0]
    note(f"finish {{i}}")

extend([0, 1, 2], [3 * PS + 1, 2 * PS, 5])
for step in range(2 * PS + 3):
    decode([0, 1, 2])
    if step % PS == PS - 1:
        for i in range(3):
            slide(i)
extend([3], [4 * PS])
alloc.free_group_begin()
finish(1)
finish(0)
alloc.free_group_end()
note("group end")
extend([4, 5], [PS + 3, 3 * PS])
for step in range(PS + 1):
    decode([2, 3, 4, 5])
for i in (2, 3, 4, 5):
    slide(i)
if PS == 1:
    out["too_big"] = alloc.alloc(10 ** 6) is None
    note("too big")
for i in (3, 2, 5, 4):
    finish(i)
out["end"] = [alloc.full_available_size(), alloc.swa_available_size(), alloc.size_full,
              alloc.size_swa]
alloc.clear()
note("clear")
emit(out)
"""


@pytest.fixture(scope="module", params=[1, 16, 64], ids=["P1", "P16", "P64"])
def both(request):
    code = SCRIPT.format(ps=request.param)
    return {flag: result_of(run_script(code, kvmem=flag)) for flag in (False, True)}


def test_inner_allocators_are_kvmems(both):
    stock, ours = both[False]["types"], both[True]["types"]
    assert stock[0] == ours[0] == "SWATokenToKVPoolAllocator"
    assert stock[1:] != ["KvmemTokenToKVPoolAllocator"] * 2
    assert ours[1:] == ["KvmemTokenToKVPoolAllocator"] * 2


def test_same_slots_mapping_and_counts_as_stock(both):
    stock, ours = both[False]["calls"], both[True]["calls"]
    assert [c["what"] for c in ours] == [c["what"] for c in stock]
    for a, b in zip(stock, ours):
        assert a == b, a["what"]
    # the calls reached both sides: the SWA side gave pages back while the full side
    # kept them, and everything came back at the end
    assert any(
        c["what"].startswith("slide") and c["swa"] > prev["swa"] for prev, c in zip(ours, ours[1:])
    )
    assert both[True]["end"] == both[False]["end"]
    full, swa, size_full, size_swa = both[True]["end"]
    assert (full, swa) == (size_full, size_swa)


RELEASE = """
import torch
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from tests.sglang.sglang_env import emit, publish, build_pools
from kvmem_sglang import kvpool
publish(16)
kv = SWAKVPool(size=4096, size_swa=1024, page_size=16, dtype=torch.bfloat16, head_num=2,
               head_dim=64, swa_attention_layer_ids=[0, 2], full_attention_layer_ids=[1, 3],
               device="cpu")
build_pools(page_size=16, size=4096, kv=kv)
full, swa = kvpool.pool_of(kv.full_kv_pool), kvpool.pool_of(kv.swa_kv_pool)
ptrs = [b.data_ptr() for p in (kv.full_kv_pool, kv.swa_kv_pool) for b in p.k_buffer + p.v_buffer]
kv.full_kv_pool.k_buffer[0].fill_(1)
kv.swa_kv_pool.v_buffer[1].fill_(2)
before = [full.resident_bytes(), swa.resident_bytes()]
kvpool.release_all()
released = [full.resident_bytes(), swa.resident_bytes()]
kvpool.resume_all(False)
emit({"before": before, "released": released, "bytes": [full.nbytes, swa.nbytes],
      "same_ptrs": ptrs == [b.data_ptr() for p in (kv.full_kv_pool, kv.swa_kv_pool)
                            for b in p.k_buffer + p.v_buffer],
      "epochs": [full.epoch, swa.epoch], "live": len(kvpool.live_pools()),
      "state": [list(x) for x in kv.get_state_buf_infos()[1:]],
      "kv": [list(x) for x in kv.get_contiguous_buf_infos()[1:]]})
"""


def test_both_inner_pools_release_and_resume_together():
    out = result_of(run_script(RELEASE, kvmem=True))
    assert out["live"] == 2
    assert out["before"] == out["bytes"]  # backed (prefaulted) when made
    assert out["released"] == [0, 0]
    assert out["same_ptrs"] and out["epochs"] == [1, 1]
    # the full pool's buffers are the KV a PD server registers, the SWA pool's its state
    assert len(out["kv"][0]) == len(out["state"][0]) == 4


RING = """
import torch
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from tests.sglang.sglang_env import emit, publish, build_pools
from kvmem_sglang.options import AdapterError
publish(16)
kv = SWAKVPool(size=256, size_swa=128, page_size=16, dtype=torch.bfloat16, head_num=2,
               head_dim=16, swa_attention_layer_ids=[0], full_attention_layer_ids=[1],
               device="cpu")
kv.swa_req_ring_size = 64
try:
    build_pools(page_size=16, size=256, kv=kv)
except AdapterError as e:
    emit({"refused": str(e)})
else:
    emit({"refused": None})
"""


def test_per_request_swa_ring_is_refused():
    out = result_of(run_script(RING, kvmem=True))
    assert out["refused"] and "per-request SWA ring" in out["refused"], out
