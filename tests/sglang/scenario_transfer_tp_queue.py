"""Run by tests/sglang/test_transfer_tp_queue.py in a process of its own (``.venv-e2e``'s
interpreter, which has Mooncake's engine): a real sglang PD pair over Mooncake at unequal
attention TP (``testkit.sglang_pair.Pair``: a TP 2 prefill beside a TP 1 decode, every
rank a process of its own with its share of the KV heads), every rank with Mooncake's
default TCP queue (1,024 transfers per peer, set explicitly: the harness raises it where
unset) and the environment the test sets (``SGLANG_KVMEM=1`` with
``SGLANG_KVMEM_TRANSFER`` ``kvmem`` or ``sglang``) on both sides.

One round: ``REQUESTS`` requests of ``TOKENS`` tokens at page size 16, one chunk each,
queued at once.  At unequal TP sglang sends each token of each plane as a slice of
its own (``send_kvcache_slice``), one ``batch_transfer_sync`` per plane with ``TOKENS``
slices: past the queue.  Every plane of every row is checked on each decode rank in the
rooms that end Success.

Then, when every room of the round ended Success (a failed session refuses any write),
the raw write of the same bytes (``Pair.raw_round``: one ``batch_transfer_sync`` slice
per request and plane on every prefill rank, each within the queue).

Prints one JSON object on its last line: for the pair (``2x1``), every room's end on
each prefill and decode rank, the rows that differ, the slices of each
``batch_transfer_sync`` call of the prefill's rank 0 (KV and aux), the sessions that
rank marked failed during the round, rank 0's send-path counters, and the round's wall
time and bytes (and the raw write's), for the report; no test reads a time.
"""

from __future__ import annotations

from testkit.sglang_pair import Pair, Shape
from tests.sglang.sglang_env import kvmem_send_path, script_main, stats_since, transfer_stats

REQUESTS = 2
SUCCESS = 4  # KVPoll.Success
TOKENS = 4096  # slices a call carries on sglang's send: four times the TCP queue
SHAPE = dict(layers=2, heads=4, head_dim=64, page_size=16, requests=REQUESTS, tokens=TOKENS)


class _Calls:
    """The slices of every ``batch_transfer_sync`` call of a prefill manager's engine."""

    def __init__(self, pm):
        self.slices: list[int] = []
        real = pm.engine.batch_transfer_sync

        def batch_transfer_sync(session, buffers, peers, lengths, *a, **k):
            self.slices.append(len(buffers))
            return real(session, buffers, peers, lengths, *a, **k)

        pm.engine.batch_transfer_sync = batch_transfer_sync


class _Marked(set):
    """A prefill manager's ``failed_sessions`` that keeps every session ever added to it
    (``marked``): sglang's probe takes a session out again once it answers."""

    def __init__(self, items=()):
        super().__init__(items)
        self.marked: list[str] = list(items)

    def add(self, session) -> None:
        self.marked.append(session)
        super().add(session)


def main() -> dict:
    pairs = [
        Pair(Shape(**SHAPE, prefill_tp=p, decode_tp=d), timeout=180, wait=False, backend="mooncake")
        for p, d in ((2, 1),)
    ]
    out = {"kvmem_path": kvmem_send_path()}
    try:
        for pair in pairs:
            pair.ready()
            calls = _Calls(pair.pm)
            marked = pair.pm.failed_sessions = _Marked(pair.pm.failed_sessions)
            s0 = transfer_stats()
            rnd = pair.sglang_round(check=range(pair.shape.planes), at_once=True, decode_timeout=20)
            out[pair.shape.tp_label] = dict(
                prefill=[rnd["prefill_states"]] + rnd["rank_states"],
                decode=[rnd["decode_states"]] + rnd["decode_rank_states"],
                bad_rows=rnd["bad_rows"],
                calls=calls.slices,
                marked_failed=sorted(set(marked.marked)),
                stats=stats_since(s0),
                seconds=rnd["seconds"],
                nbytes=rnd["nbytes"],
            )
            if rnd["prefill_states"] == [SUCCESS] * REQUESTS:  # a failed session refuses it
                raw = pair.raw_round()
                out[pair.shape.tp_label]["raw"] = dict(seconds=raw["seconds"], nbytes=raw["nbytes"])
    finally:
        for pair in pairs:
            pair.close()
    return out


if __name__ == "__main__":
    script_main(main)
