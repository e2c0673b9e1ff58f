"""The request states of both PD sides (kvmem/disagg/states.py) and the one transition
of each side (its request tables' ``set_state``):

* the drawing in each side's module docstring is exactly its edge table (parsed here);
* every edge of the table is accepted, every other one refused with an error naming the
  request and both states, the request unchanged;
* each side's dispatch table handles exactly the message kinds the protocol sends it;
* real lifecycles (both sides in this process, tests/disagg/harness.py) take every drawn
  edge, in each transfer mode, and
  nothing else: the sides log each change (DEBUG), and per request the changes form one
  path from its entry;
* a property test: random programs of requests, faults, aborts on both sides, timeouts
  and pauses, with the invariants each state promises checked after every operation
  (8 derandomized programs; ``KVMEM_FUZZ_EXAMPLES=N`` runs N random ones instead).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import types
import unittest.mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvmem.disagg.decode as decode_mod
import kvmem.disagg.prefill as prefill_mod
from kvmem.disagg import KVPoll, ProtocolError
from kvmem.disagg import device as dev
from kvmem.disagg.counters import Metrics
from kvmem.disagg.decode_pause import DecodePause
from kvmem.disagg.decode_request import DecodeRequest
from kvmem.disagg.decode_request import DecodeRequests
from kvmem.disagg.prefill_pause import PrefillPause
from kvmem.disagg.prefill_request import PrefillRequest
from kvmem.disagg.prefill_request import PrefillRequests
from kvmem.disagg.protocol import DECODE_RECEIVES, PREFILL_RECEIVES, PauseAck, Pulled
from kvmem.disagg.states import (
    DECODE_EDGES,
    DECODE_PAUSE_EDGES,
    PREFILL_EDGES,
    PREFILL_PAUSE_EDGES,
    DecodeState,
    IllegalPhase,
    IllegalTransition,
    PausePhase,
    PrefillState,
    set_phase,
)
from tests.disagg.harness import Pair
from tests.disagg.test_sync_free import _Lag
from tests.util import examples

SIDES = {
    "prefill": (prefill_mod, PrefillState, PREFILL_EDGES),
    "decode": (decode_mod, DecodeState, DECODE_EDGES),
}
# the one way each side's requests change state: its request tables' set_state
TABLES = {"prefill": PrefillRequests, "decode": DecodeRequests}
MODES = {"packed": {}, "direct": {"direct_threshold": 0}, "pull": {"transfer_mode": "pull"}}
P, D = PrefillState, DecodeState

# one edge of a drawing: "    SRC   --what happens-----> DST"
_EDGE_LINE = re.compile(r"^    (?P<src>new|[A-Z_]+) +--(?P<label>.*\S)-*-> (?P<dst>[A-Z_]+)$")


def drawn_edges(module, states) -> list:
    """The edges the module docstring draws: the first literal block (after "::"), every
    line of which must be one edge."""
    lines = module.__doc__.splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith("::")) + 1
    edges = []
    for line in lines[start:]:
        if line and not line.startswith("    "):
            break  # the block ends at the first line that is not indented
        if not line.strip():
            continue
        m = _EDGE_LINE.match(line)
        assert m, f"{module.__name__}: a line of the drawing is no edge: {line!r}"
        src = None if m["src"] == "new" else states[m["src"]]
        edges.append((src, states[m["dst"]]))
    return edges


@pytest.mark.parametrize("side", sorted(SIDES))
def test_the_docstring_draws_exactly_the_edge_table(side):
    module, states, table = SIDES[side]
    edges = drawn_edges(module, states)
    assert len(edges) == len(set(edges)), "an edge is drawn twice"
    assert set(edges) == table, (
        f"drawn, not in the table: {set(edges) - table}; in the table, not drawn: "
        f"{table - set(edges)}"
    )
    # every state is reachable from an entry and on some edge
    reach, todo = set(), [None]
    while todo:
        s = todo.pop()
        for a, b in table:
            if a == s and b not in reach:
                reach.add(b)
                todo.append(b)
    assert reach == set(states)


def _request(side: str, src):
    if side == "prefill":
        return PrefillRequest(7, 7, 100, "peer", state=src)
    return DecodeRequest(7, 7, 100, "peer", state=src)


@pytest.fixture(scope="module")
def sides():
    p = Pair()
    yield {"prefill": p.prefill, "decode": p.decode}
    p.close()


@pytest.mark.parametrize("side", sorted(SIDES))
def test_every_edge_of_the_table_is_accepted(side):
    _, _, table = SIDES[side]
    for src, dst in sorted(table, key=str):
        req = _request(side, src)
        TABLES[side](Metrics(side)).set_state(req, dst)
        assert req.state is dst


@pytest.mark.parametrize("side", sorted(SIDES))
def test_every_other_edge_is_refused_naming_the_request_and_both_states(side):
    _, states, table = SIDES[side]
    refused = 0
    for src in [None, *states]:
        for dst in states:
            if (src, dst) in table:
                continue
            req = _request(side, src)
            with pytest.raises(IllegalTransition) as e:
                TABLES[side](Metrics(side)).set_state(req, dst)
            name = "(new)" if src is None else src.name
            assert str(e.value) == (
                f"{side}: request 7: no edge {name} -> {dst.name} in the {side}'s state table"
            )
            assert (e.value.side, e.value.rid, e.value.src, e.value.dst) == (side, 7, src, dst)
            assert req.state is src  # unchanged
            refused += 1
    assert refused == (len(states) + 1) * len(states) - len(table) > 0


def test_terminal_states_have_no_way_out_and_prefill_states_report_kvpoll():
    for table, states in ((PREFILL_EDGES, (P.SUCCEEDED, P.FAILED)), (DECODE_EDGES, (D.FREED,))):
        assert not [e for e in table if e[0] in states]
    assert {s: s.poll for s in P} == {
        P.BOOTSTRAPPING: KVPoll.Bootstrapping,
        P.WAITING_FOR_INPUT: KVPoll.WaitingForInput,
        P.TRANSFERRING: KVPoll.Transferring,
        P.KV_POSTED: KVPoll.Transferring,
        P.AUX_STAGED: KVPoll.Transferring,
        P.AUX_POSTED: KVPoll.Transferring,
        P.ENDING: KVPoll.Failed,
        P.SUCCEEDED: KVPoll.Success,
        P.FAILED: KVPoll.Failed,
    }
    assert {s for s in P if s.ended} == {P.ENDING, P.SUCCEEDED, P.FAILED}
    # the decode's states are the words its docs, logs and callers use
    assert [str(s) for s in D] == [
        "waiting",
        "withheld",
        "booting",
        "booted",
        "quarantined",
        "freed",
    ]


def test_one_dispatch_table_per_side_covers_what_the_protocol_sends_it(sides):
    assert sides["prefill"].messages.handlers.kinds == PREFILL_RECEIVES
    assert sides["decode"].handlers.kinds == DECODE_RECEIVES
    # a message of the other direction reaches no handler: refused, nothing changed
    pre, dec = sides["prefill"], sides["decode"]
    with pytest.raises(ProtocolError, match="unexpected message PauseAck on the prefill side"):
        pre.messages.handle_message(PauseAck(0))
    with pytest.raises(ProtocolError, match="unexpected message Pulled on the decode side"):
        dec.handle_message(Pulled(1, 0, 1, True))
    assert not pre.reqs and not dec.reqs


# --- real lifecycles --------------------------------------------------------------------------


class Transitions(logging.Handler):
    """Collects the sides' state changes from their DEBUG log: ``(side, rid, src, dst)``."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.seen: list = []

    def emit(self, record):
        side = record.name.rsplit(".", 1)[-1]
        if side in SIDES and record.msg.endswith("%s -> %s"):
            rid, src, dst = record.args[1:]
            states = SIDES[side][1]
            self.seen.append((side, rid, None if src == "(new)" else states[src], states[dst]))

    def edges(self, side: str) -> set:
        return {(a, b) for s, _, a, b in self.seen if s == side}

    def check_paths(self) -> None:
        """Per request, one path: it starts at its entry, each change starts where the last
        one ended, and a request starts again (a REQ replayed to the decode) only after it
        finished."""
        last: dict = {}
        for side, rid, src, dst in self.seen:
            was = last.get((side, rid))
            assert src == was or (src is None and was in (P.SUCCEEDED, P.FAILED, D.FREED)), (
                side,
                rid,
                was,
                src,
                dst,
            )
            last[(side, rid)] = dst


