"""Run by tests/sglang/test_transfer_path.py in a process of its own: a real sglang PD
pair (``testkit.sglang_pair.Pair``: prefill ``NixlKVManager`` + ``NixlKVSender``s here, a
decode ``NixlKVManager`` + ``NixlKVReceiver``s in a child process with its own
environment, NIXL/UCX on DRAM) with the prefill's environment as the test sets it
(``SGLANG_KVMEM`` and ``SGLANG_KVMEM_TRANSFER``) and a STOCK decode (``SGLANG_KVMEM=0``;
one kvmem decode in ``both16``).

Rounds, in order, each of ``REQUESTS`` requests whose pages are never adjacent within a
request (interleaved with the others'), every chunk queued at once:

* ``plain`` at page sizes 16 and 1: every room Success, every plane of every page checked
  on the decode, NIXL descriptors counted, and each checked against both sides'
  registrations (inside one; a kvmem pool registers one region per physical chunk, and
  the tests run with 256 KiB chunks, tests/conftest.py);
* with kvmem's path, ``both16``: the same at page size 16 with a kvmem decode (flag on
  there too), so both sides' pools are chunked;
* ``abort``: the third room is aborted on the prefill once its chunk is queued (with the
  kvmem path: once it was sent ahead in the first room's write), while every NIXL write
  is held PROC for ``HOLD_S`` (``check_xfer_state`` answers PROC until then: a slow link);
  the decode is told Failed, sends its ABORT, and frees the pages at the ABORT_ACK;
  when the ACK left is recorded;
* ``err``: the writes posted by the first ``send_kvcache`` of the round end ERR
  (``check_xfer_state`` answers ERR for them);
* ``refused``: the first NIXL write the first ``send_kvcache`` of the round creates is
  refused (``initialize_xfer`` / ``make_prepped_xfer`` raise, as NIXL does for a bad
  descriptor);
* ``unreadable``: the state of that first write cannot be read once (``check_xfer_state``
  raises, then answers the real state): the owner's wait gives up on it;
* ``post_refused``: that first write is posted, then reported refused (``transfer``
  raises after posting: a post NIXL failed part-way, whose writes may still land);
* with kvmem's path, ``split_create_fails`` and ``split_post_refused``: the first merged
  write of the round goes as several NIXL writes (``SPLIT_MIN_BYTES`` lowered, below);
  its first piece is posted and held PROC for ``SPLIT_HOLD_S``, past sglang's
  ``NIXL_ERR_SETTLE_TIMEOUT_S`` (lowered to ``SPLIT_SETTLE_S`` for these rounds), and its
  second cannot be created (``initialize_xfer`` raises) or is posted and then reported
  refused.  Recorded: every ABORT_ACK that left before the held piece settled, every
  room of the round seen uncounted (and not poisoned) while it was held, and every room
  the decode saw Success before it settled;
* ``release``: the prefill's KV is deregistered (the adapter's
  ``deregister_buffer_to_engine``), its pool released and resumed, registered again
  (which prepares the peers' lists again, ``kvmem_sglang.nixl``), the pattern written
  again, then a ``plain`` round.

The fault wrappers stand on the prefill's real NIXL agent (they change what it reports
or refuses, as a slow or failing link would); everything else is sglang's and the
adapter's own code.  Prints one JSON object on its last line.
"""

from __future__ import annotations

import os
import threading
import time

from testkit.sglang_pair import Pair, Shape, fill_pattern, record_abort_acks
from tests.sglang.sglang_env import kvmem_send_path as _kvmem_path
from tests.sglang.sglang_env import script_main
from tests.sglang.sglang_env import stats_since as _delta
from tests.sglang.sglang_env import transfer_stats as _stats

REQUESTS = 6
HOLD_S = 0.6
# the split rounds: sglang's settle bound, and how long the first piece stays PROC (past
# the owner's bounded wait, within the next room's)
SPLIT_SETTLE_S = 0.6
SPLIT_HOLD_S = 1.0
SHAPE = dict(layers=2, heads=2, head_dim=64, requests=REQUESTS, tokens=64)


def _flag(name: str) -> bool:
    return os.environ.get(name) == "1"


def _outcome(pair: Pair, rnd: dict) -> dict:
    d = rnd["decode"]
    rooms = [str(r) for r in rnd["rooms"]]
    return dict(
        prefill=rnd["prefill_states"],
        decode=rnd["decode_states"],
        bad_rows=rnd["bad_rows"],
        safe=[r in d["safe_at"] for r in rooms],
        outstanding={str(k): v for k, v in pair.pm._staging_outstanding.items() if v > 0},
        descriptors=rnd["kv_descriptors_per_request"],
        nixl_calls=rnd["engine_writes"],
        regions=rnd["regions"],
    )


