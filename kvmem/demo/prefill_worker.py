"""The prefill worker of ``kvmem demo``: its side, its share of the requests and pauses,
the router that binds each request to a decode, and the raw bandwidth writes.

Contract: :class:`PrefillWorker` runs the request ids of :func:`requests_of`, admits them
up to ``--concurrency``, binds each to the decode :meth:`PrefillWorker.route` picks,
drives the pauses of :func:`pauses_of` (its own, or a decode's through the parent) at the
counts :func:`_thresholds` gives, and reports its outcomes by fault, status and decode
in its ``final`` message.  The pipe protocol and the schedule: :mod:`kvmem.demo.worker`.
"""

from __future__ import annotations

import time
from collections import Counter

import torch

from kvmem.demo.worker_base import NAP_MOST, PIPE_EVERY, Worker


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


class PrefillWorker(Worker):
    role = "prefill"

    def __init__(self, cfg, conn, names, index=0) -> None:
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
            out.update(self.raw_writes(self.bw_buf))
        if self.cfg.calibrates():
            from kvmem.disagg.calibrate import calibrate_direct

            cal = calibrate_direct(
                self.side, self.cfg.chunk_tokens // self.spec.page_size, peer=self.decodes[0]
            )
            self.side.set_direct_threshold(cal["threshold"])
            out["calibration"] = cal
        self.send("bw_result", out)

    def raw_writes(self, buf: torch.Tensor) -> dict:
        """Write ``buf`` (registered as "bw") into decode 0's "bw" buffer."""
        eng = self.engine
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
