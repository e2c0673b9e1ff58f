"""pack/unpack on the torch (CPU) path against the plain references, over the shared test grid."""

from __future__ import annotations

import pytest
import torch

import kvmem
from kvmem.kernels.pack import pack_buffers_ref, unpack_buffers_ref
from tests.kv_cases import fill_random, grid, make_buffers, scrambled_ids, selections

GRID = grid()


@pytest.mark.parametrize("case", GRID, ids=[c.id for c in GRID])
def test_pack_matches_ref(case):
    gen = torch.Generator().manual_seed(hash(case.id) % 2**31)
    ks, vs = make_buffers(case, gen)
    ids = scrambled_ids(case, gen)
    for layers, heads in selections(case):
        got = kvmem.pack_buffers(ks, vs, ids, layers=layers, heads=heads)
        want = pack_buffers_ref(ks, vs, ids, layers=layers, heads=heads)
        assert got.dtype == torch.uint8 and got.dim() == 1
        assert torch.equal(got, want), (layers, heads)
        spec = case.spec()
        assert got.numel() == kvmem.packed_nbytes(spec, ids.numel(), layers, heads)


@pytest.mark.parametrize("case", GRID, ids=[c.id for c in GRID])
def test_unpack_round_trip_leaves_other_pages_untouched(case):
    gen = torch.Generator().manual_seed(hash(case.id) % 2**31 + 1)
    ks, vs = make_buffers(case, gen)
    ids = scrambled_ids(case, gen)
    for layers, heads in selections(case):
        buf = kvmem.pack_buffers(ks, vs, ids, layers=layers, heads=heads)
        dst_k, dst_v = make_buffers(case, gen, sentinel=0xA5)
        ref_k, ref_v = make_buffers(case, gen, sentinel=0xA5)
        kvmem.unpack_buffers(buf, dst_k, dst_v, ids, layers=layers, heads=heads)
        unpack_buffers_ref(buf, ref_k, ref_v, ids, layers=layers, heads=heads)
        for got, want in zip(dst_k + dst_v, ref_k + ref_v):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        # Listed pages now hold the source's bytes; all else is still the sentinel.
        sel = range(case.num_layers) if layers is None else layers
        h0, h1 = heads if heads is not None else (0, case.num_heads)
        listed = torch.zeros(case.num_pages, dtype=torch.bool)
        listed[ids] = True
        for src_list, dst_list in ((ks, dst_k), (vs, dst_v)):
            for l, (src, dst) in enumerate(zip(src_list, dst_list)):
                raw_src, raw_dst = src.view(torch.uint8), dst.view(torch.uint8)
                touched = torch.zeros(raw_dst.shape, dtype=torch.bool)
                if l in sel:
                    touched[listed, :, h0:h1, :] = True
                assert torch.equal(raw_dst[touched], raw_src[touched])
                assert bool((raw_dst[~touched] == 0xA5).all())
        assert torch.equal(kvmem.pack_buffers(dst_k, dst_v, ids, layers=layers, heads=heads), buf)


def test_pool_pack_unpack_and_sglang_flat_buffers():
    spec = kvmem.KVSpec(
        num_layers=4, num_kv_heads=4, head_dim=64, page_size=16, dtype=torch.bfloat16
    )
    pool = kvmem.KVPool(spec, num_pages=12)
    gen = torch.Generator().manual_seed(0)
    for b in pool.k_buffer + pool.v_buffer:
        fill_random(b, gen)
    ids = torch.tensor([5, 11, 0, 2, 7])
    buf = kvmem.pack_pages(pool, ids, layers=[1, 3], heads=(1, 3))
    assert torch.equal(
        buf, pack_buffers_ref(pool.k_buffer, pool.v_buffer, ids, layers=[1, 3], heads=(1, 3))
    )
    # sglang's per-layer buffers are [num_tokens, H, D]: the same bytes, page_size given.
    flat_k = [b.flatten(0, 1) for b in pool.k_buffer]
    flat_v = [b.flatten(0, 1) for b in pool.v_buffer]
    assert torch.equal(
        kvmem.pack_buffers(flat_k, flat_v, ids, page_size=16, layers=[1, 3], heads=(1, 3)), buf
    )
    other = kvmem.KVPool(spec, num_pages=12)
    for b in other.k_buffer + other.v_buffer:
        b.view(torch.uint8).fill_(0)
    dst_ids = torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32)
    kvmem.unpack_pages(buf, other, dst_ids, layers=[1, 3], heads=(1, 3))
    assert torch.equal(kvmem.pack_pages(other, dst_ids, layers=[1, 3], heads=(1, 3)), buf)
    # Python lists are accepted as page ids; an empty selection packs nothing.
    assert torch.equal(kvmem.pack_pages(pool, [5, 11, 0, 2, 7], layers=[1, 3], heads=(1, 3)), buf)
    assert kvmem.pack_pages(pool, torch.tensor([], dtype=torch.int64)).numel() == 0


def test_pack_into_out_buffer():
    spec = kvmem.KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, page_size=4, dtype=torch.float16)
    pool = kvmem.KVPool(spec, num_pages=6)
    fill_random(pool._mem.tensor, torch.Generator().manual_seed(1))
    ids = torch.tensor([4, 1])
    out = torch.empty(kvmem.packed_nbytes(spec, 2), dtype=torch.uint8)
    res = kvmem.pack_pages(pool, ids, out=out)
    assert res is out
    assert torch.equal(out, pack_buffers_ref(pool.k_buffer, pool.v_buffer, ids))


def test_pool_layout_and_regions():
    spec = kvmem.KVSpec(
        num_layers=3, num_kv_heads=2, head_dim=24, page_size=3, dtype=torch.float16, v_head_dim=8
    )
    pool = kvmem.KVPool(spec, num_pages=5)
    assert [tuple(b.shape) for b in pool.k_buffer] == [(5, 3, 2, 24)] * 3
    assert [tuple(b.shape) for b in pool.v_buffer] == [(5, 3, 2, 8)] * 3
    ((ptr, nbytes),) = pool.regions()
    assert nbytes == pool.nbytes >= spec.pool_bytes(5)
    for b in pool.k_buffer + pool.v_buffer:
        start = b.data_ptr()
        assert ptr <= start and start + b.numel() * b.element_size() <= ptr + nbytes
        assert start % 512 == 0
    # Buffers do not overlap.
    spans = sorted(
        (b.data_ptr(), b.data_ptr() + b.numel() * 2) for b in pool.k_buffer + pool.v_buffer
    )
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    k_only = kvmem.KVPool(
        kvmem.KVSpec(
            num_layers=2,
            num_kv_heads=1,
            head_dim=576,
            page_size=1,
            dtype=torch.bfloat16,
            v_head_dim=0,
        ),
        num_pages=4,
    )
    assert k_only.v_buffer == []
    assert kvmem.packed_nbytes(k_only.spec, 3) == 3 * 2 * 576 * 2


def test_packed_nbytes_matches_spec():
    spec = kvmem.KVSpec(
        num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16
    )
    assert kvmem.packed_nbytes(spec, 1) == spec.page_bytes == 32 * 2 * 16 * 8 * 128 * 2
    assert (
        kvmem.packed_nbytes(spec, 10, layers=[1, 3], heads=(2, 4)) == 10 * 2 * 2 * 16 * 2 * 128 * 2
    )
    with pytest.raises(ValueError, match="n must be"):
        kvmem.packed_nbytes(spec, -1)
