"""CUDA memory backend over the driver's virtual memory management (VMM) API.

The pool's address range is reserved once (``cuMemAddressReserve``); physical memory is
created in a few large chunks (``cuMemCreate``), mapped under the range (``cuMemMap``) and
made accessible (``cuMemSetAccess``).  ``release`` waits for the device, unmaps and frees
the chunks; ``resume`` creates and maps new ones at the same addresses.  Every
``data_ptr()`` stays valid across release/resume; contents do not survive.

Touching the range while it is released is an illegal-address fault that poisons the CUDA
context for good, so :class:`kvmem.KVPool` refuses every kvmem entry point on a released
pool before anything reaches the device.

Chunks follow the pool's :class:`~kvmem.memory.plan.ChunkPlan` (``planner``): whole layer
planes (kvmem layout) or K|V blocks (sglang layout) grouped up to the chunk target, each
chunk starting on the allocation granularity, so no page, plane or page run crosses a
physical allocation.  ``regions()`` lists one region per chunk: a registration never
spans two physical allocations, and neither does a descriptor inside one.

Physical chunks request ``gpuDirectRDMACapable`` where the device supports RDMA on VMM
memory, so a transfer engine (NIXL over UCX/RDMA) can register them, and POSIX
file-descriptor handles (``requestedHandleTypes``) where the device supports them
(``CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED``): UCX's ``cuda_ipc``
exports chunks that way to map them into a peer process on the same node (NVLink).
Where the attribute is 0, or a probe ``cuMemCreate`` with that handle type is refused
(some containers and virtualised GPUs), chunks are made without it, a WARNING says so
(logger ``kvmem.memory.cuda_vmm``), and ``exportable`` / ``info()`` report it.

Ownership.  :class:`VmmRange` owns the reservation and the chunk handles and holds no
tensor.  Torch sees the range through ``__cuda_array_interface__`` (``torch.as_tensor``,
zero-copy; CuPy users get the same memory with ``cupy.asarray`` on the pool's tensors);
torch keeps that interface object in the storage's C++ deleter, where Python's GC cannot
see it, so the object refers to the :class:`VmmRange` only, never to the backend::

    CudaVmmBackend -> tensor -> (C++ deleter) -> RangeArray -> VmmRange

No cycle: once the backend and every view are gone, the range's finalizer
(``weakref.finalize``) waits for the device, unmaps, releases and frees the reservation.
``close()`` does the same at once.

Partial failure: a release or resume is all or nothing, and a failed undo leaves chunk
states the next call continues from (:mod:`kvmem.memory.vmm_range`).

One job a module: this one is the backend (the device's properties, the chunk plan, the
handle types, the MemoryBackend interface); :mod:`kvmem.memory.vmm_range` the range and
its chunks' states; :mod:`kvmem.memory.cuda_driver` the driver calls.  The driver module
is injectable (``driver=``, default ``cuda.bindings.driver``) so that the CPU test suite
drives these files against a fake driver; the real checks are in ``tests/gpu``
(bench/gpu_check.sh).
"""

from __future__ import annotations

import logging

import torch

from kvmem.errors import CudaDriverError
from kvmem.memory.backend import MemoryBackend, range_tensor
from kvmem.memory.cuda_driver import OOM, call, default_driver
from kvmem.memory.plan import chunk_target, plan_range
from kvmem.memory.vmm_range import VmmRange

log = logging.getLogger("kvmem.memory.cuda_vmm")


