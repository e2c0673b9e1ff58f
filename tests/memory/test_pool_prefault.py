"""pool.prefault() on the host backend never changes the pool's contents, whichever way
the pages are populated (MADV_POPULATE_WRITE, or the mlock fallback of kernels before
5.14, or nothing where locking is refused)."""

from __future__ import annotations

import errno
import resource

import pytest
import torch

import kvmem
from kvmem.memory import host
from tests.kv_cases import fill_random

SPEC = kvmem.KVSpec(num_layers=4, num_kv_heads=4, head_dim=128, page_size=16, dtype=torch.bfloat16)
PAGES = 129  # 4 layers x 2 x 129 pages x 16 KiB: about 16 MiB


@pytest.fixture
def pool():
    p = kvmem.KVPool(SPEC, num_pages=PAGES)
    fill_random(p._mem.tensor, torch.Generator().manual_seed(11))
    return p


def _without_populate_write(monkeypatch) -> list[int]:
    """Make MADV_POPULATE_WRITE fail as on kernels before 5.14 (EINVAL); returns the
    lengths it was asked for."""
    real = host._madvise
    asked: list[int] = []

    def madvise(addr, length, advice):
        if advice == host.MADV_POPULATE_WRITE:
            asked.append(length)
            raise OSError(errno.EINVAL, "madvise(23): Invalid argument")
        return real(addr, length, advice)

    monkeypatch.setattr(host, "_madvise", madvise)
    return asked


def _lockable() -> None:
    """Let this process lock what the fallback prefault locks at once (its threads' windows):
    RLIMIT_MEMLOCK's soft limit raised towards the hard one; fails, naming the limit, where
    the hard limit is lower."""
    need = 4 * host.PAGE * 2 * host._PREFAULT_THREADS
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard == resource.RLIM_INFINITY or hard >= need:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (need, hard))
            return
        pytest.fail(
            f"RLIMIT_MEMLOCK hard limit {hard} bytes is below the {need} bytes the "
            "fallback prefault locks at once; raise it (ulimit -l) to run this test"
        )


def test_fallback_prefault_keeps_every_byte(pool, monkeypatch):
    asked = _without_populate_write(monkeypatch)
    before = pool._mem.tensor.clone()
    pool.prefault()
    assert asked  # the fallback ran
    assert torch.equal(pool._mem.tensor, before)


def test_fallback_prefault_populates_a_released_pool(pool, monkeypatch):
    _lockable()
    _without_populate_write(monkeypatch)
    pool.release()
    assert pool.resident_bytes() <= 0.05 * pool.nbytes
    pool.resume(prefault=True)
    assert pool.resident_bytes() >= pool.nbytes  # every page faulted in, measured by mincore
    assert not bool(pool._mem.tensor.any())  # and nothing was written


def test_prefault_when_locking_is_refused_changes_nothing(pool, monkeypatch):
    _without_populate_write(monkeypatch)
    monkeypatch.setattr(host, "_mlock", lambda addr, length: errno.EPERM)
    before = pool._mem.tensor.clone()
    pool.prefault()
    assert torch.equal(pool._mem.tensor, before)
    pool.release()
    pool.resume(prefault=True)  # pages are left to fault at first touch
    assert pool.resident_bytes() <= 0.05 * pool.nbytes


def test_populate_write_failure_is_raised_and_changes_nothing(pool, monkeypatch):
    real = host._madvise

    def madvise(addr, length, advice):
        if advice == host.MADV_POPULATE_WRITE:
            raise OSError(errno.ENOMEM, "madvise(23): Cannot allocate memory")
        return real(addr, length, advice)

    monkeypatch.setattr(host, "_madvise", madvise)
    before = pool._mem.tensor.clone()
    with pytest.raises(OSError, match="Cannot allocate memory"):
        pool.prefault()
    assert torch.equal(pool._mem.tensor, before)


def test_native_prefault_keeps_every_byte(pool):
    before = pool._mem.tensor.clone()
    pool.prefault()
    assert torch.equal(pool._mem.tensor, before)
