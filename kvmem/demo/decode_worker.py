"""The decode worker of ``kvmem demo``: its side, the check of the raw bandwidth
buffer, the pauses the parent asks for, and the armed kill.

Contract: :class:`DecodeWorker` steps its side until told to stop, begins a pause when
the parent sends ``pause`` (one at a time) and reports ``resumed`` once the side is
resumed, checks the bytes of the bandwidth phase, and, once armed, reports the requests
it is in the middle of receiving (``kill_me``) and stops stepping so that the parent can
kill it.  The pipe protocol: :mod:`kvmem.demo.worker`.
"""

from __future__ import annotations

import time

import torch

from kvmem.demo.worker_base import PIPE_EVERY, Worker, _pattern


class DecodeWorker(Worker):
    role = "decode"

    def __init__(self, cfg, conn, names, index=0) -> None:
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
