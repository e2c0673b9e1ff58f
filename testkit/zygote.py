"""A fork server ("zygote"): one process imports the heavy modules once (torch, sglang:
about 20-30 s on two cores), then forks a child per request that runs ``python -c
CODE``, ``python SCRIPT`` or ``python -m MODULE`` as that fresh interpreter would, and
reports its exit status; the child's stdout and stderr are the caller's pipes.

    server = ForkServer(["torch", "sglang.srt.server_args"], forbid=["nixl"])
    proc = server.spawn(Child(code="print(1)", env=...))   # Popen-like, or None
    ...
    server.close()

:func:`testkit.child.start` uses it for a :class:`testkit.child.Child` with ``fork``
set and starts a fresh interpreter where :meth:`ForkServer.spawn` returns None.

What a forked child gets, as a fresh interpreter would: its environment (``os.environ``
and the C environment), working directory, ``sys.argv``, ``sys.path`` (its PYTHONPATH
ahead of the interpreter's own entries), a new ``__main__`` module, stdin from
/dev/null, Python's exit (a ``SystemExit`` code, or the traceback and status 1; then
non-daemon threads joined, atexit handlers run, stdout and stderr flushed), its own
process group (a kill reaches the processes it started), numpy's global random state
seeded anew and torch's default generator at its start state.  Not the same: the hash
seed (one per server), and every module of the preload is imported already, under
the server's environment.

So the server refuses (and the caller starts a fresh interpreter for) a child whose
environment differs from the server's in a variable that

- the interpreter or a native library reads at start (``PYTHON*`` but PYTHONPATH,
  ``LD_*``, ``MALLOC_*``, the OpenMP, BLAS, torch, CUDA and Triton variables: the
  prefixes of :data:`STARTUP`; a ``.pth`` file of the environment that reads a
  variable adds it), or
- a module of the preload read while it was imported: the server records every
  variable read through ``os.environ`` then.  Modules that scan the whole environment
  at import are listed in :data:`SCANS` with the name prefixes they look for; a scan
  from anywhere else makes the server refuse every child, naming it, until it is
  added there.

A variable read only later (sglang's ``envs.X.get()``, the adapter's options at plugin
load, ``SGLANG_DISAGGREGATION_*`` at construction) is the child's own.  The variables
the preload's imports set (sglang's ``setdefault`` of its cache directories) are set
in every child as they were in the server, and a child that has them already with
those values (its caller imported sglang too) is not refused for them.

Fork safety: the server checks that it runs no Python thread but its main thread
before each fork and that no more native threads run than after the preload
(OpenBLAS's workers, numpy's and scipy's, which OpenBLAS stops around a fork itself;
the server's ready line lists them); torch's intra-op pool is
made at the first parallel op, which the server never runs; the modules of ``forbid``
(NIXL and Mooncake, which start threads and load libraries at import, and a plugin a
child must load itself) must not be imported by the preload.  A child never returns
into the server's loop: it leaves with ``os._exit``.
"""

from __future__ import annotations

import atexit
import json
import locale
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Variable name prefixes read when the interpreter or a native library starts, before
# (or outside) anything the server can record.
STARTUP = (
    "PYTHON",
    "LD_",
    "MALLOC_",
    "GLIBC_",
    "LANG",
    "LC_",
    "TZ",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "THP_MEM_ALLOC_ENABLE",
    "TORCH_",
    "PYTORCH_",
    "CUDA_",
    "NVIDIA_",
    "TRITON_",
)

# (module path suffix, function) -> the variable name prefixes that function looks for
# when it reads the whole environment at import: tqdm's envwrap (TQDM_*), sglang's
# renaming of the legacy SGL_* variables (srt/environ.py), networkx's configuration
# (NETWORKX_*, some read by name in the same function), fsspec's FSSPEC_* configuration
# (it copies the whole environment first).  What these functions read is recorded as
# their prefixes, not name by name.
SCANS = {
    ("tqdm/utils.py", "envwrap"): ("TQDM_",),
    ("sglang/srt/environ.py", "_handle_deprecated_envs"): ("SGL_",),
    ("networkx/utils/backends.py", "_set_configs_from_environment"): ("NETWORKX_",),
    ("fsspec/config.py", "set_conf_env"): ("FSSPEC",),
}

_HEADER = 8  # bytes of a request's length, ahead of its JSON

