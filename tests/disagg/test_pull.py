"""Pull mode: the prefill offers a chunk's pages (READY), the decode reads them from the
prefill's pool into its own pool pages (prepared block lists, NIXL READ) and answers
(PULLED).  The lifecycle rows run in pull mode in test_disagg_lifecycle.py and the soak;
here: what only pull does (quarantine on the prefill side, the epoch guard on reads)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import kvmem
from kvmem.disagg import KVPoll
from kvmem.disagg.protocol import encode
from kvmem.transfer.errors import StaleEpochError
from tests.disagg.harness import SPEC


PAIR = dict(transfer_mode="pull")  # the shared pair fixture (tests/disagg/conftest.py)


def test_pull_reads_pool_to_pool_verified_in_place_pages_freed_once(pair):
    pair.decode.memory.landing.fill_(0xA5)
    pair.prefill.add_request(1, 200)
    pair.run_idle()
    assert pair.finished[1].status == 200
    assert pair.prefill.chunk_modes == {"pulled": 4} and pair.decode.chunk_modes == {"pulled": 4}
    m = pair.decode.metrics
    assert m.bytes_verified == m.bytes_landed == kvmem.packed_nbytes(SPEC, 13) + 64
    assert pair.prefill.metrics.bytes_sent == m.bytes_landed  # reads acked + the AUX write
    assert 0 < int((pair.decode.memory.landing != 0xA5).sum()) <= 64  # only the AUX landed there
    assert dict(pair.prefill.ledger.freed_by_reason) == {"sent": 13}
    assert dict(pair.decode.ledger.freed_by_reason) == {"completed": 13}
    pair.assert_clean()


def test_prefill_abort_during_a_read_holds_its_pages_until_pulled(pair):
    pair.faults.stall_at[1] = 1
    pair.prefill.add_request(1, 200)
    pair.run_until(lambda: pair.prefill.state(1) == KVPoll.Transferring)
    assert pair.prefill.reqs[1].handles  # chunk 0 offered; the decode has not read it yet
    pair.prefill.abort(1)
    # quarantined on the prefill side: the decode may be reading these pages
    assert pair.prefill.ledger.holds(1) and not pair.prefill.ledger.freed_by_reason
    assert 1 in pair.prefill.reqs
    pair.run_until(lambda: pair.prefill.ledger.freed_by_reason)  # the decode's PULLED
    assert dict(pair.prefill.ledger.freed_by_reason) == {"ended:499": 4}
    pair.run_idle()
    assert pair.finished[1].status == 499
    assert dict(pair.decode.ledger.freed_by_reason) == {"abort:499": 13}
    assert pair.decode.metrics.bytes_verified == kvmem.packed_nbytes(SPEC, 4)
    pair.assert_clean()


def test_offered_pages_without_an_answer_are_freed_after_the_quarantine_timeout(pair, caplog):
    pair.faults.stall_at[1] = 1
    dropped = []
    real = pair.de.send_notif

    def send_notif(peer, msg):  # the decode's PULLED answers are lost
        if b'"PULLED"' in msg:
            dropped.append(msg)
            return None
        return real(peer, msg)

    pair.de.send_notif = send_notif
    pair.prefill.add_request(1, 200)
    pair.run_until(lambda: dropped)
    pair.prefill.abort(1)
    pair.step(3)
    assert pair.prefill.ledger.holds(1)  # still quarantined: no answer yet
    pair.clock.advance(pair.prefill.ctx.config.quarantine_timeout + 1)
    pair.prefill.step()
    assert dict(pair.prefill.ledger.freed_by_reason) == {"ended:499": 4}
    assert "no PULLED from the decode" in caplog.text
    pair.run_idle()
    assert pair.finished[1].status == 499
    pair.assert_clean()


def test_a_read_built_from_the_prefills_older_metadata_is_refused_before_posting(pair):
    pair.prefill.add_request(1, 64)
    pair.run_idle()
    old = pair.decode.peers.tables[pair.pe.name].table
    assert old is not None and old.epoch == 0
    pair.prefill.begin_pause()
    pair.run_until(lambda: pair.prefill.paused)
    pair.step(2)  # the decode learns the tombstone: no read of the released pool
    assert not pair.de.remote(pair.pe.name, "kv").live
    idx = np.arange(4, dtype=np.int64) + 1
    with pytest.raises(StaleEpochError):
        pair.de.post_blocks(pair.decode.receiving.local_table, idx, old, idx, op="READ")
    pair.prefill.resume()
    pair.step(2)
    # a READY replayed from before the pause is refused before any read is posted
    pair.faults.stall_at[2] = 0  # booted, nothing offered yet
    pair.prefill.add_request(2, 128)
    pair.run_until(lambda: 2 in pair.decode.reqs and pair.decode.reqs[2].state == "booted")
    opened = pair.de.open_handles()
    pair.pe.send_notif(
        pair.de.name, encode("READY", rid=2, first=0, last=4, pages="1:4", epoch=0, final=False)
    )
    # refused by the decode (no read posted), its PULLED(ok=False) names no offer of the
    # prefill's: refused there
    end = time.monotonic() + 5
    while pair.prefill.metrics.protocol_errors == 0 and time.monotonic() < end:
        pair.step()
        assert pair.de.open_handles() == opened and not pair.decode.reqs[2].reads
        time.sleep(0.001)
    assert pair.prefill.metrics.protocol_errors == 1
    pair.faults.stall_at.clear()
    pair.run_idle()
    assert (
        pair.finished[2].status == 200 and pair.decode.peers.tables[pair.pe.name].table.epoch == 1
    )
    assert pair.decode.metrics.bytes_corrupt == 0
    pair.assert_clean()
