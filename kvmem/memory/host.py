"""Host memory backend: one private anonymous mapping, released with MADV_DONTNEED.

The mapping is ``MAP_PRIVATE | MAP_ANONYMOUS``.  Python's default ``mmap(-1, n)`` is a
*shared* mapping, on which ``MADV_DONTNEED`` only drops this process's page-table entries:
the pages stay in shared memory and the contents survive.  On a private anonymous mapping
the pages go back to the kernel and the next touch faults in zero-filled pages, at the
same address.

The range is marked ``MADV_HUGEPAGE``: with transparent huge pages (``madvise`` mode
here) a release of 2 GiB took 7-10 ms instead of 360-450 ms with 4 KiB pages, and a
two-thread pre-fault 0.26-0.75 s instead of 1.5 s (2 cores, noisy neighbours; the kernel
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

``resident_bytes()`` is measured with ``mincore(2)`` over the mapping: the pages of this
range that are in memory now, not an assumption from the release state.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import resource
import threading

import torch

from kvmem.memory import MemoryBackend

MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
# Not in Python 3.11's mmap module; Linux >= 5.14 (checked on this machine's 6.x kernel).
MADV_POPULATE_WRITE = 23
PAGE = mmap.PAGESIZE
_HUGE = 2 << 20  # pre-fault slices start on huge-page boundaries
# Threads that pre-fault in parallel.  2 threads took 0.26-0.75 s vs 1.5-3.5 s for one on
# this 2-core machine (2 GiB); more than 8 is a guess with no measurement behind it.
_PREFAULT_THREADS = max(1, min(8, os.cpu_count() or 1))

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_libc.mincore.restype = ctypes.c_int
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int
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


def _mlock(addr: int, length: int) -> int:
    """``mlock(2)``: 0 or the errno."""
    return 0 if _libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(length)) == 0 else ctypes.get_errno()


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


class HostBackend(MemoryBackend):
    """Private anonymous mapping of ``nbytes`` (rounded up to the OS page size)."""

    name = "host"
    can_release = True

    def __init__(self, nbytes: int, device: torch.device):
        super().__init__(nbytes, device)
        self._map_bytes = max(PAGE, -(-nbytes // PAGE) * PAGE)
        self._mm = mmap.mmap(-1, self._map_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes)
        self._addr = self.tensor.data_ptr()
        try:
            _madvise(self._addr, self._map_bytes, MADV_HUGEPAGE)
        except OSError:  # no transparent huge pages on this kernel: small pages work too
            pass
        self._vec = None

    def release(self) -> None:
        """Give the physical pages back; the range reads as zeros afterwards."""
        self._check_open("release")
        _madvise(self._addr, self._map_bytes, MADV_DONTNEED)
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
        """Give the physical pages back now and drop the mapping: it is unmapped as soon
        as no view of it is left (unmapping under a live view would make it fault, so
        views still held elsewhere keep the bare address range, with no memory behind it,
        until they go).  Idempotent."""
        if self._mm is None:
            return
        _madvise(self._addr, self._map_bytes, MADV_DONTNEED)
        self.released = True
        self.tensor = None
        self._mm = None
        self._vec = None

    def _check_open(self, what: str) -> None:
        if self._mm is None:
            raise RuntimeError(f"{what}: the host memory backend is closed")

    def prefault(self) -> None:
        """Populate every page of the range now, never changing its contents:
        ``MADV_POPULATE_WRITE`` over slices from several threads, ``mlock``/``munlock``
        where the kernel lacks it, else nothing (see the module docstring).  First touches
        of a fresh range otherwise cost 3-4x more, and UCX's cma writes into untouched
        pages ran 3.5x slower (measured by the demo on this machine).

        Raises:
            OSError: ``MADV_POPULATE_WRITE`` is supported and failed (e.g. ``ENOMEM``: the
                memory is not there); the contents are unchanged.
        """
        self._check_open("prefault")
        step = -(-self._map_bytes // _PREFAULT_THREADS // _HUGE) * _HUGE
        slices = [(off, min(step, self._map_bytes - off))
                  for off in range(0, self._map_bytes, step)]
        errors: list[OSError] = []
        lock_bytes = _lock_slice_bytes(len(slices))

        def populate(off: int, length: int) -> None:
            try:
                try:
                    _madvise(self._addr + off, length, MADV_POPULATE_WRITE)
                    return
                except OSError as e:
                    if e.errno != errno.EINVAL:  # supported, and failed
                        raise
                self._populate_by_lock(off, length, lock_bytes)
            except OSError as e:
                errors.append(e)

        threads = [threading.Thread(target=populate, args=sl) for sl in slices[1:]]
        for t in threads:
            t.start()
        populate(*slices[0])
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
        self._check_open("resident_bytes")
        pages = self._map_bytes // PAGE
        if self._vec is None:
            self._vec = (ctypes.c_ubyte * pages)()
        addr = self.tensor.data_ptr()
        if _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(self._map_bytes), self._vec) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore over the pool's mapping failed: errno {err}")
        flags = torch.frombuffer(self._vec, dtype=torch.uint8)
        return int((flags & 1).sum()) * PAGE
