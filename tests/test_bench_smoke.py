"""The benchmarks and the GPU check cannot rot unseen.

- Every benchmark runs once in the smoke mode (``KVMEM_BENCH_SMOKE=1``, bench/conftest.py:
  tiny sizes, one round, no timing assertion), in a process of its own (its sglang pairs
  forked from the session's sglang fork servers), and the report,
  its JSON and every plot come out: a renamed field, a broken baseline or a plot that no
  longer draws fails here.  The serving benchmark (bench_serving.py: real sglang servers,
  one stock pair, then one with the flag, minutes to start) runs in a process of its own
  with its own time limit, and its results file is checked: its schema and summary, both
  kinds in its one cell and its release/resume cycle, the plots, the README's figures
  filled from it.
- bench/gpu_check.sh (run by hand on a CUDA host) parses, every path it hands pytest
  exists, it names every CUDA-only test file, and those collect on this CPU machine:
  imported, or skipped at module level, never an import error.  The bench files it runs
  are the ones the smoke run just ran.  Its plan (``--plan``) for a bare H200 host fits
  its time limit with the small kernel grid first and the benchmarks second, and budgets
  the start of every process of the sharded step; its step runner (``--selftest``)
  reports passes, failures, steps past their budget (killed when SIGTERM is ignored) and
  skips; its dry run (``--dry-run``) runs on this CPU everything a CPU can; a run leaves
  one archive, its end screen and its console log in OUTDIR; and the parts it runs the
  pack grid in (KVMEM_GPU_GRID, KVMEM_GPU_SHARD) partition the grid.
- Run with a stand-in for the GPU host's python3 (tests/gpu_check_standin.py): a step
  stopped at its budget keeps what it wrote on SIGINT; a fast first step leaves the
  benchmarks their floor; with NIXL the CPU demo stays out of the GPU steps; a probe or
  nvidia-smi that hangs is stopped; a run killed outright leaves in OUTDIR the archive of
  the steps it finished and its console log.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import tarfile
import threading
import time
import xml.etree.ElementTree as ET

import pytest

from testkit.zygote import ForkServer

pytestmark = pytest.mark.subprocess  # starts other interpreters

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_CHECK = os.path.join(ROOT, "bench", "gpu_check.sh")
FIGURES = ["pack", "allocator", "release", "demo", "transfer", "netns"]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_BENCH_")}
    env.pop("TRITON_INTERPRET", None)
    env.pop("KVMEM_FORCE_TRITON", None)
    env.update(extra)
    return env


def _fork_servers() -> str:
    """The session's sglang fork servers (tests/sglang/sglang_env.py: this environment's
    and ``.venv-e2e``'s, started together), named for the smoke run: its sglang pairs
    fork from them instead of importing sglang in fresh interpreters."""
    from tests.sglang.sglang_env import e2e_fork_server, fork_server

    servers = [fork_server(), e2e_fork_server()]
    starting = [threading.Thread(target=s.start) for s in servers]
    for t in starting:
        t.start()
    for t in starting:
        t.join()
    for s in servers:
        s.start()  # nothing when it runs; else it fails here, with its log
    return ForkServer.variable(*servers)


SERVING = "bench/bench_serving.py"


def _smoke_run(out, paths: list[str], timeout: float, **env) -> dict:
    junit = out / "junit.xml"
    t = time.monotonic()
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *paths,
            f"--junitxml={junit}",
        ],
        cwd=ROOT,
        env=_env(KVMEM_BENCH_SMOKE="1", KVMEM_BENCH_OUT=str(out), **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return dict(p=p, out=out, junit=junit, seconds=time.monotonic() - t)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-smoke")
    zygotes = _fork_servers()
    return _smoke_run(out, ["bench", "--ignore", SERVING], 600, TESTKIT_ZYGOTE=zygotes)


@pytest.fixture(scope="module")
def serving_smoke(tmp_path_factory):
    """bench_serving.py's smoke run: its servers start in minutes on two loaded cores (a
    pair took 118 s and 235 s at a load average of 4-6)."""
    return _smoke_run(tmp_path_factory.mktemp("serving-smoke"), [SERVING], 1200)


def test_every_benchmark_runs_in_smoke_mode(smoke, serving_smoke):
    for run in (smoke, serving_smoke):
        p = run["p"]
        assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    cases = [
        c
        for run in (smoke, serving_smoke)
        for c in ET.parse(run["junit"]).getroot().iter("testcase")
    ]
    ran: dict[str, list[str]] = {}
    for c in cases:
        outcome = [e.tag for e in c if e.tag in ("failure", "error", "skipped")]
        ran.setdefault(c.get("classname").split(".")[-1], []).extend(outcome or ["passed"])
    files = {os.path.basename(f)[:-3] for f in glob.glob(os.path.join(ROOT, "bench", "bench_*.py"))}
    assert files and set(ran) == files, (sorted(files), sorted(ran))
    # a benchmark never skips: a missing baseline is a failure (every benchmark has its baseline in the same run)
    assert all(set(o) == {"passed"} for o in ran.values()), ran
    print(f"smoke run: {smoke['seconds']:.1f} s, serving: {serving_smoke['seconds']:.1f} s")


def test_smoke_report_and_plots(smoke):
    assert smoke["p"].returncode == 0
    out = smoke["out"]
    report = json.loads((out / "bench-cpu.json").read_text())
    assert report["smoke"] is True and report["device_type"] == "cpu"
    assert report["partial"] is False  # the session ended: every benchmark is in it
    rows = [r for g in report["groups"].values() for r in g]
    assert rows and all(r["median_s"] > 0 for r in rows)
    by_fig = {f: [r for r in rows if r.get("figure") == f] for f in FIGURES}
    for fig, rs in by_fig.items():
        roles = {r["role"] for r in rs}
        assert {"kvmem", "baseline"} <= roles, (fig, roles)  # kvmem beside its baseline
    assert {r["page_size"] for r in by_fig["pack"]} == {1, 16, 64}
    assert any(r["role"] == "ceiling" for r in by_fig["pack"])
    for fig in FIGURES:
        png = out / f"cpu-{fig}.png"
        assert png.exists(), sorted(os.listdir(out))
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, fig


def test_plot_cli_redraws_from_json(smoke, tmp_path):
    """``python -m bench.plot RESULTS.json OUTDIR`` (how a GPU run's JSON is drawn here)."""
    report = json.loads((smoke["out"] / "bench-cpu.json").read_text())
    report.update(device="NVIDIA H200", device_type="cuda")
    src = tmp_path / "bench-cuda.json"
    src.write_text(json.dumps(report))
    p = subprocess.run(
        [sys.executable, "-m", "bench.plot", str(src), str(tmp_path)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["bench-cuda.json"] + [f"nvidia-h200-{f}.png" for f in FIGURES]
    )


SERVING_PLOTS = ["cpu-serving.png", "cpu-serving-batch.png", "cpu-serving-resume.png"]


def test_serving_smoke_results(serving_smoke, tmp_path):
    """The serving smoke's results file (bench_serving.py itself checked its schema, every
    request answered, the decode's batch read, the flag's pool given back): stock and the
    flag in its cell with their ratio, the release/resume cycle of each, the load beside
    every run; the README's serving figures filled from it; ``python -m bench.plot``
    draws its three plots again; the session's report carries its table."""
    assert serving_smoke["p"].returncode == 0, serving_smoke["p"].stdout[-6000:]
    out = serving_smoke["out"]
    results = json.loads((out / "serving-cpu.json").read_text())
    assert results["smoke"] is True and results["partial"] is False
    assert results["config"]["backends"] == ["nixl"]
    assert results["config"]["order"] == "one pair at a time"
    assert "loadavg" in results["gate"]["at_start"]
    assert {r["kind"] for r in results["runs"]} == {"stock", "flag"}
    for r in results["runs"]:
        assert len(r["loadavg_before"]) == 2 and r["others_cores"] >= 0
        assert r["ttft_ms"]["median"] > 0 and r["itl_ms"]["median"] > 0
    (cell,) = results["summary"]["cells"]
    assert (cell["input_len"], cell["output_len"], cell["concurrency"]) == (32, 4, 2)
    assert cell["ratio"]["ttft_median_ms"]["n"] == 1
    assert {e["kind"] for e in results["summary"]["resume"]} == {"stock", "flag"}

    from bench import figures

    when = figures.render("serving.when", results=out)
    assert "SMOKE" in when and "not yet measured" not in when
    assert "| nixl | 32 / 4, 2 | " in figures.render("serving.table", results=out)
    assert "| nixl | flag | " in figures.render("serving.resume", results=out)
    assert set(SERVING_PLOTS) <= set(os.listdir(out))

    p = subprocess.run(
        [sys.executable, "-m", "bench.plot", str(out / "serving-cpu.json"), str(tmp_path)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(SERVING_PLOTS)
    report = json.loads((out / "bench-cpu.json").read_text())
    (row,) = report["groups"]["sglang serving benchmark (bench/serving.py): table"]
    assert "nixl" in row["name"] and "release/resume cycle" in row["name"]


# -- bench/gpu_check.sh --------------------------------------------------------------------


def _pytest_paths(script: str) -> list[str]:
    """Every repository path on gpu_check.sh's pytest lines (its --ignore'd ones too);
    ``${pyt[@]}`` is its pytest command."""
    text = script.replace("\\\n", " ")
    paths = []
    for line in text.splitlines():
        if "pytest" in line or "${pyt[@]}" in line or "--ignore" in line:
            paths += re.findall(r"(?<![\w/.$-])((?:tests|bench)(?:/[\w.]+)*)(?=[\s=)\"]|$)", line)
    return paths


def test_gpu_check_parses():
    p = subprocess.run(["bash", "-n", GPU_CHECK], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_gpu_check_paths_exist():
    paths = _pytest_paths(open(GPU_CHECK).read())
    assert "bench" in paths, paths
    missing = [x for x in paths if not os.path.exists(os.path.join(ROOT, x))]
    assert not missing
    files = {
        os.path.relpath(f, ROOT) for f in glob.glob(os.path.join(ROOT, "tests", "gpu", "test_*.py"))
    }
    assert files and files <= set(paths), sorted(files - set(paths))  # none left out


def test_gpu_check_cuda_tests_collect_on_cpu():
    """tests/conftest.py leaves tests/gpu out without CUDA; --noconftest brings it back, so
    each file is imported here: it collects, or skips itself at module level."""
    gpu = sorted({x for x in _pytest_paths(open(GPU_CHECK).read()) if x.startswith("tests/gpu")})
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "--noconftest",
            *gpu,
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    assert "error" not in p.stdout.lower().split("short test summary")[-1], p.stdout[-3000:]
    files = glob.glob(os.path.join(ROOT, "tests", "gpu", "test_*.py"))
    for f in files:  # each file either contributed tests or said why it skipped
        rel = os.path.relpath(f, ROOT)
        assert rel in p.stdout, (rel, p.stdout[-3000:])


def _gpu_check(*args, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    """The script with this interpreter as its python3; its probe unbounded in practice
    (300 s: on this loaded 2-core machine importing torch, NIXL and sglang can take more
    than the 30 s a GPU host gets), unless ``env`` bounds it."""
    env = {"KVMEM_PYTHON": sys.executable, "KVMEM_GPU_PROBE_LIMIT_S": "300", **env}
    return subprocess.run(
        ["bash", GPU_CHECK, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(**env),
    )


def _plan(**env) -> tuple[dict[str, str], dict[str, int], str]:
    """``--plan`` on a bare H200 host (16 cores, no NIXL, no sglang, no pytest-benchmark):
    ({step: would}, {step: budget}, stdout), steps in their order."""
    env = {"KVMEM_GPU_CORES": "16", "KVMEM_GPU_WITHOUT": "nixl sglang pytest-benchmark", **env}
    p = _gpu_check("--plan", **env)
    assert p.returncode == 0, p.stderr
    lines = [x for x in p.stdout.splitlines() if x.startswith("plan ") and "budget=" in x]
    would = {x.split()[1]: x.split("would=")[1] for x in lines}
    budget = {x.split()[1]: int(re.search(r"budget=(\d+)s", x).group(1)) for x in lines}
    return would, budget, p.stdout


def test_gpu_check_plan_for_a_bare_h200_fits_its_time():
    """The plan puts the small kernel grid first and the benchmarks right after it (the
    H200 targets are what they measure), runs them without pytest-benchmark, skips the
    steps NIXL and sglang carry (saying which), and every step that can run on a bare
    host, the benchmarks included, fits the time limit."""
    would, budget, out = _plan()
    steps = list(would)
    assert steps[:2] == ["smoke", "bench"], steps
    assert "small kernel grid first" in out.splitlines()[0]
    assert set(steps) == {
        "smoke",
        "bench",
        "gpu-paths",
        "disagg",
        "pack-grid",
        "sglang-staging",
        "sglang-memory-saver",
        "bench-transfer",
    }, steps
    assert would["disagg"].startswith("skip: NIXL is not importable")
    assert would["bench-transfer"].startswith("skip: NIXL is not importable")
    assert would["sglang-staging"].startswith("skip: sglang is not importable")
    assert would["sglang-memory-saver"].startswith("skip: sglang or torch_memory_saver")
    for name in ("smoke", "bench", "gpu-paths", "pack-grid"):
        assert would[name].startswith("run"), (name, would[name])
    assert "processes=8" in next(x for x in out.splitlines() if x.startswith("plan pack-grid"))
    total = re.search(r"plan total: (\d+)s of budgets .*, (\d+)s allowed", out)
    assert total and int(total.group(1)) <= int(total.group(2)) <= 290, out
    # with every package there, what does not fit is said to be out of time
    p = _gpu_check("--plan", KVMEM_GPU_CORES="16")
    assert p.returncode == 0 and "would=skip: out of time" in p.stdout, p.stdout


def test_gpu_check_budgets_the_start_of_every_shard():
    """8 pytest processes starting at once on one GPU take longer than one: the sharded
    step's budget grows with each process's share of the start (KVMEM_GPU_START_EXTRA_S),
    a single process's does not."""
    _, one, _ = _plan(KVMEM_GPU_START_EXTRA_S="1", KVMEM_GPU_CHECK_SECONDS="3000")
    _, three, _ = _plan(KVMEM_GPU_START_EXTRA_S="3", KVMEM_GPU_CHECK_SECONDS="3000")
    assert three["pack-grid"] - one["pack-grid"] == 7 * 2
    assert all(three[s] == one[s] for s in one if s != "pack-grid")


def _archive(outdir) -> dict[str, bytes]:
    """OUTDIR of a run: at most 8 files (what the device tool returns), the console log,
    the archive and the end screen; the archive's files by name."""
    names = sorted(os.listdir(outdir))
    assert names == ["console.log", "kvmem-gpu-check.tar.gz", "summary.txt"], names
    with tarfile.open(os.path.join(outdir, "kvmem-gpu-check.tar.gz")) as tar:
        return {
            os.path.normpath(m.name): tar.extractfile(m).read()
            for m in tar.getmembers()
            if m.isfile()
        }


def test_gpu_check_step_runner(tmp_path):
    """--selftest: a pass, a failure, a step stopped at its budget, one that ignores
    SIGINT and SIGTERM (killed KILL_S later), a sharded step, a step that cannot run here;
    one line each, the table, the exit status of a failure; one archive, the end screen
    and the console log (all that was printed, in the archive too)."""
    t = time.monotonic()
    p = _gpu_check("--selftest", str(tmp_path), KVMEM_GPU_BASE_S="1", KVMEM_GPU_CORES="4")
    assert p.returncode == 1, p.stdout + p.stderr
    assert time.monotonic() - t < 40  # the stubborn step did not sleep its 60 s
    files = _archive(tmp_path)
    run = files["run.txt"].decode().splitlines()
    assert run[0].startswith("[pass] ran: 3 passed, 1 skipped") and run[0].endswith("| ok")
    assert run[1].startswith("[fail] ran: 1 failed, 2 passed") and "FAILED (exit 1)" in run[1]
    assert run[2].startswith("[slow] ") and "TIMEOUT (ran past its 2s budget)" in run[2]
    assert run[3].startswith("[stubborn] ") and "TIMEOUT (ran past its 2s budget)" in run[3]
    assert run[4].startswith("[sharded] ran: 1 passed in 0.01s;1 passed in 0.01s")
    assert (
        run[5]
        == "[missing] skipped: a package is not importable here | a step that cannot run here"
    )
    assert run[-1].startswith("gpu_check: 2 ran ok, 3 failed, 1 skipped")
    rows = [r.split("\t") for r in files["steps.tsv"].decode().splitlines()]
    assert rows[0][:4] == ["step", "status", "seconds", "budget"]
    assert [r[:2] for r in rows[1:]] == [
        ["pass", "ok"],
        ["fail", "FAILED"],
        ["slow", "TIMEOUT"],
        ["stubborn", "TIMEOUT"],
        ["sharded", "ok"],
        ["missing", "skipped"],
    ]
    log = files["sharded.log"].decode()
    assert "shard 0/2" in log and "shard 1/2" in log
    screen = (tmp_path / "summary.txt").read_text()
    assert screen == files["summary.txt"].decode() and screen in p.stdout
    assert "stubborn" in screen and "no benchmark report" in screen
    console = (tmp_path / "console.log").read_text()
    assert console == p.stdout == files["console.log"].decode() and p.stderr == ""


def test_gpu_check_dry_run_on_cpu(tmp_path):
    """--dry-run on this CPU machine as a bare H200 host would run (no NIXL, no sglang, no
    pytest-benchmark): the probes, the CUDA test steps collected, the benchmarks at smoke
    sizes on the CPU with bench/timer.py, the end screen with every target, one archive.
    Budgets and the limit are raised: this is about what runs, not how fast this VM is."""
    p = _gpu_check(
        "--dry-run",
        str(tmp_path),
        KVMEM_GPU_CORES="4",
        KVMEM_GPU_WITHOUT="nixl sglang pytest-benchmark",
        KVMEM_GPU_BASE_S="240",
        KVMEM_GPU_CHECK_SECONDS="6000",
    )
    assert p.returncode == 0, p.stdout[-8000:] + p.stderr[-3000:]
    files = _archive(tmp_path)
    tsv = [r.split("\t") for r in files["steps.tsv"].decode().splitlines()[1:]]
    status = {r[0]: r[1] for r in tsv}
    assert status == {
        "smoke": "ok",
        "bench": "ok",
        "gpu-paths": "ok",
        "disagg": "skipped",
        "pack-grid": "ok",
        "sglang-staging": "skipped",
        "sglang-memory-saver": "skipped",
        "bench-transfer": "skipped",
    }, tsv
    assert re.match(r"6/\d+ tests collected", next(r[7] for r in tsv if r[0] == "smoke"))
    report = json.loads(files["bench-cpu.json"])
    assert report["smoke"] is True
    assert {
        "cpu-pack.png",
        "cpu-allocator.png",
        "cpu-release.png",
        "env.txt",
        "run.txt",
        "bench.log",
        "summary.txt",
    } <= set(files), sorted(files)
    screen = (tmp_path / "summary.txt").read_text().splitlines()
    assert len(screen) <= 60, len(screen)  # one screen
    text = "\n".join(screen)
    assert "SMOKE RUN" in text and "targets:" in text and "figures" in text
    for target in (
        "pack gqa-bf16, page size >= 16",
        "unpack gqa-bf16, page size >= 16",
        "pack P1 >= 3x faster",
        "release 2 GiB",
        "resume 2 GiB",
    ):
        assert target in text, (target, text)
    assert "\n".join(screen) in p.stdout  # printed at the end


# -- gpu_check.sh driven by a stand-in for the host's python3 --------------------------------

STANDIN = os.path.join(ROOT, "tests", "gpu_check_standin.py")


def _standin(tmp_path, steps=None, **probe) -> dict:
    """The variables that make gpu_check.sh run tests/gpu_check_standin.py as its python3
    (a wrapper in ``tmp_path``), on a 4-core host whose Triton cache, scratch folder and
    stand-in files are in ``tmp_path``.  ``probe`` and ``steps``: KVMEM_STANDIN's."""
    wrapper = tmp_path / "python3"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STANDIN}" "$@"\n')
    wrapper.chmod(0o755)
    (tmp_path / "standin").mkdir()
    spec = dict(probe=probe, steps=steps or {}, dir=str(tmp_path / "standin"))
    return dict(
        KVMEM_PYTHON=str(wrapper),
        KVMEM_STANDIN=json.dumps(spec),
        KVMEM_GPU_CORES="4",
        TRITON_CACHE_DIR=str(tmp_path / "triton"),
        TMPDIR=str(tmp_path),
    )


def _steps_tsv(files: dict[str, bytes]) -> dict[str, dict[str, str]]:
    lines = files["steps.tsv"].decode().splitlines()
    head = lines[0].split("\t")
    return {r.split("\t")[0]: dict(zip(head, r.split("\t"))) for r in lines[1:]}


def test_gpu_check_keeps_what_a_step_stopped_at_its_budget_wrote(tmp_path):
    """A step at its budget gets SIGINT, so that pytest ends as after a
    Ctrl-C, count line and end-of-session hooks included: the benchmark JSON its hook
    writes is in the archive and the summary reads it.  (SIGTERM, as before, ended the
    process at once: no JSON, no figure.)  bench/conftest.py also writes the rows as they
    are measured: tests/test_bench_gpu_paths.py."""
    out = tmp_path / "out"
    env = _standin(tmp_path, {"bench": {"rows": 1, "hang": True}})
    p = _gpu_check(str(out), KVMEM_GPU_BUDGET_S="bench=2", timeout=120, **env)
    assert p.returncode == 1, p.stdout[-5000:]  # a step ran past its budget
    files = _archive(out)
    bench = _steps_tsv(files)["bench"]
    assert bench["status"] == "TIMEOUT" and bench["budget"] == "2", bench
    assert re.match(r"1 passed in [0-9.]+s$", bench["result"]), bench  # its count line
    assert "KeyboardInterrupt" in files["bench.log"].decode()
    report = json.loads(files["bench-cuda.json"])
    assert report["groups"]["release 64 GiB"][0]["median_s"] == 0.010
    screen = (out / "summary.txt").read_text()
    assert "release 64 GiB: 10.0 ms" in screen and "no benchmark report" not in screen


def test_gpu_check_gives_the_benchmarks_their_floor(tmp_path):
    """A first step that compiled its 18 kernels in no time measures the
    least compile rate (0.2 s a kernel); the steps after it are sized with that rate, but
    the benchmarks keep their floor (70 s, they were cut to 48 s)."""
    out = tmp_path / "out"
    p = _gpu_check(str(out), timeout=120, **_standin(tmp_path, {"smoke": {"cubins": 18}}))
    assert p.returncode == 0, p.stdout[-5000:]
    files = _archive(out)
    assert "measured: 0.20s per kernel" in files["run.txt"].decode()
    steps = _steps_tsv(files)
    assert steps["smoke"]["kernels_compiled"] == "18"
    assert steps["bench"]["budget"] == "70", steps["bench"]
    assert steps["gpu-paths"]["budget"] == str(12 + 70 + 9), steps["gpu-paths"]  # 42 x 0.2 s


def test_gpu_check_keeps_the_cpu_demo_out_of_the_gpu_steps(tmp_path):
    """With NIXL importable the benchmark step still leaves out the CPU
    benchmarks (the kvmem demo takes minutes) and NIXL's, which runs as a step of its own,
    last; the disagg step runs."""
    out = tmp_path / "out"
    env = _standin(tmp_path, has=["cuda", "pytest", "nixl", "cupy"])
    p = _gpu_check(str(out), timeout=120, **env)
    assert p.returncode == 0, p.stdout[-5000:]
    runs = {}
    for line in (tmp_path / "standin" / "pytest.txt").read_text().splitlines():
        step, *args = line.split("\t")
        runs[step] = args
    bench = runs["bench"]
    assert "bench" in bench
    ignored = {bench[i + 1] for i, a in enumerate(bench) if a == "--ignore"}
    assert {
        "bench/bench_demo.py",
        "bench/bench_netns.py",
        "bench/bench_sglang_transfer.py",
        "bench/bench_serving.py",
        "bench/bench_transfer.py",
    } <= ignored, bench
    assert [a for a in runs["bench-transfer"] if a.startswith("bench")] == [
        "bench/bench_transfer.py"
    ]
    named = [a for args in runs.values() for a in args if "bench_demo" in a]
    assert named == ["bench/bench_demo.py"], runs  # only as the bench step's --ignore
    steps = _steps_tsv(_archive(out))
    assert list(steps)[-1] == "bench-transfer"
    assert steps["disagg"]["status"] == steps["bench-transfer"]["status"] == "ok", steps


def test_gpu_check_bounds_its_probes(tmp_path):
    """A python probe that hangs in an import (here NIXL's) and an
    nvidia-smi that hangs are each stopped at KVMEM_GPU_PROBE_LIMIT_S; what the probe
    reported before stands, the rest counts as not importable, and env.txt says so."""
    out = tmp_path / "out"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexec sleep 120\n")
    smi.chmod(0o755)
    env = _standin(tmp_path, has=["cuda", "pytest"], hang="nixl")
    t = time.monotonic()
    p = _gpu_check(
        str(out),
        KVMEM_GPU_PROBE_LIMIT_S="1",
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        timeout=120,
        **env,
    )
    assert p.returncode == 0, p.stdout[-5000:]
    assert time.monotonic() - t < 60  # neither waited for its 120 s
    files = _archive(out)
    text = files["env.txt"].decode()
    assert "nvidia-smi: stopped at its 1s bound" in text, text
    note = "probe: stopped at its 1s bound while importing for 'nixl'; counted as not importable:"
    assert note + " nixl sglang sglang_alloc tms benchmark cupy" in text, text
    assert "importable: cuda=1 pytest=1 cupy=0 nixl=0" in text, text
    assert note in files["run.txt"].decode()
    steps = _steps_tsv(files)
    assert steps["smoke"]["status"] == "ok" and steps["disagg"]["status"] == "skipped"


def test_gpu_check_killed_outright_leaves_the_finished_steps(tmp_path):
    """OUTDIR's archive and summary are written again after every step
    and its console log as it is printed, so a run killed outright (SIGKILL: no exit trap
    runs, as when a device's time runs out) leaves what its finished steps measured."""
    out = tmp_path / "out"
    env = _standin(tmp_path, {"bench": {"rows": 1}, "gpu-paths": {"hang": True}})
    p = subprocess.Popen(
        ["bash", GPU_CHECK, str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(**env),
    )
    marker = tmp_path / "standin" / "gpu-paths.hanging"
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() or not marker.read_text():
            assert p.poll() is None and time.monotonic() < deadline, p.poll()
            time.sleep(0.1)
        p.kill()  # the script, SIGKILL
        stdout = p.communicate(timeout=60)[0]
    finally:
        p.kill()
        if marker.exists() and marker.read_text():  # the hanging step and its timeout
            os.killpg(os.getpgid(int(marker.read_text())), 9)
    files = _archive(out)
    steps = _steps_tsv(files)
    assert {s: steps[s]["status"] for s in steps} == {"smoke": "ok", "bench": "ok"}, steps
    assert json.loads(files["bench-cuda.json"])["groups"]["release 64 GiB"]
    assert "release 64 GiB: 10.0 ms" in (out / "summary.txt").read_text()
    console = (out / "console.log").read_text()
    assert "[bench] ran: 1 passed" in console and console == stdout
    assert console.startswith(files["console.log"].decode())  # as after the last step


def test_gpu_grid_parts_partition_the_pack_grid():
    """KVMEM_GPU_GRID=small, the rest in shards: every case of the grid exactly once (the
    selection in process; one collection in a child shows pytest collects what the
    variables select)."""
    from tests.gpu.test_cuda_pack_pool import selected
    from tests.kv_cases import grid

    cases = grid()
    full = [c.id for c in selected(cases, None, None)]
    small = [c.id for c in selected(cases, "small", None)]
    shards = [[c.id for c in selected(cases, "rest", f"{i}/3")] for i in range(3)]
    parts = small + [x for s in shards for x in s]
    assert len(small) == 6 and sorted(parts) == sorted(full) and len(set(parts)) == len(full) == 75
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "--noconftest",
            "tests/gpu/test_cuda_pack_pool.py",
            "-k",
            "kernel_matches_ref",
        ],
        cwd=ROOT,
        env=_env(KVMEM_GPU_GRID="rest", KVMEM_GPU_SHARD="1/3"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    collected = [x.split("[", 1)[1].rstrip("]") for x in p.stdout.splitlines() if "::" in x]
    assert collected == shards[1]


def test_plot_ratios_are_against_the_rows_own_kvmem_mode():
    """A group of several kvmem modes (the demo: each mode, then the raw NIXL write of its
    own runs) compares each baseline with the mode above it, not with the group's first."""
    from bench.plot import _ref_row

    a, raw_a = dict(role="kvmem", name="push"), dict(role="baseline", name="raw of push")
    b, raw_b = dict(role="kvmem", name="pull"), dict(role="baseline", name="raw of pull")
    ceiling = dict(role="ceiling", name="copy")
    rows = [a, raw_a, b, raw_b, ceiling]
    assert [_ref_row(rows, r) for r in rows] == [a, a, b, b, b]
    lone = dict(role="baseline", name="first")
    assert _ref_row([lone, a], lone) is a  # a baseline above every kvmem row: the first kvmem
