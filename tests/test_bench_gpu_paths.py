"""The GPU benchmark's paths that a CPU can check: bench_pack.py at the chunk
sizes of the GPU run, where its pools' random bytes are drawn, the report's refusal of a
row that moved nothing, the report's rows written as they are measured, and
bench/timer.py, the ``benchmark`` fixture of a host without pytest-benchmark.
gpu_check.sh itself: tests/test_bench_smoke.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.test_bench_smoke import ROOT, _env

pytestmark = pytest.mark.subprocess  # starts other interpreters


# -- bench_pack.py at the GPU run's chunk sizes -------------------------------------------


@pytest.fixture(scope="module")
def pack_run(tmp_path_factory):
    """bench_pack.py on the CPU with the GPU default's smallest chunk (8 tokens, 1 MiB of
    gqa-bf16) beside 64 tokens, one round, its report and plot in ``out``, every random
    draw that names no device recorded (tests/random_draw_spy.py)."""
    out = tmp_path_factory.mktemp("bench-pack")
    spy = out / "spy.txt"
    spy.write_text("")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.random_draw_spy",
            "bench/bench_pack.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(
            KVMEM_BENCH_DEVICE="cpu",
            KVMEM_BENCH_TOKENS="8,64",
            KVMEM_BENCH_TOKENS_MLA="64",
            KVMEM_BENCH_ROUNDS="1",
            KVMEM_BENCH_OUT=str(out),
            KVMEM_FILL_SPY=str(spy),
        ),
    )
    return dict(p=p, out=out, spy=spy)


def test_pack_bench_at_gpu_chunk_sizes_reports_and_plots(pack_run):
    """8 tokens are no whole page at page sizes 16 and 64: those cases are not run (they
    were, with 0 pages, and their rows without bandwidth broke the plot in pytest's summary
    hook: exit 1, no PNG)."""
    p, out = pack_run["p"], pack_run["out"]
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-3000:]
    rows = [
        r for g in json.loads((out / "bench-cpu.json").read_text())["groups"].values() for r in g
    ]
    assert rows and all(r["nbytes"] > 0 and r["gb_per_s"] > 0 for r in rows)
    got = {(r.get("model", "gqa-bf16"), r["page_size"], r["tokens"]) for r in rows}
    assert got == {
        ("gqa-bf16", 1, 8),
        ("gqa-bf16", 1, 64),
        ("gqa-bf16", 16, 64),
        ("gqa-bf16", 64, 64),
        ("mla-fp8", 1, 64),
        ("mla-fp8", 16, 64),
        ("mla-fp8", 64, 64),
    }
    png = (out / "cpu-pack.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_pack_bench_draws_random_bytes_on_the_pools_device(pack_run):
    """The pools (7.7 GiB on the GPU host) are filled by their own device's generator, in
    place: no draw on the host CPU's generator copied over."""
    drawn = pack_run["spy"].read_text()
    assert drawn == "", drawn
    assert pack_run["p"].returncode == 0, pack_run["p"].stdout[-3000:]  # and the run ran