@contextlib.contextmanager
def transitions():
    rec = Transitions()
    loggers = [logging.getLogger(f"kvmem.disagg.{s}") for s in SIDES]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.DEBUG)
        lg.addHandler(rec)
    try:
        yield rec
    finally:
        for lg, lv in zip(loggers, levels):
            lg.removeHandler(rec)
            lg.setLevel(lv)


@contextlib.contextmanager
def host_copy_lag(lag: list):
    """Every HostCopy made while ``lag[0] > 0`` reaches the host after that many polls (as
    a CUDA copy does, a step or more later); ``lag[0] == 0``: at once, as on the CPU."""
    real = dev.HostCopy.__init__

    def init(self, t):
        real(self, t)
        if lag[0]:
            self._event = _Lag(lag[0])

    with unittest.mock.patch.object(dev.HostCopy, "__init__", init):
        yield


def _step_prefill_until(pair, rid: int, state) -> None:
    """Step the prefill (and the decode after it) until ``rid`` is in ``state`` right
    after a prefill step: a transfer posted in that step is still in flight then."""
    for _ in range(500):
        pair.prefill.step()
        req = pair.prefill.reqs.get(rid)
        if req is not None and req.state is state:
            return
        pair.decode.step()
    raise AssertionError(f"request {rid} never in {state.name}")


