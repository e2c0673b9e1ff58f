"""verl's PD rollout where its calls differ from slime's (``verl_client.py`` has each
call and where verl makes it): requests paired by the client itself, no router (so no
retry anywhere), and a weight sync that pauses the prefill alone in ``abort`` mode and
releases the KV cache of both servers at once, with requests still decoding, then
updates, resumes the KV cache and flushes, and continues; the requests that ended in an
abort are sent again after it, their prompt followed by what they had generated.

With ``SGLANG_KVMEM=1`` on both servers: every request of every step answered, each
answer 200 or (a request the release met on a server) 503, none sent again more than
once; each release gave the KV pool's memory back; the requests sent again after the
sync all finish; the greedy eval equals stock's; both servers idle, no crash, no leak.
A 1P:1D pair: verl's tests run 1P:3D (two more servers; each decode meets the same
calls).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e import verl_client as verl
from tests.e2e.conftest import RL_EVAL, RL_EVAL_TOKENS
from tests.e2e.deploy import IDLE_S, rss_by_mapping, wait_given_back
from tests.e2e.slime_client import sampling_params
from tests.e2e.test_rl import POOL_BYTES

STEPS = 2
REQUESTS = 24
MAX_NEW_TOKENS = 96
SYNC_AFTER = 8  # the weight sync comes once this many requests are answered


def prompt(i: int) -> list[int]:
    rng = random.Random(1000 + i)
    return [rng.randrange(4, 100) for _ in range(8 + i % 5)]


def send(d, rid: str, ids: list[int], params: dict):
    """One request as verl sends it to ``d``'s pair: (the prefill's answer, the
    decode's)."""
    return verl.generate(d.prefill, d.decode, d.bootstrap_port, rid, ids, params)


def eval_greedy(d) -> list[list[int]]:
    out = []
    params = sampling_params(RL_EVAL_TOKENS, temperature=0.0)
    for i, ids in enumerate(RL_EVAL):
        p, r = send(d, f"verl-eval-{time.monotonic_ns()}-{i}", ids, params)
        assert p.status == 200 and r.status == 200, (p.status, p.body, r.status, r.body)
        out.append(verl.tokens(r))
    return out


def step(d, model, n: int, rec: dict, flag: bool) -> None:
    """``n`` requests at once, verl's weight sync once SYNC_AFTER are answered, then
    the aborted ones sent again; what happened, in ``rec``."""
    params = sampling_params(MAX_NEW_TOKENS)
    pool = ThreadPoolExecutor(n)
    rids = [f"verl-{time.monotonic_ns()}-{i}" for i in range(n)]
    futs = [pool.submit(send, d, r, prompt(i), params) for i, r in enumerate(rids)]
    deadline = time.monotonic() + verl.HANG_S
    while sum(f.done() for f in futs) < SYNC_AFTER and time.monotonic() < deadline:
        time.sleep(0.02)
    rec["in_flight_at_sync"] = sum(not f.done() for f in futs)
    scheds = {s.name: s.scheduler_pids()[0] for s in (d.prefill, d.decode)}
    before = {pid: rss_by_mapping(pid) for pid in scheds.values()}
    back: dict = {}

    def released():
        want = 0.9 * POOL_BYTES if flag else 0
        back.update(wait_given_back(before, want, timeout=15.0 if flag else 2.0))

    version = f"verl-{rec['step']}"
    rec["calls"] = verl.weight_sync(d.prefill, d.decode, str(model), version, released)
    rec["given_back_mib"] = {n: round(back.get(pid, 0) / 2**20, 1) for n, pid in scheds.items()}
    answers = [f.result() for f in futs]
    pool.shutdown()
    rec["prefill"] = dict(Counter(p.status for p, _ in answers))
    rec["decode"] = dict(Counter(f"{r.status} {verl.finish(r)}".strip() for _, r in answers))
    # verl's agent loop: an answer that ended in an abort is sent again, its prompt
    # followed by what it generated, for the tokens it has left
    again = [
        (f"{rids[i]}-again", prompt(i) + verl.tokens(r), MAX_NEW_TOKENS - len(verl.tokens(r)))
        for i, (_, r) in enumerate(answers)
        if r.status != 200 or verl.finish(r) == "abort"
    ]
    with ThreadPoolExecutor(max(1, len(again))) as p2:
        resent = list(
            p2.map(lambda x: send(d, x[0], x[1], dict(params, max_new_tokens=x[2])), again)
        )
    rec["sent_again"] = len(again)
    rec["again_decode"] = dict(Counter(f"{r.status} {verl.finish(r)}".strip() for _, r in resent))
    rec["again_prefill"] = dict(Counter(p.status for p, _ in resent))


@pytest.mark.parametrize("kind", ["kvmem-both"])
def test_verl_loop(deployments, backend, model, rl_reference, kind):
    d = deployments.get(kind, backend)
    t0 = time.monotonic()
    steps = []
    for k in range(STEPS):
        rec: dict = {"step": k + 1}
        steps.append(rec)
        step(d, model, REQUESTS, rec, flag=True)
        rec["eval_equal"] = eval_greedy(d) == rl_reference
        print(f"\nverl's loop, SGLANG_KVMEM=1 on both servers, {backend}: {rec}")
    print(f"  {time.monotonic() - t0:.0f} s")
    for rec in steps:
        assert {c[2] for c in rec["calls"]} == {200}, rec["calls"]
        assert set(rec["prefill"]) <= {200, 503}, rec
        assert {k.split()[0] for k in rec["decode"]} <= {"200", "503"}, rec
        assert set(rec["again_decode"]) <= {"200 length", "200 stop"}, rec
        assert set(rec["again_prefill"]) <= {200}, rec
        for name, mib in rec["given_back_mib"].items():
            assert mib * 2**20 >= 0.9 * POOL_BYTES, (name, rec["given_back_mib"])
        assert rec["eval_equal"], rec
    assert any(rec["sent_again"] for rec in steps), steps  # the sync met requests
    assert d.settle(IDLE_S) == {}
    assert d.crashed() == []
    for s in (d.prefill, d.decode):
        leaked = s.metric("kvmem_sglang_prefill_leaked_total")
        assert not any(leaked.values()), (s.name, leaked)
