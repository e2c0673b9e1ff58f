"""The allocator calls of a PD prefill server, on the adapter's KvmemTokenToKVPoolAllocator
and on sglang 0.5.23's own allocator, same device, same sequence, same run.

One step is what the scheduler asks of ``token_to_kv_pool_allocator`` for one prefill
batch of 32 new requests of ~1000 tokens: ``available_size()`` (admission), then
``alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
extend_num_tokens)`` at page_size 16 or ``alloc(extend_num_tokens)`` at page_size 1 (what
``alloc_for_extend`` calls there); the slots go into int32 ``req_to_token`` rows; and,
two batches later (their KV transfer done), each request of the oldest batch in flight is
released through ``free_segments([(row, 0)])`` (``release_kv_cache`` -> ``free_kv_row``).
The pool holds 8 batches, so sglang's ``need_sort`` staging (PD mode) runs short and
merges and sorts its staged frees every few steps; a round of 8 steps includes that.

Both sides run the very same function (the adapter has sglang's interface), so the ratio
is the allocator's.  Target: kvmem no slower, goal 2x on CPU.  sglang is
required: without it the baseline fails (never skipped).  ``--benchmark-disable`` runs
each sequence once (no timing, no report row); ``KVMEM_BENCH_SMOKE=1`` runs one timed round
without warm-up; ``KVMEM_BENCH_ROUNDS_SGLANG`` sets the rounds (default 16).

Threads.  On the CPU both sides run with ``KVMEM_BENCH_THREADS_SGLANG`` torch intra-op
threads (default 1, restored afterwards): the tensors here are ~32k entries, where extra
threads gain little, and on the project's loaded 2-core VM two threads' OpenMP waits
made every step 10x slower and 10x noisier on both sides (measured 2026-11-30)."""

from __future__ import annotations

import collections
import os
import random

import pytest
import torch

from bench.conftest import bench_device, rounds, sync, warmups

DEV = bench_device()
BATCH = 32
IN_FLIGHT = 2  # batches whose KV is still being sent when the next one is allocated
POOL_TOKENS = 1 << 18  # ~8 batches of 32 x ~1000 tokens
STEPS_PER_ROUND = 8  # about one pass over the pool: each round holds one sglang merge+sort
ROUNDS = rounds("KVMEM_BENCH_ROUNDS_SGLANG", 16)
PAGE_SIZES = [16, 1]


