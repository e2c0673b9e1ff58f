"""Page runs after a long soak: how contiguous are the pages a request
gets once the free list has been churned by thousands of requests, and how many
transfer descriptors does that make (a run of consecutive page ids = one descriptor)?

    python -m bench.allocator_runs [--requests 10000] [--pages 4096] [--md FILE]

The soak: requests of random lengths (1-256 pages, uniform) arrive one at a time;
when one does not fit, random live requests finish (are freed) until it does, and after
each arrival a random live request also finishes with probability 0.3.  Two sides run
the same request lengths with their own random finishing order (a prefill pool and a
decode pool), so "both sides" counts the descriptors left after merging pages that are
adjacent on both sides, what a direct pool-to-pool transfer could send.  The first
1000 requests warm the free list up and are not counted.

Policies, in the same run, on the same request stream:

- ``kvmem``: ``kvmem.PageAllocator`` as it is (sglang's need_sort order);
- ``fifo``: kvmem's order before, a FIFO ring (freed pages reused first-freed first),
  modelled in 10 lines here because the library no longer has it;
- ``sglang need_sort`` / ``sglang no sort``: sglang 0.5.23's
  ``PagedTokenToKVPoolAllocator`` itself, imported (skipped when sglang is missing);
- ``best fit (model)``: what a run-aware allocator could reach, modelled here and not in
  the library: the shortest run of free pages that holds the request, else the longest
  runs first.  It scans the whole free map per alloc (O(num_pages)).
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter, deque

import numpy as np
import torch

from bench import print_table
from kvmem import PageAllocator

PS = 16
# One layer's K of one page at page_size 16, 8 KV heads x 128 dims bf16: the bytes one
# descriptor of a direct per-layer transfer moves per page.
PAGE_LAYER_BYTES = PS * 8 * 128 * 2


class Fifo:
    """kvmem's order before this change: free pages in a FIFO ring, 1, 2, 3, ... first."""

    def __init__(self, num_pages: int):
        self.q = deque(range(1, num_pages))

    def alloc(self, n: int) -> list[int]:
        return [self.q.popleft() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self.q.extend(pages)


class BestFit:
    """Not in the library: the headroom a run-aware policy would have (module docstring)."""

    def __init__(self, num_pages: int):
        self.f = np.ones(num_pages, dtype=bool)
        self.f[0] = False

    def alloc(self, n: int) -> list[int]:
        d = np.diff(np.concatenate(([0], self.f.astype(np.int8), [0])))
        starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)
        lens = ends - starts
        fits = np.flatnonzero(lens >= n)
        if fits.size:
            i = fits[np.argmin(lens[fits])]
            pages = np.arange(starts[i], starts[i] + n)
        else:
            parts, need = [], n
            for i in np.argsort(-lens, kind="stable"):
                take = min(need, int(lens[i]))
                parts.append(np.arange(starts[i], starts[i] + take))
                need -= take
                if need == 0:
                    break
            pages = np.concatenate(parts)
        self.f[pages] = False
        return pages.tolist()

    def free(self, pages: list[int]) -> None:
        self.f[pages] = True


class Kvmem:
    def __init__(self, num_pages: int):
        self.a = PageAllocator(num_pages, PS)

    def alloc(self, n: int) -> list[int]:
        return self.a.alloc(n).tolist()

    def free(self, pages: list[int]) -> None:
        self.a.free(pages)


