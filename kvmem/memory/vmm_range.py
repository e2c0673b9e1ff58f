"""A reserved device address range and the physical chunks mapped under it, through the
CUDA driver's virtual memory management API, with every chunk's state recorded.

Contract: :class:`VmmRange` reserves the range once and holds no tensor; its finalizer
(or :meth:`VmmRange.close`) waits for the device, unmaps and releases every chunk and
frees the reservation.  :meth:`VmmRange.map_all` and :meth:`VmmRange.unmap_all` are all
or nothing, as below.  The memory backend over it: :mod:`kvmem.memory.cuda_vmm`.

Partial failure.  Each chunk steps through NONE -> HELD (``cuMemCreate``) -> MAPPED
(``cuMemMap``) -> READY (``cuMemSetAccess``), and its state is recorded after every
successful driver call.  :meth:`VmmRange.map_all` and :meth:`VmmRange.unmap_all` either
complete or undo what they did themselves (a resume that runs out of memory after 20 of 32
chunks unmaps and frees those 20; an unmap that fails half-way maps the chunks it had
unmapped back, with their memory and contents), so the caller can free memory and retry.
If an undo fails too, the recorded states still say exactly what is mapped, and the next
call continues from there instead of mapping over a mapped chunk.
"""

from __future__ import annotations

import threading
import weakref

from kvmem.errors import CudaDriverError, PoolMemoryError
from kvmem.memory.cuda_driver import OOM, call

# Chunk states (see the module docstring).
NONE, HELD, MAPPED, READY = 0, 1, 2, 3


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
        call(st.drv, "cuMemUnmap", st.ptr + off, size, what=f"chunk at offset {off}")
        st.states[i] = HELD
    if st.states[i] == HELD and target == NONE:
        call(st.drv, "cuMemRelease", st.handles[i], what=f"chunk at offset {off}")
        st.handles[i] = None
        st.states[i] = NONE


def _raise(st: _State, i: int) -> None:
    """Take chunk ``i`` up to READY, reusing a handle it still holds."""
    off, size = st.chunks[i]
    drv = st.drv
    if st.states[i] == NONE:
        st.handles[i] = call(drv, "cuMemCreate", size, st.prop, 0, what=f"{size} bytes")
        st.states[i] = HELD
    if st.states[i] == HELD:
        call(
            drv, "cuMemMap", st.ptr + off, size, 0, st.handles[i], 0, what=f"chunk at offset {off}"
        )
        st.states[i] = MAPPED
    if st.states[i] == MAPPED:
        call(
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
                call(st.drv, "cuMemAddressFree", st.ptr, st.size)
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
            st.ptr = int(call(drv, "cuMemAddressReserve", size, alignment, 0, 0))
        except CudaDriverError as e:
            if e.code == OOM:
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
                if e.code == OOM:
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
                first, err = errors[0]
                raise CudaDriverError(
                    err.call,
                    err.code,
                    f"{err.detail}; {len(errors)} chunk handle(s) (first: chunk {first + 1}) "
                    "could not be released; the range is unmapped, and they are reused by the "
                    "next resume or freed by close",
                ) from err

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
