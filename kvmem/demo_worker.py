"""The two worker processes of ``kvmem demo`` (started by :mod:`kvmem.demo` with the
'spawn' context; this module is what each child imports).

Each worker owns a KVPool (host backend), a PageAllocator, a NixlEngine (UCX over
loopback, no progress thread: the loops poll) and one side of the PD lifecycle
(:class:`~kvmem.disagg.PrefillSide` or :class:`~kvmem.disagg.DecodeSide`).  After the
start-up exchange below, every PD control message travels as a NIXL notification inside
the sides; the pipe to the parent carries only the orchestration (start, pause, stop) and
the counters.

Pipe messages, ``(kind, payload)``::

    worker -> parent                        parent -> worker
    ("ready", {metadata, setup times})      ("peer", the other worker's metadata)
    ("bw_listening", None)      decode      ("bw_listen", None)     decode: poll notifs
    ("bw_result", {...})        prefill     ("bw_run", None)        prefill: timed writes
    ("bw_checked", {...})       decode      ("bw_end", None)        decode: check the bytes
    ("progress", {...})         ~5 per s    ("start", None)         the workload begins
    ("pause_decode", i)         prefill     ("pause", i)            decode: pause i now
    ("resumed", i)              decode      ("decode_resumed", i)   prefill: pause i done
    ("done", None)              own work finished, still stepping
    ("final", {...})            after ("stop", None): audit, close, counters
    ("error", traceback)        then the worker exits with status 1

Pauses are decided by the prefill worker from its count of finished requests, one at a
time, alternating sides: pause ``i`` starts when ``thresholds[i]`` requests have finished
(even ``i``: the prefill pauses itself; odd ``i``: it asks the decode through the parent,
and keeps stepping, which is what lets the decode's pause complete: the prefill drains
its writes into the decode and acknowledges).  Admission stops at ``thresholds[i + 1] +
concurrency`` until pause ``i`` is over, so every pause happens with traffic in flight and
none is left for after the last request.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from collections import Counter

import torch

PROGRESS_EVERY = 0.2  # seconds between progress messages
PIPE_EVERY = 0.002  # seconds between polls of the parent's pipe in the workload loops (a
# poll is a syscall; the loop runs every few microseconds when busy).  Not measured: any
# value well under the 0.2 s progress period would do; a pause request waits this long.
# A loop step that made no progress (nothing arrived, posted, ended or computed): after
# NAP_SPINS such steps in a row the loop sleeps, doubling from NAP_FIRST to NAP_MOST, and
# stops at the first step that progresses (kvmem.disagg.common.Backoff).  Measured on this
# 2-core VM, 2026-11-30, quiet (others 0.02-0.04 core): a prefill step while it only waits
# for PULLED answers takes ~34 us (pull, faults off, 200 requests: 28-38k steps in a
# 1.16 s loop, each polling get_notifs; 5-8% of the loop in get_notifs), so one spin
# catches an answer that is already on its way without a sleep; a sleep's real length
# here is its value plus the 50 us timer slack (time.sleep median of 2000: 2 us -> 67 us,
# 20 us -> 85 us, 200 us -> 266 us), so NAP_FIRST only sets where the doubling starts.
# NAP_MOST keeps the earlier idle cap (the measurement: a 50 us backoff did not
# change throughput): a waiting loop polls every ~0.27 ms, against chunks of 16 MiB that
# take ~2 ms to move at 8 GB/s.
# With these values (same VM, 2026-12-01 00:09-00:11, quiet: others 0.00-0.03 core; pull,
# faults off, 200 requests, 5 runs each, old and new code alternating): the prefill's
# get_notifs calls 33.6k -> 6.9k, its CPU 0.161 -> 0.136 s/GB, its loop's share in
# get_notifs 5.1% -> 2.3%; decode CPU 0.158 -> 0.167 s/GB; throughput over raw NIXL
# 0.85x [0.74, 0.91] -> 0.86x [0.74, 0.87].  The default demo (300 requests, every
# fault, 3 runs each): prefill get_notifs ~375k -> ~14k, CPU 0.46 -> 0.20 s/GB.
NAP_FIRST, NAP_MOST, NAP_SPINS = 5e-6, 200e-6, 1


class StageClock:
    """Seconds spent in named calls of one worker, measured by wrapping bound methods of
    the worker's own objects (the pool, the synth, the engine, the side): the real calls,
    timed; nothing else changes.  One thread per worker, so the times add up."""

    def __init__(self):
        self.seconds: Counter = Counter()
        self.calls: Counter = Counter()

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


def _thresholds(cfg) -> list[int]:
    """Finished-request counts at which pause 0, 1, ... starts."""
    return [(i + 1) * cfg.requests // (cfg.pauses + 1) for i in range(cfg.pauses)]


class _Worker:
    role = "?"
    polling = False  # recv() drives the engine meanwhile (the raw bandwidth writes need it)

    def __init__(self, cfg, conn, names: dict):
        from kvmem.disagg.common import Backoff
        from kvmem.disagg.faults import FaultPlan
        from kvmem.disagg.synth import Synth
        from kvmem.transfer.nixl import NixlEngine

        self.cfg, self.conn, self.names = cfg, conn, names
        self.setup = {}
        self.spec = cfg.spec()
        t = time.monotonic()
        self.engine = NixlEngine(names[self.role], progress_thread=False)
        self.setup["nixl agent"] = time.monotonic() - t
        self.synth = Synth(self.spec, cfg.max_tokens, cfg.seed)
        self.plan = FaultPlan(seed=cfg.seed, rates=cfg.rates(), chunk_tokens=cfg.chunk_tokens,
                              max_tokens=cfg.max_tokens, min_tokens=1, wait=cfg.abort_wait)
        self.clock = StageClock()
        self.bw_buf = None
        self.t_progress = 0.0
        self.stages = None  # the stage clock when this worker's work was done
        # naps of the workload loop; instrument() times its sleeps as the stage "nap"
        self.backoff = Backoff(NAP_FIRST, NAP_MOST, NAP_SPINS)
        self.cpu_seconds = None  # CPU time of the workload (process_time, all threads)
        self.cpu0 = 0.0

    # --- pipe -----------------------------------------------------------------------------
    def send(self, kind: str, payload=None) -> None:
        self.conn.send((kind, payload))

    def recv(self, want: str, timeout: float = 300.0):
        """Block (polling the engine's notifications: no progress thread) until the parent
        sends ``want``; its payload."""
        end = time.monotonic() + timeout
        while True:
            if self.conn.poll(0 if self.polling else 0.05):
                kind, payload = self.conn.recv()
                if kind != want:
                    raise RuntimeError(f"{self.role} worker: expected {want!r} from the "
                                       f"parent, got {kind!r}")
                return payload
            if self.polling:
                self.engine.get_notifs()
            if time.monotonic() > end:
                raise TimeoutError(f"{self.role} worker: no {want!r} from the parent in "
                                   f"{timeout:.0f} s")

    # --- start-up ---------------------------------------------------------------------------
    def populate(self) -> None:
        """Back the pool and the staging / landing buffer now: the workload's first
        requests then pay no page faults (cma writes into fresh pages ran 3.5x slower)."""
        t = time.monotonic()
        self.side.prefault()
        self.setup["populate"] = self.setup.get("populate", 0.0) + time.monotonic() - t

    def start(self) -> None:
        n = self.cfg.bw_mib << 20
        if n:
            self.bw_buf = (_pattern(n, self.cfg.seed) if self.role == "prefill"
                           else torch.zeros(n, dtype=torch.uint8))
            self.engine.register("bw", [(self.bw_buf.data_ptr(), n)], 0)
        self.send("ready", {"metadata": self.engine.local_metadata(), "setup": self.setup})
        self.engine.add_peer(self.recv("peer"))
        if n or self.cfg.calibrates():  # the raw bandwidth and/or the calibration
            self.bandwidth()
        if n:
            self.engine.deregister("bw")
            self.bw_buf = None
        self.instrument()
        self.recv("start")

    def final(self) -> dict:
        side, alloc = self.side, self.side.alloc
        audit = side.audit()
        held = {str(o): len(p) for o, p in list(audit["leaked"].items())
                + list(audit["quarantined"].items())}
        out = dict(
            audit={"leaked": {str(k): v for k, v in audit["leaked"].items()},
                   "quarantined": {str(k): v for k, v in audit["quarantined"].items()},
                   "unaccounted": audit["unaccounted"]},
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


class PrefillWorker(_Worker):
    role = "prefill"

    def __init__(self, cfg, conn, names):
        super().__init__(cfg, conn, names)
        import kvmem
        from kvmem.disagg.prefill import PrefillSide

        spec = self.spec
        t = time.monotonic()
        pool = kvmem.KVPool(spec, cfg.prefill_pages())
        alloc = kvmem.PageAllocator(cfg.prefill_pages(), spec.page_size)
        self.side = PrefillSide(
            pool, alloc, self.engine, self.synth, decode_peer=names["decode"],
            chunk_tokens=cfg.chunk_tokens, max_batch_tokens=cfg.batch_tokens(),
            bootstrap_timeout=cfg.bootstrap_timeout, transfer_timeout=cfg.transfer_timeout,
            faults=self.plan, direct_threshold=0 if cfg.chunks == "direct" else None,
            transfer_mode=cfg.transfer_mode)
        self.setup["side"] = time.monotonic() - t
        self.populate()

    def instrument(self) -> None:
        c, s = self.clock, self.side
        c.wrap(s, "step", "step")
        c.wrap(self.backoff, "sleep", "nap")
        c.wrap(s.synth, "fill", "forward: synth KV into pool pages")
        c.wrap(s.pool, "pack", "pack_pages")
        c.wrap(s.engine, "post_write", "post_write (UCX copies here)")
        c.wrap(s.engine, "post_blocks", "post_blocks (direct; UCX copies here)")
        c.wrap(s.engine, "poll", "poll writes")
        c.wrap(s.engine, "get_notifs", "get_notifs")
        c.wrap(s.engine, "send_notif", "send_notif")

    def bandwidth(self) -> None:
        """Raw NIXL write bandwidth to the decode process: one registered buffer written
        into one registered buffer, a cold write then ``bw_rounds`` warm ones."""
        self.recv("bw_run")
        out = {}
        if self.bw_buf is not None:
            out.update(self.raw_writes())
        if self.cfg.calibrates():
            from kvmem.disagg.calibrate import calibrate_direct

            cal = calibrate_direct(self.side, self.cfg.chunk_tokens // self.spec.page_size)
            self.side.set_direct_threshold(cal["threshold"])
            out["calibration"] = cal
        self.send("bw_result", out)

    def raw_writes(self) -> dict:
        eng, buf = self.engine, self.bw_buf
        remote = eng.remote(self.names["decode"], "bw")
        local, rr = [(buf.data_ptr(), buf.numel())], [(remote.regions[0][0], buf.numel())]
        times = []
        for _ in range(1 + self.cfg.bw_rounds):
            t0 = time.perf_counter()
            h = eng.post_write(local, remote, rr, b"")
            while eng.poll(h) == "PROC":
                pass
            times.append(time.perf_counter() - t0)
            state, err = h.state, h.error
            eng.release(h)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL write ended {state}: {err}")
        return dict(nbytes=buf.numel(), first_s=times[0], warm_s=times[1:])

    def snapshot(self) -> dict:
        s = self.side
        return dict(finished=len(s.finished), outcomes=dict(s.metrics.requests),
                    bytes_sent=s.metrics.bytes_sent, pauses=self.pauses_done)

    def run(self) -> None:
        self.start()
        cfg, side, plan = self.cfg, self.side, self.plan
        n, cap = cfg.requests, cfg.concurrency
        thresholds = _thresholds(cfg)
        self.pauses_done, pause_active = 0, None  # None | "prefill" | "decode"
        next_rid, done_sent = 0, False
        t0 = time.monotonic()
        self.cpu0 = time.process_time()
        next_pipe = t0
        while True:
            t = time.monotonic()
            msg = None
            if t >= next_pipe:
                next_pipe = t + PIPE_EVERY
                if self.conn.poll():
                    msg = self.conn.recv()
            if msg is not None:
                kind, payload = msg
                if kind == "stop":
                    break
                if (kind, pause_active, payload) != ("decode_resumed", "decode", self.pauses_done):
                    raise RuntimeError(f"prefill worker: unexpected {kind!r} {payload!r}")
                self.pauses_done += 1
                pause_active = None
            # progress besides step(): a pipe message, a pause begun or ended, a request added
            moved = msg is not None
            if (pause_active is None and self.pauses_done < cfg.pauses
                    and len(side.finished) >= thresholds[self.pauses_done]):
                moved = True
                if self.pauses_done % 2 == 0:
                    side.begin_pause()
                    pause_active = "prefill"
                else:
                    self.send("pause_decode", self.pauses_done)
                    pause_active = "decode"
            if pause_active == "prefill" and side.paused:
                moved = True
                side.resume()
                self.pauses_done += 1
                pause_active = None
            nxt = self.pauses_done + 1
            gate = thresholds[nxt] + cap if nxt < cfg.pauses else n
            while (next_rid < min(n, gate) and len(side.reqs) < cap
                   and pause_active != "prefill"):
                moved = True
                side.add_request(next_rid, plan.tokens(next_rid))
                next_rid += 1
            plan.drive(side, side.clock())
            # no progress (waiting for the decode's BOOT or PULLED answers, the clock, or
            # idle): nap; never while a write of ours is in flight (our polls complete it)
            moved = side.step() or moved
            self.backoff.pace(moved or side.writes_in_flight)
            self.progress()
            if (not done_sent and len(side.finished) == n and side.idle
                    and self.pauses_done == cfg.pauses and pause_active is None):
                self.progress(force=True)
                self.send("done", dict(seconds=time.monotonic() - t0))
                done_sent = True
                self.freeze_clock(time.monotonic() - t0)
        kinds = Counter(plan.kind(r) for r in range(n))
        by_kind: dict = {}
        for rid, reason in side.finished.items():
            k = by_kind.setdefault(plan.kind(rid), Counter())
            k["pause_503" if reason.status == 503 else reason.outcome.value] += 1
        out = self.final()
        ok = sorted(r for r, why in side.finished.items() if why.status == 200)
        out.update(succeeded_rids=ok, faults_planned=dict(kinds),
                   outcomes_by_fault={k: dict(v) for k, v in by_kind.items()},
                   outcomes_by_status=dict(Counter(r.status for r in side.finished.values())))
        self.send("final", out)


class DecodeWorker(_Worker):
    role = "decode"

    def __init__(self, cfg, conn, names):
        super().__init__(cfg, conn, names)
        import kvmem
        from kvmem.disagg.decode import DecodeSide

        spec = self.spec
        t = time.monotonic()
        pool = kvmem.KVPool(spec, cfg.decode_pages())
        alloc = kvmem.PageAllocator(cfg.decode_pages(), spec.page_size)
        self.side = DecodeSide(
            pool, alloc, self.engine, self.synth, prefill_peer=names["prefill"],
            landing_bytes=cfg.landing_bytes(), timeout=cfg.decode_timeout, faults=self.plan,
            transfer_mode=cfg.transfer_mode)
        self.setup["side"] = time.monotonic() - t
        self.populate()

    def instrument(self) -> None:
        c, s = self.clock, self.side
        c.wrap(s, "step", "step")
        c.wrap(self.backoff, "sleep", "nap")
        c.wrap(s.synth, "verify", "verify (Synth.verify)")
        c.wrap(s.synth, "verify_pages", "verify in place (Synth.verify_pages)")
        c.wrap(s.engine, "post_blocks", "post_blocks (pull; UCX reads here)")
        c.wrap(s.pool, "unpack", "unpack_pages into pool")
        c.wrap(s.engine, "get_notifs", "get_notifs")
        c.wrap(s.engine, "send_notif", "send_notif")

    def bandwidth(self) -> None:
        self.recv("bw_listen")
        self.send("bw_listening")
        self.polling = True  # the prefill's writes need this side's engine driven
        try:
            self.recv("bw_end")
        finally:
            self.polling = False
        ok = (self.bw_buf is None
              or torch.equal(self.bw_buf, _pattern(self.bw_buf.numel(), self.cfg.seed)))
        self.send("bw_checked", dict(verified=bool(ok)))

    def snapshot(self) -> dict:
        m = self.side.metrics
        return dict(completed=len(self.side.completed), bytes_landed=m.bytes_landed,
                    bytes_verified=m.bytes_verified, bytes_corrupt=m.bytes_corrupt)

    def run(self) -> None:
        self.start()
        side, n = self.side, self.cfg.requests
        pausing, done_sent = None, False
        t0 = time.monotonic()
        self.cpu0 = time.process_time()
        next_pipe = t0
        while True:
            t = time.monotonic()
            moved = False  # a pipe message, a pause begun or ended
            if t >= next_pipe:
                next_pipe = t + PIPE_EVERY
                if self.conn.poll():
                    kind, payload = self.conn.recv()
                    if kind == "stop":
                        break
                    if kind != "pause" or pausing is not None:
                        raise RuntimeError(f"decode worker: unexpected {kind!r} {payload!r}")
                    side.begin_pause()
                    pausing, moved = payload, True
            moved = side.step() or moved
            if pausing is not None and side.paused:
                side.resume()
                self.send("resumed", pausing)
                pausing, moved = None, True
            # no progress: back off (still polling; a write's ack needs this side), never
            # while a read of ours is in flight (pull: our polls complete it)
            self.backoff.pace(moved or side.reads_in_flight)
            self.progress()
            if not done_sent and len(side.completed) == n and side.idle and pausing is None:
                self.progress(force=True)
                self.send("done", dict(seconds=time.monotonic() - t0))
                done_sent = True
                self.freeze_clock(time.monotonic() - t0)
        out = self.final()
        out["succeeded_rids"] = sorted(r for r, why in side.completed.items() if why.status == 200)
        self.send("final", out)


def worker_main(role: str, cfg, conn, names: dict) -> None:
    """Entry point of a worker process.  SIGINT and SIGTERM are ignored: the parent owns
    the workers' lives (a Ctrl-C or SIGTERM to the demo stops them through their pipes,
    which end their loops; a worker that does not stop is killed), so a signal sent to
    the whole process group ends the run the same way as one sent to the parent.

    The process ends here, never by returning: status 0 after its ``final`` report (its
    engine closed in order by then), 1 after an ``error`` message; through
    :func:`kvmem.transfer.nixl_exit.end_process`, so the native destructors that crash
    at exit on a host with RDMA libraries do not run."""
    from kvmem.transfer.nixl_exit import end_process

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # This process hosts a PD side: its kvmem.* records (WARNING and up, the root's
    # level) go to stderr, named after the worker.  NIXL's logger keeps its own handler.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(
        f"kvmem demo {role} worker: %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("kvmem").addHandler(handler)
    try:
        torch.set_num_threads(1)  # two workers on a small machine: one core each
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # not an INFO line per agent
        worker = (PrefillWorker if role == "prefill" else DecodeWorker)(cfg, conn, names)
        worker.run()
        status = 0
    except BaseException:  # noqa: BLE001 - tell the parent, whatever it was
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, EOFError):
            pass
        status = 1
    end_process(status)
