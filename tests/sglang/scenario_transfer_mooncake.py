"""Run by tests/sglang/test_transfer_path_mooncake.py in a process of its own (``.venv-e2e``'s
interpreter, which has Mooncake's engine): a real sglang PD pair over Mooncake
(``testkit.sglang_pair.Pair(backend="mooncake")``: prefill ``MooncakeKVManager`` +
``MooncakeKVSender``s here, a decode ``MooncakeKVManager`` + ``MooncakeKVReceiver``s in a
child process, Mooncake's transfer engine over TCP on 127.0.0.1) with the prefill's
environment as the test sets it (``SGLANG_KVMEM=1`` and ``SGLANG_KVMEM_TRANSFER``) and a
STOCK decode.  Both processes run with Mooncake's default TCP queue (1,024 transfers per
peer, set explicitly: the harness raises it where unset).

Rounds, in order, each of ``REQUESTS`` requests whose pages are never adjacent within a
request (interleaved with the others'), every chunk queued at once:

* ``plain``: every room Success, every plane of every page checked on the decode, slices
  counted per ``batch_transfer_sync`` call;
* ``abort``: the third room is aborted on the prefill while a write that carries its pages
  is in flight (every ``batch_transfer_sync`` of the round is held ``HOLD_S`` before it
  moves anything: a slow link); the decode is told Failed, sends its ABORT, and frees
  the pages at the ABORT_ACK; when the ACK left is recorded;
* ``err``: the first ``batch_transfer_sync`` of the round returns -1 after moving its
  slices (a batch that failed while its slices moved); the session is then marked failed
  by sglang, and cleared here after the round (as sglang's probe would);
* ``err_posted``: the same, with each call bounded to ``POSTED_PAGES`` pages of every
  plane (``SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES``, the manager's
  ``max_transfer_batch_indices``) and each request's chunk sent from source pages that lie
  room after room (pages ``1 + r n .. (r + 1) n`` for request ``r`` of ``n`` pages, still
  to the decode's interleaved pages): kvmem's merged write then goes as calls of which the
  first, the one that fails, carries the first two rooms' slices only (no page adjacent to
  another on both sides: one slice a page and plane, sorted by source page), and no call
  after it is made.  No rows are checked (the pages land elsewhere, and every room fails);
* ``events``: the chunks carry what a GPU prefill gives them (``prefill.py:1745-1773``,
  ``1495-1498``): page ids as a host tensor with the event of their copy, and the third
  room's copy event and the fourth room's forward event (``wait_event``) still pending
  until ``HOLD_S`` after the round starts (``query()`` False, ``synchronize()`` blocks
  until then); the others' events done.  Recorded: the path's counters when the worker
  first waits on a pending event (what went ahead before it);
* ``release``: the prefill's KV is deregistered (the adapter's
  ``deregister_buffer_to_engine``), its pool released and resumed, registered again, the
  pattern written again, then a ``plain`` round;
* ``scattered``, on a pair of its own: 2 requests of 1,024 tokens of a 32-layer model at
  page size 16 (4,096 slices a request, sglang's one per page and plane) whose pages are
  adjacent to no other page of the round (``Shape.spread=2``): sglang's own send posts
  each request as one call past the TCP queue.

The fault wrapper stands on the prefill's real engine (it delays or fails what the link
reports); everything else is sglang's and the adapter's own code.  Prints one JSON object
on its last line.
"""

from __future__ import annotations

import time

from testkit.sglang_pair import Pair, Shape, fill_pattern, record_abort_acks
from tests.sglang.sglang_env import kvmem_send_path as _kvmem_path
from tests.sglang.sglang_env import script_main
from tests.sglang.sglang_env import stats_since as _delta
from tests.sglang.sglang_env import transfer_stats as _stats

REQUESTS = 6
HOLD_S = 0.6
SHAPE = dict(layers=2, heads=2, head_dim=64, requests=REQUESTS, tokens=64)
SCATTERED = dict(layers=32, heads=2, head_dim=64, requests=2, tokens=1024, spread=2)
POSTED_PAGES = 2  # pages of every plane a call carries in err_posted (a room has 4)


