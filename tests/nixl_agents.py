"""NIXL agents kept for the whole test session, lent to the tests that must run over real
NIXL (the engine contract's NIXL half, the chunk-boundary and NIXL-refusal tests).

Creating a NIXL agent (UCX context, worker, backend) took 0.13-0.5 s here and closing two
0.06-0.16 s (measured 2026-12-03 on the 2-core machine, loaded); a test that needs two
fresh agents paid both every time.  An engine made
by :meth:`AgentPool.engine` is a fresh :class:`NixlEngine` (new incarnation, no keys, no
tombstones, no peers) over an agent another engine used before: ``close()`` leaves the
agent holding nothing (keys deregistered, lists and handles released, peers removed).
What it may still hold are messages on the wire: a notification one agent sent in a test
can reach its peer's agent later, in another test, where the same names play other roles
(seen: a REQ of one test refused by the next test's prefill).  So
:meth:`AgentPool.give_back` takes back every engine of a test together and drives their
agents until the wire is quiet, dropping what arrives, before any is lent again.  A test
that needs a *new* agent (a restarted peer, a peer that dies) makes its own, or
:meth:`AgentPool.discard` s one.

Agents are made without NIXL's progress thread (it spins a core per agent, for the whole
session); the tests drive both engines, as the demo's workers do.
"""

from __future__ import annotations

import itertools
import os
import time

from kvmem.transfer.nixl import NixlEngine, import_nixl


class AgentPool:
    """Idle NIXL agents (no progress thread, UCX), lent one per engine."""

    def __init__(self):
        self._idle: list = []
        self._lent: dict[int, object] = {}  # id(engine) -> agent
        self._ids = itertools.count()
        self.made = 0  # agents created
        self.dropped = 0  # messages that arrived after their test, dropped

    def engine(self) -> NixlEngine:
        """A new engine over an idle agent (one is made when none is idle)."""
        if self._idle:
            agent = self._idle.pop()
        else:
            nixl = import_nixl()
            conf = nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
            agent = nixl.nixl_agent(f"pooled-{os.getpid()}-{next(self._ids)}", conf)
            self.made += 1
        agent.get_new_notifs()
        eng = NixlEngine(agent.name, progress_thread=False, agent=agent)
        self._lent[id(eng)] = agent
        return eng

    def give_back(self, *engines: NixlEngine, quiet_s: float = 0.02, limit_s: float = 2.0) -> None:
        """Close ``engines`` (those still open) and take their agents back, after driving
        them until none received anything for ``quiet_s`` (at most ``limit_s``): what was
        still on the wire between them is dropped here, not read by a later test.  An
        engine that cannot be closed (a write still in flight) keeps its agent out of the
        pool for good; one not lent by this pool is left alone."""
        agents = []
        for eng in engines:
            agent = self._lent.pop(id(eng), None)
            if agent is None:
                continue
            try:
                eng.close(timeout=5.0)
            except Exception:
                continue
            agents.append(agent)
        now = time.monotonic()
        quiet_since, end = now, now + limit_s
        while agents and time.monotonic() - quiet_since < quiet_s and time.monotonic() < end:
            for agent in agents:
                got = agent.get_new_notifs()
                if any(got.values()):
                    self.dropped += sum(len(v) for v in got.values())
                    quiet_since = time.monotonic()
        self._idle.extend(agents)

    def discard(self, eng: NixlEngine) -> None:
        """Close ``eng`` and let its agent go (its destructor runs): what a peer sees when
        that agent's process dies (its writes in flight fail with
        NIXL_ERR_REMOTE_DISCONNECT, sends to it are refused)."""
        self._lent.pop(id(eng), None)
        eng.close(timeout=5.0)

    def clear(self) -> None:
        """Drop the idle agents (their destructors run as each one goes)."""
        self._idle.clear()


POOL = AgentPool()
