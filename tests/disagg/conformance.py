"""The contract's cases (kvmem/lifecycle.py) driven through kvmem's own sides: both sides
in this process over the loopback engine, the clock the test's (tests/disagg/harness.py).

:func:`run` puts one request in the case's state, lets the case's cause meet it, runs the
pair until both sides are idle and returns what was :class:`Seen`: the ending the client
got, what the decode side was told, every page freed by reason on either side, and what
is still held.  The suite (test_conformance.py) holds that to the case's row."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmem.disagg import KVPoll
from kvmem.lifecycle import Case, Cause, State
from tests.disagg.harness import Pair

RID = 1
TOKENS = 256  # four chunks of 64 tokens, then the extra state
BOOTSTRAP_TIMEOUT = TRANSFER_TIMEOUT = 30.0  # the pair's


@dataclass
class Seen:
    """What one case did: the client's status (None: no ending), the status the decode
    side ended the request with (None: never told), pages freed by ledger reason on each
    side, and what each side still holds when idle (audit)."""

    status: int | None = None
    message: str = ""
    decode_told: int | None = None
    prefill_freed: dict = field(default_factory=dict)
    decode_freed: dict = field(default_factory=dict)
    held: list = field(default_factory=list)


def _state(pair: Pair) -> KVPoll | None:
    return pair.prefill.state(RID) if RID in pair.prefill.reqs else None


def _reach(pair: Pair, state: State) -> None:
    """Add the request and run the pair until it is in ``state`` (not the running batch:
    its cause meets it from the faults' ``during_forward``)."""
    f = pair.faults
    if state is State.BOOTSTRAPPING:
        f.withhold.add(RID)
        pair.prefill.add_request(RID, TOKENS)
        pair.step(3)
    elif state is State.WAITING:
        f.stall_at[RID] = 0  # bootstrapped, its forward never scheduled
        pair.prefill.add_request(RID, TOKENS)
        pair.run_until(lambda: _state(pair) == KVPoll.WaitingForInput)
        pair.step(2)
    elif state is State.TRANSFERRING:
        f.stall_at[RID] = 1  # the first chunk sent, then it stalls
        pair.prefill.add_request(RID, TOKENS)
        pair.run_until(lambda: _state(pair) == KVPoll.Transferring)
    else:
        raise AssertionError(state)
    expect = {
        State.BOOTSTRAPPING: KVPoll.Bootstrapping,
        State.WAITING: KVPoll.WaitingForInput,
        State.TRANSFERRING: KVPoll.Transferring,
    }[state]
    assert _state(pair) == expect, (state, _state(pair))


def _in_batch(pair: Pair, act) -> None:
    """The request's forward runs when ``act`` meets it (the faults' hook inside the
    prefill's forward)."""
    pair.faults.during_forward = lambda side, batch: (
        act() if any(req.rid == RID for req, *_ in batch) else None
    )
    pair.prefill.add_request(RID, TOKENS)
    pair.run_until(lambda: RID in pair.finished or pair.prefill.pausing)


def _move_decode_memory(pair: Pair) -> None:
    """The decode's memory moves to a new epoch behind the prefill's request: its kv and
    landing registrations made again (as after a release and resume), published."""
    dec = pair.decode
    pair.step(3)  # what landed before is verified first (as a pause would wait for it)
    for name in ("kv", "landing"):
        dec.engine.deregister(name)
    dec.pool.release()
    dec.pool.resume()
    dec.engine.register_pool(dec.pool, "kv")
    dec.engine.register(
        "landing", dec.memory.landing_mem.regions(), dec.pool.epoch, dec.pool.device
    )
    dec.peers.publish_metadata()
    pair.run_until(lambda: pair.pe.remote(pair.de.name, "kv").epoch == dec.pool.epoch)


def _meet(pair: Pair, c: Case) -> None:
    """Bring the case's request to its state and let its cause meet it there."""
    pre, dec, f = pair.prefill, pair.decode, pair.faults
    cause, state = c.cause, c.state
    if cause is Cause.SEND_FAILED:
        f.fail_at[RID] = 1  # the middle chunk's write
        pre.add_request(RID, TOKENS)
        return
    if cause is Cause.EXTRA_STATE_FAILED:
        f.fail_at[RID] = "aux"
        pre.add_request(RID, TOKENS)
        return
    if state is State.ARRIVING:  # only a release meets a request before it exists
        assert cause is Cause.PREFILL_RELEASE, c
        pre.begin_pause()
        pair.run_until(lambda: pre.paused)
        pre.add_request(RID, TOKENS)
        return
    if state is State.IN_BATCH:
        act = {
            Cause.CLIENT_ABORT: lambda: pre.abort(RID),
            Cause.PREFILL_RELEASE: pre.begin_pause,
        }[cause]
        _in_batch(pair, act)
        return
    _reach(pair, state)
    if cause is Cause.CLIENT_ABORT:
        pre.abort(RID)
    elif cause is Cause.DECODE_ABORT:
        dec.abort(RID)
    elif cause is Cause.BOOTSTRAP_TIMEOUT:
        pair.clock.advance(BOOTSTRAP_TIMEOUT + 1)
    elif cause is Cause.TRANSFER_TIMEOUT:
        pair.step(3)
        pair.clock.advance(TRANSFER_TIMEOUT + 1)
    elif cause is Cause.PEER_GONE:
        pre.step()  # a transfer in flight stays so: the decode does not step
        assert pre.peer_gone(pair.de.name) == 1
        pair.vanish_decode()
    elif cause is Cause.PREFILL_RELEASE:
        pre.begin_pause()
    elif cause is Cause.DECODE_RELEASE:
        dec.begin_pause()
    elif cause is Cause.STALE_SEND:
        _move_decode_memory(pair)
        f.stall_at.clear()
    else:
        raise AssertionError(c)


def run(pair: Pair, c: Case) -> Seen:
    """Drive case ``c`` on a fresh ``pair`` to its end; what it did."""
    pre, dec = pair.prefill, pair.decode
    _meet(pair, c)
    gone = c.cause is Cause.PEER_GONE
    if gone:
        pair.run_until(lambda: pre.idle)
    else:
        pair.run_until(lambda: (pre.idle or pre.paused) and (dec.idle or dec.paused))
        if pre.paused:
            pre.resume()
        if dec.paused:
            dec.resume()
        pair.faults.stall_at.clear()
        pair.faults.withhold.clear()
        pair.run_idle()
    seen = Seen(prefill_freed=dict(pre.ledger.freed_by_reason))
    r = pair.finished.get(RID)
    if r is not None:
        seen.status, seen.message = r.status, r.message
    if not gone:
        told = dec.completed.get(RID)
        seen.decode_told = None if told is None else told.status
        seen.decode_freed = dict(dec.ledger.freed_by_reason)
    sides = (pre,) if gone else (pre, dec)
    seen.held = [
        (type(s).__name__, a)
        for s in sides
        if (a := s.audit()) != {"leaked": {}, "quarantined": {}, "unaccounted": []}
    ]
    seen.held += [
        (type(s).__name__, "allocated", s.alloc.num_allocated)
        for s in sides
        if s.alloc.num_allocated
    ]
    return seen
