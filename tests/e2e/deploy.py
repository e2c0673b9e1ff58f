"""Real sglang 0.5.23 servers and sglang's router, started and stopped by the tests.

A :class:`Server` is one ``python -m sglang.launch_server`` (or the router) in a process
group of its own, started from ``.venv-e2e`` with the CPU stand-ins of ``standins/`` on
its PYTHONPATH, its output in a log file; it is stopped by its PID (SIGTERM to the
group, SIGKILL after a bounded wait).  A :class:`Deployment` is a PD pair behind the
router, or one plain server.  Every wait here is bounded; a server that dies or never
becomes healthy raises :class:`DeployError` with the tail of its log.

The servers run with what a CPU host needs (``SERVER_ARGS``; why each flag, in
tests/e2e/README.md) and bind 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from testkit.sglang_pair import with_ibverbs

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STANDINS = HERE / "standins"
PYTHON = Path(os.environ.get("KVMEM_E2E_PYTHON") or sys.executable)

# sglang on a CPU host (tests/e2e/README.md says why each is needed)
SERVER_ARGS = [
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--disable-cuda-graph",
    "--max-total-tokens",
    "65536",
    "--dtype",
    "bfloat16",
    "--skip-server-warmup",
    "--host",
    "127.0.0.1",
    "--enable-metrics",
    "--log-level",
    "info",
    "--sleep-on-idle",
]
# sglang's PD transfer backends the tier runs.  Mooncake goes over TCP on this host (no
# RDMA device): MOONCAKE_PROTOCOL=tcp (sglang's environ.py:887, read at
# distributed/device_communicators/mooncake_transfer_engine.py:209).
BACKENDS = ("nixl", "mooncake")
BACKEND_ENV = {"nixl": {}, "mooncake": {"MOONCAKE_PROTOCOL": "tcp"}}
NO_OVERLAP = ["--disable-overlap-schedule"]
DECODE_ARGS = ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
# OpenMP threads of each server process (its torch ops): KVMEM_E2E_CPU_THREADS, default 1.
CPU_THREADS = os.environ.get("KVMEM_E2E_CPU_THREADS", "1")
START_TIMEOUT = float(os.environ.get("KVMEM_E2E_START_TIMEOUT", "240"))
# Mooncake's engine.so needs libibverbs.so.1 (Debian's libibverbs1) even over TCP:
# testkit.sglang_pair.with_ibverbs puts where `make venv-e2e` found it on the Mooncake
# servers' LD_LIBRARY_PATH only.


def mooncake_env() -> dict:
    """What a Mooncake server needs in its environment here (BACKEND_ENV, and
    LD_LIBRARY_PATH for libibverbs.so.1 when the system lacks it)."""
    env = dict(BACKEND_ENV["mooncake"])
    if os.environ.get("LD_LIBRARY_PATH"):
        env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
    try:
        return with_ibverbs(env)
    except FileNotFoundError as e:
        raise DeployError(str(e)) from None


STOP_TIMEOUT = 5.0
IDLE_S = 20.0  # how long a server may take to let go of finished requests


def tp_args(tp: int) -> tuple[list[str], dict]:
    """A server's arguments and variables for tensor parallelism ``tp`` on this CPU host
    (nothing at TP 1).  sglang 0.5.23 at TP > 1 here: gloo (platforms/cpu.py:108);
    ``SGLANG_CPU_OMP_THREADS_BIND`` with one entry per rank (else utils/numa_utils.py:463
    asserts ranks <= NUMA nodes); ``SGLANG_NCCL_SO_PATH`` naming no library, so that sglang
    disables PyNccl as on a CPU-only torch (pynccl.py:73-79; this CUDA build of torch
    ships libnccl, and PyNccl raises "Expected a cuda device" at
    device_communicators/pynccl.py:116 otherwise)."""
    if tp == 1:
        return [], {}
    cores = os.cpu_count() or 1
    return (
        ["--tp-size", str(tp)],
        {
            "SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(r % cores) for r in range(tp)),
            "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2",
        },
    )


class DeployError(RuntimeError):
    """A server did not start, died, or did not answer in time (with its log's tail)."""


# How a server's log says that the port it was given is taken (sglang: "[Errno 98] Address
# already in use"; the router: "Address already in use (os error 98)"), and how many
# starts a deployment gets when it says so.
ADDRESS_IN_USE = "address already in use"
PORT_ATTEMPTS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text[-lines:])