def test_gpu_cases_are_whole_pages_of_every_page_size():
    from bench.bench_pack import PAGE_SIZES, cases

    got = cases([8, 128, 1024, 4096])
    assert all(t % ps == 0 and t // ps >= 1 for ps, t in got)
    assert {ps for ps, _ in got} == set(PAGE_SIZES)
    assert (16, 8) not in got and (64, 8) not in got and (1, 8) in got
    with pytest.raises(ValueError, match=r"page size\(s\) \[64\] get no chunk"):
        cases([8, 16])
    with pytest.raises(ValueError, match="must be > 0"):
        cases([0, 64])


def test_report_refuses_a_row_that_moved_nothing():
    from bench.conftest import Report
    from bench.timer import Timer

    t = Timer()
    t.pedantic(lambda: None, rounds=1)
    r = Report()
    with pytest.raises(ValueError, match="nbytes must be > 0 or None, got 0"):
        r.add("pack P16, 0 MiB chunk", "kvmem.pack_pages", t, 0)
    assert not r.groups  # nothing added
    r.add("g", "kvmem x", t, None)
    r.add("g", "kvmem y", t, 10)
    assert "gb_per_s" not in r.groups["g"][0] and r.groups["g"][1]["gb_per_s"] > 0


STUCK_BENCH = """
import time


def test_measured(benchmark, report):
    benchmark.pedantic(lambda: None, rounds=2)
    report.add("noop", "kvmem noop", benchmark, 8, role="kvmem")


def test_stuck():
    print("STUCK", flush=True)
    time.sleep(600)
"""


def test_report_rows_survive_a_killed_run(tmp_path):
    """With KVMEM_BENCH_OUT the JSON is written after every benchmark
    (``partial: true``), so a run killed in its next benchmark (SIGKILL: no hook of pytest
    runs) leaves the rows measured before it.  bench/conftest.py as a plugin, on a file of
    two benchmarks: one measured, one stuck until killed."""
    (tmp_path / "bench_stuck.py").write_text(STUCK_BENCH)
    out = tmp_path / "out"
    args = ["-q", "-s", "-p", "no:cacheprovider", "-p", "no:benchmark", "-p", "bench.conftest"]
    p = subprocess.Popen(
        [sys.executable, "-m", "pytest", *args, str(tmp_path / "bench_stuck.py")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(KVMEM_BENCH_OUT=str(out), KVMEM_BENCH_DEVICE="cpu"),
    )
    seen = []
    try:
        deadline = time.monotonic() + 300
        for line in p.stdout:  # until the second benchmark has started
            seen.append(line)
            if "STUCK" in line or time.monotonic() > deadline:
                break
        assert "STUCK" in seen[-1], "".join(seen)
    finally:
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=60)
    report = json.loads((out / "bench-cpu.json").read_text())
    assert report["partial"] is True and report["device_type"] == "cpu"
    [row] = report["groups"]["noop"]
    assert row["name"] == "kvmem noop" and row["nbytes"] == 8 and row["median_s"] >= 0
    assert sorted(f.name for f in out.iterdir()) == ["bench-cpu.json"]  # no half-written file


# -- bench/timer.py -----------------------------------------------------------------------


def test_timer_rounds_setup_and_warmups():
    from bench.timer import Timer

    calls, setups = [], []

    def setup():
        setups.append(len(calls))
        return (len(setups),), {"k": "v"}

    t = Timer()
    result = t.pedantic(
        lambda i, k: calls.append((i, k)) or i, setup=setup, rounds=3, warmup_rounds=2
    )
    assert calls == [(i, "v") for i in range(1, 6)] and setups == [0, 1, 2, 3, 4]
    assert result == 5 and t.stats.stats.rounds == 3  # warm-up rounds are not timed
    s = t.stats.stats
    assert s.min <= s.median <= s.max and s.min >= 0
    with pytest.raises(RuntimeError, match="once per test"):
        t.pedantic(lambda: None)
    with pytest.raises(ValueError, match="iterations must be 1"):
        Timer().pedantic(lambda: None, setup=lambda: None, iterations=2)
    t = Timer()
    t.pedantic(lambda: None, rounds=2, iterations=5)
    assert t.stats.stats.rounds == 2 and t.enabled and t.extra_info == {}


def test_benchmarks_run_without_pytest_benchmark(tmp_path):
    """``-p no:benchmark``: the fixture is bench/timer.py's; the report comes out."""
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:benchmark",
            "bench/bench_release.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(KVMEM_BENCH_SMOKE="1", KVMEM_BENCH_OUT=str(tmp_path)),
    )
    assert p.returncode == 0, p.stdout[-5000:] + p.stderr[-3000:]  # no "fixture not found"
    report = json.loads((tmp_path / "bench-cpu.json").read_text())
    assert {r["role"] for g in report["groups"].values() for r in g} == {"kvmem", "baseline"}
