"""Run by tests/sglang/test_transfer_tp.py in a process of its own: real sglang PD pairs
at TP 2 (``testkit.sglang_pair.Pair`` with ``prefill_tp=2``: the prefill's rank 0 here,
its rank 1 and each decode rank in processes of their own, each rank with its half of the
KV heads; NIXL/UCX on DRAM, or Mooncake over TCP with ``KVMEM_TEST_BACKEND=mooncake``), with
the environment the test sets on both sides (the flag on, kvmem's send path).

Two pairs, started together, one round each of ``REQUESTS`` requests whose pages are
never adjacent within a request, every plane of every page checked on each decode rank:

* ``2x1``, a TP 1 decode: each prefill rank writes its heads into every row of the one
  decode rank, which needs sglang's per-token slice send (kvmem's merged path serves
  equal TP only): on NIXL sglang's own send runs under the flag; on Mooncake sglang's
  slices are posted in calls within the TCP queue (``kvmem_sglang.mooncake_slice``);
* ``2x2``, a TP 2 decode: prefill rank ``r`` writes decode rank ``r``'s heads, on kvmem's
  path under the flag.

Prints one JSON object on its last line: per pair, every room's end on each prefill rank
and decode rank, the rows that differ from the prefill ranks' pattern, the KV
descriptors a request took on all prefill ranks, and rank 0's send-path counters.
"""

from __future__ import annotations

import os

from testkit.child import script_main
from testkit.sglang_pair import Pair, Shape
from tests.sglang.sglang_env import kvmem_send_path, stats_since, transfer_stats

REQUESTS = 4
SHAPE = dict(layers=2, heads=4, head_dim=64, page_size=16, requests=REQUESTS, tokens=64)


def main() -> dict:
    backend = os.environ.get("KVMEM_TEST_BACKEND", "nixl")
    pairs = [
        Pair(Shape(**SHAPE, prefill_tp=2, decode_tp=d), timeout=120, wait=False, backend=backend)
        for d in (1, 2)
    ]  # every rank's process starts at once
    out = {"kvmem_path": kvmem_send_path()}
    try:
        for pair in pairs:
            pair.ready()
            s0 = transfer_stats()
            rnd = pair.sglang_round(check=range(pair.shape.planes))
            out[pair.shape.tp_label] = dict(
                prefill=[rnd["prefill_states"]] + rnd["rank_states"],
                decode=[rnd["decode_states"]] + rnd["decode_rank_states"],
                bad_rows=rnd["bad_rows"],
                descriptors=rnd["kv_descriptors_per_request"],
                stats=stats_since(s0),
                kvmem_pool=pair.decode_info["kvmem_pool"],
            )
    finally:
        for pair in pairs:
            pair.close()
    return out


if __name__ == "__main__":
    script_main(main)
