"""Run by tests/sglang/test_prefill_chunked.py in a process of its own, flag off or on
(``SGLANG_KVMEM``): chunked prefill on a real PD prefill scheduler
(``prefill_env.PrefillHarness`` with ``chunk_pages``: sglang's own
``get_next_disagg_prefill_batch_to_run``, ``process_prefill_chunk``, ``send_kv_chunk``,
``process_batch_result_disagg_prefill``, ``process_pending_chunked_abort``).  Each case
records what the client got, what the sender was asked to send, and what stays held;
every case ends by letting the held senders finish and running the loop until idle.
Prints one JSON object on its last line.

Chunks: page_size 4, chunk_pages 2 -> 8 tokens a pass; a 29-token prompt is 4 chunks
(8, 8, 8, 5), a 21-token prompt 3 (8, 8, 5).  In sglang's normal loop a chunk's KV is
sent at the start of the next iteration (``process_prefill_chunk``), the last one after
its forward (``process_batch_result_disagg_prefill``)."""

from __future__ import annotations

import json
import sys
import time

from tests.sglang.prefill_env import prefill_stats
from tests.sglang.scenario_prefill_gaps import _call, _code, _kvmem_on

TRANSFER_TIMEOUT = 0.3  # SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT set by the test


def main() -> dict:
    from tests.sglang.prefill_env import PrefillHarness

    h = PrefillHarness(page_size=4, pages=64, max_reqs=8, chunk_pages=2)
    from sglang.srt.disaggregation.base.conn import KVPoll as K

    s = h.s
    out: dict = {"kvmem": _kvmem_on()}
    # what is held when sglang's release flushes the pools (after the adapter's drain):
    # the flush frees everything, so only this tells freed-once from leaked (a double
    # free shows as a negative count)
    flushes: list = []
    real_flush = h.wu.flush_cache

    def flush_spy(*a, **k):
        flushes.append(h.held())
        return real_flush(*a, **k)

    h.wu.flush_cache = flush_spy

    def answer(rid):
        return [
            {"type": r.get("type"), "status": _code(r), "message": r.get("message")}
            for _, r in h.outbox.answers.get(rid, [])
        ]

    def state():
        return {
            "held": h.held(),
            "queues": h.queues(),
            "chunked": s.chunked_req.rid if s.chunked_req is not None else None,
            "pending_chunk_rids": sorted(s.disagg_prefill_pending_chunk_rids),
            "pending_chunked_abort": s._pending_chunked_abort_req is not None,
        }

    def report(rids):
        return {
            rid: {
                "answer": answer(rid),
                "sends": h.sender(rid).sends,
                "aborts": h.sender(rid).aborts,
            }
            for rid in rids
        }

    def settle():
        """Held senders finish (FakeKVSender: Success once anything was sent) and the
        loop runs until nothing is left: what a stuck request held comes back."""
        for req in h.reqs.values():
            if req.disagg_kv_sender is not None:
                req.disagg_kv_sender.hold = None
                req.disagg_kv_sender.after_send = None
        for _ in range(8):
            h.loop_step()
        s.last_batch = None
        return state()

    # -- a. a chunked request completes: every chunk sent once, 200 --------------------------
    h.submit("a-ok", 21)
    trace = []
    for _ in range(5):
        batch = h.loop_step()
        trace.append(
            {
                "batch": [r.rid for r in batch.reqs] if batch else None,
                "sends": list(h.sender("a-ok").sends),
                **state(),
            }
        )
    out["complete"] = {**report(["a-ok"]), "trace": trace, "end": state()}
    out["complete"]["after"] = settle()

    # -- b1. client abort between chunks: chunk 1 sent, chunk 2 computed, before chunk 3 ----
    h.submit("b-between", 29)
    h.loop_step()  # chunk 1's forward
    h.loop_step()  # chunk 1 sent, chunk 2's forward
    before = state()
    h.abort("b-between")
    at_abort = state()
    h.loop_step()  # the next iteration: the pending chunked abort, no chunk 3
    h.loop_step()
    out["abort_between"] = {
        **report(["b-between"]),
        "before": before,
        "at_abort": at_abort,
        "end": state(),
    }
    out["abort_between"]["after"] = settle()

    # -- b2/b3. client abort during a chunk's forward ---------------------------------------
    # Only the overlap loop ingests while a forward runs: the batch launched and queued
    # with its result, last_batch that batch; the next iteration schedules (the pending
    # chunked abort first) before it processes the queued result.
    def abort_during(rid, n_tokens, chunks_before):
        h.submit(rid, n_tokens)
        for _ in range(chunks_before):
            h.loop_step()
        batch = h.schedule()  # the previous chunk sent, this one launched
        s.last_batch = batch
        h.abort(rid)
        at_abort = state()
        nxt = h.schedule()  # the next iteration's scheduling
        h.finish_forward(batch)  # then the queued result
        h.inflight()
        s.last_batch = nxt
        h.loop_step()
        return {
            **report([rid]),
            "at_abort": at_abort,
            "next_batch": nxt is not None,
            "end": state(),
        }

    out["abort_during"] = abort_during("b-during", 29, 1)  # chunk 2 of 4
    out["abort_during"]["after"] = settle()
    out["abort_last"] = abort_during("b-last", 21, 2)  # chunk 3 of 3, the last
    out["abort_last"]["after"] = settle()

    # -- c. the send of a middle chunk fails -------------------------------------------------
    h.submit("c-fail", 29)
    h.sender("c-fail").fail_on_send = 2  # chunk 2 of 4
    steps = 0
    while steps < 8:
        steps += 1
        h.loop_step()
        if h.outbox.answers.get("c-fail"):
            break
    out["middle_send_failed"] = {**report(["c-fail"]), "steps": steps, "end": state()}
    out["middle_send_failed"]["after"] = settle()

    # -- d. transfer timeout: the sender stays Transferring after the chunks --------------
    h.submit("d-stuck", 21)
    h.sender("d-stuck").after_send = K.Transferring
    for _ in range(4):
        h.loop_step()
    in_flight = state()
    time.sleep(TRANSFER_TIMEOUT + 0.1)
    h.loop_step()
    h.loop_step()
    out["transfer_timeout"] = {**report(["d-stuck"]), "in_flight": in_flight, "end": state()}
    out["transfer_timeout"]["after"] = settle()

    # -- e. release_memory_occupation(kv_cache) between two chunks ---------------------------
    h.submit("e-chunked", 29)
    h.loop_step()  # chunk 1
    h.loop_step()  # chunk 1 sent, chunk 2 computed: sched.chunked_req is e-chunked
    h.submit("e-boot", 9, hold=K.Bootstrapping)
    rel: dict = {"before": state()}
    rel["release"] = _call(h.release)
    rel["held_at_flush"] = list(flushes)
    rel["after_release"] = state()
    rel["resume"] = _call(h.resume)
    h.submit("e-after", 21)
    for _ in range(6):
        h.loop_step()
    rel["end"] = state()
    rel.update(report(["e-chunked", "e-boot", "e-after"]))
    rel["after"] = settle()
    rel["answers_settled"] = {rid: answer(rid) for rid in ("e-chunked", "e-boot", "e-after")}
    out["release"] = rel

    # -- e2. a client abort of the chunked request, not yet applied, then the release -------
    h.submit("e-aborted", 29)
    h.loop_step()
    h.loop_step()
    h.abort("e-aborted")  # _pending_chunked_abort_req set; applied at the next step
    ra: dict = {"before": state()}
    ra["release"] = _call(h.release)
    ra["after_release"] = state()
    ra["resume"] = _call(h.resume)
    h.loop_step()  # the next step: the pending chunked abort (stock) or nothing left
    h.loop_step()
    ra.update(report(["e-aborted"]))
    ra["end"] = state()
    ra["after"] = settle()
    ra["answers_settled"] = answer("e-aborted")
    out["release_after_abort"] = ra

    # -- f. release while a chunk's result is queued (overlap loop) --------------------------
    flushes.clear()
    out["release_overlap"] = _release_overlap(h, answer, state, report, settle)
    out["release_overlap"]["held_at_flush"] = list(flushes)
    out["prefill_stats"] = prefill_stats()
    return out


