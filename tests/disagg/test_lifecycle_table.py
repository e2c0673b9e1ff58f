"""One test per row of the lifecycle table (docs/disagg.md) (and the quarantine rule): the state
reached, the pages freed exactly once, what the client and the decode side were told.
Both sides run in this process (tests/disagg/harness.py); the clock is the test's."""

from __future__ import annotations

import pytest
import torch

import kvmem
from kvmem.disagg import KVPoll, Outcome, ProtocolError
from kvmem.disagg.decode import DecodeSide
from kvmem.disagg.protocol import encode, parse
from kvmem.transfer.errors import StaleEpochError
from tests.disagg.harness import MODES, SPEC


# Every row in every transfer mode (harness.MODES: push with chunks packed into the landing
# region, push with chunks written direct, pull), through the shared pair fixture
# (tests/disagg/conftest.py).
PAIR_PARAMS = MODES


def pages_of(tokens: int) -> int:
    return -(-tokens // SPEC.page_size)


def freed(side) -> dict:
    return dict(side.ledger.freed_by_reason)


def handle(side, peer: str, msg: dict) -> None:
    """One message through the parser and the side's handler, as its inbox does, with the
    refusal raised (ProtocolError) instead of counted."""
    if isinstance(side, DecodeSide):
        side.handle_message(parse(msg, sender=peer, receiver="decode"))
    else:
        side.messages.handle_message(parse(msg, sender=peer, receiver="prefill"))


def test_success_frees_pages_once_and_delivers_verified_bytes(pair):
    pair.prefill.add_request(1, 200)
    pair.run_idle()
    assert pair.finished[1].status == 200 and pair.prefill.state(1) == KVPoll.Success
    assert freed(pair.prefill) == {"sent": pages_of(200)}
    assert freed(pair.decode) == {"completed": pages_of(200)}
    total = kvmem.packed_nbytes(SPEC, pages_of(200)) + 64
    assert pair.decode.metrics.bytes_landed == pair.decode.metrics.bytes_verified == total
    assert pair.prefill.metrics.bytes_sent == total
    assert pair.prefill.metrics.requests[Outcome.SUCCEEDED.value] == 1
    pair.assert_clean()


def test_abort_in_bootstrapping(pair):
    pair.faults.withhold.add(1)
    pair.prefill.add_request(1, 100)
    pair.step(3)
    assert pair.prefill.state(1) == KVPoll.Bootstrapping and 1 in pair.decode.reqs
    pair.prefill.abort(1)
    pair.run_idle()
    assert pair.finished[1].status == 499 and "aborted by the client" in pair.finished[1].message
    assert pair.decode.completed[1].status == 499  # the decode side was told
    assert freed(pair.prefill) == {"ended:499": 0}
    pair.assert_clean()


def test_abort_in_waiting_for_input(pair):
    pair.faults.stall_at[1] = 0  # bootstrapped, its forward never scheduled
    pair.prefill.add_request(1, 100)
    pair.run_until(lambda: pair.prefill.state(1) == KVPoll.WaitingForInput)
    pair.step(2)
    assert 1 in pair.decode.reqs and pair.decode.ledger.owners()[1] == pages_of(100)
    pair.prefill.abort(1)
    pair.run_idle()
    assert pair.finished[1].status == 499
    assert freed(pair.decode) == {"abort:499": pages_of(100)}
    pair.assert_clean()


def test_abort_in_transferring_drains_before_decode_frees(pair):
    pair.faults.stall_at[1] = 1  # first chunk sent, then stalls
    pair.prefill.add_request(1, 200)
    pair.run_until(lambda: pair.prefill.state(1) == KVPoll.Transferring)
    req = pair.prefill.reqs[1]
    assert req.handles, "the first chunk's write is posted"
    pair.prefill.abort(1)
    if (
        pair.prefill.sending.direct.threshold is None
        and pair.prefill.ctx.config.transfer_mode == "push"
    ):
        # prefill pages freed at once (the packed copy is what is sent)
        assert freed(pair.prefill) == {"ended:499": 64 // 16}
    else:
        # the direct write (or the decode's read) reads the prefill's pages: held until it
        # is DONE or ERR
        assert freed(pair.prefill) == {} and pair.prefill.ledger.holds(1)
    # the decode pages wait for the prefill's ABORT
    assert pair.prefill.state(1) == KVPoll.Failed
    pair.decode.step()
    assert 1 in pair.decode.reqs  # not freed: a write may still land
    pair.run_idle()
    assert pair.finished[1].status == 499
    assert freed(pair.prefill) == {"ended:499": 64 // 16}  # once, in either mode
    assert freed(pair.decode) == {"abort:499": pages_of(200)}
    # the chunk that landed was verified all the same
    assert pair.decode.metrics.bytes_verified == kvmem.packed_nbytes(SPEC, 4)
    pair.assert_clean()


def test_abort_in_running_batch_frees_in_the_same_fill_batch(pair):
    pair.faults.abort_in_batch.add(1)
    pair.prefill.add_request(1, 100)
    pair.run_until(lambda: 1 in pair.finished)
    # consumed by fill_batch of the step whose forward ran: no chunk packed, nothing sent
    assert pair.finished[1].status == 499
    assert pair.prefill.metrics.bytes_packed == 0
    assert freed(pair.prefill) == {"ended:499": 64 // 16}  # the first chunk's pages
    assert pair.prefill.metrics.time_to_free and pair.prefill.metrics.time_to_free[0] == 0.0
    pair.run_idle()
    assert pair.decode.metrics.bytes_landed == 0
    pair.assert_clean()


def test_bootstrap_timeout(pair):
    pair.faults.withhold.add(1)
    pair.prefill.add_request(1, 100)
    pair.step(2)
    pair.clock.advance(31)
    pair.run_idle()
    r = pair.finished[1]
    assert r.status == 504 and r.outcome == Outcome.TIMED_OUT
    assert "bootstrap timeout (> 30 s) for request 1 (room 1)" in r.message
    assert pair.decode.completed[1].status == 504
    pair.assert_clean()


@pytest.mark.parametrize("stall_at, state", [(0, KVPoll.WaitingForInput), (1, KVPoll.Transferring)])
def test_transfer_timeout(pair, stall_at, state):
    pair.faults.stall_at[1] = stall_at
    pair.prefill.add_request(1, 200)
    pair.run_until(lambda: pair.prefill.state(1) == state)
    pair.step(3)
    pair.clock.advance(31)
    pair.run_idle()
    r = pair.finished[1]
    assert r.status == 504 and f"transfer timeout (> 30 s) in {state.name}" in r.message
    assert pair.decode.completed[1].status == 504
    assert freed(pair.decode) == {"abort:504": pages_of(200)}
    pair.assert_clean()


@pytest.mark.parametrize(
    "fail_at", [0, 1, 3, "aux"], ids=["first", "middle", "last", "extra-state"]
)
def test_send_failure(pair, fail_at):
    pair.faults.fail_at[1] = fail_at
    pair.prefill.add_request(1, 256)  # 4 chunks of 64 tokens, then the extra state
    pair.run_idle()
    r = pair.finished[1]
    assert r.status == 500 and r.outcome == Outcome.FAILED
    assert "send of" in r.message and ("extra-state" in r.message if fail_at == "aux" else True)
    assert pair.prefill.state(1) == KVPoll.Failed
    assert pair.decode.completed[1].status == 500  # the decode side was told
    # the pages allocated up to the failed chunk (4 a chunk), freed once
    allocated = pages_of(256) if fail_at == "aux" else 4 * (fail_at + 1)
    assert sum(freed(pair.prefill).values()) == allocated
    assert freed(pair.decode) == {"abort:500": pages_of(256)}
    pair.assert_clean()


def test_abort_is_idempotent_and_checks_its_input(pair):
    pair.prefill.add_request(1, 64)
    pair.prefill.abort(1)
    pair.prefill.abort(1)
    pair.run_idle()
    pair.prefill.abort(1)  # finished: nothing happens
    assert pair.prefill.metrics.requests[Outcome.ABORTED.value] == 1
    with pytest.raises(ProtocolError, match="unknown request id 99"):
        pair.prefill.abort(99)
    pair.assert_clean()


def test_quarantine_holds_decode_pages_while_a_write_is_posted(pair):
    pair.faults.stall_at[1] = 1
    pair.prefill.add_request(1, 200)
    pair.run_until(lambda: pair.prefill.state(1) == KVPoll.Transferring)
    h, _ = pair.prefill.reqs[1].handles[0]
    assert h.state == "PROC"  # posted; nobody has polled it yet
    held = pair.decode.ledger.pages(1).clone()
    pair.decode.abort(1)
    audit = pair.decode.audit()
    assert audit["quarantined"] == {1: sorted(held.tolist())} and not audit["leaked"]
    # other requests cannot get those pages while the write is posted
    free_before = pair.decode.alloc.num_free
    got = pair.decode.alloc.alloc(free_before)
    assert not set(got.tolist()) & set(held.tolist())
    pair.decode.alloc.free(got)
    pair.decode.step()
    pair.decode.step()
    assert 1 in pair.decode.reqs  # still quarantined until the prefill answers
    pair.run_idle()
    assert pair.finished[1].status == 499 and "decode side" in pair.finished[1].message
    assert freed(pair.decode) == {"abort:499": pages_of(200)}
    pair.assert_clean()


def test_prefill_pause_aborts_everything_503_and_resume_serves_again(pair):
    pair.faults.withhold.add(1)
    pair.faults.stall_at[2] = 1
    for rid, n in ((1, 64), (2, 200), (3, 128)):
        pair.prefill.add_request(rid, n)
    pair.run_until(
        lambda: (
            pair.prefill.reqs.get(2) is not None and pair.prefill.state(2) == KVPoll.Transferring
        )
    )
    epoch = pair.prefill.pool.epoch
    pair.prefill.begin_pause()
    pair.run_until(lambda: pair.prefill.paused)
    assert pair.prefill.pool.released and "kv" not in pair.pe.registrations()
    assert pair.prefill.alloc.num_allocated == 0
    for rid in (1, 2):
        assert pair.finished[rid].status == 503 and "paused" in pair.finished[rid].message
    pair.prefill.resume()
    assert pair.prefill.pool.epoch == epoch + 1 and "kv" in pair.pe.registrations()
    pair.faults.stall_at.clear()
    pair.prefill.add_request(4, 150)
    pair.run_idle()
    assert pair.finished[4].status == 200
    assert pair.prefill.metrics.pauses == 1
    pair.assert_clean()


def test_prefill_pause_ends_a_request_without_a_transfer_at_once(pair):
    """A pause ends a request waiting for its next chunk (503) in the step that begins it,
    not once another request's transfer has drained: that drain can last the transfer
    timeout (an offered read to a dead decode), and the waiting request would end 504 on
    both sides meanwhile (a demo with a killed decode did, 2026-12-06)."""
    pair.faults.stall_at[1] = 1  # first chunk sent (pull: offered), then stalls
    pair.faults.stall_at[2] = 0  # bootstrapped, its forward never scheduled
    pair.prefill.add_request(1, 200)
    pair.prefill.add_request(2, 100)
    pair.run_until(
        lambda: (
            pair.prefill.state(1) == KVPoll.Transferring
            and pair.prefill.state(2) == KVPoll.WaitingForInput
        )
    )
    pair.prefill.begin_pause()
    pair.prefill.step()  # the decode does not step: an offered read stays in flight
    assert pair.finished[2].status == 503 and "paused" in pair.finished[2].message
    assert pair.prefill.state(1) == KVPoll.Failed  # ENDING: its transfer drains first
    pair.decode.step()
    assert pair.decode.completed[2].status == 503  # told at once (ABORT)
    pair.run_until(lambda: pair.prefill.paused)
    assert pair.finished[1].status == 503
    pair.prefill.resume()
    pair.faults.stall_at.clear()
    pair.run_idle()
    pair.assert_clean()


def test_a_decode_the_caller_knows_is_gone_ends_its_requests_at_once(pair):
    """``peer_gone``: every request bound to the dead decode ends 500 in that call, its
    transfer in flight given up (a posted write cancelled, an offer dropped) and every
    prefill page freed then, not at the transfer timeout; nothing more is sent to it, a
    new request naming it is refused, and a pause no longer waits for it."""
    pre = pair.prefill
    pair.faults.stall_at[1] = 1  # first chunk in flight (pull: offered), then stalls
    pair.faults.stall_at[2] = 0  # bootstrapped, waiting for its first chunk
    pre.add_request(1, 200)
    pre.add_request(2, 100)
    pair.run_until(
        lambda: pre.state(1) == KVPoll.Transferring and pre.state(2) == KVPoll.WaitingForInput
    )
    pre.step()  # the decode does not step: the transfer of request 1 stays in flight
    sent = pre.metrics.send_errors
    assert pre.peer_gone(pair.de.name) == 2
    for rid in (1, 2):
        assert pair.finished[rid].status == 500 and "is gone" in pair.finished[rid].message
    assert not pre.reqs and pre.alloc.num_allocated == 0 and pre.arena.used_bytes == 0
    assert pre.audit() == {"leaked": {}, "quarantined": {}, "unaccounted": []}
    assert pre.engine.open_handles() == 0
    assert pre.metrics.send_errors == sent  # no ABORT tried to the dead peer
    with pytest.raises(ValueError, match="is gone"):
        pre.add_request(3, 64)
    assert pre.peer_gone(pair.de.name) == 0
    with pytest.raises(ValueError, match="not a decode peer"):
        pre.peer_gone("nobody")
    pre.begin_pause()
    pre.step()
    assert pre.paused  # nothing of the dead peer's to drain


def test_decode_pause_refuses_stale_writes_and_resumes(pair):
    pair.faults.stall_at[1] = 1
    pair.prefill.add_request(1, 200)
    pair.run_until(lambda: pair.prefill.state(1) == KVPoll.Transferring)
    old = pair.pe.remote(pair.de.name, "landing")
    pair.decode.begin_pause()
    pair.run_until(lambda: pair.decode.paused)
    assert pair.finished[1].status == 503 and "decode side is pausing" in pair.finished[1].message
    assert pair.decode.pool.released and pair.decode.alloc.num_allocated == 0
    pair.decode.resume()
    assert pair.decode.pool.epoch == 1
    pair.step(2)  # the prefill learns the new metadata
    assert pair.pe.remote(pair.de.name, "landing").epoch == 1
    src = pair.prefill.staging.tensor
    with pytest.raises(StaleEpochError):
        pair.pe.post_write([(src.data_ptr(), 64)], old, [(old.regions[0][0], 64)])
    pair.faults.stall_at.clear()
    pair.prefill.add_request(2, 150)
    pair.run_idle()
    assert pair.finished[2].status == 200 and pair.decode.metrics.bytes_corrupt == 0
    pair.assert_clean()


def test_bad_inputs_from_the_caller(pair):
    pre = pair.prefill
    with pytest.raises(ValueError, match="tokens must be an int > 0"):
        pre.add_request(1, -5)
    with pytest.raises(ValueError, match=r"rid must be an int in \[0, 2\*\*63\), got -1"):
        pre.add_request(-1, 10)
    with pytest.raises(ValueError, match="600 tokens > the 512-token maximum"):
        pre.add_request(1, 600)
    pre.add_request(1, 32)
    with pytest.raises(ProtocolError, match="request id 1 is in use"):
        pre.add_request(1, 32)
    with pytest.raises(ProtocolError, match="bootstrap room 1 is in use"):
        pre.add_request(2, 32, room=1)
    assert set(pre.reqs) == {1}
    pair.run_idle()
    pair.assert_clean()


def test_bad_inputs_from_the_peer_change_nothing(pair):
    dec, pre = pair.decode, pair.prefill
    pair.faults.stall_at[1] = 1
    pre.add_request(1, 200)
    pair.run_until(lambda: pre.state(1) == KVPoll.Transferring)
    pair.step(2)
    before = (dict(dec.ledger.owners()), dec.reqs[1].pages_done, dec.arena.used_bytes)
    pages = pages_of(200)
    bad = [
        (
            dict(t="CHUNK", rid=77, first=0, last=1, off=0, nbytes=1, final=False, direct=False),
            "unknown request 77",
        ),
        (
            dict(
                t="CHUNK",
                rid=1,
                first=4,
                last=pages + 1,
                off=kvmem.packed_nbytes(SPEC, 4),
                nbytes=kvmem.packed_nbytes(SPEC, pages - 3),
                final=True,
                direct=False,
            ),
            "outside its 13 pages",
        ),
        (
            dict(
                t="CHUNK",
                rid=1,
                first=4,
                last=6,
                off=kvmem.packed_nbytes(SPEC, 4),
                nbytes=123,
                final=False,
                direct=False,
            ),
            "123 bytes, pages \\[4, 6\\) pack to",
        ),
        (
            dict(
                t="CHUNK",
                rid=1,
                first=4,
                last=6,
                off=0,
                nbytes=kvmem.packed_nbytes(SPEC, 2),
                final=False,
                direct=False,
            ),
            "offset 0 is not where pages from 4 land",
        ),
        (dict(t="AUX", rid=1, off=0, nbytes=64), "is not its extra-state slot"),
        (dict(t="REQ", rid=1, room=9, tokens=10), "request id 1 is in use"),
        (dict(t="REQ", rid=5, room=1, tokens=10), "bootstrap room 1 is in use"),
        (
            dict(t="REQ", rid=5, room=5, tokens=-1),
            "field 'tokens' must be an int in \\[1, 2\\*\\*63\\)",
        ),
        (dict(t="REQ", rid=5, room=5, tokens=513), "tokens outside"),
        (
            dict(t="BOOT", rid=1, room=1, off=0, nbytes=1, epoch=0, pages="1:1"),
            "unexpected message BOOT",
        ),
    ]
    for msg, match in bad:
        with pytest.raises(ProtocolError, match=match):
            handle(dec, pair.pe.name, msg)
    assert (dict(dec.ledger.owners()), dec.reqs[1].pages_done, dec.arena.used_bytes) == before
    errors = dec.metrics.protocol_errors
    dec.inbox.deliver("mallory", encode("ABORT", rid=1, status=499, reason="x"))
    assert dec.metrics.protocol_errors == errors + 1 and 1 in dec.reqs
    # the prefill side likewise
    for msg, match in [
        (
            dict(t="BOOT", rid=42, room=42, off=0, nbytes=10, epoch=0, pages="1:1"),
            "unknown request 42",
        ),
        (
            dict(t="BOOT", rid=1, room=1, off=0, nbytes=10, epoch=0, pages="1:13"),
            "in state Transferring",
        ),
        (dict(t="ABORT_REQ", rid=42, status=499, reason="x"), "unknown request 42"),
        (
            dict(t="CHUNK", rid=1, first=0, last=1, off=0, nbytes=1, final=False, direct=False),
            "unexpected message CHUNK",
        ),
    ]:
        with pytest.raises(ProtocolError, match=match):
            handle(pre, pair.de.name, msg)
    # garbage on the wire is counted, not fatal
    pair.pe.send_notif(pair.de.name, b"\x00not json")
    pair.pe.send_notif(pair.de.name, encode("ABORT", rid=4242, status=499, reason="x"))
    pair.step(2)
    assert dec.metrics.protocol_errors == errors + 3
    pair.faults.stall_at.clear()
    pair.run_idle()
    assert pair.finished[1].status == 200
    pair.assert_clean()


def test_chunk_for_an_aborted_request_is_refused_once_freed(pair):
    pair.prefill.add_request(1, 64)
    pair.prefill.abort(1)
    pair.run_idle()
    with pytest.raises(ProtocolError, match="unknown request 1"):
        handle(
            pair.decode,
            pair.pe.name,
            dict(
                t="CHUNK",
                rid=1,
                first=0,
                last=1,
                off=0,
                nbytes=kvmem.packed_nbytes(SPEC, 1),
                final=True,
                direct=False,
            ),
        )
    pair.assert_clean()


def test_metrics_exposition(pair):
    pair.prefill.add_request(1, 64)
    pair.run_idle()
    from prometheus_client import CollectorRegistry

    import kvmem.disagg.metrics

    reg = kvmem.disagg.metrics.register(pair.prefill, CollectorRegistry())
    get = reg.get_sample_value
    assert get("kvmem_requests_total", {"side": "prefill", "outcome": "succeeded"}) == 1
    assert get("kvmem_pages_freed_total", {"side": "prefill", "reason": "sent"}) == 4
    kvmem.disagg.metrics.unregister(pair.prefill, reg)
    line = pair.decode.metrics.log_line(pair.decode.ledger.freed_by_reason)
    assert "succeeded=1" in line and "completed=4" in line
    assert torch.tensor(0).numel() == 1


def test_vanished_decode_is_counted_not_fatal(pair):
    """The decode side goes away: its write in flight fails (500, the engine reports the
    remote disconnect), sends to it fail and are counted, the bootstrap timeout ends the
    request it never answered (504), and every page is freed once."""
    pair.faults.stall_at[1] = 1
    pair.prefill.add_request(1, 200)
    pair.run_until(lambda: pair.prefill.state(1) == KVPoll.Transferring)
    pair.vanish_decode()  # its side and engine closed, as when its process dies
    pair.prefill.add_request(2, 64)
    for _ in range(3):
        pair.prefill.step()
    pair.clock.advance(31)
    for _ in range(5):
        pair.prefill.step()
    # push: the engine reports the write's remote disconnect; pull: the decode's read was
    # cancelled with it and the offered pages' quarantine timed out (logged)
    assert pair.finished[1].status == 500 and (
        "DISCONNECT" in pair.finished[1].message
        if pair.prefill.ctx.config.transfer_mode == "push"
        else "no PULLED" in pair.finished[1].message
    )
    assert pair.finished[2].status == 504
    assert pair.prefill.metrics.send_errors >= 1
    assert pair.prefill.audit() == {"leaked": {}, "quarantined": {}, "unaccounted": []}
    assert pair.prefill.alloc.num_allocated == 0
