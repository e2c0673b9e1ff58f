"""Run by tests/sglang/test_take_ahead_depth.py in a process of its own (nothing of sglang
hooked: the adapter's functions are called as its hooks call them): kvmem's
``transfer_ahead.take_ahead`` on a deep queue that several decodes share, against the
scan it replaced (:func:`take_ahead_scan`, which looks at every queued chunk per send).

The world, built twice from one seed: sglang's ``FastQueue`` holding ``TransferKVChunk``s
of ``ROOMS`` rooms for each of ``DECODES`` decodes, ``CHUNKS`` chunks a room of 1 to
``MAX_PAGES`` pages, interleaved across rooms and decodes as rooms arriving together fill
one worker's queue; sglang's NIXL ``TransferInfo`` per room (one decode each), and a
``NixlKVManager`` (``object.__new__``) with the fields ``take_ahead`` reads and sglang's own
``check_status`` and ``update_status``.  While the worker works: every seventh room is
aborted (``update_status(..., Failed)``) once ``ABORT_AT`` chunks were taken from the
queue; the chunks of every eleventh room carry an event still pending (``query()`` False)
until ``EVENT_AT`` chunks were taken; the first chunk of every room whose number is a
multiple of ``DEFER_EVERY`` is put back at the end of the queue the first time the worker
takes it (as sglang's worker puts back a chunk whose staging is not ready).

The worker (:func:`_worker`) does what sglang's ``transfer_worker`` and kvmem's
``send_kvcache`` do with a chunk, as far as ``take_ahead`` sees it: skips a chunk whose room
is gone or Failed, waits for its events, ends a chunk sent ahead whose write is DONE (waits
for one still in flight), and otherwise sends it with the chunks ``take_ahead`` gives it,
``BUDGET_PAGES`` pages a write.  A write is DONE at once, except every ``ERR_EVERY``-th,
which fails (its chunks go again, on their own turn or ahead in a later write), and every
``PROC_EVERY``-th, in flight for ``PROC_GETS`` more chunks taken from the queue.  Run once
through the adapter's hook (``transfer_worker`` hands the worker its queue) and once on the
scan.  Recorded per send: the owner, the chunks taken (in order), the chunks looked at
(``_readable`` calls), and of those the ones that had to wait (an event pending, or in a
write in flight).  Prints one JSON object on its last line.
"""

from __future__ import annotations

import random
from collections import defaultdict

import numpy as np

from tests.sglang.sglang_env import script_main

DECODES, ROOMS, CHUNKS, MAX_PAGES = 4, 60, 3, 24
BUDGET_PAGES, PER_PAGE = 48, 1000
ABORT_AT, EVENT_AT = 100, 150
ERR_EVERY, PROC_EVERY, PROC_GETS, DEFER_EVERY = 5, 7, 15, 13
SEED = 7


class _Event:
    """A chunk's CUDA event as the worker sees it: pending until ``EVENT_AT`` gets."""

    def __init__(self, world):
        self.world = world

    def query(self) -> bool:
        return self.world.gets >= EVENT_AT


