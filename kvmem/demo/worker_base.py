"""What both kinds of ``kvmem demo`` worker share: the pipe to the parent, the start-up
exchange, the loop's pacing, the stage clock and the final report.

Contract: :class:`Worker` is the base of :class:`~kvmem.demo.prefill_worker.PrefillWorker`
and :class:`~kvmem.demo.decode_worker.DecodeWorker`.  It makes what every worker owns (the
NIXL engine without a progress thread, the synth, the fault plan, the stage clock, the
backoff), speaks the pipe protocol of :mod:`kvmem.demo.worker` (``send``, and ``recv``,
which refuses any message but the one awaited), runs the start-up (the peers' metadata,
the bandwidth phase of worker 0 of each kind) and audits and closes the side and the
engine at the end (``final``).  A subclass makes its side and drives its workload.  The
pacing constants below are the loops' (docs/demo.md, "Pacing").
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

import torch

PROGRESS_EVERY = 0.2  # seconds between progress messages
PIPE_EVERY = 0.002  # seconds between polls of the parent's pipe in the workload loops (a
# poll is a syscall; the loop runs every few microseconds when busy).  Not measured: any
# value well under the 0.2 s progress period would do; a pause request waits this long.
# A loop step that made no progress (nothing arrived, posted, ended or computed): after
# NAP_SPINS such steps in a row the loop sleeps, doubling from NAP_FIRST to NAP_MOST, and
# stops at the first step that progresses (kvmem.disagg.pacing.Backoff).  Why these
# values: docs/demo.md, "Pacing".
NAP_FIRST, NAP_MOST, NAP_SPINS = 5e-6, 200e-6, 1
# Over TCP (--hosts netns) the kernel moves the bytes (socket copies, the veth's softirq)
# and UCX only needs its worker polled now and then, so a loop that spins while its
# transfers are in flight takes the core the kernel needs: with TCP the loops nap (as
# above) also then, and the raw bandwidth phase naps NAP_MOST between polls on both
# sides (docs/demo.md, "Pacing").  On one host UCX copies by cross-memory attach inside the
# poll that drives it: there the loops keep spinning while a transfer is in flight.
NAP_WHILE_MOVING = {"one": False, "netns": True}


class StageClock:
    """Seconds spent in named calls of one worker, measured by wrapping bound methods of
    the worker's own objects (the pool, the synth, the engine, the side): the real calls,
    timed; nothing else changes.  One thread per worker, so the times add up."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)
        seconds, calls, clock = self.seconds, self.calls, time.perf_counter

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] += clock() - t0
                calls[name] += 1

        setattr(obj, attr, timed)

    def as_dict(self) -> dict:
        return {k: {"seconds": self.seconds[k], "calls": self.calls[k]} for k in self.seconds}