class CudaVmmBackend(MemoryBackend):
    """A reserved device address range with physical memory mapped in chunks.

    Args:
        nbytes: bytes of a plain range (ignored with ``planner``: the plan's).
        device: a CUDA device.  A CPU device only with an injected ``driver`` whose
            addresses are host memory (the CPU tests' fake driver).
        chunk_bytes: the chunk target (default: ``$KVMEM_CHUNK_BYTES``, else 2 GiB).
        driver: the driver module; default ``cuda.bindings.driver``.
        planner: ``planner(granularity, target) -> ChunkPlan`` (a pool's plan); None: the
            range is cut every ``target`` bytes rounded to the granularity.

    Attributes:
        tensor: ``uint8 [nbytes]`` view of the range.
        released: not every chunk is mapped and accessible (touching the range may fault).
        rdma_capable: chunks were made ``gpuDirectRDMACapable``.
        exportable: chunks were made with POSIX file-descriptor handles.
    """

    name = "cuda_vmm"
    can_release = True

    @classmethod
    def factory(cls, *, driver=None, chunk_bytes: int | None = None):
        """A ``(nbytes, device) -> CudaVmmBackend`` callable for ``KVPool(backend=...)``
        (``chunked``: :func:`kvmem.memory.make_backend` passes it the pool's planner)."""
        own = chunk_bytes

        def make(
            nbytes: int, device: torch.device, *, planner=None, chunk_bytes: int | None = None
        ) -> CudaVmmBackend:
            return cls(
                nbytes,
                device,
                own if chunk_bytes is None else chunk_bytes,
                driver=driver,
                planner=planner,
            )

        # attributes of a function, which make_backend reads with getattr: mypy has no type
        # for a function that carries attributes
        make.name, make.chunked = cls.name, True  # type: ignore[attr-defined]
        return make

    def __init__(
        self,
        nbytes: int,
        device: torch.device,
        chunk_bytes: int | None = None,
        *,
        driver=None,
        planner=None,
    ):
        target = chunk_target(chunk_bytes)
        drv = default_driver() if driver is None else driver
        self._drv = drv
        device = torch.device(device)
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            device = torch.device("cuda", index)
            torch.zeros(1, device=device)  # the primary context exists and is current
            sync = _device_sync(index)
        elif device.type == "cpu" and driver is not None:
            index, sync = 0, None
        else:
            raise ValueError(f"the cuda_vmm backend needs a cuda device, got {device}")
        call(drv, "cuInit", 0)
        dev = call(drv, "cuDeviceGet", index)
        attr = drv.CUdevice_attribute
        vmm = call(
            drv,
            "cuDeviceGetAttribute",
            attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            dev,
            what="VMM supported",
        )
        if not vmm:
            raise RuntimeError(f"{device} does not support CUDA virtual memory management")
        rdma = call(
            drv,
            "cuDeviceGetAttribute",
            attr.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
            dev,
            what="RDMA with VMM",
        )
        fd_ok = call(
            drv,
            "cuDeviceGetAttribute",
            attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            dev,
            what="POSIX fd handles",
        )
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = index
        if rdma:
            prop.allocFlags.gpuDirectRDMACapable = 1
        self.rdma_capable = bool(rdma)
        self.exportable, self._not_exportable = self._request_fd_handles(
            drv, prop, bool(fd_ok), device
        )
        gran = _granularity(drv, prop)
        plan = planner(gran, target) if planner is not None else plan_range(nbytes, gran, target)
        super().__init__(plan.nbytes, device, plan)
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = index
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        chunks = [(c.offset, c.size) for c in plan.chunks]
        self._range = VmmRange(drv, plan.size, gran, chunks, prop, access, sync)
        try:
            self._range.map_all()
        except BaseException:
            self._range.close()
            raise
        self.tensor = range_tensor(self._range.ptr, plan.nbytes, self._range, self.device)

    @staticmethod
    def _request_fd_handles(drv, prop, supported: bool, device) -> tuple[bool, str | None]:
        """Ask for POSIX file-descriptor handles on ``prop`` where the device supports
        them and a probe ``cuMemCreate`` of one granule with them succeeds; otherwise
        leave ``prop`` without and say why.  Returns ``(exportable, reason or None)``."""
        why = None
        if not supported:
            why = "the device does not support POSIX file-descriptor handles"
        else:
            types = drv.CUmemAllocationHandleType
            prop.requestedHandleTypes = types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            try:
                probe = call(
                    drv,
                    "cuMemCreate",
                    _granularity(drv, prop),
                    prop,
                    0,
                    what="probe for POSIX fd handles",
                )
                call(drv, "cuMemRelease", probe, what="probe for POSIX fd handles")
            except CudaDriverError as e:
                if e.code == OOM:  # no memory to spare: not a question of handle support
                    return True, None
                prop.requestedHandleTypes = types.CU_MEM_HANDLE_TYPE_NONE
                why = f"a chunk with POSIX file-descriptor handles was refused ({e})"
        if why is None:
            return True, None
        log.warning(
            "cuda_vmm on %s: chunks are not exportable (%s); UCX's cuda_ipc cannot "
            "map them into a peer process, so transfers between processes on this "
            "node go through the NIC or host memory",
            device,
            why,
        )
        return False, why

    def info(self) -> dict:
        out = super().info()
        out.update(
            rdma=self.rdma_capable,
            handle_type="posix_fd" if self.exportable else None,
            not_exportable_because=self._not_exportable,
        )
        return out

    # --- MemoryBackend -----------------------------------------------------------------------
    # The base's plain attribute is written by backends that track it (host); this one
    # derives it from its chunks' states and never writes it.
    @property
    def released(self) -> bool:  # type: ignore[override]
        return not self._range.ready

    def release(self) -> None:
        """Wait for the device, unmap and free every chunk (all or nothing for the unmaps;
        see :meth:`VmmRange.unmap_all`)."""
        self._range.unmap_all()

    def resume(self, prefault: bool = True) -> None:
        """Create and map every chunk at the same addresses (all or nothing; see
        :meth:`VmmRange.map_all`)."""
        del prefault  # device memory is backed as soon as it is mapped
        self._range.map_all()

    def resident_bytes(self) -> int:
        """Bytes of physical memory the pool holds now (chunks with a live handle)."""
        return self._range.held_bytes

    def partly_held(self) -> bool:
        return not self._range.closed and self.released and self._range.held_bytes > 0

    def close(self) -> None:
        """Free the memory and the reservation now; views of the range must not be used
        afterwards.  Idempotent."""
        self.tensor = None
        self._range.close()


def _granularity(drv, prop) -> int:
    return int(
        call(
            drv,
            "cuMemGetAllocationGranularity",
            prop,
            drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    )


def _device_sync(index: int):
    def sync() -> None:
        torch.cuda.synchronize(index)

    return sync