SPLIT_FAULTS = ("split_create_fails", "split_post_refused")


class _Agent:
    """Fault wrappers on the prefill's real agent (see the module docstring)."""

    def __init__(self, pair: Pair):
        self.pm, self.agent = pair.pm, pair.pm.agent
        self.real_state = self.agent.check_xfer_state
        self.real_init = self.agent.initialize_xfer
        self.real_prep = self.agent.make_prepped_xfer
        self.real_send = self.pm.send_kvcache
        self.real_transfer = self.agent.transfer
        self.hold_until = 0.0
        self.err, self.in_first_send, self.refuse_next, self.sends = {}, False, False, 0
        self.unreadable, self.post_refused = {}, {}
        self.fault = None
        self.pieces = 0  # NIXL writes the first send created (split rounds)
        self.held, self.held_until, self.held_at, self.settled_at = {}, 0.0, None, None
        self.acks = record_abort_acks(self.pm)
        agent, pm = self.agent, self.pm
        agent.check_xfer_state = self.check_xfer_state
        agent.initialize_xfer = self.initialize_xfer
        agent.make_prepped_xfer = self.make_prepped_xfer
        agent.transfer = self.transfer
        pm.send_kvcache = self.send_kvcache

    def reset(self):
        self.hold_until, self.err, self.sends, self.fault = 0.0, {}, 0, None
        self.unreadable, self.post_refused = {}, {}
        self.pieces = 0
        self.held, self.held_until, self.held_at, self.settled_at = {}, 0.0, None, None

    def check_xfer_state(self, h):
        if self.unreadable.get(id(h)) is h:  # once: the next read answers the real state
            del self.unreadable[id(h)]
            raise RuntimeError("kvmem test: NIXL could not read the transfer state")
        if self.held.get(id(h)) is h:  # the split rounds' first piece
            if time.monotonic() < self.held_until:
                return "PROC"
            state = self.real_state(h)
            if state in ("DONE", "ERR") and self.settled_at is None:
                self.settled_at = time.monotonic()
            return state
        state = self.real_state(h)
        if self.err.get(id(h)) is h and state in ("DONE", "ERR"):
            return "ERR"
        if time.monotonic() < self.hold_until and state == "DONE":
            return "PROC"
        return state

    def _made(self, h):
        if self.in_first_send and self.fault == "err":
            self.err[id(h)] = h  # by value, as below
        if (
            self.in_first_send and self.fault in ("unreadable", "post_refused") and self.refuse_next
        ):  # the first write of the first send only
            self.refuse_next = False
            # kept by value: an id alone could name a later handle once this one is freed
            (self.unreadable if self.fault == "unreadable" else self.post_refused)[id(h)] = h
        if self.in_first_send and self.fault in SPLIT_FAULTS:
            if self.pieces == 1:  # the first piece: held PROC
                self.held_at = time.monotonic()
                self.held_until = self.held_at + SPLIT_HOLD_S
                self.held = {id(h): h}
            elif self.pieces == 2 and self.fault == "split_post_refused":
                self.post_refused[id(h)] = h
        return h

    def transfer(self, h, *a, **k):
        state = self.real_transfer(h, *a, **k)
        if self.post_refused.get(id(h)) is h:  # posted, then reported refused: its writes may land
            raise RuntimeError("kvmem test: NIXL refused to post the transfer")
        return state

    def _refuse(self):
        if self.in_first_send and self.fault == "refused" and self.refuse_next:
            self.refuse_next = False
            raise RuntimeError("kvmem test: NIXL refused the descriptor list")

    def initialize_xfer(self, *a, **k):
        self._refuse()
        if self.in_first_send and self.fault in SPLIT_FAULTS:
            self.pieces += 1
            if self.pieces == 2 and self.fault == "split_create_fails":
                raise RuntimeError("kvmem test: NIXL could not create the second write")
        return self._made(self.real_init(*a, **k))

    def make_prepped_xfer(self, *a, **k):
        self._refuse()
        return self._made(self.real_prep(*a, **k))

    def send_kvcache(self, *a, **k):
        self.sends += 1
        self.in_first_send = self.sends == 1
        self.refuse_next = True
        try:
            return self.real_send(*a, **k)
        finally:
            self.in_first_send = False


