"""Fuzzing what a peer can send: control messages and metadata blobs of every
type, with fields missing, extra, of the wrong type, out of range; replayed, reordered,
duplicated; fed to a real prefill side and a real decode side (the loopback engine,
tests/disagg/harness.py; KVMEM_TEST_ENGINE=nixl: over NIXL) while real requests run,
and caller aborts with good and bad values in between.

Invariants, after every step of both sides:
  * no exception escapes ``step()`` (or the caller's call: a refused call is a
    ValueError and changes nothing);
  * every message the generator made malformed is counted as a protocol error by the
    side that received it;
  * the page ledger stays consistent (no page freed outside it, each owner a live
    request, the allocator's invariants hold), and at the end both sides drain to idle
    with an empty audit: nothing leaked or freed twice;
  * no byte of a page that was free before the step, and not handed out during it,
    changed.

Bounded for ``make test`` (parser: 1000 inputs, live sides: 20 runs; 40 s of CPU, 45 s
on a quiet 2-core machine, 80 s when others share it).  A longer run, random rather than
derandomized::

    KVMEM_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest -q -s tests/disagg/test_fuzz_peer.py

(``KVMEM_FUZZ_EXAMPLES`` runs of the live sides, ten times as many parser inputs; a live
run costs 1-1.5 s there: 300 runs took 8 minutes on the shared machine.)
"""

from __future__ import annotations

import base64
import json
import os
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem.disagg import ProtocolError
from kvmem.disagg.protocol import (
    ABORT_STATUSES,
    DECODE_RECEIVES,
    END_STATUSES,
    FIELDS,
    PREFILL_RECEIVES,
    TYPES,
    meta_message,
    parse,
)
from kvmem.transfer.envelope import decode_metadata, encode_metadata
from tests.disagg.harness import Pair
from tests.util import examples

LONG = os.environ.get("KVMEM_FUZZ_EXAMPLES")
RUNS = int(LONG) if LONG else examples(20)
PARSER_INPUTS = 10 * RUNS if LONG else examples(1000)
SENTINEL = 0x5A
POS = {"tokens", "nbytes", "last"}  # fields that must be >= 1
TALLY: Counter = Counter()


def _settings(n: int):
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=not LONG,
        suppress_health_check=list(HealthCheck),
    )


# --- message generation -----------------------------------------------------------------------

GOOD_INTS = st.one_of(
    st.integers(0, 8),
    st.integers(0, 600),
    st.sampled_from([0, 1, 13, 64, 256, 4096, 16384, 65536, 2**31, 2**63 - 1]),
)
BAD_VALUES = st.one_of(
    st.integers(-(2**70), -1),
    st.integers(2**63, 2**70),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=4),
    st.none(),
    st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)


@st.composite
def field_value(draw, t: str, name: str):
    """(value, bad): a value for field ``name`` of a ``t`` message, and whether the
    parser must refuse it."""
    if draw(st.integers(0, 5)) == 0:
        return draw(BAD_VALUES), True
    if name == "final":
        return draw(st.booleans()), False
    if name == "reason":
        return draw(st.text(max_size=20)), False
    if name == "status":
        v = draw(st.sampled_from([200, 499, 500, 503, 504, 0, 123, 404]))
        ok = ABORT_STATUSES if t == "ABORT" else END_STATUSES
        return v, v not in ok
    if name == "rid" or name == "room":
        return draw(st.integers(0, 7)), False
    if name == "epoch":
        return draw(st.sampled_from([0, 0, 1, 2, 999])), False
    v = draw(GOOD_INTS)
    return v, name in POS and v < 1


@st.composite
def json_message(draw, receiver: str, metas: dict):
    """(raw bytes, must_refuse) of one JSON control message to ``receiver``."""
    t = draw(st.sampled_from(TYPES + ("NOPE", "ABORT_ACK")))
    bad = t not in (PREFILL_RECEIVES if receiver == "prefill" else DECODE_RECEIVES)
    msg = {"t": t}
    if t == "META":
        kind = draw(st.sampled_from(sorted(metas)))
        md, refused = metas[kind]
        msg["md"] = md
        bad = bad or refused
    else:
        for name in FIELDS.get(t, ("rid",)):
            if draw(st.integers(0, 9)) == 0:
                bad = True  # missing
                continue
            v, b = draw(field_value(t, name))
            msg[name] = v
            bad = bad or b
        if t == "CHUNK" and not bad and msg["first"] >= msg["last"]:
            bad = True
    if draw(st.integers(0, 9)) == 0:
        msg[draw(st.sampled_from(["x", "rid2", "T", ""]))] = 1
        bad = True
    if t in ("NOPE", "ABORT_ACK"):
        bad = True
    return json.dumps(msg).encode(), bad


