"""Plant a known defect in a copy of the tree and show that the tier meant to catch it does.

Each defect (:data:`DEFECTS`) is one textual change to one file of ``HEAD`` (checked out
with ``git worktree`` into a temporary folder, so the working tree is never touched) and
the tier that must fail on it: ``check`` runs what ``make check`` runs, ``test`` the
adapter's part of what ``make test`` runs (``tests/sglang``).  Both stop at the first
failure (``-x``).  A defect whose tier passes is reported as MISSED and the exit status
is 1.

    .venv/bin/python tools/planted_defects.py              # every defect
    .venv/bin/python tools/planted_defects.py allocator    # one

The copy's packages come first on ``PYTHONPATH`` (kvmem and the adapter are installed
editable from the checkout, which would otherwise be imported); each run prints the file
it imported kvmem from.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _check_marks() -> str:
    with open(os.path.join(ROOT, "Makefile")) as f:
        m = re.search(r"^CHECK_MARKS := (.+)$", f.read(), re.M)
    if not m:
        raise SystemExit("Makefile: no CHECK_MARKS line")
    return m.group(1).strip()


@dataclass(frozen=True)
class Defect:
    name: str
    what: str
    path: str
    old: str
    new: str
    tier: str  # "check" or "test"


DEFECTS = [
    Defect(
        "allocator",
        "a batched free (free_group) puts back only its first batch: "
        "the pages of every later free in the group leak",
        "kvmem/allocator.py",
        "                            if len(group) == 1\n                            else torch.cat(",
        "                            if len(group) >= 1\n                            else torch.cat(",
        "check",
    ),
    Defect(
        "lifecycle",
        "an abort of a request inside the running prefill batch is dropped "
        "(the seed's case): the request is never ended and its pages never freed",
        "kvmem/disagg/prefill_ending.py",
        "            if req.abort_pending is None:\n                req.abort_pending = reason",
        "            if False:\n                req.abort_pending = reason",
        "check",
    ),
    Defect(
        "adapter",
        "the prefill's status message to the decode loses the answer frame, so "
        "the decode answers sglang's generic 500 instead of the 503/504",
        "integration/sglang/kvmem_sglang/notify.py",
        "    if told.answer is not None:\n        if not mgr.kv_status_msg_carries_reason:",
        "    if False:\n        if not mgr.kv_status_msg_carries_reason:",
        "test",
    ),
]


def _run(d: Defect, copy: str) -> tuple[bool, str, float]:
    path = os.path.join(copy, d.path)
    with open(path) as f:
        text = f.read()
    if text.count(d.old) != 1:
        raise SystemExit(
            f"{d.name}: {d.path} holds the text to change "
            f"{text.count(d.old)} times, not once: update DEFECTS"
        )
    with open(path, "w") as f:
        f.write(text.replace(d.old, d.new))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([copy, os.path.join(copy, "integration", "sglang")])
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    if d.tier == "check":
        env["KVMEM_HYPOTHESIS"] = "dev"
        cmd += ["-m", _check_marks(), "tests"]
    else:
        env["KVMEM_HYPOTHESIS"] = "ci"
        cmd += ["tests/sglang"]
    where = subprocess.run(
        [sys.executable, "-c", "import kvmem; print(kvmem.__file__)"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    if not where.stdout.startswith(copy):
        raise SystemExit(f"{d.name}: kvmem imported from {where.stdout.strip()}, not the copy")
    t = time.monotonic()
    p = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True)
    failed = [ln for ln in p.stdout.splitlines() if ln.startswith("FAILED")]
    # caught: a test failed (pytest's 1); an error at collection or in a fixture (2-4)
    # is no proof that a test saw the defect
    caught = p.returncode == 1 and bool(failed)
    return caught, "\n".join(failed) or p.stdout[-800:], time.monotonic() - t


def main(argv: list[str]) -> int:
    chosen = [d for d in DEFECTS if not argv or d.name in argv]
    if not chosen:
        raise SystemExit(f"no defect named {argv}; known: {[d.name for d in DEFECTS]}")
    missed = 0
    for d in chosen:
        copy = tempfile.mkdtemp(prefix=f"kvmem-plant-{d.name}-")
        subprocess.run(
            ["git", "worktree", "add", "-q", "--detach", copy, "HEAD"], cwd=ROOT, check=True
        )
        try:
            print(f"== {d.name} ({d.path}): {d.what}; tier: make {d.tier}", flush=True)
            caught, detail, secs = _run(d, copy)
            print(("caught" if caught else "MISSED") + f" in {secs:.0f} s\n{detail}\n", flush=True)
            missed += not caught
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", copy], cwd=ROOT)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
