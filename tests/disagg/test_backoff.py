"""Pacing of the worker loops: each side's step() says whether it made progress, and the
loop's Backoff naps only after steps that made none (kvmem.demo.worker drives both sides
this way).  Real sides over two engines in this process (tests/disagg/harness.py); the
clock is the harness's, so the timeouts here fire however long the naps are."""

from __future__ import annotations

import time

import pytest

from kvmem.disagg.pacing import Backoff
from tests.disagg.harness import Pair

FIRST, MOST = 5e-6, 40e-6


class Naps:
    """A Backoff whose sleeps are recorded, not slept."""

    def __init__(self, spins: int = 1):
        self.slept: list[float] = []
        self.backoff = Backoff(FIRST, MOST, spins, sleep=self.slept.append)

    def step(self, side) -> tuple[bool, float]:
        """One loop iteration as the demo's workers run it: (progressed, nap taken)."""
        moved = side.step()
        return moved, self.backoff.pace(moved)


def _until_progress(naps: Naps, side, other, seconds: float = 5.0) -> list:
    """Step ``side`` until a step progresses; every (progressed, nap) on the way.  The
    ``other`` side steps too (unpaced): a NIXL notification leaves over UCX as its
    sender's engine is driven (no progress thread)."""
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        other.step()
        out.append(naps.step(side))
        if out[-1][0]:
            return out
        time.sleep(0.0005)
    raise AssertionError(f"no progress in {seconds} s: {out[-5:]}")


# the shared pair fixture (tests/disagg/conftest.py), once per transfer mode
PAIR_PARAMS = {"push": dict(transfer_mode="push"), "pull": dict(transfer_mode="pull")}


def test_backoff_spins_then_doubles_to_the_cap_and_resets_on_progress():
    slept = []
    b = Backoff(FIRST, MOST, spins=2, sleep=slept.append)
    assert [b.pace(False) for _ in range(7)] == [0.0, 0.0, 5e-6, 10e-6, 20e-6, 40e-6, 40e-6]
    assert slept == [5e-6, 10e-6, 20e-6, 40e-6, 40e-6] and b.naps == 5
    assert b.pace(True) == 0.0 and b.idle_steps == 0
    # after progress: the spins again, then from the first nap
    assert [b.pace(False) for _ in range(3)] == [0.0, 0.0, 5e-6]
    assert b.napped == pytest.approx(sum(slept)) and len(slept) == 6
    assert Backoff(FIRST, MOST).pace(False) == FIRST  # spins=0: the first idle step naps
    for bad in (
        dict(first=0.0, most=1.0),
        dict(first=2.0, most=1.0),
        dict(first=1e-6, most=1e-5, spins=-1),
        dict(first=1e-6, most=1e-5, spins=True),
    ):
        with pytest.raises(ValueError):
            Backoff(**bad)
    # naps that are not finite numbers of seconds: named in the message
    for bad, name in (
        (dict(first=True, most=1.0), "first"),
        (dict(first=1e-6, most=True), "most"),
        (dict(first=float("nan"), most=1.0), "first"),
        (dict(first=1e-6, most=float("nan")), "most"),
        (dict(first=1e-6, most=float("inf")), "most"),
        (dict(first="1e-6", most=1.0), "first"),
    ):
        with pytest.raises(ValueError, match=f"Backoff: {name} must be a finite number"):
            Backoff(**bad)


def _state(side) -> tuple:
    """What a step can change on a side, as a comparable value."""
    m = side.metrics.as_dict()
    m["time_to_free"] = len(m["time_to_free"])
    if hasattr(side, "finished"):  # prefill
        reqs = tuple(
            (
                r.rid,
                r.state,
                r.reason,
                len(r.handles),
                r.staged is not None,
                len(r.pending),
                r.done_tokens,
                r.seq,
            )
            for r in side.reqs.values()
        )
        done = tuple(side.finished)
    else:
        reqs = tuple(
            (r.rid, r.state, r.pages_done, len(r.reads), r.reason) for r in side.reqs.values()
        )
        done = tuple(side.completed)
    return reqs, done, m, tuple(side.ledger.owners().items()), side.paused


def test_steps_nap_only_without_progress_and_never_after_progress(pair):
    pre, dec = Naps(), Naps()
    pair.prefill.add_request(1, 200)  # 4 chunks of 64 tokens
    pair.prefill.add_request(2, 130)
    # Bootstrapping, the decode has not stepped: nothing to do here; after the one spin,
    # naps doubling to the cap
    assert [pre.step(pair.prefill) for _ in range(5)] == [
        (False, 0.0),
        (False, 5e-6),
        (False, 10e-6),
        (False, 20e-6),
        (False, 40e-6),
    ]
    # both loops to the end: a step that progressed never naps; one that did not changed
    # nothing, and naps after the spin
    seen = {"prefill": [], "decode": []}
    for _ in range(5000):
        for name, naps, side in (("prefill", pre, pair.prefill), ("decode", dec, pair.decode)):
            before, spun, last = _state(side), naps.backoff.idle_steps, naps.backoff.nap
            moved, nap = naps.step(side)
            seen[name].append(moved)
            if moved:
                assert nap == 0.0 and naps.backoff.idle_steps == 0
            else:
                assert _state(side) == before, name  # "no progress" really changed nothing
                # the first idle step spins; then twice the last nap, from FIRST to MOST
                assert nap == (0.0 if spun == 0 else min(max(2 * last, FIRST), MOST))
        if pair.prefill.idle and pair.decode.idle:
            break
        time.sleep(0.0002)  # let UCX deliver (loopback, no progress thread)
    assert pair.finished == {1: pair.finished[1], 2: pair.finished[2]}
    assert {r.status for r in pair.finished.values()} == {200}
    for name in seen:  # both made progress, over several steps
        assert sum(seen[name]) >= 4, (name, seen[name])
    pair.run_idle()
    pair.assert_clean()
    # both idle: no step progresses
    assert [pre.step(pair.prefill)[0] for _ in range(3)] == [False] * 3
    assert [dec.step(pair.decode)[0] for _ in range(3)] == [False] * 3