def _outcome(pair: Pair, rnd: dict, stats0: dict, calls: list) -> dict:
    d = rnd["decode"]
    rooms = [str(r) for r in rnd["rooms"]]
    return dict(
        prefill=rnd["prefill_states"],
        decode=rnd["decode_states"],
        bad_rows=rnd["bad_rows"],
        safe=[r in d["safe_at"] for r in rooms],
        rooms=rooms,
        outstanding={str(k): v for k, v in pair.pm._staging_outstanding.items() if v > 0},
        poisoned=sorted(str(r) for r in rnd["rooms"] if r in pair.pm._deferred_ack_poisoned_rooms),
        slices_per_request=rnd["kv_descriptors_per_request"],
        calls=list(calls),
        stats=_delta(stats0),
    )


class _Link:
    """Fault wrapper on the prefill's engine (module docstring); records the slices of
    every call."""

    def __init__(self, pair: Pair):
        self.engine = pair.pm.engine
        self.real = self.engine.batch_transfer_sync
        self.hold_until = 0.0
        self.fail_first = False
        self.calls: list[int] = []
        self.acks = record_abort_acks(pair.pm)
        self.engine.batch_transfer_sync = self.batch_transfer_sync

    def reset(self) -> None:
        self.hold_until, self.fail_first, self.calls = 0.0, False, []

    def batch_transfer_sync(self, session, buffers, peers, lengths, *a, **k):
        self.calls.append(len(buffers))
        while time.monotonic() < self.hold_until:
            time.sleep(0.002)
        code = self.real(session, buffers, peers, lengths, *a, **k)
        if self.fail_first:  # the round's first call: the first room's KV
            self.fail_first = False
            return -1
        return code


class _Event:
    """A CUDA event as sglang's worker reads it: done at ``at`` (``time.monotonic()``);
    ``on_wait()`` runs when a worker first blocks on it before then."""

    def __init__(self, at: float, on_wait=None):
        self.at, self.on_wait = at, on_wait

    def query(self) -> bool:
        return time.monotonic() >= self.at

    def synchronize(self) -> None:
        if not self.query() and self.on_wait is not None:
            self.on_wait()
            self.on_wait = None
        while not self.query():
            time.sleep(0.002)


def _events_round(pair: Pair, link: "_Link") -> dict:
    import torch

    every = range(pair.shape.planes)
    link.reset()
    s0 = _stats()
    seen = {}
    pending = _Event(float("inf"), on_wait=lambda: seen.setdefault("at_wait", _delta(s0)))

    def send(r, sender, pages):
        if r == 0:
            pending.at = time.monotonic() + HOLD_S
        if r == 3:
            sender._early_send_wait_event = pending
        ev = pending if r == 2 else _Event(0.0)
        sender.send(torch.from_numpy(pages), indices_event=ev)

    rnd = pair.sglang_round(check=every, at_once=True, send=send)
    return {"events": _outcome(pair, rnd, s0, link.calls) | {"at_wait": seen.get("at_wait")}}


def _err_posted_round(pair: Pair, link: "_Link") -> dict:
    import numpy as np

    pm, n = pair.pm, pair.shape.pages_per_request
    link.reset()
    link.fail_first = True
    bound, pm.max_transfer_batch_indices = pm.max_transfer_batch_indices, POSTED_PAGES
    s0 = _stats()

    def send(r, sender, pages):
        sender.send(np.arange(1 + r * n, 1 + (r + 1) * n, dtype=np.int32))  # room after room

    try:
        rnd = pair.sglang_round(check=(), at_once=True, decode_timeout=5, send=send)
    finally:
        pm.max_transfer_batch_indices = bound
    out = _outcome(pair, rnd, s0, link.calls)
    _clear_failed_sessions(pm)
    pm._staging_outstanding.clear()
    return {"err_posted": out}