def _release_overlap(h, answer, state, report, settle) -> dict:
    """``event_loop_overlap_disagg_prefill`` queues a launched batch with its result and
    processes it in the next iteration, after that iteration's ingest: a release can be
    ingested with it queued.  Here: chunk 2 of f-chunked launched and queued, last_batch
    that batch, then the release; then the loop's next steps as the overlap loop takes
    them (it pops a queued result only while last_batch is set): the queued result is
    processed after the release."""
    import torch
    from sglang.srt.managers.utils import GenerationBatchResult

    s = h.s
    h.submit("f-chunked", 29)
    h.loop_step()  # chunk 1
    batch = h.schedule()  # chunk 1 sent, chunk 2 launched
    result = GenerationBatchResult(next_token_ids=torch.arange(len(batch.reqs)) + 11)
    s.result_queue.append((batch.copy(), result))  # as the loop queues it (prefill.py:833)
    s.last_batch = batch
    s.enable_overlap = True  # is_fully_idle counts the queued result
    f: dict = {"before": state(), "queued": len(s.result_queue)}
    try:
        f["release"] = _call(h.release)
        f["after_release"] = {
            **state(),
            "queued": len(s.result_queue),
            "last_batch": s.last_batch is not None,
        }
        s.enable_overlap = False  # (a middle chunk is sent the non-overlap way below)
        if s.last_batch is not None and s.result_queue:  # the loop processes it
            h.finish_forward(s.result_queue.pop()[0])
            h.inflight()
        f["resume"] = _call(h.resume)
    finally:
        s.enable_overlap = False
        s.result_queue.clear()
    f.update(report(["f-chunked"]))
    f["end"] = state()
    f["after"] = settle()
    f["answers_settled"] = answer("f-chunked")
    return f


if __name__ == "__main__":
    result = main()
    sys.stdout.flush()
    print(json.dumps(result, default=str))
