"""slime's RL loop on a real PD pair, call for call (``slime_client.py`` has each call and
where slime makes it): sglang's router started with no workers and the pair registered
with ``POST /workers``; then three steps of over-sampled generate requests aborted once
enough groups are done (slime's abort on every worker, polled until idle), offload
(flush, release with no tags), the weight sync from disk (slime's two resumes of the
weights, pause, flush, update, continue), onload of the KV cache, and a greedy eval.

With ``SGLANG_KVMEM=1`` on both servers: every request answered once (no send again by
slime's client, nothing retried by the router: its retry counter, and each server's
count of ``POST /generate`` against the client's sends), each release gave back the KV
pool's memory, the eval's greedy tokens equal stock's after every step, both servers
idle and holding nothing at the end, no crash, no leak.  Stock 0.5.23 runs the same
sequence and what it did is printed (it is the baseline; tests/e2e/README.md has the
figures).
"""

from __future__ import annotations

import random
import re
import time
from collections import Counter

import pytest

from tests.e2e import slime_client as slime
from tests.e2e.conftest import RL_EVAL, RL_EVAL_TOKENS
from tests.e2e.deploy import IDLE_S, DeployError, rss_by_mapping, wait_given_back
from tests.e2e.test_rl import POOL_BYTES

STEPS = 3
# slime's rollout_batch_size (groups a step keeps), over_sampling_batch_size (groups
# submitted at a time), n_samples_per_prompt
TARGET, OVER_SAMPLING, PER_GROUP = 4, 4, 4
MAX_NEW_TOKENS = 96
GENERATE_LINE = '"POST /generate HTTP/1.1"'
# what the adapter logs when slime resumes the weights a second time (nothing released)
SECOND_RESUME = "resume_memory_occupation(weights) refused: weights not released"


class DataSource:
    """slime's data buffer with ``--partial-rollout``: the groups an abort left come
    back first (their aborted samples sent again, their prompt followed by what they
    generated), then new groups of PER_GROUP samples of one prompt."""

    def __init__(self):
        self.buffer: list[list[slime.Sample]] = []
        self.next = 0

    def __call__(self, n: int) -> list[list[slime.Sample]]:
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        for g in out:
            for s in g:
                if s.status == "aborted":
                    s.status = "pending"
        while len(out) < n:
            rng = random.Random(self.next)
            ids = [rng.randrange(4, 100) for _ in range(8 + self.next % 5)]
            out.append([slime.Sample(self.next, i, ids, MAX_NEW_TOKENS) for i in range(PER_GROUP)])
            self.next += 1
        return out


def keep(group: list[slime.Sample]) -> bool:
    """The stand-in for slime's dynamic sampling filter (``--dynamic-sampling-filter-path``,
    e.g. DAPO's, which drops a group whose rewards are all equal): a seeded half of the
    groups is dropped, so that slime submits more groups while others still run."""
    return random.Random(-1 - group[0].group).random() < 0.5


def run_loop(d, model, logdir, flag: bool, second_resume: bool = True) -> dict:
    """slime's loop on deployment ``d``'s servers through a router of its own; what
    happened, step by step.  It stops at a control call that was not answered 200 (slime
    raises there), a server that crashed, or a wait past the replay's bounds.  ``flag``:
    the servers run SGLANG_KVMEM=1 (each release must give the KV pool back);
    ``second_resume=False``: without slime's second resume of the weights (stock's
    scheduler dies on it)."""
    router, prom = slime.start_router(logdir)
    report: dict = {"steps": []}
    try:
        slime.register(router, d.prefill, "prefill", d.bootstrap_port)
        slime.register(router, d.decode, "decode")
        client = slime.SlimeClient(router, prom)
        source = DataSource()
        for step in range(1, STEPS + 1):
            rec: dict = {"step": step}
            report["steps"].append(rec)
            try:
                _step(d, client, model, step, source, rec, flag, second_resume)
            except DeployError as e:
                rec["stopped"] = {"error": str(e)[:400]}
            if client.failed_calls() or d.crashed():
                failed = [c[:3] for c in client.failed_calls()[:4]]
                rec["stopped"] = {"failed": failed, "crashed": d.crashed()}
            if "stopped" in rec:
                break
    finally:
        router.stop()
    return report


