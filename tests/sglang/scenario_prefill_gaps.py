"""Run by tests/sglang/test_prefill_gaps.py in a process of its own, flag off or on
(``SGLANG_KVMEM``): each case of test_prefill_gaps.py through one real PD prefill scheduler
(``prefill_env.PrefillHarness``), one after the other, recording what the client got,
what the sender saw and what stays held.  Prints one JSON object on its last line.

Every case starts from, and the harness checks it returns to, an empty scheduler: no KV
held, no request or metadata slot, empty queues (``clean``)."""

from __future__ import annotations

import json
import sys
import time
import traceback

from tests.sglang.prefill_env import PrefillHarness, prefill_stats

TRANSFER_TIMEOUT = 0.3  # SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT set by the test
BOOTSTRAP_TIMEOUT = 1  # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT (sglang reads an int)
SETTLE_S = 0.6  # a posted write settles this long after the release starts (case 6)
FAIL_AFTER_S = 0.3  # a posted write fails this long after the release starts (case 12)


def main() -> dict:
    h = PrefillHarness(page_size=4, pages=64, max_reqs=8)
    from sglang.srt.disaggregation.base.conn import KVPoll as K

    out: dict = {"kvmem": _kvmem_on()}

    def answer(rid):
        got = h.outbox.answers.get(rid, [])
        return [
            {"type": r.get("type"), "status": _code(r), "message": r.get("message")} for _, r in got
        ]

    def settle():
        """Let every held sender finish (hold None -> FakeKVSender: Success) and run the
        loop until nothing is queued: the next case starts clean."""
        for req in h.reqs.values():
            if req.disagg_kv_sender is not None:
                req.disagg_kv_sender.hold = None
        for _ in range(4):
            h.step()
            h.s.last_batch = None
        return {"held": h.held(), "queues": h.queues()}

    # -- 1. transfer timeout ----------------------------------------------------------------
    for rid, state in (("t-transferring", K.Transferring), ("t-waiting", K.WaitingForInput)):
        h.submit(rid, 9)
        h.pop_bootstrapped()
        batch = h.launch()
        h.sender(rid).hold = state
        h.finish_forward(batch)
        h.inflight()
        h.s.last_batch = None
    time.sleep(TRANSFER_TIMEOUT + 0.1)
    h.inflight()
    h.inflight()
    out["transfer_timeout"] = {
        rid: {"answer": answer(rid), "aborts": h.sender(rid).aborts, "sends": h.sender(rid).sends}
        for rid in ("t-transferring", "t-waiting")
    }
    out["transfer_timeout"]["held"] = h.held()
    out["transfer_timeout"]["queues"] = h.queues()
    out["transfer_timeout"]["after"] = settle()

    # -- 2. bootstrap timeout (504) and another bootstrap failure (500) ---------------------
    h.submit("b-timeout", 9, hold=K.Bootstrapping)
    h.submit("b-failed", 9, hold=K.Bootstrapping)
    h.step()
    h.sender("b-failed").fail("decode peer 10.0.0.2 closed the connection")
    h.step()
    time.sleep(BOOTSTRAP_TIMEOUT + 0.1)
    h.step()
    out["bootstrap"] = {rid: {"answer": answer(rid)} for rid in ("b-timeout", "b-failed")}
    out["bootstrap"]["held"] = h.held()
    out["bootstrap"]["after"] = settle()

    # -- 3. client aborts of a bootstrapping and an inflight request -------------------------
    h.submit("c-boot", 9, hold=K.Bootstrapping)
    h.step()
    h.submit("c-fly", 9)
    h.prefill_to_transferring("c-fly")
    h.abort("c-boot")
    h.abort("c-fly")
    h.step()
    h.step()
    out["client_abort"] = {
        rid: {"answer": answer(rid), "aborts": h.sender(rid).aborts} for rid in ("c-boot", "c-fly")
    }
    out["client_abort"]["held"] = h.held()
    out["client_abort"]["after"] = settle()

    # -- 4. release with requests bootstrapping, waiting and in flight ----------------------
    h.submit("r-boot", 9, hold=K.Bootstrapping)
    h.step()
    h.s.last_batch = None
    h.submit("r-fly", 9)
    h.prefill_to_transferring("r-fly")
    h.submit("r-wait", 9)
    h.pop_bootstrapped()  # bootstrapped (metadata slot taken), not yet in a batch
    rel: dict = {"before": {"held": h.held(), "queues": h.queues()}}
    rel["release"] = _call(h.release)
    rel["after_release"] = {"held": h.held(), "queues": h.queues()}
    h.submit("r-late", 9)  # arrives while released (or, stock, while not released)
    rel["late_queued"] = h.queues()
    rel["resume"] = _call(h.resume)
    h.submit("r-after", 9)
    h.step()
    h.s.last_batch = None
    rel["answers"] = {
        rid: answer(rid) for rid in ("r-fly", "r-wait", "r-boot", "r-late", "r-after")
    }
    rel["aborts"] = {
        rid: h.sender(rid).aborts
        for rid in ("r-fly", "r-wait", "r-boot")
        if h.sender(rid) is not None
    }
    rel["pool_released_between"] = rel["release"].get("ok", False)
    rel["after"] = settle()
    rel["answers_settled"] = {
        rid: answer(rid) for rid in ("r-fly", "r-wait", "r-boot", "r-late", "r-after")
    }
    out["release"] = rel

    # -- 5. what `python -O` does with stock's assertion: the same release, assertion off ---
    h.submit("o-boot", 9, hold=K.Bootstrapping)
    h.step()
    h.s.last_batch = None
    real_idle = h.wu.is_fully_idle
    h.wu.is_fully_idle = lambda **kw: True  # `assert` is stripped under -O
    o = {"release": _call(h.release)}
    h.wu.is_fully_idle = real_idle
    o["queues"] = h.queues()
    o["answer"] = answer("o-boot")
    o["aborts"] = h.sender("o-boot").aborts
    o["resume"] = _call(h.resume)
    out["release_without_assert"] = o
    o["after"] = settle()

    # -- 6. release while writes posted earlier are still in flight --------------------------
    out["posted_writes"] = _posted_writes(h)
    out["posted_writes"]["after"] = settle()

    # -- 7. release while a request waits for its grammar (grammar_queue) -------------------
    g = h.submit("g-ready", 9)  # a request that reached the queues: it will be answered
    grammar = make_req_like(h, "g-compiling")
    h.s.grammar_manager.grammar_queue.append(grammar)  # its grammar still compiles
    gr = {"release": _call(h.release)}
    gr["kept"] = [r.rid for r in h.s.grammar_manager.grammar_queue]
    gr["resume"] = _call(h.resume)
    gr["answers"] = {"g-ready": answer("g-ready"), "g-compiling": answer("g-compiling")}
    h.s.grammar_manager.grammar_queue.clear()
    out["grammar"] = gr
    gr["after"] = settle()
    del g

    # -- 8. release whose drain meets an exception from sglang's paths ----------------------
    h.submit("x-fly", 9)
    h.prefill_to_transferring("x-fly")

    def broken(req, *a, **k):
        raise RuntimeError("planted: sglang's failure path raised")

    h.s.handle_inflight_transfer_failure = broken
    x = {"release": _call(h.release)}
    del h.s.handle_inflight_transfer_failure
    x["released"] = sorted(h.wu.offload_tags)
    stats = prefill_stats()
    x["refused_releases"] = stats and stats["refused_releases"]
    h.step()
    h.s.last_batch = None
    x["answer"] = answer("x-fly")
    out["drain_raises"] = x
    x["after"] = settle()
    if h.wu.offload_tags:  # stock: its release asserted after marking nothing
        _call(h.resume)

    # -- 9. resume with no tags after a release of the KV cache alone -----------------------
    nt = {"release": _call(h.release), "resume": _call(lambda: h.resume(None))}
    nt["released_after"] = sorted(h.wu.offload_tags)
    h.submit("n-after", 9)
    h.step()
    h.s.last_batch = None
    nt["answer"] = answer("n-after")
    if h.wu.offload_tags:
        _call(h.resume)
    out["resume_no_tags"] = nt
    nt["after"] = settle()

    # -- 11. release inside the settle window of a transfer that failed while moving ---------
    import collections

    from kvmem_sglang import state

    h.mgr._staging_outstanding = collections.defaultdict(int)
    state.SETTLE_UNTIL.set(h.mgr, time.monotonic() + SETTLE_S)  # what kvmem_sglang.mooncake sets
    t0 = time.monotonic()
    sw = {
        "release": _call(h.release),
        "release_s": time.monotonic() - t0,
        "resume": _call(h.resume),
    }
    state.SETTLE_UNTIL.pop(h.mgr)
    out["settle_window"] = sw

    # -- 12. a write fails while the release waits for it -------------------------------------
    # a thread plays sglang's Mooncake worker: the room's write is posted when the release
    # starts and fails FAIL_AFTER_S later, when the worker poisons the room (the adapter's
    # hook on _poison_unsettled_send opens the settle window) and uncounts it at once
    import threading

    from kvmem_sglang import mooncake

    counts = h.mgr._staging_outstanding
    counts[903] += 1
    failed = {}
    mooncake.SETTLE_S = SETTLE_S  # inside the test's drain timeout (the default is 2 s)

    def fail_later():
        time.sleep(FAIL_AFTER_S)
        mooncake.poison_unsettled_send(lambda mgr, room: None, h.mgr, 903)
        failed["at"] = time.monotonic()
        counts[903] -= 1

    worker = threading.Thread(target=fail_later)
    t0 = time.monotonic()
    worker.start()
    fw = {"release": _call(h.release), "release_s": time.monotonic() - t0}
    worker.join()
    fw["failed_s"] = failed["at"] - t0
    fw["window_s"] = mooncake.SETTLE_S
    fw["resume"] = _call(h.resume)
    state.SETTLE_UNTIL.pop(h.mgr)
    del h.mgr._staging_outstanding
    out["failed_while_waiting"] = fw

    # -- 10. abort_all with nothing to abort -----------------------------------------------
    before = (prefill_stats() or {}).get("unknown_aborts")
    h.abort("", abort_all=True)
    out["abort_all_idle"] = {
        "unknown_aborts": [before, (prefill_stats() or {}).get("unknown_aborts")]
    }
    return out


