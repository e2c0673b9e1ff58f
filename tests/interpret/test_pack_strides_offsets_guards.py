"""Defects the pack/unpack kernel once had, kept from coming back, under Triton's
interpreter on CPU tensors (``TRITON_INTERPRET=1 KVMEM_FORCE_TRITON=1``):

- a strided ``page_ids`` tensor was read as if contiguous;
- the chunk offsets were int32 products, so past 2^31 copy units the V half
  (and, at larger sizes, later layers) landed gigabytes away from the chunk;
- every kernel launch (pack and allocator) must run under the device guard of
  its tensors' device.
"""

from __future__ import annotations

import contextlib
import mmap

import pytest
import torch

import kvmem
from kvmem.allocator import PageAllocator
from kvmem.kernels import _dispatch
from kvmem.kernels import pack as P
from kvmem.kernels.alloc import triton as alloc_triton
from kvmem.kernels.pack import triton as pack_triton
from kvmem.kernels.pack import pack_buffers_ref, unpack_buffers_ref
from tests.kv_cases import Case, make_buffers

# -- strided ids ------------------------------------------------------------------------


def test_strided_page_ids_pack_and_unpack_the_pages_they_name():
    case = Case(2, 8, "fp16", False, num_layers=2, num_heads=2, num_pages=6)
    ks, vs = make_buffers(case, torch.Generator().manual_seed(5))
    ids = torch.tensor([1, 2, 3, 4])[::2]  # [1, 3], stride 2
    assert ids.stride() == (2,)
    got = kvmem.pack_buffers(ks, vs, ids)
    want = pack_buffers_ref(ks, vs, [1, 3])
    assert torch.equal(got, want)  # was pages 1 and 2
    dk, dv = make_buffers(case, torch.Generator(), sentinel=0x5A)
    rk, rv = make_buffers(case, torch.Generator(), sentinel=0x5A)
    kvmem.unpack_buffers(got, dk, dv, ids)
    unpack_buffers_ref(got, rk, rv, [1, 3])
    for a, b in zip(dk + dv, rk + rv):  # page 2 (another request's) keeps the sentinel
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# -- int64 chunk offsets ----------------------------------------------------------------


