"""1,000 requests through a real PD prefill scheduler
(``prefill_env.PrefillHarness``), flag off or on (``SGLANG_KVMEM``), in 20 waves of 50.

Each request has a fate, drawn with a fixed seed, and the status kvmem's lifecycle table
(docs/disagg.md) gives it:

===================  ===================================================  ==============
fate                 what happens                                         table status
===================  ===================================================  ==============
ok                   bootstraps, prefills, transfers                      200
abort-bootstrapping  client aborts it while its sender bootstraps         abort
abort-waiting        client aborts it bootstrapped, before its batch      abort
abort-running        client aborts it while its prefill batch runs        abort
abort-transferring   client aborts it while its KV transfers              abort
bootstrap-timeout    its sender never leaves Bootstrapping                504
transfer-timeout     its transfer never completes                         504
fail-first/middle/   the decode side fails the first, a middle or the     500
last/extra           last page transfer, or the extra state
release-*            in a queue (bootstrapping, waiting, transferring)    503
                     when the KV cache is released (waves 7 and 14)
while-released       arrives while the KV cache is released               503
===================  ===================================================  ==============

The run records every answer (``Outbox``), what stays held at the end, exceptions that
would end sglang's scheduler loop (``crashes``; the run goes on past them so that the rest
of the table still says something), and the time of each result step that freed an abort
in the running batch.  Prints one JSON object on its last line."""

from __future__ import annotations

import json
import random
import statistics
import sys
import time

from tests.sglang.scenario_prefill_gaps import _call, _kvmem_on

REQUESTS, WAVE = 1000, 50
TRANSFER_TIMEOUT = 0.3  # SGLANG_DISAGGREGATION_TRANSFER_TIMEOUT
BOOTSTRAP_TIMEOUT = 1  # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT (an int in sglang)
RELEASE_WAVES = (7, 14)
BOOTSTRAP_TIMEOUT_WAVES = (3, 11, 18)
# Waves whose scheduler stalls for longer than the transfer timeout right after the step
# that put their requests in flight, as a process on a loaded machine can be held off the
# CPU: a client's abort of a transferring request that is already queued must still win
# over a transfer clock that ran out meanwhile.
STALL_WAVES = (5,)
ABORT_FREE_LOOP = 400  # timed retires of an abort in the running batch, after the waves

FATES = {  # fate -> weight in an ordinary wave
    "ok": 20,
    "abort-bootstrapping": 3,
    "abort-waiting": 3,
    "abort-running": 3,
    "abort-transferring": 3,
    "transfer-timeout": 2,
    "fail-first": 2,
    "fail-middle": 2,
    "fail-last": 2,
    "fail-extra": 2,
}
EXPECTED = {
    "ok": ("ok", 200),
    "bootstrap-timeout": ("abort", 504),
    "transfer-timeout": ("abort", 504),
    "while-released": ("abort", 503),
}
for _f in ("abort-bootstrapping", "abort-waiting", "abort-running", "abort-transferring"):
    EXPECTED[_f] = ("abort", None)
for _f in ("fail-first", "fail-middle", "fail-last", "fail-extra"):
    EXPECTED[_f] = ("abort", 500)
for _f in ("release-bootstrapping", "release-waiting", "release-transferring"):
    EXPECTED[_f] = ("abort", 503)


