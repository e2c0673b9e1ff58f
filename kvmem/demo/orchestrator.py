"""``kvmem demo``'s parent process: it starts the workers (:class:`Workers`, their pipes),
relays their metadata once, runs the bandwidth phase and the workload (:class:`_Orchestra`:
decode pauses, ``--kill-decode``), draws the progress line, collects the final reports
and returns the result (:func:`run`).  The workers are :mod:`kvmem.demo.worker`."""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import threading
import time
import uuid
from typing import Any

from kvmem.demo.config import DemoConfig
from kvmem.demo.hosts import NetnsHosts
from kvmem.demo.progress import Progress
from kvmem.demo.result import build_result, exit_how


class WorkerFailed(RuntimeError):
    """A worker raised, died or stopped answering; the message names it."""


STARTUP_S = 180.0  # spawn, import torch, pools pre-faulted, NIXL agent
PHASE_S = 120.0  # each hand-shake step after that
SILENT_S = 30.0  # a worker sends progress ~5 times a second
STALL_S = 120.0  # no request finished for this long (timeouts are a few seconds)


def worker_keys(cfg) -> list[tuple[str, int, str]]:
    """``(role, index, key)`` of every worker, prefills first.  ``key`` names the worker
    in the report and the errors: "prefill" and "decode" when a kind has one worker,
    "prefill0", "prefill1", ... when it has several."""
    out = []
    for role, n in (("prefill", cfg.prefills), ("decode", cfg.decodes)):
        out += [(role, i, role if n == 1 else f"{role}{i}") for i in range(n)]
    return out


