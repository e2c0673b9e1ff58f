"""Shared benchmark plumbing: every bench measures kvmem and its baseline in the same run,
and this prints (and, with KVMEM_BENCH_OUT=DIR, writes as JSON and draws as PNG plots,
bench/plot.py) medians, bandwidths and ratios at the end of the session.  With
KVMEM_BENCH_OUT the JSON is also written after every benchmark, marked ``partial: true``,
so that a run stopped before its end (bench/gpu_check.sh stops a step at its budget)
keeps the rows it measured; the end of the session writes it again, ``partial: false``
unless the session was interrupted.

``KVMEM_BENCH_SMOKE=1`` is the smoke mode ``make test`` runs (tests/test_bench_smoke.py):
every benchmark once, at tiny sizes, one timed round, no warm-up rounds; the report, its
JSON and the plots are still made, so a renamed field or a broken baseline fails there.
Its figures mean nothing.  ``KVMEM_BENCH_NOTE`` is a line stored with the report and
printed on every plot (e.g. that the machine was loaded).

Without pytest-benchmark (the bare GPU host, or ``-p no:benchmark``) the ``benchmark``
fixture is bench/timer.py's, the part of pytest-benchmark's the benchmarks use.

A run that loaded NIXL ends through :func:`testkit.pytest_exit.finish_pytest` once
pytest has written everything, the report, its JSON and plots included (NIXL's native
destructors crash at exit on a host with RDMA libraries; docs/transfer.md)."""

from __future__ import annotations

import json
import os
import platform
import time
from collections import defaultdict

import pytest
import torch


SMOKE = os.environ.get("KVMEM_BENCH_SMOKE") == "1"


def pick(full, smoke):
    """``smoke`` in the smoke mode, else ``full``: how a benchmark picks its sizes."""
    return smoke if SMOKE else full


def rounds(env: str, default: int) -> int:
    """Timed rounds: the env var ``env`` (else ``default``); 1 in the smoke mode."""
    return 1 if SMOKE else int(os.environ.get(env, str(default)))


def warmups(n: int) -> int:
    """Untimed warm-up calls or rounds: ``n``; 0 in the smoke mode."""
    return 0 if SMOKE else n


def bench_device() -> torch.device:
    """KVMEM_BENCH_DEVICE, else CUDA when present, else CPU."""
    name = os.environ.get("KVMEM_BENCH_DEVICE")
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"


class Report:
    """Rows of (group, name, median seconds, bytes moved); the first row of a group whose
    name starts with 'kvmem' is the reference the others are compared to."""

    def __init__(self):
        self.groups: dict[str, list[dict]] = defaultdict(list)

    def rows(self) -> int:
        return sum(len(rows) for rows in self.groups.values())

    def add(self, group: str, name: str, benchmark, nbytes: int | None = None, **extra):
        """One row: ``benchmark``'s median; ``nbytes`` (bytes moved, for GB/s) is None or
        > 0.  Raises ValueError for ``nbytes <= 0``: a benchmark that moved nothing has
        measured nothing (its row would have no bandwidth to plot)."""
        if nbytes is not None and nbytes <= 0:
            raise ValueError(f"{group!r} / {name!r}: nbytes must be > 0 or None, got {nbytes}")
        median = benchmark.stats.stats.median
        row = dict(name=name, median_s=median, nbytes=nbytes, **extra)
        if nbytes:
            row["gb_per_s"] = nbytes / median / 1e9
        self.groups[group].append(row)

    def lines(self) -> list[str]:
        out = []
        for group, rows in self.groups.items():
            ref = next((r for r in rows if r["name"].startswith("kvmem")), rows[0])
            out.append(f"== {group}")
            for r in rows:
                bw = f"{r['gb_per_s']:8.2f} GB/s" if r.get("gb_per_s") else " " * 13
                ratio = r["median_s"] / ref["median_s"]
                rel = (
                    ""
                    if r is ref
                    else f"  kvmem is {ratio:6.2f}x faster"
                    if ratio >= 1
                    else f"  kvmem takes {1 / ratio:6.2f}x the time"
                )
                out.append(f"   {r['name']:<44} {r['median_s'] * 1e6:12.1f} us {bw}{rel}")
        return out


_REPORT = Report()


def pytest_configure(config):
    if not config.pluginmanager.hasplugin("benchmark"):  # pytest-benchmark's name
        from bench import timer

        config.pluginmanager.register(timer, "kvmem-bench-timer")


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config):
    status = yield
    from testkit.pytest_exit import finish_pytest  # here: collection imports no kvmem

    return finish_pytest(config, status)


@pytest.fixture(scope="session")
def report() -> Report:
    return _REPORT


def sync(dev: torch.device):
    """A callable that waits for the device (what a timed CUDA function must end with)."""
    if dev.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def write_json(report: Report, out_dir: str, partial: bool) -> str:
    """``report`` as ``OUT_DIR/bench-<device type>.json``, replaced whole (a reader never
    sees half a file); returns its path.  ``partial``: the session has not ended, or was
    interrupted, so benchmarks may be missing."""
    dev = bench_device()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"bench-{dev.type}.json")
    with open(path + ".part", "w") as f:
        json.dump(
            dict(
                device=device_name(dev),
                device_type=dev.type,
                torch=torch.__version__,
                time=time.strftime("%Y-%m-%dT%H:%M:%S"),
                smoke=SMOKE,
                partial=partial,
                note=os.environ.get("KVMEM_BENCH_NOTE", ""),
                groups=report.groups,
            ),
            f,
            indent=1,
        )
    os.replace(path + ".part", path)
    return path


_WRITTEN = [0]  # rows in the JSON written last


def pytest_runtest_logfinish(nodeid, location):
    """After every benchmark that added rows (through ``report.add`` or to ``groups``): the
    JSON so far, for a run stopped before its end."""
    out_dir = os.environ.get("KVMEM_BENCH_OUT")
    if out_dir and _REPORT.rows() != _WRITTEN[0]:
        write_json(_REPORT, out_dir, partial=True)
        _WRITTEN[0] = _REPORT.rows()


def pytest_terminal_summary(terminalreporter, exitstatus):
    if not _REPORT.groups:
        return
    dev = bench_device()
    terminalreporter.section(f"kvmem vs baselines on {device_name(dev)}")
    for line in _REPORT.lines():
        terminalreporter.write_line(line)
    out_dir = os.environ.get("KVMEM_BENCH_OUT")
    if not out_dir:
        return
    interrupted = exitstatus == pytest.ExitCode.INTERRUPTED
    path = write_json(_REPORT, out_dir, partial=interrupted)
    terminalreporter.write_line(
        f"written: {path}" + (" (interrupted: partial)" if interrupted else "")
    )
    try:
        from bench import plot
    except ImportError as e:  # matplotlib is in the test and bench extras
        terminalreporter.write_line(f"no plots: {e} (pip install -e '.[bench]')")
        return
    for png in plot.plot_file(path, out_dir):
        terminalreporter.write_line(f"written: {png}")
