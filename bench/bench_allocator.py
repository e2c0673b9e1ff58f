"""PageAllocator against sglang 0.5.23's allocators on the same device, in the same run:

- alloc + free cycles of 64 pages: page_size 16 against PagedTokenToKVPoolAllocator
  (need_sort=True, as in PD mode), page_size 1 against TokenToKVPoolAllocator;
- alloc_extend + free of a batch of 32 requests of ~1000 tokens each (prefix 0), the same
  pairs (sglang serves page_size 1 with TokenToKVPoolAllocator.alloc);
- alloc_extend alone of 256 requests with check=False and the *_cpu hints (the H200
  target: under 30 us), kvmem only (sglang has no check=False mode to compare with).

Both sides get what their API takes: sglang frees token slots (and dedups them to pages
itself), kvmem frees page ids, which a caller has at hand (the first slot of each page).
Targets: CPU alloc+free cycle at least as fast as sglang's allocators.
sglang is required: without it the baseline tests fail (never skip)."""

from __future__ import annotations

import random

import pytest
import torch

from bench.conftest import bench_device, pick, rounds, sync, warmups
from kvmem.allocator import PageAllocator

DEV = bench_device()
NUM_PAGES_TOKENS = 65536  # tokens in each pool
# 64 rounds x 32 cycles of 64 pages = 2 passes over a 65536-token pool: sglang's
# need_sort allocators stage frees and sort them when alloc runs short, so a run must
# cover whole passes for its median to include that.
ROUNDS = rounds("KVMEM_BENCH_ROUNDS_ALLOC", 64)


def _sglang():
    """sglang's allocator classes; ImportError (a failing test) when it is missing."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

    return PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator


def sglang_paged(ps):
    paged, _ = _sglang()
    return paged(
        size=NUM_PAGES_TOKENS,
        page_size=ps,
        dtype=torch.bfloat16,
        device=str(DEV),
        kvcache=None,
        need_sort=True,
    )


def sglang_token():
    _, token = _sglang()
    return token(
        size=NUM_PAGES_TOKENS, dtype=torch.bfloat16, device=str(DEV), kvcache=None, need_sort=True
    )


def kvmem_alloc(ps):
    return PageAllocator(NUM_PAGES_TOKENS // ps + 1, ps, device=DEV)


# check=False differs from check=True only where reading a value costs a device sync
# (CUDA); on the CPU both run the same code, so the CPU run measures check=True only.
CHECKS = [True, False] if DEV.type == "cuda" else [True]
CHECK_IDS = ["check", "nocheck"][: len(CHECKS)]


def _measure(benchmark, fn, iterations=32):
    done = sync(DEV)

    def call():
        fn()
        done()

    for _ in range(warmups(3)):  # warm-up: Triton compilation, allocator caches
        call()
    benchmark.pedantic(
        call, rounds=ROUNDS, iterations=pick(iterations, 1), warmup_rounds=warmups(1)
    )


def _add(report, group: str, name: str, benchmark) -> None:
    """A row of the allocator figure (bench/plot.py): kvmem rows against sglang's."""
    report.add(
        group,
        name,
        benchmark,
        figure="allocator",
        role="kvmem" if name.startswith("kvmem") else "baseline",
    )


# -- alloc + free cycles -----------------------------------------------------------------

CYCLE_PAGES = 64


@pytest.mark.parametrize("check", CHECKS, ids=CHECK_IDS)
@pytest.mark.parametrize("ps", [16, 1], ids=lambda p: f"P{p}")
def test_cycle_kvmem(benchmark, report, ps, check):
    a = kvmem_alloc(ps)

    def cycle():
        a.free(a.alloc(CYCLE_PAGES, check=check), check=check)

    _measure(benchmark, cycle)
    a.check_invariants()
    _add(report, f"alloc+free of {CYCLE_PAGES} pages, P{ps}", f"kvmem check={check}", benchmark)


def test_cycle_sglang_paged(benchmark, report):
    a = sglang_paged(16)

    def cycle():
        a.free(a.alloc(CYCLE_PAGES * 16))

    _measure(benchmark, cycle)
    _add(
        report,
        f"alloc+free of {CYCLE_PAGES} pages, P16",
        "sglang PagedTokenToKVPoolAllocator",
        benchmark,
    )


def test_cycle_sglang_token(benchmark, report):
    a = sglang_token()

    def cycle():
        a.free(a.alloc(CYCLE_PAGES))

    _measure(benchmark, cycle)
    _add(
        report, f"alloc+free of {CYCLE_PAGES} pages, P1", "sglang TokenToKVPoolAllocator", benchmark
    )


