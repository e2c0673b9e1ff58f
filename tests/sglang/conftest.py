"""The fork server of ``sglang_env.run_script`` and ``run_both``: started by their first
child, stopped after the last test of this folder (it holds torch and sglang, about
1 GB); the terminal summary says what it forked and which children it left to a fresh
interpreter, and why."""

from __future__ import annotations

import pytest

from tests.sglang import sglang_env


@pytest.fixture(scope="package", autouse=True)
def sglang_fork_server():
    yield
    sglang_env.close_fork_server()


def pytest_terminal_summary(terminalreporter):
    for name, server in sglang_env.servers().items():
        info = server.info
        terminalreporter.write_line(
            f"{name} fork server: started {server.starts}x in {server.start_s:.1f} s (its "
            f"imports {info['preload_s']} s, {info['modules']} modules), {server.forked} "
            f"children forked, {sum(server.refused.values())} refused")
        for why, n in server.refused.items():
            terminalreporter.write_line(f"  refused {n}x: {why}")
