"""``kvmem demo``: the main job.  A prefill worker and a decode worker, two processes, each
with its own KVPool, PageAllocator and NIXL agent (UCX over loopback), run the PD lifecycle
of :mod:`kvmem.disagg` over requests of varied prompt lengths with chunked prefill, and by
default every fault of :class:`~kvmem.disagg.faults.FaultPlan` plus pause/resume cycles on
both sides.  The decode side verifies every chunk that lands, on arrival; at the end both
sides audit their pages.

::

    parent (this module)                      orchestration only: start, relay the two
      |  pipe                   |  pipe        metadata blobs once, pause the decode when
      v                         v              the prefill asks, progress line, report
    prefill worker  <== NIXL ==>  decode worker
    PrefillSide                   DecodeSide   every PD control message: NIXL notifications
    KVPool + alloc + staging      KVPool + alloc + landing buffer

Phases: start-up (pools pre-faulted, agents created, metadata exchanged); raw NIXL write
bandwidth between the same two processes (one registered ``bw_mib`` buffer into another,
the figure the demo's throughput is compared with); the workload; stop (audit, close,
counters).  The worker side is in :mod:`kvmem.demo_worker`.

Exit status: 0 when every request ended in exactly one outcome, no page leaked on either
side, every landed byte verified and no control message was refused; 1 when a check
failed; 2 for bad options; 3 when a worker failed or stopped answering before its final
report.  A worker that died of a signal after its final report (a native destructor at
its exit, say) leaves the results valid: the report carries a warning naming the signal.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass

DTYPES = ("bf16", "fp16", "fp32", "fp8")
CHUNK_MODES = ("auto", "packed", "direct")
TRANSFER_MODES = ("push", "pull")
OUTCOMES = ("succeeded", "aborted", "timed_out", "failed")
LANDING_ALIGN = 256  # the decode's landing Arena rounds each region up to this


@dataclass(frozen=True)
class DemoConfig:
    """Everything a run depends on; both workers get the same copy.

    Defaults: a model of 8 layers x 8 KV heads x 128 dims, bf16, 16-token pages (32 KiB of
    KV per token), prompts of 1..2048 tokens prefilled in 512-token chunks (16 MiB per
    chunk, up to 64 MiB per request), 8 requests in flight.
    """

    requests: int = 300
    abort_rate: float = 0.12
    timeout_rate: float = 0.04
    fail_rate: float = 0.06
    pauses: int = 4
    page_size: int = 16
    layers: int = 8
    heads: int = 8
    head_dim: int = 128
    dtype: str = "bf16"
    chunk_tokens: int = 512
    max_tokens: int = 2048
    concurrency: int = 8
    seed: int = 0
    bootstrap_timeout: float = 2.0  # the prefill's, seconds (sglang: 600)
    transfer_timeout: float = 2.0
    abort_wait: float = 0.02  # how long a client abort waits in its target state
    bw_mib: int = 256  # raw NIXL bandwidth buffer; 0: skip that phase
    bw_rounds: int = 5
    chunks: str = "auto"  # packed | direct | auto (per chunk, threshold calibrated at start)
    # pull: the decode reads; push: the prefill writes.  Pull by default: 0.86x [0.85, 0.89]
    # of raw NIXL against push auto's 0.71x [0.65, 0.78], faults off, 3 runs each, in a quiet
    # window of the 2-core VM (others' CPU <= 0.06 core; faults on 0.57x vs 0.52x); under
    # load (others ~1 core) push auto led, 0.85x vs 0.76x (bench/results/
    # cpu-2026-11-30-transfer-modes.md).  To be confirmed on a quiet machine.
    transfer_mode: str = "pull"

    # --- derived ------------------------------------------------------------------------
    def spec(self):
        import torch

        import kvmem

        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
              "fp8": torch.float8_e4m3fn}[self.dtype]
        return kvmem.KVSpec(num_layers=self.layers, num_kv_heads=self.heads,
                            head_dim=self.head_dim, page_size=self.page_size, dtype=dt)

    def calibrates(self) -> bool:
        """Whether the start-up measures the packed/direct threshold (push, --chunks auto)."""
        return self.transfer_mode == "push" and self.chunks == "auto"

    def rates(self) -> dict:
        return {"abort": self.abort_rate, "timeout": self.timeout_rate, "fail": self.fail_rate}

    @property
    def decode_timeout(self) -> float:
        """Well above the prefill's timeouts: those faults are the prefill's to detect."""
        return 5.0 * max(self.bootstrap_timeout, self.transfer_timeout)

    def request_pages(self) -> int:
        return -(-self.max_tokens // self.page_size)

    def token_bytes(self) -> int:
        """KV bytes of one token, all layers."""
        return self.spec().page_bytes // self.page_size

    def slots(self) -> int:
        """Requests at their longest that each side makes room for: those in flight, a
        quarter more for the ones still ending (the decode frees a request when the
        prefill's ABORT or AUX arrives, a little after the prefill counts it finished)."""
        return self.concurrency + -(-self.concurrency // 4)

    def prefill_pages(self) -> int:
        # A request holds its prefill pages until its last chunk is packed.
        return self.slots() * self.request_pages() + 1

    def decode_pages(self) -> int:
        return self.slots() * self.request_pages() + 1

    def landing_bytes(self) -> int:
        import kvmem
        from kvmem.disagg.prefill import AUX_BYTES

        per = kvmem.packed_nbytes(self.spec(), self.request_pages()) + AUX_BYTES
        return self.slots() * (per + LANDING_ALIGN)

    def batch_tokens(self) -> int:
        return 4 * self.chunk_tokens

    def memory_bytes(self) -> int:
        """About what the two workers allocate (pools, staging, landing, bandwidth buffers)."""
        page = self.spec().page_bytes
        staging = 8 * (self.chunk_tokens // self.page_size) * page  # PrefillSide's default
        return ((self.prefill_pages() + self.decode_pages()) * page + staging
                + self.landing_bytes() + 2 * (self.bw_mib << 20))

    def validate(self) -> None:
        """ValueError naming the option, for anything the run would trip on later."""
        def positive(name):
            v = getattr(self, name)
            if v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")

        for name in ("requests", "page_size", "layers", "heads", "head_dim", "chunk_tokens",
                     "max_tokens", "concurrency"):
            positive(name)
        for name in ("abort_rate", "timeout_rate", "fail_rate"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1], got {v}")
        if self.abort_rate + self.timeout_rate + self.fail_rate > 1.0:
            raise ValueError(f"--abort-rate + --timeout-rate + --fail-rate must be <= 1, got "
                             f"{self.abort_rate} + {self.timeout_rate} + {self.fail_rate}")
        if self.pauses < 0:
            raise ValueError(f"--pauses must be >= 0, got {self.pauses}")
        if self.pauses > self.requests:
            raise ValueError(f"--pauses {self.pauses} is more than --requests {self.requests}: "
                             "pauses happen between requests")
        if self.chunk_tokens % self.page_size:
            raise ValueError(f"--chunk-tokens must be a multiple of --page-size "
                             f"{self.page_size}, got {self.chunk_tokens}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        if self.bw_mib < 0:
            raise ValueError(f"--bw-mib must be >= 0, got {self.bw_mib}")
        if self.transfer_mode not in TRANSFER_MODES:
            raise ValueError(f"--transfer-mode must be one of {', '.join(TRANSFER_MODES)}, "
                             f"got {self.transfer_mode!r}")
        if self.chunks not in CHUNK_MODES:
            raise ValueError(f"--chunks must be one of {', '.join(CHUNK_MODES)}, got "
                             f"{self.chunks!r}")
        for t in (self.bootstrap_timeout, self.transfer_timeout):
            if not (math.isfinite(t) and t > 0):
                raise ValueError(f"--timeout must be a number of seconds > 0, got {t}")
        need = self.memory_bytes()
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        bw = 2 * (self.bw_mib << 20)
        if need > 0.75 * have and bw >= need - bw:  # the bandwidth buffers are most of it
            raise ValueError(
                f"--bw-mib {self.bw_mib}: the raw-bandwidth buffers (one in each worker) need "
                f"{bw / 2**30:.1f} GiB, about {need / 2**30:.1f} GiB with the workload, more "
                f"than 3/4 of this machine's {have / 2**30:.1f} GiB: lower --bw-mib (0 skips "
                "that phase)")
        if need > 0.75 * have:
            raise ValueError(
                f"this model and workload need about {need / 2**30:.1f} GiB of memory for the "
                f"two workers, more than 3/4 of this machine's {have / 2**30:.1f} GiB: lower "
                "--max-tokens, --concurrency or the model size")


# --- command line ---------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    g = p.add_argument_group("workload")
    g.add_argument("--requests", type=int, default=d.requests, help="requests to run (%(default)s)")
    g.add_argument("--concurrency", type=int, default=d.concurrency,
                   help="requests in flight on the prefill side (%(default)s)")
    g.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="prompt lengths are drawn from 1..MAX_TOKENS (%(default)s)")
    g.add_argument("--chunk-tokens", type=int, default=d.chunk_tokens,
                   help="chunked prefill: tokens per chunk, a multiple of the page size "
                        "(%(default)s)")
    g.add_argument("--seed", type=int, default=d.seed, help="seeds prompts, faults and KV data")
    f = p.add_argument_group("faults (0 turns a family off)")
    f.add_argument("--abort-rate", type=float, default=None,
                   help=f"client aborts, in every state and in the running batch ({d.abort_rate})")
    f.add_argument("--timeout-rate", type=float, default=None,
                   help=f"bootstrap and transfer timeouts ({d.timeout_rate})")
    f.add_argument("--fail-rate", type=float, default=None,
                   help=f"send failures of the first, a middle or the last chunk ({d.fail_rate})")
    f.add_argument("--pauses", type=int, default=None,
                   help=f"pause/resume cycles, alternating prefill and decode ({d.pauses})")
    f.add_argument("--no-faults", action="store_true", help="all of the above 0")
    f.add_argument("--timeout", type=float, default=d.transfer_timeout,
                   help="the prefill's bootstrap and transfer timeouts, s (%(default)s)")
    m = p.add_argument_group("model")
    m.add_argument("--layers", type=int, default=d.layers, help="(%(default)s)")
    m.add_argument("--heads", type=int, default=d.heads, help="KV heads (%(default)s)")
    m.add_argument("--head-dim", type=int, default=d.head_dim, help="(%(default)s)")
    m.add_argument("--page-size", type=int, default=d.page_size, help="(%(default)s)")
    m.add_argument("--dtype", default=d.dtype, choices=DTYPES, help="(%(default)s)")
    x = p.add_argument_group("transfer")
    x.add_argument("--transfer-mode", default=d.transfer_mode, choices=TRANSFER_MODES,
                   help="push: the prefill writes each chunk into the decode (as sglang); "
                        "pull: the prefill offers the pages and the decode reads them from "
                        "its pool, pool to pool (as vLLM's NIXL connector) (%(default)s)")
    x.add_argument("--chunks", default=d.chunks, choices=CHUNK_MODES,
                   help="packed: every chunk packed into the decode's landing buffer; direct: "
                        "pool pages written into the decode's pool pages; auto: per chunk, "
                        "direct when its page runs (merged where adjacent on both sides) "
                        "reach a threshold measured at start-up; push only (%(default)s)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", help="write the report as JSON (overwrites FILE)")
    o.add_argument("--quiet", action="store_true",
                   help="no progress line; a one-line summary instead of the report (the "
                        "progress line shows only when stderr is a terminal)")
    o.add_argument("--bw-mib", type=int, default=d.bw_mib,
                   help="raw NIXL bandwidth buffer, MiB; 0 skips that phase (%(default)s)")


def config_from_args(args) -> DemoConfig:
    d = DemoConfig()
    faults = {"abort_rate": args.abort_rate, "timeout_rate": args.timeout_rate,
              "fail_rate": args.fail_rate, "pauses": args.pauses}
    if args.no_faults:
        clash = [f"--{k.replace('_', '-')} {v}" for k, v in faults.items() if v]
        if clash:
            raise ValueError(f"--no-faults contradicts {', '.join(clash)}")
        faults = {k: 0 for k in faults}
    faults = {k: getattr(d, k) if v is None else v for k, v in faults.items()}
    cfg = DemoConfig(
        requests=args.requests, pauses=faults["pauses"], page_size=args.page_size,
        abort_rate=faults["abort_rate"], timeout_rate=faults["timeout_rate"],
        fail_rate=faults["fail_rate"], layers=args.layers, heads=args.heads,
        head_dim=args.head_dim, dtype=args.dtype, chunk_tokens=args.chunk_tokens,
        max_tokens=args.max_tokens, concurrency=args.concurrency, seed=args.seed,
        bootstrap_timeout=args.timeout, transfer_timeout=args.timeout, bw_mib=args.bw_mib,
        chunks=args.chunks, transfer_mode=args.transfer_mode)
    cfg.validate()
    if args.json is not None:
        check_json_path(args.json)
    return cfg


def check_json_path(path: str) -> None:
    """ValueError naming ``--json`` unless the report can be written to ``path``: its
    directory exists and takes a new file (probed by creating and removing one), and
    ``path`` is a regular file or nothing yet."""
    full = os.path.abspath(path)
    parent = os.path.dirname(full)
    if not path or path.endswith(os.sep) or os.path.isdir(full):
        raise ValueError(f"--json {path}: is a directory, not a file")
    if not os.path.isdir(parent):
        raise ValueError(f"--json {path}: directory {parent} does not exist")
    if os.path.lexists(full) and not os.path.isfile(full):
        raise ValueError(f"--json {path}: exists and is not a regular file")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(full)}.",
                                     suffix=".probe")
    except OSError as e:
        raise ValueError(f"--json {path}: cannot create a file in {parent}: "
                         f"{e.strerror or e}") from None
    os.close(fd)
    os.unlink(probe)


class Terminated(Exception):
    """SIGTERM reached the demo's parent process."""


def _on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: the clean-up runs now
    raise Terminated()


def main(args, parser: argparse.ArgumentParser) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))  # usage + "kvmem demo: error: ...", exit status 2
    old = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _main(args, cfg)
    except KeyboardInterrupt:
        print("\nkvmem demo: interrupted; both workers stopped", file=sys.stderr)
        return 130
    except Terminated:
        print("\nkvmem demo: terminated (SIGTERM); both workers stopped", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, old)


