"""Whether the machine is quiet enough for the serving benchmark (bench/serving.py), and
how loaded it was during each run.

Two measures, because the load average cannot tell our own processes from others':

- the 1-minute load average, read before the benchmark starts any server: the machine
  must be quiet before we add to it (``max_load``, 1.5 on this 2-core machine);
- while the benchmark runs, the CPU that processes *other* than this one and its
  servers use (``others_cores``: busy CPU time from /proc/stat less the CPU time of this
  process and of every process in the servers' process groups, per second of wall time).
  Our own servers and client load the machine by design (a run at concurrency 16 keeps
  both cores busy and the load average above 3 for a minute after it), so the load
  average says nothing about others once they run.

Before each run :meth:`Gate.before_run` probes ``others_cores`` for ``PROBE_S`` and waits
(up to ``wait_s``) until it is at most ``max_others``; a machine that stays loaded is
refused (:class:`NotQuiet`) unless the gate allows load (``KVMEM_SERVING_ALLOW_LOAD=1``),
in which case the run goes ahead and is flagged.  A run whose own ``others_cores`` went
past ``max_others`` is flagged ``loaded`` too.  Steal time (the hypervisor taking the
VM's CPU) is recorded beside it: it slows every process alike and is not ours.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

TICK = os.sysconf("SC_CLK_TCK")
PROBE_S = 2.0


class NotQuiet(RuntimeError):
    """The machine stayed loaded past the gate's wait (the figures would be worthless)."""


def _stat_cpu() -> tuple[float, float]:
    """(busy seconds of user, nice and system time of every CPU, steal seconds) since
    boot (/proc/stat; idle, iowait, irq and softirq left out of busy)."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, steal = vals[0], vals[1], vals[2], vals[7] if len(vals) > 7 else 0
    return (user + nice + system) / TICK, steal / TICK


def _group_cpu(pgids: set[int]) -> dict[int, float]:
    """CPU seconds (user + system) of every live process whose process group is in
    ``pgids``, by PID."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                text = f.read().decode(errors="replace")
        except OSError:  # it exited meanwhile
            continue
        fields = text[text.rfind(")") + 2 :].split()  # after "pid (comm) "
        # fields[0] is the state (stat field 3): pgrp is field 5, utime 14, stime 15
        if int(fields[2]) in pgids:
            out[int(entry.name)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


@dataclass
class Window:
    """CPU accounting over a span of wall time (start with :meth:`open`).  Ours: this
    process (all its threads: the benchmark's client runs here) and every process in
    ``pgids`` (the servers' groups hold their schedulers and other children).  A process
    of ours that exits within the window takes its CPU time with it: what it used is
    counted as others' (an error towards flagging a run, never towards a clean one)."""

    pgids: set[int]
    t0: float = 0.0
    busy0: float = 0.0
    steal0: float = 0.0
    own0: float = 0.0
    groups0: dict = field(default_factory=dict)

    def open(self) -> "Window":
        self.t0 = time.monotonic()
        self.busy0, self.steal0 = _stat_cpu()
        self.own0, self.groups0 = _own_cpu(), _group_cpu(self.pgids)
        return self

    def close(self) -> dict:
        """``others_cores``, ``ours_cores`` and ``steal_cores`` over the window (CPU
        seconds per wall second)."""
        wall = max(time.monotonic() - self.t0, 1e-6)
        busy, steal = _stat_cpu()
        groups = _group_cpu(self.pgids)
        ours = _own_cpu() - self.own0
        ours += sum(cpu - self.groups0.get(pid, 0.0) for pid, cpu in groups.items())
        return dict(
            others_cores=round(max(0.0, busy - self.busy0 - ours) / wall, 3),
            ours_cores=round(ours / wall, 3),
            steal_cores=round((steal - self.steal0) / wall, 3),
            wall_s=round(wall, 3),
        )


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, str(default)))


@dataclass
class Gate:
    """The quiet gate.  ``max_load``: the 1-minute load average allowed before the first
    server starts; ``max_others``: others' cores allowed before and during a run;
    ``wait_s``: how long to wait for quiet before refusing; ``allow_load``: never refuse,
    flag instead.  Defaults from KVMEM_SERVING_MAX_LOAD (1.5), KVMEM_SERVING_MAX_OTHERS
    (0.5 cores: a quarter of this machine), KVMEM_SERVING_QUIET_WAIT_S (300) and
    KVMEM_SERVING_ALLOW_LOAD=1.  The thresholds are judgement, not measurement: a run on
    two cores with half a core taken by others is no longer a clean comparison."""

    max_load: float = field(default_factory=lambda: _env_float("KVMEM_SERVING_MAX_LOAD", 1.5))
    max_others: float = field(default_factory=lambda: _env_float("KVMEM_SERVING_MAX_OTHERS", 0.5))
    wait_s: float = field(default_factory=lambda: _env_float("KVMEM_SERVING_QUIET_WAIT_S", 300.0))
    allow_load: bool = field(
        default_factory=lambda: os.environ.get("KVMEM_SERVING_ALLOW_LOAD") == "1"
    )
    log: object = print

    def as_dict(self) -> dict:
        return dict(
            max_load=self.max_load,
            max_others=self.max_others,
            wait_s=self.wait_s,
            allow_load=self.allow_load,
        )

    def _wait(self, what: str, read, limit: float) -> tuple[float, bool]:
        """Read ``read()`` until it is at most ``limit`` or ``wait_s`` passed; (the last
        reading, whether the machine counts as loaded).  Raises NotQuiet for a machine
        still loaded at the end unless load is allowed."""
        deadline = time.monotonic() + self.wait_s
        value = read()
        said = False
        while value > limit and time.monotonic() < deadline:
            if not said:
                self.log(f"serving: waiting for a quiet machine ({what} {value:.2f} > {limit})")
                said = True
            time.sleep(5.0)
            value = read()
        if value <= limit:
            return value, False
        if not self.allow_load:
            raise NotQuiet(
                f"{what} {value:.2f} > {limit} after waiting {self.wait_s:.0f} s: the machine "
                "is not quiet (KVMEM_SERVING_ALLOW_LOAD=1 runs anyway and flags every run)"
            )
        return value, True

    def before_start(self) -> dict:
        """Before any server starts: the 1-minute load average must be at most
        ``max_load``."""
        value, loaded = self._wait("load average", lambda: os.getloadavg()[0], self.max_load)
        return dict(loadavg=round(value, 2), loaded=loaded)

    def before_run(self, pgids: set[int]) -> dict:
        """Before a run: others' cores over ``PROBE_S`` must be at most ``max_others``."""

        def probe() -> float:
            w = Window(pgids).open()
            time.sleep(PROBE_S)
            return w.close()["others_cores"]

        value, loaded = self._wait("others' CPU (cores)", probe, self.max_others)
        return dict(others_cores_before=value, loaded_before=loaded)

    def flag(self, during: dict, before: dict) -> bool:
        """Whether a run counts as loaded: others went past ``max_others`` before it (load
        allowed) or during it."""
        return bool(before.get("loaded_before")) or during["others_cores"] > self.max_others


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()[:2]]