# Set in every forked child: ``<the server's interpreter><os.pathsep><its socket>``, so
# that the child can ask the same server for siblings (:meth:`ForkServer.of_parent`).
# A caller may name several servers there, one per interpreter, separated by ``;``
# (:meth:`ForkServer.variable`).
ZYGOTE_VAR = "TESTKIT_ZYGOTE"


def _entry(python: str, sock: str) -> str:
    """One server in :data:`ZYGOTE_VAR` (:meth:`ForkServer.of_parent` parses it)."""
    return f"{python}{os.pathsep}{sock}"


# -- the server ---------------------------------------------------------------------------


def _reader() -> tuple[str, str]:
    """(file, function) of the code that reads ``os.environ``: the first frame outside
    os.py, the mapping ABCs and comprehensions."""
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        if not (
            code.co_filename.startswith("<frozen")
            or code.co_filename == __file__
            or code.co_filename.endswith(("/os.py", "_collections_abc.py"))
            or code.co_name in ("<genexpr>", "<dictcomp>", "<listcomp>", "<setcomp>")
        ):
            return code.co_filename.replace(os.sep, "/"), code.co_name
        f = f.f_back
    return "?", "?"


def _scan_of(site: tuple[str, str]):
    return next((key for key in SCANS if site[1] == key[1] and site[0].endswith(key[0])), None)


class _Reads(os._Environ):
    """``os.environ`` while the preload imports: records every variable read by name,
    and who read the whole environment."""

    names: set = set()
    scans: set = set()

    def __getitem__(self, key):
        if _scan_of(_reader()) is None:
            _Reads.names.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        if _scan_of(_reader()) is None:
            _Reads.names.add(key)
        return super().__contains__(key)

    def __iter__(self):
        _Reads.scans.add(_reader())
        return super().__iter__()


def _pth_variables() -> set[str]:
    """Variables the ``.pth`` files of this environment read (they run at start)."""
    import site

    names = set()
    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    for d in dirs:
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            if name.endswith(".pth"):
                with open(os.path.join(d, name), errors="replace") as f:
                    names |= set(
                        re.findall(r"environ(?:\.get\(|\[)\s*[\"']([A-Za-z0-9_]+)", f.read())
                    )
    return names


def _native_threads() -> list[str]:
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out.append(f.read().strip())
        except OSError:
            pass
    return out