def _main(args, cfg: DemoConfig) -> int:
    try:
        result = run(cfg, progress=not args.quiet)
    except WorkerFailed as e:
        print(f"\nkvmem demo: FAILED: {e}", file=sys.stderr)
        if args.json:
            _save(args.json, dict(ok=False, errors=[str(e)], config=asdict(cfg)))
        return 3
    print(summary_line(result) if args.quiet else format_report(result))
    if args.json and not _save(args.json, result):
        return 1
    return 0 if result["ok"] else 1


def _save(path: str, obj: dict) -> bool:
    try:
        write_json(path, obj)
        return True
    except OSError as e:
        print(f"kvmem demo: --json {path}: cannot write the report: {e}", file=sys.stderr)
        return False


def write_json(path: str, obj: dict) -> None:
    """Write ``obj`` to ``path`` atomically (a temporary file in the same directory, then
    a rename); on failure the temporary file is removed and OSError raised."""
    full = os.path.abspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(full), prefix=f".{os.path.basename(full)}.",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=False)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, full)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


# --- the parent -----------------------------------------------------------------------------

class WorkerFailed(RuntimeError):
    """A worker raised, died or stopped answering; the message names it."""


STARTUP_S = 180.0    # spawn, import torch, pools pre-faulted, NIXL agent
PHASE_S = 120.0      # each hand-shake step after that
SILENT_S = 30.0      # a worker sends progress ~5 times a second
STALL_S = 120.0      # no request finished for this long (timeouts are a few seconds)


