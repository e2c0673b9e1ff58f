"""What the main test run (``pytest tests``) collects, its tiers and its Hypothesis profile.

Tiers (markers, pyproject.toml): ``make check`` runs what needs one process and no
server (``-m "not (subprocess or nixl or sglang or e2e or slow)"``); ``make test`` runs
everything once.

- ``tests/interpret``: the Triton kernels under Triton's interpreter run in a process of
  their own (``make test-interpret``: ``TRITON_INTERPRET=1 KVMEM_FORCE_TRITON=1 pytest
  tests/interpret``), because TRITON_INTERPRET is read when a kernel is decorated; the
  main run leaves that folder out.
- ``tests/gpu``: CUDA-only tests (bench/gpu_check.sh), collected only where CUDA is
  available.
- ``tests/e2e``: real sglang servers and sglang's router, run by ``make test-e2e`` with
  ``.venv-e2e`` (sglang with its full dependencies and the router), which sets
  ``KVMEM_E2E=1``; the main run leaves that folder out.

A run that loaded NIXL ends through :func:`testkit.pytest_exit.finish_pytest` once
pytest has written everything (on a host with RDMA libraries NIXL's native destructors
crash at exit, status 139, after the tests passed; docs/transfer.md, "Process exit").

Physical chunks: ``KVMEM_CHUNK_BYTES`` is set to 256 KiB here (unless the caller set it),
for this process and every process it starts (demo workers, sglang servers), so the
small pools of the tests have several chunks, each one mapping and one registered region,
as a GPU pool has at 2 GiB: a descriptor, registration or page run that crosses a chunk
fails here as it would on the GPU.  Most test pools then have a chunk boundary after
every one to five layer planes.

NIXL's progress threads nap 5 ms between polls (``testkit/nixl_nap.py``) in this process
and in the harness's processes, as in the e2e tier's servers: an idle agent otherwise
keeps a core busy, and a test with several agents starves the rest of a 2-core machine.
kvmem's own engines keep NIXL's default.
"""

import os
import sys

import pytest
import torch

from testkit import nixl_nap

try:
    from hypothesis import settings
except ImportError:  # the e2e tier's environment has no Hypothesis (and no property test)
    settings = None

os.environ.setdefault("KVMEM_CHUNK_BYTES", str(256 << 10))

# NIXL agents made in this process nap between progress polls instead of spinning a
# core each (testkit/nixl_nap.py); the harness's child processes do the same.
nixl_nap.install()

# Hypothesis profiles, chosen by KVMEM_HYPOTHESIS: "dev" (default: the edit loop, a tenth
# of the examples), "ci" (what make test runs), "nightly" (ten times ci).  A property test
# that sets its own count scales it with tests.util.examples().
PROFILE = os.environ.get("KVMEM_HYPOTHESIS", "dev")
if PROFILE not in ("dev", "ci", "nightly"):
    raise pytest.UsageError(f"KVMEM_HYPOTHESIS={PROFILE!r}: dev, ci or nightly")
if settings is not None:
    settings.register_profile("dev", max_examples=10, deadline=None)
    settings.register_profile("ci", max_examples=100, deadline=None)
    settings.register_profile("nightly", max_examples=1000, deadline=None)
    settings.load_profile(PROFILE)

collect_ignore = []
if os.environ.get("TRITON_INTERPRET") != "1":
    collect_ignore.append("interpret")
if not torch.cuda.is_available():
    collect_ignore.append("gpu")
if os.environ.get("KVMEM_E2E") != "1":
    collect_ignore.append("e2e")


# folders whose tests all carry a tier's marker (tests that start interpreters elsewhere
# say so themselves: ``pytestmark = pytest.mark.subprocess``)
_FOLDER_MARKS = {"sglang": ("sglang", "subprocess"), "e2e": ("e2e", "subprocess")}


# the tests that fork from this session's sglang fork servers: with several workers
# (``make test-main``: pytest-xdist, ``--dist loadfile``) they run in one, which starts
# the two servers once (about 1 GB and 10 to 20 s each)
_FORK_SERVER_USERS = ("sglang", "test_bench_smoke.py")


def pytest_configure(config):
    """A pytest-xdist worker's variables name it to whatever reads them: pytest-benchmark
    turns itself off in a pytest run that sees them, and the benchmark smoke's nested run
    would then time nothing.  The worker keeps them in its ``workerinput``; its children
    are not workers."""
    if hasattr(config, "workerinput"):
        for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
            os.environ.pop(name, None)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's
def pytest_xdist_make_scheduler(config, log):
    """With ``--dist loadfile``: each file's tests in one worker, as pytest-xdist does
    (module fixtures set up once), and every file of the fork servers' users in the same
    one.  (``--dist loadgroup`` with ``xdist_group`` marks would say the same; with pytest
    9.2 and pytest-xdist 3.8 it spreads a group over the workers.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ForkServerScopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            parts = path.split("/")
            if parts[0] == "tests" and len(parts) > 1 and parts[1] in _FORK_SERVER_USERS:
                return "sglang fork servers"
            return path

    return ForkServerScopes(config, log)


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        rel = os.path.relpath(str(item.fspath), here).split(os.sep)
        for name in _FOLDER_MARKS.get(rel[0], ()):
            item.add_marker(name)


@pytest.fixture(scope="session", autouse=True)
def sglang_fork_servers():
    """The fork servers of tests.sglang.sglang_env (torch and sglang imported once, about
    1 GB each) live until the session ends: tests/sglang and the benchmark smoke both
    fork from them."""
    yield
    env = sys.modules.get("tests.sglang.sglang_env")
    if env is not None:
        env.close_fork_server()


def _fork_server_lines() -> list[str]:
    """What each fork server of this process did, and which children it left to a fresh
    interpreter, and why."""
    env = sys.modules.get("tests.sglang.sglang_env")
    lines = []
    for name, server in (env.servers() if env is not None else {}).items():
        info = server.info
        if not server.starts or "preload_s" not in info:  # it never came up: its error says why
            lines.append(f"{name} fork server: did not start ({server.starts} tries)")
            continue
        lines.append(
            f"{name} fork server: started {server.starts}x in {server.start_s:.1f} s (its "
            f"imports {info['preload_s']} s, {info['modules']} modules), {server.forked} "
            f"children forked, {sum(server.refused.values())} refused"
        )
        lines += [f"  refused {n}x: {why}" for why, n in server.refused.items()]
    return lines


_WORKER_LINES: list[str] = []  # what the pytest-xdist workers' fork servers did


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: to the controller
        session.config.workeroutput["fork_servers"] = _fork_server_lines()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's, in the controller
def pytest_testnodedown(node, error):
    _WORKER_LINES.extend(getattr(node, "workeroutput", {}).get("fork_servers", []))


def pytest_terminal_summary(terminalreporter):
    for line in _fork_server_lines() + _WORKER_LINES:
        terminalreporter.write_line(line)


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config):
    status = yield
    from testkit.pytest_exit import finish_pytest  # here: collection imports no kvmem

    return finish_pytest(config, status)
