"""The pack/unpack Triton kernel itself, run on CPU tensors by Triton's interpreter
(``TRITON_INTERPRET=1 KVMEM_FORCE_TRITON=1``): a tiny grid, since the interpreter is slow."""

from __future__ import annotations

import pytest
import torch

import kvmem
from kvmem.kernels import pack as P
from kvmem.kernels.pack import pack_buffers_ref, unpack_buffers_ref
from kvmem.kernels.pack.plan import _ERR_FLAGS
from kvmem.kernels.pack.triton import _launch
from tests.kv_cases import Case, make_buffers

CASES = [
    Case(1, 64, "bf16", False, num_layers=2, num_heads=2, num_pages=5),
    Case(4, 64, "fp16", True, num_layers=2, num_heads=3, num_pages=5),
    Case(2, 128, "fp32", False, num_layers=2, num_heads=2, num_pages=4, v_head_dim=64),
    Case(2, 576, "fp8", False, num_layers=2, num_heads=1, num_pages=4, v_head_dim=0),
    Case(3, 6, "bf16", True, num_layers=2, num_heads=3, num_pages=4),  # 2-byte units
    Case(2, 5, "fp8", False, num_layers=2, num_heads=3, num_pages=4),  # 1-byte units
]
SELECTIONS = [(None, None), ([1], (1, 2))]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_kernel_pack_unpack_matches_ref(case):
    gen = torch.Generator().manual_seed(11)
    ks, vs = make_buffers(case, gen)
    ids = torch.tensor([3, 0, 2], dtype=torch.int32)
    for layers, heads in SELECTIONS:
        if heads is not None and heads[1] > case.num_heads:
            heads = (0, 1)
        plan = P.make_plan(ks, vs, None, layers, heads)
        got = kvmem.pack_buffers(ks, vs, ids, layers=layers, heads=heads)
        assert torch.equal(got, pack_buffers_ref(ks, vs, ids, layers=layers, heads=heads))
        dst_k, dst_v = make_buffers(case, gen, sentinel=0x5A)
        ref_k, ref_v = make_buffers(case, gen, sentinel=0x5A)
        kvmem.unpack_buffers(got, dst_k, dst_v, ids, layers=layers, heads=heads)
        unpack_buffers_ref(got, ref_k, ref_v, ids, layers=layers, heads=heads)
        for a, b in zip(dst_k + dst_v, ref_k + ref_v):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert plan.unit_bytes in (1, 2, 4)


def test_kernel_skips_and_flags_out_of_range_ids():
    """What an unchecked (check=False) CUDA call does with a bad id: skip it, never touch
    memory outside the buffers, and leave a flag for the next checked call."""
    case = Case(2, 64, "bf16", False, num_layers=2, num_heads=2, num_pages=4)
    ks, vs = make_buffers(case, torch.Generator().manual_seed(3))
    plan = P.make_plan(ks, vs, None, None, None)
    ids = torch.tensor([1, 9, 2])
    chunk = torch.full((plan.nbytes(3),), 0xEE, dtype=torch.uint8)
    _launch(plan, ks, ids, chunk, pack=True)
    good = pack_buffers_ref(ks, vs, torch.tensor([1, 2]))
    per_page = plan.k_page_bytes
    pieces = chunk.view(2 * case.num_layers, 3, per_page)
    assert torch.equal(pieces[:, [0, 2]].reshape(-1), good)
    assert bool((pieces[:, 1] == 0xEE).all())  # the bad page's slots are untouched
    flag = _ERR_FLAGS[torch.device("cpu")]
    assert flag.tolist() == [1, 9]
    with pytest.raises(ValueError, match=r"earlier unchecked .* page id 9, outside \[0, 4\)"):
        kvmem.pack_buffers(ks, vs, torch.tensor([1]))
    assert flag.tolist() == [0, 0]
