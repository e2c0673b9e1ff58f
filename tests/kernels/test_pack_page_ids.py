"""Page ids through the public pack/unpack functions and PageAllocator.free: bool and float ids are refused everywhere with nothing changed, NumPy
and strided ids give the pages they name, and every one of these functions coerces its
ids with the same function, kvmem._ids.as_page_ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvmem
import kvmem.allocator
import kvmem.kernels.pack
from tests.kv_cases import fill_random

SPEC = kvmem.KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, page_size=2, dtype=torch.float16)
BAD = [
    [True],
    [True, False],
    [1, False],
    [1.7],
    [2.0],
    [np.bool_(True)],
    [np.float64(1.0)],
    np.array([True]),
    np.array([1.0]),
    torch.tensor([True]),
    torch.tensor([1.0]),
]
BAD_IDS = [
    "bool",
    "bools",
    "int-bool",
    "float",
    "float-int",
    "np-bool",
    "np-float",
    "np-bool-array",
    "np-float-array",
    "bool-tensor",
    "float-tensor",
]


@pytest.fixture
def pool():
    p = kvmem.KVPool(SPEC, num_pages=6)
    fill_random(p._mem.tensor, torch.Generator().manual_seed(3))
    return p


def _calls(pool):
    """(name, call(ids)) for every public function that takes page ids."""
    n = kvmem.packed_nbytes(SPEC, 1)
    buf = torch.zeros(n, dtype=torch.uint8)
    ks, vs = pool.k_buffer, pool.v_buffer
    return [
        ("pack_pages", lambda ids: kvmem.pack_pages(pool, ids)),
        ("unpack_pages", lambda ids: kvmem.unpack_pages(buf, pool, ids)),
        ("pack_buffers", lambda ids: kvmem.pack_buffers(ks, vs, ids)),
        ("unpack_buffers", lambda ids: kvmem.unpack_buffers(buf, ks, vs, ids)),
    ]


@pytest.mark.parametrize("ids", BAD, ids=BAD_IDS)
def test_pack_and_unpack_refuse_bool_and_float_ids(pool, ids):
    before = pool._mem.tensor.clone()
    for name, call in _calls(pool):
        with pytest.raises(ValueError, match=r"page_ids must be (integers|an integer)"):
            call(ids)
        assert torch.equal(pool._mem.tensor, before), name


@pytest.mark.parametrize("ids", BAD, ids=BAD_IDS)
def test_free_refuses_bool_and_float_ids(ids):
    a = kvmem.PageAllocator(num_pages=5, page_size=2)
    a.alloc(2)
    with pytest.raises(ValueError, match=r"free: pages must be (integers|an integer)"):
        a.free(ids)
    assert a.num_allocated == 2 and a.allocated_pages().tolist() == [1, 2]
    with pytest.raises(ValueError):
        with a.free_group():
            a.free(ids)
    assert a.num_allocated == 2
    a.check_invariants()


def test_free_true_does_not_free_page_one():
    # The reported case: free([True]) used to free page 1.
    a = kvmem.PageAllocator(num_pages=5, page_size=2)
    a.alloc(2)
    with pytest.raises(ValueError, match="got True"):
        a.free([True])
    assert a.allocated_pages().tolist() == [1, 2]


@pytest.mark.parametrize(
    "form",
    [
        lambda x: np.array(x),
        lambda x: np.array(x, dtype=np.int32),
        lambda x: np.array([v for p in x for v in (p, 0)])[::2],
        lambda x: torch.tensor([v for p in x for v in (p, 0)])[::2],
        lambda x: tuple(x),
        lambda x: [np.int64(v) for v in x],
    ],
    ids=["np-int64", "np-int32", "np-strided", "torch-strided", "tuple", "np-scalars"],
)
def test_other_id_forms_pack_the_pages_they_name(pool, form):
    ids = [3, 1, 4]
    want = kvmem.pack_pages(pool, torch.tensor(ids))
    assert torch.equal(kvmem.pack_pages(pool, form(ids)), want)
    dst = kvmem.KVPool(SPEC, num_pages=6)
    dst._mem.tensor.fill_(0x5A)
    kvmem.unpack_pages(want, dst, form(ids))
    assert torch.equal(kvmem.pack_pages(dst, torch.tensor(ids)), want)
    for p in (0, 2, 5):  # pages not listed keep the sentinel
        for buf in dst.k_buffer + dst.v_buffer:
            assert bool((buf[p].view(torch.uint8) == 0x5A).all())


def test_every_public_function_uses_the_one_coercion(pool, monkeypatch):
    seen = []
    real = kvmem._ids.as_page_ids

    def spy(page_ids, device, **kw):
        seen.append(kw.get("what", "page_ids"))
        return real(page_ids, device, **kw)

    monkeypatch.setattr(kvmem.kernels.pack, "as_page_ids", spy)
    monkeypatch.setattr(kvmem.allocator, "as_page_ids", spy)
    for name, call in _calls(pool):
        before = len(seen)
        call([1])
        assert len(seen) == before + 1, name
    a = kvmem.PageAllocator(num_pages=5, page_size=2)
    a.alloc(4)
    a.free(torch.tensor([1]))
    with a.free_group():
        a.free(np.array([2]))
    assert seen[-2:] == ["free: pages", "free: pages"]
    # the one exception: a short list of Python ints on the CPU is checked in plain
    # Python (kvmem.kernels.alloc.free_pages_list); any other entry, a NumPy integer
    # here, goes through the coercion
    n = len(seen)
    a.free([3])
    assert len(seen) == n
    a.free([np.int64(4)])
    assert seen[n:] == ["free: pages"]
    assert a.num_allocated == 0


def test_free_group_copies_an_array_the_caller_reuses():
    a = kvmem.PageAllocator(num_pages=6, page_size=1)
    a.alloc(4)
    ids = np.array([1, 2])
    with a.free_group():
        a.free(ids)  # a zero-copy view on CPU: the group must keep its own copy
        ids[:] = [3, 4]
    assert a.allocated_pages().tolist() == [3, 4]