def exit_how(code) -> str:
    """A process's ``exitcode`` (multiprocessing's: None while running, -N for signal N)
    in words: 'still running', 'killed by signal 11 (SIGSEGV)', 'exit status 1'."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        return f"killed by signal {-code} ({name})"
    return f"exit status {code}"


class Workers:
    """The two worker processes and their pipes."""

    def __init__(self, cfg: DemoConfig):
        from kvmem.demo_worker import worker_main

        ctx = mp.get_context("spawn")
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.names = {r: f"kvmem-demo-{r}-{tag}" for r in ("prefill", "decode")}
        self.conns, self.procs, self.heard = {}, {}, {}
        self.inbox: list = []  # received, not consumed yet
        self.ended: set = set()  # roles whose "final" arrived
        self.watch = False  # silence detection: on while the workload runs
        self.closed = False
        try:
            for role in ("prefill", "decode"):
                here, there = ctx.Pipe()
                proc = ctx.Process(target=worker_main, name=f"kvmem-demo-{role}",
                                   args=(role, cfg, there, self.names), daemon=True)
                self.conns[role] = here
                proc.start()
                self.procs[role] = proc
                there.close()
                self.heard[role] = time.monotonic()
        except BaseException:  # SIGTERM / Ctrl-C while starting: stop what started
            self.close(failed=True)
            raise

    def send(self, role: str, kind: str, payload=None) -> None:
        try:
            self.conns[role].send((kind, payload))
        except (OSError, EOFError) as e:
            raise WorkerFailed(self._why(role, f"pipe closed ({e})")) from None

    def _why(self, role: str, what: str) -> str:
        proc = self.procs[role]
        proc.join(0.5)
        code = proc.exitcode
        state = "still running" if code is None else f"exit status {code}"
        return f"the {role} worker: {what} ({state}, pid {proc.pid})"

    def poll(self, timeout: float) -> list[tuple[str, str, object]]:
        """Messages that arrived within ``timeout`` s: ``[(role, kind, payload)]``, the
        buffered ones (:meth:`expect` left them) first.  WorkerFailed for an ``error``
        message, a worker that exited before its ``final`` message, a closed pipe, or a
        worker silent for SILENT_S while the workload runs."""
        out, self.inbox = self.inbox, []
        live = [r for r in self.procs if r not in self.ended]
        by_obj = {self.conns[r]: r for r in live}
        by_obj.update({self.procs[r].sentinel: r for r in live})
        for obj in mpc.wait(list(by_obj), 0 if out else timeout):
            role = by_obj[obj]
            if role in self.ended:
                continue
            conn, got = self.conns[role], 0
            while True:
                try:
                    if not conn.poll():
                        break
                    kind, payload = conn.recv()
                except (OSError, EOFError):
                    raise WorkerFailed(self._why(role, "its pipe closed")) from None
                if kind == "error":
                    raise WorkerFailed(f"the {role} worker raised:\n{payload}")
                self.heard[role] = time.monotonic()
                out.append((role, kind, payload))
                got += 1
                if kind == "final":
                    self.ended.add(role)
                    break
            if obj is self.procs[role].sentinel and not got and role not in self.ended:
                raise WorkerFailed(self._why(role, "exited"))
        if self.watch:
            t = time.monotonic()
            for role in live:
                if t - self.heard[role] > SILENT_S:
                    raise WorkerFailed(self._why(role, f"silent for {t - self.heard[role]:.0f} s"))
        return out

    def expect(self, role: str, kind: str, timeout: float = PHASE_S):
        """The payload of the next ``kind`` message from ``role``; other messages stay
        buffered for later (the two workers' hand-shake messages come in either order)."""
        end = time.monotonic() + timeout
        while True:
            msgs = self.poll(min(1.0, max(end - time.monotonic(), 0.0)))
            for i, (r, k, payload) in enumerate(msgs):
                if (r, k) == (role, kind):
                    self.inbox = msgs[:i] + msgs[i + 1:] + self.inbox
                    return payload
            self.inbox = msgs + self.inbox
            if time.monotonic() >= end:
                raise WorkerFailed(self._why(role, f"no {kind!r} in {timeout:.0f} s"))

    def status(self) -> str:
        """How each worker ended, e.g. 'decode worker: killed by signal 9 (SIGKILL)'."""
        return "; ".join(f"{role} worker (pid {proc.pid}): {exit_how(proc.exitcode)}"
                         for role, proc in self.procs.items())

    def close(self, failed: bool = False) -> None:
        """Join both.  After a failure the pipes are closed first (a worker exits when its
        pipe ends) and the grace time is short; a worker still alive after it is
        terminated, then killed.  Calling it again does nothing."""
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


def run(cfg: DemoConfig, progress: bool = True) -> dict:
    """Run the demo; the result dict (what ``--json`` writes).  WorkerFailed if a worker
    fails; both processes are gone when this returns or raises."""
    t_begin = time.monotonic()
    bar = Progress(cfg) if progress else None
    w = Workers(cfg)  # stops what it started should it be interrupted itself
    clean = False
    try:
        if bar:
            bar.note("starting the prefill and decode workers")
        ready = {r: w.expect(r, "ready", STARTUP_S) for r in ("prefill", "decode")}
        phases = {"startup": time.monotonic() - t_begin}
        w.send("prefill", "peer", ready["decode"]["metadata"])
        w.send("decode", "peer", ready["prefill"]["metadata"])
        raw = None
        if cfg.bw_mib or cfg.calibrates():  # raw bandwidth and/or the calibration
            if bar:
                bar.note(f"measuring raw NIXL write bandwidth ({cfg.bw_mib} MiB buffer)")
            w.send("decode", "bw_listen")
            w.expect("decode", "bw_listening")
            w.send("prefill", "bw_run")
            raw = w.expect("prefill", "bw_result")
            w.send("decode", "bw_end")
            raw.update(w.expect("decode", "bw_checked"))
        for r in ("prefill", "decode"):
            w.send(r, "start")
        t0 = time.monotonic()
        if bar:
            bar.start()
        phases["bandwidth"] = t0 - t_begin - phases["startup"]
        w.heard = {r: t0 for r in w.heard}
        w.watch = True
        last = {"prefill": {}, "decode": {}}
        done = {}
        finished, t_finished = -1, t0
        while len(done) < 2:
            for role, kind, payload in w.poll(0.1):
                if kind == "progress":
                    last[role] = payload
                elif kind == "pause_decode":
                    w.send("decode", "pause", payload)
                elif kind == "resumed":
                    w.send("prefill", "decode_resumed", payload)
                elif kind == "done":
                    done[role] = payload
                else:
                    raise WorkerFailed(f"the {role} worker sent an unexpected {kind!r}")
            t = time.monotonic()
            n = last["prefill"].get("finished", 0) + last["decode"].get("completed", 0)
            if n != finished:
                finished, t_finished = n, t
            elif t - t_finished > STALL_S:
                raise WorkerFailed(f"no request finished for {STALL_S:.0f} s: prefill "
                                   f"{last['prefill']}, decode {last['decode']}")
            if bar:
                bar.update(last, t - t0)
        wall = max(d["seconds"] for d in done.values())
        if bar:
            bar.update(last, wall, force=True)
            bar.close()
        phases["workload"] = time.monotonic() - t0
        w.watch = False  # closing an engine drains, deregisters: quiet for a moment
        for r in ("prefill", "decode"):
            w.send(r, "stop")
        final = {}
        while len(final) < 2:
            for role, kind, payload in w.poll(1.0):
                if kind == "final":
                    final[role] = payload
                elif kind not in ("progress", "done"):
                    raise WorkerFailed(f"the {role} worker sent {kind!r} after stop")
            if time.monotonic() - t0 > wall + PHASE_S + 60:
                raise WorkerFailed(f"no final report from {sorted(set(w.procs) - set(final))}")
        clean = True
    except WorkerFailed as e:
        w.close(failed=True)
        raise WorkerFailed(f"{e}\n{w.status()}") from None
    finally:
        if bar:
            bar.close()
        w.close(failed=not clean)
    codes = {r: p.exitcode for r, p in w.procs.items()}
    phases["shutdown"] = time.monotonic() - t_begin - sum(phases.values())
    res = build_result(cfg, final, raw, wall, time.monotonic() - t_begin, codes)
    res["phase_seconds"] = phases
    res["setup_seconds"] = {r: ready[r]["setup"] for r in ready}
    return res


# --- the result -----------------------------------------------------------------------------

def _ms_stats(xs) -> dict:
    if not xs:
        return {"count": 0, "median_ms": None, "max_ms": None}
    return {"count": len(xs), "median_ms": statistics.median(xs) * 1e3, "max_ms": max(xs) * 1e3}


def build_result(cfg, final: dict, raw, wall: float, total: float, exit_codes: dict) -> dict:
    pre, dec = final["prefill"], final["decode"]
    pm, dm = pre["metrics"], dec["metrics"]
    outcomes = {o: int(pm["requests"].get(o, 0)) for o in OUTCOMES}
    verified = int(dm["bytes_verified"])
    res = dict(
        requests=cfg.requests, **outcomes,
        pauses=int(pm["pauses"] + dm["pauses"]),
        bytes_transferred=int(dm["bytes_landed"]),
        bytes_verified=verified,
        bytes_corrupt=int(dm["bytes_corrupt"]),
        leaked_pages={"prefill": int(pre["leaked_pages"]), "decode": int(dec["leaked_pages"])},
        throughput_gbps=float(verified / wall / 1e9) if wall > 0 else 0.0,
        wall_seconds=wall, total_seconds=total,
    )
    calibration = raw.pop("calibration", None) if raw else None
    if raw and "warm_s" not in raw:
        raw = None  # the phase ran for the calibration only (--bw-mib 0)
    if raw:
        warm = raw["warm_s"]
        med = statistics.median(warm)
        res["raw_nixl"] = dict(nbytes=raw["nbytes"], rounds=len(warm), first_s=raw["first_s"],
                               median_s=med, gbps=raw["nbytes"] / med / 1e9,
                               best_gbps=raw["nbytes"] / min(warm) / 1e9,
                               verified=raw["verified"])
        res["raw_nixl_gbps"] = res["raw_nixl"]["gbps"]
        res["throughput_vs_raw"] = res["throughput_gbps"] / res["raw_nixl_gbps"]
    else:
        res["raw_nixl_gbps"] = None
        res["throughput_vs_raw"] = None
    res.update(
        faults_planned=pre["faults_planned"],
        outcomes_by_fault=pre["outcomes_by_fault"],
        outcomes_by_status={str(k): v for k, v in pre["outcomes_by_status"].items()},
        pauses_by_side={"prefill": pm["pauses"], "decode": dm["pauses"]},
        pause_mean_ms={s: (m["pause_seconds"] / m["pauses"] * 1e3 if m["pauses"] else None)
                       for s, m in (("prefill", pm), ("decode", dm))},
        time_to_free=_ms_stats(pm["time_to_free"]),
        protocol_errors={"prefill": pm["protocol_errors"], "decode": dm["protocol_errors"]},
        bytes_packed=int(pm["bytes_packed"]), bytes_sent=int(pm["bytes_sent"]),
    )
    for side, f in (("prefill", pre), ("decode", dec)):
        m = dict(f["metrics"])
        m.pop("time_to_free")
        res[side] = dict(metrics=m, freed_by_reason=f["freed_by_reason"],
                         leaked_owners=f["leaked_owners"], audit=f["audit"],
                         allocator_allocated=f["allocator_allocated"],
                         arena_used_bytes=f["arena_used_bytes"],
                         open_handles=f["open_handles"], closed=f["closed"],
                         exit_code=exit_codes.get(side),
                         stage_seconds=f["stage_seconds"])
    pre_ok, dec_ok = set(pre["succeeded_rids"]), set(dec["succeeded_rids"])
    # A request can end early on the prefill (an abort, a pause) after its last write landed
    # and was announced: the decode has all of it, the client was told otherwise.  The
    # other way round (told delivered, not received) is a failure.
    res["delivered"] = dict(prefill=len(pre_ok), decode=len(dec_ok),
                            missing=sorted(pre_ok - dec_ok),
                            received_after_early_end=sorted(dec_ok - pre_ok))
    res.update(transfer_fields(cfg, pre, dec, calibration))
    res["config"] = asdict(cfg)
    errors = check(res)
    res["ok"] = not errors
    res["errors"] = errors
    res["warnings"] = exit_warnings(res)
    return res


def check(res: dict) -> list[str]:
    """What makes the run fail (exit status 1)."""
    errs = []
    parts = sum(res[o] for o in OUTCOMES)
    if parts != res["requests"]:
        errs.append(f"outcomes add up to {parts}, not {res['requests']} requests")
    for side in ("prefill", "decode"):
        s = res[side]
        if res["leaked_pages"][side]:
            errs.append(f"{side}: {res['leaked_pages'][side]} page(s) leaked, held by "
                        f"{s['leaked_owners'] or 'nobody (unaccounted)'}")
        if s["allocator_allocated"]:
            errs.append(f"{side}: the allocator still counts {s['allocator_allocated']} pages "
                        "allocated")
        if s["arena_used_bytes"]:
            errs.append(f"{side}: {s['arena_used_bytes']} bytes of its registered buffer "
                        "still reserved")
        if s["open_handles"]:
            errs.append(f"{side}: {s['open_handles']} transfer handle(s) still open")
        if res["protocol_errors"][side]:
            errs.append(f"{side}: {res['protocol_errors'][side]} control message(s) refused")
        if s["exit_code"] is None or s["exit_code"] > 0:  # a signal: exit_warnings
            errs.append(f"{side} worker exited with status {s['exit_code']}")
    if res["bytes_corrupt"]:
        errs.append(f"{res['bytes_corrupt']} landed bytes failed verification")
    if res["bytes_verified"] != res["bytes_transferred"]:
        errs.append(f"{res['bytes_transferred']} bytes landed but {res['bytes_verified']} "
                    "verified")
    if res["delivered"]["missing"]:
        errs.append(f"the prefill reports requests {res['delivered']['missing'][:10]} delivered, "
                    "the decode did not receive them")
    if res.get("raw_nixl") and not res["raw_nixl"]["verified"]:
        errs.append("the raw NIXL bandwidth buffer did not arrive intact")
    return errs


def exit_warnings(res: dict) -> list[str]:
    """The workers that died of a signal after their final report: every result came in
    that report, so the run stands; each is named with its signal.  (A worker that dies
    before its final report fails the run, exit status 3, before there is a result.)"""
    return [f"the {side} worker was {exit_how(res[side]['exit_code'])} after its final "
            "report (its results are complete)"
            for side in ("prefill", "decode")
            if res[side]["exit_code"] is not None and res[side]["exit_code"] < 0]


# --- output ---------------------------------------------------------------------------------

def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 2**20:.1f} MiB"


