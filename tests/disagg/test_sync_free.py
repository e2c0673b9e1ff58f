"""The CPU half of sync-freedom: the sides' hot path never converts a device tensor to the
host.  On CUDA each such conversion (``int(t)``, ``.tolist()``, ``.cpu().numpy()``,
``torch.equal``, ...) waits for the device; tests/gpu/test_gpu_disagg.py runs the sides in
CUDA sync-debug mode for the same lifecycle.  Here there is no device, so the check tracks
which tensors *are* device tensors on a GPU (the pools, the staging and landing buffers,
what the allocators hand out, the stand-in's verdicts, and everything torch computes from
them) and records every conversion of one made by the sides' own code
(kvmem/disagg/prefill*.py, decode*.py, device.py, ledger.py, peers.py, counters.py,
outcome.py, protocol.py, arena.py) while both sides run
whole lifecycles in every transfer mode.  The sanctioned way to the host is
``device.HostCopy`` (a non-blocking copy and an event on CUDA, polled, never waited on);
``Ledger.audit`` runs in a pause only (which waits for the device by design)."""

from __future__ import annotations

import os
import sys
import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import kvmem
from kvmem.disagg import KVPoll
from kvmem.disagg import device as D
from kvmem.disagg.ledger import Ledger
from tests.disagg.harness import Pair

_T = torch.Tensor
# Calls that read a tensor's values on the host: on CUDA each waits for the device.
CONVERSIONS = {
    _T.item,
    _T.tolist,
    _T.numpy,
    _T.cpu,
    _T.__int__,
    _T.__index__,
    _T.__bool__,
    _T.__float__,
    _T.__array__,
    _T.__format__,
    _T.__repr__,
    torch.equal,
    _T.equal,
    _T.nonzero,
    torch.nonzero,
    torch.unique,
    _T.unique,
    torch.masked_select,
    _T.masked_select,
    torch.allclose,
    _T.allclose,
}
DISAGG = os.path.dirname(os.path.abspath(D.__file__))
SCOPE = {
    os.path.join(DISAGG, f)
    for f in (
        "prefill.py",
        "prefill_send.py",
        "prefill_peers.py",
        "prefill_messages.py",
        "requests.py",
        "dispatch.py",
        "decode.py",
        "decode_peers.py",
        "decode_memory.py",
        "device.py",
        "ledger.py",
        "peers.py",
        "counters.py",
        "outcome.py",
        "protocol.py",
        "arena.py",
    )
}
# Where the sides may read device values: the asynchronous host copy, and the audit of a
# pause (docs/disagg.md: a pause waits for the device anyway).
ALLOWED = {D.HostCopy.__init__.__code__, D.HostCopy.numpy.__code__, Ledger.audit.__code__}
TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _is_cpu(args, kwargs) -> bool:
    """``Tensor.to(...)`` / ``copy_`` towards the host."""
    for a in list(args[1:]) + list(kwargs.values()):
        if isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu":
            return True
    return False


class DeviceReads(TorchFunctionMode):
    """Taint tracking of device tensors: ``mark`` the roots; every tensor a torch call
    computes from a marked one is marked too (views, slices, arithmetic, in-place
    results); a conversion of a marked tensor made from a file of SCOPE, outside
    ALLOWED, is recorded in ``reads`` as ``(call, file:line)``."""

    def __init__(self):
        super().__init__()
        self._marked: dict[int, weakref.ref] = {}
        self.reads: list[tuple[str, str]] = []

    def mark(self, t) -> None:
        if isinstance(t, torch.Tensor):
            self._marked[id(t)] = weakref.ref(t)

    def marked(self, t) -> bool:
        ref = self._marked.get(id(t))
        return ref is not None and ref() is t

    def _caller(self):
        f = sys._getframe(2)
        while f is not None and f.f_code.co_filename.startswith(TORCH):
            f = f.f_back
        return f

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        tainted = any(self.marked(x) for x in flat)
        if tainted and (func in CONVERSIONS or (func in (_T.to,) and _is_cpu(args, kwargs))):
            f = self._caller()
            if f is not None and f.f_code.co_filename in SCOPE and f.f_code not in ALLOWED:
                name = getattr(func, "__name__", str(func))
                self.reads.append(
                    (
                        name,
                        f"{os.path.basename(f.f_code.co_filename)}:"
                        f"{f.f_lineno} ({f.f_code.co_name})",
                    )
                )
        out = func(*args, **kwargs)
        if tainted:
            for x in tree_flatten(out)[0]:
                self.mark(x)
        return out