def make_req_like(h, rid: str):
    """A generate request as the harness makes one, not queued anywhere (the scheduler
    put it in its grammar queue instead)."""
    from tests.sglang.sglang_env import make_req

    req = make_req(rid, 9, max_new_tokens=8, seed=len(h.reqs))
    h._room += 1
    req.bootstrap_host, req.bootstrap_port, req.bootstrap_room = "10.0.0.2", 8998, h._room
    h.reqs[rid] = req
    return req


def _posted_writes(h) -> dict:
    """An idle scheduler whose transfer workers still hold a chunk: the write of a
    request already answered and freed (a client aborted it while in flight) has been
    posted and not yet settled.  sglang's ``CommonKVManager`` counts such chunks per room
    in ``_staging_outstanding`` (its ``__init__`` makes the defaultdict; the fake manager
    has no workers, so the case gives it one): a worker counts a chunk when it dequeues it
    and uncounts it once every handle it posted is DONE or ERR.  Here a thread plays the
    worker: room 900's write settles SETTLE_S after the release starts; room 901's never
    does.  Recorded: when sglang's queue release (the deregistration) ran against when
    the write settled, and what the drain timeout (``SGLANG_KVMEM_DRAIN_TIMEOUT``, set
    by the test) did with the room that never settles."""
    import collections
    import threading

    counts = collections.defaultdict(int)
    h.mgr._staging_outstanding = counts
    queue = h.s.disagg_prefill_bootstrap_queue
    real = queue.release_memory_occupation
    marks: dict = {}

    def release_spy(*a, **k):
        marks.setdefault("deregistered", time.monotonic())
        return real(*a, **k)

    queue.release_memory_occupation = release_spy
    out: dict = {}

    def release_while_settling(room: int, key: str) -> None:
        """Release while ``room``'s write settles SETTLE_S after the release starts (a
        thread plays the worker); then resume."""
        marks.clear()
        counts[room] += 1

        def settle_later():
            time.sleep(SETTLE_S)
            marks["settled"] = time.monotonic()
            counts[room] -= 1

        worker = threading.Thread(target=settle_later)
        t0 = time.monotonic()
        worker.start()
        out[f"{key}release"] = _call(h.release)
        out[f"{key}release_s"] = time.monotonic() - t0
        worker.join()
        out[f"{key}deregistered_after_settle"] = marks["deregistered"] >= marks["settled"]
        out[f"{key}resume"] = _call(h.resume)

    try:
        release_while_settling(900, "")
        marks.clear()
        counts[901] += 1  # never settles
        t0 = time.monotonic()
        out["stuck_release"] = _call(h.release)
        out["stuck_release_s"] = time.monotonic() - t0
        out["stuck_resume"] = _call(h.resume)
        # room 901 still counted: the next release does not wait for it again, but waits
        # for room 902's write
        release_while_settling(902, "again_")
        stats = prefill_stats()
        out["stats"] = stats and {k: stats[k] for k in ("drain_waits", "drain_timeouts")}
    finally:
        counts.clear()
        del queue.release_memory_occupation
    return out


def _call(fn) -> dict:
    try:
        fn()
        return {"ok": True}
    except BaseException as e:  # stock raises in the scheduler loop: record it
        return {
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            "where": traceback.format_exc().strip().splitlines()[-3].strip(),
        }


def _code(reason: dict):
    code = reason.get("status_code")
    if reason.get("type") == "abort":
        return int(code) if code is not None else "abort"
    return 200


def _kvmem_on() -> bool:
    try:
        from kvmem_sglang import state

        return state.PROCESS.options.is_active()
    except ImportError:
        return False


if __name__ == "__main__":
    result = main()
    sys.stdout.flush()
    print(json.dumps(result, default=str))
