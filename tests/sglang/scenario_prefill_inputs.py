"""Run by tests/sglang/test_prefill_inputs.py in a process of its own, flag off or on:
what 0.5.23 already does right (regressions), bad inputs through the adapter's surface,
the idle leak audit, the time to free an abort in the running batch, a release while a
batch's result is pending, and (last, because it leaves the scheduler inconsistent on
purpose) a chunk send set up before a release.  Prints one JSON object on its last line."""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time

from tests.sglang.prefill_env import prefill_stats
from tests.sglang.scenario_prefill_gaps import _call, _kvmem_on


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main() -> dict:
    from tests.sglang.prefill_env import PrefillHarness

    h = PrefillHarness(page_size=4, pages=64, max_reqs=8)
    from sglang.srt.disaggregation.base.conn import KVPoll as K

    log = _Lines()
    logging.getLogger("kvmem.sglang").addHandler(log)
    logging.getLogger("kvmem.sglang").setLevel(logging.INFO)
    out: dict = {"kvmem": _kvmem_on()}

    def answers(rid):
        return [r for _, r in h.outbox.answers.get(rid, [])]

    def snapshot():
        return {
            "held": h.held(),
            "queues": h.queues(),
            "answers": sum(len(v) for v in h.outbox.answers.values()),
            "offload_tags": sorted(h.wu.offload_tags),
        }

    # -- regression: abort in the running prefill batch frees its KV before any chunk -------
    h.submit("run-a", 9)
    h.submit("run-b", 9)
    h.pop_bootstrapped()
    batch = h.launch()
    held_in_batch = h.held()
    h.abort("run-a")
    h.finish_forward(batch)
    out["running_abort"] = {
        "held_in_batch": held_in_batch,
        "held_after_result": h.held(),
        "sends": h.sender("run-a").sends,
        "aborts": h.sender("run-a").aborts,
        "answers": answers("run-a"),
        "other_sends": h.sender("run-b").sends,
    }
    h.inflight()
    h.s.last_batch = None

    # -- regression: an inflight abort reaches the sender -------------------------------------
    h.submit("fly", 9)
    h.prefill_to_transferring("fly")
    h.abort("fly")
    aborts_at_once = h.sender("fly").aborts
    h.inflight()
    out["inflight_abort"] = {"aborts": aborts_at_once, "answers": answers("fly"), "held": h.held()}

    # -- bad inputs -----------------------------------------------------------------------------
    bad: dict = {}
    before = snapshot()
    h.abort("no-such-rid")
    bad["unknown_abort"] = {"before": before, "after": snapshot()}
    h.submit("dbl", 9, hold=K.Bootstrapping)
    h.step()
    h.abort("dbl")
    h.abort("dbl")
    h.step()
    h.abort("dbl")  # after it was answered: unknown now
    bad["double_abort"] = {
        "answers": answers("dbl"),
        "aborts": h.sender("dbl").aborts,
        "held": h.held(),
    }
    bad["resume_without_release"] = {"before": snapshot(), "call": _call(h.resume)}
    bad["resume_without_release"]["after"] = snapshot()
    bad["release"] = _call(h.release)
    before = snapshot()
    bad["release_twice"] = {"before": before, "call": _call(h.release), "after": snapshot()}
    bad["resume"] = _call(h.resume)
    before = snapshot()
    bad["resume_twice"] = {"before": before, "call": _call(h.resume), "after": snapshot()}
    h.submit("after-bad", 9)
    h.step()
    h.s.last_batch = None
    bad["after_bad"] = answers("after-bad")
    bad["log"] = [line for line in log.lines if "refused" in line or "no such request" in line]
    out["bad_inputs"] = bad

    # -- leak audit: a request lost by a buggy path while in flight ---------------------------
    from_audit = _audit_stats()
    h.submit("lost", 9)
    h.prefill_to_transferring("lost")
    h.s.disagg_prefill_inflight_queue.remove(h.reqs["lost"])  # the bug: dropped, unfreed
    h.inflight()  # the scheduler is idle now
    h.inflight()  # and stays idle: no second report
    out["audit"] = {
        "before": from_audit,
        "after": _audit_stats(),
        "held": h.held(),
        "log": [line for line in log.lines if "leak audit" in line],
    }
    # give the lost request's KV and slots back (what its missing path should have done)
    from sglang.srt.disaggregation.prefill import maybe_release_metadata_buffer
    from sglang.srt.mem_cache.common import release_kv_cache

    lost = h.reqs["lost"]
    release_kv_cache(lost, h.tree, checkpoint=False)
    maybe_release_metadata_buffer(lost, h.s.req_to_metadata_buffer_idx_allocator)
    out["audit"]["held_after_cleanup"] = h.held()

    # -- time to free an abort in the running batch (same scheduler step) --------------------
    times = []
    for rep in range(40):
        rids = [f"tm{rep}-{i}" for i in range(4)]
        for rid in rids:
            h.submit(rid, 9)
        h.pop_bootstrapped()
        batch = h.launch()
        for rid in rids:
            h.abort(rid)
        t0 = time.perf_counter()
        h.finish_forward(batch)
        times.append(time.perf_counter() - t0)
        assert h.held()["kv_tokens"] == 0
        h.inflight()
        h.s.last_batch = None
    out["abort_free_us"] = {
        "median": statistics.median(times[5:]) * 1e6,
        "n": len(times) - 5,
        "reqs_per_batch": 4,
    }

    # -- release while a batch's result is pending (its forward launched) --------------------
    h.submit("busy", 9)
    h.submit("busy-q", 9, hold=K.Bootstrapping)
    h.pop_bootstrapped()
    batch = h.launch()  # running: last_batch holds it
    before = snapshot()
    out["release_busy"] = {"before": before, "call": _call(h.release), "after": snapshot()}
    h.finish_forward(batch)  # the pending result reaches the result handler
    out["release_busy"]["after_result"] = snapshot()
    out["release_busy"]["resume"] = _call(h.resume)  # stock: KeyError (nothing released)
    h.sender("busy-q").hold = None
    for _ in range(3):
        h.step()
        h.s.last_batch = None
    out["release_busy"]["answers"] = {r: answers(r) for r in ("busy", "busy-q")}
    out["release_busy"]["held_end"] = h.held()

    # -- last: a chunk send set up before a release, posted after the resume ----------------
    h.submit("stale", 9)
    h.pop_bootstrapped()
    batch = h.launch()
    h.s.last_batch = None  # the forward's result is pending where the release cannot see it
    st = {"release": _call(h.release), "resume": _call(h.resume)}
    try:
        h.finish_forward(batch)
        st["finish"] = "ok"
    except Exception as e:
        st["finish"] = f"{type(e).__name__}: {e}"
    st["sends"] = h.sender("stale").sends
    st["aborts"] = h.sender("stale").aborts
    out["stale_send"] = st
    out["prefill_stats"] = prefill_stats()
    return out


def _audit_stats():
    try:
        from kvmem_sglang import audit
    except ImportError:
        return None
    s = audit.STATS
    metric = None
    try:
        from prometheus_client import REGISTRY

        metric = {
            k: REGISTRY.get_sample_value("kvmem_sglang_prefill_leaked_total", {"kind": k})
            for k in ("pages", "req_slots", "metadata_slots")
        }
    except ImportError:
        pass
    return {
        "audits": s.audits,
        "leaks": s.leaks,
        "pages": s.leaked_pages,
        "req_slots": s.leaked_req_slots,
        "metadata_slots": s.leaked_metadata_slots,
        "page_owners": dict(s.last.page_owners) if s.last else None,
        "req_slot_owners": list(s.last.req_slot_owners) if s.last else None,
        "metadata_owners": list(s.last.metadata_owners) if s.last else None,
        "metric": metric,
    }


if __name__ == "__main__":
    result = main()
    sys.stdout.flush()
    print(json.dumps(result, default=str))
