"""kvmem/memory/cuda_vmm.py (and vmm_range.py under it) against a fake CUDA driver, on CPU.

``FakeDriver`` implements the ``cuda.bindings.driver`` calls the backend makes, with the
checks of the real driver that matter here: a mapping cannot overlap another, an unmap
must name a mapping, access needs a mapping, a reservation is freed only when nothing is
mapped in it, and ``cuMemCreate`` fails with ``CUDA_ERROR_OUT_OF_MEMORY`` past its
capacity.  It tracks every reservation, handle and mapping, and can fail the Nth call of
any entry point.  Reservations are real private host mappings (``MAP_NORESERVE``), so the
pool's tensors (CPU tensors here) can be packed and unpacked.

The same checks on a real GPU: tests/gpu/test_gpu_memory_vmm.py.
"""

from __future__ import annotations

import ctypes
import enum
import gc
import logging
import mmap
import weakref
from types import SimpleNamespace

import pytest
import torch

import kvmem
from kvmem.errors import CudaDriverError, PoolMemoryError, ReleasedPoolError
from kvmem.memory.cuda_vmm import CudaVmmBackend
from kvmem.memory.vmm_range import NONE, READY
from tests.kv_cases import fill_random
from tests.util import assert_closed_pool_refuses

GRAN = 4096
CHUNK = 32 << 10
SPEC = kvmem.KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, page_size=4, dtype=torch.bfloat16)
PAGES = 32  # 4 layers x (K + V) x 32 pages x 1 KiB = 256 KiB: 8 chunks of one 32 KiB plane


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_UNKNOWN = 999


