"""What an RL trainer (slime, verl) does to the engines between rollouts, over HTTP, on
the PD pair and on a plain server with the flag: pause and continue generation in each
of sglang's modes (``abort``, ``retract``, ``in_place``) with a release and a resume in
between; release and resume the KV cache alone, the weights and the KV cache together,
everything (no tags); a weight update between release and resume; requests in flight at
each step, a structured-output request whose grammar still compiles among them.  Every
request is answered once with the status of the lifecycle table (a paused engine keeps
what stock keeps and serves it after ``continue_generation``), nothing stays held, and
the KV pool's memory is really given back while released (the scheduler's resident
memory drops by the pool's size)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.deploy import given_back, prompt, rss_anon, rss_by_mapping
from tests.e2e.tiny_model import WORDS

# the tiny model's KV pool: 65537 pages x 1 token x 2 layers x (K + V) x 2 heads x 32 x 2 B
POOL_BYTES = 65537 * 2 * 2 * 2 * 32 * 2
PROMPTS = [prompt(i) for i in range(4)]
MODES = ["abort", "retract", "in_place"]


def served(d):
    """Every prompt answered 200; the outputs."""
    out = []
    for p in PROMPTS:
        r = d.generate(p)
        assert r.status == 200, (r.status, r.body, r.error)
        out.append(r.body["output_ids"])
    return out


def idle(d):
    """Both servers let go of every request and KV token (their own /v1/loads)."""
    held = d.settle()
    assert not held, held


def with_requests(d, action, n=4, tokens=48):
    """Run ``action()`` while ``n`` requests are in flight; (its result, the answers)."""
    pool = ThreadPoolExecutor(n)
    futs = [
        pool.submit(d.generate, PROMPTS[i % len(PROMPTS)], tokens, timeout=120) for i in range(n)
    ]
    time.sleep(0.3)
    out = action()
    answers = [f.result() for f in futs]
    pool.shutdown()
    return out, answers


def check_answers(answers, allowed):
    got = [a.status for a in answers]
    assert all(a.answered for a in answers), [(a.error, round(a.seconds, 1)) for a in answers]
    assert set(got) <= set(allowed), [(a.status, a.body) for a in answers]
    return got


@pytest.fixture(scope="module")
def pair(deployments, backend):
    d = deployments.get("kvmem-both", backend)
    reference = served(d)
    kv = {"tags": ["kv_cache"]}
    for s in (d.prefill, d.decode):  # a resume pre-faults the pool: all of it resident
        assert d.control(s, "/release_memory_occupation", kv).status == 200
        assert d.control(s, "/resume_memory_occupation", kv).status == 200
    return d, reference


@pytest.mark.parametrize("kind", ["kvmem-both"])
def test_pause_and_continue_generation(pair, kind):
    d, reference = pair
    for server in (d.prefill, d.decode):
        assert d.control(server, "/pause_generation", {"mode": "abort"}).status == 200
    for server in (d.prefill, d.decode):
        assert d.control(server, "/continue_generation", {}).status == 200
    assert served(d) == reference
    idle(d)


@pytest.mark.parametrize("kind", ["kvmem-both"])
@pytest.mark.parametrize(
    "tags",
    [["kv_cache"], ["weights", "kv_cache"], None],
    ids=["kv_cache", "weights+kv_cache", "no-tags"],
)
def test_release_resume_with_requests_in_flight(pair, kind, tags):
    """Release both engines with requests in flight (answered 200 if they finished
    first, else 503 naming the release), check the memory is gone, resume, serve."""
    d, reference = pair
    body = {"tags": tags} if tags is not None else {}
    scheds = {s.name: s.scheduler_pids() for s in (d.prefill, d.decode)}
    assert all(len(p) == 1 for p in scheds.values()), scheds
    before = {name: rss_by_mapping(p[0]) for name, p in scheds.items()}

    def release_both():
        return [
            d.control(s, "/release_memory_occupation", body, timeout=90)
            for s in (d.prefill, d.decode)
        ]

    try:
        rels, answers = with_requests(d, release_both)
        assert [r.status for r in rels] == [200, 200], rels
        released = {name: rss_by_mapping(p[0]) for name, p in scheds.items()}
        statuses = check_answers(answers, {200, 503})
        back = {n: given_back(before[n], released[n]) for n in before}
        print(
            f"tags {tags}: answers {statuses}; resident MiB the schedulers' mappings gave "
            f"back: { {n: round(b / 2**20, 1) for n, b in back.items()} }"
        )
        # the pool was resident (pre-faulted by the last resume); the requests served
        # meanwhile grow other mappings (on 2026-12-02 by 7 MiB of the decode's, which
        # hid a quarter of the pool in the whole process's RssAnon), not the pool's
        for name, b in back.items():
            assert b >= POOL_BYTES * 0.9, (name, b, POOL_BYTES)
    finally:
        for s in (d.prefill, d.decode):
            assert d.control(s, "/resume_memory_occupation", body, timeout=90).status == 200
    assert served(d) == reference
    idle(d)
    assert d.crashed() == []


@pytest.mark.parametrize("kind", ["kvmem-both"])
def test_weight_update_between_release_and_resume(pair, model, kind):
    """slime's cycle: release weights and KV cache, resume the weights, load new weights
    from disk (the same tiny model here), resume the KV cache, serve; a request sent
    while the KV cache is released is refused 503 at once."""
    d, reference = pair
    both = {"tags": ["weights", "kv_cache"]}
    for s in (d.prefill, d.decode):
        assert d.control(s, "/release_memory_occupation", both, timeout=90).status == 200
    refused = d.generate(PROMPTS[0], timeout=30)
    assert refused.status == 503, (refused.status, refused.body)
    for s in (d.prefill, d.decode):
        assert d.control(s, "/resume_memory_occupation", {"tags": ["weights"]}).status == 200
        upd = d.control(s, "/update_weights_from_disk", {"model_path": str(model)}, timeout=120)
        assert upd.status == 200 and upd.body.get("success"), upd
        assert d.control(s, "/resume_memory_occupation", {"tags": ["kv_cache"]}).status == 200
    assert served(d) == reference
    idle(d)
    assert d.crashed() == []


@pytest.mark.parametrize("kind", ["kvmem-both"])
def test_pool_memory_given_back_while_released(pair, kind):
    """The prefill scheduler's anonymous resident memory, after a resume (the pool
    pre-faulted: SGLANG_KVMEM_PREFAULT=1), while released, and after the next resume."""
    d, _ = pair
    pid = d.prefill.scheduler_pids()[0]
    kv = {"tags": ["kv_cache"]}
    assert d.control(d.prefill, "/release_memory_occupation", kv).status == 200
    assert d.control(d.prefill, "/resume_memory_occupation", kv).status == 200
    live = rss_anon(pid)
    assert d.control(d.prefill, "/release_memory_occupation", kv).status == 200
    released = rss_anon(pid)
    assert d.control(d.prefill, "/resume_memory_occupation", kv).status == 200
    back = rss_anon(pid)
    print(
        f"prefill scheduler RssAnon: live {live >> 20} MiB, released {released >> 20} MiB, "
        f"resumed {back >> 20} MiB (pool {POOL_BYTES >> 20} MiB)"
    )
    assert live - released >= 0.9 * POOL_BYTES
    assert back - released >= 0.9 * POOL_BYTES


@pytest.mark.parametrize("kind", ["single-kvmem"])
def test_single_server_rl_cycle(deployments, model, kind):
    """One (non-PD) server with the flag, slime's whole cycle: generate, pause, release
    everything (no tags), resume, continue, generate; release weights and KV cache,
    resume the weights, update them from disk, resume the KV cache, generate."""
    d = deployments.get(kind)
    first = d.generate(PROMPTS[0])
    assert first.status == 200, first
    s = d.single
    steps = [
        ("/pause_generation", {"mode": "abort"}),
        ("/release_memory_occupation", {}),
        ("/resume_memory_occupation", {}),
        ("/continue_generation", {}),
    ]
    for path, body in steps:
        assert d.control(s, path, body).status == 200, path
    assert d.generate(PROMPTS[0]).body["output_ids"] == first.body["output_ids"]
    both = {"tags": ["weights", "kv_cache"]}
    assert d.control(s, "/release_memory_occupation", both).status == 200
    refused = d.generate(PROMPTS[1], timeout=30)
    assert refused.status == 503, (refused.status, refused.body)
    assert d.control(s, "/resume_memory_occupation", {"tags": ["weights"]}).status == 200
    upd = d.control(s, "/update_weights_from_disk", {"model_path": str(model)}, timeout=120)
    assert upd.status == 200 and upd.body.get("success"), upd
    assert d.control(s, "/resume_memory_occupation", {"tags": ["kv_cache"]}).status == 200
    assert d.generate(PROMPTS[0]).body["output_ids"] == first.body["output_ids"]
    assert d.settle() == {}
    assert d.crashed() == []


def finish(answer) -> str:
    """The finish reason's type of a 200 answer ("length", "stop", "abort")."""
    return ((answer.body.get("meta_info") or {}).get("finish_reason") or {}).get("type", "")