def main() -> dict:
    out = {"kvmem_path": _kvmem_path()}
    if _kvmem_path():
        from kvmem_sglang import transfer

        # these rounds move a few KiB a write: split them as the path splits a large batch
        # (up to SPLIT writes), so the split writes' waits, errors and refusals are covered
        transfer.SPLIT_MIN_BYTES = 1
    pages = [int(p) for p in os.environ.get("KVMEM_TEST_PAGES", "16,1").split(",")]
    pairs = {
        ps: Pair(
            Shape(page_size=ps, **SHAPE),
            decode_env={"SGLANG_KVMEM": "0"},
            timeout=120,
            wait=False,
            record=True,
        )
        for ps in pages
    }  # decodes start together
    if _kvmem_path():  # and one kvmem decode: chunked pools on both sides
        pairs["both"] = Pair(
            Shape(page_size=16, **SHAPE),
            decode_env={"SGLANG_KVMEM": "1"},
            timeout=120,
            wait=False,
            record=True,
        )
    try:
        if "both" in pairs:
            out |= _both16(pairs.pop("both").ready())
        if 1 in pairs:
            out |= _plain1(pairs.pop(1).ready())
        if 16 in pairs:
            out |= _rounds16(pairs.pop(16).ready())
    finally:
        for pair in pairs.values():
            pair.close()
    return out


def _rounds16(pair: Pair) -> dict:
    out = {}
    every = range(pair.shape.planes)
    faults = _Agent(pair)
    try:
        s0 = _stats()
        rnd = pair.sglang_round(check=every, at_once=True)
        out["plain16"] = _outcome(pair, rnd) | {"stats": _delta(s0)}

        if not _flag("SGLANG_KVMEM"):  # stock: the plain rounds only
            return out
        # abort the third room once it is queued (kvmem: once sent ahead)
        faults.reset()
        faults.hold_until = float("inf")  # until the abort: every write looks in flight
        s0 = _stats()
        t = {}

        def abort_third(senders):
            victim = senders[2]
            room = victim.bootstrap_room
            faults.hold_until = time.monotonic() + HOLD_S
            end = time.monotonic() + 10
            first = senders[0].bootstrap_room
            if _kvmem_path():  # wait until the worker sent it ahead of its turn
                while pair.pm._staging_outstanding.get(room, 0) <= 0:
                    assert time.monotonic() < end, "the third room was never sent ahead"
                    time.sleep(0.001)
                t["ahead_state"] = int(pair.pm.check_status(room))
            else:  # wait until the worker is on the first room
                while pair.pm._staging_outstanding.get(first, 0) <= 0:
                    assert time.monotonic() < end, "the worker never took the first room"
                    time.sleep(0.001)
            victim.abort()
            t["aborted_at"], t["room"] = time.monotonic(), room

        rnd = pair.sglang_round(check=every, on_sent=abort_third, at_once=True)
        room = t["room"]
        out["abort"] = _outcome(pair, rnd) | {
            "stats": _delta(s0),
            "ahead_state": t.get("ahead_state"),
            "hold_end_after_abort_s": faults.hold_until - t["aborted_at"],
            "ack_after_abort_s": (
                faults.acks[room] - t["aborted_at"] if room in faults.acks else None
            ),
            "decode_safe_after_abort_s": (
                rnd["decode"]["safe_at"][str(room)] - t["aborted_at"]
                if str(room) in rnd["decode"]["safe_at"]
                else None
            ),
        }

        for fault in ("err", "refused"):
            faults.reset()
            faults.fault = fault
            s0 = _stats()
            # a refused post poisons its room (sglang gives up proving it drained): its
            # decode never gets the ABORT_ACK, so the decode is watched only a while
            rnd = pair.sglang_round(
                check=every, at_once=True, decode_timeout=3 if fault == "refused" else None
            )
            out[fault] = _outcome(pair, rnd) | {"stats": _delta(s0)}
            faults.fault = None

        # the first write's state cannot be read once: the owner's wait gives up on it (it
        # stays counted, sglang's rule), the rooms sent ahead in it wait for it themselves
        # and succeed once it reads DONE; and a write posted then reported refused
        for fault in ("unreadable", "post_refused"):
            faults.reset()
            faults.fault = fault
            s0 = _stats()
            rnd = pair.sglang_round(check=every, at_once=True, decode_timeout=3)
            out[fault] = _outcome(pair, rnd) | {
                "stats": _delta(s0),
                "rooms": [str(r) for r in rnd["rooms"]],
                "poisoned": sorted(
                    str(r) for r in rnd["rooms"] if r in pair.pm._deferred_ack_poisoned_rooms
                ),
            }
            faults.fault = None
            pair.pm._staging_outstanding.clear()  # the owner's count, kept for ever by sglang

        if _kvmem_path():  # a merged write split into several NIXL writes, cut short
            for fault in SPLIT_FAULTS:
                out[fault] = _split_round(pair, faults, fault)
                pair.pm._staging_outstanding.clear()  # as above

        # release and resume the prefill's KV, then a plain round
        from kvmem_sglang import kvpool

        pm = pair.pm
        pm.deregister_buffer_to_engine()
        kvpool.release_all()
        kvpool.resume_all(True)
        pm.register_buffer_to_engine()
        fill_pattern(pair.kv)
        s0 = _stats()
        rnd = pair.sglang_round(check=every, at_once=True)  # one batch: all queued at once
        out["release"] = _outcome(pair, rnd) | {
            "stats": _delta(s0),
            "prepared_lists": len(pm.prep_handles),
            "registrations": sum(d.descCount() for d in pm.kv_descs),
        }
    finally:
        pair.close()
    return out