class FakeDriver:
    """The driver calls of CudaVmmBackend, over host memory, with bookkeeping."""

    CUresult = CUresult
    CUdevice_attribute = SimpleNamespace(
        CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED=102,
        CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED=103,
        CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED=112,
    )
    CUmemAllocationHandleType = SimpleNamespace(
        CU_MEM_HANDLE_TYPE_NONE=0, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR=1
    )
    CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_RECOMMENDED=1)
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)

    def __init__(
        self, capacity: int = 1 << 20, address_space: int = 1 << 30, granularity: int = GRAN
    ):
        self.capacity = capacity
        self.granularity = granularity
        self.address_space = address_space
        self.reservations: dict[int, tuple[int, mmap.mmap]] = {}
        self.handles: dict[int, dict] = {}  # id -> {"size", "released"}
        self.mappings: dict[int, tuple[int, int]] = {}  # va -> (size, handle)
        self.accessible: set[int] = set()  # va of mappings with read/write access
        self.held: dict[int, int] = {}  # other allocations: id -> bytes
        self.calls: dict[str, int] = {}
        self.faults: dict[str, dict[int, CUresult]] = {}
        self.attributes: dict[int, int] = {}  # attribute -> value; absent: 1
        self.refuse_fd_handles: CUresult | None = None  # cuMemCreate with fd handles fails
        self._next = 1

    # --- test controls --------------------------------------------------------------------
    def fail(self, name: str, nth: int = 1, code: CUresult = CUresult.CUDA_ERROR_OUT_OF_MEMORY):
        """Fail the ``nth`` call of ``name`` from now on (1 = the next one)."""
        self.faults.setdefault(name, {})[self.calls.get(name, 0) + nth] = code

    def hold(self, nbytes: int) -> int:
        """Another allocation taking device memory."""
        self._next += 1
        self.held[self._next] = nbytes
        return self._next

    def free(self, key: int) -> None:
        del self.held[key]

    def physical_bytes(self) -> int:
        """Device memory behind this driver's handles (a released handle still mapped
        counts until it is unmapped), other allocations left out."""
        return sum(h["size"] for h in self.handles.values())

    def mapped_bytes(self) -> int:
        return sum(size for size, _ in self.mappings.values())

    def _used(self) -> int:
        return self.physical_bytes() + sum(self.held.values())

    # --- the driver -------------------------------------------------------------------------
    def _enter(self, name: str):
        n = self.calls[name] = self.calls.get(name, 0) + 1
        return self.faults.get(name, {}).pop(n, None)

    @staticmethod
    def cuGetErrorName(err):
        return CUresult.CUDA_SUCCESS, CUresult(err).name.encode()

    def cuInit(self, flags):
        return (self._enter("cuInit") or CUresult.CUDA_SUCCESS,)

    def cuDeviceGet(self, index):
        return self._enter("cuDeviceGet") or CUresult.CUDA_SUCCESS, index

    def cuDeviceGetAttribute(self, attr, dev):
        return (
            self._enter("cuDeviceGetAttribute") or CUresult.CUDA_SUCCESS,
            self.attributes.get(attr, 1),
        )

    @staticmethod
    def CUmemAllocationProp():
        return SimpleNamespace(
            type=0,
            location=SimpleNamespace(type=0, id=-1),
            allocFlags=SimpleNamespace(gpuDirectRDMACapable=0),
            requestedHandleTypes=0,
        )

    @staticmethod
    def CUmemAccessDesc():
        return SimpleNamespace(location=SimpleNamespace(type=0, id=-1), flags=0)

    def cuMemGetAllocationGranularity(self, prop, flags):
        return (
            self._enter("cuMemGetAllocationGranularity") or CUresult.CUDA_SUCCESS,
            self.granularity,
        )

    def cuMemAddressReserve(self, size, alignment, addr, flags):
        if (err := self._enter("cuMemAddressReserve")) is not None:
            return err, 0
        reserved = sum(s for s, _ in self.reservations.values())
        if size % self.granularity or reserved + size > self.address_space:
            return CUresult.CUDA_ERROR_OUT_OF_MEMORY, 0
        # MAP_NORESERVE: memory only where touched, so a 64 GiB pool's calls can be
        # counted on a small machine (bench/chunk_plan.py)
        mm = mmap.mmap(
            -1,
            size,
            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000),
        )
        anchor = ctypes.c_char.from_buffer(mm)
        ptr = ctypes.addressof(anchor)
        del anchor  # no export left: the mapping can be closed
        self.reservations[ptr] = (size, mm)
        return CUresult.CUDA_SUCCESS, ptr

    def cuMemAddressFree(self, ptr, size):
        if (err := self._enter("cuMemAddressFree")) is not None:
            return (err,)
        if self.reservations.get(ptr, (None,))[0] != size:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        if any(ptr <= va < ptr + size for va in self.mappings):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)  # unmap first
        _, mm = self.reservations.pop(ptr)
        mm.close()
        return (CUresult.CUDA_SUCCESS,)

    def cuMemCreate(self, size, prop, flags):
        if (err := self._enter("cuMemCreate")) is not None:
            return err, None
        if size % self.granularity or prop.location.id < 0:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        if self.refuse_fd_handles is not None and prop.requestedHandleTypes == 1:
            return self.refuse_fd_handles, None
        if self._used() + size > self.capacity:
            return CUresult.CUDA_ERROR_OUT_OF_MEMORY, None
        self._next += 1
        self.handles[self._next] = {
            "size": size,
            "released": False,
            "handle_types": prop.requestedHandleTypes,
        }
        return CUresult.CUDA_SUCCESS, self._next

    def cuMemRelease(self, handle):
        if (err := self._enter("cuMemRelease")) is not None:
            return (err,)
        h = self.handles.get(handle)
        if h is None or h["released"]:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        if any(hid == handle for _, hid in self.mappings.values()):
            h["released"] = True  # the memory goes when the last mapping does
        else:
            del self.handles[handle]
        return (CUresult.CUDA_SUCCESS,)

    def _reservation_of(self, va, size):
        return any(p <= va and va + size <= p + s for p, (s, _) in self.reservations.items())

    def cuMemMap(self, va, size, offset, handle, flags):
        if (err := self._enter("cuMemMap")) is not None:
            return (err,)
        h = self.handles.get(handle)
        if (
            h is None
            or h["released"]
            or offset != 0
            or size != h["size"]
            or not self._reservation_of(va, size)
            or any(va < v + s and v < va + size for v, (s, _) in self.mappings.items())
        ):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        self.mappings[va] = (size, handle)
        return (CUresult.CUDA_SUCCESS,)

    def cuMemSetAccess(self, va, size, descs, count):
        if (err := self._enter("cuMemSetAccess")) is not None:
            return (err,)
        covered = sorted((v, s) for v, (s, _) in self.mappings.items() if va <= v < va + size)
        pos = va
        for v, s in covered:
            if v != pos:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            pos += s
        if pos != va + size or count != len(descs) or descs[0].location.id < 0:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        self.accessible.update(v for v, _ in covered)
        return (CUresult.CUDA_SUCCESS,)

    def cuMemUnmap(self, va, size):
        if (err := self._enter("cuMemUnmap")) is not None:
            return (err,)
        if self.mappings.get(va, (None,))[0] != size:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        _, handle = self.mappings.pop(va)
        self.accessible.discard(va)
        if self.handles[handle]["released"] and handle not in {
            h for _, h in self.mappings.values()
        }:
            del self.handles[handle]
        return (CUresult.CUDA_SUCCESS,)

    # --- views of the state -------------------------------------------------------------
    def layout(self) -> dict[int, int]:
        """va -> handle of every mapping that is also accessible."""
        return {va: h for va, (_, h) in self.mappings.items() if va in self.accessible}

    def empty(self) -> bool:
        return not (self.reservations or self.handles or self.mappings)


