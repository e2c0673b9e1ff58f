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
import threading
import time
import uuid
from dataclasses import asdict, dataclass

from kvmem.demo.hosts import HOSTS, HostsError, NetnsHosts, netns_refusal

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
    # pull: the decode reads; push: the prefill writes.  Pull by default: it led push in a
    # quiet window, push led under load (bench/results/cpu-2026-11-30-transfer-modes.md).
    transfer_mode: str = "pull"
    hosts: str = "one"  # one: every worker on this host; netns: two network namespaces
    prefills: int = 1  # prefill workers
    decodes: int = 1  # decode workers
    kill_decode: bool = False  # SIGKILL the last decode mid-transfer (needs decodes >= 2)

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
        # Every prefill's requests may be routed to one decode (the others paused or gone).
        return self.prefills * self.slots() * self.request_pages() + 1

    def landing_bytes(self) -> int:
        import kvmem
        from kvmem.disagg.prefill import AUX_BYTES

        per = kvmem.packed_nbytes(self.spec(), self.request_pages()) + AUX_BYTES
        return self.prefills * self.slots() * (per + LANDING_ALIGN)

    def batch_tokens(self) -> int:
        return 4 * self.chunk_tokens

    def memory_bytes(self) -> int:
        """About what the workers allocate (pools, staging, landing, bandwidth buffers)."""
        page = self.spec().page_bytes
        staging = 8 * (self.chunk_tokens // self.page_size) * page  # PrefillSide's default
        return (self.prefills * (self.prefill_pages() * page + staging)
                + self.decodes * (self.decode_pages() * page + self.landing_bytes())
                + 2 * (self.bw_mib << 20))

    def validate(self) -> None:
        """ValueError naming the option, for anything the run would trip on later."""
        def positive(name):
            v = getattr(self, name)
            if v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")

        for name in ("requests", "page_size", "layers", "heads", "head_dim", "chunk_tokens",
                     "max_tokens", "concurrency", "prefills", "decodes"):
            positive(name)
        if self.hosts not in HOSTS:
            raise ValueError(f"--hosts must be one of {', '.join(HOSTS)}, got {self.hosts!r}")
        if self.requests < self.prefills:
            raise ValueError(f"--requests {self.requests} is fewer than --prefills "
                             f"{self.prefills}: every prefill runs at least one request")
        if self.kill_decode and self.decodes < 2:
            raise ValueError(f"--kill-decode needs --decodes >= 2 (a decode that survives "
                             f"serves the rest), got --decodes {self.decodes}")
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
        if self.transfer_mode == "pull" and self.chunks != "auto":
            raise ValueError(f"--chunks {self.chunks} contradicts --transfer-mode pull (the "
                             "decode reads pool pages; --chunks chooses how a push writes)")
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
                f"{self.prefills + self.decodes} workers, more than 3/4 of this machine's "
                f"{have / 2**30:.1f} GiB: lower --max-tokens, --concurrency, the model size "
                "or the worker counts")
        if self.hosts == "netns":
            why = netns_refusal()
            if why:
                raise ValueError(why)


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
    h = p.add_argument_group("workers and hosts")
    h.add_argument("--prefills", type=int, default=d.prefills,
                   help="prefill workers; request ids are dealt among them (%(default)s)")
    h.add_argument("--decodes", type=int, default=d.decodes,
                   help="decode workers; each prefill routes each request to the least "
                        "loaded decode that is neither paused nor gone (%(default)s)")
    h.add_argument("--kill-decode", action="store_true",
                   help="kill the last decode worker with SIGKILL in the middle of "
                        "receiving requests, once a quarter of them have finished; its requests "
                        "end as the lifecycle says, the others go on (needs --decodes >= 2)")
    h.add_argument("--hosts", default=d.hosts, choices=HOSTS,
                   help="one: every worker on this host (UCX moves KV by cross-memory "
                        "attach); netns: prefills and decodes in two network namespaces "
                        "joined by a veth pair, made and removed by the demo, KV over TCP "
                        "(needs root and `ip`) (%(default)s)")
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
        chunks=args.chunks, transfer_mode=args.transfer_mode, hosts=args.hosts,
        prefills=args.prefills, decodes=args.decodes, kill_decode=args.kill_decode)
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
    except HostsError as e:
        print(f"\nkvmem demo: --hosts netns: {e}", file=sys.stderr)
        return 2
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
        self.conns, self.procs, self.heard = {}, {}, {}
        self.inbox: list = []  # received, not consumed yet
        self.ended: set = set()  # keys whose "final" arrived
        self.killed: set = set()  # keys the demo killed on purpose (--kill-decode)
        self.watch = False  # silence detection: on while the workload runs
        self.closed = False
        try:
            for role, index, key in keys:
                here, there = ctx.Pipe()
                place = None if hosts is None else hosts.place(role)
                proc = ctx.Process(target=worker_main, name=f"kvmem-demo-{key}",
                                   args=(role, cfg, there, names, index, place), daemon=True)
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

    def kill(self, key: str) -> int:
        """SIGKILL worker ``key`` on purpose and reap it; its exit code."""
        proc = self.procs[key]
        self.killed.add(key)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10.0)
        self.conns[key].close()
        return proc.exitcode

    def poll(self, timeout: float) -> list[tuple[str, str, object]]:
        """Messages that arrived within ``timeout`` s: ``[(key, kind, payload)]``, the
        buffered ones (:meth:`expect` left them) first.  WorkerFailed for an ``error``
        message, a worker that exited before its ``final`` message (unless the demo killed
        it), a closed pipe, or a worker silent for SILENT_S while the workload runs."""
        out, self.inbox = self.inbox, []
        live = [k for k in self.keys if k not in self.ended and k not in self.killed]
        by_obj = {self.conns[k]: k for k in live}
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
                    self.inbox = msgs[:i] + msgs[i + 1:] + self.inbox
                    return payload
            self.inbox = msgs + self.inbox
            if time.monotonic() >= end:
                raise WorkerFailed(self._why(key, f"no {kind!r} in {timeout:.0f} s"))

    def status(self) -> str:
        """How each worker ended, e.g. 'decode worker (pid 12): killed by signal 9 (SIGKILL)'."""
        return "; ".join(f"{key} worker (pid {proc.pid}): {exit_how(proc.exitcode)}"
                         + (" (killed by the demo)" if key in self.killed else "")
                         for key, proc in self.procs.items())

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
        if (self.target is not None and self.kill is None and not self.armed
                and finished >= cfg.requests // 4):
            self.armed = True
            w.send(self.target, "arm_kill")
        if self.target is not None and self.kill is None and all(p in done for p in self.prefills):
            self._kill({"mid_transfer": {}, "armed_s": None}, last)  # never got the chance
        if (not self.expect_sent and cfg.decodes > 1
                and all(p in done for p in self.prefills)):
            self.expect_sent = True
            for d in self.live:
                agent = w.agent[d]
                w.send(d, "expect", sum(r.get(agent, 0) for r in self.routed.values()))

    def _kill(self, payload: dict, last: dict) -> None:
        w, key = self.w, self.target
        finished = sum(last[p].get("finished", 0) for p in self.prefills)
        code = w.kill(key)
        self.live.remove(key)
        by_agent = {w.agent[k]: k for k in w.keys}
        self.kill = dict(worker=key, agent=w.agent[key], exit_code=code,
                         finished_before=finished, armed_seconds=payload.get("armed_s"),
                         mid_transfer={by_agent.get(a, a): sorted(r)
                                       for a, r in payload.get("mid_transfer", {}).items()},
                         last_progress=last.get(key, {}))
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
        last = {k: {} for k in w.keys}
        done = {}
        finished, t_finished = -1, t0
        while len(done) < len(pre) + len(orch.live):
            for key, kind, payload in w.poll(0.1):
                orch.on_message(key, kind, payload, last, done)
            orch.tick(last, done)
            t = time.monotonic()
            n = (sum(last[k].get("finished", 0) for k in pre)
                 + sum(last[k].get("completed", 0) for k in dec))
            if n != finished:
                finished, t_finished = n, t
            elif t - t_finished > STALL_S:
                raise WorkerFailed(f"no request finished for {STALL_S:.0f} s: "
                                   + "; ".join(f"{k} {last[k]}" for k in w.keys))
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
        final = {}
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
    res = build_result(cfg, final, raw, wall, time.monotonic() - t_begin, codes,
                       keys=w.keys, roles=w.role, agents=w.agent, kill=orch.kill,
                       confirmed=orch.confirmed, last=last)
    res["phase_seconds"] = phases
    res["setup_seconds"] = {k: ready[k]["setup"] for k in ready}
    if hosts is not None:
        res["hosts"] = dict(hosts.describe(), link_bytes=link)
    else:
        res["hosts"] = {"kind": "one"}
    return res


def _sides(last: dict, pre: list, dec: list) -> dict:
    return {"prefill": _sum_progress([last[k] for k in pre]),
            "decode": _sum_progress([last[k] for k in dec])}


# --- the result -----------------------------------------------------------------------------

def _ms_stats(xs) -> dict:
    if not xs:
        return {"count": 0, "median_ms": None, "max_ms": None}
    return {"count": len(xs), "median_ms": statistics.median(xs) * 1e3, "max_ms": max(xs) * 1e3}


def _add(a, b):
    """``a`` + ``b`` for the workers' counters: numbers add, dicts add key by key, lists
    join; anything else keeps ``a``."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = _add(out[k], v) if k in out else v
        return out
    if isinstance(a, list) and isinstance(b, list):
        return a + b
    if (isinstance(a, (int, float)) and isinstance(b, (int, float))
            and not isinstance(a, bool) and not isinstance(b, bool)):
        return a + b
    return a


def _exit_code(codes: list):
    """One side's exit code from its workers': None if one is still running, else the
    worst: a failure status, then a signal, then 0."""
    if any(c is None for c in codes):
        return None
    return max(codes) if any(c > 0 for c in codes) else min(codes)


def _worker_report(f: dict, exit_code, role: str, index: int, agent: str) -> dict:
    m = dict(f["metrics"])
    m.pop("time_to_free")
    return dict(role=role, index=index, agent=agent, killed=False, metrics=m,
                freed_by_reason=f["freed_by_reason"], leaked_pages=int(f["leaked_pages"]),
                leaked_owners=f["leaked_owners"], audit=f["audit"],
                allocator_allocated=f["allocator_allocated"],
                arena_used_bytes=f["arena_used_bytes"], open_handles=f["open_handles"],
                closed=f["closed"], exit_code=exit_code, stage_seconds=f["stage_seconds"])


def _side_report(reports: list[dict]) -> dict:
    """One kind's workers as one: a single worker's report as it is; several added up
    (counters summed, owners named ``worker: owner``)."""
    if len(reports) == 1:
        return reports[0]
    out = dict(metrics={}, freed_by_reason={}, leaked_pages=0, leaked_owners={},
               audit={"leaked": {}, "quarantined": {}, "unaccounted": []},
               allocator_allocated=0, arena_used_bytes=0, open_handles=0, closed=True,
               exit_code=_exit_code([r["exit_code"] for r in reports]), stage_seconds={},
               workers=[r["key"] for r in reports])
    for r in reports:
        key = r["key"]
        out["metrics"] = _add(out["metrics"], r["metrics"])
        out["freed_by_reason"] = _add(out["freed_by_reason"], r["freed_by_reason"])
        out["stage_seconds"] = _add(out["stage_seconds"], r["stage_seconds"])
        out["leaked_owners"].update({f"{key}: {o}": n for o, n in r["leaked_owners"].items()})
        for part in ("leaked", "quarantined"):
            out["audit"][part].update({f"{key}: {o}": p for o, p in r["audit"][part].items()})
        out["audit"]["unaccounted"] += [[key, p] for p in r["audit"]["unaccounted"]]
        for k in ("leaked_pages", "allocator_allocated", "arena_used_bytes", "open_handles"):
            out[k] += r[k]
        out["closed"] = out["closed"] and r["closed"]
    return out


def build_result(cfg, final: dict, raw, wall: float, total: float, exit_codes: dict, *,
                 keys=None, roles=None, agents=None, kill=None, confirmed=None,
                 last=None) -> dict:
    """The report from the workers' final messages (``final``: key -> message; a killed
    worker has none).  ``keys``, ``roles``, ``agents``: the workers (default: one prefill
    "prefill", one decode "decode"); ``kill``: what --kill-decode did; ``confirmed``:
    decode key -> the request ids its progress messages reported delivered; ``last``:
    each worker's last progress message."""
    if keys is None:
        keys, roles = ["prefill", "decode"], {"prefill": "prefill", "decode": "decode"}
        agents = {k: k for k in keys}
    confirmed, last = confirmed or {}, last or {}
    index = {}
    for k in keys:
        index[k] = sum(1 for kk in keys[:keys.index(k)] if roles[kk] == roles[k])
    by_agent = {agents[k]: k for k in keys}
    pre = [k for k in keys if roles[k] == "prefill"]
    dec = [k for k in keys if roles[k] == "decode" and k in final]
    workers = {}
    for k in keys:
        if k in final:
            workers[k] = _worker_report(final[k], exit_codes.get(k), roles[k], index[k],
                                        agents[k])
            workers[k]["key"] = k
        else:  # killed by the demo: what its last progress message said
            workers[k] = dict(role=roles[k], index=index[k], agent=agents[k], killed=True,
                              exit_code=exit_codes.get(k), last_progress=last.get(k, {}),
                              key=k)
    pm = _side_report([workers[k] for k in pre])["metrics"]
    dm = _side_report([workers[k] for k in dec])["metrics"]
    gone = [k for k in keys if workers[k]["killed"]]
    lost = {f: sum(int(last.get(k, {}).get(f, 0)) for k in gone)
            for f in ("bytes_landed", "bytes_verified", "bytes_corrupt")}
    outcomes = {o: int(pm["requests"].get(o, 0)) for o in OUTCOMES}
    verified = int(dm["bytes_verified"]) + lost["bytes_verified"]
    res = dict(
        requests=cfg.requests, **outcomes,
        pauses=int(pm["pauses"] + dm["pauses"]),
        bytes_transferred=int(dm["bytes_landed"]) + lost["bytes_landed"],
        bytes_verified=verified,
        bytes_corrupt=int(dm["bytes_corrupt"]) + lost["bytes_corrupt"],
        leaked_pages={"prefill": sum(workers[k]["leaked_pages"] for k in pre),
                      "decode": sum(workers[k]["leaked_pages"] for k in dec)},
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
    fp = [final[k] for k in pre]
    merged = {f: {} for f in ("faults_planned", "outcomes_by_fault", "outcomes_by_status")}
    for f in fp:
        for field_ in merged:
            merged[field_] = _add(merged[field_], {str(a): b for a, b in f[field_].items()})
    res.update(
        faults_planned=merged["faults_planned"],
        outcomes_by_fault=merged["outcomes_by_fault"],
        outcomes_by_status=merged["outcomes_by_status"],
        pauses_by_side={"prefill": pm["pauses"], "decode": dm["pauses"]},
        pause_mean_ms={s: (m["pause_seconds"] / m["pauses"] * 1e3 if m["pauses"] else None)
                       for s, m in (("prefill", pm), ("decode", dm))},
        time_to_free=_ms_stats([x for k in pre for x in final[k]["metrics"]["time_to_free"]]),
        protocol_errors={"prefill": pm["protocol_errors"], "decode": dm["protocol_errors"]},
        bytes_packed=int(pm["bytes_packed"]), bytes_sent=int(pm["bytes_sent"]),
    )
    for side, ks in (("prefill", pre), ("decode", dec)):
        res[side] = {k: v for k, v in _side_report([workers[k] for k in ks]).items()
                     if k not in ("role", "index", "agent", "killed", "key")}
    # Delivered, per decode.  A request can end early on the prefill (an abort, a pause)
    # after its last write landed and was announced: the decode has all of it, the client
    # was told otherwise.  The other way round (told delivered, not received) is a failure,
    # unless that decode was killed: what it received after its last progress message is
    # unknown (``unconfirmed``).
    pre_ok = {r for f in fp for r in f["succeeded_rids"]}
    missing, unconfirmed, late, dec_ok_n = [], [], [], 0
    for k in [k for k in keys if roles[k] == "decode"]:
        told = {r for f in fp for r in f["succeeded_by_peer"].get(agents[k], [])}
        if k in final:
            got = set(final[k]["succeeded_rids"])
            missing += sorted(told - got)
            late += sorted(got - pre_ok)
            dec_ok_n += len(got)
        else:
            unconfirmed += sorted(told - set(confirmed.get(k, [])))
            dec_ok_n += len(told & set(confirmed.get(k, [])))
    res["delivered"] = dict(prefill=len(pre_ok), decode=dec_ok_n, missing=sorted(missing),
                            received_after_early_end=sorted(late),
                            unconfirmed=sorted(unconfirmed))
    res.update(transfer_fields(cfg, fp, [final[k] for k in dec], calibration,
                               final[pre[0]].get("direct_threshold")))
    res["config"] = asdict(cfg)
    res["workers"] = {k: {kk: vv for kk, vv in w_.items() if kk != "key"}
                      for k, w_ in workers.items()}
    res["peers"] = peer_table(keys, roles, final, workers, by_agent)
    if kill is not None:
        res["killed"] = dict(kill, ended_on_prefills={
            p: {by_agent.get(a, a): info for a, info in final[p].get("gone", {}).items()}
            for p in pre})
    errors = check(res)
    res["ok"] = not errors
    res["errors"] = errors
    res["warnings"] = exit_warnings(res)
    return res


def peer_table(keys, roles, final, workers, by_agent) -> dict:
    """Per worker: its requests by outcome (a prefill: those it ran; a decode: those it
    received), and per peer (by worker key) the requests bound to that peer by outcome,
    the bytes moved with it and the messages it could not be sent; a prefill also
    counts its requests per decode by status.  A killed worker: ``killed`` only."""
    out = {}
    for k in keys:
        if k not in final:
            out[k] = {"role": roles[k], "killed": True}
            continue
        m = final[k]["metrics"]
        row = {"role": roles[k], "killed": False, "requests": dict(m["requests"]),
               "by_peer": {by_agent.get(a, a): c for a, c in m.get("peers", {}).items()}}
        if roles[k] == "prefill":
            row["status_by_peer"] = {by_agent.get(a, a): {str(s): n for s, n in c.items()}
                                     for a, c in final[k].get("status_by_peer", {}).items()}
            row["routed"] = {by_agent.get(a, a): n for a, n in final[k].get("routed", {}).items()}
        out[k] = row
    return out


def check(res: dict) -> list[str]:
    """What makes the run fail (exit status 1)."""
    errs = []
    parts = sum(res[o] for o in OUTCOMES)
    if parts != res["requests"]:
        errs.append(f"outcomes add up to {parts}, not {res['requests']} requests")
    for key, s in res["workers"].items():
        if s["killed"]:
            continue  # killed by the demo (--kill-decode): nothing of it is left to check
        if s["leaked_pages"]:
            errs.append(f"{key}: {s['leaked_pages']} page(s) leaked, held by "
                        f"{s['leaked_owners'] or 'nobody (unaccounted)'}")
        if s["allocator_allocated"]:
            errs.append(f"{key}: the allocator still counts {s['allocator_allocated']} pages "
                        "allocated")
        if s["arena_used_bytes"]:
            errs.append(f"{key}: {s['arena_used_bytes']} bytes of its registered buffer "
                        "still reserved")
        if s["open_handles"]:
            errs.append(f"{key}: {s['open_handles']} transfer handle(s) still open")
        if s["metrics"]["protocol_errors"]:
            errs.append(f"{key}: {s['metrics']['protocol_errors']} control message(s) refused")
        if s["exit_code"] is None or s["exit_code"] > 0:  # a signal: exit_warnings
            errs.append(f"{key} worker exited with status {s['exit_code']}")
    for key, row in res.get("peers", {}).items():
        if not row["killed"] and sum(row["requests"].values()) != sum(
                sum(c["requests"].values()) for c in row["by_peer"].values()):
            errs.append(f"{key}: its requests by peer do not add up to its requests")
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
    before its final report fails the run, exit status 3, before there is a result; one
    the demo killed is no warning.)"""
    return [f"the {key} worker was {exit_how(s['exit_code'])} after its final "
            "report (its results are complete)"
            for key, s in res["workers"].items()
            if not s["killed"] and s["exit_code"] is not None and s["exit_code"] < 0]


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
    several = c.get("prefills", 1) > 1 or c.get("decodes", 1) > 1
    if raw:
        between = "prefill 0 and decode 0" if several else "the same processes"
        thr += (f"; raw NIXL write between {between} {raw['gbps']:.2f} GB/s "
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
    hosts = r.get("hosts", {})
    if hosts.get("kind") == "netns":
        link = hosts.get("link_bytes") or {}
        sent = link.get("prefill", {}).get("tx")
        add(f"hosts: prefills in network namespace {hosts['namespaces']['prefill']}, decodes "
            f"in {hosts['namespaces']['decode']}, joined by a veth pair "
            f"({hosts['addresses']['prefill']} <-> {hosts['addresses']['decode']}), UCX over "
            f"{hosts['ucx_tls']}" + (f"; the prefills' end sent {_gb(sent)}, received "
                                     f"{_gb(link['prefill']['rx'])}" if sent is not None else ""))
    if several or "killed" in r:
        add("")
        lines.extend(peer_lines(r))
    add("")
    add(f"where the time went (seconds of the {r['wall_seconds']:.1f} s workload)")
    for side in ("prefill", "decode"):
        st = r[side]["stage_seconds"]
        b = loop_breakdown(st)
        nap = st.get("nap", {})
        ws = r[side].get("workers")
        who = f"{side} ({len(ws)} workers, summed)" if ws else side
        add(f"  {who}: worker loop {b['loop']:.2f}, of which in step() {b['step']:.2f}, "
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


def _counts(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items()) if v) or "none"


def peer_lines(r: dict) -> list[str]:
    """The report's per-worker section: each worker's requests, per peer."""
    out = ["workers (requests by outcome, and per peer: the requests bound to it, bytes)"]
    kill = r.get("killed")
    for key, row in r["peers"].items():
        if row["killed"]:
            mid = "; ".join(f"{p}: {rids}" for p, rids in kill["mid_transfer"].items())
            out.append(f"  {key:<9} KILLED by the demo (SIGKILL) after {kill['finished_before']} "
                       f"requests had finished, in the middle of receiving "
                       + (mid or "nothing (it never was: killed at the end)"))
            continue
        n = sum(row["requests"].values())
        verb = "ran" if row["role"] == "prefill" else "received"
        out.append(f"  {key:<9} {verb} {n}: {_counts(row['requests'])}")
        for peer, c in sorted(row["by_peer"].items()):
            what = "to" if row["role"] == "prefill" else "from"
            st = row.get("status_by_peer", {}).get(peer)
            out.append(f"    {what} {peer:<9} {sum(c['requests'].values()):>5}: "
                       f"{_counts(c['requests'])}" + (f" (status {_counts(st)})" if st else "")
                       + f"; {_gb(c['bytes'])}"
                       + (f"; {c['send_errors']} messages not sent" if c["send_errors"] else ""))
    if kill:
        for p, by in kill["ended_on_prefills"].items():
            for peer, info in by.items():
                ends = {}
                for st in info["status"].values():
                    ends[str(st)] = ends.get(str(st), 0) + 1
                out.append(f"  {p}: {len(info['active'])} request(s) bound to {peer} were "
                           f"active when it died; they ended with status {_counts(ends)}")
        un = r["delivered"]["unconfirmed"]
        if un:
            out.append(f"  {len(un)} request(s) the prefills count delivered to "
                       f"{kill['worker']} are not confirmed by it (its last progress message "
                       f"came before they landed): {un[:10]}")
    return out


def _ms(x, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f} ms"


def transfer_fields(cfg, pre: list, dec: list, calibration, threshold) -> dict:
    """The report's transfer-mode and CPU fields, from the final messages of the prefill
    workers (``pre``) and the decode workers (``dec``): ``transfer_mode`` (push: the
    prefill writes), ``chunk_mode`` (--chunks), ``direct_threshold`` (``threshold``: bytes
    per merged descriptor from which a chunk went direct; None: every chunk packed),
    ``calibration`` (the measurement behind it, --chunks auto), ``chunks`` (posted, by
    kind), and ``cpu``: per side, CPU seconds of the workload (``time.process_time``,
    every thread of its worker processes) and per GB it moved (prefill: bytes sent, decode:
    bytes landed), and ``poll_share``: the share of its workload loops spent in
    ``get_notifs``."""
    cpu = {}
    for side, fs, moved in (("prefill", pre, "bytes_sent"), ("decode", dec, "bytes_landed")):
        secs = [f.get("cpu_seconds") for f in fs]
        s = None if not secs or any(x is None for x in secs) else sum(secs)
        b = sum(int(f["metrics"][moved]) for f in fs)
        st = {}
        for f in fs:
            st = _add(st, f.get("stage_seconds", {}))
        loop = st.get("loop", {}).get("seconds", 0.0)
        cpu[side] = dict(seconds=s, bytes=b,
                         seconds_per_gb=(s / (b / 1e9)) if s is not None and b else None,
                         poll_share=(st.get("get_notifs", {}).get("seconds", 0.0) / loop
                                     if loop > 0 else None))
    chunks = {}
    for f in pre:
        chunks = _add(chunks, f.get("chunk_modes", {}))
    return dict(transfer_mode=cfg.transfer_mode,
                chunk_mode=cfg.chunks if cfg.transfer_mode == "push" else "pulled",
                direct_threshold=threshold, calibration=calibration,
                chunks=chunks, cpu=cpu,
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
    if r.get("killed"):
        warn += f"; {r['killed']['worker']} killed by the demo"
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
