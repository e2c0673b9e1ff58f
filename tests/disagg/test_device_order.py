"""The decode's device work on a request's memory (the check of a landed
chunk, its unpack into the pool pages; asynchronous on CUDA) is ordered before any reuse of
those pages and that landing region.  A NIXL write is not ordered with the device's
stream: pages or a region handed to a new BOOT while the old unpack is still queued
could receive the new request's bytes before the old unpack ran, which would then
overwrite them.  So each landed chunk records an event, and a request that ends gives its
memory back only once its last event is done, polled in step(), never waited on.

On the CPU that work is done when it returns; the ordering contract is tested with
stand-in events the test opens by hand (tests/disagg/test_landing_and_hostile_peers.py Gate), both sides
in this process (tests/disagg/harness.py).  tests/gpu/test_gpu_disagg.py runs the same on a
GPU with CUDA events, over real NIXL."""

from __future__ import annotations

import kvmem
from kvmem.disagg import KVPoll
from tests.disagg.harness import MODES, SPEC
from tests.disagg.test_landing_and_hostile_peers import Gate

NUM_PAGES = 14  # 13 usable: a 200-token request holds every page of the decode


def pages_of(tokens: int) -> int:
    return -(-tokens // SPEC.page_size)


# the shared pair fixture (tests/disagg/conftest.py) in every transfer mode, its decode's
# device work a Gate the test opens by hand (pair.done_event)
PAIR_PARAMS = {
    mode: (lambda kw=kw: dict(num_pages=NUM_PAGES, done_event=Gate(), **kw))
    for mode, kw in MODES.items()
}


def test_memory_of_a_delivered_request_waits_for_its_device_work(pair):
    dec = pair.decode
    pair.prefill.add_request(1, 200)  # every decode page
    pair.run_until(lambda: 1 in pair.finished)
    assert pair.finished[1].status == 200 and dec.completed[1].status == 200
    first_pages = sorted(dec.ledger.pages(("device-busy", 1)).tolist())
    assert len(first_pages) == pages_of(200) and dec.alloc.num_free == 0
    assert dec.arena.used_bytes > 0 and not dec.idle
    assert dec.audit()["quarantined"] == {("device-busy", 1): first_pages}
    pair.prefill.add_request(2, 64)
    for _ in range(30):
        pair.step()
    # the new request waits: no page, no landing region of request 1 is handed out
    assert dec.reqs[2].state == "waiting" and pair.prefill.state(2) == KVPoll.Bootstrapping
    for ev in pair.done_event.made[:-1]:
        ev.done = True  # every chunk's work but the last (the AUX check) done: still held
    pair.step(3)
    assert dec.reqs[2].state == "waiting" and dec.alloc.num_free == 0
    pair.done_event.open_all(auto=True)
    pair.step()
    assert dict(dec.ledger.freed_by_reason) == {"completed": pages_of(200)}
    pair.run_idle()
    assert pair.finished[2].status == 200
    assert dec.metrics.bytes_verified == dec.metrics.bytes_landed
    pair.assert_clean()


def test_an_abort_frees_the_memory_once_the_unpack_ran(pair):
    """The issue's race: chunk 0 landed (its unpack queued), the prefill aborts, the
    decode frees on ABORT, and a new BOOT must not get those pages or that region until
    the unpack's event is done."""
    dec = pair.decode
    pair.faults.stall_at[1] = 1
    pair.prefill.add_request(1, 200)
    pair.run_until(lambda: 1 in dec.reqs and dec.reqs[1].pages_done == 4)
    assert not pair.done_event.made[-1].done
    pair.prefill.abort(1)
    pair.run_until(lambda: 1 in dec.completed)
    assert dec.completed[1].status == 499 and 1 not in dec.reqs
    held = dec.audit()["quarantined"]
    assert list(held) == [("device-busy", 1)] and len(held[("device-busy", 1)]) == 13
    pair.prefill.add_request(2, 100)
    pair.step(20)
    assert dec.reqs[2].state == "waiting"  # nothing to boot it with yet
    pair.done_event.open_all(auto=True)
    pair.run_idle()
    assert pair.finished[2].status == 200
    assert dict(dec.ledger.freed_by_reason) == {"abort:499": 13, "completed": pages_of(100)}
    pair.assert_clean()


def test_a_decode_pause_releases_memory_only_after_the_device_work(pair):
    dec = pair.decode
    pair.faults.stall_at[1] = 1
    pair.prefill.add_request(1, 200)
    pair.run_until(lambda: 1 in dec.reqs and dec.reqs[1].pages_done == 4)
    dec.begin_pause()
    pair.run_until(lambda: 1 in dec.completed)  # PAUSE_ACK: request 1 freed (503)
    pair.step(10)
    assert dec.pausing and not dec.paused and not dec.pool.released
    pair.done_event.open_all(auto=True)
    pair.run_until(lambda: dec.paused)
    assert dec.pool.released and dec.audit() == {"leaked": {}, "quarantined": {}, "unaccounted": []}
    dec.resume()
    pair.prefill.add_request(2, 64)
    pair.run_idle()
    assert pair.finished[1].status == 503 and pair.finished[2].status == 200
    pair.assert_clean()


def test_landed_chunks_record_events_that_are_only_polled(pair):
    """One event per landed chunk or read and per AUX, each polled (query) by step, none
    waited on; on the CPU the default is always ready."""
    pair.done_event.auto = True
    pair.prefill.add_request(1, 130)  # 3 chunks
    pair.run_idle()
    assert len(pair.done_event.made) == 3 + 1  # three chunks, the AUX
    from kvmem.disagg.device import device_event

    assert device_event("cpu")().query() is True
    assert pair.decode.metrics.bytes_verified == kvmem.packed_nbytes(SPEC, 9) + 64
    pair.assert_clean()