def _mark_results(mode: DeviceReads, obj, names) -> None:
    """Wrap ``obj``'s methods ``names`` (the real calls) so that what they return is marked."""
    for name in names:
        real = getattr(obj, name)

        def marked(*a, _real=real, **k):
            out = _real(*a, **k)
            mode.mark(out)
            return out

        setattr(obj, name, marked)


def watch(pair: Pair, mode: DeviceReads) -> None:
    """Mark what lives on the device on a GPU: both pools, the staging and landing
    buffers, and from now on every page id the allocators hand out and every verdict of
    the stand-in's checks."""
    for side in (pair.prefill, pair.decode):
        pool = side.pool
        for t in [pool._mem.tensor] + pool._k_buffer + pool._v_buffer:
            mode.mark(t)
        _mark_results(mode, side.alloc, ("alloc", "alloc_extend", "alloc_decode"))
    mode.mark(pair.prefill.staging.tensor)
    mode.mark(pair.decode.memory.landing)
    _mark_results(mode, pair.synth, ("verify", "verify_pages"))


def lifecycle(pair: Pair) -> None:
    """Every way through both sides' lifecycles, short of a pause: delivered requests
    (whole and partial chunks), aborts in each prefill state and inside the running batch,
    bootstrap and transfer timeouts, failed sends (a chunk, the extra state), a
    decode-side abort (quarantine) and a decode timeout."""
    pre, dec, f = pair.prefill, pair.decode, pair.faults
    for rid, n in ((1, 200), (2, 17), (3, 64)):
        pre.add_request(rid, n)
    f.withhold.add(10)
    pre.add_request(10, 50)
    f.stall_at[11] = 0
    pre.add_request(11, 100)
    f.stall_at[12] = 1
    pre.add_request(12, 200)
    f.abort_in_batch.add(13)
    pre.add_request(13, 100)
    f.fail_at[14] = 1
    pre.add_request(14, 200)
    f.fail_at[15] = "aux"
    pre.add_request(15, 70)
    f.stall_at[16] = 1
    pre.add_request(16, 200)
    pair.run_until(
        lambda: (
            pre.state(11) == KVPoll.WaitingForInput
            and pre.state(12) == KVPoll.Transferring
            and pre.state(16) == KVPoll.Transferring
            and 10 in dec.reqs
        )
    )
    pre.abort(10)  # Bootstrapping
    pre.abort(11)  # WaitingForInput
    pre.abort(12)  # Transferring
    dec.abort(16)  # decode side: quarantined until the prefill's ABORT
    pair.run_until(lambda: all(r in pair.finished for r in (1, 2, 3, 10, 11, 12, 13, 14, 15, 16)))
    f.withhold.add(20)
    pre.add_request(20, 30)  # bootstrap timeout
    f.stall_at[21] = 1
    pre.add_request(21, 200)  # transfer timeout
    pair.run_until(
        lambda: pre.state(21) == KVPoll.Transferring and not pre.reqs[21].handles and 20 in dec.reqs
    )  # chunk 0 delivered (pull: PULLED), chunk 1 held
    pair.clock.advance(31)
    pair.run_until(lambda: 20 in pair.finished and 21 in pair.finished)
    f.stall_at[22] = 0
    pre.add_request(22, 40)  # the decode's own timeout (no news for 60 s)
    pair.run_until(lambda: pre.state(22) == KVPoll.WaitingForInput)
    pair.clock.advance(61)
    pair.step(3)
    pre.abort(22)
    pair.run_idle(max_steps=2000)
    want = {
        1: 200,
        2: 200,
        3: 200,
        10: 499,
        11: 499,
        12: 499,
        13: 499,
        14: 500,
        15: 500,
        16: 499,
        20: 504,
        21: 504,
        22: 504,
    }
    assert {r: pair.finished[r].status for r in want} == want, pair.finished