def make_pool(fake: FakeDriver, layout: str = "kvmem") -> kvmem.KVPool:
    return kvmem.KVPool(
        SPEC,
        PAGES,
        "cpu",
        layout=layout,
        backend=CudaVmmBackend.factory(driver=fake, chunk_bytes=CHUNK),
    )


@pytest.fixture
def fake():
    return FakeDriver()


def _round_trip(pool: kvmem.KVPool, seed: int) -> None:
    ids = torch.tensor([1, PAGES - 1, 7])
    chunk = torch.randint(
        0,
        256,
        (kvmem.packed_nbytes(SPEC, 3),),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(seed),
    )
    kvmem.unpack_pages(chunk, pool, ids)
    assert torch.equal(kvmem.pack_pages(pool, ids), chunk)


def test_fake_pool_maps_every_chunk(fake):
    pool = make_pool(fake)
    assert pool.backend == "cuda_vmm" and pool.nbytes == 8 * CHUNK
    ((ptr, (size, _)),) = fake.reservations.items()
    assert pool._mem.tensor.data_ptr() == ptr and size == 8 * CHUNK
    assert sorted(fake.layout()) == [ptr + i * CHUNK for i in range(8)]
    assert pool.regions() == [(ptr + i * CHUNK, CHUNK) for i in range(8)]
    assert pool.resident_bytes() == fake.physical_bytes() == pool.nbytes
    _round_trip(pool, 1)
    pool.release()
    assert fake.mapped_bytes() == 0 and fake.physical_bytes() == 0 and pool.resident_bytes() == 0
    pool.resume()
    assert fake.mapped_bytes() == pool.nbytes and len(fake.layout()) == 8 and pool.epoch == 1


# --- D: a map or unmap that fails half-way completes or undoes its own work ----------------


def test_resume_out_of_memory_half_way_gives_back_and_retries(fake):
    pool = make_pool(fake)
    ptrs = [b.data_ptr() for b in pool.k_buffer + pool.v_buffer]
    regions = pool.regions()
    pool.release()
    other = fake.hold(fake.capacity - 5 * CHUNK)  # room for 5 of the 8 chunks
    for attempt in range(3):  # every retry fails the same clear way, and leaks nothing
        with pytest.raises(
            PoolMemoryError,
            match=r"cannot map 262144 bytes .* cuda_vmm .*"
            r"cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY .*chunk 6 of 8 .*"
            r"the 5 chunk\(s\) this call had changed were unmapped and "
            r"released again",
        ) as info:
            pool.resume()
        assert info.value.nbytes == pool.nbytes and isinstance(info.value, MemoryError)
        assert fake.mapped_bytes() == 0 and fake.physical_bytes() == 0
        assert pool.released and pool.epoch == 0
        with pytest.raises(ReleasedPoolError):
            pool.k_buffer
    pool.release()  # still counts as released: a no-op, not a stuck pool
    fake.free(other)
    pool.resume()
    assert not pool.released and pool.epoch == 1
    assert fake.mapped_bytes() == pool.nbytes and len(fake.layout()) == 8
    assert [b.data_ptr() for b in pool.k_buffer + pool.v_buffer] == ptrs
    assert pool.regions() == regions
    _round_trip(pool, 2)
    pool.release()
    assert fake.physical_bytes() == 0


