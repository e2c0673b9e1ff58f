"""On a CUDA device (bench/gpu_check.sh): the pack/unpack Triton kernel over the shared test
grid against the CPU reference, the unchecked-call error flag, and a cuda_vmm pool's
release/resume, CuPy views and refusals.  Collected only where CUDA is available.

The grid compiles about 200 kernel variants on an empty Triton cache, so
bench/gpu_check.sh runs it in parts, chosen by the environment:

    KVMEM_GPU_GRID=small   the SMALL cases only (every page size, head dim and dtype once,
                           strided and contiguous, K|V of two head dims, K only): the
                           script's first step
    KVMEM_GPU_GRID=rest    the others
    (unset, or full)       the whole grid
    KVMEM_GPU_SHARD=i/n    of those, every n-th case from the i-th (n processes compile in
                           parallel)"""

from __future__ import annotations

import os

import pytest
import torch

import kvmem
from kvmem.kernels.pack import pack_buffers_ref, unpack_buffers_ref
from tests.kv_cases import fill_random, grid, make_buffers

DEV = torch.device("cuda")
SMALL = (
    "P16-D128-bf16-contig",
    "P1-D576-fp8-strided",
    "P64-D64-fp32-strided",
    "P1-D64-fp16-contig",
    "P16-D128-V64-bf16-contig",
    "P16-D576-V0-bf16-contig",
)


def selected(cases, part: str | None, shard: str | None):
    """The cases of ``part`` (``small`` | ``rest`` | ``full``/None) and ``shard``
    (``"i/n"`` or None): see the module docstring.  ValueError for anything else."""
    ids = [c.id for c in cases]
    missing = set(SMALL) - set(ids)
    if missing:
        raise ValueError(f"SMALL names cases the grid lacks: {sorted(missing)}")
    if part in (None, "", "full"):
        out = list(cases)
    elif part in ("small", "rest"):
        out = [c for c in cases if (c.id in SMALL) == (part == "small")]
    else:
        raise ValueError(f"KVMEM_GPU_GRID must be small, rest or full, got {part!r}")
    if shard:
        i, _, n = shard.partition("/")
        if not (i.isdigit() and n.isdigit() and 0 <= int(i) < int(n)):
            raise ValueError(f"KVMEM_GPU_SHARD must be i/n with 0 <= i < n, got {shard!r}")
        out = out[int(i) :: int(n)]
    return out


GRID = selected(grid(), os.environ.get("KVMEM_GPU_GRID"), os.environ.get("KVMEM_GPU_SHARD"))


@pytest.mark.parametrize("case", GRID, ids=[c.id for c in GRID])
def test_kernel_matches_ref_on_cuda(case):
    gen = torch.Generator().manual_seed(hash(case.id) % 2**31)
    ks, vs = make_buffers(case, gen, device=DEV)
    ids = torch.randperm(case.num_pages, generator=gen)[: case.num_pages - 2].to(DEV)
    sels = [(None, None), ([2, 0], (1, case.num_heads) if case.num_heads > 1 else (0, 1))]
    for layers, heads in sels:
        got = kvmem.pack_buffers(ks, vs, ids, layers=layers, heads=heads, check=False)
        cpu = lambda xs: [x.cpu() for x in xs]  # noqa: E731
        want = pack_buffers_ref(cpu(ks), cpu(vs), ids.cpu(), layers=layers, heads=heads)
        assert torch.equal(got.cpu(), want)
        dk, dv = make_buffers(case, gen, sentinel=0xA5, device=DEV)
        rk, rv = make_buffers(case, gen, sentinel=0xA5)
        kvmem.unpack_buffers(got, dk, dv, ids, layers=layers, heads=heads)
        unpack_buffers_ref(want, rk, rv, ids.cpu(), layers=layers, heads=heads)
        for a, b in zip(dk + dv, rk + rv):
            assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))


