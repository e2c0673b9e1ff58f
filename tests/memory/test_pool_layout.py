"""KVPool's two layouts: kvmem's (all K layers, then all V) and sglang's (per layer, K then
V adjacent in one block).  Addresses are checked byte for byte, and pack/unpack must give
the same chunks on both for the same data."""

from __future__ import annotations

import re

import pytest
import torch

import kvmem
from kvmem.memory.plan import LAYER_ALIGN
from tests.kv_cases import fill_random

SPECS = {
    "D128-bf16": kvmem.KVSpec(
        num_layers=3, num_kv_heads=4, head_dim=128, page_size=16, dtype=torch.bfloat16
    ),
    "D64-V32-fp16": kvmem.KVSpec(
        num_layers=3, num_kv_heads=2, head_dim=64, page_size=4, dtype=torch.float16, v_head_dim=32
    ),
    "D576-Konly-bf16": kvmem.KVSpec(
        num_layers=2, num_kv_heads=1, head_dim=576, page_size=1, dtype=torch.bfloat16, v_head_dim=0
    ),
    # odd byte sizes: K of a layer is 7 bytes, so V starts on an odd address
    "D1-P1-fp8": kvmem.KVSpec(
        num_layers=3, num_kv_heads=1, head_dim=1, page_size=1, dtype=torch.float8_e4m3fn
    ),
    "D3-V5-P1-fp8": kvmem.KVSpec(
        num_layers=2,
        num_kv_heads=3,
        head_dim=3,
        page_size=1,
        dtype=torch.float8_e4m3fn,
        v_head_dim=5,
    ),
}
PAGES = 7


def _layer_bytes(spec):
    return spec.k_layer_bytes(PAGES), spec.v_layer_bytes(PAGES)


ONE_CHUNK = 2 << 30  # these pools then have one physical chunk: the single-range layout


