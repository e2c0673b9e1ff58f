"""The CPU pack/unpack path for buffers that share one storage (a KVPool in either layout,
or per-layer views carved out of one tensor at irregular offsets): one op over every
layer (kvmem.kernels.pack.cpu._one_storage_rows), compared with the plain references over
the shared test grid; unpack is checked against the reference on the whole storage, so the
gaps between layers stay untouched too."""

from __future__ import annotations

import pytest
import torch

import kvmem
from kvmem.kernels import pack as P
from kvmem.kernels.pack import pack_buffers_ref, unpack_buffers_ref
from kvmem.kernels.pack.cpu import _one_storage_rows
from tests.kv_cases import Case, fill_random, grid, scrambled_ids, selections

GRID = grid()


def carved(case: Case, gen: torch.Generator, sentinel: int | None = None):
    """(storage, K views, V views): every layer a view of one tensor, blocks in a
    scrambled order with gaps of different sizes between them (so the layers are not
    equally strided), strided views (padded tokens, heads, head_dim) for strided cases."""
    spec = case.spec()
    dt = spec.storage_dtype
    pad = (1, 1, 16) if case.strided else (0, 0, 0)
    dims = [case.head_dim] * case.num_layers + [spec.v_head_dim] * (
        case.num_layers if spec.has_v else 0
    )
    blocks = [
        (case.num_pages, case.page_size + pad[0], case.num_heads + pad[1], d + pad[2]) for d in dims
    ]
    order = list(range(len(blocks)))
    order = order[1::2] + order[::2]  # odd blocks first: addresses not in layer order
    offsets, at = {}, 0
    for i, b in enumerate(order):
        at += 3 * i  # growing gaps, in elements
        offsets[b] = at
        at += torch.Size(blocks[b]).numel()
    storage = torch.empty(at + 7, dtype=dt)
    if sentinel is None:
        fill_random(storage, gen)
    else:
        storage.view(torch.uint8).fill_(sentinel)
    views = []
    for b, (shape, d) in enumerate(zip(blocks, dims)):
        block = storage[offsets[b] : offsets[b] + torch.Size(shape).numel()].view(shape)
        views.append(block[:, pad[0] :, pad[1] :, 8 * (pad[2] > 0) : 8 * (pad[2] > 0) + d])
    return storage, views[: case.num_layers], views[case.num_layers :]


@pytest.mark.parametrize("case", GRID, ids=[c.id for c in GRID])
def test_one_storage_pack_and_unpack_match_ref(case):
    gen = torch.Generator().manual_seed(hash(case.id) % 2**31)
    _, ks, vs = carved(case, gen)
    ids = scrambled_ids(case, gen)
    for layers, heads in selections(case):
        plan = P.make_plan(
            ks, vs, None, P._check_layers(layers, len(ks)), P._check_heads(heads, case.num_heads)
        )
        rows = _one_storage_rows(plan, ks, vs)
        assert rows is not None
        same_dims = not vs or vs[0].shape[-1] == ks[0].shape[-1]
        assert len(rows) == (1 if same_dims else 2)
        got = kvmem.pack_buffers(ks, vs, ids, layers=layers, heads=heads)
        assert torch.equal(got, pack_buffers_ref(ks, vs, ids, layers=layers, heads=heads))
        dst, dst_k, dst_v = carved(case, gen, sentinel=0xA5)
        ref, ref_k, ref_v = carved(case, gen, sentinel=0xA5)
        kvmem.unpack_buffers(got, dst_k, dst_v, ids, layers=layers, heads=heads)
        unpack_buffers_ref(got, ref_k, ref_v, ids, layers=layers, heads=heads)
        assert torch.equal(dst.view(torch.uint8), ref.view(torch.uint8)), (layers, heads)


@pytest.mark.parametrize("layout", ["kvmem", "sglang"])
@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("v_head_dim", [None, 64, 0])
def test_pool_layouts_take_one_op(layout, ps, v_head_dim):
    spec = kvmem.KVSpec(
        num_layers=4,
        num_kv_heads=2,
        head_dim=128,
        page_size=ps,
        dtype=torch.bfloat16,
        v_head_dim=v_head_dim,
    )
    pool = kvmem.KVPool(spec, num_pages=7, layout=layout)
    gen = torch.Generator().manual_seed(ps)
    fill_random(pool._mem.tensor, gen)
    ids = torch.tensor([5, 1, 6, 0, 3])
    for layers, heads in ((None, None), ([3, 1], (1, 2))):
        rows = _one_storage_rows(pool._plan(layers, heads), pool.k_buffer, pool.v_buffer)
        assert rows is not None and len(rows) == (2 if v_head_dim == 64 else 1)
        buf = kvmem.pack_pages(pool, ids, layers=layers, heads=heads)
        assert torch.equal(
            buf, pack_buffers_ref(pool.k_buffer, pool.v_buffer, ids, layers=layers, heads=heads)
        )
        other = kvmem.KVPool(spec, num_pages=7, layout=layout)
        other._mem.tensor.fill_(0x5A)
        kvmem.unpack_pages(buf, other, ids, layers=layers, heads=heads)
        ref = kvmem.KVPool(spec, num_pages=7, layout=layout)
        ref._mem.tensor.fill_(0x5A)
        unpack_buffers_ref(buf, ref.k_buffer, ref.v_buffer, ids, layers=layers, heads=heads)
        assert torch.equal(other._mem.tensor, ref._mem.tensor)


def test_separate_storages_fall_back_per_layer():
    """Per-layer tensors of their own (sglang's own buffers) cannot be one view: the plan
    falls back to one op per layer, with the same bytes."""
    case = Case(16, 128, "bf16", False)
    gen = torch.Generator().manual_seed(3)
    _, ks, vs = carved(case, gen)
    ks = [ks[0].clone()] + ks[1:]  # layer 0 in a storage of its own
    plan = P.make_plan(ks, vs, None, P._check_layers(None, 3), P._check_heads(None, 4))
    assert _one_storage_rows(plan, ks, vs) is None
    ids = torch.tensor([4, 0, 7])
    assert torch.equal(kvmem.pack_buffers(ks, vs, ids), pack_buffers_ref(ks, vs, ids))