class Workers:
    """The worker processes and their pipes, by key (:func:`worker_keys`)."""

    def __init__(self, cfg: DemoConfig, hosts=None):
        from kvmem.demo.worker import worker_main

        ctx = mp.get_context("spawn")
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        keys = worker_keys(cfg)
        self.keys = [k for _, _, k in keys]
        self.role = {k: r for r, _, k in keys}
        self.agent = {k: f"kvmem-demo-{k}-{tag}" for k in self.keys}
        names = {r: [self.agent[k] for rr, _, k in keys if rr == r] for r in ("prefill", "decode")}
        self.names = names
        self.conns: dict[str, mpc.Connection] = {}
        self.procs: dict[str, mp.process.BaseProcess] = {}
        self.heard: dict[str, float] = {}
        self.inbox: list = []  # received, not consumed yet
        self.ended: set = set()  # keys whose "final" arrived
        self.killed: set = set()  # keys the demo killed on purpose (--kill-decode)
        self.watch = False  # silence detection: on while the workload runs
        self.closed = False
        try:
            for role, index, key in keys:
                here, there = ctx.Pipe()
                place = None if hosts is None else hosts.place(role)
                proc = ctx.Process(
                    target=worker_main,
                    name=f"kvmem-demo-{key}",
                    args=(role, cfg, there, names, index, place),
                    daemon=True,
                )
                self.conns[key] = here
                proc.start()
                self.procs[key] = proc
                there.close()
                self.heard[key] = time.monotonic()
        except BaseException:  # SIGTERM / Ctrl-C while starting: stop what started
            self.close(failed=True)
            raise

    def of(self, role: str) -> list[str]:
        return [k for k in self.keys if self.role[k] == role]

    def send(self, key: str, kind: str, payload=None) -> None:
        try:
            self.conns[key].send((kind, payload))
        except (OSError, EOFError) as e:
            raise WorkerFailed(self._why(key, f"pipe closed ({e})")) from None

    def _why(self, key: str, what: str) -> str:
        proc = self.procs[key]
        proc.join(0.5)
        code = proc.exitcode
        state = "still running" if code is None else f"exit status {code}"
        return f"the {key} worker: {what} ({state}, pid {proc.pid})"

    def kill(self, key: str) -> int | None:
        """SIGKILL worker ``key`` on purpose and reap it; its exit code (None if it had not
        exited 10 s later)."""
        proc = self.procs[key]
        self.killed.add(key)
        assert proc.pid is not None  # started in __init__
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10.0)
        self.conns[key].close()
        return proc.exitcode

    def poll(self, timeout: float) -> list[tuple[str, str, Any]]:
        """Messages that arrived within ``timeout`` s: ``[(key, kind, payload)]``, the
        buffered ones (:meth:`expect` left them) first.  WorkerFailed for an ``error``
        message, a worker that exited before its ``final`` message (unless the demo killed
        it), a closed pipe, or a worker silent for SILENT_S while the workload runs."""
        out, self.inbox = self.inbox, []
        live = [k for k in self.keys if k not in self.ended and k not in self.killed]
        by_obj: dict[Any, str] = {self.conns[k]: k for k in live}
        by_obj.update({self.procs[k].sentinel: k for k in live})
        for obj in mpc.wait(list(by_obj), 0 if out else timeout):
            key = by_obj[obj]
            if key in self.ended or key in self.killed:
                continue
            conn, got = self.conns[key], 0
            while True:
                try:
                    if not conn.poll():
                        break
                    kind, payload = conn.recv()
                except (OSError, EOFError):
                    raise WorkerFailed(self._why(key, "its pipe closed")) from None
                if kind == "error":
                    raise WorkerFailed(f"the {key} worker raised:\n{payload}")
                self.heard[key] = time.monotonic()
                out.append((key, kind, payload))
                got += 1
                if kind in ("final", "kill_me"):
                    if kind == "final":
                        self.ended.add(key)
                    break
            if obj is self.procs[key].sentinel and not got and key not in self.ended:
                raise WorkerFailed(self._why(key, "exited"))
        if self.watch:
            t = time.monotonic()
            for key in live:
                if key not in self.killed and t - self.heard[key] > SILENT_S:
                    raise WorkerFailed(self._why(key, f"silent for {t - self.heard[key]:.0f} s"))
        return out

    def expect(self, key: str, kind: str, timeout: float = PHASE_S):
        """The payload of the next ``kind`` message from ``key``; other messages stay
        buffered for later (the workers' hand-shake messages come in any order)."""
        end = time.monotonic() + timeout
        while True:
            msgs = self.poll(min(1.0, max(end - time.monotonic(), 0.0)))
            for i, (k, kd, payload) in enumerate(msgs):
                if (k, kd) == (key, kind):
                    self.inbox = msgs[:i] + msgs[i + 1 :] + self.inbox
                    return payload
            self.inbox = msgs + self.inbox
            if time.monotonic() >= end:
                raise WorkerFailed(self._why(key, f"no {kind!r} in {timeout:.0f} s"))

    def status(self) -> str:
        """How each worker ended, e.g. 'decode worker (pid 12): killed by signal 9 (SIGKILL)'."""
        return "; ".join(
            f"{key} worker (pid {proc.pid}): {exit_how(proc.exitcode)}"
            + (" (killed by the demo)" if key in self.killed else "")
            for key, proc in self.procs.items()
        )

    def close(self, failed: bool = False) -> None:
        """Join every worker.  After a failure the pipes are closed first (a worker exits
        when its pipe ends) and the grace time is short; a worker still alive after it is
        killed.  Calling it again does nothing."""
        if self.closed:
            return
        self.closed = True
        if failed:
            for c in self.conns.values():
                c.close()
        for proc in self.procs.values():
            proc.join(2.0 if failed else 30.0)
            if proc.is_alive():  # workers ignore SIGTERM (the parent owns their lives)
                proc.kill()
                proc.join(5.0)
        if not failed:
            for c in self.conns.values():
                c.close()


def _sum_progress(msgs: list[dict]) -> dict:
    """The progress messages of the workers of one kind, added up (outcomes by key)."""
    out: dict = {}
    for m in msgs:
        for k, v in m.items():
            if isinstance(v, dict):
                d = out.setdefault(k, {})
                for kk, vv in v.items():
                    d[kk] = d.get(kk, 0) + vv
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    return out