def _split_round(pair: Pair, faults: _Agent, fault: str) -> dict:
    """One split round (module docstring), with a watcher that samples the prefill's
    counts and poisoned rooms while the first piece is held."""
    from sglang.srt.disaggregation.nixl import conn

    pm = pair.pm
    seen = {"uncounted": set(), "unprotected": set()}
    rooms: list[int] = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            counts = dict(pm._staging_outstanding)
            poisoned = set(pm._deferred_ack_poisoned_rooms)
            if faults.held and faults.settled_at is None:  # read after the snapshot
                for room in rooms:
                    if counts.get(room, 0) <= 0:
                        seen["uncounted"].add(room)
                        if room not in poisoned:
                            seen["unprotected"].add(room)
            time.sleep(0.002)

    def on_sent(senders):
        rooms.extend(s.bootstrap_room for s in senders)

    faults.reset()
    faults.fault = fault
    bound = conn.NIXL_ERR_SETTLE_TIMEOUT_S
    conn.NIXL_ERR_SETTLE_TIMEOUT_S = SPLIT_SETTLE_S
    s0 = _stats()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        # the owner is poisoned (its piece was never proven settled): its decode gets no
        # ABORT_ACK and is watched only a while
        rnd = pair.sglang_round(
            check=range(pair.shape.planes), at_once=True, on_sent=on_sent, decode_timeout=3
        )
    finally:
        stop.set()
        watcher.join()
        conn.NIXL_ERR_SETTLE_TIMEOUT_S = bound
        faults.fault = None
    settled = faults.settled_at if faults.settled_at is not None else float("inf")
    ok_at = rnd["decode"]["ok_at"]
    return _outcome(pair, rnd) | {
        "stats": _delta(s0),
        "rooms": [str(r) for r in rnd["rooms"]],
        "poisoned": sorted(str(r) for r in rnd["rooms"] if r in pm._deferred_ack_poisoned_rooms),
        "pieces": faults.pieces,
        "settle_timeout_s": SPLIT_SETTLE_S,
        "held_s": (
            None
            if faults.held_at is None or faults.settled_at is None
            else faults.settled_at - faults.held_at
        ),
        "acked_before_settle": sorted(
            str(r) for r in rnd["rooms"] if faults.acks.get(r, float("inf")) < settled
        ),
        "uncounted_while_held": sorted(str(r) for r in seen["uncounted"]),
        "unprotected_while_held": sorted(str(r) for r in seen["unprotected"]),
        "ok_before_settle": sorted(r for r, t in ok_at.items() if t < settled),
    }


def _both16(pair: Pair) -> dict:
    try:
        s0 = _stats()
        rnd = pair.sglang_round(check=range(pair.shape.planes), at_once=True)
        return {
            "both16": _outcome(pair, rnd)
            | {"stats": _delta(s0), "decode_kvmem_pool": pair.decode_info["kvmem_pool"]}
        }
    finally:
        pair.close()


def _plain1(pair: Pair) -> dict:
    try:
        s0 = _stats()
        rnd = pair.sglang_round(check=range(pair.shape.planes), at_once=True)
        return {"plain1": _outcome(pair, rnd) | {"stats": _delta(s0)}}
    finally:
        pair.close()


if __name__ == "__main__":
    script_main(main)
