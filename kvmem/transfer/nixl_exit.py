"""How a process that loaded NIXL ends: its Python exit, without the native destructors
that crash on an RDMA host.

The defect (nixl-cu12 1.5.1, UCX backend; docs/transfer.md, "Process exit"): with Debian's
``libibverbs1`` and ``ibverbs-providers`` installed, every process that created a NIXL
agent died of SIGSEGV at interpreter exit, after an orderly close.  The wheel's UCX module
``libuct_ib_efa`` needs ``libefa.so.1``, which the wheel does not bundle; the system's
(from ``ibverbs-providers``) loads the system's ``libibverbs.so.1`` and with it a second
libnl (``libnl-route-3.so.200``) beside the wheel's bundled one, and at exit ``_dl_fini``
runs a libnl destructor (``rtnl_tc_unregister`` in the bundled ``libnl-route-3``) that
crashes.  Nothing in Python avoids it (``del agent``, the UCX_TLS / UCX_NET_DEVICES /
UCX_IB_ENABLE / RDMAV_DRIVERS / IBV_CONFIG_DIR settings); leaving with ``os._exit`` does.

So a process that loaded NIXL closes it in order (deregister, release its transfer
handles: :meth:`TransferEngine.close`), reports, and then leaves through :func:`finish`
(or :func:`end_process`): Python's own exit work runs (``atexit`` handlers: logging's
flush, multiprocessing's clean-up of child processes, ``weakref.finalize``), stdout and
stderr are flushed, and ``os._exit`` skips the C library's exit handlers and the shared
libraries' destructors.  What that skips: waiting for non-daemon threads, the module
teardown's ``__del__`` methods and the destructors of native objects still alive (a NIXL
agent not closed: its threads end with the process), and buffered data of files nobody
closed.

Who calls it: the ``kvmem demo`` workers (:mod:`kvmem.demo.worker`; the demo's parent
never loads NIXL), scripts or multiprocessing targets through :func:`process_body`, and
the repository's pytest runs through its test kit's wrapper of :func:`finish`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import NoReturn

# The importable names of NIXL's Python API (kvmem.transfer.nixl.import_nixl tries these).
NIXL_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")


def nixl_loaded() -> bool:
    """Whether this process imported one of :data:`NIXL_MODULES` (an agent's native
    libraries come with it)."""
    return any(name in sys.modules for name in NIXL_MODULES)


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing left to save
            pass


def end_process(status: int) -> NoReturn:
    """End this process now with exit status ``status`` (0-255): Python's ``atexit``
    handlers run (logging is flushed and shut down there), then stdout and stderr are
    flushed, then ``os._exit(status)``: no C-level exit handler and no shared library's
    destructor runs.  Call it after closing NIXL in order and after the last report."""
    _flush_stdio()
    try:
        atexit._run_exitfuncs()  # the handlers a normal exit runs, in the same order
    finally:
        _flush_stdio()
        os._exit(status)


def finish(status: int) -> int:
    """:func:`end_process` with ``status`` when NIXL was loaded in this process; else
    ``status``, for the caller's normal exit (``sys.exit(finish(main()))``)."""
    if nixl_loaded():
        end_process(status)
    return status


@contextlib.contextmanager
def process_body():
    """The body of a process that may load NIXL: a script's ``if __name__ ==
    "__main__":`` or a multiprocessing target.  Leaving the block ends the process through
    :func:`finish`: status 0 when it ends normally, the code of a ``SystemExit`` with an
    int code (or None: 0); any other exception, a ``SystemExit`` with a message included,
    goes to ``sys.excepthook`` (what the interpreter calls for an uncaught exception: the
    traceback on stderr) and the status is 1::

        if __name__ == "__main__":
            with process_body():
                main()
    """
    try:
        yield
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            sys.excepthook(type(e), e, e.__traceback__)
        status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException as e:  # noqa: BLE001 - reported as the interpreter would, then 1
        sys.excepthook(type(e), e, e.__traceback__)
        status = 1
    else:
        status = 0
    sys.exit(finish(status))
