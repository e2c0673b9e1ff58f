"""On a CUDA device (written for an H200, not yet run on a GPU): the cuda_vmm backend's
chunk plan and exportable chunks against the real driver.

- Every K/V plane lies inside one physical allocation: the first and the last byte of
  each plane are backed by the same handle (``cuMemRetainAllocationHandle``), for MLA's
  576- and 1152-byte tokens at page_size 1 and 64, both layouts, with small chunks so
  that there are many; chunk offsets are multiples of the driver's granularity.
- Chunks are exportable where the device supports POSIX file-descriptor handles (what
  UCX's cuda_ipc needs): each chunk's handle exports to a file descriptor, and that fd,
  imported and mapped at a second address, shows the pool's bytes.

The same logic on CPU against a fake driver: tests/memory/test_cuda_vmm_fake_driver.py.
"""

from __future__ import annotations

import os

import pytest
import torch

import kvmem
from kvmem.memory import range_tensor
from kvmem.memory.cuda_driver import call as _call, default_driver
from kvmem.memory.cuda_vmm import _granularity

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = torch.device("cuda")
MiB = 1 << 20


def _fd_supported(drv) -> bool:
    dev = _call(drv, "cuDeviceGet", torch.cuda.current_device())
    attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
    return bool(_call(drv, "cuDeviceGetAttribute", attr, dev))


def _handle_at(drv, addr: int) -> int:
    h = _call(drv, "cuMemRetainAllocationHandle", addr)
    try:
        return int(h)
    finally:
        _call(drv, "cuMemRelease", h)


@pytest.mark.parametrize("layout", ["kvmem", "sglang"])
@pytest.mark.parametrize(
    "dtype, ps",
    [
        (torch.float8_e4m3fn, 1),
        (torch.bfloat16, 1),
        (torch.float8_e4m3fn, 64),
        (torch.bfloat16, 64),
    ],
    ids=["576B-P1", "1152B-P1", "576B-P64", "1152B-P64"],
)
def test_every_plane_is_inside_one_physical_allocation(dtype, ps, layout):
    drv = default_driver()
    spec = kvmem.KVSpec(
        num_layers=12, num_kv_heads=1, head_dim=576, page_size=ps, dtype=dtype, v_head_dim=0
    )
    pages = (3 * MiB) // spec.k_page_bytes + 7  # planes of ~3 MiB: not a granule multiple
    pool = kvmem.KVPool(spec, pages, DEV, layout=layout, chunk_bytes=8 * MiB)
    try:
        gran = pool.plan.granularity
        assert gran == _granularity(drv, pool._mem._range._st.prop)
        assert len(pool.plan.chunks) >= 4
        assert all(c.offset % gran == 0 and c.size % gran == 0 for c in pool.plan.chunks)
        base = pool._mem.tensor.data_ptr()
        handles = {int(h) for h in pool._mem._range._st.handles}
        for c in pool.plan.chunks:
            assert _handle_at(drv, base + c.offset) in handles
        for b in pool.k_buffer:
            first, last = b.data_ptr(), b.data_ptr() + b.nbytes - 1
            assert _handle_at(drv, first) == _handle_at(drv, last), "a plane spans two chunks"
        # the first and last page of every plane read back what was written (plain torch
        # copies: no kernel to compile in bench/gpu_check.sh's budget)
        for i, b in enumerate(pool.k_buffer):
            u8 = b.view(torch.uint8)
            u8[0].fill_(i + 1)
            u8[-1].fill_(i + 101)
        torch.cuda.synchronize()
        for i, b in enumerate(pool.k_buffer):
            u8 = b.view(torch.uint8)
            assert bool((u8[0] == i + 1).all()) and bool((u8[-1] == i + 101).all())
    finally:
        pool.close()


def test_chunks_export_as_posix_fds_and_map_elsewhere():
    drv = default_driver()
    spec = kvmem.KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, page_size=16)
    pool = kvmem.KVPool(spec, 1025, DEV, chunk_bytes=64 * MiB)  # 32 MiB planes, 2 a chunk
    try:
        info = pool.memory_info()
        if not _fd_supported(drv):
            assert not info["exportable"] and info["handle_type"] is None
            assert "does not support" in info["not_exportable_because"]
            return
        assert info["exportable"] and info["handle_type"] == "posix_fd", info
        pool._mem.tensor.copy_(torch.randint(0, 256, (pool.nbytes,), dtype=torch.uint8, device=DEV))
        torch.cuda.synchronize()
        st = pool._mem._range._st
        fd_type = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        for (off, size), handle, c in zip(st.chunks, st.handles, pool.plan.chunks):
            fd = _call(drv, "cuMemExportToShareableHandle", handle, fd_type, 0)
            assert int(fd) >= 0
            try:
                imported = _call(drv, "cuMemImportFromShareableHandle", int(fd), fd_type)
            finally:
                os.close(int(fd))
            va = int(_call(drv, "cuMemAddressReserve", size, pool.plan.granularity, 0, 0))
            try:
                _call(drv, "cuMemMap", va, size, 0, imported, 0)
                _call(drv, "cuMemSetAccess", va, size, [st.access], 1)
                other = range_tensor(va, c.nbytes, None, DEV)
                assert torch.equal(other, pool._mem.tensor[off : off + c.nbytes])
                del other
                torch.cuda.synchronize()
                _call(drv, "cuMemUnmap", va, size)
            finally:
                _call(drv, "cuMemRelease", imported)
                _call(drv, "cuMemAddressFree", va, size)
    finally:
        pool.close()
