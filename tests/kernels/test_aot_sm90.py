"""Every Triton kernel of kvmem compiles ahead of time for the H200 (sm_90) with the triton
``make test`` installs AND with the GPU host's triton 3.6, on this CPU machine
(tools/aot_sm90.py).  triton 3.6 lives in a small environment of its own,
``.venv-triton36`` (``make venv-triton36``: triton alone, no torch); ``KVMEM_TRITON36_PYTHON``
names another interpreter with it.  Both compiles run in subprocesses, side by side.

Beyond "it compiles", the PTX of both versions must keep what tests/kernels/test_ptx_sm90.py checks
on the installed one: 16-byte accesses in the pack kernel's copy loops where rows allow
them, and no 32-bit arithmetic on large values feeding an address."""

from __future__ import annotations

import ast
import glob
import json
import os
import subprocess
import sys

import pytest
import triton

from tests.kernels.test_ptx_sm90 import narrow_address_math

pytestmark = pytest.mark.subprocess  # starts other interpreters

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "aot_sm90.py")
TRITON36 = os.environ.get(
    "KVMEM_TRITON36_PYTHON", os.path.join(ROOT, ".venv-triton36", "bin", "python")
)
ENVS = ["installed", "triton36"]


def _tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("aot_sm90", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    if not os.path.exists(TRITON36):
        pytest.fail(
            f"{TRITON36} is missing: `make venv-triton36` builds it (triton 3.6 "
            f"alone, the GPU host's), or set KVMEM_TRITON36_PYTHON"
        )
    tmp = tmp_path_factory.mktemp("aot")
    cases = str(tmp / "cases.json")
    with open(cases, "w") as f:
        json.dump(_tool().make_cases(), f)
    pythons = {"installed": sys.executable, "triton36": TRITON36}
    procs = {
        name: subprocess.Popen(
            [py, TOOL, "compile", cases, str(tmp / name)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, py in pythons.items()
    }
    out = {}
    for name, p in procs.items():
        log, _ = p.communicate(timeout=600)
        res_path = tmp / name / "results.json"
        results = json.loads(res_path.read_text()) if res_path.exists() else None
        out[name] = dict(rc=p.returncode, log=log, results=results, dir=tmp / name)
    return dict(cases=json.load(open(cases)), envs=out)


def test_every_kernel_has_a_case(compiled):
    """A kernel added to kvmem without a case here fails: it would go unchecked."""
    tool = _tool()
    found = set()
    for path in glob.glob(os.path.join(ROOT, "kvmem", "**", "*.py"), recursive=True):
        rel = os.path.relpath(path, ROOT)
        names = tool.jit_functions(path)
        if names:
            assert rel in tool.KERNEL_FILES, f"{rel} has Triton kernels the tool does not read"
        found |= {(rel, n) for n in names if n.endswith("_kernel")}
    covered = {(c["file"], c["kernel"]) for c in compiled["cases"]}
    assert found and covered == found


@pytest.mark.parametrize("env", ENVS)
def test_every_kernel_compiles_for_sm90(compiled, env):
    r = compiled["envs"][env]
    assert r["rc"] == 0 and r["results"], r["log"]
    version = r["results"]["triton"]
    if env == "triton36":
        assert version.startswith("3.6."), version
    else:
        assert version == triton.__version__
    bad = {i: c["error"] for i, c in r["results"]["cases"].items() if not c["ok"]}
    assert not bad
    assert set(r["results"]["cases"]) == {c["id"] for c in compiled["cases"]}
    assert all(c["cubin_bytes"] > 0 for c in r["results"]["cases"].values())


@pytest.mark.parametrize("env", ENVS)
def test_pack_copies_use_16_byte_accesses(compiled, env):
    r = compiled["envs"][env]["results"]
    wide = [c["id"] for c in compiled["cases"] if c.get("unit_bytes") == 4]
    assert wide
    for i in wide:
        acc = set(r["cases"][i]["accesses"])
        assert {"ld.global.v4.b32", "st.global.v4.b32"} <= acc, (i, acc)


@pytest.mark.parametrize("env", ENVS)
def test_address_math_is_64_bit(compiled, env):
    d = compiled["envs"][env]["dir"]
    for c in compiled["cases"]:
        ptx = (d / f"{c['id']}.ptx").read_text()
        assert "%ctaid" in ptx, c["id"]
        assert narrow_address_math(ptx) == [], c["id"]


def test_tool_reads_kernels_without_torch(compiled):
    """The 3.6 environment has no torch: the compile step must not need it (if it did,
    every case there would have failed above; this says why in one line)."""
    probe = subprocess.run([TRITON36, "-c", "import torch"], capture_output=True)
    assert probe.returncode != 0, "the triton 3.6 environment should hold triton alone"
    tree = ast.parse(open(TOOL).read())
    top = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    assert "torch" not in top
