"""pool.release() / pool.resume() against freeing and re-allocating the same bytes for real.

Host (CPU): pools of 0.5, 1 and 2 GiB.  Targets (2 GiB): release under 150 ms; resume with
pages pre-faulted at least as fast as allocating and touching a fresh 2 GiB buffer.
GPU: pools of 1, 16 and 64 GiB.  Targets: release of 64 GiB under 50 ms, resume under
300 ms, both >= 5x faster than ``del`` + ``torch.cuda.empty_cache()`` / ``torch.empty``.
``KVMEM_BENCH_RELEASE_GIB`` sets the sizes (GiB, comma-separated, fractions allowed); the
smoke mode uses one 16 MiB pool.
"""

from __future__ import annotations

import os

import pytest
import torch

import kvmem
from bench.conftest import bench_device, pick, rounds, sync

DEV = bench_device()
_DEFAULT_GIB = "1,16,64" if DEV.type == "cuda" else "0.5,1,2"
SIZES_GIB = pick(
    [float(x) for x in os.environ.get("KVMEM_BENCH_RELEASE_GIB", _DEFAULT_GIB).split(",")], [1 / 64]
)
ROUNDS = rounds("KVMEM_BENCH_RELEASE_ROUNDS", 5)


def _spec_for(gib: float) -> tuple[kvmem.KVSpec, int]:
    spec = kvmem.KVSpec(
        num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16
    )
    return spec, int(gib * 2**30) // spec.page_bytes


def _label(gib: float) -> str:
    return f"{gib:g} GiB" if gib >= 1 else f"{gib * 1024:g} MiB"


@pytest.fixture(scope="module", params=SIZES_GIB, ids=lambda g: _label(g).replace(" ", ""))
def pool(request):
    spec, pages = _spec_for(request.param)
    p = kvmem.KVPool(spec, num_pages=pages, device=DEV)
    p._mem.tensor.fill_(1)  # every page resident before the first release
    sync(DEV)()
    p.label = _label(request.param)
    yield p
    p.release()
    del p


def _add(report, op: str, pool, name: str, role: str, benchmark) -> None:
    """A row of the release/resume figure (bench/plot.py): time against pool bytes."""
    report.add(
        f"{op} {pool.label}",
        name,
        benchmark,
        figure="release",
        op=op,
        pool_bytes=pool.nbytes,
        role=role,
    )


def test_release_kvmem(benchmark, pool, report):
    benchmark.pedantic(
        pool.release, setup=lambda: pool.resume(prefault=True), rounds=ROUNDS, iterations=1
    )
    assert pool.released and pool.resident_bytes() <= 0.05 * pool.nbytes
    _add(report, "release", pool, "kvmem pool.release()", "kvmem", benchmark)


def test_resume_kvmem(benchmark, pool, report):
    benchmark.pedantic(
        lambda: pool.resume(prefault=True), setup=pool.release, rounds=ROUNDS, iterations=1
    )
    assert not pool.released and pool.resident_bytes() >= pool.nbytes
    _add(report, "resume", pool, "kvmem pool.resume(prefault=True)", "kvmem", benchmark)
    pool.release()  # leave the memory free for the baselines


def _fresh(nbytes: int) -> torch.Tensor:
    t = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    if DEV.type == "cpu":
        t[::4096].zero_()  # touch every page, as a pre-faulted resume does
    return t


def test_release_baseline_free(benchmark, pool, report):
    holder = {}

    def setup():
        holder["t"] = _fresh(pool.nbytes)
        sync(DEV)()

    def free():
        del holder["t"]
        if DEV.type == "cuda":
            torch.cuda.empty_cache()  # give it back to the driver, as release does

    benchmark.pedantic(free, setup=setup, rounds=ROUNDS, iterations=1)
    _add(report, "release", pool, "del tensor (+ torch.cuda.empty_cache)", "baseline", benchmark)


def test_resume_baseline_allocate(benchmark, pool, report):
    holder = {}

    def setup():
        holder.pop("t", None)
        if DEV.type == "cuda":
            torch.cuda.empty_cache()

    def allocate():
        holder["t"] = _fresh(pool.nbytes)
        sync(DEV)()

    benchmark.pedantic(allocate, setup=setup, rounds=ROUNDS, iterations=1)
    holder.clear()
    _add(
        report,
        "resume",
        pool,
        "torch.empty of the same bytes, pages touched",
        "baseline",
        benchmark,
    )
