"""On a CUDA device (bench/gpu_check.sh), the GPU halves of the kernel and allocator
checks at real sizes, on a second device and across streams; tests/interpret and
tests/kernels/test_ptx_sm90.py hold the CPU-checkable halves.

- pack + unpack of a chunk whose K half passes 2^31 copy units (int64 offsets);
- a pool, buffers and an allocator on cuda:1 while cuda:0 is current (hosts with
  two GPUs);
- an allocator used from two streams keeps one order (its own stream);
- the paths documented as sync-free make no host sync
  (``torch.cuda.set_sync_debug_mode("error")``), NumPy ids on a CUDA pool;
- strided ids on the Triton path.
Collected only where CUDA is available (tests/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvmem
from kvmem.kernels import pack as P
from tests.kv_cases import Case, fill_random, make_buffers
from tests.util import no_host_sync

if not torch.cuda.is_available():  # on CPU only tests/test_bench_smoke.py collects this file
    pytest.skip(
        "CUDA is not available: the hardening checks run on CUDA hosts only",
        allow_module_level=True,
    )

DEV = torch.device("cuda", torch.cuda.current_device())
GiB = 1 << 30


def _free_bytes(device=DEV) -> int:
    return torch.cuda.mem_get_info(device)[0]


# -- a K half past 2^31 units ------------------------------------------------------------

# (name, dtype, layers, [page_size, H, D], pages packed); each K half is past 2^31 + 2^24
# copy units: 1-byte units (odd row bytes) at ~2.2 GB, and bf16 rows (4-byte units,
# 16-byte accesses) at ~8.7 GB, the case.
BIG = [  # n = pages so that layers * n * (units of one page) > 2^31 + 2^24
    ("u8-units", torch.uint8, 4, (16, 1, 129), (2**31 + 2**24) // (4 * 2064) + 1),  # 13 GB
    ("bf16", torch.bfloat16, 2, (16, 8, 128), (2**31 + 2**24) // (2 * 8192) + 1),  # 57 GB
]


@pytest.mark.parametrize("name, dtype, layers, page, n", BIG, ids=[b[0] for b in BIG])
def test_pack_unpack_past_2_31_units(name, dtype, layers, page, n):
    num_pages = n + 1
    item = torch.empty(0, dtype=dtype).element_size()
    half = layers * num_pages * int(np.prod(page)) * item  # bytes of all K (or V) buffers
    if _free_bytes() < 3 * 2 * half + 2 * GiB:  # source, chunk, destination
        pytest.skip(f"needs {3 * 2 * half / GiB:.1f} GiB of free device memory")
    raw = torch.randint(0, 256, (2 * half,), dtype=torch.uint8, device=DEV)
    src = raw.view(dtype).view(2, layers, num_pages, *page)
    ks, vs = list(src[0]), list(src[1])
    plan = P.make_plan(ks, vs, None, None, None)
    units = n * layers * plan.k.rows * plan.k.seg  # the K half, in copy units
    assert units >= 2**31, units
    ids = torch.randperm(num_pages - 1, device=DEV)[:n] + 1
    chunk = kvmem.pack_buffers(ks, vs, ids, check=False)
    torch.cuda.synchronize()
    pieces = chunk.view(2, layers, n, -1)
    for kv, bufs in enumerate((ks, vs)):
        for layer, buf in enumerate(bufs):
            want = buf.reshape(num_pages, -1).view(torch.uint8)[ids]
            assert torch.equal(pieces[kv, layer], want), (kv, layer)
    del raw, src, ks, vs  # keep the peak at three copies
    dst_raw = torch.zeros(2 * half, dtype=torch.uint8, device=DEV)
    dst = dst_raw.view(dtype).view(2, layers, num_pages, *page)
    kvmem.unpack_buffers(chunk, list(dst[0]), list(dst[1]), ids, check=False)
    torch.cuda.synchronize()
    for kv in range(2):
        for layer in range(layers):
            got = dst[kv, layer].reshape(num_pages, -1).view(torch.uint8)
            assert torch.equal(got[ids], pieces[kv, layer]), (kv, layer)
            assert not bool(got[0].any())  # page 0 was not listed: untouched


# -- two devices ---------------------------------------------------------------------------

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@two_gpus
def test_pack_buffers_on_cuda1_while_cuda0_is_current():
    d1 = torch.device("cuda", 1)
    case = Case(16, 128, "bf16", True, num_layers=3, num_heads=4, num_pages=33)
    gen = torch.Generator().manual_seed(8)
    with torch.cuda.device(0):
        ks, vs = make_buffers(case, gen, device=d1)
        ids = [5, 1, 30, 7]
        chunk = kvmem.pack_buffers(ks, vs, ids, heads=(1, 3), check=False)
        assert chunk.device == d1 and torch.cuda.current_device() == 0
        cpu = lambda xs: [x.cpu() for x in xs]  # noqa: E731
        want = P.pack_buffers_ref(cpu(ks), cpu(vs), ids, heads=(1, 3))
        assert torch.equal(chunk.cpu(), want)
        dk, dv = make_buffers(case, gen, sentinel=0xA5, device=d1)
        rk, rv = make_buffers(case, gen, sentinel=0xA5)
        kvmem.unpack_buffers(chunk, dk, dv, np.array(ids), heads=(1, 3), check=False)
        P.unpack_buffers_ref(want, rk, rv, ids, heads=(1, 3))
        for a, b in zip(dk + dv, rk + rv):
            assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))
        with pytest.raises(ValueError, match="page id 33 is outside"):  # checked, on d1
            kvmem.pack_buffers(ks, vs, [1, 33])
        assert torch.cuda.current_device() == 0


@two_gpus
def test_pool_on_cuda1_while_cuda0_is_current():
    d1 = torch.device("cuda", 1)
    spec = kvmem.KVSpec(
        num_layers=3, num_kv_heads=4, head_dim=64, page_size=16, dtype=torch.bfloat16
    )
    with torch.cuda.device(0):
        pool = kvmem.KVPool(spec, num_pages=33, device=d1)
        gen = torch.Generator().manual_seed(4)
        for buf in pool.k_buffer + pool.v_buffer:
            fill_random(buf, gen)
        ids = torch.tensor([5, 1, 30, 7], device=d1)
        chunk = kvmem.pack_pages(pool, ids, check=False)
        assert torch.cuda.current_device() == 0
        cpu_k = [b.cpu() for b in pool.k_buffer]
        cpu_v = [b.cpu() for b in pool.v_buffer]
        assert torch.equal(chunk.cpu(), P.pack_buffers_ref(cpu_k, cpu_v, ids.cpu()))
        other = kvmem.KVPool(spec, num_pages=33, device=d1)
        kvmem.unpack_pages(chunk, other, ids)
        assert torch.equal(
            kvmem.pack_pages(other, ids.tolist(), layers=[2, 0], heads=(1, 3)),
            kvmem.pack_pages(pool, ids, layers=[2, 0], heads=(1, 3)),
        )
        torch.cuda.synchronize(d1)
        assert torch.cuda.current_device() == 0


@two_gpus
@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_allocator_on_cuda1_while_cuda0_is_current(check):
    d1 = torch.device("cuda", 1)
    with torch.cuda.device(0):
        a = kvmem.PageAllocator(65, 4, device=d1)
        b = kvmem.PageAllocator(65, 4)
        assert a.stream.device == d1
        for _ in range(3):
            assert torch.equal(a.alloc(5, check=check).cpu(), b.alloc(5, check=check))
        a.free(torch.tensor([3, 1], device=d1), check=check)
        b.free([3, 1], check=check)
        seq = torch.tensor([3, 9, 1])
        kw = dict(
            prefix_lens_cpu=torch.zeros(3, dtype=torch.int64),
            seq_lens_cpu=seq,
            extend_num_tokens=13,
            check=check,
        )
        got = a.alloc_extend(
            torch.zeros(3, dtype=torch.int64, device=d1),
            seq.to(d1),
            torch.full((3,), -1, device=d1),
            **kw,
        )
        want = b.alloc_extend(torch.zeros(3, dtype=torch.int64), seq, torch.full((3,), -1), **kw)
        assert torch.equal(got.cpu(), want)
        a.check_invariants()
        assert torch.cuda.current_device() == 0


# -- one stream per allocator --------------------------------------------------------------


def test_allocator_calls_from_two_streams_keep_one_order():
    """A free queued from a busy side stream, then an alloc from the main stream: the
    alloc must take the freed pages only after the free has written them."""
    a = kvmem.PageAllocator(9, 1, device=DEV)  # bound to the current (main) stream
    b = kvmem.PageAllocator(9, 1)
    side = torch.cuda.Stream(DEV)
    held = a.alloc(8, check=False)
    b.alloc(8)
    pages = torch.tensor([4, 2, 7], device=DEV)  # (a pageable copy here would wait)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~25 ms of work queued before the free
        a.free(pages, check=False)  # without the rule: queued behind the sleep
    b.free([4, 2, 7])
    got = a.alloc(3, check=False)  # main stream
    assert torch.equal(got.cpu(), b.alloc(3))
    a.synchronize()  # no device error
    a.check_invariants()
    assert held.numel() == 8


def test_allocator_on_an_explicit_stream():
    s = torch.cuda.Stream(DEV)
    a = kvmem.PageAllocator(17, 2, device=DEV, stream=s)
    assert a.stream == s
    p = a.alloc(4)  # from the main stream: ordered both ways, no sync
    q = p * 1  # the main stream reads the result
    a.free(q[:2])
    a.synchronize()
    a.check_invariants()
    assert a.num_free == 14
    with pytest.raises(ValueError, match="stream must be a torch.cuda.Stream"):
        kvmem.PageAllocator(5, 1, device=DEV, stream=object())


# -- no hidden host syncs ------------------------------------------------------------------


def test_documented_sync_free_paths_make_no_sync():
    spec = kvmem.KVSpec(
        num_layers=4, num_kv_heads=4, head_dim=64, page_size=16, dtype=torch.bfloat16
    )
    pool = kvmem.KVPool(spec, num_pages=65, device=DEV)
    a = kvmem.PageAllocator(65, 16, device=DEV)
    ks, vs = pool.k_buffer, pool.v_buffer
    torch.cuda.synchronize()
    with no_host_sync():
        a.reset()
        p = a.alloc(6, check=False)
        a.free([1, 2], check=False)  # a Python list: pinned + non-blocking copy
        a.free(np.array([3]), check=False)
        a.free(p[3:], check=False)
        for layer in range(4):  # new plans: their offsets go non-blocking too
            chunk = kvmem.pack_buffers(ks, vs, [3, 1], layers=[layer], heads=(1, 3), check=False)
            kvmem.unpack_buffers(
                chunk, ks, vs, np.array([3, 1]), layers=[layer], heads=(1, 3), check=False
            )
        kvmem.pack_pages(pool, [4, 5, 6], check=False)
    a.synchronize()
    a.check_invariants()
    assert a.num_free == 64


def test_numpy_and_strided_ids_on_a_cuda_pool():
    spec = kvmem.KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, page_size=4, dtype=torch.float16)
    pool = kvmem.KVPool(spec, num_pages=9, device=DEV)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_(torch.randn(buf.shape, device=DEV))
    want = kvmem.pack_pages(pool, torch.tensor([1, 3], device=DEV))
    assert torch.equal(kvmem.pack_pages(pool, np.array([1, 3])), want)
    assert torch.equal(kvmem.pack_pages(pool, np.array([1, 3], dtype=np.int32)), want)
    strided = torch.tensor([1, 2, 3, 4], device=DEV)[::2]
    assert torch.equal(kvmem.pack_pages(pool, strided), want)
    with pytest.raises(ValueError, match="got True"):
        kvmem.pack_pages(pool, [True])
