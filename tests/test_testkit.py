"""testkit's fork server (testkit/zygote.py) against fresh interpreters: a child forked
from it ends, prints and sees what the same ``python`` command would (status, stdout
and stderr, environment, working directory, argv, sys.path, ``__main__``, atexit and
non-daemon threads at exit); a child whose environment a fresh interpreter would read
differently is refused and started fresh; a child past its time is killed with its
process group.  The server here preloads a small module of its own (what it reads at
import is its own variable), so each case costs a fork, not sglang's imports
(tests/sglang forks its scripts from one that preloaded those)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from testkit.child import Child, child_env, json_of, run, run_children, start
from testkit.zygote import ForkServer

pytestmark = pytest.mark.subprocess  # starts other interpreters

PRELOAD = """
import json, os
IMPORT_VAR = os.environ.get("KZ_IMPORT_VAR")
os.environ.setdefault("KZ_SET", "w")  # as sglang sets its cache directories
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("zygote")
    (d / "kz_pre.py").write_text(PRELOAD)
    (d / "kz_mod.py").write_text(
        "import sys, json\nprint(json.dumps([__name__, sys.argv[1:], "
        "sys.argv[0].endswith('kz_mod.py')]))\n"
    )
    fs = ForkServer(
        ["kz_pre"], forbid=["kz_never"], env=child_env({"KZ_SERVER_ONLY": "1"}, paths=[d]), cwd=d
    )
    fs.start()
    fs.dir = d
    yield fs
    fs.close()


def both(server, **kw):
    """The same child forked and fresh: (forked CompletedProcess, fresh one)."""
    env = child_env(kw.pop("env", {}), paths=[server.dir])
    forked_before = server.forked
    forked = run(Child(env=env, fork=server, **kw), 60)
    assert server.forked == forked_before + 1, server.refused
    fresh = run(Child(env=env, **kw), 60)
    return forked, fresh


def same(forked, fresh):
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode,
        fresh.stdout,
        fresh.stderr,
    )


@pytest.mark.parametrize(
    "code, status",
    [
        ("import sys; print('out'); print('err', file=sys.stderr)", 0),
        ("import sys; sys.exit('bye')", 1),
        ("import sys; sys.exit(3)", 3),
        ("raise ValueError('boom')", 1),
        ("import os; os.write(1, b'raw\\n'); os._exit(5)", 5),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9),
        (
            "import atexit, threading, time\n"
            "atexit.register(print, 'atexit')\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), print('thread'))).start()\n"
            "print('main')",
            0,
        ),
    ],
    ids=["print", "exit-text", "exit-3", "raise", "os-exit", "killed", "atexit-thread"],
)
def test_forked_child_ends_as_a_fresh_interpreter(server, code, status):
    forked, fresh = both(server, code=code)
    same(forked, fresh)
    assert forked.returncode == status
    if "raise" in code:
        assert forked.stderr.splitlines()[1] == '  File "<string>", line 1, in <module>'
    if "atexit" in code:
        assert forked.stdout == "main\nthread\natexit\n"


SEES = """
import json, os, sys
site = min(i for i, p in enumerate(sys.path) if p.endswith("site-packages"))
print(json.dumps({"v": os.environ.get("KZ_V"), "server_only": os.environ.get("KZ_SERVER_ONLY"),
                  "cwd": os.getcwd(), "argv": sys.argv, "path0": sys.path[0],
                  "extra_first": sys.path.index(os.environ["KZ_EXTRA"]) < site,
                  "name": __name__}))
"""


def test_forked_child_sees_its_environment_cwd_argv_and_path(server, tmp_path):
    env = {"KZ_V": "1", "KZ_EXTRA": str(tmp_path), "PYTHONPATH": str(tmp_path)}
    forked, fresh = both(server, code=SEES, args=("a", "b"), env=env, cwd=tmp_path)
    same(forked, fresh)
    got = json.loads(forked.stdout)
    assert got == {
        "v": "1",
        "server_only": None,
        "cwd": str(tmp_path),
        "argv": ["-c", "a", "b"],
        "path0": "",
        "extra_first": True,
        "name": "__main__",
    }


def test_forked_script_and_module_run_as_main(server, tmp_path):
    script = tmp_path / "s.py"
    script.write_text(
        textwrap.dedent("""
        import json, os, sys
        def f():
            return 1
        print(json.dumps([__name__, __file__, sys.argv, sys.path[0], f.__module__]))
        if __name__ == "__main__":
            print("main")
    """)
    )
    forked, fresh = both(server, script=script, args=("x",), cwd=tmp_path)
    same(forked, fresh)
    assert json.loads(forked.stdout.splitlines()[0]) == [
        "__main__",
        str(script),
        [str(script), "x"],
        str(tmp_path),
        "__main__",
    ]
    forked, fresh = both(server, module="kz_mod", args=("y",), cwd=server.dir)
    same(forked, fresh)
    assert json.loads(forked.stdout) == ["__main__", ["y"], True]


