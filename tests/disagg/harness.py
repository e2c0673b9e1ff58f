"""A prefill side and a decode side in one process, with a clock the test advances
(timeouts), and fault hooks the test sets per request.

The two sides talk over two loopback engines (kvmem.transfer.loopback: the engine rules
of kvmem.transfer, bytes copied within the process, states that settle on poll), or over
two real NIXL agents (UCX) where a test asks for ``engine="nixl"`` (what NIXL itself
refuses, raw NIXL calls), where the pools are on a CUDA device (VRAM), or for every test
when ``KVMEM_TEST_ENGINE=nixl`` is set: the lifecycle suite then runs over real NIXL as
it did before the loopback engine.  tests/transfer/test_engine_contract.py holds both
engines to the same rules.  NIXL engines borrow session-long agents
(tests/nixl_agents.py)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import itertools
import mmap
import os
import unittest.mock
import uuid
from dataclasses import dataclass, field

import torch

import kvmem
from kvmem.memory import MemoryBackend
from kvmem.disagg.decode import DecodeFaults, DecodeSide
from kvmem.disagg.prefill import Faults, PrefillSide
from kvmem.demo.synth import Synth
from kvmem.transfer.loopback import LoopbackEngine

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

ENGINES = ("loopback", "nixl")
# The lifecycle modes every row runs in: push with chunks packed into the landing region,
# push with chunks written direct (pool pages to the decode's pool pages; threshold 0:
# every chunk), and pull (the decode reads the prefill's pool pages).
MODES = {"packed": {}, "direct": {"direct_threshold": 0}, "pull": {"transfer_mode": "pull"}}


def engine_kind(engine: str | None = None, device="cpu") -> str:
    """The engine a pair runs over: ``engine`` when given; else NIXL for CUDA pools (the
    loopback engine moves host memory only); else ``KVMEM_TEST_ENGINE`` (``loopback`` by
    default, ``nixl`` to run the lifecycle suite over real NIXL)."""
    if engine is None:
        if torch.device(device).type == "cuda":
            engine = "nixl"
        else:
            engine = os.environ.get("KVMEM_TEST_ENGINE", "loopback")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    return engine


def make_engines(engine: str | None = None, device="cpu", tag: str = "pair"):
    """``(prefill engine, decode engine)`` of kind :func:`engine_kind`: loopback engines
    named after ``tag``, or NIXL engines over session-long agents (close them with
    :func:`close_engines`)."""
    if engine_kind(engine, device) == "nixl":
        from tests.nixl_agents import POOL

        return POOL.engine(), POOL.engine()
    uid = f"{uuid.uuid4().hex[:8]}-{next(_ids)}"
    # settle_polls=2: a transfer outlives the poll in the step that posted it (a side
    # polls what it posted before its step ends), as NIXL's do here; with 1, a pull read
    # would never be in flight between two steps.
    return (
        LoopbackEngine(f"{tag}-prefill-{uid}", settle_polls=2),
        LoopbackEngine(f"{tag}-decode-{uid}", settle_polls=2),
    )


def close_engines(*engines) -> None:
    """Close each engine; NIXL ones give their agents back to the session's pool (all of
    a test's together: see tests/nixl_agents.py)."""
    nixl = [e for e in engines if e.kind == "nixl"]
    if nixl:
        from tests.nixl_agents import POOL

        POOL.give_back(*nixl)
    for e in engines:
        if not e.closed:
            e.close()


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
        base = _libc.mmap(
            None, total, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0
        )
        if base in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"reserving {total} bytes failed")
        self._base, self._total = base, total
        self._chunks = [(off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk)]
        for off in range(0, total, chunk):
            got = _libc.mmap(
                base + off,
                chunk,
                mmap.PROT_READ | mmap.PROT_WRITE,
                mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED,
                -1,
                0,
            )
            if got != base + off:
                err = ctypes.get_errno()
                _libc.munmap(base, total)
                raise OSError(err, f"mapping chunk {off // chunk} at {base + off:#x} failed")
        self.tensor = torch.frombuffer(
            (ctypes.c_ubyte * nbytes).from_address(base), dtype=torch.uint8
        )

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
    return lambda nbytes, device, kind=None: ChunkedLanding(
        make_backend(nbytes, device, kind), chunk
    )


