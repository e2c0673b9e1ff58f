"""A release while a request that was prefilled before its bootstrap finished (sglang's
optimistic prefill, ``--optimistic-prefill-attempts``) waits in the inflight queue: it
holds KV, a request slot and a metadata slot.  Stock sglang 0.5.23 raises in the
scheduler loop; with the flag on it is answered once with 503 through sglang's bootstrap
failure path, and everything it held is freed."""

from __future__ import annotations

from tests.sglang.sglang_env import result_of, run_script

SCRIPT = """
import tests.sglang.prefill_env as E
from tests.sglang import sglang_env
E.publish = lambda ps: sglang_env.publish(ps, optimistic_prefill_attempts=1)
from tests.sglang.scenario_prefill_gaps import _call
from tests.sglang.sglang_env import emit
h = E.PrefillHarness(page_size=4, pages=64, max_reqs=8)
from sglang.srt.disaggregation.base.conn import KVPoll as K
h.submit("opt", 9, hold=K.Bootstrapping)
h.step()
h.s.last_batch = None
out = {"parked": h.queues()["inflight"], "pending": h.reqs["opt"].pending_bootstrap,
       "held_before": h.held(), "release": _call(h.release), "held_after": h.held(),
       "answers": [r for _, r in h.outbox.answers.get("opt", [])],
       "aborts": h.sender("opt").aborts}
emit(out)
"""


def test_release_with_an_optimistically_prefilled_request():
    on = result_of(run_script(SCRIPT, kvmem=True))
    off = result_of(run_script(SCRIPT, kvmem=False))
    for run in (on, off):
        assert run["parked"] == ["opt"] and run["pending"]
        assert run["held_before"] == {"kv_tokens": 12, "req_slots": 1, "meta_slots": 1}
    assert off["release"]["error"].startswith("AssertionError") and off["answers"] == []
    assert on["release"]["ok"]
    assert on["held_after"] == {"kv_tokens": 0, "req_slots": 0, "meta_slots": 0}
    assert len(on["answers"]) == 1 and on["answers"][0]["status_code"] == 503
    assert on["aborts"] >= 1
