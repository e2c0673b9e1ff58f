"""Direct chunks: the prefill writes a chunk's pages from its pool straight into the
decode's pool pages (prepared block lists, page runs merged where adjacent on both sides),
instead of packing it into the decode's landing region.  The lifecycle rows run in both
modes in test_disagg_lifecycle.py and the soak; here: what only the direct path does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvmem
from kvmem.disagg import KVPoll
from kvmem.transfer.errors import StaleEpochError
from tests.disagg.harness import SPEC, Pair

PLANE_PAGE = (
    SPEC.page_size * SPEC.num_kv_heads * SPEC.head_dim * 2
)  # bytes of one page of a layer's K


PAIR = dict(direct_threshold=0)  # the shared pair fixture (tests/disagg/conftest.py)


def test_direct_chunks_land_in_pool_pages_verified_in_place_pages_freed_once(pair):
    pair.decode.memory.landing.fill_(0xA5)  # a direct chunk never touches the landing region
    pair.prefill.add_request(1, 200)  # 4 chunks of 64 tokens, the last one partial
    pair.run_idle()
    assert pair.finished[1].status == 200
    assert pair.prefill.chunk_modes == {"direct": 4}
    assert pair.decode.chunk_modes == {"direct": 4}
    m = pair.decode.metrics
    assert m.bytes_verified == m.bytes_landed == kvmem.packed_nbytes(SPEC, 13) + 64
    assert pair.prefill.metrics.bytes_packed == 0
    # only the AUX (extra state) went through the landing region
    touched = int((pair.decode.memory.landing != 0xA5).sum())
    assert 0 < touched <= 64
    assert dict(pair.prefill.ledger.freed_by_reason) == {"sent": 13}
    assert dict(pair.decode.ledger.freed_by_reason) == {"completed": 13}
    pair.assert_clean()


def test_the_last_direct_write_holds_the_prefill_pages_until_done(pair):
    pair.prefill.add_request(1, 64)  # one chunk, final
    pair.run_until(lambda: pair.prefill.reqs[1].handles)
    h, off = pair.prefill.reqs[1].handles[0]
    assert off is None and h.tables  # a direct write, no staging slot
    assert pair.prefill.ledger.holds(1) and not pair.prefill.ledger.freed_by_reason
    pair.run_idle()
    assert dict(pair.prefill.ledger.freed_by_reason) == {"sent": 4}
    pair.assert_clean()


def test_decode_abort_during_a_direct_write_quarantines_its_pool_pages(pair):
    pair.faults.stall_at[1] = 1
    pair.prefill.add_request(1, 200)
    pair.run_until(lambda: pair.prefill.state(1) == KVPoll.Transferring)
    h, _ = pair.prefill.reqs[1].handles[0]
    assert h.tables and h.state == "PROC"
    held = sorted(pair.decode.ledger.pages(1).tolist())
    pair.decode.abort(1)
    assert pair.decode.audit()["quarantined"] == {1: held}
    pair.decode.step()
    assert 1 in pair.decode.reqs  # held until the prefill's ABORT (its writes drained)
    pair.run_idle()
    assert dict(pair.decode.ledger.freed_by_reason) == {"abort:499": 13}
    assert dict(pair.prefill.ledger.freed_by_reason) == {"ended:499": 4}
    # the chunk that landed in the pool pages was verified there all the same
    assert pair.decode.metrics.bytes_verified == kvmem.packed_nbytes(SPEC, 4)
    pair.assert_clean()


def test_corrupt_pool_pages_are_caught_in_place(pair):
    pair.faults.stall_at[1] = 1
    pair.prefill.add_request(1, 128)
    pair.run_until(lambda: pair.prefill.state(1) == KVPoll.Transferring)
    # chunk 0 lands in the decode's pool pages and is verified there
    pair.run_until(lambda: pair.decode.metrics.bytes_verified > 0)
    assert pair.decode.metrics.bytes_verified == kvmem.packed_nbytes(SPEC, 4)
    # one flipped byte in a landed page: the in-place check (against the tape) sees it
    dec = pair.decode
    pages = dec.ledger.pages(1)
    assert dec.verifier.verify_pages(dec.pool, 1, 0, 4, pages[:4])
    dec.pool.v_buffer[1][int(pages[2])].view(torch.uint8).view(-1)[7] ^= 1
    assert not dec.verifier.verify_pages(dec.pool, 1, 0, 4, pages[:4])
    assert not dec.verifier.verify_pages(dec.pool, 1, 0, 4, pages[:3])  # wrong count
    pair.faults.stall_at.clear()
    pair.run_idle()


def test_choice_per_chunk_by_merged_runs():
    """Threshold two pages of a layer: a chunk whose decode pages are scattered (runs of
    one page) packs, one whose pages are adjacent on both sides goes direct."""
    p = Pair(direct_threshold=2 * PLANE_PAGE)
    try:
        dec = p.decode
        # scatter the decode's free pages: hold every other page for the first request's
        # lifetime, so request 1 gets runs of one page
        spread = dec.alloc.alloc(dec.alloc.num_free)
        keep, give = spread[0::2], spread[1::2]
        dec.alloc.free(give)
        p.prefill.add_request(1, 64)
        p.run_idle()
        assert p.prefill.chunk_modes == {"packed": 1}
        dec.alloc.free(keep)
        dec.alloc.reset()
        p.prefill.add_request(2, 64)
        p.run_idle()
        assert p.prefill.chunk_modes == {"packed": 1, "direct": 1}
        assert p.finished[1].status == p.finished[2].status == 200
        p.assert_clean()
    finally:
        p.close()


def test_direct_write_from_older_decode_metadata_is_refused_before_posting(pair):
    pair.prefill.add_request(1, 64)
    pair.run_idle()
    old = pair.prefill.peers.get(pair.de.name).table.table
    assert old is not None and old.epoch == 0
    pair.decode.begin_pause()
    pair.run_until(lambda: pair.decode.paused)
    pair.decode.resume()
    pair.step(2)
    lt = pair.prefill.sending.direct.local_table
    idx = np.arange(4, dtype=np.int64) + 1
    opened = pair.pe.open_handles()
    with pytest.raises(StaleEpochError):
        pair.pe.post_blocks(lt, idx, old, idx)
    assert pair.pe.open_handles() == opened
    pair.prefill.add_request(2, 64)
    pair.run_idle()
    assert (
        pair.finished[2].status == 200
        and pair.prefill.peers.get(pair.de.name).table.table.epoch == 1
    )
    assert pair.prefill.chunk_modes["direct"] == 2
    pair.assert_clean()


def test_post_blocks_checks_indices_and_sizes(pair):
    pair.prefill.add_request(1, 64)
    pair.run_idle()
    lt, rt = (
        pair.prefill.sending.direct.local_table,
        pair.prefill.peers.get(pair.de.name).table.table,
    )
    n_local = lt.layout.count * lt.nbytes.size
    for li, ri, match in [
        (np.array([1, 2]), np.array([1]), "equal in number"),
        (np.array([n_local]), np.array([1]), "outside the tables"),
        (np.array([-1]), np.array([1]), "outside the tables"),
    ]:
        with pytest.raises(ValueError, match=match):
            pair.pe.post_blocks(lt, li, rt, ri)
    with pytest.raises(ValueError, match="a local table .* and a remote one"):
        pair.pe.post_blocks(rt, np.array([1]), lt, np.array([1]))
    assert pair.pe.open_handles() == 0
    # deregistering the pool releases its prepared list
    pair.prefill.begin_pause()
    pair.run_until(lambda: pair.prefill.paused)
    assert lt.released
    pair.prefill.resume()
    assert (
        pair.prefill.sending.direct.local_table is not lt
        and not pair.prefill.sending.direct.local_table.released
    )


def test_calibration_measures_both_ways_and_records_its_fit():
    import threading

    from kvmem.disagg.calibrate import calibrate_direct

    p = Pair(direct_threshold=None)
    stop = threading.Event()

    def drive_decode():  # the decode's engine must progress (no NIXL progress thread)
        while not stop.is_set():
            p.de.get_notifs()

    t = threading.Thread(target=drive_decode)
    t.start()
    try:
        rec = calibrate_direct(p.prefill, chunk_pages=4, rounds=2)
    finally:
        stop.set()
        t.join()
    try:
        assert [r["run_pages"] for r in rec["rows"]] == [1, 2, 4]
        assert [r["descriptors"] for r in rec["rows"]] == [16, 8, 4]  # 4 planes x 4 pages / r
        for r in rec["rows"]:
            assert 0 < r["direct_s"] <= r["direct_median_s"] and 0 < r["packed_s"]
        assert set(rec["fit"]) == {"direct_per_descriptor_s", "direct_rest_s", "packed_s"}
        thr = rec["threshold"]
        assert thr is None or (thr >= PLANE_PAGE and thr % PLANE_PAGE == 0)
        # nothing of the side changed; its own lists were not prepared and none is left
        assert (
            p.prefill.sending.direct.threshold is None
            and p.prefill.sending.direct.local_table is None
        )
        assert not p.pe._tables and p.pe.open_handles() == 0
        p.prefill.set_direct_threshold(thr)
        p.prefill.add_request(1, 128)
        p.run_idle()
        assert p.finished[1].status == 200
        p.assert_clean()
    finally:
        p.close()


def _reregister_decode_kv(pair) -> None:
    """The decode moves its kv to a new epoch without a pause (no PAUSING: nothing tells
    the prefill to end its requests), then publishes the new metadata."""
    dec = pair.decode
    dec.engine.deregister("kv")
    dec.pool.release()
    dec.pool.resume()
    dec.engine.register_pool(dec.pool, "kv")
    dec.peers.publish_metadata()


@pytest.mark.parametrize("when", ["before-staging", "staged-not-posted"])
def test_direct_chunk_is_tied_to_the_kv_epoch_of_its_boot(when):
    """The decode's page ids in a BOOT belong to the kv registration of
    that BOOT's epoch.  A direct chunk posted after the decode moved its kv to a newer
    epoch is refused before posting (StaleEpochError: 503, as a packed chunk or a pull
    offer is), never written into the new epoch's pool and answered 200."""
    from tests.disagg.test_landing_and_hostile_peers import Gate

    gate = Gate()
    gate.auto = True
    p = Pair(direct_threshold=0, ready_event=gate)
    try:
        p.faults.stall_at[1] = 1
        p.prefill.add_request(1, 200)  # 4 direct chunks; chunk 1 held back
        p.run_until(lambda: p.decode.chunk_modes["direct"] == 1)
        boot_kv = p.prefill.reqs[1].kv
        assert boot_kv is not None and boot_kv.epoch == 0
        if when == "staged-not-posted":
            gate.auto = False
            p.faults.stall_at.clear()
            p.run_until(lambda: p.prefill.reqs[1].staged is not None)
        _reregister_decode_kv(p)
        p.run_until(lambda: p.pe.remote(p.de.name, "kv").epoch == 1)
        p.faults.stall_at.clear()
        gate.open_all(auto=True)
        opened = p.pe.open_handles()
        p.run_idle()
        assert p.finished[1].status == 503, p.finished[1]
        assert "epoch" in p.finished[1].message
        assert p.decode.chunk_modes["direct"] == 1  # nothing more landed in the new pool
        assert p.pe.open_handles() <= opened
        assert p.decode.completed[1].status == 503
        # the decode moves its landing buffer to the new epoch too; a request booted
        # there goes direct again
        dec = p.decode
        dec.engine.deregister("landing")
        dec.engine.register(
            "landing", dec.memory.landing_mem.regions(), dec.pool.epoch, dec.pool.device
        )
        dec.peers.publish_metadata()
        p.prefill.add_request(2, 64)
        p.run_idle()
        assert p.finished[2].status == 200 and p.decode.chunk_modes["direct"] == 2
        p.assert_clean()
    finally:
        p.close()