# -- alloc_extend + free of a prefill batch ----------------------------------------------

BATCH = 32


def _batch(bs, ps, seed=0):
    """Fresh requests of ~1000 tokens: device lengths, CPU hints, and the index in the
    output of each page's first slot (what a caller reads its page ids from)."""
    rng = random.Random(seed)
    lens = [rng.randrange(900, 1100) for _ in range(bs)]
    seq_cpu = torch.tensor(lens, dtype=torch.int64)
    pre_cpu = torch.zeros(bs, dtype=torch.int64)
    starts, first_slots = 0, []
    for n in lens:
        first_slots += range(starts, starts + n, ps)
        starts += n
    return dict(
        pre=pre_cpu.to(DEV),
        seq=seq_cpu.to(DEV),
        pre_cpu=pre_cpu,
        seq_cpu=seq_cpu,
        last=torch.full((bs,), -1, dtype=torch.int64, device=DEV),
        total=sum(lens),
        page_first=torch.tensor(first_slots, dtype=torch.int64, device=DEV),
    )


@pytest.mark.parametrize("check", CHECKS, ids=CHECK_IDS)
@pytest.mark.parametrize("ps", [16, 1], ids=lambda p: f"P{p}")
def test_extend_kvmem(benchmark, report, ps, check):
    a = kvmem_alloc(ps)
    b = _batch(BATCH, ps)

    def cycle():
        slots = a.alloc_extend(
            b["pre"],
            b["seq"],
            b["last"],
            prefix_lens_cpu=b["pre_cpu"],
            seq_lens_cpu=b["seq_cpu"],
            extend_num_tokens=b["total"],
            check=check,
        )
        a.free(slots if ps == 1 else slots[b["page_first"]] // ps, check=check)

    _measure(benchmark, cycle, iterations=2)
    a.check_invariants()
    _add(
        report,
        f"alloc_extend+free, {BATCH} requests x ~1000 tokens, P{ps}",
        f"kvmem check={check}",
        benchmark,
    )


def test_extend_sglang_paged(benchmark, report):
    a = sglang_paged(16)
    b = _batch(BATCH, 16)

    def cycle():
        slots = a.alloc_extend(
            b["pre"], b["pre_cpu"], b["seq"], b["seq_cpu"], b["last"], b["total"]
        )
        a.free(slots)

    _measure(benchmark, cycle, iterations=2)
    _add(
        report,
        f"alloc_extend+free, {BATCH} requests x ~1000 tokens, P16",
        "sglang PagedTokenToKVPoolAllocator",
        benchmark,
    )


def test_extend_sglang_token(benchmark, report):
    a = sglang_token()
    b = _batch(BATCH, 1)

    def cycle():
        a.free(a.alloc(b["total"]))  # what sglang does for an extend at page_size 1

    _measure(benchmark, cycle, iterations=2)
    _add(
        report,
        f"alloc_extend+free, {BATCH} requests x ~1000 tokens, P1",
        "sglang TokenToKVPoolAllocator.alloc",
        benchmark,
    )


# -- the GPU target: alloc_extend of 256 requests, check=False, no host sync --------------


def test_extend_256_nocheck_kvmem(benchmark, report):
    """alloc_extend alone (the free runs untimed, in setup); page_size 16."""
    a = kvmem_alloc(16)
    b = _batch(256, 16, seed=1)
    b["seq"] = (b["seq"] // 8).contiguous()  # ~125 tokens each: 256 requests fit the pool
    b["seq_cpu"] = b["seq"].cpu()
    b["total"] = int(b["seq_cpu"].sum())
    held = []
    done = sync(DEV)

    def setup():
        if held:
            a.free(torch.unique(held.pop() // 16), check=False)
        done()

    def extend():
        held.append(
            a.alloc_extend(
                b["pre"],
                b["seq"],
                b["last"],
                prefix_lens_cpu=b["pre_cpu"],
                seq_lens_cpu=b["seq_cpu"],
                extend_num_tokens=b["total"],
                check=False,
            )
        )
        done()

    for _ in range(warmups(3)):
        setup()
        extend()
    benchmark.pedantic(extend, setup=setup, rounds=pick(ROUNDS * 2, 1), warmup_rounds=warmups(1))
    setup()
    a.check_invariants()
    _add(
        report,
        "alloc_extend alone, 256 requests x ~125 tokens, P16, check=False",
        "kvmem check=False",
        benchmark,
    )