@pytest.mark.parametrize("name", SPECS)
def test_sglang_layout_puts_v_right_after_k(name):
    spec = SPECS[name]
    pool = kvmem.KVPool(spec, PAGES, layout="sglang", chunk_bytes=ONE_CHUNK)
    assert pool.layout == "sglang"
    k_bytes, v_bytes = _layer_bytes(spec)
    block = -(-(k_bytes + v_bytes) // LAYER_ALIGN) * LAYER_ALIGN
    base = pool._mem.tensor.data_ptr()
    assert base % LAYER_ALIGN == 0
    assert pool.nbytes == spec.num_layers * block
    assert len(pool.v_buffer) == (spec.num_layers if spec.has_v else 0)
    for l in range(spec.num_layers):
        k = pool.k_buffer[l]
        assert k.shape == spec.k_shape(PAGES) and k.is_contiguous()
        assert k.data_ptr() == base + l * block  # each layer block on the 512-byte boundary
        if spec.has_v:
            v = pool.v_buffer[l]
            assert v.shape == spec.v_shape(PAGES) and v.is_contiguous()
            assert v.data_ptr() == k.data_ptr() + k_bytes  # no padding between the halves
            assert v.data_ptr() + v_bytes <= base + (l + 1) * block
    # one address range, one region, as in kvmem's layout
    assert pool.regions() == [(base, pool.nbytes)]


def test_sglang_layout_is_sglangs_two_halves_tensor():
    """sglang's MHATokenToKVPool: buf = [2, rows, H, D] per layer, k = buf[0], v = buf[1].
    The same block of the pool, viewed that way, is the pool's own K and V."""
    spec = SPECS["D128-bf16"]
    pool = kvmem.KVPool(spec, PAGES, layout="sglang")
    fill_random(pool._mem.tensor, torch.Generator().manual_seed(1))
    rows = PAGES * spec.page_size
    ks, vs = pool.token_buffers()
    for l in range(spec.num_layers):
        k = ks[l]
        assert k.shape == (rows, spec.num_kv_heads, spec.head_dim)
        assert k.data_ptr() == pool.k_buffer[l].data_ptr()
        block = pool._mem.tensor[k.data_ptr() - pool._mem.tensor.data_ptr() :][
            : 2 * spec.k_layer_bytes(PAGES)
        ]
        buf = block.view(spec.storage_dtype).view(2, rows, spec.num_kv_heads, spec.head_dim)
        assert buf[1].data_ptr() - buf[0].data_ptr() == rows * spec.num_kv_heads * spec.head_dim * 2
        assert torch.equal(
            buf[0].view(torch.int16), pool.k_buffer[l].flatten(0, 1).view(torch.int16)
        )
        assert torch.equal(buf[1].view(torch.int16), vs[l].view(torch.int16))


@pytest.mark.parametrize("name", SPECS)
def test_several_chunks_keep_each_block_whole(name):
    """With several chunks: each K|V block (sglang) and each plane (kvmem) inside one
    region, V right after K, every block 512-aligned."""
    spec = SPECS[name]
    k_bytes, v_bytes = _layer_bytes(spec)
    for layout in ("sglang", "kvmem"):
        # target just over one K plane: a chunk boundary after every plane or block
        pool = kvmem.KVPool(spec, 97, layout=layout, chunk_bytes=spec.k_layer_bytes(97) + 1)
        regions = pool.regions()
        assert len(regions) > 1
        for l in range(spec.num_layers):
            k = pool.k_buffer[l]
            assert k.data_ptr() % LAYER_ALIGN == 0
            blocks = [(k.data_ptr(), k.nbytes)]
            if spec.has_v:
                v = pool.v_buffer[l]
                if layout == "sglang":
                    assert v.data_ptr() == k.data_ptr() + spec.k_layer_bytes(97)
                    blocks = [(k.data_ptr(), k.nbytes + v.nbytes)]
                else:
                    blocks.append((v.data_ptr(), v.nbytes))
            for a, n in blocks:
                assert sum(r <= a and a + n <= r + m for r, m in regions) == 1
        pool.close()


def test_kvmem_layout_is_unchanged():
    spec = SPECS["D128-bf16"]
    pool = kvmem.KVPool(spec, PAGES, chunk_bytes=ONE_CHUNK)
    assert pool.layout == "kvmem"
    k_bytes = spec.k_layer_bytes(PAGES)
    stride = -(-k_bytes // LAYER_ALIGN) * LAYER_ALIGN
    base = pool._mem.tensor.data_ptr()
    assert [b.data_ptr() - base for b in pool.k_buffer] == [l * stride for l in range(3)]
    assert [b.data_ptr() - base for b in pool.v_buffer] == [(3 + l) * stride for l in range(3)]


def _same_data(a: kvmem.KVPool, b: kvmem.KVPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for x, y in zip(a.k_buffer + a.v_buffer, b.k_buffer + b.v_buffer):
        fill_random(x, gen)
        y.copy_(x)


def _bytes(pool):
    return [t.view(torch.uint8).clone() for t in pool.k_buffer + pool.v_buffer]


@pytest.mark.parametrize("name", SPECS)
def test_pack_unpack_match_kvmem_layout(name):
    spec = SPECS[name]
    ours = kvmem.KVPool(spec, PAGES, layout="kvmem")
    theirs = kvmem.KVPool(spec, PAGES, layout="sglang")
    _same_data(ours, theirs, seed=3)
    ids = torch.tensor([5, 1, 3])
    sels = [(None, None), ([spec.num_layers - 1, 0], (0, 1))]
    for layers, heads in sels:
        want = kvmem.pack_pages(ours, ids, layers=layers, heads=heads)
        got = kvmem.pack_pages(theirs, ids, layers=layers, heads=heads)
        assert torch.equal(got, want)
        # round trip on the sglang layout: write a fresh chunk, read it back; the pools
        # stay byte-equal, pages not listed included
        chunk = torch.randint(
            0, 256, want.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(9)
        )
        kvmem.unpack_pages(chunk, ours, ids, layers=layers, heads=heads)
        kvmem.unpack_pages(chunk, theirs, ids, layers=layers, heads=heads)
        assert torch.equal(kvmem.pack_pages(theirs, ids, layers=layers, heads=heads), chunk)
        for x, y in zip(_bytes(ours), _bytes(theirs)):
            assert torch.equal(x, y)


def test_sglang_layout_release_resume_keeps_addresses():
    spec = SPECS["D128-bf16"]
    pool = kvmem.KVPool(spec, 65, layout="sglang")
    ptrs = [b.data_ptr() for b in pool.k_buffer + pool.v_buffer]
    regions = pool.regions()
    fill_random(pool._mem.tensor, torch.Generator().manual_seed(2))
    pool.release()
    assert pool.resident_bytes() <= 0.05 * pool.nbytes
    pool.resume()
    assert [b.data_ptr() for b in pool.k_buffer + pool.v_buffer] == ptrs
    assert pool.regions() == regions and pool.epoch == 1


@pytest.mark.parametrize("bad", ["sgl", "SGLANG", "", None, 1])
def test_unknown_layout_is_refused(bad):
    with pytest.raises(ValueError, match=rf"unknown KVPool layout {re.escape(repr(bad))}"):
        kvmem.KVPool(SPECS["D128-bf16"], PAGES, layout=bad)