def test_timeouts_fire_between_naps_and_count_as_progress(pair):
    pre, dec = Naps(), Naps()
    pair.faults.withhold.add(1)  # the decode never answers REQ 1
    pair.prefill.add_request(1, 64)
    # REQ 1 seen (withheld), a new request: progress
    assert _until_progress(dec, pair.decode, pair.prefill)[-1] == (True, 0.0)
    # then both only wait: no progress, naps
    assert [dec.step(pair.decode)[0] for _ in range(3)] == [False] * 3
    assert [pre.step(pair.prefill)[0] for _ in range(4)] == [False] * 4
    assert pre.backoff.nap > 0 and dec.backoff.nap > 0
    pair.clock.advance(pair.decode.ctx.config.timeout + 1)  # past both sides' timeouts
    # nothing arrived at the decode: its own timeout is the progress (ABORT_REQ, quarantine)
    assert dec.step(pair.decode) == (True, 0.0)
    assert pair.decode.reqs[1].state == "quarantined"
    assert pre.step(pair.prefill) == (True, 0.0)  # its bootstrap timeout: 504
    assert pair.finished[1].status == 504
    pair.run_idle()
    assert pair.decode.completed[1].status == 504
    pair.assert_clean()


def test_the_prefills_own_timeout_is_progress_with_nothing_arriving(pair):
    pre = Naps()
    pair.prefill.add_request(1, 64)  # the decode never steps: no BOOT, no message at all
    assert [pre.step(pair.prefill)[0] for _ in range(4)] == [False] * 4
    pair.clock.advance(pair.prefill.bootstrap_timeout + 1)
    assert pre.step(pair.prefill) == (True, 0.0)
    assert pair.finished[1].status == 504 and pair.prefill.idle


def test_pull_quarantine_expiry_on_the_prefill_is_progress():
    p = Pair(transfer_mode="pull")
    try:
        pre = Naps()
        real = p.de.send_notif
        p.de.send_notif = lambda peer, msg: None if b'"PULLED"' in msg else real(peer, msg)  # lost
        p.faults.stall_at[1] = 1
        p.prefill.add_request(1, 200)
        p.run_until(lambda: p.decode.metrics.bytes_landed > 0)  # chunk 0 read, not answered
        p.prefill.abort(1)
        assert [pre.step(p.prefill)[0] for _ in range(4)] == [False] * 4
        assert p.prefill.ledger.holds(1)  # quarantined: the decode may be reading
        p.clock.advance(p.prefill.ctx.config.quarantine_timeout + 1)
        assert pre.step(p.prefill) == (True, 0.0)
        assert dict(p.prefill.ledger.freed_by_reason) == {"ended:499": 4}
    finally:
        p.close()


def test_a_write_in_flight_is_the_prefills_to_poll_an_offer_is_not():
    # push: a posted write completes (and sends its CHUNK) only at this side's poll: the
    # loop must not nap on it
    p = Pair()
    try:
        p.prefill.add_request(1, 200)
        for _ in range(500):
            if p.prefill.step() and p.prefill.writes_in_flight:
                break
            p.decode.step()
        else:
            raise AssertionError("no write posted")
        handles = list(p.prefill.reqs[1].handles)
        assert handles and p.pe.open_handles() >= 1
        for _ in range(2000):
            moved = p.prefill.step()
            if p.prefill.reqs[1].handles != handles:
                assert moved  # the poll that saw it DONE (and sent its CHUNK): progress
                break
            assert p.prefill.writes_in_flight  # PROC: the loop keeps polling, no nap
            p.decode.step()  # (UCX over loopback completes it as both engines are driven)
            time.sleep(0.0002)
        else:
            raise AssertionError("the write never completed")
        p.run_idle()
        assert p.finished[1].status == 200
        p.assert_clean()
    finally:
        p.close()
    # pull: an offer waits for the decode's PULLED: no write of ours in flight, nap
    p = Pair(transfer_mode="pull")
    try:
        p.faults.stall_at[1] = 1
        p.prefill.add_request(1, 200)
        p.run_until(lambda: 1 in p.prefill.reqs and p.prefill.reqs[1].handles)
        assert not p.prefill.writes_in_flight
        # the decode's read stays PROC while its engine says so: its own to poll
        real = p.de.poll
        p.de.poll = lambda h: "PROC"
        p.run_until(lambda: p.decode.reads_in_flight)
        assert p.decode.step() is False and p.decode.reads_in_flight
        p.de.poll = real
        for _ in range(2000):
            moved = p.decode.step()
            if not p.decode.reads_in_flight:
                assert moved  # the poll that saw it DONE (verified, PULLED sent): progress
                break
            p.prefill.step()
            time.sleep(0.0002)
        else:
            raise AssertionError("the read never completed")
        p.faults.stall_at.clear()
        p.run_idle()
        assert p.finished[1].status == 200
        p.assert_clean()
    finally:
        p.close()
