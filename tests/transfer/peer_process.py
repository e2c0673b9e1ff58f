"""A NixlEngine in a process of its own, the NIXL target of the in-flight test of
tests/transfer/test_engine_contract.py (started with the 'spawn' context, so this module
imports nothing from pytest).

Protocol over a multiprocessing Pipe:
    child -> parent   local_metadata() of its engine (one registration "buf" of nbytes)
    child -> parent   ("landed", notif, sha256 hex of buf) for each write notification,
                      computed when the notification arrives
    parent -> child   "quit" (through the pipe)

The process ends through kvmem.transfer.nixl_exit.process_body: exit status 0 after its
engine closed, without the native destructors that crash on a host with RDMA libraries.
"""

from __future__ import annotations

import hashlib
import time


def serve(name: str, nbytes: int, conn, deadline_s: float = 60.0) -> None:
    from kvmem.transfer.nixl_exit import process_body

    with process_body():
        _serve(name, nbytes, conn, deadline_s)


def _serve(name: str, nbytes: int, conn, deadline_s: float) -> None:
    import torch

    from kvmem.transfer import NixlEngine

    eng = NixlEngine(name)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    eng.register("buf", [(buf.data_ptr(), nbytes)], 0)
    conn.send(eng.local_metadata())
    end = time.monotonic() + deadline_s
    try:
        while time.monotonic() < end:
            for _, msgs in eng.get_notifs().items():
                for m in msgs:
                    conn.send(("landed", m, hashlib.sha256(buf.numpy().tobytes()).hexdigest()))
            if conn.poll(0.002) and conn.recv() == "quit":
                break
    finally:
        eng.close(timeout=5.0)
