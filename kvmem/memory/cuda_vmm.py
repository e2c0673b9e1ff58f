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

Partial failure.  Each chunk steps through NONE -> HELD (``cuMemCreate``) -> MAPPED
(``cuMemMap``) -> READY (``cuMemSetAccess``), and its state is recorded after every
successful driver call.  :meth:`VmmRange.map_all` and :meth:`VmmRange.unmap_all` either
complete or undo what they did themselves (a resume that runs out of memory after 20 of 32
chunks unmaps and frees those 20; an unmap that fails half-way maps the chunks it had
unmapped back, with their memory and contents), so the caller can free memory and retry.
If an undo fails too, the recorded states still say exactly what is mapped, and the next
call continues from there instead of mapping over a mapped chunk.

The driver module is injectable (``driver=``, default ``cuda.bindings.driver``) so that
the CPU test suite drives this file against a fake driver; the real checks are in
``tests/gpu`` (bench/gpu_check.sh).
"""

from __future__ import annotations

import logging
import threading
import weakref

import torch

from kvmem.errors import CudaDriverError, PoolMemoryError
from kvmem.memory import MemoryBackend, range_tensor
from kvmem.memory.plan import chunk_target, plan_range

log = logging.getLogger("kvmem.memory.cuda_vmm")

_OOM = "CUDA_ERROR_OUT_OF_MEMORY"

# Chunk states (see the module docstring).
NONE, HELD, MAPPED, READY = 0, 1, 2, 3


def default_driver():
    """``cuda.bindings.driver`` (``cuda.cuda`` on cuda-python before the bindings
    namespace)."""
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python before the cuda.bindings namespace
        from cuda import cuda as driver  # type: ignore[no-redef]
    return driver


def _error_name(drv, err) -> str:
    try:
        res, name = drv.cuGetErrorName(err)
        if res == drv.CUresult.CUDA_SUCCESS and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - a name is a nicety; the code below still says it
        pass
    return getattr(err, "name", str(err))


def _call(drv, fn: str, *args, what: str = ""):
    """Call ``drv.<fn>(*args)``; cuda-python returns ``(CUresult, *values)``: raise
    :class:`CudaDriverError` on an error, return the value(s)."""
    result = getattr(drv, fn)(*args)
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise CudaDriverError(fn, _error_name(drv, err), what)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


class _State:
    """Everything a :class:`VmmRange` owns, apart from the range object itself, so that
    its finalizer can free it without a reference to the range.

    Invariants, for chunk ``i`` with ``(off, size) = chunks[i]``:
    ``states[i] == NONE`` <=> ``handles[i] is None``; ``states[i] >= MAPPED`` means the
    handle is mapped at ``ptr + off``; ``READY`` means it is also read/write accessible
    from ``access``'s device.  ``ptr == 0`` once the reservation is freed.
    """

    def __init__(self, drv, size: int, chunks: list[tuple[int, int]], prop, access, sync):
        self.drv = drv
        self.ptr = 0
        self.size = size
        self.chunks = chunks
        self.prop = prop
        self.access = access
        self.sync = sync  # waits for the device's outstanding work (None: nothing to wait for)
        self.handles: list = [None] * len(chunks)
        self.states = [NONE] * len(chunks)
        self.lock = threading.Lock()


def _lower(st: _State, i: int, target: int) -> None:
    """Take chunk ``i`` down to ``target`` (HELD: unmapped; NONE: handle released),
    recording each step as soon as the driver confirms it."""
    off, size = st.chunks[i]
    if st.states[i] >= MAPPED and target <= HELD:
        _call(st.drv, "cuMemUnmap", st.ptr + off, size, what=f"chunk at offset {off}")
        st.states[i] = HELD
    if st.states[i] == HELD and target == NONE:
        _call(st.drv, "cuMemRelease", st.handles[i], what=f"chunk at offset {off}")
        st.handles[i] = None
        st.states[i] = NONE


def _raise(st: _State, i: int) -> None:
    """Take chunk ``i`` up to READY, reusing a handle it still holds."""
    off, size = st.chunks[i]
    drv = st.drv
    if st.states[i] == NONE:
        st.handles[i] = _call(drv, "cuMemCreate", size, st.prop, 0, what=f"{size} bytes")
        st.states[i] = HELD
    if st.states[i] == HELD:
        _call(
            drv, "cuMemMap", st.ptr + off, size, 0, st.handles[i], 0, what=f"chunk at offset {off}"
        )
        st.states[i] = MAPPED
    if st.states[i] == MAPPED:
        _call(
            drv, "cuMemSetAccess", st.ptr + off, size, [st.access], 1, what=f"chunk at offset {off}"
        )
        st.states[i] = READY


def _free(st: _State) -> list[CudaDriverError]:
    """Unmap and release every chunk, then free the reservation; keep going past errors
    and return them.  The finalizer of a :class:`VmmRange` (runs at most once)."""
    errors: list[CudaDriverError] = []
    with st.lock:
        if st.ptr == 0:
            return errors
        if st.sync is not None and any(s >= MAPPED for s in st.states):
            try:
                st.sync()
            except Exception:  # noqa: BLE001 - a dead context: unmapping is all that is left
                pass
        for i in range(len(st.chunks)):
            try:
                _lower(st, i, NONE)
            except CudaDriverError as e:
                errors.append(e)
        if all(s == NONE for s in st.states):
            try:
                _call(st.drv, "cuMemAddressFree", st.ptr, st.size)
                st.ptr = 0
            except CudaDriverError as e:
                errors.append(e)
    return errors


class VmmRange:
    """A reserved device address range of ``size`` bytes and the physical chunks under it.

    Holds no tensor.  Its finalizer frees everything once the range is garbage; torch's
    views keep it alive through :class:`~kvmem.memory.RangeArray`.

    Args:
        drv: the driver module (``cuda.bindings.driver`` or a stand-in).
        size: bytes to reserve, a multiple of ``alignment``.
        alignment: the allocation granularity.
        chunks: ``[(offset, nbytes)]`` covering ``[0, size)``, each a multiple of
            ``alignment``.
        prop: ``CUmemAllocationProp`` for ``cuMemCreate``.
        access: ``CUmemAccessDesc`` for ``cuMemSetAccess``.
        sync: callable that waits for the device (before any unmap), or ``None``.

    Raises:
        PoolMemoryError: the reservation failed for lack of address space or memory.
        CudaDriverError: any other driver error.  Nothing stays reserved.
    """

    def __init__(self, drv, size: int, alignment: int, chunks, prop, access, sync=None):
        st = _State(drv, size, list(chunks), prop, access, sync)
        try:
            st.ptr = int(_call(drv, "cuMemAddressReserve", size, alignment, 0, 0))
        except CudaDriverError as e:
            if e.code == _OOM:
                raise PoolMemoryError(
                    size, "cuda_vmm", _device_of(access), str(e), what="reserve"
                ) from e
            raise
        self._st = st
        # Called by the GC, the errors _free returns go nowhere: nobody is left to tell.
        self._finalizer = weakref.finalize(self, _free, st)
        self._finalizer.atexit = False  # at exit the process's context goes anyway

    @property
    def ptr(self) -> int:
        return self._st.ptr

    @property
    def size(self) -> int:
        return self._st.size

    @property
    def chunks(self) -> list[tuple[int, int]]:
        return list(self._st.chunks)

    @property
    def states(self) -> list[int]:
        """Per chunk: NONE, HELD, MAPPED or READY."""
        return list(self._st.states)

    @property
    def ready(self) -> bool:
        """Every chunk mapped and accessible: the whole range may be touched."""
        return all(s == READY for s in self._st.states)

    @property
    def held_bytes(self) -> int:
        """Bytes of physical memory this range holds (chunks with a handle)."""
        return sum(size for (_, size), s in zip(self._st.chunks, self._st.states) if s != NONE)

    @property
    def closed(self) -> bool:
        return self._st.ptr == 0

    def _check_open(self, what: str) -> None:
        if self._st.ptr == 0:
            raise RuntimeError(f"{what}: the VMM range is closed")

    def map_all(self) -> None:
        """Bring every chunk to READY.  All or nothing: on an error, the chunks this call
        changed go back to the state they had, and the error says so.

        Raises:
            PoolMemoryError: ``cuMemCreate`` ran out of device memory (free some, retry).
            CudaDriverError: another driver error.
        """
        st = self._st
        with st.lock:
            self._check_open("map")
            before = list(st.states)
            todo = [i for i, s in enumerate(before) if s != READY]
            done: list[int] = []
            try:
                for i in todo:
                    done.append(i)
                    _raise(st, i)
            except CudaDriverError as e:
                failed = done[-1]
                undo = _undo(st, reversed(done), before, up=False)
                where = (
                    f"chunk {failed + 1} of {len(st.chunks)} "
                    f"({st.chunks[failed][1]} bytes at offset {st.chunks[failed][0]})"
                )
                note = f"at {where}; {undo}"
                if e.code == _OOM:
                    need = sum(st.chunks[i][1] for i in todo)
                    raise PoolMemoryError(
                        need,
                        "cuda_vmm",
                        _device_of(st.access),
                        f"{e}, {note}; free device memory and retry",
                        what="map",
                    ) from e
                raise CudaDriverError(e.call, e.code, f"{e.detail}; {note}") from e

    def unmap_all(self) -> None:
        """Give every chunk's memory back (all chunks NONE).  The unmaps are all or
        nothing: if one fails, the chunks this call unmapped are mapped back (same handles,
        so the contents survive) and the error says so.  Once all are unmapped, a handle
        whose release fails is kept (HELD) and the error is raised after the others are
        released: the range is then unmapped, and the handle is reused by the next
        :meth:`map_all` or freed by :meth:`close`.

        Raises:
            CudaDriverError: naming the call, the chunk and what was undone.
        """
        st = self._st
        with st.lock:
            self._check_open("unmap")
            if st.sync is not None and any(s >= MAPPED for s in st.states):
                st.sync()  # nothing in flight may touch the range
            before = list(st.states)
            done: list[int] = []
            try:
                for i, s in enumerate(before):
                    if s >= MAPPED:
                        done.append(i)
                        _lower(st, i, HELD)
            except CudaDriverError as e:
                failed = done[-1]  # its unmap failed: still recorded as mapped
                undo = _undo(st, reversed(done[:-1]), before, up=True)
                raise CudaDriverError(
                    e.call, e.code, f"{e.detail}; at chunk {failed + 1} of {len(st.chunks)}; {undo}"
                ) from e
            errors = []
            for i, s in enumerate(st.states):
                if s == HELD:
                    try:
                        _lower(st, i, NONE)
                    except CudaDriverError as e:
                        errors.append((i, e))
            if errors:
                i, e = errors[0]
                raise CudaDriverError(
                    e.call,
                    e.code,
                    f"{e.detail}; {len(errors)} chunk handle(s) (first: chunk {i + 1}) could "
                    "not be released; the range is unmapped, and they are reused by the next "
                    "resume or freed by close",
                ) from e

    def close(self) -> None:
        """Unmap, release and unreserve everything now (waits for the device first).
        Idempotent.

        Raises:
            CudaDriverError: the first of the driver errors met; everything else was
                still freed.
        """
        errors = self._finalizer() or []
        if errors:
            raise errors[0]


def _undo(st: _State, chunks, before: list[int], *, up: bool) -> str:
    """Return each listed chunk to its state in ``before``; describe the result."""
    n = 0
    failures = []
    for i in chunks:
        if st.states[i] == before[i]:
            continue  # this call had not changed it (e.g. its cuMemCreate failed)
        try:
            if up:
                _raise(st, i)
            else:
                _lower(st, i, before[i])
            n += 1
        except CudaDriverError as u:
            failures.append(f"chunk {i + 1}: {u}")
    verb = "mapped back" if up else "unmapped and released again"
    text = f"the {n} chunk(s) this call had changed were {verb}"
    if failures:
        mapped = sum(s >= MAPPED for s in st.states)
        text += (
            f"; undoing failed for {len(failures)} ({'; '.join(failures)}): {mapped} of "
            f"{len(st.chunks)} chunks are mapped now, and the next release/resume "
            "continues from there"
        )
    return text


def _device_of(access) -> str:
    try:
        return f"cuda:{access.location.id}"
    except AttributeError:
        return "cuda"


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

        make.name, make.chunked = cls.name, True
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
        _call(drv, "cuInit", 0)
        dev = _call(drv, "cuDeviceGet", index)
        attr = drv.CUdevice_attribute
        vmm = _call(
            drv,
            "cuDeviceGetAttribute",
            attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            dev,
            what="VMM supported",
        )
        if not vmm:
            raise RuntimeError(f"{device} does not support CUDA virtual memory management")
        rdma = _call(
            drv,
            "cuDeviceGetAttribute",
            attr.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
            dev,
            what="RDMA with VMM",
        )
        fd_ok = _call(
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
                probe = _call(
                    drv,
                    "cuMemCreate",
                    _granularity(drv, prop),
                    prop,
                    0,
                    what="probe for POSIX fd handles",
                )
                _call(drv, "cuMemRelease", probe, what="probe for POSIX fd handles")
            except CudaDriverError as e:
                if e.code == _OOM:  # no memory to spare: not a question of handle support
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
    @property
    def released(self) -> bool:
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
        _call(
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
