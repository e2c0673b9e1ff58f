"""Bad inputs to pack/unpack and KVSpec/KVPool: a clear error, and nothing changed."""

from __future__ import annotations

import pytest
import torch

import kvmem
from tests.kv_cases import fill_random

SPEC = kvmem.KVSpec(num_layers=3, num_kv_heads=4, head_dim=16, page_size=4, dtype=torch.bfloat16)


@pytest.fixture
def pool():
    p = kvmem.KVPool(SPEC, num_pages=8)
    fill_random(p._mem.tensor, torch.Generator().manual_seed(7))
    return p


def _snapshot(pool):
    return pool._mem.tensor.clone()


@pytest.mark.parametrize("ids", [[-1], [8], [1, 2, 100], [0, -5, 3]], ids=str)
def test_page_id_out_of_range(pool, ids):
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=r"page id -?\d+ is outside \[0, 8\)"):
        kvmem.pack_pages(pool, torch.tensor(ids))
    buf = torch.zeros(kvmem.packed_nbytes(SPEC, len(ids)), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"outside \[0, 8\)"):
        kvmem.unpack_pages(buf, pool, torch.tensor(ids))
    assert torch.equal(_snapshot(pool), before)


def test_out_buffer_is_validated(pool):
    ids = torch.tensor([1, 2])
    n = kvmem.packed_nbytes(SPEC, 2)
    cases = [
        (torch.zeros(n - 1, dtype=torch.uint8), rf"out has {n - 1} bytes, the chunk needs {n}"),
        (torch.zeros(n + 2, dtype=torch.uint8), rf"out has {n + 2} bytes, the chunk needs {n}"),
        (torch.zeros(n // 2, dtype=torch.int16), r"must be uint8, got torch.int16"),
        (torch.zeros(2, n // 2, dtype=torch.uint8), r"contiguous 1-D"),
        (torch.zeros(2 * n, dtype=torch.uint8)[::2], r"contiguous 1-D"),
        (torch.zeros(n, dtype=torch.uint8, device="meta"), r"is on meta, the KV buffers on cpu"),
        ("not a tensor", r"must be a torch.Tensor"),
    ]
    for out, msg in cases:
        before = (
            out.clone() if isinstance(out, torch.Tensor) and out.device.type != "meta" else None
        )
        with pytest.raises((ValueError, TypeError), match=msg):
            kvmem.pack_pages(pool, ids, out=out)
        if before is not None:
            assert torch.equal(out, before)


def test_unpack_buffer_is_validated(pool):
    before = _snapshot(pool)
    ids = torch.tensor([1, 2])
    with pytest.raises(
        ValueError, match=f"buf has 10 bytes, the chunk needs {kvmem.packed_nbytes(SPEC, 2)}"
    ):
        kvmem.unpack_pages(torch.zeros(10, dtype=torch.uint8), pool, ids)
    with pytest.raises(ValueError, match="must be uint8"):
        kvmem.unpack_pages(torch.zeros(768, dtype=torch.float16), pool, ids)
    assert torch.equal(_snapshot(pool), before)


def test_unpack_rejects_duplicate_pages(pool):
    before = _snapshot(pool)
    buf = torch.zeros(kvmem.packed_nbytes(SPEC, 3), dtype=torch.uint8)
    with pytest.raises(ValueError, match="lists a page twice"):
        kvmem.unpack_pages(buf, pool, torch.tensor([3, 5, 3]))
    assert torch.equal(_snapshot(pool), before)
    # Packing a page twice is harmless and allowed.
    assert kvmem.pack_pages(pool, torch.tensor([3, 3])).numel() == kvmem.packed_nbytes(SPEC, 2)


@pytest.mark.parametrize(
    "ids, msg",
    [
        (torch.tensor([1.0, 2.0]), "int32 or int64, got torch.float32"),
        (torch.tensor([[1, 2]]), "must be 1-D"),
        (["a"], "page_ids must be integers"),
        (torch.tensor([1, 2], device="meta"), "page_ids are on meta, the KV buffers on cpu"),
    ],
    ids=["float", "2d", "strings", "device"],
)
def test_bad_page_ids(pool, ids, msg):
    with pytest.raises(ValueError, match=msg):
        kvmem.pack_pages(pool, ids)


@pytest.mark.parametrize(
    "layers, heads, msg",
    [
        ([3], None, r"layers: 3 is not a layer index in \[0, 3\)"),
        ([-1], None, r"layers: -1 is not a layer index"),
        ([], None, "layers is empty"),
        ([1, 1], None, "lists a layer twice"),
        (7, None, "layers must be a sequence"),
        (None, (2, 2), r"heads=\(2, 2\) is not a non-empty range"),
        (None, (0, 5), r"heads=\(0, 5\) is not a non-empty range within \[0, 4\]"),
        (None, (-1, 2), "not a non-empty range"),
        (None, 3, r"heads must be a \(start, stop\) pair"),
        (None, (0.0, 2), "pair of ints"),
    ],
)
def test_bad_layers_and_heads(pool, layers, heads, msg):
    with pytest.raises(ValueError, match=msg):
        kvmem.pack_pages(pool, torch.tensor([1]), layers=layers, heads=heads)
    with pytest.raises(ValueError, match=msg):
        kvmem.packed_nbytes(SPEC, 1, layers=layers, heads=heads)


def test_bad_buffer_lists():
    k = [torch.zeros(4, 2, 2, 8) for _ in range(2)]
    v = [torch.zeros(4, 2, 2, 8) for _ in range(2)]
    ids = torch.tensor([1])
    with pytest.raises(ValueError, match="k_buffers is empty"):
        kvmem.pack_buffers([], v, ids)
    with pytest.raises(ValueError, match="2 K layers but 1 V layers"):
        kvmem.pack_buffers(k, v[:1], ids)
    with pytest.raises(ValueError, match=r"k_buffers\[1\] differs"):
        kvmem.pack_buffers([k[0], torch.zeros(4, 2, 2, 4)], None, ids)
    with pytest.raises(ValueError, match=r"v_buffers\[0\] .* does not match"):
        kvmem.pack_buffers(k, [torch.zeros(5, 2, 2, 8)] * 2, ids)
    with pytest.raises(ValueError, match="head_dim axis must be contiguous"):
        kvmem.pack_buffers([torch.zeros(4, 2, 8, 2).transpose(2, 3)], None, ids)
    with pytest.raises(ValueError, match=r"\[num_tokens, H, D\]: pass page_size="):
        kvmem.pack_buffers([torch.zeros(8, 2, 8)], None, ids)
    with pytest.raises(ValueError, match="not a multiple of page_size 3"):
        kvmem.pack_buffers([torch.zeros(8, 2, 8)], None, ids, page_size=3)
    with pytest.raises(ValueError, match="has page_size 2, expected 4"):
        kvmem.pack_buffers(k, v, ids, page_size=4)
    with pytest.raises(TypeError, match="list of per-layer tensors"):
        kvmem.pack_buffers(k[0], None, ids)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(num_kv_heads=-1), "num_kv_heads"),
        (dict(head_dim=0), "head_dim"),
        (dict(page_size=0), "page_size"),
        (dict(v_head_dim=-2), "v_head_dim"),
        (dict(num_layers=2.0), "num_layers"),
        (dict(dtype=torch.int32), "dtype"),
        (dict(dtype=torch.float64), "dtype"),
    ],
)
def test_kvspec_rejects_bad_fields(kwargs, field):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.bfloat16)
    args.update(kwargs)
    with pytest.raises(ValueError, match=rf"KVSpec\.{field}"):
        kvmem.KVSpec(**args)


def test_kvspec_sizes():
    s = kvmem.KVSpec(
        num_layers=2,
        num_kv_heads=4,
        head_dim=128,
        page_size=16,
        dtype=torch.float8_e4m3fn,
        v_head_dim=64,
    )
    assert s.storage_dtype == torch.uint8 and s.itemsize == 1
    assert s.k_token_bytes == 512 and s.v_token_bytes == 256
    assert s.k_page_bytes == 16 * 512 and s.page_bytes == 2 * 16 * (512 + 256)
    assert s.pool_bytes(10) == 10 * s.page_bytes
    assert kvmem.KVSpec(2, 1, 576, 1, torch.bfloat16, v_head_dim=0).has_v is False


def test_kvpool_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_pages must be an int >= 2"):
        kvmem.KVPool(SPEC, num_pages=1)
    with pytest.raises(TypeError, match="spec must be a KVSpec"):
        kvmem.KVPool(dict(num_layers=1), num_pages=4)
    with pytest.raises(ValueError, match="unknown memory backend 'nope'"):
        kvmem.KVPool(SPEC, num_pages=4, backend="nope")