def format_report(r: dict) -> str:
    c = r["config"]
    lines = []
    add = lines.append
    tok = DemoConfig(**c).token_bytes()
    add(f"kvmem demo: {r['requests']} requests, model {c['layers']} layers x {c['heads']} KV "
        f"heads x {c['head_dim']} ({c['dtype']}), page {c['page_size']} tokens, "
        f"{tok // 1024} KiB of KV per token; prompts 1..{c['max_tokens']} tokens in "
        f"{c['chunk_tokens']}-token chunks ({_gb(c['chunk_tokens'] * tok)} each), "
        f"{c['concurrency']} in flight")
    add("")
    add("requests by outcome")
    for o in OUTCOMES:
        add(f"  {o:<10} {r[o]:>7}")
    by_status = r["outcomes_by_status"]
    add(f"  (aborted includes {by_status.get('503', 0)} aborted by a pause (503); "
        f"sum {sum(r[o] for o in OUTCOMES)} of {r['requests']})")
    late = r["delivered"]["received_after_early_end"]
    add(f"  the decode received all KV of {r['delivered']['decode']} requests: the "
        f"{r['succeeded']} succeeded" + (f", and {len(late)} whose last write had landed when "
                                         f"the prefill ended them early" if late else ""))
    add("")
    add("faults injected (planned kind -> how those requests ended)")
    for kind in sorted(r["faults_planned"], key=lambda k: (k != "none", k)):
        ends = r["outcomes_by_fault"].get(kind, {})
        ends_s = ", ".join(f"{k} {v}" for k, v in sorted(ends.items()))
        add(f"  {kind:<22} {r['faults_planned'][kind]:>6}   {ends_s}")
    add("")
    pm = r["pause_mean_ms"]
    add(f"pauses: {r['pauses']} (prefill {r['pauses_by_side']['prefill']}, mean "
        f"{_ms(pm['prefill'])}; decode {r['pauses_by_side']['decode']}, mean {_ms(pm['decode'])})")
    ttf = r["time_to_free"]
    add(f"aborts in the running batch: {ttf['count']}, prefill pages freed in the same step's "
        f"fill_batch after median {_ms(ttf['median_ms'], 3)}, max {_ms(ttf['max_ms'], 3)}")
    add("")
    add(f"bytes: packed {_gb(r['bytes_packed'])}, sent {_gb(r['bytes_sent'])}, landed "
        f"{_gb(r['bytes_transferred'])}, verified {_gb(r['bytes_verified'])}, corrupt "
        f"{r['bytes_corrupt']}")
    raw = r.get("raw_nixl")
    thr = (f"throughput: {r['throughput_gbps']:.2f} GB/s of verified KV over "
           f"{r['wall_seconds']:.1f} s")
    if raw:
        thr += (f"; raw NIXL write between the same processes {raw['gbps']:.2f} GB/s "
                f"({raw['nbytes'] >> 20} MiB, median of {raw['rounds']}; first write "
                f"{raw['first_s'] * 1e3:.0f} ms): {r['throughput_vs_raw']:.2f}x raw")
    add(thr)
    add(transfer_line(r))
    add(f"leaked pages: prefill {r['leaked_pages']['prefill']}, decode "
        f"{r['leaked_pages']['decode']}")
    for side in ("prefill", "decode"):
        if r[side]["leaked_owners"]:
            add(f"  {side} owners: {r[side]['leaked_owners']}")
    add(f"protocol errors: prefill {r['protocol_errors']['prefill']}, decode "
        f"{r['protocol_errors']['decode']}")
    add("")
    add(f"where the time went (seconds of the {r['wall_seconds']:.1f} s workload)")
    for side in ("prefill", "decode"):
        st = r[side]["stage_seconds"]
        b = loop_breakdown(st)
        nap = st.get("nap", {})
        add(f"  {side}: worker loop {b['loop']:.2f}, of which in step() {b['step']:.2f}, "
            f"napping {b['nap']:.2f} ({nap.get('calls', 0)} naps)")
        for k, sec in sorted(b["in_step"].items(), key=lambda x: -x[1]):
            add(f"    {k:<32} {sec:7.2f}   {st[k]['calls']:>8} calls")
        add(f"    {'rest of step() (Python)':<32} {b['rest_of_step']:7.2f}")
    add("")
    ph = r.get("phase_seconds", {})
    add(f"total {r['total_seconds']:.1f} s: " + ", ".join(f"{k} {v:.1f} s" for k, v in ph.items()))
    for side, st in r.get("setup_seconds", {}).items():
        add(f"  {side} set-up: " + ", ".join(f"{k} {v:.1f} s" for k, v in st.items())
            + " (the rest of start-up: interpreter and imports)")
    for w in r.get("warnings", []):
        add(f"warning: {w}")
    add("OK" if r["ok"] else "FAILED:\n  " + "\n  ".join(r["errors"]))
    return "\n".join(lines)