class _World:
    def __init__(self):
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.common.utils import FastQueue, TransferKVChunk
        from sglang.srt.disaggregation.nixl.conn import NixlKVManager, TransferInfo

        rng = random.Random(SEED)
        mgr = object.__new__(NixlKVManager)
        mgr.request_status, mgr.transfer_infos = {}, {}
        mgr._staging_outstanding = defaultdict(int)
        mgr.enable_deferred_decode_kv_release = False
        mgr.deferred_bootstrap = None
        mgr._deferred_ack_targets, mgr._deferred_ack_poisoned_rooms = {}, set()
        self.mgr, self.queue, self.gets = mgr, FastQueue(), 0
        self.key: dict[int, list] = {}  # id(page ids) -> [room, chunk]
        self.aborts: list[int] = []
        self.st = None  # the worker's TransferState (_worker)
        chunks = []
        for d in range(DECODES):
            for r in range(ROOMS):
                room = 1000 * (d + 1) + r
                pages = [rng.randint(1, MAX_PAGES) for _ in range(CHUNKS)]
                mgr.update_status(room, KVPoll.Bootstrapping)
                mgr.update_status(room, KVPoll.WaitingForInput)
                info = TransferInfo(
                    room=room,
                    endpoint="127.0.0.1",
                    dst_port=17000 + d,
                    agent_name=f"decode-{d}",
                    dst_kv_indices=np.arange(sum(pages), dtype=np.int32),
                    dst_aux_index=0,
                    required_dst_info_num=1,
                    dst_state_indices=[],
                )
                mgr.transfer_infos[room] = {info.agent_name: info}
                if r % 7 == 3:
                    self.aborts.append(room)
                start = 0
                for c, n in enumerate(pages):
                    src = np.arange(start, start + n, dtype=np.int32) + 1
                    chunk = TransferKVChunk(
                        room=room,
                        prefill_kv_indices=src,
                        index_slice=slice(start, start + n),
                        is_last_chunk=c == CHUNKS - 1,
                        prefill_aux_index=0,
                        state_indices=None,
                        wait_event=_Event(self) if r % 11 == 5 else None,
                    )
                    self.key[id(src)] = [room, c]
                    chunks.append((c, rng.random(), chunk))
                    start += n
        for _, _, chunk in sorted(chunks, key=lambda t: t[:2]):  # rooms interleaved
            self.queue.put(chunk)
        self.queued = self.puts = len(chunks)


def take_ahead_scan(mgr, st, peer, budget, per_page, peer_of, queue):
    """The scan ``take_ahead`` replaced (every queued chunk looked at, per send), for
    which chunks it takes and in what order."""
    from kvmem_sglang import transfer_ahead
    from kvmem_sglang.transfer_records import Ahead
    from sglang.srt.disaggregation.base.conn import KVPoll

    st.sweep(mgr)
    with queue._cond:
        queued = list(queue._buf)
    out = []
    for chunk in queued:
        if not transfer_ahead._readable(chunk):
            continue
        src = chunk.prefill_kv_indices
        n = len(src)
        if n == 0 or n * per_page > budget or _in_write(st, src):
            continue
        room, counts = chunk.room, mgr._staging_outstanding
        fresh = room not in counts
        counts[room] += 1
        rec = Ahead(room, peer, src, np.empty(0, dtype=np.int64))
        ok = (
            room in mgr.request_status
            and mgr.check_status(room) != KVPoll.Failed
            and transfer_ahead._dst_of(mgr, chunk, peer, rec, peer_of)
        )
        if not ok:
            transfer_ahead.uncount(mgr, rec, drop=fresh)
            continue
        budget -= n * per_page
        out.append(rec)
    return out


def _in_write(st, src) -> bool:
    """Whether the chunk of ``src`` is in a write that has not failed."""
    rec = st.ahead.get(id(src))
    return rec is not None and rec.src is src and (rec.batch is None or rec.batch.state != "ERR")


