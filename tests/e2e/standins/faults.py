"""Faults a test arms in one running server, each made by the real Mooncake transfer
engine refusing a call, not by a replaced function.  Loaded by ``sitecustomize.py`` in
every server process when sglang imports its Mooncake wrapper
(``sglang/srt/distributed/device_communicators/mooncake_transfer_engine.py``); inert
until a test writes a file named after a fault into the server's fault folder
(``KVMEM_E2E_FAULTS``; ``tests/e2e/deploy.py`` ``Server.arm``).  A fault fires once, at
the next call it names, removes its file and notes what the engine returned in
``fired.log`` in the same folder (``fault:<name> <code> ...``).

* ``register-overlap``: the next ``batch_register`` of the KV regions (a resume's) is
  refused by the engine: just before it, 4 KiB at the first region's address is
  registered on its own, and the engine refuses any region that overlaps a registered
  one ("Transfer Engine does not support overlapped memory region", -7; measured here:
  a batch with one overlapping region registers none).  The 4 KiB is deregistered again
  afterwards, so a second resume can succeed.
* ``deregister-missing``: the next ``batch_deregister`` (a release's) is refused: just
  before it, the first region it names is deregistered on its own, and the engine
  answers -3 for a region it does not hold.  (In a batch of several regions it also
  drops the others half-way, so that they can be neither deregistered nor registered
  again: the adapter deregisters one region per call for that reason.)
* ``aux-unregister`` / ``aux-restore`` (a decode): the registered regions that hold the
  decode's aux (metadata) buffers are deregistered from its engine at once (a thread of
  the scheduler process watches the folder every 0.1 s), and registered again by the
  second.  In between, a prefill's KV writes into the decode still land, and the last
  write of each request, its aux data (``mooncake/conn.py`` ``send_aux``), is refused by
  the decode's engine: the failure of a request's last send that slime's patch handles
  ("extra state ... ``ret != 0``"), made on the wire's far end.
"""

from __future__ import annotations

import os
import threading
import time
import weakref

FOLDER_ENV = "KVMEM_E2E_FAULTS"
FAULTS = ("register-overlap", "deregister-missing", "aux-unregister", "aux-restore")
WATCH_S = 0.1
_PROBE = 4096


def _take(name: str) -> bool:
    """True once per file the test wrote: the fault is armed, and now disarmed."""
    folder = os.environ.get(FOLDER_ENV)
    if not folder:
        return False
    try:
        os.remove(os.path.join(folder, name))
    except FileNotFoundError:
        return False
    return True


def _fired(line: str) -> None:
    with open(os.path.join(os.environ[FOLDER_ENV], "fired.log"), "a") as f:
        f.write(line + "\n")


def apply(module) -> bool:
    cls = getattr(module, "MooncakeTransferEngine", None)
    if cls is None or getattr(cls, "_kvmem_e2e_faults", False):
        return False
    register, deregister = cls.batch_register, cls.batch_deregister

    def batch_register(self, ptrs, lengths):
        if not ptrs or not _take("register-overlap"):
            return register(self, ptrs, lengths)
        probe = self.engine.register_memory(ptrs[0], _PROBE)
        code = register(self, ptrs, lengths)
        undo = self.engine.unregister_memory(ptrs[0]) if probe == 0 else None
        _fired(f"fault:register-overlap {code} (probe {probe}, undone {undo})")
        return code

    def batch_deregister(self, ptrs):
        if not ptrs or not _take("deregister-missing"):
            return deregister(self, ptrs)
        first = self.engine.unregister_memory(ptrs[0])
        code = deregister(self, ptrs)
        _fired(f"fault:deregister-missing {code} (first region alone {first})")
        return code

    cls.batch_register, cls.batch_deregister = batch_register, batch_deregister
    cls._kvmem_e2e_faults = True
    return True


_MANAGERS: "weakref.WeakSet" = weakref.WeakSet()
_DROPPED: list[tuple[object, int, int]] = []  # (manager, region address, bytes)
_WATCHING = threading.Lock()


def _aux_regions(manager) -> list[tuple[int, int]]:
    """The registered regions (``_registerable_regions``, as the manager registers them)
    that hold one of the manager's aux buffers."""
    aux = list(manager.kv_args.aux_data_ptrs or [])
    return [(p, n) for p, n in manager._registerable_regions() if any(p <= a < p + n for a in aux)]


def _watch() -> None:
    while True:
        time.sleep(WATCH_S)
        if _take("aux-unregister"):
            codes = []
            for m in list(_MANAGERS):
                for p, n in _aux_regions(m):
                    codes.append(m.engine.engine.unregister_memory(p))
                    _DROPPED.append((m, p, n))
            _fired(f"fault:aux-unregister {codes}")
        if _take("aux-restore"):
            codes = [m.engine.engine.register_memory(p, n) for m, p, n in _DROPPED]
            _DROPPED.clear()
            _fired(f"fault:aux-restore {codes}")


def apply_managers(module) -> bool:
    """Track the decode's ``MooncakeKVManager`` and watch the folder for the aux faults."""
    cls = getattr(module, "MooncakeKVManager", None)
    if cls is None or getattr(cls, "_kvmem_e2e_faults", False) or not os.environ.get(FOLDER_ENV):
        return False
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if str(getattr(self.disaggregation_mode, "value", "")) == "decode":
            _MANAGERS.add(self)
            if _WATCHING.acquire(blocking=False):
                threading.Thread(target=_watch, name="kvmem-e2e-faults", daemon=True).start()

    cls.__init__ = __init__
    cls._kvmem_e2e_faults = True
    return True