class _Server:
    def __init__(self, preload: list[str], forbid: list[str], idle_s: float | None = None):
        self.idle_s = idle_s
        self.sock = ""  # its listening socket (main)
        self.env0 = dict(os.environ)
        cwd = os.getcwd()
        self.pythonpath = [
            os.path.abspath(os.path.join(cwd, p))
            for p in self.env0.get("PYTHONPATH", "").split(os.pathsep)
            if p
        ]
        self.base_path = [p for p in sys.path[1:] if p not in self.pythonpath]
        self.startup_names = _pth_variables()
        t0 = time.monotonic()
        os.environ.__class__ = _Reads
        try:
            import importlib

            for name in preload:
                importlib.import_module(name)
        finally:
            os.environ.__class__ = os._Environ
        self.preload_s = time.monotonic() - t0
        self.reads = set(_Reads.names)
        self.scan_prefixes: tuple[str, ...] = ()
        self.unknown_scans = []
        for site in sorted(_Reads.scans):
            key = _scan_of(site)
            if key is None:
                self.unknown_scans.append(":".join(site))
            else:
                self.scan_prefixes += SCANS[key]
        env1 = dict(os.environ)
        # what the imports set or removed: set so in every child too
        self.import_writes = {
            k: env1.get(k) for k in set(env1) | set(self.env0) if env1.get(k) != self.env0.get(k)
        }
        problems = [m for m in sys.modules for f in forbid if m == f or m.startswith(f + ".")]
        if problems:
            raise SystemExit(f"the preload imported modules it must not: {sorted(problems)}")
        import threading

        if threading.enumerate() != [threading.main_thread()]:
            raise SystemExit(f"the preload started Python threads: {threading.enumerate()}")
        tracker = sys.modules.get("multiprocessing.resource_tracker")
        if tracker is not None and getattr(tracker._resource_tracker, "_pid", None):
            raise SystemExit("the preload started multiprocessing's resource tracker")
        self.threads = _native_threads()
        self.running: dict[int, socket.socket | None] = {}

    def info(self, sock: str) -> dict:
        return dict(
            socket=sock,
            pid=os.getpid(),
            preload_s=round(self.preload_s, 2),
            modules=len(sys.modules),
            native_threads=self.threads,
            reads=sorted(self.reads),
            scans=list(self.scan_prefixes),
            unknown_scans=self.unknown_scans,
            import_writes=self.import_writes,
        )

    def refusal(self, req: dict) -> str | None:
        """Why a fresh interpreter would run this child differently; None if it would
        not."""
        import threading

        if self.unknown_scans:
            return (
                "a module of the preload read the whole environment at import from "
                f"{self.unknown_scans} (not in testkit.zygote.SCANS)"
            )
        env = req["env"]
        # A variable the preload's imports set (sglang's cache directories, with
        # setdefault) is the same when the child has the value they set: a caller that
        # imported sglang itself passes them on.
        differ = sorted(
            k
            for k in set(env) | set(self.env0)
            if k != "PYTHONPATH"
            and env.get(k) != self.env0.get(k)
            and not (k in self.import_writes and env.get(k) == self.import_writes[k])
        )
        read_early = [
            k
            for k in differ
            if k in self.reads
            or k in self.startup_names
            or k.startswith(STARTUP)
            or k.startswith(self.scan_prefixes)
        ]
        if read_early:
            return (
                f"{', '.join(read_early)} differ from the fork server's and are read "
                "at interpreter start or while the preload imports"
            )
        if threading.enumerate() != [threading.main_thread()]:
            return f"the fork server runs Python threads: {threading.enumerate()}"
        if len(_native_threads()) > len(self.threads):
            return f"the fork server runs more native threads now: {_native_threads()}"
        return None

    def serve(self, listener: socket.socket) -> None:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.signal(signal.SIGCHLD, lambda *a: None)
        signal.set_wakeup_fd(wake_w)
        self.sel = sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ, "accept")
        sel.register(0, selectors.EVENT_READ, "lifeline")
        sel.register(wake_r, selectors.EVENT_READ, "reap")
        self.listener, self.wake = listener, (wake_r, wake_w)
        while True:
            events = sel.select(self.idle_s if not self.running else None)
            if not events:  # nothing asked for or running for idle_s: give the memory back
                listener.close()
                return
            for key, _ in events:
                if key.data == "accept":
                    conn, _ = listener.accept()
                    self.request(conn)
                elif key.data == "lifeline":
                    if not os.read(0, 4096):  # the caller closed it, or is gone
                        self.stop()
                        return
                elif key.data == "reap":
                    try:
                        while os.read(wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                    self.reap()
                else:
                    self.from_caller(key.fileobj, key.data)

    def request(self, conn: socket.socket) -> None:
        conn.settimeout(60)
        fds: list[int] = []
        try:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
            size = int.from_bytes(data[:_HEADER], "big")
            data = data[_HEADER:]
            while len(data) < size:
                more = conn.recv(size - len(data))
                if not more:
                    raise ConnectionError("the request ended early")
                data += more
            req = json.loads(data)
            why = "stdout and stderr were not passed" if len(fds) != 2 else self.refusal(req)
            if why is not None:
                conn.sendall(json.dumps({"refused": why}).encode() + b"\n")
                conn.close()
                return
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the child: never back into this loop
                status = 70
                try:
                    status = self.child(req, fds, conn)
                except BaseException:
                    import traceback

                    traceback.print_exc()
                finally:
                    os._exit(status)
            self.running[pid] = conn
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            self.sel.register(conn, selectors.EVENT_READ, pid)
        except (OSError, ValueError) as e:
            print(f"zygote: a request failed: {e!r}", file=sys.stderr, flush=True)
            conn.close()
        finally:
            for fd in fds:
                os.close(fd)

    def from_caller(self, conn: socket.socket, pid: int) -> None:
        try:
            data = conn.recv(64)
        except OSError:
            data = b""
        if pid in self.running and (not data or data.startswith(b"kill")):
            # the caller gave up on it (a timeout), or is gone
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not data:
            self.sel.unregister(conn)
            conn.close()
            if self.running.get(pid) is conn:
                self.running[pid] = None  # reaped later, answered to no one

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.running.pop(pid, None)
            if conn is None:
                continue
            try:
                conn.sendall(
                    json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n"
                )
            except OSError:
                pass
            self.sel.unregister(conn)
            conn.close()

    def stop(self) -> None:
        for pid in list(self.running):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in list(self.running):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass

    # -- in the forked child ----------------------------------------------------------------

    def child(self, req: dict, fds: list[int], conn: socket.socket) -> int:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.sel.close()
        for c in [conn, self.listener] + [c for c in self.running.values() if c is not None]:
            c.close()
        for fd in self.wake:
            os.close(fd)
        os.setpgid(0, 0)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (null, *fds):
            os.close(fd)
        env = dict(req["env"])
        mine = _entry(sys.executable, self.sock)  # first: of_parent finds it
        env[ZYGOTE_VAR] = ";".join(
            [mine] + [e for e in env.get(ZYGOTE_VAR, "").split(";") if e and e != mine]
        )
        for k, v in self.import_writes.items():  # what the preload's imports set
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        os.environ.clear()
        os.environ.update(env)
        cwd = req["cwd"]
        os.chdir(cwd)
        kind, target = req["kind"], req["target"]
        path0 = {"code": "", "module": cwd, "script": os.path.dirname(os.path.realpath(target))}[
            kind
        ]
        extra = [
            os.path.abspath(os.path.join(cwd, p))
            for p in env.get("PYTHONPATH", "").split(os.pathsep)
            if p
        ]
        rest = []
        for p in extra + self.base_path:
            if p not in rest:
                rest.append(p)
        sys.path[:] = [path0] + rest
        np = sys.modules.get("numpy")
        if np is not None:
            np.random.seed()  # a fresh interpreter seeds it from the OS
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.random.default_generator.set_state(torch.Generator().get_state())
        return _run_as_main(kind, target, req["args"])


def _run_as_main(kind: str, target: str, args: list[str]) -> int:
    """Run the child's code as ``__main__`` and end as the interpreter ends: the exit
    status."""
    import atexit as _atexit
    import builtins
    import threading
    import types

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    try:
        if kind == "module":
            import runpy

            sys.argv = ["-m", *args]  # runpy puts the module's path first
            runpy._run_module_as_main(target, alter_argv=True)
        else:
            if kind == "code":
                filename, source = "<string>", target
                sys.argv = ["-c", *args]
            else:
                filename = target
                with open(filename, "rb") as f:
                    source = f.read()
                main.__file__ = filename
                sys.argv = [filename, *args]
            exec(compile(source, filename, "exec", dont_inherit=True), main.__dict__)
        status = 0
    except SystemExit as e:
        status = _system_exit_status(e)
    except BaseException as e:
        e = e.with_traceback(e.__traceback__.tb_next)  # this frame left out
        sys.excepthook(type(e), e, e.__traceback__)
        status = -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
    threading._shutdown()
    _atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - as the interpreter: status 120
            status = 120 if status == 0 else status
    if status == -signal.SIGINT:  # the interpreter re-raises SIGINT at its exit
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return status


def _system_exit_status(e: SystemExit) -> int:
    code = e.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    try:
        print(code, file=sys.stderr)
    except Exception:  # noqa: BLE001
        pass
    return 1


def main(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m testkit.zygote")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--forbid", default="")
    ap.add_argument("--idle", type=float, default=None)
    ap.add_argument("preload", nargs="*")
    a = ap.parse_args(argv)
    server = _Server(a.preload, [f for f in a.forbid.split(",") if f], a.idle)
    server.sock = os.path.abspath(a.socket)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(a.socket)
    listener.listen(64)
    print(json.dumps(server.info(a.socket)), flush=True)
    server.serve(listener)
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown of everything the preload imported


# -- the caller's side --------------------------------------------------------------------


def _text(data: bytes) -> str:
    """As ``subprocess`` decodes a text-mode pipe."""
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


class Forked:
    """A child of the fork server, with the parts of ``subprocess.Popen`` that tests
    use: ``pid``, ``args``, ``returncode``, ``poll``, ``wait``, ``communicate`` (text),
    ``kill`` (its whole process group, SIGKILL)."""

    def __init__(
        self,
        args: list[str],
        pid: int,
        conn: socket.socket,
        out_r: int,
        err_r: int,
        reply: bytes = b"",
    ):
        self.args, self.pid, self.returncode = args, pid, None
        self._conn, self._reply = conn, b""
        self._out, self._err = out_r, err_r
        self._data = {out_r: bytearray(), err_r: bytearray()}
        self._open = {out_r, err_r}
        self._sel = selectors.DefaultSelector()
        for fd in self._open:
            self._sel.register(fd, selectors.EVENT_READ)
        self._sel.register(conn, selectors.EVENT_READ)
        self._answer(reply)

    def _answer(self, chunk: bytes) -> None:
        self._reply += chunk
        while b"\n" in self._reply:
            line, self._reply = self._reply.split(b"\n", 1)
            self.returncode = json.loads(line)["status"]

    def _pump(self, timeout: float | None, pipes: bool) -> bool:
        """Read what is ready until the exit status is known (and, with ``pipes``,
        stdout and stderr are closed); False when ``timeout`` s passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None or (pipes and self._open):
            left = None if end is None else max(0.0, end - time.monotonic())
            events = self._sel.select(left)
            if not events and left is not None and left <= 0:
                return False
            for key, _ in events:
                if key.fileobj is self._conn:
                    chunk = self._conn.recv(4096)
                    if not chunk:
                        self._sel.unregister(self._conn)
                        if self.returncode is None:
                            raise RuntimeError(
                                f"the fork server went away while its child {self.pid} ran"
                            )
                        continue
                    self._answer(chunk)
                else:
                    chunk = os.read(key.fd, 1 << 16)
                    if chunk:
                        self._data[key.fd] += chunk
                    else:
                        self._sel.unregister(key.fd)
                        os.close(key.fd)
                        self._open.discard(key.fd)
        return True

    def communicate(self, input=None, timeout: float | None = None):
        if input is not None:
            raise ValueError("a forked child's stdin is /dev/null")
        if not self._pump(timeout, pipes=True):
            raise subprocess.TimeoutExpired(
                self.args,
                timeout,
                output=bytes(self._data[self._out]),
                stderr=bytes(self._data[self._err]),
            )
        return _text(bytes(self._data[self._out])), _text(bytes(self._data[self._err]))

    def poll(self):
        self._pump(0, pipes=False)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._pump(timeout, pipes=False):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL to its process group (the fork server sends it while the child is
        its child: no other process can have that id then)."""
        if self.returncode is None:
            try:
                self._conn.sendall(b"kill\n")
            except OSError:
                pass

    terminate = kill

    def __del__(self):
        for fd in list(self._open):
            os.close(fd)
        self._open.clear()
        self._conn.close()


class _Gone(Exception):
    """The server ended (idle) while a request reached it."""


class ForkServer:
    """The caller's handle on one fork server, started at the first :meth:`spawn`;
    ``preload``: modules it imports (in order); ``forbid``: module names that must not
    be imported then (their submodules too); ``env``: its environment (default: this
    process's); ``cwd``: its working directory; ``idle_s``: it ends after that long
    with no child running and none asked for (its memory given back), and starts again
    at the next :meth:`spawn`; ``python``: its interpreter (default: this one's; the
    children it forks run that environment's).  ``forked``, ``refused`` (reason ->
    count), ``starts`` and ``start_s`` (seconds spent starting it) say what it did;
    ``info`` is what its last start reported (preload seconds, modules, native threads,
    variables read)."""

    def __init__(
        self,
        preload: list[str],
        *,
        forbid: list[str] = (),
        env: dict | None = None,
        cwd: str | Path | None = None,
        idle_s: float | None = 600,
        start_timeout: float = 900,
        python: str | None = None,
    ):
        self.python = str(python or sys.executable)
        self.preload, self.forbid = list(preload), list(forbid)
        self.env, self.cwd, self.idle_s = env, cwd, idle_s
        self.start_timeout = start_timeout
        self.proc = None
        self.info: dict = {}
        self.forked = self.starts = 0
        self.start_s = 0.0
        self.refused: dict[str, int] = {}
        self.attached = False

    @classmethod
    def of_parent(cls, python: str | Path | None = None) -> "ForkServer | None":
        """A handle on the fork server of interpreter ``python`` (default: this one's)
        that this process was forked from, or told of (:data:`ZYGOTE_VAR`): its children
        are forked from the server's clean state.  None: there is none for that
        interpreter, or its socket is gone.  The handle never starts or stops the
        server; when the server ends, :meth:`spawn` returns None."""
        want = str(python or sys.executable)
        for entry in os.environ.get(ZYGOTE_VAR, "").split(";"):
            exe, _, sock = entry.partition(os.pathsep)
            if exe == want and os.path.exists(sock):
                server = cls([], python=want)
                server.attached, server.info = True, {"socket": sock}
                return server
        return None

    @staticmethod
    def variable(*servers: "ForkServer") -> str:
        """The value of :data:`ZYGOTE_VAR` that tells a process of ``servers`` (started
        ones), so that it forks its children of their interpreters there."""
        return ";".join(_entry(s.python, s.info["socket"]) for s in servers)

    def start(self) -> None:
        """Start the server unless it runs; returns once it imported the preload."""
        if self.attached or (self.proc is not None and self.proc.poll() is None):
            return
        self.close()
        self._dir = tempfile.mkdtemp(prefix="testkit-zygote-")
        sock = os.path.join(self._dir, "sock")
        self._log = os.path.join(self._dir, "log")
        t0 = time.monotonic()
        idle = [] if self.idle_s is None else ["--idle", str(self.idle_s)]
        with open(self._log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    self.python,
                    "-m",
                    "testkit.zygote",
                    "--socket",
                    sock,
                    "--forbid",
                    ",".join(self.forbid),
                    *idle,
                    *self.preload,
                ],
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
            )
        if self.starts == 0:
            atexit.register(self.close)
        self.starts += 1
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        ready = sel.select(self.start_timeout)
        sel.close()
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            tail = Path(self._log).read_text(errors="replace")[-4000:]
            self.close()
            raise RuntimeError(
                f"the fork server did not start (in {self.start_timeout:.0f} s at most):\n{tail}"
            )
        self.info = json.loads(line)
        self.start_s += time.monotonic() - t0

    def spawn(self, child) -> Forked | None:
        """Fork ``child`` (a :class:`testkit.child.Child`); None when the server says
        a fresh interpreter would run it differently (``refused`` counts why)."""
        if child.code is not None:
            kind, target = "code", child.code
        elif child.script is not None:
            kind, target = "script", str(child.script)
        else:
            kind, target = "module", child.module
        req = dict(
            kind=kind,
            target=target,
            args=[str(a) for a in child.args],
            env=child.environment(),
            cwd=os.path.abspath(child.cwd),
        )
        data = json.dumps(req).encode()
        data = len(data).to_bytes(_HEADER, "big") + data
        for attempt in (1, 2):
            self.start()
            try:
                return self._spawn(data, [self.python, *child.argv()])
            except _Gone:
                if self.attached:
                    return None  # not ours to start again: a fresh interpreter runs it
                if attempt == 2:
                    raise RuntimeError(
                        f"the fork server ended twice while asked for a child; its log: {self._log}"
                    ) from None

    def _spawn(self, data: bytes, args: list[str]) -> Forked | None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        reply, answer = b"", None
        try:
            try:
                conn.connect(self.info["socket"])
                sent = socket.send_fds(conn, [data], [out_w, err_w])
                if sent < len(data):
                    conn.sendall(data[sent:])
                while b"\n" not in reply:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    reply += chunk
            except (ConnectionError, FileNotFoundError):
                pass
            finally:
                os.close(out_w)
                os.close(err_w)
            if b"\n" not in reply:
                if self.proc is None:  # attached: the server is gone
                    raise _Gone()
                try:  # unanswered: the server ended on its idle time as we asked
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    raise RuntimeError(
                        f"the fork server closed a request without an answer; its log: {self._log}"
                    ) from None
                raise _Gone()
            line, rest = reply.split(b"\n", 1)  # the exit status may follow already
            answer = json.loads(line)
        finally:
            if answer is None or "refused" in answer:
                conn.close()
                os.close(out_r)
                os.close(err_r)
        if "refused" in answer:
            self.refused[answer["refused"]] = self.refused.get(answer["refused"], 0) + 1
            return None
        self.forked += 1
        return Forked(args, answer["pid"], conn, out_r, err_r, rest)

    def close(self) -> None:
        """Stop the server (it kills the children still running) and remove its
        socket's folder."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        try:
            proc.stdin.close()
            proc.wait(60)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        proc.stdout.close()
        shutil.rmtree(self._dir, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
