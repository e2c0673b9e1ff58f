"""`kvmem demo` end to end: two worker processes over NIXL, every fault injected; its JSON
report, typed as docs/demo.md says; bad options; a worker that dies before its final
report, and one that dies after it; the progress line on a terminal, and none on a
pipe."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from kvmem.cli import main
from kvmem.demo.faults import FAMILIES
from kvmem.demo.report import loop_breakdown
from tests.util import communicate, no_core_dumps, pythonpath_env

pytestmark = pytest.mark.subprocess  # starts other interpreters

ROOT = Path(__file__).resolve().parents[2]
DEMO = [sys.executable, "-m", "kvmem.cli", "demo"]
PROBE = ROOT / "tests" / "exit_probe"  # its sitecustomize.py says what it does
# The prefill's timeouts of an every-fault run: 8 s, not the demo's 2 s.  A request with no
# fault must succeed, and a loaded machine held one past 2 s (two pytest workers beside other
# work, load average 6 to 7 on two cores); the timeout cases then wait 8 s.
LOADED = ["--timeout", "8"]
FAMILY_OUTCOME = {"abort": "aborted", "timeout": "timed_out", "fail": "failed"}


class _Terminal:
    """A pseudo-terminal of 150 columns for a child's stderr (the progress line shows only
    on a terminal); :meth:`text` is what the child wrote to it so far, carriage returns
    kept (a pty only adds a carriage return to each newline)."""

    def __init__(self):
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 150, 0, 0))
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read, daemon=True)

    def started(self) -> None:
        """The child holds the slave end now: close ours, so that reading ends with it."""
        os.close(self.slave)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every slave end closed
                break
            if not chunk:
                break
            self.chunks.append(chunk)

    def text(self) -> str:
        return b"".join(self.chunks).decode(errors="replace").replace("\r\n", "\n")

    def close(self) -> str:
        self.reader.join(10)
        os.close(self.master)
        return self.text()


def _popen(args, tty: bool, **kw):
    """The demo in a process of its own, stdout piped, stderr on a terminal or piped;
    ``(process, terminal or None)``."""
    term = _Terminal() if tty else None
    proc = subprocess.Popen(
        DEMO + args,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=term.slave if tty else subprocess.PIPE,
        **kw,
    )
    if term:
        term.started()
    return proc, term


def _run(args, timeout=120, tty=False, **kw):
    """The demo to its end; stdout and stderr decoded as they are (text mode would turn
    the progress line's carriage returns into newlines)."""
    proc, term = _popen(args, tty, **kw)
    out, err = communicate(proc, timeout)
    err = term.close() if term else err.decode()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def assert_every_fault_lifecycle(r: dict, requests: int) -> None:
    """The checks of a default run (every fault, 4 pauses) of ``requests`` requests, one
    prefill and one decode: each request ended once, as its row of the lifecycle table
    says; nothing leaked; every landed byte verified."""
    assert r["requests"] == requests
    assert r["succeeded"] + r["aborted"] + r["timed_out"] + r["failed"] == requests
    assert r["leaked_pages"] == {"prefill": 0, "decode": 0}
    assert r["bytes_transferred"] == r["bytes_verified"] > 0 and r["bytes_corrupt"] == 0
    assert r["ok"] is True and r["errors"] == []
    # the default 4 pauses all happened, alternating sides, with traffic in flight
    assert r["pauses"] == 4 and r["pauses_by_side"] == {"prefill": 2, "decode": 2}
    assert r["outcomes_by_status"].get("503", 0) > 0
    # every family was injected, and each request ended the way its row of the lifecycle
    # table says (or was aborted by a pause first)
    planned = r["faults_planned"]
    for fam, kinds in FAMILIES.items():
        assert sum(planned.get(k, 0) for k in kinds) > 0, fam
        for k in kinds:
            assert set(r["outcomes_by_fault"].get(k, {})) <= {FAMILY_OUTCOME[fam], "pause_503"}, k
    assert set(r["outcomes_by_fault"]["none"]) <= {"succeeded", "pause_503"}
    assert r["succeeded"] == r["outcomes_by_fault"]["none"].get("succeeded", 0) > 0
    assert not r["delivered"]["missing"]
    assert r["protocol_errors"] == {"prefill": 0, "decode": 0}
    for side in ("prefill", "decode"):
        assert r[side]["closed"] is True and r[side]["exit_code"] == 0
        assert r[side]["allocator_allocated"] == 0 and r[side]["open_handles"] == 0


@pytest.mark.nixl
def test_demo_end_to_end_every_fault(tmp_path):
    out = tmp_path / "demo.json"
    out.write_text("not json: --json must overwrite it")
    p = _run(["--requests", "60", "--json", str(out), "--bw-mib", "64"] + LOADED, tty=True)
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(out.read_text())

    for key in (
        "requests",
        "succeeded",
        "aborted",
        "timed_out",
        "failed",
        "pauses",
        "bytes_transferred",
        "bytes_verified",
    ):
        assert _is_int(r[key]), (key, r[key])
    assert set(r["leaked_pages"]) == {"prefill", "decode"}
    assert all(_is_int(v) for v in r["leaked_pages"].values())
    assert isinstance(r["throughput_gbps"], float) and r["throughput_gbps"] > 0

    assert_every_fault_lifecycle(r, 60)
    for side in ("prefill", "decode"):
        # the workload loop napped (the faults leave both sides waiting for the other and
        # for timeouts), and fewer times than it stepped (steps that progress do not nap)
        st = r[side]["stage_seconds"]
        assert 0 < st["nap"]["calls"] < st["step"]["calls"], (side, st["nap"], st["step"])
        # the report's breakdown: naps are outside step(), the rest of step() is what
        # step() took beyond its timed stages (never below a timer's slack)
        b = loop_breakdown(st)
        assert "nap" not in b["in_step"] and b["nap"] == st["nap"]["seconds"]
        assert -0.05 * b["step"] <= b["rest_of_step"] <= b["step"], (side, b)
        assert b["step"] + b["nap"] <= b["loop"] * 1.05, (side, b)
    raw = r["raw_nixl"]
    assert raw["verified"] is True and raw["gbps"] > 0
    assert r["throughput_vs_raw"] == pytest.approx(r["throughput_gbps"] / raw["gbps"])

    # the report on stdout, the progress line on the terminal (stderr): redrawn in place,
    # one line, its last state the finished count
    assert "requests by outcome" in p.stdout
    assert "leaked pages: prefill 0, decode 0" in p.stdout
    assert p.stdout.rstrip().endswith("OK")
    assert "\rkvmem demo: starting the prefill and decode workers" in p.stderr
    assert "\rkvmem demo: measuring raw NIXL write bandwidth" in p.stderr
    last = p.stderr.rstrip("\n").rsplit("\r", 1)[-1]
    assert last.startswith("kvmem demo: 100%") and "| 60/60 [" in last, last
    assert f"ok {r['succeeded']} abort {r['aborted']}" in last and "pauses 4/4" in last


def test_bad_option_exits_2_with_the_reason():
    p = _run(["--abort-rate", "0.7", "--fail-rate", "0.5"], timeout=60)
    assert p.returncode == 2
    assert "kvmem demo: error: --abort-rate + --timeout-rate + --fail-rate must be <= 1" in p.stderr
    assert p.stdout == ""


def _refused(capsys, command: str, *args: str) -> str:
    """``kvmem COMMAND ARGS`` exits 2 with its usage line on stderr; that stderr."""
    with pytest.raises(SystemExit) as e:
        main([command, *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: kvmem {command}" in err, err
    return err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--requests", "0"], "--requests must be >= 1, got 0"),
        (["--requests", "ten"], "argument --requests: invalid int value: 'ten'"),
        (["--fail-rate", "-0.1"], "--fail-rate must be in [0, 1], got -0.1"),
        (["--chunk-tokens", "100"], "--chunk-tokens must be a multiple of --page-size 16, got 100"),
        (["--no-faults", "--pauses", "2"], "--no-faults contradicts --pauses 2"),
        (["--chunks", "direct"], "--chunks direct contradicts --transfer-mode pull"),
        (
            ["--transfer-mode", "pull", "--chunks", "packed"],
            "--chunks packed contradicts --transfer-mode pull",
        ),
        (["--pauses", "9", "--requests", "5"], "--pauses 9 is more than --requests 5"),
        (["--dtype", "int4"], "argument --dtype: invalid choice: 'int4'"),
        (["--timeout", "nan"], "--timeout must be a number of seconds > 0, got nan"),
        (["--layers", "4000", "--max-tokens", "100000"], "GiB of memory"),
        (["--json", "/nonexistent-dir/x.json"], "directory /nonexistent-dir does not exist"),
        (
            ["--json", "/proc/kvmem-demo.json"],
            "--json /proc/kvmem-demo.json: cannot create a file in /proc",
        ),
        (["--json", "/dev/null"], "--json /dev/null: exists and is not a regular file"),
        (
            ["--bw-mib", "100000"],
            "--bw-mib 100000: the raw-bandwidth buffers (one in each worker) need",
        ),
    ],
)
def test_bad_options(args, message, capsys):
    assert message in _refused(capsys, "demo", *args)


def test_json_naming_a_directory_exits_2_before_any_work(tmp_path, capsys):
    t0 = time.monotonic()
    for path in (str(tmp_path), str(tmp_path) + "/"):
        assert f"--json {path}: is a directory" in _refused(capsys, "demo", "--json", path)
    assert time.monotonic() - t0 < 10  # no worker was started
    assert list(tmp_path.iterdir()) == []  # no probe or temporary file left


def test_json_in_a_read_only_directory_exits_2(tmp_path, capsys):
    """A directory the user cannot create files in: mode 0500, and, for root (whom modes
    do not stop; CI runs as root), also immutable (``chattr +i``), which stops root too."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    immutable = os.geteuid() == 0
    if immutable:
        subprocess.run(["chattr", "+i", str(ro)], check=True)
    try:
        assert not os.access(ro, os.W_OK) or immutable
        assert f"--json {ro / 'r.json'}: cannot create a file in {ro}" in _refused(
            capsys, "demo", "--json", str(ro / "r.json")
        )
        assert list(ro.iterdir()) == []
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(ro)], check=True)
        ro.chmod(0o700)


def test_write_json_leaves_no_temporary_file_on_failure(tmp_path):
    from kvmem.demo.command import write_json

    with pytest.raises(TypeError):
        write_json(str(tmp_path / "r.json"), {"x": object()})  # not JSON-serializable
    assert list(tmp_path.iterdir()) == []
    write_json(str(tmp_path / "r.json"), {"x": 1})
    assert json.loads((tmp_path / "r.json").read_text()) == {"x": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--requests", "1000", "--pages", "10"], "--requests 1000 take"),
        (["--pages", "1"], "--pages must be >= 2"),
        (["--layers", "0"], "--layers must be >= 1, got 0"),
        (["--device", "tpu"], "--device 'tpu'"),
        (["--device", "cuda:7"], "--device cuda:7"),
        (["--pages", str(2**40)], "--pages 1099511627776: two pools"),
    ],
)
def test_selfcheck_bad_options_exit_2(args, message, capsys):
    assert message in _refused(capsys, "selfcheck", *args)


def test_selfcheck_cuda_without_cuda_exits_2(capsys, monkeypatch):
    import torch

    # a host without CUDA (on a CUDA host, as torch would answer there)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "--device cuda: CUDA is not available here" in _refused(
        capsys, "selfcheck", "--device", "cuda"
    )


@pytest.mark.nixl
def test_tiny_model_with_an_unaligned_extra_state_slot():
    """4 bytes of KV a page, so the AUX slot after a request's KV is not
    8-byte aligned for most lengths; the decode used to crash reading it as int64."""
    p = _run(
        [
            "--head-dim",
            "1",
            "--heads",
            "1",
            "--layers",
            "1",
            "--page-size",
            "1",
            "--chunk-tokens",
            "1",
            "--max-tokens",
            "3",
            "--requests",
            "100",
            "--bw-mib",
            "0",
            "--quiet",
        ],
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.rstrip().endswith(": OK")


def _workers_of(pid: int) -> list[int]:
    return [
        int(c)
        for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()
    ]


def _workload_running(proc, term) -> list[int]:
    """Wait (90 s at most) until the demo's progress line shows its workload running;
    its two workers' pids."""
    end = time.monotonic() + 90
    while "GB/s" not in term.text():
        assert proc.poll() is None and time.monotonic() < end, term.text()
        time.sleep(0.1)
    workers = _workers_of(proc.pid)
    assert len(workers) == 2
    return workers


@pytest.mark.nixl
@pytest.mark.parametrize("group", [False, True], ids=["parent", "process-group"])
def test_sigterm_stops_the_demo_cleanly(group):
    proc, term = _popen(
        ["--requests", "100000", "--bw-mib", "0", "--max-tokens", "256", "--chunk-tokens", "64"],
        tty=True,
        start_new_session=True,
    )
    try:
        workers = _workload_running(proc, term)
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        rc = proc.wait(timeout=30)
        assert time.monotonic() - t0 < 15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        text = term.close()
    assert rc == 128 + signal.SIGTERM, text
    assert "kvmem demo: terminated (SIGTERM); both workers stopped" in text
    assert "Traceback" not in text
    for pid in workers:
        assert not Path(f"/proc/{pid}").exists(), pid


@pytest.mark.nixl
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV], ids=["SIGKILL", "SIGSEGV"])
def test_a_worker_that_dies_does_not_hang_the_parent(sig):
    """Killed during the workload, before its final report: the run fails (status 3)."""
    proc, term = _popen(
        ["--requests", "100000", "--bw-mib", "0", "--max-tokens", "256", "--chunk-tokens", "64"],
        tty=True,
        preexec_fn=no_core_dumps,
    )
    try:
        workers = _workload_running(proc, term)
        victim = max(workers)  # the decode worker, started second
        os.kill(victim, sig)
        t0 = time.monotonic()
        rc = proc.wait(timeout=30)
        assert time.monotonic() - t0 < 15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        text = term.close()
    assert rc == 3, text
    assert "kvmem demo: FAILED" in text
    assert f"decode worker (pid {victim}): killed by signal {sig.value} ({sig.name})" in text
    for pid in workers:  # both workers are gone (joined by the parent before it exited)
        assert not Path(f"/proc/{pid}").exists(), pid