@st.composite
def raw_junk(draw):
    """Bytes that are no control message at all."""
    kind = draw(st.integers(0, 6))
    if kind == 0:
        return draw(st.binary(max_size=48)), True
    if kind == 1:
        return draw(st.sampled_from([b"[", b'{"t":'])) * draw(st.integers(5, 50_000)), True
    if kind == 2:
        return json.dumps(
            draw(st.one_of(st.integers(), st.text(max_size=8), st.lists(st.integers(), max_size=3)))
        ).encode(), True
    if kind == 3:
        return b'{"t":"REQ","rid":1,"room":1,"tokens":NaN}', True
    if kind == 4:
        return b'{"t":"REQ","rid":1,"room":1,"tokens":' + b"7" * 5000 + b"}", True
    if kind == 5:
        return b'{"t":"ABORT","rid":1,"status":499,"reason":"\xff"}', True
    return b'{"t":"CHUNK","t":"REQ","rid":1,"room":1,"tokens":1}', False  # last key wins


def metas_for(pair: Pair, sender: str) -> dict:
    """META bodies a fuzz message can carry, each with whether it must be refused."""
    eng = pair.pe if sender == "prefill" else pair.de
    other = pair.de if sender == "prefill" else pair.pe
    md = eng.local_metadata()
    header, blob = decode_metadata(md)
    forged = encode_metadata(dict(header, agent="mallory"), blob)
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    return {
        "current": (b64(md), False),  # a duplicate: accepted, changes nothing
        "older": (b64(pair.old_md[sender]), True),  # a replay: StaleEpochError
        "forged-agent": (b64(forged), True),
        "receiver's own": (b64(other.local_metadata()), True),
        "junk": (b64(b"KVMEMTX1" + bytes(40)), True),
        "truncated": (b64(md[:-7]), True),
        "not base64": ("@@not base64@@", True),
        "padding": (b64(md)[:-1], True),
    }


# --- the parser alone -----------------------------------------------------------------------------


@st.composite
def any_input(draw):
    receiver = draw(st.sampled_from(["prefill", "decode"]))
    metas = {"m": (draw(st.text(max_size=30)), True)}
    raw, _ = draw(st.one_of(json_message(receiver, metas), raw_junk()))
    if draw(st.booleans()):  # flip, cut or extend a few bytes
        raw = bytearray(raw)
        for _ in range(draw(st.integers(1, 3))):
            op = draw(st.integers(0, 2))
            i = draw(st.integers(0, max(len(raw) - 1, 0)))
            if op == 0 and raw:
                raw[i] ^= draw(st.integers(1, 255))
            elif op == 1:
                del raw[i:]
            else:
                raw[i:i] = draw(st.binary(min_size=1, max_size=4))
        raw = bytes(raw)
    return receiver, raw


def test_fuzz_parser_returns_a_typed_message_or_refuses():
    @_settings(PARSER_INPUTS)
    @given(any_input())
    def run(case):
        receiver, raw = case
        TALLY["parser inputs"] += 1
        try:
            msg = parse(raw, sender="peer", receiver=receiver)
        except ProtocolError:
            TALLY["parser refused"] += 1
            return
        assert msg.t in (PREFILL_RECEIVES if receiver == "prefill" else DECODE_RECEIVES)
        for name in FIELDS[msg.t]:
            if msg.t != "META":
                v = getattr(msg, name)
                assert type(v) in (int, bool, str), (name, v)

    run()
    print(f"\nfuzz parser: {TALLY['parser inputs']} inputs, {TALLY['parser refused']} refused")


# --- live sides --------------------------------------------------------------------------------------


@st.composite
def actions(draw):
    """A list of actions; messages are drawn later (they need the pair's metadata)."""
    out = []
    for _ in range(draw(st.integers(4, 28))):
        kind = draw(
            st.sampled_from(
                [
                    "add",
                    "step",
                    "step",
                    "step",
                    "hostile",
                    "hostile",
                    "hostile",
                    "replay",
                    "advance",
                    "caller",
                    "pause",
                    "resume",
                ]
            )
        )
        if kind == "add":
            out.append(("add", draw(st.integers(1, 300))))
        elif kind == "step":
            out.append(("step", draw(st.integers(1, 4))))
        elif kind == "advance":
            out.append(("advance", draw(st.sampled_from([0.5, 5.0, 31.0, 61.0]))))
        elif kind == "caller":
            out.append(
                (
                    "caller",
                    draw(st.sampled_from(["prefill", "decode"])),
                    draw(st.integers(0, 7)),
                    draw(st.sampled_from([499, 500, 503, 504, 200, 123, True, 499.0])),
                )
            )
        elif kind == "replay":
            out.append(("replay", draw(st.integers(0, 10_000)), draw(st.integers(1, 3))))
        elif kind in ("pause", "resume"):
            out.append((kind, draw(st.sampled_from(["prefill", "decode"]))))
        else:
            out.append(
                ("hostile", draw(st.sampled_from(["prefill", "decode"])), draw(st.integers(1, 4)))
            )
    return out