@pytest.mark.parametrize("mode", sorted(MODES))
def test_real_lifecycles_take_every_drawn_edge_and_no_other(mode):
    lag = [0]
    with transitions() as rec, host_copy_lag(lag):
        pair = Pair(**MODES[mode])
        try:
            pre, dec, f = pair.prefill, pair.decode, pair.faults
            pre.add_request(1, 200)  # four chunks and a last one: success
            pre.add_request(2, 64)  # one chunk: WAITING_FOR_INPUT -> KV_POSTED
            pair.run_idle()
            pre.add_request(3, 64)
            pre.abort(3)  # BOOTSTRAPPING -> ENDING
            f.stall_at[4] = 0
            pre.add_request(4, 200)
            pair.run_until(lambda: pre.state(4) == KVPoll.WaitingForInput)
            pre.abort(4)
            f.stall_at[5] = 1
            pre.add_request(5, 200)
            pair.run_until(lambda: pre.state(5) == KVPoll.Transferring)
            pre.abort(5)
            pair.run_idle()
            pre.add_request(6, 64)
            _step_prefill_until(pair, 6, P.KV_POSTED)
            pre.abort(6)  # its last write (or offer) in flight
            pre.add_request(8, 64)
            _step_prefill_until(pair, 8, P.AUX_POSTED)
            pre.abort(8)  # its AUX write in flight
            f.fail_at[7] = "aux"
            pre.add_request(7, 64)  # AUX_STAGED -> ENDING: the AUX refused at post
            pair.run_idle()
            # the decode: withheld, then freed by the prefill's bootstrap timeout ...
            f.withhold.add(9)
            pre.add_request(9, 64)
            pair.run_until(lambda: 9 in dec.reqs)
            pair.clock.advance(pre.bootstrap_timeout + 1)
            f.withhold.add(10)
            pre.add_request(10, 64)
            pair.run_until(lambda: 10 in dec.reqs)
            dec.abort(10)  # ... or aborted here while withheld
            pair.run_idle()
            # waiting for memory: aborted here, or by the prefill
            taken = dec.alloc.alloc(dec.alloc.num_free)
            pre.add_request(11, 64)
            pre.add_request(12, 64)
            pair.run_until(lambda: {11, 12} <= set(dec.reqs))
            assert dec.reqs[11].state is D.WAITING and dec.reqs[12].state is D.WAITING
            dec.abort(11)
            pre.abort(12)
            pair.run_until(lambda: 11 not in dec.reqs and 12 not in dec.reqs)
            dec.alloc.free(taken)
            # booting (its page ids on their way to the host): aborted here, or freed by
            # the prefill's ABORT
            lag[0] = 10**6
            pre.add_request(13, 64)
            pre.add_request(14, 64)
            pair.run_until(
                lambda: all(r in dec.reqs and dec.reqs[r].state is D.BOOTING for r in (13, 14))
            )
            dec.abort(13)
            pre.abort(14)
            pair.run_until(lambda: 13 not in dec.reqs and 14 not in dec.reqs)
            lag[0] = 0
            # booted, chunks landing: aborted here
            f.stall_at[15] = 1
            pre.add_request(15, 200)
            pair.run_until(lambda: pre.state(15) == KVPoll.Transferring)
            dec.abort(15)
            pair.run_idle()
            status = {rid: r.status for rid, r in pair.finished.items()}
            assert status == {
                1: 200,
                2: 200,
                3: 499,
                4: 499,
                5: 499,
                6: 499,
                7: 500,
                8: 499,
                9: 504,
                10: 499,
                11: 499,
                12: 499,
                13: 499,
                14: 499,
                15: 499,
            }
            pair.assert_clean()
        finally:
            pair.close()
    rec.check_paths()
    for side in SIDES:
        table = SIDES[side][2]
        assert rec.edges(side) == table, (
            f"{side}: not taken: {table - rec.edges(side)}, "
            f"taken and not drawn: {rec.edges(side) - table}"
        )