def _step(d, client, model, step, source, rec, flag, second_resume) -> None:
    """One step of slime's loop (the module docstring) on ``d``'s servers, what it saw
    written into ``rec``."""
    engines = [d.prefill, d.decode]
    urls = [s.url for s in engines]
    # rollout: over-sampled groups, aborted once TARGET groups are accepted
    mark = _traffic_mark(client, engines)
    sent = {id(s): len(s.sends) for g in source.buffer for s in g}  # earlier steps' sends
    out = client.rollout(source, TARGET, OVER_SAMPLING, keep, slime.sampling_params(MAX_NEW_TOKENS))
    groups = out.pop("data") + out.pop("dropped") + out["left"]
    source.buffer += out.pop("left")
    rec["abort"] = out
    new = {id(s): s.sends[sent.get(id(s), 0) :] for g in groups for s in g}
    rec["statuses"] = _count(s.status for g in groups for s in g if new[id(s)])
    rec["resent"] = sum(max(0, len(x) - 1) for x in new.values())
    rec["rollout"] = _traffic(client, engines, mark, [x for v in new.values() for x in v])
    # offload, every engine at once, each scheduler's resident memory read around it
    calls = len(client.calls)
    scheds = {s.name: s.scheduler_pids()[0] for s in engines}
    before = {pid: rss_by_mapping(pid) for pid in scheds.values()}
    client.each(urls, client.offload)
    if not client.failed_calls():
        want = 0.9 * POOL_BYTES if flag else 0
        back = wait_given_back(before, want, timeout=15.0 if flag else 2.0)
        rec["given_back_mib"] = {n: round(back[pid] / 2**20, 1) for n, pid in scheds.items()}
        # the weight sync: train.py's resume of the weights, then the update's own
        client.each(urls, lambda u: client.resume(u, ["weights"]))
        client.update_weights_from_disk(urls, str(model), f"step-{step}", second_resume)
    if not client.failed_calls():  # onload
        client.each(urls, lambda u: client.resume(u, ["kv_cache", "cuda_graph"]))
    rec["calls"] = _count(f"{c[0]} {c[2]}" for c in client.calls[calls:])
    if client.failed_calls() or d.crashed():
        return
    # eval, greedy
    mark = _traffic_mark(client, engines)
    rec["eval"], sends = client.evaluate(RL_EVAL, RL_EVAL_TOKENS)
    rec["eval_traffic"] = _traffic(client, engines, mark, sends)


# What sglang's router logs when a PD request fails, by whose doing: a server's error
# answer (which it then retries), or a request it could not deliver to a server (seen
# once in a dozen runs here: "Decode request failed ... error sending request", which it
# then retries too; the prefill holding the undelivered request's twin answered 504 at
# its bootstrap timeout).
ANSWERED = re.compile(r"(Prefill|Decode) server returned error status")
UNSENT = re.compile(r"(Prefill server failed|Decode request failed).*error sending request")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _traffic_mark(client, engines) -> tuple:
    """What :func:`_traffic` counts from: the router's retry counter and log, each
    server's count of ``POST /generate`` in its log."""
    return (
        sum(slime.prometheus(client.prometheus_url, "smg_worker_retries_total").values()),
        len(client.router.log_text()),
        {s.name: s.log_text().count(GENERATE_LINE) for s in engines},
    )


def _traffic(client, engines, mark, sends) -> dict:
    """The generate traffic since ``mark``: the client's sends (``sends``) and their
    statuses; the router's retry counter (``smg_worker_retries_total``: 2 for each PD
    request it sends again, prefill and decode: 16 for the 8 requests a stock run's
    router logged 500s for) and the failures it logged, by kind (:data:`ANSWERED`,
    :data:`UNSENT`, by server); each server's ``POST /generate`` lines."""
    retries, offset, generated = mark
    log = ANSI.sub("", client.router.log_text()[offset:]).splitlines()
    failed = [m.group(1).split()[0].lower() for ln in log if (m := UNSENT.search(ln))]
    unsent = {role: failed.count(role) for role in ("prefill", "decode")}
    now = sum(slime.prometheus(client.prometheus_url, "smg_worker_retries_total").values())
    return {
        "sends": len(sends),
        "send_statuses": _count(x.status for x in sends),
        "router_retries": now - retries,
        "router_answered_errors": sum(1 for ln in log if ANSWERED.search(ln)),
        "router_unsent": unsent,
        "server_generates": {
            s.name: s.log_text().count(GENERATE_LINE) - generated[s.name] for s in engines
        },
    }