class _Orchestra:
    """The parent's part of the workload: relays the decode pauses the prefills ask for
    (the decode is picked here: the decodes in turn, never the one --kill-decode will
    kill while another remains, one pause at a time per decode), runs --kill-decode, and
    tells the decodes how many requests are theirs once every prefill is done."""

    def __init__(self, cfg: DemoConfig, w: Workers):
        self.cfg, self.w = cfg, w
        self.prefills, self.decodes = w.of("prefill"), w.of("decode")
        self.live = list(self.decodes)
        self.target = self.decodes[-1] if cfg.kill_decode else None
        self.queue: list = []  # (prefill key, pause index) waiting for a decode
        self.pausing: dict = {}  # decode key -> (prefill key, pause index)
        self.decode_pauses = 0
        self.armed = False
        self.kill: dict | None = None
        self.confirmed: dict = {k: [] for k in self.decodes}  # ok rids seen in progress
        self.routed: dict = {}  # prefill key -> {decode agent: requests}
        self.expect_sent = False

    def on_message(self, key: str, kind: str, payload, last: dict, done: dict) -> None:
        w = self.w
        if kind == "progress":
            last[key] = payload
            self.confirmed.get(key, []).extend(payload.get("ok_rids", ()))
        elif kind == "pause_decode":
            self.queue.append((key, payload))
        elif kind == "resumed":
            driver, i = self.pausing.pop(key)
            if i != payload:
                raise WorkerFailed(f"the {key} worker resumed from pause {payload}, not {i}")
            w.send(driver, "decode_resumed", i)
        elif kind == "kill_me" and key == self.target and self.kill is None:
            self._kill(payload, last)
        elif kind == "done":
            done[key] = payload
            if w.role[key] == "prefill":
                self.routed[key] = payload.get("routed", {})
        else:
            raise WorkerFailed(f"the {key} worker sent an unexpected {kind!r}")

    def tick(self, last: dict, done: dict) -> None:
        w, cfg = self.w, self.cfg
        candidates = [d for d in self.live if d != self.target or len(self.live) == 1]
        waiting, self.queue = self.queue, []
        for driver, i in waiting:
            free = [d for d in candidates if d not in self.pausing]
            if not free:
                self.queue.append((driver, i))
                continue
            target = candidates[self.decode_pauses % len(candidates)]
            if target in self.pausing:
                target = free[0]
            self.decode_pauses += 1
            self.pausing[target] = (driver, i)
            w.send(target, "pause", i)
        finished = sum(last[p].get("finished", 0) for p in self.prefills)
        if (
            self.target is not None
            and self.kill is None
            and not self.armed
            and finished >= cfg.requests // 4
        ):
            self.armed = True
            w.send(self.target, "arm_kill")
        if self.target is not None and self.kill is None and all(p in done for p in self.prefills):
            self._kill({"mid_transfer": {}, "armed_s": None}, last)  # never got the chance
        if not self.expect_sent and cfg.decodes > 1 and all(p in done for p in self.prefills):
            self.expect_sent = True
            for d in self.live:
                agent = w.agent[d]
                w.send(d, "expect", sum(r.get(agent, 0) for r in self.routed.values()))

    def _kill(self, payload: dict, last: dict) -> None:
        w, key = self.w, self.target
        assert key is not None  # only the target asks to be killed
        finished = sum(last[p].get("finished", 0) for p in self.prefills)
        code = w.kill(key)
        self.live.remove(key)
        by_agent = {w.agent[k]: k for k in w.keys}
        self.kill = dict(
            worker=key,
            agent=w.agent[key],
            exit_code=code,
            finished_before=finished,
            armed_seconds=payload.get("armed_s"),
            mid_transfer={
                by_agent.get(a, a): sorted(r) for a, r in payload.get("mid_transfer", {}).items()
            },
            last_progress=last.get(key, {}),
        )
        for p in self.prefills:
            w.send(p, "peer_gone", w.agent[key])


def run(cfg: DemoConfig, progress: bool = True) -> dict:
    """Run the demo; the result dict (what ``--json`` writes).  WorkerFailed if a worker
    fails, HostsError if the network namespaces cannot be made; every worker process is
    gone, and the namespaces removed, when this returns or raises."""
    if cfg.hosts != "netns":
        return _run(cfg, progress, None)
    hosts = NetnsHosts()
    try:
        hosts.make()
        return _run(cfg, progress, hosts)
    finally:
        # a second Ctrl-C must not cut the clean-up short (SIGTERM: ignored by now)
        main_thread = threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
        try:
            hosts.close()
        finally:
            if main_thread:
                signal.signal(signal.SIGINT, old)