def test_unmap_failing_half_way_maps_back_the_same_memory(fake):
    pool = make_pool(fake)
    fill_random(pool._mem.tensor, torch.Generator().manual_seed(3))
    before = fake.layout()  # va -> handle: the same physical memory must come back
    fake.fail("cuMemUnmap", nth=4, code=CUresult.CUDA_ERROR_UNKNOWN)
    with pytest.raises(
        CudaDriverError,
        match=r"cuMemUnmap failed: CUDA_ERROR_UNKNOWN .*"
        r"at chunk 4 of 8; the 3 chunk\(s\) this call had changed were "
        r"mapped back",
    ) as info:
        pool.release()
    assert info.value.code == "CUDA_ERROR_UNKNOWN"
    assert not pool.released and pool.epoch == 0
    assert fake.layout() == before and fake.physical_bytes() == pool.nbytes
    _round_trip(pool, 4)  # the pool is live and usable
    pool.release()  # the retry completes
    assert pool.released and fake.mapped_bytes() == 0 and fake.physical_bytes() == 0


@pytest.mark.parametrize("call", ["cuMemMap", "cuMemSetAccess"])
def test_resume_failing_half_way_in_a_driver_call_is_undone(fake, call):
    pool = make_pool(fake)
    pool.release()
    fake.fail(call, nth=3, code=CUresult.CUDA_ERROR_UNKNOWN)
    with pytest.raises(
        CudaDriverError,
        match=rf"{call} failed: CUDA_ERROR_UNKNOWN .*"
        r"at chunk 3 of 8 .*the 3 chunk\(s\) this call had changed were "
        r"unmapped and released again",
    ):
        pool.resume()
    assert pool.released and fake.mapped_bytes() == 0 and fake.physical_bytes() == 0
    pool.resume()
    assert not pool.released and len(fake.layout()) == 8


def test_handle_that_cannot_be_released_is_kept_and_reused(fake):
    pool = make_pool(fake)
    fake.fail("cuMemRelease", nth=2, code=CUresult.CUDA_ERROR_UNKNOWN)
    with pytest.raises(
        CudaDriverError,
        match=r"cuMemRelease failed: CUDA_ERROR_UNKNOWN .*"
        r"1 chunk handle\(s\) \(first: chunk 2\) could not be released; "
        r"the range is unmapped",
    ):
        pool.release()
    assert pool.released  # nothing is mapped: it must count as released
    assert fake.mapped_bytes() == 0 and fake.physical_bytes() == CHUNK
    with pytest.raises(ReleasedPoolError):
        pool.k_buffer
    created = fake.calls["cuMemCreate"]
    pool.resume()
    assert fake.calls["cuMemCreate"] - created == 7  # the kept handle was mapped again
    assert len(fake.layout()) == 8 and fake.physical_bytes() == pool.nbytes
    pool.release()
    assert fake.physical_bytes() == 0


def test_a_failed_undo_leaves_a_state_the_next_call_continues_from(fake):
    """Out of memory at chunk 6, and then one of the 5 unmaps of the undo fails too: the
    error says so, and the next resume maps only what is missing (no mapping over a
    mapped chunk, which the driver refuses with CUDA_ERROR_INVALID_VALUE)."""
    pool = make_pool(fake)
    pool.release()
    other = fake.hold(fake.capacity - 5 * CHUNK)
    fake.fail("cuMemCreate", nth=6)
    fake.fail("cuMemUnmap", nth=2, code=CUresult.CUDA_ERROR_UNKNOWN)
    with pytest.raises(
        PoolMemoryError,
        match=r"undoing failed for 1 .*1 of 8 chunks are "
        r"mapped now, and the next release/resume continues from there",
    ):
        pool.resume()
    assert pool.released and fake.mapped_bytes() == CHUNK
    states = pool._mem._range.states
    assert states.count(READY) == 1 and states.count(NONE) == 7
    pool.release()  # released, yet holding a chunk: a release gives it back
    assert pool.released and fake.mapped_bytes() == 0 and fake.physical_bytes() == 0
    fake.fail("cuMemCreate", nth=6)
    fake.fail("cuMemUnmap", nth=2, code=CUresult.CUDA_ERROR_UNKNOWN)
    with pytest.raises(PoolMemoryError, match=r"undoing failed for 1"):
        pool.resume()  # the same double fault again
    assert fake.mapped_bytes() == CHUNK
    fake.free(other)
    pool.resume()
    assert not pool.released and len(fake.layout()) == 8
    assert fake.physical_bytes() == pool.nbytes  # nothing leaked on the way
    pool.release()
    assert fake.physical_bytes() == 0 and fake.mapped_bytes() == 0