# stages a worker times outside step(): its loop, the naps between steps
_OUTSIDE_STEP = ("step", "loop", "nap")


def loop_breakdown(stage_seconds: dict) -> dict:
    """A worker's ``stage_seconds`` (name -> {"seconds", "calls"}) as ``loop``, ``step``
    and ``nap`` seconds, ``in_step`` (the stages timed inside ``step()``, name -> seconds)
    and ``rest_of_step``: ``step`` minus those, the Python of ``step()`` itself."""
    sec = {k: v["seconds"] for k, v in stage_seconds.items()}
    in_step = {k: v for k, v in sec.items() if k not in _OUTSIDE_STEP}
    step = sec.get("step", 0.0)
    return {"loop": sec.get("loop", 0.0), "step": step, "nap": sec.get("nap", 0.0),
            "in_step": in_step, "rest_of_step": step - sum(in_step.values())}


def _ms(x, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f} ms"


def transfer_fields(cfg, pre: dict, dec: dict, calibration) -> dict:
    """The report's transfer-mode and CPU fields: ``transfer_mode`` (push: the prefill
    writes), ``chunk_mode`` (--chunks), ``direct_threshold`` (bytes per merged descriptor
    from which a chunk went direct; None: every chunk packed), ``calibration`` (the
    measurement behind it, --chunks auto), ``chunks`` (posted, by kind), and ``cpu``: per
    worker, CPU seconds of the workload (``time.process_time``, every thread of the
    process) and per GB it moved (prefill: bytes sent, decode: bytes landed), and
    ``poll_share``: the share of its workload loop spent in ``get_notifs``."""
    cpu = {}
    for side, f, moved in (("prefill", pre, "bytes_sent"), ("decode", dec, "bytes_landed")):
        s, b = f.get("cpu_seconds"), int(f["metrics"][moved])
        st = f.get("stage_seconds", {})
        loop = st.get("loop", {}).get("seconds", 0.0)
        cpu[side] = dict(seconds=s, bytes=b,
                         seconds_per_gb=(s / (b / 1e9)) if s is not None and b else None,
                         poll_share=(st.get("get_notifs", {}).get("seconds", 0.0) / loop
                                     if loop > 0 else None))
    return dict(transfer_mode=cfg.transfer_mode,
                chunk_mode=cfg.chunks if cfg.transfer_mode == "push" else "pulled",
                direct_threshold=pre.get("direct_threshold"), calibration=calibration,
                chunks=pre.get("chunk_modes", {}), cpu=cpu,
                cpu_seconds_per_gb={k: v["seconds_per_gb"] for k, v in cpu.items()})