@dataclass
class Response:
    status: int  # HTTP status, 0 when no answer came in time (or the connection broke)
    body: object  # parsed JSON, or the text
    seconds: float
    error: str = ""
    rid: str = ""  # the request id the client gave, when it gave one

    @property
    def answered(self) -> bool:
        return self.status != 0


def http(method: str, url: str, payload=None, timeout: float = 30.0) -> Response:
    """One HTTP call; never raises for an HTTP status or a timeout."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out
        return Response(0, None, time.monotonic() - t0, f"{type(e).__name__}: {e}")
    text = raw.decode(errors="replace")
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = text
    return Response(status, body, time.monotonic() - t0)


@dataclass
class Server:
    name: str
    args: list[str]
    port: int
    logdir: Path
    env: dict = field(default_factory=dict)
    module: str = "sglang.launch_server"
    proc: subprocess.Popen | None = None
    log_offset: int = 0  # where this start's output begins in the log

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.logdir / f"{self.name}.log"

    @property
    def faults(self) -> Path:
        """The folder a test arms this server's faults in (``standins/faults.py``)."""
        return self.logdir / "faults" / self.name

    def arm(self, fault: str) -> None:
        """Arm one fault of ``standins/faults.py`` in this server: it fires at the next
        call it names, once."""
        from tests.e2e.standins.faults import FAULTS

        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; known: {FAULTS}")
        (self.faults / fault).write_text("")

    def fault_notes(self) -> list[str]:
        """What this server's fired faults noted (``fault:<name> <code> ...``)."""
        path = self.faults / "fired.log"
        return path.read_text().splitlines() if path.exists() else []

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        env = dict(os.environ)
        for k in [k for k in env if k.startswith("SGLANG_KVMEM")]:
            del env[k]  # each server gets exactly the flags its test gives it
        # one OpenMP thread per server process: two servers, a router and the clients share
        # two cores here, and torch's OpenMP threads spin while they wait for each other
        # (tests/e2e/README.md)
        # SGLANG_HOST_IP: what sglang's PD bootstrap, NIXL and Mooncake advertise to peers
        # (else the machine's first interface, eth0): nothing leaves 127.0.0.1
        env.update(
            SGLANG_USE_CPU_ENGINE="1",
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS=CPU_THREADS,
            SGLANG_HOST_IP="127.0.0.1",
            PYTHONPATH=os.pathsep.join([str(STANDINS)]),
            KVMEM_E2E_STANDINS_LOG=str(self.logdir / "standins.log"),
            KVMEM_E2E_FAULTS=str(self.faults),
        )
        env.update(self.env)
        self.faults.mkdir(parents=True, exist_ok=True)
        for armed in self.faults.iterdir():  # a fault armed for an earlier start
            if armed.name != "fired.log":
                armed.unlink()
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.log_offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            out.write(
                f"\n==== {time.strftime('%H:%M:%S')} start {self.name}: "
                f"{' '.join(self.args)} env {self.env}\n".encode()
            )
            out.flush()
            # cwd: not the repository (a clone named kvmem on sys.path shadows the package)
            self.proc = subprocess.Popen(
                [str(PYTHON), "-m", self.module, *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.logdir,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, deadline: float, path: str = "/health") -> None:
        """Until this start of the server answers ``path`` 200 on its port.  A 200 alone
        does not say whose: another process may hold the port (seen here: an sglang
        server that was still loading answered by another worktree's server on the port
        it was given, its own bind failing "address already in use" a minute later), so
        an sglang server counts once its log says its own uvicorn listens there, and a
        log that says the port is taken raises (the callers then start it on new
        ports)."""
        while True:
            if not self.alive():
                raise DeployError(
                    f"{self.name} exited with status {self.proc.returncode} "
                    f"before it was healthy; log {self.log}:\n{tail(self.log)}"
                )
            if ADDRESS_IN_USE in self.log_text().lower():
                raise DeployError(
                    f"{self.name}: its port {self.port} is taken by another process; "
                    f"log {self.log}:\n{tail(self.log)}"
                )
            r = http("GET", self.url + path, timeout=5)
            if r.status == 200 and self._listening():
                return
            if time.monotonic() > deadline:
                raise DeployError(
                    f"{self.name} not healthy after {START_TIMEOUT:.0f} s "
                    f"(last: {r.status} {r.error}); log {self.log}:\n"
                    f"{tail(self.log)}"
                )
            time.sleep(0.5)

    def _listening(self) -> bool:
        """Whether this start's log says it listens on its port (sglang's uvicorn line;
        the router reports a taken port in its log, which ``wait_healthy`` reads)."""
        if self.module != "sglang.launch_server":
            return True
        return f"Uvicorn running on http://127.0.0.1:{self.port} " in self.log_text()

    def signal(self, sig: int) -> None:
        if self.alive():
            os.killpg(self.proc.pid, sig)

    def stop(self) -> int | None:
        """SIGTERM the server's process group, SIGKILL it after STOP_TIMEOUT; its exit
        status (None if it was never started)."""
        if self.proc is None:
            return None
        if self.alive():
            for sig in (signal.SIGCONT, signal.SIGTERM):  # a stopped server cannot exit
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
        try:  # children sglang spawned (scheduler, detokenizer) share the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pass
        return self.proc.returncode

    def metric(self, name: str) -> dict[str, float]:
        """The samples of metric ``name`` in the server's ``/metrics`` (sglang's
        Prometheus text; the scheduler's counters included), by their label text
        (``'what="sends"'``; '' for none)."""
        r = http("GET", self.url + "/metrics", timeout=30)
        if r.status != 200:
            raise DeployError(f"{self.name}: /metrics answered {r.status} {r.error}")
        out = {}
        for line in str(r.body).splitlines():
            head, _, value = line.rpartition(" ")
            if head == name or head.startswith(name + "{"):
                labels = head[len(name) :].strip("{}")
                out[labels] = out.get(labels, 0.0) + float(value)
        return out

    def loads(self) -> dict:
        """The server's own load report (``GET /v1/loads``, its first DP rank): live
        counts of used KV tokens and of the requests in each queue."""
        r = http("GET", self.url + "/v1/loads", timeout=30)
        if r.status != 200 or not isinstance(r.body, dict):
            raise DeployError(f"{self.name}: /v1/loads answered {r.status} {r.error}")
        return r.body["loads"][0]

    def held(self) -> dict[str, int]:
        """What the server holds now, by its own ``/v1/loads``: KV tokens in use and
        requests in each queue (the non-zero counts only)."""
        loads = self.loads()
        q = loads.get("disaggregation") or {}
        counts = dict(
            kv_tokens=loads["num_used_tokens"],
            running=loads["num_running_reqs"],
            waiting=loads["num_waiting_reqs"],
            bootstrap=q.get("prefill_bootstrap_queue_reqs", 0),
            inflight=q.get("prefill_inflight_queue_reqs", 0),
            prealloc=q.get("decode_prealloc_queue_reqs", 0),
            transfer=q.get("decode_transfer_queue_reqs", 0),
        )
        return {k: v for k, v in counts.items() if v}

    def scheduler_pids(self) -> list[int]:
        """PIDs of the server's scheduler processes (sglang names them
        ``sglang::scheduler``), found in its process group."""
        out = []
        if not self.alive():
            return out
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.getpgid(int(entry.name)) != self.proc.pid:
                    continue
                cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            except (OSError, ProcessLookupError):
                continue
            if cmd.startswith("sglang::scheduler"):
                out.append(int(entry.name))
        return out

    def log_text(self) -> str:
        """What this server wrote since its last start."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""


class Deployment:
    """A PD pair (prefill + decode + sglang's router) or one plain server, on 127.0.0.1.

    ``prefill_env`` / ``decode_env`` / ``env`` are the extra variables of each server
    (``{"SGLANG_KVMEM": "1"}`` turns the adapter on there).  ``overlap``: sglang's
    overlap schedule, its default and what a GPU deployment runs (off:
    ``--disable-overlap-schedule``, the loops that launch a batch and process its result
    in the same iteration)."""

    def __init__(
        self,
        model: Path,
        logdir: Path,
        *,
        pd: bool = True,
        prefill_env: dict | None = None,
        decode_env: dict | None = None,
        env: dict | None = None,
        extra_args: list[str] | None = None,
        overlap: bool = True,
        backend: str = "nixl",
        tp: int = 1,
        prefill_tp: int | None = None,
        decode_tp: int | None = None,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}: one of {BACKENDS}")
        self.model, self.logdir, self.pd, self.backend = Path(model), Path(logdir), pd, backend
        base = [
            "--model-path",
            str(self.model),
            *SERVER_ARGS,
            *(extra_args or []),
            *([] if overlap else NO_OVERLAP),
        ]
        if pd:
            pd_args = ["--disaggregation-transfer-backend", backend]
            pd_env = mooncake_env() if backend == "mooncake" else {}
            p_args, p_env = tp_args(prefill_tp or tp)
            d_args, d_env = tp_args(decode_tp or tp)
            self.bootstrap_port = free_port()
            self.prefill = Server(
                "prefill",
                [
                    *base,
                    *pd_args,
                    *p_args,
                    "--port",
                    "0",
                    "--disaggregation-mode",
                    "prefill",
                    "--disaggregation-bootstrap-port",
                    str(self.bootstrap_port),
                ],
                0,
                self.logdir,
                {**pd_env, **p_env, **(prefill_env or {})},
            )
            self.decode = Server(
                "decode",
                [
                    *base,
                    *pd_args,
                    *DECODE_ARGS,
                    *d_args,
                    "--port",
                    "0",
                    "--disaggregation-mode",
                    "decode",
                ],
                0,
                self.logdir,
                {**pd_env, **d_env, **(decode_env or {})},
            )
            self.router = Server("router", [], 0, self.logdir, module="sglang_router.launch_router")
            self.servers = [self.prefill, self.decode, self.router]
        else:
            s_args, s_env = tp_args(tp)
            self.single = Server(
                "server", [*base, *s_args, "--port", "0"], 0, self.logdir, {**s_env, **(env or {})}
            )
            self.servers = [self.single]

    @classmethod
    def over(
        cls,
        model: Path,
        *,
        single: Server | None = None,
        prefill: Server | None = None,
        decode: Server | None = None,
        router: Server | None = None,
        bootstrap_port: int = 0,
        backend: str | None = None,
    ) -> "Deployment":
        """A deployment over servers that run already (``tests.e2e.fleet`` shares them
        between deployments): one plain server, or a prefill, a decode and a router."""
        d = cls.__new__(cls)
        d.model, d.backend, d.pd = Path(model), backend, single is None
        if d.pd:
            d.prefill, d.decode, d.router = prefill, decode, router
            d.bootstrap_port = bootstrap_port
            d.servers = [prefill, decode, router]
        else:
            d.single = single
            d.servers = [single]
        d.logdir = d.servers[0].logdir
        return d

    # -- life ---------------------------------------------------------------------------
    def _ports(self, servers=None) -> None:
        """New free ports for ``servers`` (default: all), written into their arguments."""
        servers = self.servers if servers is None else servers
        if self.pd and self.prefill in servers:
            self.bootstrap_port = free_port()
            args = self.prefill.args
            args[args.index("--disaggregation-bootstrap-port") + 1] = str(self.bootstrap_port)
        for s in servers:
            s.port = free_port()
            if "--port" in s.args:
                s.args[s.args.index("--port") + 1] = str(s.port)
        if self.pd and self.router in servers:
            self.router.args = [
                "--pd-disaggregation",
                "--prefill",
                self.prefill.url,
                str(self.bootstrap_port),
                "--decode",
                self.decode.url,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.router.port),
                "--log-level",
                "info",
                "--request-timeout-secs",
                "120",
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_port()),
                "--disable-circuit-breaker",
            ]

    def start(self) -> "Deployment":
        """Start every server and wait until each is healthy (the router: until it lists
        both workers).  A port is chosen free just before the server that binds it
        starts, but another process may bind it first (a starting sglang server binds
        ephemeral ports of its own for tens of seconds): a start that failed on a taken
        address is tried again with new ports, up to PORT_ATTEMPTS times in all."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                return self._start_once()
            except DeployError:
                taken = [
                    s.name
                    for s in self.servers
                    if s.proc is not None and ADDRESS_IN_USE in s.log_text().lower()
                ]
                if not taken or attempt == PORT_ATTEMPTS:
                    raise
                print(
                    f"deploy: {', '.join(taken)} found its port taken (attempt {attempt} "
                    f"of {PORT_ATTEMPTS}); starting again on new ports",
                    flush=True,
                )
        raise AssertionError("unreachable")

    def _start_once(self) -> "Deployment":
        engines = [s for s in self.servers if s.module == "sglang.launch_server"]
        self._ports(engines)
        t0 = time.monotonic()
        deadline = t0 + START_TIMEOUT
        for s in engines:
            s.start()
        try:
            for s in engines:
                s.wait_healthy(deadline)
            if self.pd:
                self._ports([self.router])  # chosen now: the engines hold theirs already
                self.router.start()
                self.router.wait_healthy(deadline)
                self._wait_workers(deadline)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def _wait_workers(self, deadline: float) -> None:
        """Until the router lists both workers healthy (its /health answers earlier)."""
        while True:
            r = http("GET", self.router.url + "/workers", timeout=5)
            workers = r.body.get("workers", []) if isinstance(r.body, dict) else []
            kinds = {w.get("worker_type") for w in workers if w.get("is_healthy")}
            if {"prefill", "decode"} <= kinds:
                return
            if not self.router.alive() or time.monotonic() > deadline:
                raise DeployError(
                    f"the router does not list both workers healthy "
                    f"({r.status}: {r.body}); log {self.router.log}:\n"
                    f"{tail(self.router.log)}"
                )
            time.sleep(0.5)

    def stop(self) -> dict:
        return {s.name: s.stop() for s in reversed(self.servers)}

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- use ----------------------------------------------------------------------------
    @property
    def entry(self) -> Server:
        """Where clients send requests: the router, or the plain server."""
        return self.router if self.pd else self.single

    def generate(
        self,
        text: str,
        max_new_tokens: int = 8,
        *,
        timeout: float = 30.0,
        rid: str | None = None,
        server: Server | None = None,
        stream: bool = False,
    ) -> Response:
        payload = {
            "text": text,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        }
        if rid is not None:
            payload["rid"] = rid
        if stream:
            payload["stream"] = True
        return http("POST", (server or self.entry).url + "/generate", payload, timeout)

    def control(self, server: Server, path: str, payload=None, timeout: float = 60.0) -> Response:
        return http("POST", server.url + path, payload if payload is not None else {}, timeout)

    def settle(self, within: float = IDLE_S) -> dict[str, dict[str, int]]:
        """What each engine still holds (:meth:`Server.held`) once it had up to
        ``within`` seconds to finish what it was doing (a prefill pops a request whose
        KV went out at its next scheduler pass, which can come after the client's
        answer); {} when all are idle."""
        engines = [self.prefill, self.decode] if self.pd else [self.single]
        deadline = time.monotonic() + within
        while True:
            held = {s.name: h for s in engines if (h := s.held())}
            if not held or time.monotonic() > deadline:
                return held
            time.sleep(0.25)

    def crashed(self) -> list[str]:
        """Servers whose process died or whose log shows a crash of a scheduler."""
        out = []
        for s in self.servers:
            text = s.log_text()
            if not s.alive():
                out.append(f"{s.name}: exited with status {s.proc.returncode}")
            elif any(m in text for m in CRASH_MARKERS):
                out.append(f"{s.name}: " + next(m for m in CRASH_MARKERS if m in text))
        return out

    def trace(self, needle: str, lines: int = 12) -> str:
        """The log lines of every server that mention ``needle`` (a request id)."""
        out = []
        for s in self.servers:
            hits = [ln for ln in s.log_text().splitlines() if needle in ln]
            out += [f"{s.name}: {ln[:300]}" for ln in hits[-lines:]]
        return "\n".join(out)

    def logs(self, lines: int = 60) -> str:
        return "\n".join(
            f"---- {s.name} ({s.log}) ----\n{tail(s.log, lines)}" for s in self.servers
        )


# What a scheduler's death leaves in a server's log.
CRASH_MARKERS = (
    "Segmentation fault",
    "Fatal Python error",
    "Scheduler hit an exception",
    "AssertionError",
    "Received sigquit from a child process",
)


def rss_anon(pid: int) -> int:
    """Anonymous resident bytes of a process (``RssAnon`` in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise DeployError(f"no RssAnon for pid {pid}")


def rss_by_mapping(pid: int) -> dict[tuple[int, int], int]:
    """Resident bytes of each mapping of a process (``Rss`` in /proc/PID/smaps), keyed
    by its address range."""
    out, key = {}, None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = head.split("-")
            key = (int(lo, 16), int(hi, 16))
        elif head == "Rss:" and key is not None:
            out[key] = int(line.split()[1]) * 1024
    return out


def given_back(before: dict, after: dict, min_size: int = 1 << 20) -> int:
    """Resident bytes that mappings of at least ``min_size`` bytes, present in both
    :func:`rss_by_mapping` snapshots, gave back between them.  Unlike the difference of
    two ``RssAnon`` figures, memory that other mappings gained meanwhile (requests served
    while a release runs) does not hide what a release gave back."""
    return sum(
        max(0, rss - after[k])
        for k, rss in before.items()
        if k in after and k[1] - k[0] >= min_size
    )


def wait_given_back(before: dict[int, dict], want: float, timeout: float = 15.0) -> dict[int, int]:
    """What each process of ``before`` (pid -> its :func:`rss_by_mapping` snapshot) gave
    back since (:func:`given_back`), read until every one gave back at least ``want``
    bytes or ``timeout`` seconds passed; the last reading.  For the ranks of a TP server:
    sglang answers ``/release_memory_occupation`` once rank 0 released, and the other
    ranks release in the same broadcast a moment later (a run here: rank 1's release
    logged after the 200, its snapshot taken at once showed 0 bytes given back)."""
    end = time.monotonic() + timeout
    while True:
        back = {p: given_back(snap, rss_by_mapping(p)) for p, snap in before.items()}
        if all(b >= want for b in back.values()) or time.monotonic() >= end:
            return back
        time.sleep(0.05)


def prompt(i: int, words: int = 12) -> str:
    """A deterministic prompt of the tiny model's words (tests.e2e.tiny_model.WORDS)."""
    from tests.e2e.tiny_model import WORDS

    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(words))