def test_environment_read_at_start_or_import_goes_to_a_fresh_interpreter(server):
    code = "import os; print(os.environ.get('KZ_IMPORT_VAR'), os.environ.get('KZ_OTHER'))"
    refused = sum(server.refused.values())
    for env in ({"KZ_IMPORT_VAR": "2"}, {"PYTHONHASHSEED": "7"}):
        proc = start(Child(code=code, env=child_env(env, paths=[server.dir]), fork=server))
        assert isinstance(proc, subprocess.Popen), env  # a fresh interpreter
        out, _ = proc.communicate(timeout=60)
        assert out == f"{env.get('KZ_IMPORT_VAR')} None\n"
    assert sum(server.refused.values()) == refused + 2
    assert any("KZ_IMPORT_VAR" in why for why in server.refused)
    assert any("PYTHONHASHSEED" in why for why in server.refused)
    # a variable nothing read while the server imported is the child's own
    forked, fresh = both(server, code=code, env={"KZ_OTHER": "3"})
    same(forked, fresh)
    assert forked.stdout == "None 3\n"


def test_what_the_preload_set_is_set_in_every_child(server):
    code = "import os; print(os.environ.get('KZ_SET'))"
    env = child_env(paths=[server.dir])
    env.pop("KZ_SET", None)
    assert run(Child(code=code, env=env, fork=server), 60).stdout == "w\n"
    # a caller that imported the preload itself passes the value on: the same
    assert run(Child(code=code, env=env | {"KZ_SET": "w"}, fork=server), 60).stdout == "w\n"
    refused = sum(server.refused.values())
    proc = start(Child(code=code, env=env | {"KZ_SET": "mine"}, fork=server))
    assert isinstance(proc, subprocess.Popen) and proc.communicate(timeout=60)[0] == "mine\n"
    assert sum(server.refused.values()) == refused + 1


def test_child_past_its_time_is_killed_with_its_process_group(server, tmp_path):
    pid_file = tmp_path / "grandchild"
    code = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen(['sleep', '300'])\nopen({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "print('started', flush=True)\ntime.sleep(300)"
    )
    child = Child(code=code, env=child_env(paths=[server.dir]), fork=server)
    with pytest.raises(subprocess.TimeoutExpired) as e:
        run(child, timeout=10)
    assert b"started" in e.value.output
    grandchild = int(pid_file.read_text())
    end = time.monotonic() + 30
    while time.monotonic() < end:
        try:
            with open(f"/proc/{grandchild}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    break  # killed, not yet reaped by whoever adopted it
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the child's own child {grandchild} outlived the kill")


def test_children_json_at_once_and_a_failing_one_named(server):
    env = child_env(paths=[server.dir])
    ok = {
        k: Child(
            code=f"import json; print('noise'); print(json.dumps({{'k': {k!r}}})); "
            "print('[UCX after it')",
            env=env,
            fork=server,
        )
        for k in "abc"
    }
    replies = run_children(ok, timeout=60)
    assert {k: r.value for k, r in replies.items()} == {k: {"k": k} for k in "abc"}
    bad = dict(
        ok,
        b=Child(
            code="import sys; print('why', file=sys.stderr); sys.exit(2)", env=env, fork=server
        ),
    )
    with pytest.raises(AssertionError, match=r"(?s)b \(python -c\) failed with 2:.*why"):
        run_children(bad, timeout=60)
    with pytest.raises(AssertionError, match="no JSON line"):
        json_of(run(Child(code="print('plain')", env=env, fork=server), 60))


def test_server_idle_ends_and_starts_again_at_the_next_child(tmp_path):
    fs = ForkServer(["json"], env=child_env(), cwd=tmp_path, idle_s=1)
    try:
        code = "import os; print(os.getpid())"
        first = run(Child(code=code, env=child_env(), fork=fs), 60)
        fs.proc.wait(60)  # idle for a second: it ends
        second = run(Child(code=code, env=child_env(), fork=fs), 60)
        assert first.returncode == second.returncode == 0
        assert fs.starts == 2 and fs.forked == 2
    finally:
        fs.close()


def test_preload_that_imports_a_forbidden_module_does_not_start(tmp_path):
    fs = ForkServer(["json"], forbid=["json"], env=child_env(), cwd=tmp_path)
    with pytest.raises(RuntimeError, match="must not.*json"):
        fs.start()
    fs.close()
    assert sys.modules.get("testkit.zygote") is not None


def test_forked_child_forks_its_siblings_from_the_same_server(server):
    """A forked child reaches its server (``ForkServer.of_parent``): what it starts is
    forked there too (the server's child, not its own), in its environment; a fresh
    child, or one told of a server of another interpreter, has none."""
    code = textwrap.dedent("""
        import json, os
        from testkit.child import Child, child_env, run
        from testkit.zygote import ForkServer
        fs = ForkServer.of_parent()
        sib = run(Child(code="import os; print(os.getppid(), os.environ['KZ_SIB'])",
                        env=child_env({"KZ_SIB": "s"}), fork=fs), 60)
        print(json.dumps({"sib": sib.stdout.split(), "me": os.getppid(),
                          "kind": type(fs).__name__}))
    """)
    env = child_env(paths=[server.dir])
    r = json_of(run(Child(code=code, env=env, fork=server), 60))
    assert r["kind"] == "ForkServer" and r["sib"] == [str(server.info["pid"]), "s"], r
    assert r["me"] == server.info["pid"]  # both children of the server
    probe = "from testkit.zygote import ForkServer; print(ForkServer.of_parent())"
    assert run(Child(code=probe, env=env), 60).stdout == "None\n"
    other = env | {"TESTKIT_ZYGOTE": f"/usr/bin/python3:{server.info['socket']}"}
    assert run(Child(code=probe, env=other), 60).stdout == "None\n"