def test_construction_out_of_memory_leaves_nothing(fake):
    fake.capacity = 3 * CHUNK
    with pytest.raises(
        PoolMemoryError,
        match=r"cannot map 262144 bytes .* for a KV pool of "
        r"32 pages .*cuda_vmm memory backend .*CUDA_ERROR_OUT_OF_MEMORY",
    ):
        make_pool(fake)
    assert fake.empty()
    fake.address_space = CHUNK
    with pytest.raises(
        PoolMemoryError,
        match=r"cannot reserve 262144 bytes .*"
        r"cuMemAddressReserve failed: CUDA_ERROR_OUT_OF_MEMORY",
    ):
        make_pool(fake)
    assert fake.empty()


# --- E: a dropped or closed pool gives everything back ---------------------------------


def test_dropped_pool_frees_everything(fake):
    pool = make_pool(fake)
    _round_trip(pool, 5)
    rng = weakref.ref(pool._mem._range)
    view = pool.k_buffer[1]
    del pool
    gc.collect()
    assert rng() is not None and fake.reservations  # a live view keeps its addresses
    del view
    gc.collect()
    assert rng() is None
    assert fake.empty()


def test_dropped_released_pool_frees_its_reservation(fake):
    pool = make_pool(fake, layout="sglang")
    pool.release()
    del pool
    gc.collect()
    assert fake.empty()


def test_close_frees_everything_and_refuses_every_use(fake):
    pool = make_pool(fake)
    ids = torch.tensor([1, 2])
    chunk = kvmem.pack_pages(pool, ids)
    outside = pool.k_buffer[0]  # a view held elsewhere does not stop close()
    pool.close()
    assert fake.empty()
    assert pool.closed and pool.released
    pool.close()  # idempotent
    assert_closed_pool_refuses(pool, ids, chunk, as_cupy=pool.as_cupy)
    assert "closed" in repr(pool)
    del outside
    gc.collect()
    assert fake.empty()


def test_close_of_a_released_pool(fake):
    pool = make_pool(fake)
    pool.release()
    pool.close()
    assert fake.empty()


def test_close_reports_a_driver_error_and_frees_the_rest(fake):
    pool = make_pool(fake)
    fake.fail("cuMemRelease", nth=1, code=CUresult.CUDA_ERROR_UNKNOWN)
    with pytest.raises(CudaDriverError, match="cuMemRelease failed: CUDA_ERROR_UNKNOWN"):
        pool.close()
    assert pool.closed
    assert fake.mapped_bytes() == 0 and fake.physical_bytes() == CHUNK  # the one it could not
    pool.close()  # idempotent: no second attempt, no error


# --- the chunk plan on the driver: every plane inside one physical allocation -------------