def _clear_failed_sessions(pm) -> None:
    """What sglang's failed-session probe does once the decode answers again."""
    with pm.session_lock:
        pm.failed_sessions.clear()
        pm.session_failures.clear()


def main() -> dict:
    out = {"kvmem_path": _kvmem_path()}
    pair = Pair(
        Shape(page_size=16, **SHAPE),
        decode_env={"SGLANG_KVMEM": "0"},
        timeout=120,
        wait=False,
        backend="mooncake",
    )
    wide = Pair(
        Shape(page_size=16, **SCATTERED),
        decode_env={"SGLANG_KVMEM": "0"},
        timeout=120,
        wait=False,
        backend="mooncake",
    )
    try:
        # the scattered round first: the release round releases every kvmem pool of
        # this process (kvpool.release_all), and would leave this pair's pool zeros
        out |= _scattered(wide.ready())
        out |= _rounds(pair.ready())
    finally:
        pair.close()
        wide.close()
    return out


def _rounds(pair: Pair) -> dict:
    out = {}
    every = range(pair.shape.planes)
    link = _Link(pair)
    s0 = _stats()
    rnd = pair.sglang_round(check=every, at_once=True)
    out["plain"] = _outcome(pair, rnd, s0, link.calls)

    # abort the third room while a write carrying its pages is in flight
    link.reset()
    link.hold_until = float("inf")  # until the abort
    s0 = _stats()
    t = {}

    def abort_third(senders):
        victim, first = senders[2], senders[0].bootstrap_room
        room = victim.bootstrap_room
        end = time.monotonic() + 10
        # kvmem: the third room is counted once the worker sent it ahead in the first
        # room's write; sglang: wait until the worker is on the first room
        watch = room if _kvmem_path() else first
        while pair.pm._staging_outstanding.get(watch, 0) <= 0:
            assert time.monotonic() < end, "the worker never took the room"
            time.sleep(0.001)
        t["ahead_state"] = int(pair.pm.check_status(room))
        link.hold_until = time.monotonic() + HOLD_S
        victim.abort()
        t["aborted_at"], t["room"] = time.monotonic(), room

    rnd = pair.sglang_round(check=every, on_sent=abort_third, at_once=True)
    room = t["room"]
    out["abort"] = _outcome(pair, rnd, s0, link.calls) | {
        "ahead_state": t["ahead_state"],
        "hold_end_after_abort_s": link.hold_until - t["aborted_at"],
        "ack_after_abort_s": (link.acks[room] - t["aborted_at"] if room in link.acks else None),
    }

    # the first KV write of the round fails after its slices moved
    link.reset()
    link.fail_first = True
    s0 = _stats()
    rnd = pair.sglang_round(check=every, at_once=True, decode_timeout=5)
    out["err"] = _outcome(pair, rnd, s0, link.calls)
    _clear_failed_sessions(pair.pm)
    pair.pm._staging_outstanding.clear()  # what sglang keeps counted for failed rooms

    out |= _err_posted_round(pair, link)
    out |= _events_round(pair, link)

    # release and resume the prefill's KV, then a plain round
    from kvmem_sglang import kvpool

    pm = pair.pm
    pm.deregister_buffer_to_engine()
    kvpool.release_all()
    kvpool.resume_all(True)
    pm.register_buffer_to_engine()
    fill_pattern(pair.kv)
    link.reset()
    s0 = _stats()
    rnd = pair.sglang_round(check=every, at_once=True)
    out["release"] = _outcome(pair, rnd, s0, link.calls) | {"registrations": pair.registrations()}
    return out


def _scattered(pair: Pair) -> dict:
    link = _Link(pair)
    s0 = _stats()
    rnd = pair.sglang_round(check=(0, pair.shape.planes - 1), at_once=True, decode_timeout=10)
    return {"scattered": _outcome(pair, rnd, s0, link.calls)}


if __name__ == "__main__":
    script_main(main)
