"""kvmem.transfer.nixl_exit: a process that loaded NIXL leaves with its own exit status,
its Python exit work done and its output complete, without the C-level exit handlers (where
NIXL's destructors crash on an RDMA host: tests/transfer/test_rdma_host.py runs that host).

Each case runs in a process of its own with tests/exit_probe on PYTHONPATH: there a C-level
exit handler that aborts (SIGABRT) is armed, so a process that ran the C library's exit
handlers ends in SIGABRT instead of its status.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.util import pythonpath_env

pytestmark = pytest.mark.subprocess  # starts other interpreters

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "exit_probe"


def _env(probe: str = "abort") -> dict:
    # NIXL_LOG_LEVEL: not NIXL's INFO lines on stdout
    return pythonpath_env(PROBE, ROOT, NIXL_LOG_LEVEL="WARN", KVMEM_EXIT_PROBE=probe)


def _python(code: str, probe: str = "abort", timeout: float = 120):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=_env(probe),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_probe_aborts_a_normal_exit():
    """The control: without kvmem's exit, the armed handler runs (so the cases below that
    end with their own status did skip it)."""
    p = _python("print('plain exit')")
    assert p.returncode == -signal.SIGABRT, (p.returncode, p.stderr)
    assert p.stdout == "plain exit\n"


# A NIXL agent created and closed in order, then the case's body, in process_body().
_BODY = """
    import atexit, sys
    from kvmem.transfer import NixlEngine
    from kvmem.transfer.nixl_exit import nixl_loaded, process_body

    atexit.register(lambda: print("atexit ran"))
    with process_body():
        engine = NixlEngine("exit-case")
        engine.close()
        assert nixl_loaded()
        print("closed", end="")  # no newline, stdout a pipe: still in the buffer
        {}
"""


@pytest.mark.nixl
@pytest.mark.parametrize(
    "body, status, err",
    [
        ("pass", 0, ""),
        ("sys.exit(4)", 4, ""),
        ("sys.exit('a message for stderr')", 1, "SystemExit: a message for stderr\n"),
        ("raise ValueError('on purpose')", 1, "ValueError: on purpose\n"),
    ],
    ids=["returns", "exit-4", "exit-message", "raises"],
)
def test_process_body_ends_a_nixl_process_with_its_status(body, status, err):
    p = _python(_BODY.format(body))
    assert p.returncode == status, (p.returncode, p.stderr)
    assert p.stdout == "closedatexit ran\n"  # the buffer flushed, the atexit handler run
    assert p.stderr.endswith(err), p.stderr
    assert ("Traceback (most recent call last)" in p.stderr) == bool(err)


def test_without_nixl_finish_returns_the_status_for_a_normal_exit():
    p = _python(
        """
        import sys
        from kvmem.transfer.nixl_exit import finish, nixl_loaded, process_body

        assert not nixl_loaded()
        print(finish(5))
        with process_body():
            sys.exit(7)
    """,
        probe="",
    )
    assert (p.returncode, p.stdout) == (7, "5\n"), p.stderr


@pytest.mark.nixl
def test_a_pytest_run_that_loaded_nixl_ends_after_its_reports(tmp_path):
    """tests/conftest.py's hook (loaded here with -p): a run whose tests created a NIXL
    agent ends with pytest's own status (1: a test failed), its summary printed and its
    junit XML complete, the aborting exit handler skipped; a passing run ends 0."""
    (tmp_path / "test_case.py").write_text(
        textwrap.dedent("""
        from kvmem.transfer import NixlEngine

        def test_an_agent():
            NixlEngine("pytest-exit-case").close()

        def test_fails():
            assert False, "on purpose"
    """)
    )
    for select, status, summary in (
        (None, 1, "1 failed, 1 passed"),
        ("an_agent", 0, "1 passed, 1 deselected"),
    ):
        junit = tmp_path / f"junit-{status}.xml"
        argv = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.conftest",
            str(tmp_path / "test_case.py"),
            f"--junitxml={junit}",
        ]
        p = subprocess.run(
            argv + (["-k", select] if select else []),
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert p.returncode == status, (p.returncode, p.stdout[-3000:], p.stderr[-3000:])
        assert p.stdout.rstrip().splitlines()[-1].startswith(summary), p.stdout[-2000:]
        cases = list(ET.parse(junit).getroot().iter("testcase"))
        failed = [c.get("name") for c in cases if c.find("failure") is not None]
        assert len(cases) == (2 if select is None else 1)
        assert failed == (["test_fails"] if select is None else [])