def paused_release(d, servers, mode, tags, *, n=3, tokens=300, delay=1.0):
    """``n`` requests of ``tokens`` new tokens in flight, then on every server in turn:
    pause_generation(mode), release(tags), resume (no tags: whatever is released),
    continue_generation; (the control calls' statuses, the answers)."""

    def cycle():
        steps = []
        for path, body in (
            ("/pause_generation", {"mode": mode}),
            ("/release_memory_occupation", {"tags": tags}),
            ("/resume_memory_occupation", {}),
            ("/continue_generation", {}),
        ):
            steps += [d.control(s, path, body, timeout=90).status for s in servers]
        return steps

    pool = ThreadPoolExecutor(n)
    futs = [
        pool.submit(d.generate, PROMPTS[i % len(PROMPTS)], tokens, timeout=150) for i in range(n)
    ]
    time.sleep(delay)
    steps = cycle()
    answers = [f.result() for f in futs]
    pool.shutdown()
    return steps, answers


@pytest.mark.parametrize("kind", ["kvmem-both"])
@pytest.mark.parametrize("mode", MODES)
def test_pd_pause_release_resume_continue(pair, kind, mode):
    """Both servers paused in ``mode`` with requests decoding, their KV cache released,
    resumed, continued: every request answered once (decoding ones run on after the
    continue, sglang's decode re-fetching their KV; ``abort`` answers them as aborts;
    a request caught between the servers is refused 503), no crash, nothing held."""
    d, reference = pair
    steps, answers = paused_release(d, (d.prefill, d.decode), mode, ["kv_cache"])
    assert set(steps) == {200}, steps
    check_answers(answers, {200, 503})
    kinds = [finish(a) if a.status == 200 else a.status for a in answers]
    print(f"PD {mode}: {kinds}")
    if mode == "abort":
        assert set(kinds) <= {"abort", "length", 503}, kinds
    else:  # kept across the release: they run to their length after the continue
        assert "length" in kinds and "abort" not in kinds, kinds
    assert served(d) == reference
    idle(d)
    assert d.crashed() == []