@pytest.fixture(autouse=True)
def _threads():
    if DEV.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("KVMEM_BENCH_THREADS_SGLANG", "1")))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _stock(ps: int):
    """sglang's allocator for this page size (need_sort=True: PD mode)."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

    if ps == 1:
        return TokenToKVPoolAllocator(POOL_TOKENS, torch.bfloat16, str(DEV), None, True)
    return PagedTokenToKVPoolAllocator(POOL_TOKENS, ps, torch.bfloat16, str(DEV), None, True)


def _kvmem(ps: int):
    from kvmem_sglang.allocator import KvmemTokenToKVPoolAllocator

    return KvmemTokenToKVPoolAllocator(POOL_TOKENS, ps, torch.bfloat16, str(DEV), None, True)


def _batch(seed: int):
    """A batch of new requests: device lengths, CPU hints, lengths as a list."""
    rng = random.Random(seed)
    lens = [rng.randrange(900, 1100) for _ in range(BATCH)]
    seq_cpu = torch.tensor(lens, dtype=torch.int64)
    pre_cpu = torch.zeros(BATCH, dtype=torch.int64)
    return dict(
        lens=lens,
        total=sum(lens),
        pre=pre_cpu.to(DEV),
        seq=seq_cpu.to(DEV),
        pre_cpu=pre_cpu,
        seq_cpu=seq_cpu,
        last=torch.full((BATCH,), -1, dtype=torch.int64, device=DEV),
    )


def prefill_step(a, ps: int, batches: list[dict], in_flight: collections.deque, k: list[int]):
    """One batch allocated, the oldest batch in flight released (the scheduler's calls)."""
    b = batches[k[0] % len(batches)]
    k[0] += 1
    assert a.available_size() >= b["total"] + BATCH * ps
    if ps == 1:
        out = a.alloc(b["total"])
    else:
        out = a.alloc_extend(b["pre"], b["pre_cpu"], b["seq"], b["seq_cpu"], b["last"], b["total"])
    in_flight.append(out.to(torch.int32).split(b["lens"]))  # req_to_token rows
    if len(in_flight) > IN_FLIGHT:
        for row in in_flight.popleft():
            a.free_segments([(row, 0)])


def _run(benchmark, report, ps: int, name: str, a):
    batches = [_batch(seed) for seed in range(4)]
    in_flight: collections.deque = collections.deque()
    k = [0]
    done = sync(DEV)

    def round_():
        for _ in range(STEPS_PER_ROUND):
            prefill_step(a, ps, batches, in_flight, k)
        done()

    for _ in range(warmups(2)):  # warm-up: fill the pipeline, one pass over the pool
        round_()
    benchmark.pedantic(round_, rounds=ROUNDS, iterations=1, warmup_rounds=warmups(1))
    while in_flight:  # drain: the pool is whole again on both sides
        for row in in_flight.popleft():
            a.free_segments([(row, 0)])
    assert a.available_size() == POOL_TOKENS
    if hasattr(a, "page_allocator"):
        a.page_allocator.check_invariants()
    if benchmark.enabled:
        report.add(
            f"PD prefill allocator calls, {STEPS_PER_ROUND} batches of {BATCH} x ~1000 "
            f"tokens, P{ps}",
            name,
            benchmark,
            figure="allocator",
            role="kvmem" if name.startswith("kvmem") else "baseline",
        )


@pytest.mark.parametrize("ps", PAGE_SIZES, ids=lambda p: f"P{p}")
def test_pd_prefill_kvmem(benchmark, report, ps):
    _run(benchmark, report, ps, "kvmem KvmemTokenToKVPoolAllocator", _kvmem(ps))


@pytest.mark.parametrize("ps", PAGE_SIZES, ids=lambda p: f"P{p}")
def test_pd_prefill_sglang(benchmark, report, ps):
    a = _stock(ps)
    _run(benchmark, report, ps, f"sglang {type(a).__name__}", a)


# -- the free of an aborted request's row ------------------------------------------------
# What the prefill scheduler calls when it retires a request aborted in its running batch
# (``release_kv_cache`` -> ``free_kv_row`` -> ``free_segments([(row, 0)])``): short rows,
# where kvmem's validated free (range, ownership and duplicate checks) against sglang's
# append to its staging list is all fixed per-call cost.  Target: no slower.

ABORT_ROWS = 64  # rows freed one by one per timed round
ABORT_CASES = [(16, 100), (4, 37), (1, 30)]  # (page_size, tokens per request)


def _abort_run(benchmark, report, ps: int, tokens: int, name: str, a):
    done = sync(DEV)
    rows: list = []

    def setup():
        slots = a.alloc(ABORT_ROWS * -(-tokens // ps) * ps).to(torch.int32)
        step = -(-tokens // ps) * ps
        rows[:] = [slots[i * step : i * step + tokens] for i in range(ABORT_ROWS)]
        done()

    def free_rows():
        for row in rows:
            a.free_segments([(row, 0)])
        done()

    for _ in range(warmups(3)):
        setup()
        free_rows()
    benchmark.pedantic(
        free_rows, setup=setup, rounds=ROUNDS * 4, iterations=1, warmup_rounds=warmups(1)
    )
    assert a.available_size() == POOL_TOKENS
    if benchmark.enabled:
        report.add(
            f"free of an aborted request's row ({ABORT_ROWS} rows of {tokens} tokens), P{ps}",
            name,
            benchmark,
            figure="allocator",
            role="kvmem" if name.startswith("kvmem") else "baseline",
        )


@pytest.mark.parametrize("ps,tokens", ABORT_CASES, ids=lambda v: str(v))
def test_abort_free_kvmem(benchmark, report, ps, tokens):
    _abort_run(benchmark, report, ps, tokens, "kvmem KvmemTokenToKVPoolAllocator", _kvmem(ps))


@pytest.mark.parametrize("ps,tokens", ABORT_CASES, ids=lambda v: str(v))
def test_abort_free_sglang(benchmark, report, ps, tokens):
    a = _stock(ps)
    _abort_run(benchmark, report, ps, tokens, f"sglang {type(a).__name__}", a)
