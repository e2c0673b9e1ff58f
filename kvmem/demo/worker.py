"""The worker processes of ``kvmem demo`` (started by :mod:`kvmem.demo.orchestrator` with
the 'spawn' context; this module is what each child imports): ``--prefills`` prefill
workers and ``--decodes`` decode workers, one and one by default.

The two worker classes share their loop, pacing and pipe protocol (``_Worker``), and
each is the one place its side's setup and workload are driven from.

Each worker owns a KVPool (host backend), a PageAllocator, a NixlEngine (UCX, no progress
thread: the loops poll) and one side of the PD lifecycle
(:class:`~kvmem.disagg.PrefillSide` or :class:`~kvmem.disagg.DecodeSide`), whose peers
are every worker of the other kind.  With ``--hosts netns`` a worker first enters its
network namespace (:func:`kvmem.demo.hosts.enter`).  After the start-up exchange below,
every PD control message travels as a NIXL notification inside the sides; the pipe to
the parent carries only the orchestration (start, pause, stop, kill) and the counters.

Pipe messages, ``(kind, payload)``::

    worker -> parent                        parent -> worker
    ("ready", {metadata, setup times})      ("peer", [the other kind's metadata])
    ("bw_listening", None)      decode 0    ("bw_listen", None)     decode 0: poll notifs
    ("bw_result", {...})        prefill 0   ("bw_run", None)        prefill 0: timed writes
    ("bw_checked", {...})       decode 0    ("bw_end", None)        decode 0: check bytes
    ("progress", {...})         ~5 per s    ("start", {...})        the workload begins
    ("pause_decode", i)         prefill     ("pause", i)            decode: pause i now
    ("resumed", i)              decode      ("decode_resumed", i)   prefill: pause i done
    ("kill_me", {...})          decode      ("arm_kill", None)      decode: ask to be killed
                                            ("peer_gone", agent)    prefill: route elsewhere
                                            ("expect", n)           decode: n requests are
                                                                    yours (several decodes)
    ("done", {...})             own work finished, still stepping
    ("final", {...})            after ("stop", None): audit, close, counters
    ("error", traceback)        then the worker exits with status 1

The bandwidth phase runs between prefill 0 and decode 0 only (their raw NIXL write is
the baseline, over the same link as the workload's), and prefill 0's packed/direct
calibration gives the other prefills their threshold (``start``'s payload).

Requests: prefill ``p`` of ``P`` runs the request ids ``p, p + P, p + 2P, ...`` (ids are
unique across the prefills, as a decode requires), each bound to the decode its router
picks (:meth:`PrefillWorker.route`: the least loaded decode that is neither paused nor
gone).  Pauses are decided by the prefill workers from their own counts of finished
requests, one at a time each, alternating sides: pause ``i`` of ``--pauses`` belongs to
prefill ``(i // 2) % P``; even ``i``: that prefill pauses itself; odd ``i``: it asks for a
decode pause through the parent (which picks the decode and runs one decode pause at a
time per decode) and keeps stepping, which is what lets the decode's pause complete: the
prefills drain their writes into it and acknowledge.  A prefill's ``j``-th pause starts
when ``thresholds[j]`` of its requests have finished, and admission stops at
``thresholds[j + 1] + concurrency`` until it is over, so every pause happens with traffic
in flight and none is left for after the last request.  The other workers keep serving.

``--kill-decode``: once a quarter of the requests have finished the parent arms the last decode;
that decode, as soon as it is in the middle of receiving a request from every prefill
(some pages landed, not all), reports those requests (``kill_me``) and stops (no more
steps), and the parent kills it with SIGKILL.  The prefills are told (``peer_gone``) so
their routers stop picking it and its requests end at once (``PrefillSide.peer_gone``:
500); one that ended before the prefill heard ended as the lifecycle says (a failed
write, 500, or a timeout, 504).
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from collections import Counter

import torch

from kvmem.demo.hosts import enter

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


def _thresholds(n: int, pauses: int) -> list[int]:
    """Counts of finished requests (of ``n``) at which pause 0, 1, ... (of ``pauses``)
    starts."""
    return [(i + 1) * n // (pauses + 1) for i in range(pauses)]


def pauses_of(cfg, index: int) -> list[int]:
    """The pauses (indices into ``--pauses``) that prefill ``index`` drives: pause ``i``
    belongs to prefill ``(i // 2) % prefills`` (every pause, with one prefill)."""
    return [i for i in range(cfg.pauses) if (i // 2) % cfg.prefills == index]


def requests_of(cfg, index: int) -> range:
    """The request ids prefill ``index`` runs."""
    return range(index, cfg.requests, cfg.prefills)


class _Worker:
    role = "?"
    polling = False  # recv() drives the engine meanwhile (the raw bandwidth writes need it)

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
        self.bw_buf = None
        self.t_progress = 0.0
        self.stages = None  # the stage clock when this worker's work was done
        # naps of the workload loop; instrument() times its sleeps as the stage "nap"
        self.backoff = Backoff(NAP_FIRST, NAP_MOST, NAP_SPINS)
        self.nap_moving = NAP_WHILE_MOVING[cfg.hosts]  # nap while our transfers move
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


class PrefillWorker(_Worker):
    role = "prefill"

    def __init__(self, cfg, conn, names, index=0):
        super().__init__(cfg, conn, names, index)
        import kvmem
        from kvmem.disagg.prefill import PrefillSide

        spec = self.spec
        t = time.monotonic()
        pool = kvmem.KVPool(spec, cfg.prefill_pages())
        alloc = kvmem.PageAllocator(cfg.prefill_pages(), spec.page_size)
        self.decodes = list(names["decode"])
        self.gone: set = set()  # decodes the parent said are dead: routed to no more
        self.routed: Counter = Counter()  # decode agent -> requests bound to it
        self.gone_active: dict = {}  # decode agent -> rids active here when it died
        self.side = PrefillSide(
            pool,
            alloc,
            self.engine,
            self.synth,
            decode_peers=self.decodes,
            chunk_tokens=cfg.chunk_tokens,
            max_batch_tokens=cfg.batch_tokens(),
            bootstrap_timeout=cfg.bootstrap_timeout,
            transfer_timeout=cfg.transfer_timeout,
            faults=self.plan,
            direct_threshold=0 if cfg.chunks == "direct" else None,
            transfer_mode=cfg.transfer_mode,
        )
        self.setup["side"] = time.monotonic() - t
        self.populate()

    TIMED = (
        ("model", "fill", "forward: synth KV into pool pages"),
        ("pool", "pack", "pack_pages"),
        ("engine", "post_write", "post_write (UCX copies here)"),
        ("engine", "post_blocks", "post_blocks (direct; UCX copies here)"),
        ("engine", "poll", "poll writes"),
        ("engine", "get_notifs", "get_notifs"),
        ("engine", "send_notif", "send_notif"),
    )

    def bandwidth(self) -> None:
        """Raw NIXL write bandwidth to the decode process: one registered buffer written
        into one registered buffer, a cold write then ``bw_rounds`` warm ones."""
        self.recv("bw_run")
        out = {}
        if self.bw_buf is not None:
            out.update(self.raw_writes())
        if self.cfg.calibrates():
            from kvmem.disagg.calibrate import calibrate_direct

            cal = calibrate_direct(
                self.side, self.cfg.chunk_tokens // self.spec.page_size, peer=self.decodes[0]
            )
            self.side.set_direct_threshold(cal["threshold"])
            out["calibration"] = cal
        self.send("bw_result", out)

    def raw_writes(self) -> dict:
        eng, buf = self.engine, self.bw_buf
        remote = eng.remote(self.decodes[0], "bw")
        local, rr = [(buf.data_ptr(), buf.numel())], [(remote.regions[0][0], buf.numel())]
        times = []
        for _ in range(1 + self.cfg.bw_rounds):
            t0 = time.perf_counter()
            h = eng.post_write(local, remote, rr, b"")
            while eng.poll(h) == "PROC":
                if self.nap_moving:
                    time.sleep(NAP_MOST)
            times.append(time.perf_counter() - t0)
            state, err = h.state, h.error
            eng.release(h)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL write ended {state}: {err}")
        return dict(nbytes=buf.numel(), first_s=times[0], warm_s=times[1:])

    def snapshot(self) -> dict:
        s = self.side
        return dict(
            finished=len(s.finished),
            outcomes=dict(s.metrics.requests),
            bytes_sent=s.metrics.bytes_sent,
            pauses=self.pauses_done,
        )

    def route(self, rid: int) -> str:
        """The decode for a new request: of the decodes that are not gone, the one with the
        fewest of this side's requests in flight, preferring those not paused; ties go
        round-robin by request id."""
        live = [d for d in self.decodes if d not in self.gone]
        if len(live) == 1:
            return live[0]
        ready = [d for d in live if not self.side.peer_is_paused(d)] or live
        k = len(ready)
        return min((ready[(rid + j) % k] for j in range(k)), key=self.side.requests_of)

    def run(self) -> None:
        begin = self.start()
        if "direct_threshold" in begin:  # prefill 0's calibration, for the others
            self.side.set_direct_threshold(begin["direct_threshold"])
        cfg, side, plan = self.cfg, self.side, self.plan
        rids = requests_of(cfg, self.index)
        n, cap = len(rids), cfg.concurrency
        mine = pauses_of(cfg, self.index)  # the global indices of this prefill's pauses
        thresholds = _thresholds(n, len(mine))
        self.pauses_done, pause_active = 0, None  # None | "prefill" | "decode"
        next_i, done_sent = 0, False  # rids[next_i] is the next request to admit
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
                if kind == "peer_gone":
                    self.gone.add(payload)
                    self.gone_active[payload] = sorted(
                        r.rid for r in side.reqs.values() if r.peer == payload
                    )
                    side.peer_gone(payload)  # its requests end now (500)
                elif (kind, pause_active, payload) != (
                    "decode_resumed",
                    "decode",
                    mine[self.pauses_done] if self.pauses_done < len(mine) else None,
                ):
                    raise RuntimeError(f"prefill worker: unexpected {kind!r} {payload!r}")
                else:
                    self.pauses_done += 1
                    pause_active = None
            # progress besides step(): a pipe message, a pause begun or ended, a request added
            moved = msg is not None
            if (
                pause_active is None
                and self.pauses_done < len(mine)
                and len(side.finished) >= thresholds[self.pauses_done]
            ):
                moved = True
                if mine[self.pauses_done] % 2 == 0:
                    side.begin_pause()
                    pause_active = "prefill"
                else:
                    self.send("pause_decode", mine[self.pauses_done])
                    pause_active = "decode"
            if pause_active == "prefill" and side.paused:
                moved = True
                side.resume()
                self.pauses_done += 1
                pause_active = None
            nxt = self.pauses_done + 1
            gate = thresholds[nxt] + cap if nxt < len(mine) else n
            while next_i < min(n, gate) and len(side.reqs) < cap and pause_active != "prefill":
                moved = True
                rid = rids[next_i]
                peer = self.route(rid)
                side.add_request(rid, plan.tokens(rid), peer=peer)
                self.routed[peer] += 1
                next_i += 1
            plan.drive(side, side.clock())
            # no progress (waiting for the decode's BOOT or PULLED answers, the clock, or
            # idle): nap; on one host never while a write of ours is in flight (our polls
            # complete it), over TCP then too (NAP_WHILE_MOVING)
            moved = side.step() or moved
            self.backoff.pace(moved or (side.writes_in_flight and not self.nap_moving))
            self.progress()
            if (
                not done_sent
                and len(side.finished) == n
                and side.idle
                and self.pauses_done == len(mine)
                and pause_active is None
            ):
                self.progress(force=True)
                self.send("done", dict(seconds=time.monotonic() - t0, routed=dict(self.routed)))
                done_sent = True
                self.freeze_clock(time.monotonic() - t0)
        kinds = Counter(plan.kind(r) for r in rids)
        by_kind: dict = {}
        for rid, reason in side.finished.items():
            k = by_kind.setdefault(plan.kind(rid), Counter())
            k["pause_503" if reason.status == 503 else reason.outcome.value] += 1
        out = self.final()
        ok = sorted(r for r, why in side.finished.items() if why.status == 200)
        by_peer: dict = {}
        for rid, why in side.finished.items():
            by_peer.setdefault(side.finished_peer[rid], Counter())[why.status] += 1
        out.update(
            succeeded_rids=ok,
            faults_planned=dict(kinds),
            outcomes_by_fault={k: dict(v) for k, v in by_kind.items()},
            outcomes_by_status=dict(Counter(r.status for r in side.finished.values())),
            succeeded_by_peer={
                d: sorted(r for r in ok if side.finished_peer[r] == d) for d in self.decodes
            },
            status_by_peer={d: dict(c) for d, c in by_peer.items()},
            routed=dict(self.routed),
            gone={
                d: {
                    "active": rids_,
                    "status": {r: side.finished[r].status for r in rids_},
                    "bound": {
                        r: why.status
                        for r, why in side.finished.items()
                        if side.finished_peer[r] == d
                    },
                }
                for d, rids_ in self.gone_active.items()
            },
        )
        self.send("final", out)


class DecodeWorker(_Worker):
    role = "decode"

    def __init__(self, cfg, conn, names, index=0):
        super().__init__(cfg, conn, names, index)
        import kvmem
        from kvmem.disagg.decode import DecodeSide

        spec = self.spec
        t = time.monotonic()
        pool = kvmem.KVPool(spec, cfg.decode_pages())
        alloc = kvmem.PageAllocator(cfg.decode_pages(), spec.page_size)
        self.ok_sent = 0  # succeeded rids reported in progress so far (several decodes)
        self.side = DecodeSide(
            pool,
            alloc,
            self.engine,
            self.synth,
            prefill_peers=list(names["prefill"]),
            landing_bytes=cfg.landing_bytes(),
            timeout=cfg.decode_timeout,
            faults=self.plan,
            transfer_mode=cfg.transfer_mode,
        )
        self.setup["side"] = time.monotonic() - t
        self.populate()

    TIMED = (
        ("verifier", "verify", "verify (Synth.verify)"),
        ("verifier", "verify_pages", "verify in place (Synth.verify_pages)"),
        ("engine", "post_blocks", "post_blocks (pull; UCX reads here)"),
        ("pool", "unpack", "unpack_pages into pool"),
        ("engine", "get_notifs", "get_notifs"),
        ("engine", "send_notif", "send_notif"),
    )

    def bandwidth(self) -> None:
        self.recv("bw_listen")
        self.send("bw_listening")
        self.polling = True  # the prefill's writes need this side's engine driven
        try:
            self.recv("bw_end")
        finally:
            self.polling = False
        ok = self.bw_buf is None or torch.equal(
            self.bw_buf, _pattern(self.bw_buf.numel(), self.cfg.seed)
        )
        self.send("bw_checked", dict(verified=bool(ok)))

    def snapshot(self) -> dict:
        m = self.side.metrics
        out = dict(
            completed=len(self.side.completed),
            bytes_landed=m.bytes_landed,
            bytes_verified=m.bytes_verified,
            bytes_corrupt=m.bytes_corrupt,
        )
        if self.cfg.decodes > 1:  # what this decode confirmed so far, should it die
            ok = [r for r, why in self.side.completed.items() if why.status == 200]
            out["ok_rids"], self.ok_sent = ok[self.ok_sent :], len(ok)
            out["active"] = len(self.side.reqs)
        return out

    def mid_transfer(self) -> dict:
        """The requests this side is in the middle of receiving (some pages landed, not
        all), by prefill agent."""
        out: dict = {}
        for req in self.side.reqs.values():
            n_pages = -(-req.tokens // self.spec.page_size)
            if req.state == "booted" and 0 < req.pages_done < n_pages:
                out.setdefault(req.peer, []).append(req.rid)
        return out

    def run(self) -> None:
        self.start()
        side = self.side
        n = self.cfg.requests if self.cfg.decodes == 1 else None  # else: "expect" says
        pausing, done_sent, armed = None, False, None
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
                    if kind == "expect" and n is None:
                        n, moved = payload, True
                    elif kind == "arm_kill" and armed is None:
                        armed, moved = t, True
                    elif kind != "pause" or pausing is not None:
                        raise RuntimeError(f"decode worker: unexpected {kind!r} {payload!r}")
                    else:
                        side.begin_pause()
                        pausing, moved = payload, True
            if armed is not None and pausing is None:
                mid = self.mid_transfer()
                # mid-transfer from every prefill; after 5 s armed, from any one
                if mid and (len(mid) == len(self.names["prefill"]) or t - armed > 5.0):
                    self.progress(force=True)  # what it confirmed, up to this moment
                    self.send("kill_me", {"mid_transfer": mid, "armed_s": t - armed})
                    while True:  # no step any more: the parent kills this process now
                        self.conn.recv()
            moved = side.step() or moved
            if pausing is not None and side.paused:
                side.resume()
                self.send("resumed", pausing)
                pausing, moved = None, True
            # no progress: back off (still polling; a write's ack needs this side); on one
            # host never while a read of ours is in flight (pull: our polls complete it),
            # over TCP then too (NAP_WHILE_MOVING)
            self.backoff.pace(moved or (side.reads_in_flight and not self.nap_moving))
            self.progress()
            if (
                not done_sent
                and n is not None
                and len(side.completed) == n
                and side.idle
                and pausing is None
            ):
                self.progress(force=True)
                self.send("done", dict(seconds=time.monotonic() - t0))
                done_sent = True
                self.freeze_clock(time.monotonic() - t0)
        out = self.final()
        out["succeeded_rids"] = sorted(r for r, why in side.completed.items() if why.status == 200)
        self.send("final", out)


def worker_main(role: str, cfg, conn, names: dict, index: int = 0, place=None) -> None:
    """Entry point of a worker process.  SIGINT and SIGTERM are ignored: the parent owns
    the workers' lives (a Ctrl-C or SIGTERM to the demo stops them through their pipes,
    which end their loops; a worker that does not stop is killed), so a signal sent to
    the whole process group ends the run the same way as one sent to the parent.
    ``index``: the worker's among its kind; ``place``: its network namespace
    (:meth:`kvmem.demo.hosts.NetnsHosts.place`; None: this host's).

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
    handler.setFormatter(
        logging.Formatter(f"kvmem demo {role} worker: %(levelname)s %(name)s: %(message)s")
    )
    logging.getLogger("kvmem").addHandler(handler)
    try:
        enter(place)  # before the NIXL agent: its UCX context reads the network devices
        torch.set_num_threads(1)  # two workers on a small machine: one core each
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # not an INFO line per agent
        worker = (PrefillWorker if role == "prefill" else DecodeWorker)(cfg, conn, names, index)
        worker.run()
        status = 0
    except BaseException:  # noqa: BLE001 - tell the parent, whatever it was
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, EOFError):
            pass
        status = 1
    end_process(status)