class Sglang:
    def __init__(self, num_pages: int, need_sort: bool):
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

        self.a = PagedTokenToKVPoolAllocator(
            size=(num_pages - 1) * PS,
            page_size=PS,
            dtype=torch.bfloat16,
            device="cpu",
            kvcache=None,
            need_sort=need_sort,
        )

    def alloc(self, n: int) -> list[int]:
        return (self.a.alloc(n * PS)[::PS] // PS).tolist()

    def free(self, pages: list[int]) -> None:
        self.a.free_page_ids(torch.tensor(pages, dtype=torch.int64))


def soak(make, num_pages: int, lengths: list[int], seed: int) -> list[list[int]]:
    """The pages each request got, in request order."""
    a = make(num_pages)
    rng = random.Random(seed)
    live: list[list[int]] = []
    free = num_pages - 1
    got = []
    for n in lengths:
        while n > free:
            pages = live.pop(rng.randrange(len(live)))
            a.free(pages)
            free += len(pages)
        pages = a.alloc(n)
        free -= n
        live.append(pages)
        got.append(pages)
        if live and rng.random() < 0.3:
            done = live.pop(rng.randrange(len(live)))
            a.free(done)
            free += len(done)
    return got


def runs(pages: list[int]) -> list[int]:
    """Lengths of the runs of consecutive page ids, in order."""
    p = np.asarray(pages)
    breaks = np.flatnonzero(np.diff(p) != 1) + 1
    return np.diff(np.concatenate(([0], breaks, [len(p)]))).tolist()


def both_sides(src: list[int], dst: list[int]) -> int:
    """Descriptors after merging pages adjacent on both sides."""
    s, d = np.asarray(src), np.asarray(dst)
    return 1 + int(np.count_nonzero((np.diff(s) != 1) | (np.diff(d) != 1)))


def stats(prefill: list[list[int]], decode: list[list[int]], skip: int) -> dict:
    run_hist: Counter = Counter()
    pages_total = desc_one = desc_both = 0
    for src, dst in zip(prefill[skip:], decode[skip:]):
        rs = runs(src)
        for r in rs:
            run_hist[r] += r  # pages in runs of length r
        pages_total += len(src)
        desc_one += len(rs)
        desc_both += both_sides(src, dst)
    reqs = len(prefill) - skip

    def share(lo, hi):
        return sum(v for k, v in run_hist.items() if lo <= k <= hi) / pages_total

    return dict(
        pages_per_desc=pages_total / desc_one,
        desc_per_req=desc_one / reqs,
        both_pages_per_desc=pages_total / desc_both,
        both_desc_per_req=desc_both / reqs,
        kib_per_desc=pages_total / desc_one * PAGE_LAYER_BYTES / 1024,
        both_kib_per_desc=pages_total / desc_both * PAGE_LAYER_BYTES / 1024,
        run_1=share(1, 1),
        run_2_7=share(2, 7),
        run_8_63=share(8, 63),
        run_64=share(64, 1 << 30),
        median_run_page=_weighted_median(run_hist),
    )


def _weighted_median(hist: Counter) -> int:
    """The run length the median page sits in."""
    total = sum(hist.values())
    acc = 0
    for k in sorted(hist):
        acc += hist[k]
        if acc * 2 >= total:
            return k
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--pages", type=int, default=4096, help="pages per pool (page 0 aside)")
    ap.add_argument("--md", help="append the table as markdown to this file")
    a = ap.parse_args()
    rng = random.Random(0)
    lengths = [rng.randint(1, 256) for _ in range(a.requests)]
    num_pages = a.pages + 1
    policies = {"fifo": Fifo, "kvmem": Kvmem, "best fit (model)": BestFit}
    try:
        import sglang.srt.mem_cache.allocator  # noqa: F401

        policies["sglang need_sort"] = lambda n: Sglang(n, True)
        policies["sglang no sort"] = lambda n: Sglang(n, False)
    except ImportError:
        print("sglang not installed: its allocators are left out")
    skip = min(1000, a.requests // 10)
    rows = []
    results = {}
    for name, make in policies.items():
        t = time.perf_counter()
        pre = soak(make, num_pages, lengths, seed=1)
        dec = soak(make, num_pages, lengths, seed=2)
        results[name] = pre
        s = stats(pre, dec, skip)
        rows.append((name, s))
        print(f"{name:<18} {time.perf_counter() - t:6.1f} s  {s}", flush=True)
    if "sglang need_sort" in results:
        same = results["kvmem"] == results["sglang need_sort"]
        print(f"kvmem hands out the same pages as sglang need_sort: {same}")
    lines = [
        f"{a.requests} requests of 1-256 pages (uniform) through a pool of {a.pages} pages "
        f"of {PS} tokens, first {skip} not counted; KiB per descriptor: one layer's K, "
        f"8 heads x 128 dims bf16 ({PAGE_LAYER_BYTES // 1024} KiB per page)",
        "",
        "| policy | pages per descriptor | descriptors per request | KiB per descriptor "
        "| pages in runs of 1 / 2-7 / 8-63 / 64+ | median page's run | both sides: pages "
        "per descriptor | both sides: descriptors per request | both sides: KiB per "
        "descriptor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in rows:
        lines.append(
            f"| {name} | {s['pages_per_desc']:.1f} | {s['desc_per_req']:.1f} | "
            f"{s['kib_per_desc']:.0f} | {s['run_1']:.0%} / {s['run_2_7']:.0%} / "
            f"{s['run_8_63']:.0%} / {s['run_64']:.0%} | {s['median_run_page']} | "
            f"{s['both_pages_per_desc']:.1f} | {s['both_desc_per_req']:.1f} | "
            f"{s['both_kib_per_desc']:.0f} |"
        )
    print_table(lines, a.md)


if __name__ == "__main__":
    main()
