"""The tier's servers, shared: each engine configuration (role, backend, flags and
variables, TP, schedule) runs once and serves every deployment that names it.

Starting a server is most of the tier's time (its process and the fork server of its
children each import torch and sglang, ``standins/sitecustomize.py`` item 6: 30-55 s a
server on two loaded cores, against seconds for most tests).  A
deployment kind of ``conftest.KINDS`` is a prefill configuration and a decode
configuration behind a router (or one plain server), and kinds share engines: ``stock``,
``kvmem-prefill``, ``kvmem-decode`` and ``kvmem-both`` are four engines (a stock and a
flag prefill, a stock and a flag decode) and four routers, where separate deployments
started eight engines.  A prefill serves several decodes and a decode several prefills,
as in any sglang PD deployment; each router pairs one prefill with one decode.

At most :data:`MAX_ENGINES` engine processes' worth (a TP 2 server counts twice) and
:data:`MAX_ROUTERS` routers run at once (a server's three processes hold about 3.5 GB
here), the least recently used stopped first.  ``KVMEM_E2E_MAX_ENGINES`` lowers the
first on a machine that others share (2: one PD pair at a time; the tier then starts
servers more often).  An engine whose process died or whose log
shows a crash is started again, with the routers that named it, when a deployment needs
it next; :meth:`Fleet.discard` stops chosen engines of a kind (a test that left them
changed).
"""

from __future__ import annotations

import time
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.e2e.deploy import (
    CRASH_MARKERS,
    DECODE_ARGS,
    NO_OVERLAP,
    SERVER_ARGS,
    START_TIMEOUT,
    DeployError,
    Deployment,
    Server,
    free_port,
    http,
    mooncake_env,
    tp_args,
)

MAX_ENGINES = int(os.environ.get("KVMEM_E2E_MAX_ENGINES", "4"))
MAX_ROUTERS = 2


@dataclass(frozen=True)
class Spec:
    """One engine server's configuration."""

    role: str  # "prefill", "decode" or "plain"
    backend: str | None = None  # the PD transfer backend (None: plain)
    env: tuple[tuple[str, str], ...] = ()  # its own variables (the flag, timeouts)
    tp: int = 1
    overlap: bool = True
    family: str = "llama"  # the tiny model's attention family (tests.e2e.tiny_model)

    @property
    def name(self) -> str:
        env = dict(self.env)
        parts = [
            *(self.family for _ in [0] if self.family != "llama"),
            self.role,
            self.backend or "",
            "kvmem" if env.get("SGLANG_KVMEM") == "1" else "stock",
            *(f"tp{self.tp}" for _ in [0] if self.tp > 1),
            *("no-overlap" for _ in [0] if not self.overlap),
            *("timeouts" for _ in [0] if "SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT" in env),
        ]
        return "-".join(p for p in parts if p)

    @property
    def weight(self) -> int:
        return self.tp


def specs(conf: dict, backend: str) -> tuple[Spec, ...]:
    """The engine specs of a kind's Deployment keyword arguments: (prefill, decode), or
    (plain,)."""
    tp, overlap = conf.get("tp", 1), conf.get("overlap", True)
    family = conf.get("family", "llama")

    def env(d):
        return tuple(sorted((d or {}).items()))

    if not conf.get("pd", True):
        return (Spec("plain", None, env(conf.get("env")), tp, overlap, family),)
    return (
        Spec(
            "prefill",
            backend,
            env(conf.get("prefill_env")),
            conf.get("prefill_tp") or tp,
            overlap,
            family,
        ),
        Spec(
            "decode",
            backend,
            env(conf.get("decode_env")),
            conf.get("decode_tp") or tp,
            overlap,
            family,
        ),
    )


@dataclass
class Engine:
    spec: Spec
    server: Server
    bootstrap_port: int = 0
    starts: int = 0
    used: float = field(default_factory=time.monotonic)


