"""NIXL's processes on a host with Debian's RDMA libraries (``libibverbs1``,
``ibverbs-providers``): there, every process that created a NIXL agent used to die of
SIGSEGV at exit (docs/transfer.md, "Process exit").  The packages are fetched with apt and
made visible to this test's processes only (tests/transfer/rdma_host.py: a private mount
namespace; nothing is installed on the machine).  First the defect itself, so this test
cannot pass vacuously: a plain NIXL script crashes at exit in there and not outside; then
``kvmem demo`` and NIXL test and benchmark processes in there end with status 0, their
reports complete.

Needs root, apt with a reachable archive and the overlay filesystem (CI has them: root on
a fresh Debian machine); where one is missing this test fails naming it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.transfer import rdma_host
from tests.util import communicate, no_core_dumps, pythonpath_env

ROOT = Path(__file__).resolve().parents[2]

# A NIXL agent created, a region registered and deregistered, the agent deleted: the
# orderly close; then the libraries of libnl mapped in this process, one a line.
PLAIN_NIXL = """
import re, sys
import numpy as np
import nixl_cu12 as nixl

agent = nixl.nixl_agent("rdma-host-case", nixl.nixl_agent_config(backends=["UCX"]))
buf = np.zeros(1 << 20, dtype=np.uint8)
reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
agent.deregister_memory(reg)
del agent
for lib in sorted({l.split()[-1] for l in open("/proc/self/maps") if "libnl-route" in l}):
    print(lib)
if sys.argv[1:] == ["finish"]:
    from kvmem.transfer.nixl_exit import finish
    finish(0)
"""
SYSTEM_LIBNL = "libnl-route-3.so.200"  # the system's; the wheel's is libnl-route-3-<hash>


pytestmark = [pytest.mark.subprocess, pytest.mark.nixl]


@pytest.fixture(scope="module")
def rdma_root(tmp_path_factory):
    """The unpacked packages (None: this machine's processes have them already)."""
    try:
        return rdma_host.fetch(str(tmp_path_factory.mktemp("rdma")))
    except rdma_host.RdmaHostError as e:
        pytest.fail(f"cannot make an RDMA host here: {e}", pytrace=False)


def _start(root, argv, **env) -> subprocess.Popen:
    return subprocess.Popen(
        rdma_host.command(root, argv),
        cwd=ROOT,
        text=True,
        env=pythonpath_env(ROOT, NIXL_LOG_LEVEL="WARN", **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=no_core_dumps,
    )


def _wait(proc: subprocess.Popen, timeout: float = 240) -> subprocess.CompletedProcess:
    out, err = communicate(proc, timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_nixl_processes_end_cleanly_with_rdma_libraries(rdma_root, tmp_path):
    """All at once (their start-up, imports and NIXL agents, is most of their time)."""
    py = sys.executable
    report, junit, out = tmp_path / "demo.json", tmp_path / "junit.xml", tmp_path / "bench"
    procs = dict(
        plain=_start(rdma_root, [py, "-c", PLAIN_NIXL]),
        outside=_start(None, [py, "-c", PLAIN_NIXL]) if rdma_root is not None else None,
        finish=_start(rdma_root, [py, "-c", PLAIN_NIXL, "finish"]),
        demo=_start(
            rdma_root,
            [
                py,
                "-m",
                "kvmem",
                "demo",
                "--requests",
                "50",
                "--bw-mib",
                "16",
                "--quiet",
                "--json",
                str(report),
            ],
        ),
        tests=_start(
            rdma_root,
            [
                py,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "tests/transfer/test_engine_contract.py::"
                "test_in_flight_write_blocks_deregister_until_drained[nixl]",
                f"--junitxml={junit}",
            ],
        ),
        bench=_start(
            rdma_root,
            [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "bench/bench_transfer.py"],
            KVMEM_BENCH_SMOKE="1",
            KVMEM_BENCH_OUT=str(out),
        ),
    )
    done = {k: _wait(p) for k, p in procs.items() if p is not None}

    # The defect, reproduced: two libnl in the process, SIGSEGV at exit after the close.
    p = done["plain"]
    if p.returncode > 0 and ("unshare:" in p.stderr or "RdmaHostError" in p.stderr):
        pytest.fail(f"cannot make the mount namespace here: {p.stderr[-2000:]}", pytrace=False)
    assert p.returncode == -signal.SIGSEGV, (p.returncode, p.stdout, p.stderr[-3000:])
    assert "/" + SYSTEM_LIBNL in p.stdout, p.stdout
    if rdma_root is not None:  # and outside that namespace, no crash: it is the packages
        p = done["outside"]
        assert p.returncode == 0 and "/" + SYSTEM_LIBNL not in p.stdout, (p.returncode, p.stdout)
    # kvmem's exit after the same close.
    p = done["finish"]
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])
    assert "/" + SYSTEM_LIBNL in p.stdout

    # The demo: both workers end with status 0, the report says OK.
    p = done["demo"]
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert p.stdout.rstrip().endswith(": OK") and "warning" not in p.stdout, p.stdout
    r = json.loads(report.read_text())
    assert r["ok"] and r["warnings"] == [] and r["errors"] == []
    assert (r["prefill"]["exit_code"], r["decode"]["exit_code"]) == (0, 0)
    assert r["leaked_pages"] == {"prefill": 0, "decode": 0}
    assert r["bytes_transferred"] == r["bytes_verified"] > 0

    # A NIXL test process (its peer process too) and a NIXL benchmark process: status 0,
    # the summary, the junit XML and the benchmark JSON complete.
    p = done["tests"]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.rstrip().splitlines()[-1].startswith("1 passed"), p.stdout
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    assert len(cases) == 1 and not list(cases[0]), ET.tostring(cases[0])
    p = done["bench"]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"written: {out / 'bench-cpu.json'}" in p.stdout, p.stdout[-3000:]
    groups = json.loads((out / "bench-cpu.json").read_text())["groups"]
    assert groups and all(rows for rows in groups.values())
