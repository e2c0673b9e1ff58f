"""A stand-in for the GPU host's python3, for tests/test_bench_smoke.py's runs of
bench/gpu_check.sh on a CPU machine (``KVMEM_PYTHON`` names a wrapper that runs this file
with the test's interpreter).

It answers the script's probe (``python3 -``, the probe on stdin) and its steps' pytest
runs (``python3 -m pytest ...``, the step's name in ``KVMEM_GPU_STEP``) as the JSON
object in ``KVMEM_STANDIN`` says; anything else (``-m bench.gpu_summary``, ``-c ...``)
runs as python3 would run it, with this interpreter.

    {"probe": {"has": ["cuda", "pytest"], "hang": "nixl"},
     "steps": {"smoke": {"cubins": 18}, "bench": {"rows": 1, "hang": true}},
     "dir": "/tmp/..."}

- ``probe.has``: the checks that import (the others report 0); ``probe.hang``: the check
  the probe hangs in, reported as tried and then never ended (it sleeps until stopped).
- a step's ``cubins``: new ``.cubin`` files in ``TRITON_CACHE_DIR`` (kernels it compiled);
  ``rows``: benchmark rows it measured, written to ``KVMEM_BENCH_OUT/bench-cuda.json`` at
  the end of its session, as bench/conftest.py's end-of-session hook writes them (not as
  they are measured: the stand-in shows what the script keeps of a step that writes at
  its end); ``hang``: after its rows, it waits to be stopped (and ``dir``/STEP.hanging
  holds its pid meanwhile).  Like pytest, SIGINT (a KeyboardInterrupt) ends the session
  with its count line and its end-of-session hooks, exit status 2; SIGTERM ends the
  process at once.  A step it is not told about passes at once.
- ``dir``: ``pytest.txt`` there gets one line per pytest run: the step, then its
  arguments, tab-separated.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import sys
import time

HANG_S = 120  # a hang's end, should nothing stop it (a test that failed leaves no process)


def probe(spec: dict, code: str) -> int:
    has = set(spec.get("has", ["cuda", "pytest"]))
    for name in re.findall(r'^\s+"(\w+)": \("', code, flags=re.M):  # the script's CHECKS
        print("try", name, flush=True)
        if name == spec.get("hang"):
            time.sleep(HANG_S)
            return 1
        print("has", name, int(name in has), flush=True)
    print("env torch stand-in, triton stand-in, cuda stand-in", flush=True)
    return 0


def session_end(step: dict, passed: int, started: float) -> None:
    """What pytest prints and bench/conftest.py writes when a session ends."""
    out = os.environ.get("KVMEM_BENCH_OUT")
    if out and step.get("rows"):
        rows = [
            dict(name="kvmem pool.release()", median_s=0.010, nbytes=None, role="kvmem")
            for _ in range(step["rows"])
        ]
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "bench-cuda.json"), "w") as f:
            json.dump(
                dict(
                    device="stand-in GPU",
                    device_type="cuda",
                    smoke=False,
                    partial=False,
                    groups={"release 64 GiB": rows},
                ),
                f,
            )
    print(f"{passed} passed in {time.monotonic() - started:.2f}s", flush=True)


def pytest_run(spec: dict, args: list[str]) -> int:
    started = time.monotonic()
    name = os.environ.get("KVMEM_GPU_STEP", "?")
    if spec.get("dir"):
        with open(os.path.join(spec["dir"], "pytest.txt"), "a") as f:
            f.write("\t".join([name, *args]) + "\n")
    step = spec.get("steps", {}).get(name, {})
    cache = os.environ.get("TRITON_CACHE_DIR")
    for i in range(step.get("cubins", 0)):
        os.makedirs(os.path.join(cache, name), exist_ok=True)
        open(os.path.join(cache, name, f"k{i}.cubin"), "w").close()
    if not step.get("hang"):
        session_end(step, 1, started)
        return 0
    with open(os.path.join(spec["dir"], f"{name}.hanging"), "w") as f:
        f.write(str(os.getpid()))
    try:
        time.sleep(HANG_S)
    except KeyboardInterrupt:
        print("!!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!!", flush=True)
        session_end(step, 1, started)
        return 2
    return 1


def main(argv: list[str]) -> int:
    spec = json.loads(os.environ.get("KVMEM_STANDIN", "{}"))
    if argv == ["-"]:
        return probe(spec.get("probe", {}), sys.stdin.read())
    if argv[:2] == ["-m", "pytest"]:
        return pytest_run(spec, argv[2:])
    if argv[:1] == ["-m"] and len(argv) > 1:  # in this process: one interpreter start less
        sys.argv = argv[1:]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    os.execv(sys.executable, [sys.executable, *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