@pytest.fixture(scope="module")
def plain(deployments):
    return deployments.get("single-kvmem")


@pytest.mark.parametrize("kind", ["single-kvmem"])
@pytest.mark.parametrize("mode", MODES)
def test_plain_pause_release_resume_continue(plain, kind, mode):
    """A plain server paused in ``mode`` with requests running, weights and KV cache
    released, everything resumed, continued.  ``retract``: stock keeps the retracted
    requests waiting and finishes them after the continue, and so does the flag (it
    answered them 503 before the fix).  ``in_place``: stock's scheduler dies on its idle
    assertion; the flag retracts them as a retract pause does, and they finish too.
    ``abort``: answered as aborts, as stock does."""
    d = plain
    steps, answers = paused_release(d, (d.single,), mode, ["weights", "kv_cache"], tokens=600)
    assert set(steps) == {200}, steps
    check_answers(answers, {200})
    kinds = [finish(a) for a in answers]
    print(f"plain {mode}: {kinds}")
    if mode == "abort":
        assert set(kinds) <= {"abort", "length"}, kinds
    else:
        assert kinds == ["length"] * len(answers), [(a.status, a.body) for a in answers]
        assert all(len(a.body["output_ids"]) == 600 for a in answers)
    assert d.generate(PROMPTS[0]).status == 200
    assert d.settle() == {}
    assert d.crashed() == []


def slow_grammar(n: int = 25000) -> str:
    """A regex of ``n`` alternatives of four of the tiny model's words: xgrammar compiles
    it for about 5 s here (a one-word answer matches it), long enough to be in sglang's
    grammar queue when the engine pauses."""
    import random

    rng, seen = random.Random(0), set()
    while len(seen) < n:
        seen.add("".join(rng.choice(WORDS) for _ in range(4)))
    return "(" + "|".join(sorted(seen)) + ")"


@pytest.mark.parametrize("kind", ["single-kvmem"])
def test_grammar_request_kept_across_a_paused_release(plain, kind):
    """A structured-output request whose grammar is still compiling waits in sglang's
    grammar queue, which the release's idle assertion counts even on a paused engine:
    stock's scheduler dies there (seen: retract pause, release, the server gone).  With
    the flag the release keeps the request (it holds no KV), and after the resume and the
    continue it is served."""
    d = plain
    payload = {
        "text": PROMPTS[1],
        "sampling_params": {"max_new_tokens": 16, "temperature": 0, "regex": slow_grammar()},
    }
    from tests.e2e.deploy import http

    pool = ThreadPoolExecutor(1)
    fut = pool.submit(http, "POST", d.single.url + "/generate", payload, 600)
    time.sleep(1.0)
    for path, body in (
        ("/pause_generation", {"mode": "retract"}),
        ("/release_memory_occupation", {"tags": ["weights", "kv_cache"]}),
        ("/resume_memory_occupation", {}),
        ("/continue_generation", {}),
    ):
        assert d.control(d.single, path, body, timeout=90).status == 200, path
    answer = fut.result()
    pool.shutdown()
    assert d.crashed() == []
    assert "waiting for their grammar" in d.single.log_text()  # it was in the queue
    assert answer.status == 200, (answer.status, answer.body, answer.error)
    assert d.generate(PROMPTS[0]).status == 200
    assert d.settle() == {}
