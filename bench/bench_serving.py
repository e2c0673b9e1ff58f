"""sglang's serving benchmark through real PD pairs, stock against ``SGLANG_KVMEM=1``, on
NIXL and Mooncake (bench/serving.py: its docstring has the sweep, the release/resume
cycle and the quiet gate), run under pytest: ``make bench`` runs it with its defaults and
writes ``serving-cpu.json`` and its plots into ``KVMEM_BENCH_OUT`` (bench/results/); the
README's serving figures come from that file (bench/figures.py).

It runs in ``.venv-e2e`` (sglang with its benchmark, the router and Mooncake: ``make
venv-e2e``), as a child process whose progress lines reach the terminal as they come
(outside the smoke mode).  ``KVMEM_BENCH_SERVING_ARGS`` adds options (``"--backends nixl
--rounds 1"``).  A machine that is not quiet is refused: the test fails and says so,
with the rows measured before the refusal kept in the file (``partial: true``).

The smoke mode runs ``--smoke``: NIXL alone, one pair at a time (two engines alive: the
main suite runs beside the e2e tier), one round of one cell (4 requests of 32 tokens in,
4 out, 2 at a time), one release/resume cycle per kind, load allowed.  What it checks is
the plumbing (every request answered, the schema, the summary, the decode's batch read,
the release giving the flag's pool back, the plots), not figures.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import threading
from pathlib import Path

import pytest

from bench.conftest import SMOKE
from bench.serving_report import KINDS, check, table
from testkit.sglang_pair import E2E_PYTHON

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600 if SMOKE else 4 * 3600


def _command(out: Path, logs: Path) -> list[str]:
    extra = shlex.split(os.environ.get("KVMEM_BENCH_SERVING_ARGS", ""))
    return [
        str(E2E_PYTHON),
        "-m",
        "bench.serving",
        "--out",
        str(out),
        "--logs",
        str(logs),
        *(["--smoke"] if SMOKE else []),
        *extra,
    ]


def _run(cmd: list[str], console: Path, capsys) -> int:
    """The tool, its output into ``console`` and, outside the smoke mode, its own lines
    (not sglang's warnings) to the terminal as they come; killed past TIMEOUT_S."""
    with open(console, "w") as log:
        p = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        watchdog = threading.Timer(TIMEOUT_S, p.kill)
        watchdog.start()
        try:
            for line in p.stdout:
                log.write(line)
                log.flush()
                if not SMOKE and line.startswith(("serving", "[", "written")):
                    with capsys.disabled():
                        print(line, end="", flush=True)
            return p.wait()
        finally:
            watchdog.cancel()


def test_serving(benchmark, report, tmp_path, capsys):
    if not E2E_PYTHON.exists():
        pytest.fail(f"{E2E_PYTHON} is missing: the serving benchmark runs there (make venv-e2e)")
    out = Path(os.environ.get("KVMEM_BENCH_OUT") or tmp_path / "out")
    console = tmp_path / "serving-console.log"
    status = []
    cmd = _command(out, tmp_path / "logs")
    benchmark.pedantic(lambda: status.append(_run(cmd, console, capsys)), rounds=1, iterations=1)
    text = console.read_text()
    assert status == [0], f"{shlex.join(cmd)} exited {status}:\n{text[-6000:]}"
    results = json.loads((out / "serving-cpu.json").read_text())
    assert check(results) == [], check(results)
    assert results["partial"] is False and results["smoke"] is SMOKE
    runs = results["runs"]
    cfg = results["config"]
    assert len(runs) == len(cfg["backends"]) * len(KINDS) * cfg["rounds"] * len(cfg["cells"])
    assert all(r["failed"] == 0 and r["completed"] == r["cell"]["prompts"] for r in runs), [
        (r["seq"], r["errors"]) for r in runs if r["failed"]
    ]
    # the decode's counters moved: every answer's tokens after the first came from it
    assert all(r["decode_batch_mean"] and r["decode_batch_mean"] > 0 for r in runs)
    cycles = results["cycles"]
    assert len(cycles) == len(cfg["backends"]) * len(KINDS) * cfg["resume"]["cycles"]
    for c in cycles:
        assert c["before"]["slices"] and c["after"]["slices"]
        assert all(s["failed"] == 0 for w in ("before", "after") for s in c[w]["slices"])
        if c["kind"] == "flag":  # the flag's release gives its pool back (34 MiB here)
            assert min(c["given_back_mib"].values()) > 8, c["given_back_mib"]
    for name in ("cpu-serving.png", "cpu-serving-batch.png") + (
        ("cpu-serving-resume.png",) if cycles else ()
    ):
        png = out / name
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    lines = table(results["summary"])
    report.groups["sglang serving benchmark (bench/serving.py): table"].append(
        dict(name="\n      " + "\n      ".join(lines), median_s=1.0, nbytes=None)
    )
