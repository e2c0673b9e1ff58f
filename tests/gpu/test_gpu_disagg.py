"""On a CUDA device (bench/gpu_check.sh): the PD lifecycle's sides on CUDA pools over real
NIXL (VRAM registrations): no host sync on the hot path, device work ordered before reuse.

- every lifecycle path of tests/disagg/test_sync_free.py (deliveries, aborts in
  each state and in the running batch, timeouts, failed sends, a decode-side abort) in
  packed, direct and pull modes, both sides stepped in CUDA sync-debug mode ("error": any
  host sync raises), after one warm-up pass outside it (Triton compiles, UCX connects,
  the pinned-memory cache fills).  Pauses are left out: a pause waits for the device by
  design (the audit, the release).
- a decode request whose chunk's unpack is still queued (the stream held busy by
  ``torch.cuda._sleep``) ends; its pages and landing region go to no new BOOT until the
  unpack's event is done, and the next request's bytes are then verified.
- HostCopy: page ids and verdicts reach the host through pinned memory, polled.

Needs NIXL with CUDA support (nixl-cu13 on a CUDA 13 host; the H200 image has none:
carry its wheel), else the module skips, saying so.  Collected only where CUDA is
available (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():  # on CPU only tests/test_bench_smoke.py collects this file
    pytest.skip(
        "CUDA is not available: the disagg sides run on CUDA pools on CUDA hosts only",
        allow_module_level=True,
    )

from kvmem.transfer.nixl import import_nixl  # noqa: E402

try:
    import_nixl()
except ImportError as e:
    pytest.skip(f"NIXL is not importable here, the sides cannot run: {e}", allow_module_level=True)

import kvmem  # noqa: E402
from kvmem.disagg import KVPoll  # noqa: E402
from kvmem.disagg.device import HostCopy
from tests.disagg.harness import Pair  # noqa: E402
from tests.disagg.test_sync_free import lifecycle  # noqa: E402
from tests.util import no_host_sync  # noqa: E402

DEV = torch.device("cuda", torch.cuda.current_device())
MODES = ["packed", "direct", "pull"]


def make_pair(mode: str, **kw) -> Pair:
    torch.zeros(1, device=DEV)  # a CUDA context is current before NIXL's agents are made
    return Pair(
        device=DEV,
        direct_threshold=0 if mode == "direct" else None,
        transfer_mode="pull" if mode == "pull" else "push",
        **kw,
    )


def test_host_copy_reaches_the_host_without_a_sync():
    ids = torch.arange(5, 12, device=DEV)
    with no_host_sync():
        copy = HostCopy(ids * 2)
        for _ in range(100_000):
            if copy.ready():
                break
    torch.cuda.synchronize()
    assert copy.ready() and copy.numpy().tolist() == list(range(10, 24, 2))


@pytest.mark.parametrize("mode", MODES)
def test_every_lifecycle_path_steps_without_a_host_sync(mode):
    warm = make_pair(mode)
    try:
        lifecycle(warm)  # compiles, connects, fills the caches
        warm.assert_clean()
    finally:
        warm.close()
    torch.cuda.synchronize()
    pair = make_pair(mode)
    try:
        pair.prefill.add_request(99, 64)  # this pair's own first transfer, outside the check
        pair.run_idle()
        with no_host_sync():
            lifecycle(pair)
            pair.prefill.add_request(30, 100)
            pair.run_idle()
        assert pair.finished[30].status == 200
        m = pair.decode.metrics
        assert m.bytes_verified == m.bytes_landed > 0 and m.bytes_corrupt == 0
        pair.assert_clean()
    finally:
        pair.close()


@pytest.mark.parametrize("mode", MODES)
def test_memory_is_reused_only_after_the_queued_unpack(mode):
    """The decode holds every page for request 2 and runs on a stream of its own, held
    busy (``torch.cuda._sleep``) when the request's last chunk lands: its check and unpack
    are queued behind the sleep when the request ends.  Request 3 waits for memory until
    their event is done, then boots on the same pages and is verified."""
    pair = make_pair(mode, num_pages=14)
    ds = torch.cuda.Stream(DEV)  # the decode's stream (separate processes have their own)

    def run_until(cond, steps: int = 5000):
        for _ in range(steps):
            if cond():
                return
            pair.prefill.step()
            with torch.cuda.stream(ds):
                pair.decode.step()
        raise AssertionError("condition not reached")

    try:
        dec = pair.decode
        pair.prefill.add_request(1, 64)  # warm-up
        run_until(lambda: pair.prefill.idle and dec.idle)
        pair.faults.stall_at[2] = 3
        pair.prefill.add_request(2, 200)  # 13 pages: every decode page
        run_until(lambda: 2 in dec.reqs and dec.reqs[2].pages_done == 12)
        with torch.cuda.stream(ds):
            torch.cuda._sleep(4_000_000_000)  # about 2 s of GPU time on the decode's stream
        pair.faults.stall_at.clear()
        run_until(lambda: 2 in dec.completed)
        busy = [ev for ev, *_ in dec.memory.draining]
        assert dec.completed[2].status == 200 and busy and not busy[0].query()
        assert dec.alloc.num_free == 0
        pair.prefill.add_request(3, 64)
        while not busy[0].query():
            pair.prefill.step()
            with torch.cuda.stream(ds):
                dec.step()
            assert 3 not in dec.reqs or dec.reqs[3].state == "waiting"
        run_until(lambda: pair.prefill.idle and dec.idle)
        assert pair.finished[2].status == pair.finished[3].status == 200
        m = dec.metrics
        assert m.bytes_verified == m.bytes_landed and m.bytes_corrupt == 0
        pair.assert_clean()
    finally:
        pair.close()


def test_pool_pages_hold_the_delivered_kv():
    """What the sides verified is what the decode's pool holds: packed chunks unpacked
    into its pages, read back and compared on the host once, at the end."""
    pair = make_pair("packed")
    try:
        pair.faults.stall_at[1] = 3  # the last chunk (page 12) held back: pages stay held
        pair.prefill.add_request(1, 200)
        pair.run_until(lambda: 1 in pair.decode.reqs and pair.decode.reqs[1].pages_done == 12)
        dec = pair.decode
        pages = dec.ledger.pages(1)[:12]
        torch.cuda.synchronize()
        got = kvmem.pack_pages(dec.pool, pages)
        assert torch.equal(got.cpu(), pair.synth.chunk(1, 0, 12))
        pair.faults.stall_at.clear()
        pair.run_idle()
        assert pair.prefill.state(1) == KVPoll.Success
        pair.assert_clean()
    finally:
        pair.close()