@pytest.mark.nixl
def test_a_worker_that_dies_after_its_final_report_leaves_the_results_valid(tmp_path):
    """The decode worker is killed with SIGSEGV at its exit, after its final report (a
    Python exit handler of tests/exit_probe, as a native destructor would crash there on
    an RDMA host): the run stands, status 0, with a warning naming the signal.  The
    prefill worker carries a C-level exit handler that aborts: its status 0 shows that a
    worker leaves without running those (kvmem.transfer.nixl_exit)."""
    out = tmp_path / "demo.json"
    env = pythonpath_env(
        PROBE, ROOT, KVMEM_EXIT_PROBE="abort@kvmem-demo-prefill,segv@kvmem-demo-decode"
    )
    p = _run(
        [
            "--requests",
            "30",
            "--bw-mib",
            "0",
            "--max-tokens",
            "256",
            "--chunk-tokens",
            "64",
            "--json",
            str(out),
        ],
        env=env,
        preexec_fn=no_core_dumps,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(out.read_text())
    assert r["ok"] is True and r["errors"] == []
    assert (r["prefill"]["exit_code"], r["decode"]["exit_code"]) == (0, -signal.SIGSEGV)
    want = (
        "the decode worker was killed by signal 11 (SIGSEGV) after its final report "
        "(its results are complete)"
    )
    assert r["warnings"] == [want]
    assert f"warning: {want}" in p.stdout and p.stdout.rstrip().endswith("OK")
    assert r["leaked_pages"] == {"prefill": 0, "decode": 0}
    assert r["bytes_transferred"] == r["bytes_verified"] > 0
    assert r["succeeded"] + r["aborted"] + r["timed_out"] + r["failed"] == 30


@pytest.mark.nixl
def test_no_progress_line_when_stderr_is_not_a_terminal():
    """Piped (a log file, CI): the report on stdout, no progress line on stderr."""
    p = _run(
        [
            "--requests",
            "6",
            "--no-faults",
            "--bw-mib",
            "0",
            "--layers",
            "1",
            "--heads",
            "1",
            "--head-dim",
            "64",
            "--max-tokens",
            "64",
            "--chunk-tokens",
            "32",
        ]
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "requests by outcome" in p.stdout and p.stdout.rstrip().endswith("OK")
    assert "kvmem demo" not in p.stderr and "\r" not in p.stderr and "%|" not in p.stderr


class _FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _progress_messages(finished: int) -> dict:
    return {
        "prefill": {
            "finished": finished,
            "pauses": 1,
            "outcomes": {"succeeded": finished - 1, "aborted": 1},
        },
        "decode": {"bytes_verified": 3 * 10**9},
    }


def test_progress_redraws_one_line_on_a_terminal():
    from kvmem.demo import DemoConfig
    from kvmem.demo.progress import Progress

    out = _FakeTerminal()
    bar = Progress(DemoConfig(requests=10, pauses=2), out)
    bar.EVERY = 3600.0  # only a forced update or the first one draws, however slow this is
    assert bar.shown
    bar.note("starting the prefill and decode workers")
    bar.start()
    bar.update(_progress_messages(3), 2.0)
    bar.update(_progress_messages(4), 2.0)  # within EVERY of the last draw: skipped
    bar.update(_progress_messages(5), 2.0, force=True)
    bar.close()
    bar.close()
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # one line, redrawn with \r
    draws = text.rstrip("\n").split("\r")[1:]
    assert any(d.startswith("kvmem demo: starting the prefill and decode workers") for d in draws)
    assert any(
        d.startswith("kvmem demo:  30%")
        and "3/10 [" in d
        and "ok 2 abort 1 timeout 0 fail 0, pauses 1/2, 1.50 GB/s" in d
        for d in draws
    )
    assert not any("4/10" in d for d in draws)
    assert draws[-1].startswith("kvmem demo:  50%") and "5/10 [" in draws[-1]


def test_progress_is_quiet_when_not_a_terminal():
    from kvmem.demo import DemoConfig
    from kvmem.demo.progress import Progress

    out = io.StringIO()
    bar = Progress(DemoConfig(requests=10), out)
    assert not bar.shown
    bar.note("starting")
    bar.start()
    bar.update(_progress_messages(3), 2.0, force=True)
    bar.close()
    assert out.getvalue() == ""