# --- the property: random programs --------------------------------------------------------------

LONG = os.environ.get("KVMEM_FUZZ_EXAMPLES")
FAULTS = ("none", "none", "stall0", "stall1", "fail0", "fail_aux", "withhold")
OPS = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 300), st.sampled_from(FAULTS)),
    st.tuples(st.just("abort_prefill"), st.integers(0, 7)),
    st.tuples(st.just("abort_decode"), st.integers(0, 7)),
    st.tuples(st.just("steps"), st.integers(1, 6)),
    st.tuples(st.just("clock"), st.sampled_from([5.0, 31.0, 61.0])),
    st.tuples(st.just("pause"), st.sampled_from(["prefill", "decode"])),
)


def check_states(pair) -> None:
    """What each state promises, on both sides, now."""
    pre, dec = pair.prefill, pair.decode
    for rid, r in pre.reqs.items():
        s = r.state
        assert isinstance(s, PrefillState) and s not in (P.SUCCEEDED, P.FAILED), (rid, s)
        assert pre.state(rid) == s.poll
        assert (r.reason is not None) == (s is P.ENDING), (rid, s, r.reason)
        assert len(r.handles) <= 1, (rid, r.handles)
        if s is P.BOOTSTRAPPING:
            assert r.remote is None and not (r.handles or r.pending or r.staged), rid
        if s in (P.KV_POSTED, P.AUX_STAGED, P.AUX_POSTED):
            assert r.done_tokens == r.tokens and not r.pending, (rid, s)
        if s in (P.KV_POSTED, P.AUX_POSTED, P.ENDING):
            assert r.handles, (rid, s)  # it moves on when its transfer ends
        assert (s is P.AUX_STAGED) == (r.staged is not None and r.staged.aux), (rid, s)
        if s is P.ENDING:
            assert r.staged is None and not r.pending, rid
    for rid, reason in pre.finished.items():
        assert pre.state(rid) == (KVPoll.Success if reason.status == 200 else KVPoll.Failed)
    for rid, r in dec.reqs.items():
        s = r.state
        assert isinstance(s, DecodeState) and s is not D.FREED, (rid, s)
        if s is D.BOOTING:
            assert r.ids is not None and r.host_pages is None, rid
        assert (r.reason is not None) == (s is D.QUARANTINED), (rid, s)
        if s in (D.WAITING, D.WITHHELD):
            assert r.landing_off == -1 and not dec.ledger.holds(rid), (rid, s)
        if s is D.BOOTED:
            assert r.host_pages is not None and dec.ledger.holds(rid), rid
        if r.reads or r.free_after_reads:
            assert s in (D.BOOTED, D.QUARANTINED), (rid, s)


def run_program(mode: str, lag: int, ops) -> None:
    with transitions() as rec, host_copy_lag([lag]):
        pair = Pair(**MODES[mode])
        try:
            pre, dec, f = pair.prefill, pair.decode, pair.faults
            rids: list = []
            for op in ops:
                kind = op[0]
                if kind == "add":
                    rid = len(rids) + 1
                    fault = op[2]
                    if fault.startswith("stall"):
                        f.stall_at[rid] = int(fault[-1])
                    elif fault == "fail0":
                        f.fail_at[rid] = 0
                    elif fault == "fail_aux":
                        f.fail_at[rid] = "aux"
                    elif fault == "withhold":
                        f.withhold.add(rid)
                    pre.add_request(rid, op[1])
                    rids.append(rid)
                elif kind in ("abort_prefill", "abort_decode") and rids:
                    rid = rids[op[1] % len(rids)]
                    if kind == "abort_prefill":
                        pre.abort(rid)  # a finished one: nothing happens
                    elif rid in dec.reqs or rid in dec.completed:
                        dec.abort(rid)
                elif kind == "steps":
                    for _ in range(op[1]):
                        pair.step()
                        check_states(pair)
                elif kind == "clock":
                    pair.clock.advance(op[1])
                elif kind == "pause":
                    side = pre if op[1] == "prefill" else dec
                    side.begin_pause()
                    pair.run_until(lambda: side.paused, max_steps=2000)
                    side.resume()
                    pair.step(2)
                check_states(pair)
            f.stall_at.clear()
            pair.clock.advance(pre.bootstrap_timeout + 1)  # withheld ones end (504)
            pair.run_idle(max_steps=2000)
            check_states(pair)
            assert set(pre.finished) == set(rids) and not dec.reqs
            pair.assert_clean()
        finally:
            pair.close()
    rec.check_paths()
    for side in SIDES:
        assert rec.edges(side) <= SIDES[side][2]


