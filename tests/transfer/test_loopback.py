"""What only the loopback engine (kvmem.transfer.loopback) promises: its knobs (settle_polls,
landing), its faults (freeze/thaw, fail_next), its fabric (names, other fabrics and
processes, memory an agent never registered), host memory only, a copy into memory that
is gone failing the write instead of the process, and a second thread reading a peer's
notifications.  The rules it shares with NIXL are tests/transfer/test_engine_contract.py."""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing as mp
import threading

import numpy as np
import pytest
import torch

from kvmem.transfer import MetadataError, TransferError, TransferInFlightError
from kvmem.transfer.envelope import decode_metadata, encode_metadata
from kvmem.transfer.loopback import LoopbackEngine
from kvmem.transfer.loopback_fabric import LoopbackFabric, default_fabric


@pytest.fixture
def fabric():
    return LoopbackFabric()


def pair(fabric, nbytes: int = 1 << 16, **kw):
    """Engines ``a`` (a ``src`` buffer of random bytes, registered "src") and ``b`` (a
    zeroed ``dst``, registered "dst"), each knowing the other: ``(a, b, src, dst, remote)``."""
    a = LoopbackEngine("a", fabric=fabric, **kw)
    b = LoopbackEngine("b", fabric=fabric, **kw)
    src = torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    a.register("src", [(src.data_ptr(), nbytes)], 0)
    b.register("dst", [(dst.data_ptr(), nbytes)], 0)
    remote = a.add_peer(b.local_metadata())["dst"]
    b.add_peer(a.local_metadata())
    return a, b, src, dst, remote


def write(a, src, remote, off: int, n: int, notif: bytes = b""):
    return a.post_write(
        [(src.data_ptr() + off, n)], remote, [(remote.regions[0][0] + off, n)], notif
    )


def test_the_process_fabric_copies_with_process_vm_calls(fabric):
    assert fabric.copier == "process_vm"
    assert default_fabric() is default_fabric() and default_fabric().copier == "process_vm"


def test_settle_polls_and_the_notification_at_the_settling_poll(fabric):
    a, b, src, dst, remote = pair(fabric, settle_polls=3)
    h = write(a, src, remote, 0, 4096, b"n")
    assert torch.equal(dst[:4096], src[:4096])  # landing="post": inside the post
    assert [a.poll(h), b.get_notifs(), a.poll(h), b.get_notifs()] == ["PROC", {}, "PROC", {}]
    assert a.poll(h) == "DONE" and b.get_notifs() == {"a": [b"n"]}
    a.release(h)
    with pytest.raises(ValueError, match="settle_polls must be an int >= 1"):
        LoopbackEngine("c", fabric=fabric, settle_polls=0)
    with pytest.raises(ValueError, match="landing must be"):
        LoopbackEngine("c", fabric=fabric, landing="never")
    assert fabric.agents() == ["a", "b"]  # the refused ones opened nothing


def test_landing_at_settle_moves_the_bytes_at_the_settling_poll(fabric):
    a, b, src, dst, remote = pair(fabric, landing="settle", settle_polls=2)
    h = write(a, src, remote, 0, 4096, b"late")
    assert a.poll(h) == "PROC" and not dst[:4096].any()
    assert a.poll(h) == "DONE" and torch.equal(dst[:4096], src[:4096])
    # cancelled in flight: its bytes never land, its notification is never delivered
    h2 = write(a, src, remote, 4096, 4096, b"cancelled")
    a.release(h2, abort=True)
    assert h2.state == "ERR" and not dst[4096:8192].any()
    a.release(h)
    assert b.get_notifs() == {"a": [b"late"]}


def test_freeze_holds_writes_and_notifications_until_thaw(fabric):
    a, b, src, dst, remote = pair(fabric)
    b.freeze()
    assert b.frozen
    h = write(a, src, remote, 0, 4096, b"w")
    a.send_notif("b", b"hello")
    for _ in range(5):
        assert a.poll(h) == "PROC"
        assert b.get_notifs() == {}
    with pytest.raises(TransferInFlightError):
        a.drain(timeout=0.05)
    b.thaw()
    assert a.drain(timeout=1.0) == [h] and h.state == "DONE"
    assert b.get_notifs() == {"a": [b"hello", b"w"]}  # arrival order
    a.release(h)
    # a frozen initiator progresses nothing either
    a.freeze()
    h = write(a, src, remote, 0, 16)
    assert a.poll(h) == "PROC"
    a.thaw()
    assert a.poll(h) == "DONE"
    a.release(h)