class Fleet:
    """Engines and routers by configuration (module docstring).  ``models`` gives the
    tiny model of a family (``"llama"``, ``"mla"``: tests.e2e.tiny_model), made on first
    use."""

    def __init__(self, models: Callable[[str], Path], logroot: Path):
        self.models, self.logroot = models, Path(logroot)
        self.engines: dict[Spec, Engine] = {}
        self.routers: dict[tuple[Spec, Spec], Server] = {}
        self.started: dict[str, int] = {}  # starts per engine name (a report)

    # -- engines ------------------------------------------------------------------------
    def _new_server(self, spec: Spec) -> Engine:
        base = [
            "--model-path",
            str(self.models(spec.family)),
            *SERVER_ARGS,
            *([] if spec.overlap else NO_OVERLAP),
        ]
        args, env = tp_args(spec.tp)
        env = {**env, **dict(spec.env)}
        if spec.role != "plain":
            base += [
                "--disaggregation-transfer-backend",
                spec.backend,
                "--disaggregation-mode",
                spec.role,
            ]
            if spec.backend == "mooncake":
                env = {**mooncake_env(), **env}
        if spec.role == "prefill":
            base += ["--disaggregation-bootstrap-port", "0"]
        if spec.role == "decode":
            base += DECODE_ARGS
        n = self.started[spec.name] = self.started.get(spec.name, 0) + 1
        logdir = self.logroot / f"{spec.name}-{n}"
        return Engine(
            spec,
            Server(
                spec.role if spec.role != "plain" else "server",
                [*base, *args, "--port", "0"],
                0,
                logdir,
                env,
            ),
        )

    def _healthy(self, engine: Engine) -> bool:
        s = engine.server
        return s.alive() and not any(m in s.log_text() for m in CRASH_MARKERS)

    def _evict(self, keep: set[Spec], weight: int) -> None:
        """Stop the least recently used engines not in ``keep`` until ``weight`` more fits."""
        while sum(e.spec.weight for e in self.engines.values()) + weight > MAX_ENGINES:
            idle = [e for e in self.engines.values() if e.spec not in keep]
            if not idle:
                return
            self._stop_engine(min(idle, key=lambda e: e.used).spec)

    def _stop_engine(self, spec: Spec) -> None:
        engine = self.engines.pop(spec, None)
        for key in [k for k in self.routers if spec in k]:
            self.routers.pop(key).stop()
        if engine is not None:
            engine.server.stop()

    def _ensure(self, wanted: tuple[Spec, ...]) -> list[Engine]:
        """The engines of ``wanted``, started (together) where missing or crashed."""
        for spec in wanted:
            e = self.engines.get(spec)
            if e is not None and not self._healthy(e):
                self._stop_engine(spec)
        missing = [s for s in wanted if s not in self.engines]
        self._evict(set(wanted), sum(s.weight for s in missing))
        fresh = [self._new_server(s) for s in missing]
        for _ in range(3):  # a port another process took meanwhile: new ports
            for e in fresh:
                e.server.port = free_port()
                e.server.args[e.server.args.index("--port") + 1] = str(e.server.port)
                if e.spec.role == "prefill":
                    e.bootstrap_port = free_port()
                    a = e.server.args
                    a[a.index("--disaggregation-bootstrap-port") + 1] = str(e.bootstrap_port)
                e.server.start()
            deadline = time.monotonic() + START_TIMEOUT
            try:
                for e in fresh:
                    e.server.wait_healthy(deadline)
                break
            except DeployError:
                taken = [
                    e for e in fresh if "address already in use" in e.server.log_text().lower()
                ]
                for e in fresh:
                    e.server.stop()
                if not taken:
                    raise
        for e in fresh:
            self.engines[e.spec] = e
        now = time.monotonic()
        out = [self.engines[s] for s in wanted]
        for e in out:
            e.used = now
        return out

    # -- routers ------------------------------------------------------------------------
    def _router(self, p: Engine, d: Engine) -> Server:
        key = (p.spec, d.spec)
        r = self.routers.get(key)
        if r is not None and r.alive():
            self.routers[key] = self.routers.pop(key)  # most recently used last
            return r
        if r is not None:
            self.routers.pop(key).stop()
        while len(self.routers) >= MAX_ROUTERS:
            self.routers.pop(next(iter(self.routers))).stop()
        r = Server(
            "router",
            [],
            free_port(),
            self.logroot / f"router-{p.spec.name}--{d.spec.name}",
            module="sglang_router.launch_router",
        )
        r.args = [
            "--pd-disaggregation",
            "--prefill",
            p.server.url,
            str(p.bootstrap_port),
            "--decode",
            d.server.url,
            "--host",
            "127.0.0.1",
            "--port",
            str(r.port),
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
        r.start()
        deadline = time.monotonic() + START_TIMEOUT
        try:
            r.wait_healthy(deadline)
            while True:  # until it lists both workers healthy (its /health answers first)
                w = http("GET", r.url + "/workers", timeout=5)
                workers = w.body.get("workers", []) if isinstance(w.body, dict) else []
                if {"prefill", "decode"} <= {
                    x.get("worker_type") for x in workers if x.get("is_healthy")
                }:
                    break
                if not r.alive() or time.monotonic() > deadline:
                    raise DeployError(
                        f"router {r.url} does not list both workers healthy ({w.status}: {w.body})"
                    )
                time.sleep(0.5)
        except BaseException:
            r.stop()
            raise
        self.routers[key] = r
        return r

    # -- what the tests ask for ---------------------------------------------------------
    def get(self, conf: dict, backend: str = "nixl") -> Deployment:
        """A deployment of ``conf`` (a kind's Deployment keyword arguments) on
        ``backend``, over shared engines."""
        wanted = specs(conf, backend)
        engines = self._ensure(wanted)
        model = self.models(wanted[0].family)
        if len(engines) == 1:
            return Deployment.over(model, single=engines[0].server)
        p, d = engines
        r = self._router(p, d)
        return Deployment.over(
            model,
            prefill=p.server,
            decode=d.server,
            router=r,
            bootstrap_port=p.bootstrap_port,
            backend=backend,
        )

    def discard(self, conf: dict, backend: str = "nixl", roles=("prefill", "decode", "plain")):
        """Stop the engines of ``conf`` with those roles (and their routers); the next
        :meth:`get` starts them anew."""
        for spec in specs(conf, backend):
            if spec.role in roles:
                self._stop_engine(spec)

    def stop_all(self) -> None:
        for r in self.routers.values():
            r.stop()
        self.routers.clear()
        for spec in list(self.engines):
            self._stop_engine(spec)

    def live(self) -> list[Server]:
        return [e.server for e in self.engines.values()] + list(self.routers.values())