def test_checked_call_raises_before_touching_memory():
    spec = kvmem.KVSpec(
        num_layers=2, num_kv_heads=2, head_dim=64, page_size=4, dtype=torch.bfloat16
    )
    pool = kvmem.KVPool(spec, num_pages=8, device=DEV)
    with pytest.raises(ValueError, match=r"page id 8 is outside \[0, 8\)"):
        kvmem.pack_pages(pool, torch.tensor([1, 8], device=DEV))


def test_unchecked_bad_id_is_skipped_and_raised_later():
    spec = kvmem.KVSpec(
        num_layers=2, num_kv_heads=2, head_dim=64, page_size=4, dtype=torch.bfloat16
    )
    pool = kvmem.KVPool(spec, num_pages=8, device=DEV)
    fill_random(pool._mem.tensor, torch.Generator().manual_seed(1))
    out = torch.full((kvmem.packed_nbytes(spec, 2),), 0xEE, dtype=torch.uint8, device=DEV)
    kvmem.pack_pages(pool, torch.tensor([1, 1000], device=DEV), out=out, check=False)
    torch.cuda.synchronize()  # no illegal address: the bad page was skipped
    with pytest.raises(ValueError, match="earlier unchecked .* page id 1000"):
        kvmem.pack_pages(pool, torch.tensor([1], device=DEV))
    kvmem.pack_pages(pool, torch.tensor([1], device=DEV))  # the flag was cleared


def test_vmm_pool_release_resume_and_views():
    spec = kvmem.KVSpec(
        num_layers=4, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16
    )
    pool = kvmem.KVPool(spec, num_pages=2049, device=DEV)  # 1 GiB
    assert pool.backend == "cuda_vmm"
    ptrs = [b.data_ptr() for b in pool.k_buffer + pool.v_buffer]
    regions = pool.regions()
    assert sum(n for _, n in regions) == pool.nbytes and len(regions) <= 8
    assert pool.resident_bytes() >= pool.nbytes
    ids = torch.arange(1, 65, device=DEV)
    chunk = torch.randint(0, 256, (kvmem.packed_nbytes(spec, 64),), dtype=torch.uint8, device=DEV)
    kvmem.unpack_pages(chunk, pool, ids)
    free_before = torch.cuda.mem_get_info()[0]
    pool.release()
    assert pool.resident_bytes() == 0
    assert torch.cuda.mem_get_info()[0] - free_before >= 0.95 * pool.nbytes
    for call in (
        lambda: pool.k_buffer,
        lambda: kvmem.pack_pages(pool, ids),
        lambda: kvmem.unpack_pages(chunk, pool, ids),
    ):
        with pytest.raises(kvmem.ReleasedPoolError):
            call()
    pool.resume()
    assert pool.epoch == 1 and pool.resident_bytes() >= pool.nbytes
    assert [b.data_ptr() for b in pool.k_buffer + pool.v_buffer] == ptrs
    kvmem.unpack_pages(chunk, pool, ids)
    assert torch.equal(kvmem.pack_pages(pool, ids), chunk)
    for _ in range(20):
        pool.release()
        pool.resume()
    assert pool.epoch == 21


def test_vmm_pool_cupy_views_are_zero_copy():
    import cupy  # on the H200 image; this folder runs on CUDA hosts only

    spec = kvmem.KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, page_size=4, dtype=torch.float16)
    pool = kvmem.KVPool(spec, num_pages=8, device=DEV)
    ks, vs = pool.as_cupy()
    assert [k.data.ptr for k in ks] == [b.data_ptr() for b in pool.k_buffer]
    ks[1][3] = 7.0
    torch.cuda.synchronize()
    assert bool((pool.k_buffer[1][3] == 7.0).all())
    ids = cupy.asarray([3, 5], dtype=cupy.int64)  # CuPy page ids, taken zero-copy
    chunk = kvmem.pack_pages(pool, ids, layers=[1])
    assert torch.equal(chunk, kvmem.pack_pages(pool, torch.tensor([3, 5], device=DEV), layers=[1]))