@pytest.mark.parametrize("mode", ["packed", "direct", "pull"])
def test_no_device_value_is_read_on_the_host_in_the_hot_path(mode):
    pair = Pair(
        direct_threshold=0 if mode == "direct" else None,
        transfer_mode="pull" if mode == "pull" else "push",
    )
    try:
        reads = DeviceReads()
        watch(pair, reads)
        with reads:
            lifecycle(pair)
            for side in (pair.prefill, pair.decode):  # and a pause of each side
                side.begin_pause()
                pair.run_until(lambda: side.paused, max_steps=2000)
                side.resume()
            pair.prefill.add_request(30, 100)
            pair.run_idle()
        assert pair.finished[30].status == 200
        assert reads.reads == [], sorted(set(reads.reads))
        pair.assert_clean()
    finally:
        pair.close()


def test_the_check_sees_a_conversion_of_a_device_tensor():
    """The check itself: a conversion of a marked tensor (or of anything computed from
    one) in the sides' code is recorded, one of a host tensor is not."""
    pair = Pair()
    try:
        reads = DeviceReads()
        watch(pair, reads)
        with reads:
            pages = pair.decode.alloc.alloc(3)
            Ledger(pair.decode.alloc).hold("x", pages + 0)  # computed: still marked
            ids = D.HostCopy(pages).numpy()  # the sanctioned way
            kvmem.disagg.protocol.encode_runs(ids)  # host ids: nothing to record
            assert reads.reads == []
            kvmem.disagg.protocol.encode_runs(pages[1:])  # a device tensor: .tolist()
            kvmem.disagg.protocol.encode_runs(torch.tensor([1, 2]))  # a host one
        assert [r[0] for r in reads.reads] == ["tolist"], reads.reads
        assert reads.reads[0][1].startswith("protocol.py:")
        pair.decode.alloc.free(pages)
    finally:
        pair.close()


class _Lag:
    """A copy that reaches the host after ``polls`` polls: what a CUDA event is to a
    HostCopy on a GPU, where page ids and verdicts arrive a step or more later."""

    def __init__(self, polls: int):
        self.polls = polls

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0


@pytest.fixture
def lagging_copies(monkeypatch):
    real = D.HostCopy.__init__

    def init(self, t):
        real(self, t)
        self._event = _Lag(3)

    monkeypatch.setattr(D.HostCopy, "__init__", init)


@pytest.mark.parametrize("mode", ["packed", "direct", "pull"])
def test_every_lifecycle_path_with_host_copies_that_take_steps(mode, lagging_copies):
    """The paths that only run on a GPU: BOOTs sent once the decode's page ids are on the
    host (``booting`` meanwhile), direct descriptors and READY offers built once the
    prefill's page ids are, verdicts counted when they arrive; every outcome as on the
    CPU, every page freed once, every byte verified."""
    pair = Pair(
        direct_threshold=0 if mode == "direct" else None,
        transfer_mode="pull" if mode == "pull" else "push",
    )
    try:
        lifecycle(pair)
        for side in (pair.prefill, pair.decode):
            side.begin_pause()
            pair.run_until(lambda: side.paused, max_steps=2000)
            side.resume()
        pre, dec = pair.prefill, pair.decode
        pre.add_request(30, 100)
        pair.run_until(lambda: 30 in dec.reqs and dec.reqs[30].state == "booting")
        dec.abort(30)  # before its BOOT went out: the prefill ends it, then frees
        pre.add_request(31, 150)
        pair.run_idle()
        assert pair.finished[30].status == 499 and pair.finished[31].status == 200
        m = dec.metrics
        assert m.bytes_verified == m.bytes_landed and m.bytes_corrupt == 0
        assert (
            pair.prefill.chunk_modes[
                {"packed": "packed", "direct": "direct", "pull": "pulled"}[mode]
            ]
            > 0
        )
        pair.assert_clean()
    finally:
        pair.close()
