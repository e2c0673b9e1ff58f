"""A prefill side and a decode side in one process, over two real NIXL agents (UCX), with
a clock the test advances (timeouts), and fault hooks the test sets per request."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import itertools
import mmap
import unittest.mock
import uuid
from dataclasses import dataclass, field

import torch

import kvmem
from kvmem.memory import MemoryBackend
from kvmem.disagg.decode import DecodeFaults, DecodeSide
from kvmem.disagg.prefill import Faults, PrefillSide
from kvmem.demo.synth import Synth
from kvmem.transfer.nixl import NixlEngine

SPEC = kvmem.KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@dataclass
class TestFaults(Faults, DecodeFaults):
    """Faults chosen per request id by the test."""

    withhold: set = field(default_factory=set)
    stall_at: dict = field(default_factory=dict)  # rid -> chunk seq not scheduled
    fail_at: dict = field(default_factory=dict)  # rid -> chunk seq (or "aux") refused
    abort_in_batch: set = field(default_factory=set)

    def withhold_boot(self, rid):
        return rid in self.withhold

    def stall(self, rid, seq):
        return self.stall_at.get(rid) == seq

    def fail_send(self, rid, seq, aux):
        want = self.fail_at.get(rid)
        return want == "aux" if aux else want == seq

    def during_forward(self, side, batch):
        for req, *_ in batch:
            if req.rid in self.abort_in_batch:
                side.abort(req.rid)


_ids = itertools.count()


class ChunkedLanding:
    """A host backend whose ``regions()`` cut its range into ``chunk``-byte pieces, as the
    CUDA VMM backend registers one region per physical chunk (2 GiB there)."""

    def __init__(self, inner, chunk: int):
        self._inner, self._chunk = inner, chunk

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def regions(self) -> list[tuple[int, int]]:
        base, n = self._inner.tensor.data_ptr(), self._inner.nbytes
        return [(base + o, min(self._chunk, n - o)) for o in range(0, n, self._chunk)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long)
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.munmap.restype = ctypes.c_int
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int
_PROT_NONE, _MAP_FIXED, _MAP_NORESERVE, _MADV_DONTNEED = 0, 0x10, 0x4000, 4
_MAP_FAILED = ctypes.c_void_p(-1).value


class SideBySideMappings(MemoryBackend):
    """Host memory made of separate private anonymous mappings side by side, one per
    physical chunk of ``chunk`` bytes (a multiple of the OS page), as the CUDA VMM backend
    maps one physical allocation per chunk into one reserved range: ``tensor`` views the
    whole range, ``regions()`` is one region per mapping.  Registered per region, NIXL
    refuses a descriptor that crosses from one mapping into the next (NIXL_ERR_NOT_FOUND),
    as it does across two physical allocations on a GPU.  For the disagg tests until the
    host backend maps its pools this way itself."""

    name = "side-by-side"
    can_release = True

    def __init__(self, nbytes: int, device: torch.device, chunk: int):
        super().__init__(nbytes, device)
        if chunk <= 0 or chunk % mmap.PAGESIZE:
            raise ValueError(f"chunk must be a positive multiple of {mmap.PAGESIZE}, got {chunk}")
        total = -(-nbytes // chunk) * chunk
        base = _libc.mmap(None, total, _PROT_NONE,
                          mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if base in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"reserving {total} bytes failed")
        self._base, self._total = base, total
        self._chunks = [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]
        for off in range(0, total, chunk):
            got = _libc.mmap(base + off, chunk, mmap.PROT_READ | mmap.PROT_WRITE,
                             mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED, -1, 0)
            if got != base + off:
                err = ctypes.get_errno()
                _libc.munmap(base, total)
                raise OSError(err, f"mapping chunk {off // chunk} at {base + off:#x} failed")
        self.tensor = torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(base),
                                       dtype=torch.uint8)

    def regions(self) -> list[tuple[int, int]]:
        return [(self._base + off, n) for off, n in self._chunks]

    def release(self) -> None:
        for off, n in self._chunks:
            if _libc.madvise(self._base + off, n, _MADV_DONTNEED) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")
        self.released = True

    def resume(self, prefault: bool = True) -> None:
        self.released = False


def side_by_side(chunk: int):
    """A ``make_backend`` stand-in building :class:`SideBySideMappings` of ``chunk``-byte
    mappings (for ``unittest.mock.patch`` of a side's ``make_backend``)."""
    return lambda nbytes, device, kind=None: SideBySideMappings(nbytes, torch.device(device), chunk)


def _landing_backend(chunk: int | None):
    from kvmem.memory import make_backend

    if chunk is None:
        return make_backend
    return lambda nbytes, device, kind=None: ChunkedLanding(make_backend(nbytes, device, kind), chunk)


class Pair:
    """Both sides, wired: metadata exchanged, ready to step."""

    def __init__(self, *, num_pages: int = 97, chunk_tokens: int = 64, max_tokens: int = 512,
                 bootstrap_timeout: float = 30.0, transfer_timeout: float = 30.0,
                 decode_timeout: float = 60.0, staging_chunks: int = 8, spec=SPEC,
                 ready_event=None, landing_chunk: int | None = None,
                 direct_threshold: int | None = None, transfer_mode: str = "push",
                 staging_chunk: int | None = None, done_event=None, device="cpu"):
        """``ready_event``: the prefill's (see PrefillSide); ``landing_chunk``: register
        the decode's landing buffer as regions of that many bytes (ChunkedLanding);
        ``staging_chunk``: the prefill's staging buffer made of separate mappings of that
        many bytes side by side (SideBySideMappings), one region each; ``done_event``: the
        decode's (see DecodeSide); ``device``: where both pools and allocators live (the
        staging and landing buffers follow the pools);
        ``direct_threshold``: the prefill's (None: every chunk packed, 0: every chunk
        written direct, pool pages to pool pages); ``transfer_mode``: both sides' ("pull":
        the decode reads the prefill's pool pages)."""
        tag = f"{uuid.uuid4().hex[:8]}-{next(_ids)}"
        self.clock = Clock()
        self.faults = TestFaults()
        self.spec = spec
        self.synth = Synth(spec, max_tokens)
        self.pe = NixlEngine(f"prefill-{tag}", progress_thread=False)
        self.de = NixlEngine(f"decode-{tag}", progress_thread=False)
        self.finished: dict[int, kvmem.disagg.Reason] = {}
        landing_bytes = kvmem.packed_nbytes(spec, num_pages) + 64 * 1024
        with unittest.mock.patch("kvmem.disagg.decode.make_backend", _landing_backend(landing_chunk)):
            self.decode = DecodeSide(
                kvmem.KVPool(spec, num_pages, device),
                kvmem.PageAllocator(num_pages, spec.page_size, device),
                self.de, self.synth, prefill_peer=self.pe.name, landing_bytes=landing_bytes,
                timeout=decode_timeout, clock=self.clock, faults=self.faults,
                transfer_mode=transfer_mode, done_event=done_event)
        chunk_bytes = kvmem.packed_nbytes(spec, chunk_tokens // spec.page_size)
        staging = (unittest.mock.patch("kvmem.disagg.prefill.make_backend", side_by_side(staging_chunk))
                   if staging_chunk else contextlib.nullcontext())
        with staging:
            self.prefill = PrefillSide(
                kvmem.KVPool(spec, num_pages, device),
                kvmem.PageAllocator(num_pages, spec.page_size, device),
                self.pe, self.synth, decode_peer=self.de.name, chunk_tokens=chunk_tokens,
                staging_bytes=staging_chunks * chunk_bytes + 64 * 64,
                bootstrap_timeout=bootstrap_timeout, transfer_timeout=transfer_timeout,
                clock=self.clock, faults=self.faults, ready_event=ready_event,
                direct_threshold=direct_threshold, transfer_mode=transfer_mode,
                on_finish=lambda rid, reason: self.finished.__setitem__(rid, reason))
        self.pe.add_peer(self.de.local_metadata())
        self.de.add_peer(self.pe.local_metadata())

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.prefill.step()
            self.decode.step()

    def run_until(self, cond, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if cond():
                return
            self.step()
        raise AssertionError(f"condition not reached in {max_steps} steps: "
                             f"prefill {self.prefill.reqs.keys()} decode {self.decode.reqs.keys()}")

    def run_idle(self, max_steps: int = 500) -> None:
        self.run_until(lambda: self.prefill.idle and self.decode.idle, max_steps)
        self.step(2)

    def assert_clean(self) -> None:
        for side in (self.prefill, self.decode):
            audit = side.audit()
            assert audit == {"leaked": {}, "quarantined": {}, "unaccounted": []}, audit
            side.alloc.check_invariants()
            assert side.alloc.num_allocated == 0
        assert self.decode.metrics.bytes_corrupt == 0
        assert self.prefill.arena.used_bytes == 0 and self.decode.arena.used_bytes == 0
        assert self.pe.open_handles() == 0

    def close(self) -> None:
        for side, engine in ((self.prefill, self.pe), (self.decode, self.de)):
            if not engine.closed:
                side.close()
                engine.close()
