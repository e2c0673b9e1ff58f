"""NIXL agents kept for the whole test session, lent to the tests that must run over real
NIXL (the engine contract's NIXL half, the chunk-boundary and NIXL-refusal tests).

Creating a NIXL agent (UCX context, worker, backend) took 0.13-0.5 s here and closing two
0.06-0.16 s (measured 2026-12-03 on the 2-core machine, loaded); a test that needs two
fresh agents paid both every time.  An engine made
by :meth:`AgentPool.engine` is a fresh :class:`NixlEngine` (new incarnation, no keys, no
tombstones, no peers) over an agent another engine used before: ``close()`` leaves the
agent holding nothing (keys deregistered, lists and handles released, peers removed),
and :meth:`AgentPool.give_back` drops the notifications still unread before the agent is
lent again.  A test that needs a *new* agent (a restarted peer) makes its own.

Agents are made without NIXL's progress thread (it spins a core per agent, for the whole
session); the tests drive both engines, as the demo's workers do.
"""

from __future__ import annotations

import itertools
import os

from kvmem.transfer.nixl import NixlEngine, import_nixl


class AgentPool:
    """Idle NIXL agents (no progress thread, UCX), lent one per engine."""

    def __init__(self):
        self._idle: list = []
        self._lent: dict[int, object] = {}   # id(engine) -> agent
        self._ids = itertools.count()
        self.made = 0

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

    def give_back(self, eng: NixlEngine) -> None:
        """Close ``eng`` (if open) and take its agent back; an engine that cannot be
        closed (a write still in flight) keeps its agent out of the pool for good."""
        agent = self._lent.pop(id(eng), None)
        if agent is None:
            return
        try:
            eng.close(timeout=5.0)
        except Exception:
            return
        agent.get_new_notifs()
        self._idle.append(agent)

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
