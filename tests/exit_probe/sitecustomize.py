"""How a process ends, probed.  With this directory on PYTHONPATH every Python process
imports this module at start-up (``site`` imports ``sitecustomize``) and reads
``KVMEM_EXIT_PROBE``, comma-separated items ``WHAT`` or ``WHAT@NAME``:

* ``abort``: a C-level exit handler that aborts (``__cxa_atexit(abort)``): ``exit()``
  runs it after Python's finalization, where it also runs the shared libraries'
  destructors that crash on an RDMA host.  The process ends with its own status only if
  it leaves by ``os._exit``; a normal exit ends in SIGABRT.
* ``segv``: a Python exit handler (``atexit``, registered first, so it runs last) kills
  the process with SIGSEGV: a crash at its exit, after everything it reported.

``@NAME`` limits an item to the multiprocessing child of that name (the demo's workers
are ``kvmem-demo-prefill`` and ``kvmem-demo-decode``); the name is known only once the
child runs, so such an item acts from the Python exit handler (``abort``: armed there,
before the C-level exit handlers).  Without ``@NAME`` it acts in every process.
"""

import atexit
import ctypes
import os
import signal
import sys

_ITEMS = [
    tuple((w + "@").split("@")[:2]) for w in os.environ.get("KVMEM_EXIT_PROBE", "").split(",") if w
]
_LIBC = ctypes.CDLL(None)


def _arm_abort() -> None:
    _LIBC.__cxa_atexit.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    if _LIBC.__cxa_atexit(ctypes.cast(_LIBC.abort, ctypes.c_void_p), None, None) != 0:
        raise RuntimeError("exit probe: __cxa_atexit refused the handler")


def _at_exit() -> None:
    mp = sys.modules.get("multiprocessing")
    name = mp.current_process().name if mp is not None else None
    mine = {what for what, where in _ITEMS if where in ("", name)}
    sys.stdout.flush()
    sys.stderr.flush()
    if ("abort", name) in _ITEMS:
        _arm_abort()
    if "segv" in mine:
        os.kill(os.getpid(), signal.SIGSEGV)


if _ITEMS:
    if ("abort", "") in _ITEMS:
        _arm_abort()
    atexit.register(_at_exit)