class Live:
    """A pair under fuzz: pools filled with a sentinel, legit messages recorded for
    replay, hostile ones counted per receiver, invariants checked after every step."""

    def __init__(self):
        self.pair = pair = Pair()
        self.old_md = {"prefill": pair.pe.local_metadata(), "decode": pair.de.local_metadata()}
        # Newer snapshots on both sides, published: the ones above are "older" replays.
        self._bufs = []
        for eng, side in ((pair.pe, pair.prefill), (pair.de, pair.decode)):
            buf = torch.zeros(4096, dtype=torch.uint8)
            self._bufs.append(buf)
            eng.register("fuzz", [(buf.data_ptr(), buf.numel())], 0)
        pair.prefill.peers.tell(pair.de.name, meta_message(pair.pe))
        pair.decode.peers.tell(pair.pe.name, meta_message(pair.de))
        pair.old_md = self.old_md
        for side in (pair.prefill, pair.decode):
            for b in side.pool.k_buffer + side.pool.v_buffer:
                b.view(torch.uint8).fill_(SENTINEL)
        self.sent: list = []  # (receiver, raw) of legit messages, for replays
        # Each side's parts tell the other through the callable they were built with: the
        # messages are recorded where they leave, at each engine (the hostile ones, sent
        # from those engines too, go through the unrecorded originals: send())
        self.raw_send = {pair.pe.name: pair.pe.send_notif, pair.de.name: pair.de.send_notif}
        for eng, receiver in ((pair.pe, "decode"), (pair.de, "prefill")):

            def send_notif(peer, msg, real=eng.send_notif, receiver=receiver):
                self.sent.append((receiver, msg))
                return real(peer, msg)

            eng.send_notif = send_notif
        real_post = pair.pe.post_write

        def post_write(local, remote, remote_ranges, notif=b""):  # CHUNK / AUX notifications
            self.sent.append(("decode", notif))
            return real_post(local, remote, remote_ranges, notif)

        pair.pe.post_write = post_write
        self.held_during: dict = {"prefill": set(), "decode": set()}
        for name, side in (("prefill", pair.prefill), ("decode", pair.decode)):
            real_hold = side.ledger.hold

            def hold(owner, pages, real_hold=real_hold, name=name):
                self.held_during[name].update(int(p) for p in pages.tolist())
                return real_hold(owner, pages)

            side.ledger.hold = hold
        self.must_refuse = Counter()  # receiver -> malformed messages sent to it
        self.metas = {"prefill": metas_for(pair, "prefill"), "decode": metas_for(pair, "decode")}
        self.next_rid = 0

    def sides(self):
        return (("prefill", self.pair.prefill), ("decode", self.pair.decode))

    def send(self, receiver: str, raw: bytes, bad: bool) -> None:
        p = self.pair
        sender = p.de if receiver == "prefill" else p.pe
        to = p.pe if receiver == "prefill" else p.de
        self.raw_send[sender.name](to.name, raw)
        self.must_refuse[receiver] += bool(bad)
        TALLY["messages"] += 1
        TALLY["malformed"] += bool(bad)

    def step(self) -> None:
        before = {}
        for name, side in self.sides():
            free = sorted(
                set(range(1, side.alloc.num_pages)) - set(side.alloc.allocated_pages().tolist())
            )
            idx = torch.tensor(free, dtype=torch.int64)
            released = side.pool.released
            before[name] = (idx, None if released else _page_rows(side.pool, idx), side.pool.epoch)
            self.held_during[name] = set()
        self.pair.step()
        TALLY["steps"] += 1
        for name, side in self.sides():
            idx, old, epoch = before[name]
            if old is None or side.pool.released or side.pool.epoch != epoch:
                self.check_ledger(name, side)  # a pause released the memory: contents go
                continue
            new = _page_rows(side.pool, idx)
            changed = torch.zeros(idx.numel(), dtype=torch.bool)
            for o, n in zip(old, new):
                changed |= (o != n).any(dim=1)
            held = self.held_during[name]
            bad = [int(p) for p, c in zip(idx.tolist(), changed.tolist()) if c and p not in held]
            assert not bad, f"{name}: bytes of free pages {bad[:8]} changed"
            self.check_ledger(name, side)

    def check_ledger(self, name: str, side) -> None:
        side.alloc.check_invariants()
        audit = side.ledger.audit()
        assert audit["unaccounted"] == [], (name, audit)
        owners = set(side.ledger.owners())
        assert owners <= set(side.reqs), (name, owners - set(side.reqs))

    def drain(self) -> None:
        """No more input: timeouts end whatever the hostile messages left hanging."""
        p = self.pair
        for _ in range(3):  # messages still on the way arrive
            self.step()
        for _ in range(200):  # pauses complete, then resume
            for name, side in self.sides():
                if side.paused:
                    side.resume()
            if not any(s.paused or _pausing(s) for _, s in self.sides()):
                break
            self.step()
        else:
            raise AssertionError("a pause did not complete")
        for _ in range(40):
            if p.prefill.idle and p.decode.idle:
                break
            p.clock.advance(31.0)
            for _ in range(4):
                self.step()
        for _ in range(2):
            self.step()
        for name, side in self.sides():
            # Notifications may take a step or two to arrive: counted by the end.
            assert side.metrics.protocol_errors >= self.must_refuse[name], (
                name,
                side.metrics.protocol_errors,
                self.must_refuse[name],
                side.inbox.refused,
            )
            assert side.idle, (name, list(side.reqs))
            assert side.audit() == {"leaked": {}, "quarantined": {}, "unaccounted": []}
            assert side.alloc.num_allocated == 0 and side.arena.used_bytes == 0, name
        assert p.pe.open_handles() == 0

    def close(self) -> None:
        self.pair.close()