@settings(
    max_examples=int(LONG) if LONG else examples(8),
    deadline=None,
    database=None,
    derandomize=not LONG,
    suppress_health_check=list(HealthCheck),
)
@given(
    mode=st.sampled_from(sorted(MODES)),
    lag=st.sampled_from([0, 0, 2]),
    ops=st.lists(OPS, min_size=1, max_size=14),
)
def test_random_programs_keep_every_state_promise(mode, lag, ops):
    run_program(mode, lag, ops)


# -- pause phases ------------------------------------------------------------------------


@contextlib.contextmanager
def phases():
    """Every pause phase change of both sides, as (side, from, to)."""
    seen = []

    def wrap(cls, side):
        real = cls._phase

        def record(self, to):
            seen.append((side, self.phase, to))
            real(self, to)

        return unittest.mock.patch.object(cls, "_phase", record)

    with wrap(PrefillPause, "PrefillSide"), wrap(DecodePause, "DecodeSide"):
        yield seen


@pytest.mark.parametrize("mode", sorted(MODES))
def test_pauses_walk_their_phase_tables(mode):
    """A prefill's pause and a decode's take only edges of their tables, and every phase
    they can reach on the CPU (READS in pull mode: every PAUSE_ACK in while the decode's
    own read is in flight, which happens when the prefill gave the offer up); an edge off
    the table is refused, the phase unchanged."""
    S = PausePhase
    with phases() as seen:
        pair = Pair(**MODES[mode])
        try:
            pre, dec = pair.prefill, pair.decode
            pair.faults.stall_at[1] = 1
            pre.add_request(1, 200)
            pair.run_until(lambda: pre.state(1) == KVPoll.Transferring)
            pre.begin_pause()
            assert pre.pause.phase is S.DRAINING and pre.pausing and not pre.paused
            pair.run_until(lambda: pre.paused)
            pre.resume()
            pair.faults.stall_at.clear()
            pair.run_idle()
            pre.add_request(2, 200)
            if mode == "pull":  # the decode's read of an offer posted, not yet polled
                for _ in range(500):
                    pre.step()
                    dec.inbox.drain()
                    if any(r.reads for r in dec.reqs.values()):
                        break
                    dec.step()
                dec.begin_pause()
                # the prefill gives the offer up (no PULLED in its quarantine timeout),
                # so it acknowledges with the decode's read still in flight
                pair.clock.advance(pre.ctx.config.quarantine_timeout + 1)
                pre.step()
                dec.inbox.drain()
                assert dec.pause.phase is S.READS
            else:
                pair.step(2)
                dec.begin_pause()
            pair.run_until(lambda: dec.paused)
            dec.resume()
            pair.run_idle()
            pair.assert_clean()
        finally:
            pair.close()
    pre_edges = [(a, b) for side, a, b in seen if side == "PrefillSide"]
    dec_edges = [(a, b) for side, a, b in seen if side == "DecodeSide"]
    assert (
        pre_edges == [(S.SERVING, S.DRAINING), (S.DRAINING, S.PAUSED), (S.PAUSED, S.SERVING)]
        and set(pre_edges) == PREFILL_PAUSE_EDGES
    )
    want = [(S.SERVING, S.DRAINING)] + (
        [(S.DRAINING, S.READS), (S.READS, S.PAUSED)] if mode == "pull" else [(S.DRAINING, S.PAUSED)]
    )
    assert dec_edges == want + [(S.PAUSED, S.SERVING)], dec_edges
    assert set(dec_edges) <= DECODE_PAUSE_EDGES
    obj = types.SimpleNamespace(phase=S.PAUSED)
    with pytest.raises(IllegalPhase, match="PAUSED -> DRAINING") as e:
        set_phase("decode", DECODE_PAUSE_EDGES, obj, S.DRAINING, logging.getLogger("t"))
    assert obj.phase is S.PAUSED and e.value.side == "decode"