def _worker(world: _World, take, looked: dict, sends: list):
    """sglang's transfer worker as ``take_ahead`` sees it (module docstring), sending
    with ``take(mgr, st, peer, budget, queue)``; appends ``[owner, taken, looked, waiting]``
    per send to ``sends`` (from ``looked``, which ``main``'s ``_readable`` fills)."""
    from kvmem_sglang.transfer_ahead import uncount
    from kvmem_sglang.transfer_records import Batch, TransferState
    from sglang.srt.disaggregation.base.conn import KVPoll

    st = world.st = TransferState()
    in_flight: list = []  # [(settles at this many gets, batch)]

    deferred: set[int] = set()

    def loop(mgr, queue):
        while queue._buf:  # this thread is the queue's only reader
            chunk = queue.get()
            world.gets += 1
            if world.gets == ABORT_AT:
                for room in world.aborts:
                    mgr.update_status(room, KVPoll.Failed)
            for at, batch in list(in_flight):
                if at <= world.gets:
                    batch.state = "DONE"
                    in_flight.remove((at, batch))
            room = chunk.room
            if room not in mgr.request_status or mgr.check_status(room) == KVPoll.Failed:
                mgr._staging_outstanding.pop(room, None)
                continue
            key = world.key[id(chunk.prefill_kv_indices)]
            if key[0] % DEFER_EVERY == 0 and key[1] == 0 and key[0] not in deferred:
                deferred.add(key[0])  # its staging is not ready: put back, last
                queue.put(chunk)
                world.puts += 1
                continue
            chunk.wait_event = None  # the worker synchronizes it
            rec = st.take(chunk.prefill_kv_indices)
            if rec is not None and rec.batch.state == "PROC":
                rec.batch.state = "DONE"  # the worker waits for it
            if rec is not None and rec.batch.state == "DONE":
                continue  # sent ahead: its write is DONE
            peer = next(iter(mgr.transfer_infos[room]))  # (ERR: sent again on its own)
            budget = (BUDGET_PAGES - len(chunk.prefill_kv_indices)) * PER_PAGE
            looked.update(looked=0, waiting=0)
            ahead = take(mgr, st, peer, budget, queue)
            key = world.key
            owner, taken = key[id(chunk.prefill_kv_indices)], [key[id(a.src)] for a in ahead]
            sends.append([owner, taken, looked["looked"], looked["waiting"]])
            batch = Batch([], ahead, 0, 0)
            batch.state = "DONE"
            if len(sends) % ERR_EVERY == 0:
                batch.state, batch.failed = "ERR", True
            elif len(sends) % PROC_EVERY == 0:
                batch.state = "PROC"
                in_flight.append((world.gets + PROC_GETS, batch))
            for a in ahead:
                a.batch = batch
                st.put(a)
                uncount(mgr, a)

    return loop


def main() -> dict:
    from testkit.sglang_pair import nixl_as_sglang_imports_it

    nixl_as_sglang_imports_it()
    from kvmem_sglang import transfer_ahead
    from kvmem_sglang.transfer import _nixl_peer
    from kvmem_sglang.transfer_records import STATS

    looked = {"looked": 0, "waiting": 0}
    readable = transfer_ahead._readable

    def counted(chunk):
        ok = readable(chunk)
        looked["looked"] += 1
        rec = world.st.ahead.get(id(chunk.prefill_kv_indices))
        looked["waiting"] += not ok or (rec is not None and rec.batch.state == "PROC")
        return ok

    transfer_ahead._readable = counted  # what both look at a queued chunk with
    out = {}
    world, sends = _World(), []
    loop = _worker(
        world,
        lambda mgr, st, peer, budget, queue: transfer_ahead.take_ahead(
            mgr, st, peer, budget, PER_PAGE, _nixl_peer
        ),
        looked,
        sends,
    )
    s0 = STATS.as_dict()
    transfer_ahead.transfer_worker(loop, world.mgr, world.queue)  # the hook, as sglang calls it
    s1 = STATS.as_dict()
    out["index"] = dict(
        sends=sends,
        queued=world.queued,
        puts=world.puts,
        stats={k: s1.get(k, 0) - s0.get(k, 0) for k in ("indexed", "inspected")},
    )
    world, sends = _World(), []
    loop = _worker(
        world,
        lambda mgr, st, peer, budget, queue: take_ahead_scan(
            mgr, st, peer, budget, PER_PAGE, _nixl_peer, queue
        ),
        looked,
        sends,
    )
    loop(world.mgr, world.queue)
    out["scan"] = dict(sends=sends, queued=world.queued, puts=world.puts)
    return out


if __name__ == "__main__":
    script_main(main)