def transfer_line(r: dict) -> str:
    thr = r.get("direct_threshold")
    cal = r.get("calibration")
    how = {"auto": "per chunk", "packed": "all packed", "direct": "all direct",
           "pulled": "read by the decode, pool to pool"}[r["chunk_mode"]]
    if r["chunk_mode"] == "auto":
        how += (", direct from " + (f"{thr / 1024:g} KiB per merged descriptor" if thr is not None
                                    else "nowhere (packing won at every run length)")
                + (f" (calibrated at start-up over {len(cal['rows'])} run lengths)" if cal else ""))
    ch = r.get("chunks", {})
    cpu = r["cpu"]
    per = "; ".join(f"{s} {c['seconds']:.1f} s" + (f" = {c['seconds_per_gb']:.2f} s/GB"
                                                     if c["seconds_per_gb"] is not None else "")
                    + (f", {c['poll_share']:.0%} of its loop polling"
                       if c.get("poll_share") is not None else "")
                    for s, c in cpu.items() if c["seconds"] is not None)
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(ch.items())) or "none"
    return (f"transfer: {r['transfer_mode']}, chunks {how}: {kinds}; CPU of the workload: "
            f"{per or '-'}")


def summary_line(r: dict) -> str:
    raw = f", {r['throughput_vs_raw']:.2f}x raw NIXL" if r.get("raw_nixl") else ""
    status = "OK" if r["ok"] else "FAILED: " + "; ".join(r["errors"])
    warn = "".join(f"; warning: {w}" for w in r.get("warnings", []))
    return (f"kvmem demo: {r['requests']} requests: " + ", ".join(f"{o} {r[o]}" for o in OUTCOMES)
            + f"; pauses {r['pauses']}; leaked {r['leaked_pages']}; "
            f"{r['throughput_gbps']:.2f} GB/s verified{raw}; {r['wall_seconds']:.1f} s{warn}: "
            f"{status}")


