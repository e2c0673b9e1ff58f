"""The PD lifecycle at its edges: a landing buffer of several regions, an AUX slot that is
not 8-byte aligned, hostile peer messages in one batch, a PAUSE_ACK of another pause, an
ABORT_REQ that claims success, bad values from the caller, and pack ordered before post.
Both sides run in this process (tests/disagg/harness.py; ``pair`` is the shared fixture of
tests/disagg/conftest.py)."""

from __future__ import annotations

import base64
import json
import time

import pytest
import torch

import kvmem
from kvmem.disagg import KVPoll, ProtocolError
from kvmem.disagg.peers import RegionMap
from kvmem.disagg.protocol import encode, meta_message, parse
from kvmem.transfer.envelope import decode_metadata, encode_metadata
from tests.disagg.harness import SPEC, Pair


def pages_of(tokens: int, spec=SPEC) -> int:
    return -(-tokens // spec.page_size)


def record_posts(pair: Pair) -> list:
    """Wrap the prefill engine's post_write: the remote ranges of every write posted."""
    posts, real = [], pair.pe.post_write

    def post_write(local, remote, remote_ranges, notif=b""):
        posts.append(list(remote_ranges))
        return real(local, remote, remote_ranges, notif)

    pair.pe.post_write = post_write
    return posts


def one_batch(engine, sender: str, n: int) -> None:
    """Wait until ``n`` notifications from ``sender`` reached ``engine`` (over the wire),
    then make its next get_notifs() return them all at once: one batch, as a busy worker
    fetches them."""
    got, end = [], time.monotonic() + 10
    while len(got) < n:
        assert time.monotonic() < end, f"{len(got)} of {n} notifications arrived"
        got += engine.get_notifs().get(sender, [])
    real = engine.get_notifs

    def batch():
        engine.get_notifs = real
        return {sender: got}

    engine.get_notifs = batch


def step_until(side, cond, sender, steps: int = 200) -> None:
    """Step one side until ``cond()`` (notifications take a moment on the wire), keeping
    ``sender``'s engine progressing: a NIXL notification that UCX could not send at once
    leaves only when its sender's worker progresses (without a progress thread, a
    get_notifs() call), which failed this test about 1 time in 3 when only the receiver
    was stepped.  What the sender's engine fetches meanwhile goes into its side's inbox,
    to be handled at that side's next step: nothing is lost or handled early."""
    for _ in range(steps):
        side.step()
        for peer, msgs in sender.engine.get_notifs().items():
            sender.inbox._queue.extend((peer, m) for m in msgs)
        if cond():
            return
        time.sleep(0.001)
    raise AssertionError("condition not reached")


# --- 3: a landing buffer of several regions ------------------------------------------------


def test_region_map_cuts_ranges_at_region_boundaries():
    m = RegionMap([(1000, 10), (5000, 6), (9000, 100)])
    assert m.size == 116
    assert m.ranges(0, 10) == [(1000, 10)]
    assert m.ranges(8, 4) == [(1008, 2), (5000, 2)]
    assert m.ranges(3, 20) == [(1003, 7), (5000, 6), (9000, 7)]
    assert m.ranges(115, 1) == [(9099, 1)]
    for off, n in ((-1, 2), (0, 0), (110, 7)):
        with pytest.raises(ValueError, match="outside the 116 bytes of 3 region"):
            m.ranges(off, n)


def test_landing_buffer_of_many_regions_writes_split_at_region_boundaries():
    # 4000-byte regions: every 16 KiB page-chunk write and most AUX slots straddle one
    pair = Pair(landing_chunk=4000)
    try:
        assert len(pair.de.registrations()["landing"].regions) > 10
        posts = record_posts(pair)
        for rid, n in ((1, 200), (2, 17), (3, 64), (4, 333)):
            pair.prefill.add_request(rid, n)
        pair.run_idle()
        assert all(pair.finished[r].status == 200 for r in (1, 2, 3, 4)), pair.finished
        assert any(len(p) > 1 for p in posts), "no write spanned two regions"
        total = sum(kvmem.packed_nbytes(SPEC, pages_of(n)) + 64 for n in (200, 17, 64, 333))
        assert pair.decode.metrics.bytes_verified == pair.decode.metrics.bytes_landed == total
        pair.assert_clean()
    finally:
        pair.close()


# --- 4: the AUX slot unaligned ---------------------------------------------------------------


def test_aux_slot_not_8_byte_aligned_is_read_as_bytes():
    tiny = kvmem.KVSpec(
        num_layers=1, num_kv_heads=1, head_dim=1, page_size=1, dtype=torch.bfloat16
    )  # 4 bytes a page: AUX at 4 * tokens
    pair = Pair(spec=tiny, chunk_tokens=1, max_tokens=3)
    try:
        for rid, n in ((1, 3), (2, 1), (3, 2)):
            pair.prefill.add_request(rid, n)
        pair.run_idle()
        assert all(pair.finished[r].status == 200 for r in (1, 2, 3)), pair.finished
        assert pair.decode.completed[1].status == 200
        assert pair.decode.metrics.bytes_corrupt == 0
        assert pair.decode.metrics.protocol_errors == 0
        pair.assert_clean()
    finally:
        pair.close()


# --- 5: hostile messages, one batch ------------------------------------------------------------


def forged_meta(engine, agent: str) -> bytes:
    header, blob = decode_metadata(engine.local_metadata())
    header["agent"] = agent
    md = encode_metadata(header, blob)
    return encode("META", md=base64.b64encode(md).decode())


def test_hostile_messages_in_one_batch_are_counted_and_the_rest_applied(pair):
    pre, dec = pair.prefill, pair.decode
    pair.faults.withhold.add(1)  # request 1 stays waiting; its ABORT comes last
    pre.add_request(1, 100)
    pair.faults.stall_at[2] = 1  # request 2 is Transferring
    pre.add_request(2, 200)
    pair.run_until(lambda: pre.state(2) == KVPoll.Transferring and 1 in dec.reqs)
    pair.step(2)
    old_pe = pair.pe.local_metadata()
    buf = torch.zeros(4096, dtype=torch.uint8)
    pair.pe.register("extra", [(buf.data_ptr(), 4096)], 0)
    pair.pe.send_notif(pair.de.name, meta_message(pair.pe))  # a newer snapshot: applied
    before = dec.metrics.protocol_errors
    hostile = [
        encode("META", md="%%% not base64 %%%"),
        encode("META", md=base64.b64encode(b"junk" * 20).decode()),
        forged_meta(pair.pe, "mallory"),
        encode("META", md=base64.b64encode(old_pe).decode()),  # an older replay
        b"[" * 100_000 + b"]" * 100_000,
        json.dumps({"t": "ABORT", "rid": 1, "status": 123, "reason": "x"}).encode(),
        json.dumps({"t": "ABORT", "rid": 1, "status": 499}).encode(),
        json.dumps(
            {
                "t": "CHUNK",
                "rid": 2,
                "first": True,
                "last": 2,
                "off": 0,
                "nbytes": 1,
                "final": False,
            }
        ).encode(),
        b'{"t":"REQ","rid":9,"room":9,"tokens":NaN}',
        b'{"t":"REQ","rid":9,"room":9,"tokens":' + b"9" * 5000 + b"}",
        b"\xff\xfe",
    ]
    for raw in hostile:
        pair.pe.send_notif(pair.de.name, raw)
    pair.pe.send_notif(pair.de.name, encode("ABORT", rid=1, status=499, reason="valid, last"))
    one_batch(pair.de, pair.pe.name, 1 + len(hostile) + 1)
    assert 1 in dec.reqs
    dec.step()  # one batch: every hostile message refused, the ABORT after them applied
    assert dec.metrics.protocol_errors == before + len(hostile)
    assert 1 not in dec.reqs and dec.completed[1].status == 499
    assert pair.de.remote(pair.pe.name, "extra").live  # the newer META, in the same batch
    pair.faults.stall_at.clear()
    pair.run_until(lambda: 2 in pair.finished)
    pair.clock.advance(31)  # request 1 was withheld: the prefill's bootstrap timeout ends it
    pair.run_idle()
    assert pair.finished[2].status == 200 and pair.finished[1].status == 504
    pair.assert_clean()


def test_hostile_messages_to_the_prefill_are_counted_and_the_rest_applied(pair):
    pre = pair.prefill
    pair.faults.stall_at[1] = 1
    pre.add_request(1, 200)
    pair.run_until(lambda: pre.state(1) == KVPoll.Transferring)
    before = pre.metrics.protocol_errors
    hostile = [
        encode("ABORT_REQ", rid=1, status=123, reason="x"),
        encode("ABORT_REQ", rid=1, status=200, reason="claims success"),  # 7
        encode("PAUSING", epoch=999),
        encode("META", md="!!"),
        forged_meta(pair.de, "mallory"),
        b'{"t":"BOOT","rid":1,"room":1,"off":0,"nbytes":1,"epoch":0,"extra":1}',
        b'{"t":"BOOT","rid":1,"room":1,"off":-5,"nbytes":100,"epoch":0}',
        encode("PAUSE_ACK", epoch=0),  # the decode's own message type
        b"{" * 50_000,
    ]
    for raw in hostile:
        pair.de.send_notif(pair.pe.name, raw)
    pair.de.send_notif(pair.pe.name, encode("ABORT_REQ", rid=1, status=499, reason="valid"))
    one_batch(pair.pe, pair.de.name, len(hostile) + 1)
    pre.step()
    assert pre.metrics.protocol_errors == before + len(hostile)
    assert not pre.peers.any_paused
    assert pre.metrics.requests["succeeded"] == 0
    pair.run_idle()
    assert pair.finished[1].status == 499 and "decode side: valid" in pair.finished[1].message
    assert pre.metrics.requests == {"aborted": 1}
    pair.assert_clean()


def test_abort_req_with_status_200_is_refused_not_a_success(pair):
    pair.faults.stall_at[1] = 1
    pair.prefill.add_request(1, 200)
    pair.run_until(lambda: pair.prefill.state(1) == KVPoll.Transferring)
    with pytest.raises(
        ProtocolError, match=r"ABORT_REQ: status 200 is not one of \[499, 500, 503, 504\]"
    ):
        parse(
            encode("ABORT_REQ", rid=1, status=200, reason="x"),
            sender=pair.de.name,
            receiver="prefill",
        )
    pair.de.send_notif(pair.pe.name, encode("ABORT_REQ", rid=1, status=200, reason="x"))
    step_until(pair.prefill, lambda: pair.prefill.metrics.protocol_errors == 1, pair.decode)
    assert 1 not in pair.finished and pair.prefill.state(1) == KVPoll.Transferring
    pair.faults.stall_at.clear()
    pair.run_idle()
    assert pair.finished[1].status == 200
    pair.assert_clean()


def test_abort_with_status_200_only_answers_an_abort_req(pair):
    pair.faults.withhold.add(1)
    pair.prefill.add_request(1, 64)
    pair.step(2)
    pair.pe.send_notif(pair.de.name, encode("ABORT", rid=1, status=200, reason="forged"))
    step_until(pair.decode, lambda: pair.decode.metrics.protocol_errors == 1, pair.prefill)
    assert 1 in pair.decode.reqs
    pair.prefill.abort(1)
    pair.run_idle()
    pair.assert_clean()


def test_a_message_from_another_agent_is_refused(pair):
    before = pair.decode.metrics.protocol_errors
    pair.decode.inbox.deliver("mallory", encode("REQ", rid=5, room=5, tokens=10))
    assert pair.decode.metrics.protocol_errors == before + 1 and not pair.decode.reqs
    assert pair.decode.inbox.refused == {"REQ": 1}


# --- 6: a PAUSE_ACK of another pause ------------------------------------------------------------


@pytest.mark.parametrize("epoch", [999, 1])
def test_pause_ack_of_another_epoch_frees_nothing(pair, epoch):
    pre, dec = pair.prefill, pair.decode
    pair.faults.stall_at[1] = 1
    pre.add_request(1, 200)
    pair.run_until(lambda: pre.state(1) == KVPoll.Transferring)
    assert pre.reqs[1].handles  # a write into the decode is posted
    held = dict(dec.ledger.owners())
    dec.begin_pause()
    pair.pe.send_notif(pair.de.name, encode("PAUSE_ACK", epoch=epoch))
    step_until(dec, lambda: dec.metrics.protocol_errors == 1, pre)
    assert dec.pausing and not dec.paused and not dec.pool.released
    assert dict(dec.ledger.owners()) == held
    pair.run_until(lambda: dec.paused)  # the prefill's own ack, for epoch 0
    assert pair.finished[1].status == 503
    dec.resume()
    pair.step(3)
    pair.pe.send_notif(pair.de.name, encode("PAUSE_ACK", epoch=1))  # not pausing now
    step_until(dec, lambda: dec.metrics.protocol_errors == 2, pre)
    assert not dec.paused
    pair.faults.stall_at.clear()
    pre.add_request(2, 64)
    pair.run_idle()
    assert pair.finished[2].status == 200
    pair.assert_clean()


# --- 8: the caller's values -----------------------------------------------------------------------


def snapshot(pair: Pair):
    pre, dec = pair.prefill, pair.decode
    return (
        sorted(pre.reqs),
        {r: q.state for r, q in pre.reqs.items()},
        dict(pre.ledger.owners()),
        dict(pre.ledger.freed_by_reason),
        sorted(dec.reqs),
        dict(dec.ledger.owners()),
        {r: q.state for r, q in dec.reqs.items()},
        pre.metrics.as_dict(),
        dec.metrics.as_dict(),
    )


@pytest.mark.parametrize("status", [123, 200, True, 499.0, "499", None])
def test_bad_abort_status_is_refused_up_front(pair, status):
    pair.faults.stall_at[1] = 1
    pair.prefill.add_request(1, 200)
    pair.run_until(lambda: pair.prefill.state(1) == KVPoll.Transferring)
    pair.step(2)
    before = snapshot(pair)
    with pytest.raises(ValueError, match=f"status must be one of .*got {status!r}"):
        pair.prefill.abort(1, status=status)
    with pytest.raises(ValueError, match=f"status must be one of .*got {status!r}"):
        pair.decode.abort(1, status=status)
    pair.step(2)
    assert snapshot(pair) == before
    pair.faults.stall_at.clear()
    pair.run_idle()
    assert pair.finished[1].status == 200
    pair.assert_clean()


def test_bad_values_from_the_caller_change_nothing(pair):
    pre, dec = pair.prefill, pair.decode
    pre.add_request(1, 64)
    before = snapshot(pair)
    for call, match in [
        (lambda: pre.add_request(7, 10, room="r7"), "room must be an int in .*got 'r7'"),
        (lambda: pre.add_request(7, 10, room=-1), "room must be an int in .*got -1"),
        (lambda: pre.add_request(7, 10, room=True), "room must be an int in .*got True"),
        (lambda: pre.add_request(7.0, 10), "rid must be an int in .*got 7.0"),
        (lambda: pre.add_request(2**63, 10), "rid must be an int in .*got 9223372036854775808"),
        (lambda: pre.add_request(7, True), "tokens must be an int > 0, got True"),
        (lambda: pre.abort(1, message=5), "message must be a str or None, got int"),
        (lambda: pre.abort("1"), "rid must be an int in .*got '1'"),
        (lambda: dec.abort([1]), r"rid must be an int in .*got \[1\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
        assert snapshot(pair) == before
    pair.run_idle()
    assert pair.finished[1].status == 200
    pair.assert_clean()


def test_decode_abort_with_a_valid_status_still_works(pair):
    pair.faults.stall_at[1] = 1
    pair.prefill.add_request(1, 200)
    pair.run_until(lambda: pair.prefill.state(1) == KVPoll.Transferring)
    pair.decode.abort(1, status=504, message="decode gave up")
    pair.run_idle()
    assert pair.finished[1].status == 504 and "decode gave up" in pair.finished[1].message
    pair.assert_clean()


# --- 15: pack before post, on the device too ------------------------------------------------------


class Gate:
    """Ready objects the test opens by hand: what a CUDA event is to the prefill."""

    def __init__(self):
        self.made: list = []
        self.auto = False

    def __call__(self):
        ev = _Event(self.auto)
        self.made.append(ev)
        return ev

    def open_all(self, auto: bool = False) -> None:
        self.auto = auto
        for ev in self.made:
            ev.done = True


class _Event:
    def __init__(self, done: bool):
        self.done = done
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


def test_a_chunk_is_posted_only_once_its_pack_is_done():
    gate = Gate()
    pair = Pair(ready_event=gate)
    try:
        posts = record_posts(pair)
        pre = pair.prefill
        pre.add_request(1, 200)
        pair.run_until(lambda: pre.state(1) == KVPoll.WaitingForInput)
        for _ in range(5):
            pair.step()
        assert len(gate.made) == 1 and pre.metrics.bytes_packed > 0
        assert posts == [] and pre.reqs[1].staged is not None
        assert gate.made[0].queries >= 5  # polled each step, never waited on
        gate.made[0].done = True
        pair.step()
        assert len(posts) == 1 and pre.state(1) == KVPoll.Transferring
        gate.open_all(auto=True)
        pair.run_idle()
        assert pair.finished[1].status == 200
        assert len(posts) == pages_of(200) // 4 + 1 + 1  # 4 chunks of 4 pages, 1 of 1, AUX
        pair.assert_clean()
    finally:
        pair.close()


def test_aux_waits_for_its_copy_and_an_abort_frees_a_staged_slot():
    gate = Gate()
    pair = Pair(ready_event=gate)
    try:
        posts = record_posts(pair)
        pre = pair.prefill
        pre.add_request(1, 64)  # one chunk, then the AUX
        for _ in range(50):
            gate.open_all()
            pair.step()
            req = pre.reqs.get(1)
            if req is not None and req.staged is not None and req.staged.aux:
                break
        req = pre.reqs[1]
        assert req.staged is not None and req.staged.aux and not req.staged.ready.done
        n = len(posts)
        pair.step(3)
        assert len(posts) == n  # the AUX is not posted before its copy is done
        assert pre.arena.used_bytes > 0
        pre.abort(1)  # never posted: its staging slot is freed with the request
        pair.run_idle()
        assert pair.finished[1].status == 499 and len(posts) == n
        pair.assert_clean()
    finally:
        pair.close()


def test_default_ready_event_on_cpu_is_ready_at_once(pair):
    from kvmem.disagg.prefill import default_ready_event

    assert default_ready_event(torch.device("cpu"))().query() is True


# --- found by tests/disagg/test_fuzz_peer.py ---------------------------------------------------------------


def test_replayed_req_of_a_delivered_request_is_refused(pair):
    """A REQ replayed after its request was delivered re-opened it on the decode side,
    which then held pages and landing bytes until its own timeout (600 s by default)."""
    pair.prefill.add_request(1, 64)
    pair.run_idle()
    assert pair.decode.completed[1].status == 200
    pair.pe.send_notif(pair.de.name, encode("REQ", rid=1, room=1, tokens=64))
    pair.run_until(lambda: pair.decode.metrics.protocol_errors == 1)
    assert pair.decode.idle
    assert pair.decode.alloc.num_allocated == 0
    pair.assert_clean()


def test_boot_for_a_request_that_ended_is_answered_with_abort(pair):
    """A replayed REQ of a request that ended early (here: aborted) is booted again by the
    decode; the prefill answers the BOOT with ABORT at once, so those pages do not wait
    for the decode's timeout."""
    pair.faults.withhold.add(1)
    pair.prefill.add_request(1, 64)
    pair.step(2)
    pair.prefill.abort(1)
    pair.run_idle()
    pair.faults.withhold.clear()
    pair.pe.send_notif(pair.de.name, encode("REQ", rid=1, room=1, tokens=64))
    # no clock advance: the decode's 60 s timeout never fires; the prefill's ABORT frees
    pair.run_until(lambda: pair.decode.ledger.freed_by_reason["abort:499"] == pages_of(64))
    assert pair.decode.idle and pair.decode.completed[1].status == 499
    pair.assert_clean()


def test_inbox_keeps_the_rest_of_a_batch_when_a_handler_fails():
    """A handler bug (anything but ProtocolError) propagates, and the messages fetched with
    it stay queued for the next drain: none is lost."""
    import logging

    from kvmem.disagg import Metrics
    from kvmem.disagg.protocol import Inbox

    class Engine:
        def __init__(self):
            self.batches = [{"p": [encode("PAUSE_ACK", epoch=e) for e in range(4)]}]

        def get_notifs(self):
            return self.batches.pop(0) if self.batches else {}

    seen = []

    def handle(msg, peer):
        if msg.epoch == 1 and not seen.count(1):
            seen.append(1)
            raise RuntimeError("a bug")
        seen.append(msg.epoch)

    metrics = Metrics("decode")
    inbox = Inbox(
        Engine(),
        peer="p",
        receiver="decode",
        handle=handle,
        metrics=metrics,
        log=logging.getLogger("test"),
    )
    with pytest.raises(RuntimeError, match="a bug"):
        inbox.drain()
    assert seen == [0, 1]
    inbox.drain()
    assert seen == [0, 1, 2, 3] and metrics.protocol_errors == 0
