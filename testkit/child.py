"""Child processes that report one JSON value, for tests and benchmarks alike.

The child prints its result as JSON on a stdout line of its own (:func:`emit`, or
:func:`script_main` around a script's ``main()``); the parent starts it (:func:`start`,
:func:`run`) and reads the last stdout line that holds JSON (:func:`json_of`,
:func:`last_json`).  :func:`run_children` does both for several children at once: the
one way here to "run this in a child and read its JSON".

A :class:`Child` names what to run (``python -c CODE``, ``python SCRIPT``,
``python -m MODULE``) and its environment.  With ``fork`` (a
:class:`testkit.zygote.ForkServer`) it is forked from a process that imported the
heavy modules once, as that interpreter would run it; without, or where the server
says a fresh interpreter would differ (testkit/zygote.py), it is a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def last_json(stdout: str):
    """The JSON value on the last line of a child's ``stdout`` that holds one: UCX prints
    its own errors to stdout, after the child's result (seen: a TCP connect it retried
    under load, "try to increase net.core.somaxconn ..."); raises naming the tail when no
    line parses."""
    lines = stdout.strip().splitlines()
    for line in reversed(lines):
        if line.lstrip().startswith(("{", "[")):
            try:
                return json.loads(line)
            except ValueError:
                continue
    raise ValueError(
        "no JSON line in the child's output; its last lines:\n" + "\n".join(lines[-5:])
    )


def emit(obj) -> None:
    """Print ``obj`` as the child's JSON result line."""
    print(json.dumps(obj), flush=True)


def script_main(main) -> None:
    """Run a scenario script's ``main()`` and leave: its result as JSON on the last
    stdout line and status 0, or the traceback on stderr and status 1; with ``os._exit``
    either way (sglang's threads are not daemons, and NIXL's exit is not clean here)."""
    try:
        result = main()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    print(json.dumps(result, default=str), flush=True)
    sys.stderr.flush()
    os._exit(0)


def child_env(env: dict | None = None, *, drop: tuple[str, ...] = (), paths: tuple = ()) -> dict:
    """This process's environment less the variables whose names start with one of
    ``drop``, with ``env`` over it, and the repository root (then ``paths``) ahead of
    its PYTHONPATH: what a child needs to import ``tests``, ``bench`` and ``testkit``."""
    full = {k: v for k, v in os.environ.items() if not (drop and k.startswith(drop))}
    full.update(env or {})
    full["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)]
        + [str(p) for p in paths]
        + [q for q in full.get("PYTHONPATH", "").split(os.pathsep) if q]
    )
    return full


@dataclass(frozen=True)
class Child:
    """One child: ``code`` (``python -c``), ``script`` (a file run as ``__main__``) or
    ``module`` (``python -m``), with ``args`` after it; ``env``: its whole environment
    (default :func:`child_env`); ``fork``: a fork server to fork it from (None: a fresh
    interpreter, as for everything that must start as one), of the same interpreter;
    ``python``: the child's interpreter (default: this one's)."""

    code: str | None = None
    script: str | Path | None = None
    module: str | None = None
    args: tuple = ()
    env: dict | None = None
    cwd: str | Path = ROOT
    fork: object = field(default=None, compare=False)
    python: str | None = None

    def __post_init__(self):
        if sum(x is not None for x in (self.code, self.script, self.module)) != 1:
            raise ValueError("a Child runs exactly one of code, script or module")
        if self.fork is not None and str(self.python or sys.executable) != getattr(
            self.fork, "python", None
        ):
            raise ValueError("a Child is forked only from a fork server of its interpreter")

    def argv(self) -> list[str]:
        """The interpreter's arguments after ``sys.executable``."""
        if self.code is not None:
            head = ["-c", self.code]
        elif self.script is not None:
            head = [str(self.script)]
        else:
            head = ["-m", self.module]
        return head + [str(a) for a in self.args]

    def environment(self) -> dict:
        return dict(self.env) if self.env is not None else child_env()


def start(child: Child):
    """Start ``child``; a ``subprocess.Popen`` (text, stdout and stderr piped), or the
    fork server's process with the same methods (``pid``, ``args``, ``returncode``,
    ``poll``, ``wait``, ``communicate``, ``kill``)."""
    if child.fork is not None:
        proc = child.fork.spawn(child)
        if proc is not None:
            return proc
    return subprocess.Popen(
        [child.python or sys.executable, *child.argv()],
        cwd=child.cwd,
        env=child.environment(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run(child: Child, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(..., capture_output=True, text=True, timeout=timeout)`` of
    ``child``: a child still running after ``timeout`` s is killed and waited for, and
    ``subprocess.TimeoutExpired`` goes on."""
    proc = start(child)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def json_of(proc, what: str = "the child"):
    """The JSON result of a finished child (:func:`last_json` of its stdout); an
    AssertionError with its stderr's tail when it ended with a non-zero status or
    printed no JSON line."""
    if proc.returncode != 0:
        raise AssertionError(f"{what} failed with {proc.returncode}:\n{proc.stderr[-4000:]}")
    try:
        return last_json(proc.stdout)
    except ValueError as e:
        raise AssertionError(f"{what}: {e}\nits stderr:\n{proc.stderr[-4000:]}") from None


@dataclass
class Reply:
    """A child's JSON result (``value``) and what it printed."""

    value: object
    stdout: str
    stderr: str


def run_children(children: dict, timeout: float) -> dict:
    """Start every :class:`Child` of ``children`` at once and read each one's JSON:
    ``{key: Reply}``.  A child that fails (non-zero status, no JSON line) or is still
    running ``timeout`` s after the start raises AssertionError naming it; the children
    still running then are killed."""
    procs, end = {}, time.monotonic() + timeout
    replies: dict = {}
    try:
        for key, child in children.items():
            procs[key] = start(child)
        for key, proc in procs.items():
            try:
                out, err = proc.communicate(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired as e:
                tail = e.stderr or b""
                tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
                raise AssertionError(
                    f"{key} ({_name(children[key])}): still running after "
                    f"{timeout:.0f} s; its stderr so far:\n{tail[-4000:]}"
                ) from None
            done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            replies[key] = Reply(json_of(done, f"{key} ({_name(children[key])})"), out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return replies


def _name(child: Child) -> str:
    if child.script is not None:
        return Path(child.script).name
    return f"-m {child.module}" if child.module is not None else "python -c"
