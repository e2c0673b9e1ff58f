"""The loopback fabric: the wire between the loopback agents of one process.

Contract: a :class:`LoopbackFabric` holds the open agents by name (one open agent a name),
what each ever registered, each one's notification inbox, and one lock over all of it;
:func:`default_fabric` is the process's own (a new one in a forked child).  Its copier
moves the bytes of paired ranges by ``process_vm_writev`` / ``process_vm_readv`` on this
process (a failed copy is an error string, never a crash), or by ``memmove`` where those
system calls are refused.  What the engine promises over it:
:mod:`kvmem.transfer.loopback`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import os
import threading
import uuid
from dataclasses import dataclass, field

import numpy as np

from kvmem.transfer.errors import TransferError

NOT_FOUND = "LOOPBACK_ERR_NOT_FOUND"
DISCONNECT = "LOOPBACK_ERR_REMOTE_DISCONNECT"
_IOV_MAX = 1024  # iovecs per process_vm_* call (Linux IOV_MAX)


# --- copying ---------------------------------------------------------------------------------


class _Copier:
    """Copies paired ranges of this process: ``process_vm_writev``/``readv`` on its own pid
    (a failure is an error string, never a crash), or ``memmove`` where the system calls
    are refused."""

    def __init__(self) -> None:
        self.kind = "memmove"
        self._pid = os.getpid()
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fns = libc.process_vm_writev, libc.process_vm_readv
        except (OSError, AttributeError):
            return
        for f in fns:
            f.restype = ctypes.c_ssize_t
            f.argtypes = (
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_ulong,
                ctypes.c_void_p,
                ctypes.c_ulong,
                ctypes.c_ulong,
            )
        self._writev, self._readv = fns
        src, dst = np.arange(8, dtype=np.uint8), np.zeros(8, dtype=np.uint8)
        if self._vm(
            self._writev,
            np.array([[src.ctypes.data, 8]], dtype=np.uint64),
            np.array([[dst.ctypes.data, 8]], dtype=np.uint64),
        ) is None and np.array_equal(src, dst):
            self.kind = "process_vm"

    def _vm(self, fn, local: np.ndarray, remote: np.ndarray) -> str | None:
        for i in range(0, local.shape[0], _IOV_MAX):
            lv = np.ascontiguousarray(local[i : i + _IOV_MAX])
            rv = np.ascontiguousarray(remote[i : i + _IOV_MAX])
            want = int(lv[:, 1].sum())
            got = fn(self._pid, lv.ctypes.data, lv.shape[0], rv.ctypes.data, rv.shape[0], 0)
            if got != want:
                err = ctypes.get_errno()
                return (
                    f"{os.strerror(err) if got < 0 else 'partial copy'} ({got} of {want} "
                    f"bytes of ranges {i}..{i + lv.shape[0] - 1})"
                )
        return None

    def copy(self, op: str, local: np.ndarray, remote: np.ndarray) -> str | None:
        """WRITE: local -> remote; READ: remote -> local.  ``[n, 2]`` (addr, nbytes) rows
        paired one to one (equal lengths).  None, or why the copy failed."""
        lv, rv = local.astype(np.uint64), remote.astype(np.uint64)
        if self.kind == "process_vm":
            # process_vm_writev(pid, local=from, remote=to); readv(pid, local=to, remote=from)
            return self._vm(self._writev if op == "WRITE" else self._readv, lv, rv)
        src, dst = (lv, rv) if op == "WRITE" else (rv, lv)
        for (s, n), (d, _) in zip(src.tolist(), dst.tolist()):
            ctypes.memmove(d, s, n)
        return None


# --- the fabric --------------------------------------------------------------------------------


@dataclass(eq=False)
class Agent:
    name: str
    number: int
    frozen: bool = False
    closed: bool = False
    live: dict = field(default_factory=dict)  # native registration id -> ((addr, n), ...)
    ever: set = field(default_factory=set)  # every (addr, n) it registered
    inbox: list = field(default_factory=list)  # (sender name, msg), arrival order


class LoopbackFabric:
    """The wire between the loopback agents of one process: the open agents by name, what
    each ever registered, each one's notification inbox, and one lock over all of it.  An
    engine holds its name until it is closed (one dropped unclosed keeps it).

    ``copier``: ``"process_vm"`` (failures of a copy are errors) or ``"memmove"`` (the
    system calls were refused here: a copy into unmapped memory crashes the process)."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex
        self.pid = os.getpid()
        self.lock = threading.RLock()
        self._agents: dict[str, Agent] = {}
        self._numbers = itertools.count(1)
        self._copier = _Copier()

    @property
    def copier(self) -> str:
        return self._copier.kind

    def agents(self) -> list[str]:
        """Names of the open agents."""
        with self.lock:
            return sorted(self._agents)

    def _open(self, name: str) -> Agent:
        with self.lock:
            if name in self._agents:
                raise TransferError(
                    f"LoopbackEngine {name!r}: an open loopback agent of that "
                    "name exists in this fabric; close it first"
                )
            a = Agent(name, next(self._numbers))
            self._agents[name] = a
            return a

    def _close(self, agent: Agent) -> None:
        with self.lock:
            agent.closed = True
            agent.inbox.clear()
            if self._agents.get(agent.name) is agent:
                del self._agents[agent.name]

    def _find(self, name: str, number: int) -> Agent | None:
        a = self._agents.get(name)
        return a if a is not None and a.number == number else None


_DEFAULT: LoopbackFabric | None = None
_DEFAULT_LOCK = threading.Lock()


def default_fabric() -> LoopbackFabric:
    """The process's fabric (a new one in a forked child: agents do not cross processes)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None or _DEFAULT.pid != os.getpid():
            _DEFAULT = LoopbackFabric()
        return _DEFAULT
