"""Host memory backend: the CPU twin of the CUDA VMM backend's chunks.  One address
range, reserved once, mapped as one private anonymous mapping per chunk of its
:class:`~kvmem.memory.plan.ChunkPlan`, released with MADV_DONTNEED.

Layout of the range (``G`` = :data:`GRANULARITY`, 2 MiB, the huge page; chunk ``i`` of
the plan at ``offset_i``, a multiple of ``G``)::

    reserve  mmap(PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE), total + G
             bytes, then trimmed to a G-aligned start
    chunk i  mmap(offset_i, size_i, PROT_READ | PROT_WRITE,
                  MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)
             (the last chunk only up to its used bytes, rounded to the OS page)

so the chunk boundaries, and ``regions()`` (one per chunk), are those a GPU pool of the
same spec gets: a descriptor that spans two chunks fails against NIXL on the CPU as it
would on the GPU.  ``MAP_NORESERVE`` takes no commit charge: a 64 GiB range fits the
address space of a small machine and costs memory only where touched (so a pool larger
than the machine's memory is made, and fails when it is touched or pre-faulted).

Each mapping is ``MAP_PRIVATE | MAP_ANONYMOUS``.  Python's default ``mmap(-1, n)`` is a
*shared* mapping, on which ``MADV_DONTNEED`` only drops this process's page-table entries:
the pages stay in shared memory and the contents survive.  On a private anonymous mapping
the pages go back to the kernel and the next touch faults in zero-filled pages, at the
same address.

Every chunk is marked ``MADV_HUGEPAGE``: with transparent huge pages a release and a
pre-fault are many times faster than with 4 KiB pages (docs/pool.md, "Costs"; the kernel
falls back to small pages when no huge page is free).  Pre-faulting on resume runs
``MADV_POPULATE_WRITE`` over slices of the range from several threads (``madvise`` through
ctypes releases the GIL); the page faults are the cost, and they parallelise.

A pre-fault never changes the contents, even while other threads write to the range.
Where the kernel lacks ``MADV_POPULATE_WRITE`` (before 5.14: ``EINVAL``), pages are
populated by ``mlock`` + ``munlock`` of sub-slices that fit ``RLIMIT_MEMLOCK``: locking a
private writable range write-faults every page in (the kernel breaks copy-on-write, as a
write would) without any store from us, and unlocking leaves them resident.  Where
``mlock`` is refused too (``EPERM``/``ENOMEM``/``EAGAIN``, e.g. a limit of 0) the rest of
the range is left to fault at first touch: a read touch would only map the shared zero
page, and a store, even of the value just read, could overwrite a concurrent writer's.

``release()`` is one ``MADV_DONTNEED`` per chunk; ``prefault()`` populates every chunk
whole, padding included, so that a resumed pool holds what a GPU pool holds (every
allocation backed).  ``resident_bytes()`` is measured with ``mincore(2)`` over the chunks'
mappings: the pages of this range that are in memory now, not an assumption from the
release state.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import resource
import threading
import weakref

import torch

from kvmem.memory.backend import MAX_BYTES, MemoryBackend, range_tensor
from kvmem.memory.plan import chunk_target, plan_range

MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
# Not in Python 3.11's mmap module; Linux >= 5.14 (checked on this machine's 6.x kernel).
MADV_POPULATE_WRITE = 23
PAGE = mmap.PAGESIZE
_HUGE = 2 << 20  # pre-fault slices start on huge-page boundaries
# Chunk alignment of the host twin: the huge page (2 MiB on x86-64), as CUDA's allocation
# granularity is 2 MiB on current GPUs.
GRANULARITY = _HUGE
_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # not in Python 3.11's mmap
_MAP_ANON = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
# Threads that pre-fault in parallel.  2 threads took 0.26-0.75 s vs 1.5-3.5 s for one on
# this 2-core machine (2 GiB); more than 8 is a guess with no measurement behind it.
_PREFAULT_THREADS = max(1, min(8, os.cpu_count() or 1))

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_libc.mincore.restype = ctypes.c_int
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.munmap.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value
for _fn in (_libc.mlock, _libc.munlock):
    _fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    _fn.restype = ctypes.c_int
# mlock sub-slice when RLIMIT_MEMLOCK is unlimited: a guess (a huge page's multiple small
# enough that a locked slice is never a noticeable share of memory), not measured.
_LOCK_SLICE_UNLIMITED = 16 * _HUGE


def _madvise(addr: int, length: int, advice: int) -> None:
    if _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise({advice}) over {length} bytes failed: {os.strerror(err)}")


def _mmap(addr: int, length: int, prot: int, flags: int) -> int:
    """``mmap(2)`` of anonymous memory: the address, or OSError with the errno."""
    if length > MAX_BYTES:
        raise OverflowError(f"mmap of {length} bytes: more than {MAX_BYTES}")
    p = _libc.mmap(ctypes.c_void_p(addr or None), ctypes.c_size_t(length), prot, flags, -1, 0)
    if p is None or p == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {length} bytes failed: {os.strerror(err)}")
    return int(p)


def _munmap(addr: int, length: int) -> None:
    if length and _libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(length)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap of {length} bytes failed: {os.strerror(err)}")


def _mlock(addr: int, length: int) -> int:
    """``mlock(2)``: 0 or the errno."""
    return (
        0
        if _libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(length)) == 0
        else ctypes.get_errno()
    )


def _munlock(addr: int, length: int) -> None:
    if _libc.munlock(ctypes.c_void_p(addr), ctypes.c_size_t(length)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munlock over {length} bytes failed: {os.strerror(err)}")


def _lock_slice_bytes(threads: int) -> int:
    """Bytes one thread may lock at a time so that ``threads`` of them stay within
    ``RLIMIT_MEMLOCK`` (0: locking is not possible)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return _LOCK_SLICE_UNLIMITED
    # Other locked memory of the process counts against the same limit: use half of it.
    per_thread = soft // 2 // max(1, threads)
    return per_thread // PAGE * PAGE


