"""A pool that cannot be had fails with kvmem.PoolMemoryError (a MemoryError) naming the
bytes asked for, the backend and the page count: never a bare OSError/OverflowError."""

from __future__ import annotations

import errno

import pytest
import torch

import kvmem
from kvmem.errors import KVMemError, PoolMemoryError
from kvmem.memory import MAX_BYTES, make_backend

SPEC = kvmem.KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, page_size=4, dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", ["host", "plain"])
@pytest.mark.parametrize("num_pages", [2**45, 2**61, 2**200], ids=["2^45", "2^61", "2^200"])
def test_impossible_pool_size_names_bytes_and_backend(num_pages, backend):
    nbytes = SPEC.pool_bytes(num_pages)
    with pytest.raises(PoolMemoryError) as info:
        kvmem.KVPool(SPEC, num_pages, backend=backend)
    e = info.value
    assert isinstance(e, MemoryError) and isinstance(e, KVMemError)
    assert e.nbytes >= nbytes and e.backend == backend and e.device == "cpu"
    msg = str(e)
    assert f"cannot allocate {e.nbytes} bytes" in msg
    assert f"on the {backend} memory backend (cpu)" in msg
    assert f"a KV pool of {num_pages} pages" in msg


def test_range_past_ssize_t_is_refused_before_the_os_sees_it():
    with pytest.raises(
        PoolMemoryError,
        match=rf"{MAX_BYTES + 1} bytes .* host memory backend"
        r".*more than the \d+ bytes one range can address",
    ):
        make_backend(MAX_BYTES + 1, torch.device("cpu"))
    # one byte less passes the check; the OS then refuses it (rounded up past ssize_t,
    # or not enough memory), and that refusal is a PoolMemoryError too
    with pytest.raises(PoolMemoryError, match=rf"{MAX_BYTES} bytes .* host memory backend"):
        make_backend(MAX_BYTES, torch.device("cpu"))


def test_backend_out_of_memory_errors_are_translated():
    def enomem(nbytes, device):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    def other(nbytes, device):
        raise OSError(errno.EACCES, "Permission denied")

    with pytest.raises(
        PoolMemoryError,
        match=r"cannot allocate 4096 bytes \(4.0 KiB\) for "
        r"staging on the enomem memory backend \(cpu\): "
        r"OSError: \[Errno 12\] Cannot allocate memory",
    ):
        make_backend(4096, torch.device("cpu"), enomem, purpose="staging")
    with pytest.raises(PermissionError):  # not a memory shortage: left as it is
        make_backend(4096, torch.device("cpu"), other)