class Pair:
    """Both sides, wired: metadata exchanged, ready to step."""

    def __init__(
        self,
        *,
        num_pages: int = 97,
        chunk_tokens: int = 64,
        max_tokens: int = 512,
        bootstrap_timeout: float = 30.0,
        transfer_timeout: float = 30.0,
        decode_timeout: float = 60.0,
        staging_chunks: int = 8,
        spec=SPEC,
        ready_event=None,
        landing_chunk: int | None = None,
        direct_threshold: int | None = None,
        transfer_mode: str = "push",
        staging_chunk: int | None = None,
        done_event=None,
        device="cpu",
        engine: str | None = None,
    ):
        """``ready_event``: the prefill's (see PrefillSide); ``landing_chunk``: register
        the decode's landing buffer as regions of that many bytes (ChunkedLanding);
        ``staging_chunk``: the prefill's staging buffer made of separate mappings of that
        many bytes side by side (SideBySideMappings), one region each; ``done_event``: the
        decode's (see DecodeSide); ``device``: where both pools and allocators live (the
        staging and landing buffers follow the pools);
        ``direct_threshold``: the prefill's (None: every chunk packed, 0: every chunk
        written direct, pool pages to pool pages); ``transfer_mode``: both sides' ("pull":
        the decode reads the prefill's pool pages); ``engine``: ``"loopback"`` or
        ``"nixl"`` (None: :func:`engine_kind` chooses).  ``ready_event`` and
        ``done_event`` stay readable as attributes."""
        self.clock = Clock()
        self.faults = TestFaults()
        self.spec = spec
        self.synth = Synth(spec, max_tokens)
        self.ready_event, self.done_event = ready_event, done_event
        self.engine = engine_kind(engine, device)
        self.pe, self.de = make_engines(self.engine, device)
        self.finished: dict[int, kvmem.disagg.Reason] = {}
        landing_bytes = kvmem.packed_nbytes(spec, num_pages) + 64 * 1024
        with unittest.mock.patch(
            "kvmem.disagg.decode_memory.make_backend", _landing_backend(landing_chunk)
        ):
            self.decode = DecodeSide(
                kvmem.KVPool(spec, num_pages, device),
                kvmem.PageAllocator(num_pages, spec.page_size, device),
                self.de,
                self.synth,
                prefill_peer=self.pe.name,
                landing_bytes=landing_bytes,
                timeout=decode_timeout,
                clock=self.clock,
                faults=self.faults,
                transfer_mode=transfer_mode,
                done_event=done_event,
            )
        chunk_bytes = kvmem.packed_nbytes(spec, chunk_tokens // spec.page_size)
        staging = (
            unittest.mock.patch(
                "kvmem.disagg.prefill_staging.make_backend", side_by_side(staging_chunk)
            )
            if staging_chunk
            else contextlib.nullcontext()
        )
        with staging:
            self.prefill = PrefillSide(
                kvmem.KVPool(spec, num_pages, device),
                kvmem.PageAllocator(num_pages, spec.page_size, device),
                self.pe,
                self.synth,
                decode_peer=self.de.name,
                chunk_tokens=chunk_tokens,
                staging_bytes=staging_chunks * chunk_bytes + 64 * 64,
                bootstrap_timeout=bootstrap_timeout,
                transfer_timeout=transfer_timeout,
                clock=self.clock,
                faults=self.faults,
                ready_event=ready_event,
                direct_threshold=direct_threshold,
                transfer_mode=transfer_mode,
                on_finish=lambda rid, reason: self.finished.__setitem__(rid, reason),
            )
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
        raise AssertionError(
            f"condition not reached in {max_steps} steps: "
            f"prefill {self.prefill.reqs.keys()} decode {self.decode.reqs.keys()}"
        )

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

    def vanish_decode(self) -> None:
        """The decode side goes away as its process would: its side and engine closed,
        and a NIXL engine's agent destroyed (a session-long agent merely given back would
        keep answering)."""
        self.decode.close()
        if self.de.kind == "nixl":
            from tests.nixl_agents import POOL

            POOL.discard(self.de)
        else:
            self.de.close()

    def close(self) -> None:
        for side, engine in ((self.prefill, self.pe), (self.decode, self.de)):
            if not engine.closed:
                side.close()
        close_engines(self.pe, self.de)