class _HostRange:
    """A reserved range of ``total`` bytes starting on a ``GRANULARITY`` boundary, and its
    chunk mappings.  Holds no tensor; unmapped by its finalizer once it is garbage (views
    keep it alive through :class:`~kvmem.memory.RangeArray`)."""

    def __init__(self, total: int, spans: list[tuple[int, int]]):
        raw = _mmap(0, total + GRANULARITY, _PROT_NONE, _MAP_ANON)
        addr = -(-raw // GRANULARITY) * GRANULARITY
        try:
            _munmap(raw, addr - raw)  # trim the slack before and after the aligned range
            _munmap(addr + total, raw + GRANULARITY - addr)
            for off, n in spans:
                _mmap(addr + off, n, _PROT_RW, _MAP_ANON | _MAP_FIXED)
        except BaseException:
            _munmap(addr, total)
            raise
        self.addr, self.total = addr, total
        self._finalizer = weakref.finalize(self, _munmap, addr, total)
        self._finalizer.atexit = False  # at exit the process's mappings go anyway


class HostBackend(MemoryBackend):
    """Private anonymous mappings, one per chunk of the range's plan (module docstring).

    Args:
        nbytes: bytes of a plain range (ignored with ``planner``: the plan's).
        device: the CPU.
        planner: ``planner(granularity, target) -> ChunkPlan`` (a pool's plan); None: the
            range is cut every ``target`` bytes.
        chunk_bytes: the chunk target (default: ``$KVMEM_CHUNK_BYTES``, else 2 GiB).
    """

    name = "host"
    can_release = True

    def __init__(
        self, nbytes: int, device: torch.device, *, planner=None, chunk_bytes: int | None = None
    ):
        target = chunk_target(chunk_bytes)
        plan = (
            planner(GRANULARITY, target)
            if planner is not None
            else plan_range(nbytes, GRANULARITY, target)
        )
        super().__init__(plan.nbytes, device, plan)
        last = len(plan.chunks) - 1
        # (offset, bytes mapped) of each chunk: its allocation, the last one only up to
        # its used bytes (nothing after the range needs memory)
        self._spans = [
            (c.offset, c.size if i < last else max(PAGE, -(-c.nbytes // PAGE) * PAGE))
            for i, c in enumerate(plan.chunks)
        ]
        total = self._spans[-1][0] + self._spans[-1][1]
        self._range: _HostRange | None = _HostRange(total, self._spans)
        self._addr = self._range.addr
        for off, n in self._spans:
            try:
                _madvise(self._addr + off, n, MADV_HUGEPAGE)
            except OSError:  # no transparent huge pages on this kernel: small pages work too
                break
        self.tensor = range_tensor(self._addr, plan.nbytes, self._range, device)
        self._vec = None

    def release(self) -> None:
        """Give the physical pages back, one ``MADV_DONTNEED`` per chunk; the range reads
        as zeros afterwards."""
        self._check_open("release")
        for off, n in self._spans:
            _madvise(self._addr + off, n, MADV_DONTNEED)
        self.released = True

    def resume(self, prefault: bool = True) -> None:
        """Nothing to map on the host: the next touch faults pages in.  With ``prefault``
        they are populated now (:meth:`prefault`), so the first use pays no faults; if
        that raises, the backend stays released."""
        self._check_open("resume")
        if prefault:
            self.prefault()
        self.released = False

    def close(self) -> None:
        """Give the physical pages back now and drop the mappings: they are unmapped as
        soon as no view of them is left (unmapping under a live view would make it fault,
        so views still held elsewhere keep the bare address range, with no memory behind
        it, until they go).  Idempotent."""
        if self._range is None:
            return
        for off, n in self._spans:
            _madvise(self._addr + off, n, MADV_DONTNEED)
        self.released = True
        self.tensor = None
        self._range = None
        self._vec = None

    def _check_open(self, what: str) -> None:
        if self._range is None:
            raise RuntimeError(f"{what}: the host memory backend is closed")

    def prefault(self) -> None:
        """Populate every page of every chunk now, never changing the contents:
        ``MADV_POPULATE_WRITE`` over slices from several threads, ``mlock``/``munlock``
        where the kernel lacks it, else nothing (see the module docstring).  First touches
        of a fresh range otherwise cost several times more, also for UCX's cma writes
        (docs/pool.md, "Costs").

        Raises:
            OSError: ``MADV_POPULATE_WRITE`` is supported and failed (e.g. ``ENOMEM``: the
                memory is not there); the contents are unchanged.
        """
        self._check_open("prefault")
        mapped = sum(n for _, n in self._spans)
        step = -(-mapped // _PREFAULT_THREADS // _HUGE) * _HUGE
        pieces = [
            (o, min(step, off + n - o)) for off, n in self._spans for o in range(off, off + n, step)
        ]
        nthreads = min(_PREFAULT_THREADS, len(pieces))
        errors: list[OSError] = []
        lock_bytes = _lock_slice_bytes(nthreads)

        def populate(mine) -> None:
            try:
                for off, length in mine:
                    try:
                        _madvise(self._addr + off, length, MADV_POPULATE_WRITE)
                        continue
                    except OSError as e:
                        if e.errno != errno.EINVAL:  # supported, and failed
                            raise
                    self._populate_by_lock(off, length, lock_bytes)
            except OSError as e:
                errors.append(e)

        threads = [
            threading.Thread(target=populate, args=(pieces[t::nthreads],))
            for t in range(1, nthreads)
        ]
        for t in threads:
            t.start()
        populate(pieces[0::nthreads])
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _populate_by_lock(self, off: int, length: int, lock_bytes: int) -> None:
        """Write-fault ``[off, off + length)`` in by locking and unlocking sub-slices of
        ``lock_bytes``; stop quietly where locking is refused (the pages then fault at
        first touch).  No store: concurrent writers are never overwritten."""
        if lock_bytes <= 0:
            return
        end = off + length
        while off < end:
            n = min(lock_bytes, end - off)
            err = _mlock(self._addr + off, n)
            if err in (errno.EPERM, errno.ENOMEM, errno.EAGAIN):
                return
            if err:
                raise OSError(err, f"mlock over {n} bytes failed: {os.strerror(err)}")
            _munlock(self._addr + off, n)
            off += n

    def resident_bytes(self) -> int:
        """Bytes of the chunks' mappings in memory now (``mincore``), padding included."""
        self._check_open("resident_bytes")
        if self._vec is None:
            self._vec = (ctypes.c_ubyte * (max(n for _, n in self._spans) // PAGE))()
        flags = torch.frombuffer(self._vec, dtype=torch.uint8)
        total = 0
        for off, n in self._spans:
            if _libc.mincore(ctypes.c_void_p(self._addr + off), ctypes.c_size_t(n), self._vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore over the pool's mapping failed: errno {err}")
            total += int((flags[: n // PAGE] & 1).sum()) * PAGE
        return total
