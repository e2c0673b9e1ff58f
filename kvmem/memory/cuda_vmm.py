"""CUDA memory backend over the driver's virtual memory management (VMM) API.

The pool's address range is reserved once (``cuMemAddressReserve``); physical memory is
created in a few large chunks (``cuMemCreate``), mapped under the range (``cuMemMap``) and
made accessible (``cuMemSetAccess``).  ``release`` waits for the device, unmaps and frees
the chunks; ``resume`` creates and maps new ones at the same addresses.  Every
``data_ptr()`` stays valid across release/resume; contents do not survive.

Touching the range while it is released is an illegal-address fault that poisons the CUDA
context for good, so :class:`kvmem.KVPool` refuses every kvmem entry point on a released
pool before anything reaches the device.

Physical chunks request ``gpuDirectRDMACapable`` where the device supports RDMA on VMM
memory, so a transfer engine (NIXL over UCX/RDMA) can register them.  ``regions()`` lists
one region per chunk: a registration never spans two physical allocations.

Torch sees the range through ``__cuda_array_interface__`` (``torch.as_tensor``, zero-copy);
CuPy users get the same memory with ``cupy.asarray`` on the pool's tensors.

Needs a GPU: exercised by ``bench/gpu_check.sh`` (tests/gpu), not by the CPU suite.
"""

from __future__ import annotations

import torch

from kvmem.memory import MemoryBackend

# Physical chunk size.  Few, large handles keep release/resume to a few dozen driver calls
# for a 64 GiB pool; 2 GiB is a guess, not yet measured on the H200.
CHUNK_BYTES = 2 << 30


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python before the cuda.bindings namespace
        from cuda import cuda as driver  # type: ignore[no-redef]
    return driver


def _check(result, what: str):
    """cuda-python returns (CUresult, *values): raise on error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    drv = _driver()
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class _CudaArray:
    """Just enough of ``__cuda_array_interface__`` for torch.as_tensor / cupy.asarray."""

    def __init__(self, ptr: int, nbytes: int, owner):
        self._owner = owner  # keeps the backend (and its reservation) alive
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2,
            "strides": None,
        }


class CudaVmmBackend(MemoryBackend):
    """A reserved device address range with physical memory mapped in large chunks."""

    name = "cuda_vmm"
    can_release = True

    def __init__(self, nbytes: int, device: torch.device, chunk_bytes: int = CHUNK_BYTES):
        super().__init__(nbytes, device)
        drv = _driver()
        self._drv = drv
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        torch.zeros(1, device=self.device)  # the primary context exists and is current
        _check(drv.cuInit(0), "cuInit")
        dev = _check(drv.cuDeviceGet(index), "cuDeviceGet")
        vmm = _check(drv.cuDeviceGetAttribute(
            drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev),
            "cuDeviceGetAttribute(VMM)")
        if not vmm:
            raise RuntimeError(f"{self.device} does not support CUDA virtual memory management")
        rdma = _check(drv.cuDeviceGetAttribute(
            drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
            dev), "cuDeviceGetAttribute(RDMA with VMM)")
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        if rdma:
            prop.allocFlags.gpuDirectRDMACapable = 1
        self.rdma_capable = bool(rdma)
        self._prop = prop
        gran = _check(drv.cuMemGetAllocationGranularity(
            prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            "cuMemGetAllocationGranularity")
        self._size = -(-nbytes // gran) * gran
        chunk = max(gran, min(-(-chunk_bytes // gran) * gran, self._size))
        self._chunks = [(off, min(chunk, self._size - off)) for off in range(0, self._size, chunk)]
        self._ptr = int(_check(drv.cuMemAddressReserve(self._size, gran, 0, 0),
                               "cuMemAddressReserve"))
        self._handles: list = []
        self._access = drv.CUmemAccessDesc()
        self._access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = index
        self._access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        try:
            self._map()
        except Exception:
            self._unmap()
            _check(drv.cuMemAddressFree(self._ptr, self._size), "cuMemAddressFree")
            raise
        self.tensor = torch.as_tensor(_CudaArray(self._ptr, nbytes, self), device=self.device)
        assert self.tensor.data_ptr() == self._ptr

    # --- mapping ---------------------------------------------------------------------------
    def _map(self) -> None:
        drv = self._drv
        for off, size in self._chunks:
            handle = _check(drv.cuMemCreate(size, self._prop, 0), f"cuMemCreate({size} bytes)")
            try:
                _check(drv.cuMemMap(self._ptr + off, size, 0, handle, 0), "cuMemMap")
            except Exception:
                drv.cuMemRelease(handle)
                raise
            self._handles.append(handle)
        _check(drv.cuMemSetAccess(self._ptr, self._size, [self._access], 1), "cuMemSetAccess")

    def _unmap(self) -> None:
        drv = self._drv
        for (off, size), handle in zip(self._chunks, self._handles):
            _check(drv.cuMemUnmap(self._ptr + off, size), "cuMemUnmap")
            _check(drv.cuMemRelease(handle), "cuMemRelease")
        self._handles = []

    def release(self) -> None:
        torch.cuda.synchronize(self.device)  # nothing in flight may touch the range
        self._unmap()

    def resume(self, prefault: bool = True) -> None:
        del prefault  # device memory is backed as soon as it is mapped
        self._map()

    def resident_bytes(self) -> int:
        return sum(size for (_, size), _h in zip(self._chunks, self._handles))

    def regions(self) -> list[tuple[int, int]]:
        """One region per physical chunk, clipped to the pool's bytes."""
        out = []
        for off, size in self._chunks:
            if off < self.nbytes:
                out.append((self._ptr + off, min(size, self.nbytes - off)))
        return out

    def close(self) -> None:
        if self._handles:
            self.release()
        if self._ptr:
            _check(self._drv.cuMemAddressFree(self._ptr, self._size), "cuMemAddressFree")
            self._ptr = 0

    def __del__(self):  # runs once no tensor views the range any more
        try:
            self.close()
        except Exception:  # interpreter shutdown: the driver may be gone already
            pass