def _count(items) -> dict:
    return dict(Counter(items))


def _print(name: str, report: dict) -> None:
    print(f"\n{name}:")
    for rec in report["steps"]:
        rec = dict(rec)
        rec.pop("eval", None)
        print(f"  {rec}")


@pytest.mark.parametrize("kind", ["kvmem-both"])
def test_slime_loop(deployments, backend, model, logroot, rl_reference, kind):
    d = deployments.get(kind, backend)
    t0 = time.monotonic()
    report = run_loop(d, model, logroot / f"slime-router-{kind}-{backend}", flag=True)
    _print(f"slime's loop, SGLANG_KVMEM=1 on both servers, {backend}", report)
    print(f"  {time.monotonic() - t0:.0f} s")
    steps = report["steps"]
    assert len(steps) == STEPS and "stopped" not in steps[-1], steps[-1]
    for rec in steps:
        for t in (rec["rollout"], rec["eval_traffic"]):
            # every request answered once, 200: nothing sent again by slime's client ...
            assert set(t["send_statuses"]) == {200}, (rec["step"], t)
            # ... nor by the router for an answer: none of the servers' answers was an
            # error, and it sent again only what it had failed to deliver (its counter,
            # its log, and each server's POST /generate count against the client's sends)
            assert t["router_answered_errors"] == 0, (rec["step"], t)
            unsent = sum(t["router_unsent"].values())
            assert t["router_retries"] == 2 * unsent, (rec["step"], t)
            assert t["server_generates"] == {
                role: t["sends"] + unsent - n for role, n in t["router_unsent"].items()
            }, (rec["step"], t)
        assert rec["resent"] == 0 and rec["eval_traffic"]["sends"] == len(RL_EVAL), rec
        assert set(rec["statuses"]) <= {"completed", "truncated", "aborted"}, rec
        # each release gave the KV pool's memory back
        for name, mib in rec["given_back_mib"].items():
            assert mib * 2**20 >= 0.9 * POOL_BYTES, (name, rec["given_back_mib"])
        assert rec["eval"] == rl_reference, rec["step"]
    # the abort met requests in flight (it aborted some of them) in at least one step
    assert any(rec["abort"]["in_flight_at_abort"] for rec in steps), steps
    assert any(rec["statuses"].get("aborted") for rec in steps), steps
    # slime's second resume of the weights: refused with a log line, nothing changed
    for s in (d.prefill, d.decode):
        assert s.log_text().count(SECOND_RESUME) >= STEPS, s.name
    assert d.settle(IDLE_S) == {}
    assert d.crashed() == []
    for s in (d.prefill, d.decode):
        leaked = s.metric("kvmem_sglang_prefill_leaked_total")
        assert not any(leaked.values()), (s.name, leaked)


@pytest.mark.leaves_broken
@pytest.mark.parametrize("kind", ["stock"])
def test_slime_loop_stock(deployments, backend, model, logroot, rl_reference, kind):
    """The same loop on stock sglang 0.5.23, printed as the baseline beside the flag's.
    Stock's scheduler dies at slime's second resume of the weights (``KeyError:
    'weights'``, ``SchedulerWeightUpdaterManager.resume_memory_occupation``), in the
    first step: the loop runs without that call, which is then sent once at the end, to
    the prefill, to show it."""
    d = deployments.get(kind, backend)
    t0 = time.monotonic()
    try:
        report = run_loop(
            d, model, logroot / f"slime-router-{kind}-{backend}", flag=False, second_resume=False
        )
        _print(f"slime's loop, stock sglang 0.5.23, {backend}", report)
        print(f"  {time.monotonic() - t0:.0f} s; crashed {d.crashed()}")
        assert report["steps"], report
        if d.crashed():  # what it met in the loop, printed above
            return
        # slime's second resume of the weights, once
        client = slime.SlimeClient(d.router)
        client.resume(d.prefill.url, ["weights"])
        deadline = time.monotonic() + IDLE_S
        while not d.crashed() and time.monotonic() < deadline:
            time.sleep(0.5)
        print(f"  slime's second resume of the weights: {client.calls}; crashed {d.crashed()}")
        assert "KeyError: 'weights'" in d.prefill.log_text(), d.crashed()
    finally:
        deployments.discard_broken(kind, backend, d)