@pytest.mark.parametrize("layout", ["kvmem", "sglang"])
@pytest.mark.parametrize(
    "name, spec",
    [
        (
            "MLA576-fp8-P1",
            kvmem.KVSpec(
                num_layers=5,
                num_kv_heads=1,
                head_dim=576,
                page_size=1,
                dtype=torch.float8_e4m3fn,
                v_head_dim=0,
            ),
        ),
        (
            "MLA576-bf16-P64",
            kvmem.KVSpec(
                num_layers=3,
                num_kv_heads=1,
                head_dim=576,
                page_size=64,
                dtype=torch.bfloat16,
                v_head_dim=0,
            ),
        ),
        ("D128-bf16-P16", kvmem.KVSpec(num_layers=3, num_kv_heads=2, head_dim=128, page_size=16)),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_chunks_hold_whole_planes_on_the_driver(fake, name, spec, layout):
    """576- and 1152-byte tokens do not divide the chunk target: the old cut at multiples
    of it fell inside pages.  Each mapping the driver made is one chunk of the plan, and
    every K/V plane (sglang: K|V block) lies inside one mapping."""
    pages = 53
    del name
    fake.capacity = 64 << 20
    target = 3 * GRAN
    pool = kvmem.KVPool(
        spec,
        pages,
        "cpu",
        layout=layout,
        backend=CudaVmmBackend.factory(driver=fake, chunk_bytes=target),
    )
    base = pool._mem.tensor.data_ptr()
    maps = sorted((va, size) for va, (size, _) in fake.mappings.items())
    plan = pool.plan
    assert maps == [(base + c.offset, c.size) for c in plan.chunks] and len(maps) > 1
    assert pool.regions() == [(base + c.offset, c.nbytes) for c in plan.chunks]
    assert all(c.offset % GRAN == 0 and c.size % GRAN == 0 for c in plan.chunks)
    if layout == "sglang" and spec.has_v:
        blocks = [(k.data_ptr(), k.nbytes + v.nbytes) for k, v in zip(pool.k_buffer, pool.v_buffer)]
    else:
        blocks = [(b.data_ptr(), b.nbytes) for b in pool.k_buffer + pool.v_buffer]
    for a, n in blocks:
        assert sum(va <= a and a + n <= va + size for va, size in maps) == 1, (a, n)
    naive = range(base + target, base + pool.nbytes, target)  # the cut of a fixed chunk size
    page = spec.k_page_bytes
    assert any(a < cut < a + n and (cut - a) % page for a, n in blocks for cut in naive), (
        "this shape would not have straddled: the test proves nothing"
    )
    _round_trip_spec(pool, spec)


def _round_trip_spec(pool, spec) -> None:
    ids = torch.tensor([1, pool.num_pages - 1, 7])
    chunk = torch.randint(
        0,
        256,
        (kvmem.packed_nbytes(spec, 3),),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(3),
    )
    kvmem.unpack_pages(chunk, pool, ids)
    assert torch.equal(kvmem.pack_pages(pool, ids), chunk)


def test_driver_calls_per_release_and_resume_are_per_chunk(fake):
    pool = make_pool(fake)
    n = len(pool.plan.chunks)
    before = dict(fake.calls)
    pool.release()
    pool.resume()
    made = {k: v - before.get(k, 0) for k, v in fake.calls.items() if v != before.get(k, 0)}
    assert made == {
        "cuMemUnmap": n,
        "cuMemRelease": n,
        "cuMemCreate": n,
        "cuMemMap": n,
        "cuMemSetAccess": n,
    }


# --- exportable chunks (POSIX file-descriptor handles) ---------------------------------------


def test_chunks_request_posix_fd_handles_where_supported(fake):
    pool = make_pool(fake)
    assert pool._mem.exportable
    assert {h["handle_types"] for h in fake.handles.values()} == {1}
    info = pool.memory_info()
    assert info["exportable"] and info["handle_type"] == "posix_fd" and info["rdma"]
    assert info["chunks"] == 8 and info["granularity"] == GRAN
    assert fake.calls["cuMemCreate"] == 8 + 1  # the probe, released again
    pool.release()
    pool.resume()
    assert {h["handle_types"] for h in fake.handles.values()} == {1}


def test_no_fd_handles_where_the_device_lacks_them_said_in_a_warning(fake, caplog):
    fake.attributes[
        FakeDriver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
    ] = 0
    with caplog.at_level(logging.WARNING, logger="kvmem.memory.cuda_vmm"):
        pool = make_pool(fake)
    assert not pool._mem.exportable
    assert {h["handle_types"] for h in fake.handles.values()} == {0}
    info = pool.memory_info()
    assert (info["exportable"], info["handle_type"]) == (False, None)
    assert "does not support POSIX file-descriptor handles" in info["not_exportable_because"]
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "kvmem.memory.cuda_vmm"]
    assert "chunks are not exportable" in msg and "cuda_ipc" in msg
    _round_trip(pool, 7)


def test_fd_handles_refused_by_the_driver_fall_back(fake, caplog):
    fake.refuse_fd_handles = CUresult.CUDA_ERROR_NOT_SUPPORTED
    with caplog.at_level(logging.WARNING, logger="kvmem.memory.cuda_vmm"):
        pool = make_pool(fake)
    assert not pool._mem.exportable and len(fake.layout()) == 8
    assert {h["handle_types"] for h in fake.handles.values()} == {0}
    assert "CUDA_ERROR_NOT_SUPPORTED" in pool.memory_info()["not_exportable_because"]
    assert any("CUDA_ERROR_NOT_SUPPORTED" in r.getMessage() for r in caplog.records)
    pool.release()
    pool.resume()  # the fallback holds for the chunks of every resume
    assert {h["handle_types"] for h in fake.handles.values()} == {0}
    _round_trip(pool, 8)


def test_probe_out_of_memory_keeps_fd_handles_and_fails_as_out_of_memory(fake):
    fake.capacity = GRAN - 1  # not even the probe fits
    with pytest.raises(PoolMemoryError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        make_pool(fake)
    assert fake.empty()