def _run(cfg: DemoConfig, progress: bool, hosts) -> dict:
    t_begin = time.monotonic()
    bar = Progress(cfg) if progress else None
    w = Workers(cfg, hosts)  # stops what it started should it be interrupted itself
    pre, dec = w.of("prefill"), w.of("decode")
    clean = False
    orch = _Orchestra(cfg, w)
    try:
        if bar:
            bar.note("starting the prefill and decode workers")
        ready = {k: w.expect(k, "ready", STARTUP_S) for k in w.keys}
        phases = {"startup": time.monotonic() - t_begin}
        for k in pre:
            w.send(k, "peer", [ready[d]["metadata"] for d in dec])
        for k in dec:
            w.send(k, "peer", [ready[p]["metadata"] for p in pre])
        raw = None
        if cfg.bw_mib or cfg.calibrates():  # raw bandwidth and/or the calibration
            if bar:
                bar.note(f"measuring raw NIXL write bandwidth ({cfg.bw_mib} MiB buffer)")
            w.send(dec[0], "bw_listen")
            w.expect(dec[0], "bw_listening")
            w.send(pre[0], "bw_run")
            raw = w.expect(pre[0], "bw_result")
            w.send(dec[0], "bw_end")
            raw.update(w.expect(dec[0], "bw_checked"))
        for k in w.keys:
            begin = None
            if w.role[k] == "prefill" and k != pre[0] and raw and "calibration" in raw:
                begin = {"direct_threshold": raw["calibration"]["threshold"]}
            w.send(k, "start", begin)
        t0 = time.monotonic()
        if bar:
            bar.start()
        phases["bandwidth"] = t0 - t_begin - phases["startup"]
        w.heard = {k: t0 for k in w.heard}
        w.watch = True
        last: dict[str, dict] = {k: {} for k in w.keys}
        done: dict[str, dict] = {}
        finished, t_finished = -1, t0
        while len(done) < len(pre) + len(orch.live):
            for key, kind, payload in w.poll(0.1):
                orch.on_message(key, kind, payload, last, done)
            orch.tick(last, done)
            t = time.monotonic()
            n = sum(last[k].get("finished", 0) for k in pre) + sum(
                last[k].get("completed", 0) for k in dec
            )
            if n != finished:
                finished, t_finished = n, t
            elif t - t_finished > STALL_S:
                raise WorkerFailed(
                    f"no request finished for {STALL_S:.0f} s: "
                    + "; ".join(f"{k} {last[k]}" for k in w.keys)
                )
            if bar:
                bar.update(_sides(last, pre, dec), t - t0)
        wall = max(d["seconds"] for d in done.values())
        if bar:
            bar.update(_sides(last, pre, dec), wall, force=True)
            bar.close()
        phases["workload"] = time.monotonic() - t0
        w.watch = False  # closing an engine drains, deregisters: quiet for a moment
        live = pre + orch.live
        for k in live:
            w.send(k, "stop")
        final: dict[str, dict] = {}
        while len(final) < len(live):
            for key, kind, payload in w.poll(1.0):
                if kind == "final":
                    final[key] = payload
                elif kind not in ("progress", "done"):
                    raise WorkerFailed(f"the {key} worker sent {kind!r} after stop")
            if time.monotonic() - t0 > wall + PHASE_S + 60:
                raise WorkerFailed(f"no final report from {sorted(set(live) - set(final))}")
        link = hosts.link_bytes() if hosts is not None else None
        clean = True
    except WorkerFailed as e:
        w.close(failed=True)
        raise WorkerFailed(f"{e}\n{w.status()}") from None
    finally:
        if bar:
            bar.close()
        w.close(failed=not clean)
    codes = {k: p.exitcode for k, p in w.procs.items()}
    phases["shutdown"] = time.monotonic() - t_begin - sum(phases.values())
    res = build_result(
        cfg,
        final,
        raw,
        wall,
        time.monotonic() - t_begin,
        codes,
        keys=w.keys,
        roles=w.role,
        agents=w.agent,
        kill=orch.kill,
        confirmed=orch.confirmed,
        last=last,
    )
    res["phase_seconds"] = phases
    res["setup_seconds"] = {k: ready[k]["setup"] for k in ready}
    if hosts is not None:
        res["hosts"] = dict(hosts.describe(), link_bytes=link)
    else:
        res["hosts"] = {"kind": "one"}
    return res


def _sides(last: dict, pre: list, dec: list) -> dict:
    return {
        "prefill": _sum_progress([last[k] for k in pre]),
        "decode": _sum_progress([last[k] for k in dec]),
    }