def _pattern(nbytes: int, seed: int) -> torch.Tensor:
    """uint8 [nbytes]: every 8-byte word different (a misplaced word shows)."""
    base = (seed % (1 << 20)) << 40
    return torch.arange(base, base + nbytes // 8, dtype=torch.int64).view(torch.uint8)


class Worker:
    """What a prefill and a decode worker share (module docstring)."""

    role = "?"
    polling = False  # recv() drives the engine meanwhile (the raw bandwidth writes need it)

    if TYPE_CHECKING:  # what PrefillWorker and DecodeWorker provide
        side: Any

        def bandwidth(self) -> None: ...

        def snapshot(self) -> dict: ...

    def __init__(self, cfg, conn, names: dict, index: int = 0):
        """``names``: {"prefill": [agent names], "decode": [agent names]}, every worker's;
        ``index``: this worker's among its kind."""
        from kvmem.disagg.pacing import Backoff
        from kvmem.demo.faults import FaultPlan
        from kvmem.demo.synth import Synth
        from kvmem.transfer.nixl import NixlEngine

        self.cfg, self.conn, self.names, self.index = cfg, conn, names, index
        self.name = names[self.role][index]
        self.setup = {}
        self.spec = cfg.spec()
        t = time.monotonic()
        self.engine = NixlEngine(self.name, progress_thread=False)
        self.setup["nixl agent"] = time.monotonic() - t
        self.synth = Synth(self.spec, cfg.max_tokens, cfg.seed)
        self.plan = FaultPlan(
            seed=cfg.seed,
            rates=cfg.rates(),
            chunk_tokens=cfg.chunk_tokens,
            max_tokens=cfg.max_tokens,
            min_tokens=1,
            wait=cfg.abort_wait,
        )
        self.clock = StageClock()
        self.bw_buf: torch.Tensor | None = None
        self.t_progress = 0.0
        self.stages: dict | None = None  # the stage clock when this worker's work was done
        # naps of the workload loop; instrument() times its sleeps as the stage "nap"
        self.backoff = Backoff(NAP_FIRST, NAP_MOST, NAP_SPINS)
        self.nap_moving = NAP_WHILE_MOVING[cfg.hosts]  # nap while our transfers move
        self.cpu_seconds: float | None = (
            None  # CPU time of the workload (process_time, all threads)
        )
        self.cpu0 = 0.0

    # --- pipe -----------------------------------------------------------------------------
    def send(self, kind: str, payload=None) -> None:
        self.conn.send((kind, payload))

    def recv(self, want: str, timeout: float = 300.0):
        """Block (polling the engine's notifications: no progress thread) until the parent
        sends ``want``; its payload."""
        end = time.monotonic() + timeout
        while True:
            wait = (NAP_MOST if self.nap_moving else 0.0) if self.polling else 0.05
            if self.conn.poll(wait):
                kind, payload = self.conn.recv()
                if kind != want:
                    raise RuntimeError(
                        f"{self.role} worker: expected {want!r} from the parent, got {kind!r}"
                    )
                return payload
            if self.polling:
                self.engine.get_notifs()
            if time.monotonic() > end:
                raise TimeoutError(
                    f"{self.role} worker: no {want!r} from the parent in {timeout:.0f} s"
                )

    # --- start-up ---------------------------------------------------------------------------
    def populate(self) -> None:
        """Back the pool and the staging / landing buffer now: the workload's first
        requests then pay no page faults (cma writes into fresh pages ran 3.5x slower)."""
        t = time.monotonic()
        self.side.prefault()
        self.setup["populate"] = self.setup.get("populate", 0.0) + time.monotonic() - t

    def start(self) -> dict:
        """Start-up: the peers' metadata, the bandwidth phase (worker 0 of each kind), the
        stage clock; returns ``start``'s payload."""
        first = self.index == 0  # the raw bandwidth runs between prefill 0 and decode 0
        n = self.cfg.bw_mib << 20 if first else 0
        if n:
            self.bw_buf = (
                _pattern(n, self.cfg.seed)
                if self.role == "prefill"
                else torch.zeros(n, dtype=torch.uint8)
            )
            self.engine.register("bw", [(self.bw_buf.data_ptr(), n)], 0)
        self.send("ready", {"metadata": self.engine.local_metadata(), "setup": self.setup})
        for blob in self.recv("peer"):
            self.engine.add_peer(blob)
        if first and (n or self.cfg.calibrates()):  # the raw bandwidth and/or the calibration
            self.bandwidth()
        if n:
            self.engine.deregister("bw")
            self.bw_buf = None
        self.instrument()
        return self.recv("start") or {}

    TIMED: tuple = ()  # (attribute of the side, method, stage label), per kind of worker

    def instrument(self) -> None:
        """Time the side's step, the loop's naps and the calls of :attr:`TIMED`."""
        c, s = self.clock, self.side
        c.wrap(s, "step", "step")
        c.wrap(self.backoff, "sleep", "nap")
        for attr, method, label in self.TIMED:
            c.wrap(getattr(s, attr), method, label)

    def final(self) -> dict:
        side, alloc = self.side, self.side.alloc
        audit = side.audit()
        held = {
            str(o): len(p)
            for o, p in list(audit["leaked"].items()) + list(audit["quarantined"].items())
        }
        out = dict(
            audit={
                "leaked": {str(k): v for k, v in audit["leaked"].items()},
                "quarantined": {str(k): v for k, v in audit["quarantined"].items()},
                "unaccounted": audit["unaccounted"],
            },
            leaked_pages=sum(held.values()) + len(audit["unaccounted"]),
            leaked_owners=held,
            allocator_allocated=int(alloc.num_allocated),
            arena_used_bytes=int(side.arena.used_bytes),
            open_handles=int(self.engine.open_handles()),
            metrics=side.metrics.as_dict(),
            chunk_modes=dict(side.chunk_modes),
            direct_threshold=getattr(side, "direct_threshold", None),
            freed_by_reason=dict(side.ledger.freed_by_reason),
            stage_seconds=self.stages if self.stages is not None else self.clock.as_dict(),
            cpu_seconds=self.cpu_seconds,
        )
        alloc.check_invariants()
        side.close()
        self.engine.close(timeout=10.0)
        out["closed"] = True
        return out

    def freeze_clock(self, loop_seconds: float) -> None:
        """Keep the stage times and the CPU time of the workload (the idle steps until stop
        are not)."""
        self.cpu_seconds = time.process_time() - self.cpu0
        self.clock.seconds["loop"] += loop_seconds
        self.clock.calls["loop"] += 1
        self.stages = self.clock.as_dict()

    def progress(self, force: bool = False) -> None:
        t = time.monotonic()
        if force or t - self.t_progress >= PROGRESS_EVERY:
            self.t_progress = t
            self.send("progress", self.snapshot())