def _reserve(nbytes: int):
    """A private anonymous mapping of ``nbytes`` that takes memory only where touched
    (MAP_NORESERVE), as a uint8 tensor."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
    try:
        m = mmap.mmap(-1, nbytes, flags=flags)
    except (OSError, OverflowError) as e:  # a 32-bit host or strict overcommit
        pytest.fail(
            f"cannot reserve {nbytes} bytes of address space here ({e}): the int64 "
            "offset checks need a 64-bit host without strict overcommit"
        )
    return m, torch.frombuffer(m, dtype=torch.uint8)


def _int32(x: int) -> int:
    """x as an int32 product would hold it (two's complement wrap)."""
    return (x + 2**31) % 2**32 - 2**31


# (layers, head_dim in bytes, n): the chunk's page count n is a kernel argument, so the
# kernel can be told the chunk is huge while the grid runs only page j = 0 of each copy.
BIG = [
    # 1-byte pages, 3 layers, n = 2^30 + 1: K of layer 2 starts at 2n = 2^31 + 2 units,
    # so (t * n) wraps in int32; the V half starts at 3n (NUM_K * n * K_UNITS wraps).
    (3, 1, 2**30 + 1),
    # 4097-byte pages (1-byte units), 1 layer: the K half is n * 4097 = 2^31 + 2^24 + ...
    # units, the case of the issue (V written ~2 GiB before the chunk).
    (1, 4097, (2**31 + 2**24) // 4097 + 1),
]


@pytest.mark.parametrize("layers, dim, n", BIG, ids=["t*n", "K-half"])
def test_chunk_offsets_past_2_31_units_are_exact(layers, dim, n):
    """The real kernel on a chunk whose offsets pass 2^31 units, without the memory: the
    chunk is a view into a MAP_NORESERVE mapping with 8 GiB of slack before it (where
    wrapped int32 offsets would write), and only page j = 0 of each copy is launched, so
    only a few pages are touched.  Pack must write each copy's page at its exact int64 offset, and
    unpack must read it from there.  What this proves: the offset arithmetic the kernel
    runs (same source as on the GPU) is exact past 2^31 under the interpreter's
    int32/int64 semantics; the PTX test checks the compiled sm_90 code separately."""
    gen = torch.Generator().manual_seed(9)
    shape = (4, 1, 1, dim)  # [num_pages, page_size, H, D] of uint8: 1-byte units
    ks = [torch.randint(0, 255, shape, generator=gen, dtype=torch.uint8) for _ in range(layers)]
    vs = [torch.randint(0, 255, shape, generator=gen, dtype=torch.uint8) for _ in range(layers)]
    plan = P.make_plan(ks, vs, None, None, None)
    assert plan.unit_bytes == 1 and plan.k.rows * plan.k.seg == dim
    copies = ks + vs
    offsets = [t * n * dim for t in range(len(copies))]  # every page is `dim` units
    assert max(offsets) >= 2**31
    # Slack before the chunk, where wrapped offsets land (a sum of up to four wrapped
    # int32 terms is >= -2^33): a kernel with the bug fails the checks below instead of
    # writing outside the mapping.
    slack = 2**33
    m, whole = _reserve(slack + max(offsets) + dim)
    chunk = whole[slack:]
    ids = torch.tensor([2])
    err = torch.zeros(2, dtype=torch.int64)

    def launch(pack):
        pack_triton._copy_pages_kernel[(1, plan.num_copies)](
            ks[0],
            plan.layer_offs,
            ids,
            chunk,
            n,
            plan.num_pages,
            err,
            **pack_triton.kernel_params(plan, pack),
        )

    launch(pack=True)
    for t, (buf, off) in enumerate(zip(copies, offsets)):
        assert torch.equal(chunk[off : off + dim], buf[2].reshape(-1)), f"copy {t}"
        wrapped = _int32(off)
        if wrapped != off:  # where one wrapped int32 product would put it: untouched
            assert not bool(whole[slack + wrapped : slack + wrapped + dim].any()), f"copy {t}"
    # unpack: distinct bytes at the exact offsets come back into page 2 of each copy
    for t, off in enumerate(offsets):
        chunk[off : off + dim] = (t * 37 + torch.arange(dim)) % 251
    before = [b.clone() for b in copies]
    launch(pack=False)
    for t, (buf, old) in enumerate(zip(copies, before)):
        want = (t * 37 + torch.arange(dim)) % 251
        assert torch.equal(buf[2].reshape(-1), want.to(torch.uint8)), f"copy {t}"
        assert torch.equal(buf[[0, 1, 3]], old[[0, 1, 3]])  # other pages untouched
    assert err.tolist() == [0, 0]
    del whole, m  # unmapped when the last view goes (no close(): views may linger)
    chunk = None  # launch() holds this name: dropped, not deleted


# -- the device guard -------------------------------------------------------------------


class _LaunchSpy:
    """Stands in for a @triton.jit kernel: records, at each launch, the devices of the
    guards that are open, then launches the real kernel."""

    def __init__(self, name, real, open_guards, launches):
        self.name, self.real, self.open, self.launches = name, real, open_guards, launches

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches.append((self.name, list(self.open)))
            return self.real[grid](*args, **kwargs)

        return run


KERNELS = [
    (pack_triton, "_copy_pages_kernel"),
    (alloc_triton, "_take_pages_kernel"),
    (alloc_triton, "_free_apply_kernel"),
    (alloc_triton, "_free_commit_kernel"),
    (alloc_triton, "_extend_slots_kernel"),
    (alloc_triton, "_decode_slots_kernel"),
]


def test_every_kernel_launch_runs_under_its_tensors_device_guard(monkeypatch):
    """On CPU tensors device_guard is a no-op context, so this cannot show a device
    switch; it shows that every launch site (the pack kernel and the five allocator
    kernels) launches inside device_guard(d) with d its tensors' device.  What
    device_guard does for a CUDA device is the next test; the real two-device check is
    tests/gpu/test_cuda_sizes_devices_streams.py."""
    open_guards, launches = [], []

    @contextlib.contextmanager
    def guard(device):
        open_guards.append(torch.device(device))
        try:
            yield
        finally:
            open_guards.pop()

    monkeypatch.setattr(pack_triton, "device_guard", guard)
    monkeypatch.setattr(alloc_triton, "device_guard", guard)
    for mod, name in KERNELS:
        monkeypatch.setattr(mod, name, _LaunchSpy(name, getattr(mod, name), open_guards, launches))
    case = Case(2, 8, "bf16", False, num_layers=2, num_heads=2, num_pages=5)
    ks, vs = make_buffers(case, torch.Generator().manual_seed(1))
    buf = kvmem.pack_buffers(ks, vs, [1, 2])
    kvmem.unpack_buffers(buf, ks, vs, [1, 2])
    a = PageAllocator(num_pages=9, page_size=2)
    a.free(a.alloc(2))
    a.free(a.alloc(2), check=False)
    i64 = lambda *x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    a.alloc_extend(
        i64(0, 0),
        i64(3, 1),
        i64(-1, -1),
        check=False,
        prefix_lens_cpu=i64(0, 0),
        seq_lens_cpu=i64(3, 1),
    )
    a.alloc_decode(i64(3), i64(5), check=False, seq_lens_cpu=i64(3))  # starts a page
    a.synchronize()
    names = {name for name, _ in launches}
    assert names == {name for _, name in KERNELS}, names
    cpu = torch.device("cpu")
    for name, guards in launches:
        assert guards and guards[-1] == cpu, (name, guards)


def test_device_guard_switches_to_the_tensors_cuda_device():
    """What device_guard returns (not entered: this host may have no GPU)."""
    g = _dispatch.device_guard(torch.device("cuda", 1))
    assert isinstance(g, torch.cuda.device) and g.idx == 1
    with _dispatch.device_guard(torch.device("cpu")):
        pass
