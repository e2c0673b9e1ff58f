"""The ``kvmem`` command keeps the ecosystem's conventions: ``--version``, ``python -m
kvmem`` as the same command, and in ``kvmem/`` no hand-written Prometheus text, no
hand-drawn progress bar, no print outside the command line."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvmem
from kvmem.cli import main

pytestmark = pytest.mark.subprocess  # starts other interpreters

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "kvmem"
CONSOLE = Path(sys.executable).with_name("kvmem")  # the console script beside python
SELFCHECK = [
    "selfcheck",
    "--layers",
    "2",
    "--heads",
    "2",
    "--head-dim",
    "64",
    "--pages",
    "129",
    "--requests",
    "4",
]


def _run(argv, timeout=120):
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _run_all(argvs, timeout=120) -> list[subprocess.CompletedProcess]:
    """:func:`_run` of each of ``argvs``, all started at once (each imports torch)."""
    procs = [
        subprocess.Popen(a, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for a in argvs
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [
        subprocess.CompletedProcess(a, p.returncode, o, e)
        for a, p, (o, e) in zip(argvs, procs, outs)
    ]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"kvmem {kvmem.__version__}\n" == "kvmem 0.1.0\n"
    # the package's own string and the installed metadata (pyproject.toml) agree
    assert kvmem.__version__ == importlib.metadata.version("kvmem")


def test_python_m_kvmem_is_the_kvmem_command():
    # pyproject.toml's [project.scripts]: the install (make test) puts it beside python
    assert CONSOLE.exists(), f"no kvmem console script at {CONSOLE}: kvmem is not installed"
    cases = (["--version"], ["--help"], SELFCHECK)
    runs = _run_all(
        [
            argv
            for args in cases
            for argv in ([sys.executable, "-m", "kvmem", *args], [str(CONSOLE), *args])
        ]
        + [[sys.executable, "-m", "kvmem", "selfcheck", "--pages", "1"]]
    )
    for by_module, by_script in zip(runs[0:-1:2], runs[1:-1:2]):
        assert by_module.returncode == by_script.returncode == 0, by_module.stderr
        # the same output but for selfcheck's own timing line
        strip = lambda out: re.sub(r"done in [0-9.]+ s", "done in T s", out)  # noqa: E731
        assert strip(by_module.stdout) == strip(by_script.stdout)
    assert by_module.stdout.rstrip().endswith(": OK")
    bad = runs[-1]
    assert bad.returncode == 2
    assert "usage: kvmem selfcheck" in bad.stderr and "--pages must be >= 2" in bad.stderr


@pytest.mark.nixl
def test_python_m_kvmem_runs_the_demo():
    """The demo's workers are started with 'spawn', which imports kvmem/__main__.py again
    in each of them: they must run their work, not the command.  Timeouts of 20 s: this
    checks the start, not the timing (with the default 2 s a loaded machine timed out
    reads here)."""
    p = _run(
        [
            sys.executable,
            "-m",
            "kvmem",
            "demo",
            "--requests",
            "6",
            "--no-faults",
            "--timeout",
            "20",
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
            "--quiet",
        ],
        timeout=180,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("kvmem demo: 6 requests: succeeded 6")
    assert p.stdout.rstrip().endswith(": OK")


def test_the_demo_is_imported_only_for_its_subcommand():
    """The library's command line loads the demo app (kvmem.demo) for ``kvmem demo``
    alone: not for selfcheck, --version or the top-level help."""
    code = (
        "import sys\nfrom kvmem.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[:2] == ['kvmem', 'demo']))"
    )
    cases = (SELFCHECK, ["--version"], ["--help"], ["demo", "--help"])
    runs = _run_all([[sys.executable, "-c", code, *args] for args in cases])
    for args, p in zip(cases[:-1], runs):
        assert p.returncode == 0, p.stderr
        assert p.stdout.splitlines()[-1] == "[]", (args, p.stdout)
    p = runs[-1]
    assert p.returncode == 0, p.stderr
    assert "--transfer-mode" in p.stdout and "'kvmem.demo.command'" in p.stdout.splitlines()[-1]


def _sources():
    return sorted(PKG.rglob("*.py"))


def test_no_hand_written_prometheus_text_or_progress_bar_in_kvmem():
    """Metrics go through prometheus_client (kvmem.disagg.metrics), progress through tqdm."""
    found = []
    for path in _sources():
        text = path.read_text()
        for needle, what in (
            ("# TYPE", "Prometheus exposition text"),
            ("# HELP", "Prometheus exposition text"),
            ("\\r", "a carriage return: a line redrawn by hand"),
            ("\r", "a carriage return: a line redrawn by hand"),
        ):
            if needle in text:
                found.append(f"{path.relative_to(ROOT)}: {needle!r} ({what})")
        for ch in re.findall(r"[\u2580-\u259f]", text):  # block elements: drawn bars
            found.append(f"{path.relative_to(ROOT)}: {ch!r} (a hand-drawn bar)")
    assert not found, "\n".join(found)


def test_only_the_command_line_prints():
    """Library modules log (kvmem.* loggers); the command line (kvmem/cli.py and the demo's
    command, kvmem/demo/command.py) prints its report and its errors."""
    cli = {PKG / "cli.py", PKG / "demo" / "command.py"}
    found = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in _sources()
        if p not in cli
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"(?<![\w.])print\(|sys\.std(err|out)\.write", line)
    ]
    assert not found, "\n".join(found)


def test_version_from_any_directory(tmp_path):
    # not the repository's root: the installed package answers, not a kvmem/ folder nearby
    p = subprocess.run(
        [sys.executable, "-m", "kvmem", "--version"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"},
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout == f"kvmem {kvmem.__version__}\n"


def test_selfcheck_help_describes_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        main(["selfcheck", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal
    assert "compares byte for byte" in out and "Exit status" in out
    for opt, words in (
        ("--device DEVICE", "cpu or cuda[:N] (default: cpu)"),
        ("--layers LAYERS", "layers of the model (default: 8)"),
        ("--heads HEADS", "KV heads per layer"),
        ("--head-dim HEAD_DIM", "elements per head"),
        ("--page-size PAGE_SIZE", "tokens per page (default: 16)"),
        ("--dtype {bf16,fp16,fp32,fp8}", "KV element type (default: bf16)"),
        ("--pages PAGES", "pages in each of the two pools (page 0 is padding) (default: 1025)"),
        ("--requests REQUESTS", "prompts in the batch"),
        ("--seed SEED", "seed of the prompt lengths"),
    ):
        assert f"{opt} {words}" in out, (opt, out)


@pytest.mark.parametrize("cmd", ["demo", "selfcheck"])
def test_an_unknown_option_prints_the_subcommands_usage(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: kvmem {cmd} ")
    assert f"kvmem {cmd}: error: unrecognized arguments: --bogus" in err