def main() -> dict:
    from tests.sglang.prefill_env import PrefillHarness

    t_start = time.perf_counter()
    h = PrefillHarness(page_size=4, pages=512, max_reqs=128)
    from sglang.srt.disaggregation.base.conn import KVPoll as K

    rng = random.Random(8)
    fate: dict[str, str] = {}
    crashes: list[str] = []
    n = 0

    def new(f: str, hold=None):
        nonlocal n
        rid = f"q{n:04d}"
        n += 1
        fate[rid] = f
        h.submit(rid, 9, hold=hold)
        snd = h.sender(rid)
        if snd is None:
            return rid
        if f in ("abort-transferring", "transfer-timeout", "release-transferring"):
            snd.after_send = K.Transferring
        elif f.startswith("fail-"):
            snd.fail_chunk = f[5:]
        return rid

    def step(*, wave_aborts=True):
        h.pop_bootstrapped()
        if wave_aborts:
            for req in list(h.s.waiting_queue):
                if fate[req.rid] == "abort-waiting":
                    h.abort(req.rid)
        batch = h.launch()
        if batch is not None:
            for r in batch.reqs:
                if fate[r.rid] == "abort-running":
                    h.abort(r.rid)
            h.finish_forward(batch)
        h.inflight()
        h.s.last_batch = None

    def abort_where(f: str, *, queue):
        for req in list(queue):
            if fate[req.rid] == f:
                h.abort(req.rid)

    # time to free an abort in the running batch: sglang's own retire call, in the result
    # step of that batch (the same step on both flags)
    free_step_us = h.time_retires(lambda req: fate.get(req.rid) == "abort-running")

    wave = -1
    while n < REQUESTS:
        wave += 1
        if wave in RELEASE_WAVES:
            _release_wave(h, K, new, step, crashes)
            continue
        left = min(WAVE, REQUESTS - n)
        names, weights = zip(*FATES.items())
        fates = rng.choices(names, weights, k=left)
        if wave in BOOTSTRAP_TIMEOUT_WAVES:
            fates[:3] = ["bootstrap-timeout"] * 3
        for f in fates:
            hold = K.Bootstrapping if f in ("abort-bootstrapping", "bootstrap-timeout") else None
            new(f, hold)
        step()
        # Transferring now, their transfer clock started by that step's poll of the
        # inflight queue: aborted before the next poll, which alone could find the clock
        # run out (a step on a loaded machine can take longer than TRANSFER_TIMEOUT).
        abort_where("abort-transferring", queue=h.s.disagg_prefill_inflight_queue)
        if wave in STALL_WAVES:
            time.sleep(TRANSFER_TIMEOUT + 0.05)
        abort_where("abort-bootstrapping", queue=h.s.disagg_prefill_bootstrap_queue.queue)
        step()
        step()
        time.sleep(
            BOOTSTRAP_TIMEOUT + 0.1 if wave in BOOTSTRAP_TIMEOUT_WAVES else TRANSFER_TIMEOUT + 0.05
        )
        for _ in range(3):
            step()

    for _ in range(3):  # drain what is left
        step()
    answered_once = answered_more = hangs = wrong = 0
    wrong_examples: dict[str, list] = {}
    by_fate: dict[str, dict] = {}
    for rid, f in fate.items():
        got = h.outbox.answers.get(rid, [])
        row = by_fate.setdefault(f, {"n": 0, "as_table": 0, "hang": 0, "got": {}})
        row["n"] += 1
        if not got:
            hangs += 1
            row["hang"] += 1
            continue
        if len(got) > 1:
            answered_more += 1
            continue
        answered_once += 1
        reason = got[0][1]
        code = reason.get("status_code")
        status = (
            ("abort", int(code) if code is not None else None)
            if reason.get("type") == "abort"
            else ("ok", 200)
        )
        key = f"{status[0]} {status[1]}"
        row["got"][key] = row["got"].get(key, 0) + 1
        if status == EXPECTED[f]:
            row["as_table"] += 1
        else:
            wrong += 1
            wrong_examples.setdefault(f, []).append([rid, key, reason.get("message")])
    held = h.held()
    audit = send_path = None
    try:
        from kvmem_sglang import audit as A
        from kvmem_sglang import plugin, transfer_records

        audit = {"audits": A.STATS.audits, "leaks": A.STATS.leaks}
        # kvmem's NIXL send path (SGLANG_KVMEM_TRANSFER=kvmem): installed or not (once
        # sglang imports NIXL's module: pending here, where the backend is sglang's fake
        # one), and what it moved (nothing here: the FakeKVManager is no NixlKVManager)
        planned = plugin.INSTALLED + [t for ts in plugin.PENDING.values() for t in ts]
        send_path = {
            "installed": any(t.endswith("NixlKVManager.send_kvcache") for t in planned),
            "sends": transfer_records.STATS.sends + transfer_records.STATS.fallbacks,
        }
    except ImportError:
        pass
    return {
        "kvmem": _kvmem_on(),
        "requests": len(fate),
        "answered_once": answered_once,
        "answered_more": answered_more,
        "hangs": hangs,
        "wrong_status": wrong,
        "crashes": crashes,
        "held_end": held,
        "queues_end": {k: len(v) for k, v in h.queues().items()},
        "by_fate": by_fate,
        "wrong_examples": {f: v[:2] for f, v in wrong_examples.items()},
        "abort_free_us": {
            "median": statistics.median(free_step_us) if free_step_us else None,
            "n": len(free_step_us),
        },
        "audit": audit,
        "send_path": send_path,
        "seconds": time.perf_counter() - t_start,
        "abort_free_loop_us": _abort_free_loop(),  # after the run's wall time
    }


def _abort_free_loop(n: int = ABORT_FREE_LOOP) -> dict:
    """The retire step of an abort in the running batch, ``n`` times in a row on a new
    scheduler (one request per batch, 37 tokens at page_size 4, aborted while its
    forward runs): median and quartiles in us of sglang's ``_retire_aborted_prefill_result``
    call, the first 50 (warm-up) left out.  The waves above time the same call but only
    ~70 times, each after different work, which spreads their median by +-10 us."""
    from tests.sglang.prefill_env import PrefillHarness

    h = PrefillHarness(page_size=4, pages=64, max_reqs=4)
    times = h.time_retires()
    for i in range(n + 50):
        rid = f"free-loop-{i}"
        h.submit(rid, n_tokens=37)
        h.pop_bootstrapped()
        batch = h.launch()
        h.abort(rid)
        h.finish_forward(batch)
        h.inflight()
        h.s.last_batch = None
    assert h.held() == {"kv_tokens": 0, "req_slots": 0, "meta_slots": 0}, h.held()
    q = statistics.quantiles(times[50:], n=4)
    return {"median": q[1], "q1": q[0], "q3": q[2], "n": len(times) - 50}


def _release_wave(h, K, new, step, crashes):
    """Requests in every state, then release_memory_occupation(kv_cache); arrivals while
    released; resume; the requests that were held are let go."""
    boot = [new("release-bootstrapping", K.Bootstrapping) for _ in range(8)]
    fly = [new("release-transferring") for _ in range(8)]
    step(wave_aborts=False)  # fly: prefilled, now transferring (held)
    waiting = [new("release-waiting") for _ in range(8)]
    h.pop_bootstrapped()  # waiting: bootstrapped, not yet in a batch
    r = _call(h.release)
    if not r["ok"]:
        crashes.append(f"release: {r['error']}")
    late = [new("while-released") for _ in range(6)]
    r = _call(h.resume)
    if not r["ok"]:
        crashes.append(f"resume: {r['error']}")
    for rid in boot + fly + waiting + late:  # whatever is still held goes on
        snd = h.sender(rid)
        if snd is not None:
            snd.hold = snd.after_send = None
    for _ in range(3):
        step()


if __name__ == "__main__":
    result = main()
    sys.stdout.flush()
    print(json.dumps(result, default=str))