class Progress:
    """The demo's progress: one tqdm line on stderr, redrawn in place at most every
    ``EVERY`` seconds: requests finished of ``cfg.requests``, their outcomes, pauses done,
    GB/s verified.  tqdm draws nothing when the stream is not a terminal (``disable=None``):
    a pipe or a log file gets only the report."""

    EVERY = 0.2  # seconds between redraws (the workers report about that often)
    NOTE = "{desc} ... {elapsed}"  # before the workload: what happens, for how long

    def __init__(self, cfg: DemoConfig, file=None):
        from tqdm import tqdm  # here: the library and `kvmem selfcheck` do without it

        self.cfg = cfg
        self.t = -math.inf  # the last draw
        self.bar = tqdm(total=cfg.requests, desc="kvmem demo", unit="req", leave=True,
                        file=sys.stderr if file is None else file, disable=None,
                        dynamic_ncols=True, bar_format=self.NOTE)

    @property
    def shown(self) -> bool:
        return not self.bar.disable

    def note(self, text: str) -> None:
        """What the demo does before the workload (start-up, the raw bandwidth)."""
        self.bar.set_description_str(f"kvmem demo: {text}")

    def start(self) -> None:
        """The workload begins: count and clock from zero."""
        self.bar.set_description_str("kvmem demo", refresh=False)
        self.bar.bar_format = None  # tqdm's own: percentage, bar, count, times, postfix
        self.bar.reset(total=self.cfg.requests)

    def update(self, last: dict, elapsed: float, force: bool = False) -> None:
        """``last``: the workers' latest progress messages; ``elapsed``: seconds of
        workload."""
        t = time.monotonic()
        if not force and t - self.t < self.EVERY:
            return
        self.t = t
        p, d = last["prefill"], last["decode"]
        o = p.get("outcomes", {})
        gbps = d.get("bytes_verified", 0) / elapsed / 1e9 if elapsed > 0 else 0.0
        self.bar.n = p.get("finished", 0)
        self.bar.set_postfix_str(
            f"ok {o.get('succeeded', 0)} abort {o.get('aborted', 0)} timeout "
            f"{o.get('timed_out', 0)} fail {o.get('failed', 0)}, pauses "
            f"{p.get('pauses', 0)}/{self.cfg.pauses}, {gbps:.2f} GB/s", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        """Leave the last state on its line; a second call does nothing."""
        self.bar.close()
