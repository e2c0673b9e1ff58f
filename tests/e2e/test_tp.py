"""Tensor parallelism under the flag, over HTTP: a plain server at TP 2 through the RL
cycle, and PD pairs with a TP 2 prefill beside a TP 1 and a TP 2 decode.  Every rank
builds, releases and resumes its own pool (each scheduler's resident memory drops and
returns), and every rank agrees on a request's answer: a request refused by a released
TP 2 prefill is answered 503 through a TP 2 decode whichever decode rank sees the
failure first (it was answered 500 about a third of the time: rank 0 raised "unknown
reason from another rank" before its own notice arrived), and the refusal names the
rank that made it.

Greedy outputs differ between TP 1 and TP 2 after a few tokens here, so the PD pairs are
compared with the plain server at the prefill's TP (2).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.deploy import prompt, rss_by_mapping, wait_given_back
from tests.e2e.test_rl import MODES, finish, paused_release

PROMPTS = [prompt(i) for i in range(4)]
KV = {"tags": ["kv_cache"]}
# the tiny model's KV pool at TP 2: each rank holds one of the two KV heads
RANK_POOL_BYTES = 65537 * 2 * 2 * 1 * 32 * 2


def outputs(d, prompts=PROMPTS):
    got = []
    for p in prompts:
        r = d.generate(p)
        assert r.status == 200, (r.status, r.body, r.error)
        got.append(r.body["output_ids"])
    return got


@pytest.fixture(scope="session")
def tp2_reference(deployments):
    """Greedy outputs of the plain TP 2 server (its tests run first: conftest's order)."""
    return outputs(deployments.get("tp2-plain"))


@pytest.mark.parametrize("kind", ["tp2-plain"])
def test_tp2_plain_release_gives_back_every_ranks_pool(deployments, tp2_reference, kind):
    """Release the KV cache of a plain TP 2 server: both ranks' schedulers give their
    pool back (resident memory of their mappings), the resume brings it back, and the
    server serves the same tokens."""
    d = deployments.get(kind)
    pids = d.single.scheduler_pids()
    assert len(pids) == 2, pids
    # a resume pre-faults the pool: all of it resident on both ranks (the pages a few
    # requests touched are too few to show a release)
    assert d.control(d.single, "/release_memory_occupation", KV).status == 200
    assert d.control(d.single, "/resume_memory_occupation", KV).status == 200
    before = {p: rss_by_mapping(p) for p in pids}
    assert d.control(d.single, "/release_memory_occupation", KV).status == 200
    back = wait_given_back(before, 0.9 * RANK_POOL_BYTES)  # rank 1 a moment after the 200
    refused = d.generate(PROMPTS[0], timeout=30)
    assert d.control(d.single, "/resume_memory_occupation", KV).status == 200
    print(
        f"TP 2 plain: MiB each rank's mappings gave back: "
        f"{ {p: round(b / 2**20, 1) for p, b in back.items()} }"
    )
    assert all(b >= 0.9 * RANK_POOL_BYTES for b in back.values()), back
    assert refused.status == 503, (refused.status, refused.body)
    assert "(TP rank 0)" in str(refused.body)
    log = d.single.log_text()
    assert "Server (TP rank 1) has released its KV cache" in log  # every rank refuses
    assert outputs(d) == tp2_reference
    assert d.crashed() == []


@pytest.mark.parametrize("kind", ["tp2-plain"])
@pytest.mark.parametrize("mode", MODES)
def test_tp2_plain_pause_release_resume_continue(deployments, tp2_reference, kind, mode):
    """The RL cycle at TP 2 in each pause mode, weights and KV cache released with
    requests running: kept and finished (retract, in_place) or answered as aborts."""
    d = deployments.get(kind)
    steps, answers = paused_release(d, (d.single,), mode, ["weights", "kv_cache"], tokens=300)
    assert set(steps) == {200}, steps
    kinds = [finish(a) if a.status == 200 else a.status for a in answers]
    print(f"TP 2 plain {mode}: {kinds}")
    if mode == "abort":
        assert set(kinds) <= {"abort", "length"}, kinds
    else:
        assert kinds == ["length"] * len(answers), [(a.status, a.body) for a in answers]
    assert outputs(d) == tp2_reference
    assert d.settle() == {}
    assert d.crashed() == []


@pytest.mark.parametrize("kind", ["tp2-plain"])
def test_tp2_plain_weight_update_between_release_and_resume(
    deployments, model, tp2_reference, kind
):
    d = deployments.get(kind)
    s = d.single
    assert (
        d.control(s, "/release_memory_occupation", {"tags": ["weights", "kv_cache"]}).status == 200
    )
    assert d.control(s, "/resume_memory_occupation", {"tags": ["weights"]}).status == 200
    upd = d.control(s, "/update_weights_from_disk", {"model_path": str(model)}, timeout=120)
    assert upd.status == 200 and upd.body.get("success"), upd
    assert d.control(s, "/resume_memory_occupation", {"tags": ["kv_cache"]}).status == 200
    assert outputs(d) == tp2_reference
    assert d.crashed() == []


@pytest.mark.parametrize("kind", ["tp2-prefill", "tp2-both"])
def test_tp2_pd_outputs_equal_plain_tp2(deployments, backend, tp2_reference, kind):
    """A TP 2 prefill beside a TP 1 and a TP 2 decode: the same tokens as the plain TP 2
    server, through the router (the KV of both prefill ranks crossed intact)."""
    assert outputs(deployments.get(kind, backend)) == tp2_reference


@pytest.mark.backends("nixl")  # two more TP 2 servers per backend: one backend shows it
@pytest.mark.parametrize("kind", ["tp2-stock"])
def test_tp2_stock_pd_outputs_equal_plain_tp2(deployments, backend, tp2_reference, kind):
    """Stock sglang's TP 2 prefill and decode, beside the flag's: the same tokens as the
    plain TP 2 server with the flag (so the flag's TP 2 pairs above equal stock's)."""
    assert outputs(deployments.get(kind, backend)) == tp2_reference


@pytest.mark.parametrize("kind", ["tp2-both"])
def test_tp2_refusal_by_a_released_prefill_is_503_on_every_decode_rank(
    deployments, backend, tp2_reference, kind
):
    """50 requests while the TP 2 prefill's KV cache is released, 5 at a time: every one
    answered 503 with the prefill's reason through the TP 2 decode and the router (before
    the fix about a third were 500, which the router retries), and each prefill rank's
    refusals name that rank."""
    d = deployments.get(kind, backend)
    assert d.control(d.prefill, "/release_memory_occupation", KV).status == 200
    try:
        with ThreadPoolExecutor(5) as pool:
            answers = list(pool.map(lambda i: d.generate(PROMPTS[i % 4], timeout=60), range(50)))
        statuses = [a.status for a in answers]
        print(
            f"TP 2 + TP 2 on {backend}, prefill released: statuses "
            f"{ {s: statuses.count(s) for s in set(statuses)} }"
        )
        assert statuses == [503] * 50, [
            (a.status, str(a.body)[:200]) for a in answers if a.status != 503
        ][:3]
        assert all("released its KV cache" in str(a.body) for a in answers)
        assert d.settle() == {}
    finally:
        assert d.control(d.prefill, "/resume_memory_occupation", KV).status == 200
    log = d.prefill.log_text()
    assert "Prefill server (TP rank 0) has released" in log
    assert "Prefill server (TP rank 1) has released" in log
    assert outputs(d) == tp2_reference
    assert d.crashed() == []