def test_fail_next_at_post_and_at_poll(fabric):
    a, b, src, dst, remote = pair(fabric)
    a.fail_next(at="post", reason="no route")
    with pytest.raises(TransferError, match="no route"):
        write(a, src, remote, 0, 4096, b"x")
    assert a.open_handles() == 0 and a.pending_faults() == 0 and not dst.any()
    a.fail_next(2, reason="wire cut")
    assert a.pending_faults() == 2
    h1, h2 = write(a, src, remote, 0, 4096, b"one"), write(a, src, remote, 4096, 4096, b"two")
    h3 = write(a, src, remote, 8192, 4096, b"three")
    assert [a.poll(h) for h in (h1, h2, h3)] == ["ERR", "ERR", "DONE"]
    assert "wire cut" in h1.error and "wire cut" in h2.error
    assert not dst[:8192].any() and torch.equal(dst[8192:12288], src[8192:12288])
    assert b.get_notifs() == {"a": [b"three"]}
    for h in (h1, h2, h3):
        a.release(h)
    # a post the engine itself refuses does not use an injected failure
    a.fail_next(at="post")
    with pytest.raises(ValueError):
        a.post_write([(src.data_ptr(), 8)], remote, [(remote.regions[0][0], 4)])
    assert a.pending_faults() == 1
    for bad in (dict(at="later"), dict(count=0)):
        with pytest.raises(ValueError):
            a.fail_next(**bad)


def test_a_write_into_memory_that_is_gone_is_err_not_a_crash(fabric):
    """The target unmaps memory it had registered; a write built from the sections the
    initiator loaded (no revocation) reaches it: the copy fails (EFAULT), the write is
    ERR, the process lives on."""
    a = LoopbackEngine("a", fabric=fabric)
    b = LoopbackEngine("b", fabric=fabric)
    src = torch.ones(4096, dtype=torch.uint8)
    a.register("src", [(src.data_ptr(), 4096)], 0)
    m = mmap.mmap(-1, 1 << 16)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    b.register("dst", [(addr, 1 << 16)], 0)
    remote = a.add_peer(b.local_metadata())["dst"]
    b.deregister("dst")
    m.close()  # unmapped (nothing else refers to it)
    native, state = a._t_post(
        np.array([[src.data_ptr(), 4096]], dtype=np.int64),
        a.registrations()["src"],
        np.array([[addr, 4096]], dtype=np.int64),
        remote,
        b"",
    )
    with pytest.raises(TransferError, match="Bad address"):
        a._t_state(native)
    a._t_release(native)


def test_host_memory_only(fabric):
    a = LoopbackEngine("a", fabric=fabric)
    with pytest.raises(TransferError, match="host memory only"):
        a.register("gpu", [(1 << 20, 4096)], 0, device="cuda:0")
    assert a.registrations() == {} and a.open_registrations() == 0


def test_names_other_fabrics_and_memory_never_registered(fabric):
    a = LoopbackEngine("a", fabric=fabric)
    with pytest.raises(TransferError, match="an open loopback agent of that name"):
        LoopbackEngine("a", fabric=fabric)
    other = LoopbackEngine("b", fabric=LoopbackFabric())
    with pytest.raises(MetadataError, match="another process or fabric"):
        a.add_peer(other.local_metadata())
    b = LoopbackEngine("b", fabric=fabric)
    buf = torch.zeros(4096, dtype=torch.uint8)
    b.register("buf", [(buf.data_ptr(), 4096)], 0)
    header, blob = decode_metadata(b.local_metadata())
    forged = blob.replace(str(buf.data_ptr()).encode(), str(buf.data_ptr() + 8192).encode())
    with pytest.raises(MetadataError, match="never registered"):
        a.add_peer(encode_metadata(header, forged))
    assert a.peers() == []
    a.add_peer(b.local_metadata())
    b.close()
    assert fabric.agents() == ["a"]
    LoopbackEngine("b", fabric=fabric).close()  # a closed agent's name is free again
    other.close()
    a.close()


def _child_add_peer(md, q) -> None:
    a = LoopbackEngine("child")
    try:
        a.add_peer(md)
        q.put("loaded")
    except MetadataError as e:
        q.put(str(e))


def test_an_agent_of_another_process_is_refused():
    b = LoopbackEngine("parent-side")
    try:
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_child_add_peer, args=(b.local_metadata(), q))
        p.start()
        got = q.get(timeout=60)
        p.join(60)
        assert "another process or fabric" in got
    finally:
        b.close()


def test_another_thread_may_read_a_peers_notifications(fabric):
    a, b, src, dst, remote = pair(fabric)
    got, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            got.extend(b.get_notifs().get("a", []))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(200):
            h = write(a, src, remote, (i % 16) * 4096, 4096, b"%d" % i)
            while a.poll(h) == "PROC":
                pass
            a.release(h)
    finally:
        stop.set()
        t.join()
    got.extend(b.get_notifs().get("a", []))
    assert got == [b"%d" % i for i in range(200)]
    assert torch.equal(dst, src)


def test_states_are_xferstate_and_an_unknown_transport_state_is_err(fabric):
    """``poll`` gives an :class:`XferState` (equal to NIXL's strings); a state the
    transport names that is not one of them ends the write ERR, saying which."""
    from kvmem.transfer import XferState

    a, b, src, dst, remote = pair(fabric, settle_polls=2)
    h = write(a, src, remote, 0, 4096)
    assert h.state is XferState.PROC and a.poll(h) is XferState.PROC
    a._t_state = lambda native: "WEIRD"
    assert a.poll(h) is XferState.ERR and h.error == "unknown transport state 'WEIRD'"
    a.release(h)
