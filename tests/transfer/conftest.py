"""Shared fixtures of the transfer tests: ``nixl_agents``, the session's pool of NIXL
agents (tests/nixl_agents.py), for the tests that must run over real NIXL."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def nixl_agents():
    """The session-long NIXL agents: ``nixl_agents.engine()`` a new engine over one,
    ``nixl_agents.give_back(engine)`` closes it and takes its agent back."""
    from tests.nixl_agents import POOL

    yield POOL
    POOL.clear()