def _pausing(side) -> bool:
    return side.pausing


def _page_rows(pool, idx: torch.Tensor) -> list:
    """Copies of pages ``idx`` of every layer's K and V: uint8 [len(idx), page bytes] each."""
    return [
        b.view(torch.uint8).reshape(pool.num_pages, -1).view(torch.int64).index_select(0, idx)
        for b in pool.k_buffer + pool.v_buffer
    ]


@pytest.mark.slow  # 10-15 s here (live sides through the engine): make test
def test_fuzz_live_sides_survive_hostile_peers():
    @_settings(RUNS)
    @given(plan=actions(), data=st.data())
    def run(plan, data):
        live = Live()
        TALLY["runs"] += 1
        try:
            pre, dec = live.pair.prefill, live.pair.decode
            for act in plan:
                kind = act[0]
                if kind == "add":
                    if len(pre.reqs) < 6 and not pre.paused and not _pausing(pre):
                        pre.add_request(live.next_rid, act[1])
                        live.next_rid += 1
                elif kind == "step":
                    for _ in range(act[1]):
                        live.step()
                elif kind == "advance":
                    live.pair.clock.advance(act[1])
                elif kind == "caller":
                    _, who, rid, status = act
                    side = pre if who == "prefill" else dec
                    good = type(status) is int and status in END_STATUSES
                    TALLY["caller calls"] += 1
                    try:
                        side.abort(rid, status=status)
                    except ProtocolError:
                        assert rid not in side.reqs  # an unknown id
                    except ValueError:
                        assert not good
                    else:
                        assert good
                elif kind == "pause":
                    side = pre if act[1] == "prefill" else dec
                    if not (pre.paused or dec.paused or _pausing(pre) or _pausing(dec)):
                        side.begin_pause()
                        TALLY["pauses"] += 1
                elif kind == "resume":
                    side = pre if act[1] == "prefill" else dec
                    side.resume()
                elif kind == "replay":
                    if live.sent:
                        _, idx, times = act
                        receiver, raw = live.sent[idx % len(live.sent)]
                        for _ in range(times):
                            live.send(receiver, raw, False)
                        TALLY["replays"] += times
                else:
                    _, receiver, n = act
                    for _ in range(n):
                        raw, bad = data.draw(
                            st.one_of(
                                json_message(
                                    receiver,
                                    live.metas["decode" if receiver == "prefill" else "prefill"],
                                ),
                                raw_junk(),
                            )
                        )
                        live.send(receiver, raw, bad)
            live.drain()
        finally:
            live.close()

    run()
    print(
        f"\nfuzz live sides: {TALLY['runs']} runs, {TALLY['steps']} steps, "
        f"{TALLY['messages']} hostile or replayed messages ({TALLY['malformed']} malformed, "
        f"{TALLY['replays']} replays), {TALLY['caller calls']} caller aborts, "
        f"{TALLY['pauses']} pauses"
    )
