"""kvmem.memory.plan: the chunk plan both backends map.  What it must guarantee, for any
spec, page count, layout, granularity and target: chunks tile the range on granularity
boundaries; every K/V plane (kvmem layout) or K|V block (sglang layout) lies inside one
chunk's used bytes; planes inside a chunk are 512-aligned; a chunk holds at most
``target`` bytes of planes unless one plane alone is bigger; and a chunk is closed only
when the next plane would not fit (greedy, so few chunks).  With one chunk the layout is
the single-range layout of before (``layer_offsets``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.util import examples

import kvmem
from kvmem.memory.plan import (
    CHUNK_BYTES,
    CHUNK_ENV,
    LAYER_ALIGN,
    chunk_target,
    plan_pool,
    plan_range,
)
from kvmem.pool import layer_offsets

MiB, GiB = 1 << 20, 1 << 30


def _items(spec, num_pages, layout, plan):
    """(offset, bytes) of everything the plan must not cut, in address order."""
    k, v = spec.k_layer_bytes(num_pages), spec.v_layer_bytes(num_pages)
    if layout == "sglang":
        return [(o, k + v) for o in plan.k_offsets]
    return [(o, k) for o in plan.k_offsets] + [(o, v) for o in plan.v_offsets]


def check_plan(spec, num_pages, layout, gran, target):
    plan = plan_pool(spec, num_pages, layout, gran, target)
    align = max(gran, LAYER_ALIGN)
    chunks = plan.chunks
    assert chunks[0].offset == 0
    for a, b in zip(chunks, chunks[1:]):
        assert b.offset == a.offset + a.size  # they tile the range
    for c in chunks:
        assert c.offset % align == 0 and c.size % align == 0
        assert 0 < c.nbytes <= c.size < c.nbytes + align
    assert plan.nbytes == chunks[-1].offset + chunks[-1].nbytes
    assert plan.content == spec.pool_bytes(num_pages)
    assert plan.padding == plan.size - plan.content >= 0
    items = _items(spec, num_pages, layout, plan)
    if layout == "sglang" and spec.has_v:
        k = spec.k_layer_bytes(num_pages)
        assert list(plan.v_offsets) == [o + k for o in plan.k_offsets]
    per_chunk = [[] for _ in chunks]
    for off, n in items:
        assert off % LAYER_ALIGN == 0
        inside = [
            i for i, c in enumerate(chunks) if c.offset <= off and off + n <= c.offset + c.nbytes
        ]
        assert len(inside) == 1, (off, n, chunks)
        per_chunk[inside[0]].append(n)
        assert plan.chunk_of(off) == inside[0] and plan.chunk_of(off + n - 1) == inside[0]
    for i, sizes in enumerate(per_chunk):
        assert sizes, f"chunk {i} holds no plane"
        if target is not None and len(sizes) > 1:
            assert chunks[i].nbytes <= target
        if target is not None and i + 1 < len(chunks):  # closed only when the next did not fit
            nxt = -(-per_chunk[i + 1][0] // LAYER_ALIGN) * LAYER_ALIGN  # with its padding
            assert -(-chunks[i].nbytes // LAYER_ALIGN) * LAYER_ALIGN + nxt > target
    # no two items overlap, in address order
    spans = sorted(items)
    for (a, n), (b, _) in zip(spans, spans[1:]):
        assert a + n <= b
    return plan


specs = st.builds(
    lambda layers, heads, dim, vdim, ps, dtype: kvmem.KVSpec(
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=dim,
        page_size=ps,
        dtype=dtype,
        v_head_dim=vdim,
    ),
    st.integers(1, 12),
    st.integers(1, 8),
    st.sampled_from([1, 3, 64, 128, 576]),
    st.sampled_from([None, 0, 5, 64]),
    st.sampled_from([1, 16, 64]),
    st.sampled_from([torch.bfloat16, torch.float8_e4m3fn, torch.float32]),
)


@settings(max_examples=examples(300), deadline=None)
@given(
    specs,
    st.integers(2, 5000),
    st.sampled_from(["kvmem", "sglang"]),
    st.sampled_from([1, 512, 4096, 2 * MiB]),
    st.one_of(st.none(), st.integers(1, 8 * MiB)),
)
def test_every_plane_lies_inside_one_chunk(spec, num_pages, layout, gran, target):
    check_plan(spec, num_pages, layout, gran, target)


def test_a_planes_padding_counts_against_the_target():
    # found by the property above: a 640-byte V plane after a 128-byte K plane ends at
    # 1152 bytes, but its padding to LAYER_ALIGN takes the chunk to 1536
    spec = kvmem.KVSpec(
        num_layers=1, num_kv_heads=1, head_dim=1, page_size=16, dtype=torch.float32, v_head_dim=5
    )
    plan = check_plan(spec, 2, "kvmem", 1, 1152)
    assert [c.nbytes for c in plan.chunks] == [512, 1024]


@pytest.mark.parametrize("layout", ["kvmem", "sglang"])
def test_one_chunk_is_the_single_range_layout(layout):
    spec = kvmem.KVSpec(
        num_layers=3,
        num_kv_heads=2,
        head_dim=3,
        page_size=1,
        dtype=torch.float8_e4m3fn,
        v_head_dim=5,
    )
    plan = plan_pool(spec, 7, layout, 2 * MiB, None)
    k, v, total = layer_offsets(spec, 7, layout)
    assert (list(plan.k_offsets), list(plan.v_offsets), plan.nbytes) == (k, v, total)
    assert len(plan.chunks) == 1 and plan.chunks[0].size == 2 * MiB
    if layout == "kvmem":  # 6- and 10-byte layers, each on a 512-byte boundary
        assert k == [0, 512, 1024] and v == [1536, 2048, 2560] and total == 3072


def test_a_plane_bigger_than_the_target_is_a_chunk_of_its_own():
    spec = kvmem.KVSpec(
        num_layers=2,
        num_kv_heads=1,
        head_dim=576,
        page_size=1,
        dtype=torch.float8_e4m3fn,
        v_head_dim=0,
    )
    plan = check_plan(spec, 10_000, "kvmem", 2 * MiB, 1 * MiB)  # 5.76 MB planes
    assert [c.offset for c in plan.chunks] == [0, 6 * MiB]
    assert [c.nbytes for c in plan.chunks] == [5_760_000, -(-5_760_000 // 512) * 512]


def test_planes_are_grouped_up_to_the_target():
    # 80 layers of 8 KV heads x 128, bf16, page_size 1, 64 GiB: 409.6 MiB planes, five
    # to a 2 GiB chunk, 32 chunks, 64 KiB of padding in all (bench/results/chunk-plan.md)
    spec = kvmem.KVSpec(num_layers=80, num_kv_heads=8, head_dim=128, page_size=1)
    pages = (64 * GiB) // spec.page_bytes
    plan = check_plan(spec, pages, "kvmem", 2 * MiB, CHUNK_BYTES)
    assert len(plan.chunks) == 32 and plan.padding < 2 * MiB
    sgl = check_plan(spec, pages, "sglang", 2 * MiB, CHUNK_BYTES)  # 819 MiB K|V blocks
    assert len(sgl.chunks) == 40


def test_mla_and_1152_byte_tokens_at_64_gib_never_straddle():
    """576- and 1152-byte tokens do not divide 2 GiB, so fixed 2 GiB
    chunks cut pages; the plan's chunks never do, at page_size 1 and 64."""
    for dtype in (torch.float8_e4m3fn, torch.bfloat16):  # 576 and 1152 bytes a token
        for ps in (1, 64):
            spec = kvmem.KVSpec(
                num_layers=80, num_kv_heads=1, head_dim=576, page_size=ps, dtype=dtype, v_head_dim=0
            )
            pages = (64 * GiB) // spec.page_bytes
            for layout in ("kvmem", "sglang"):
                plan = check_plan(spec, pages, layout, 2 * MiB, CHUNK_BYTES)
                naive = range(CHUNK_BYTES, plan.content, CHUNK_BYTES)
                page = spec.k_page_bytes
                assert any(cut % page for cut in naive)  # the old cut fell inside pages


def test_plan_range_cuts_every_target():
    plan = plan_range(5 * MiB + 3, 2 * MiB, 3 * MiB)  # target rounded up to 4 MiB
    assert [(c.offset, c.nbytes, c.size) for c in plan.chunks] == [
        (0, 4 * MiB, 4 * MiB),
        (4 * MiB, MiB + 3, 2 * MiB),
    ]
    assert plan.nbytes == plan.content == 5 * MiB + 3 and plan.k_offsets == ()
    one = plan_range(100, 4096, None)
    assert [(c.offset, c.nbytes, c.size) for c in one.chunks] == [(0, 100, 4096)]
    with pytest.raises(
        OverflowError,
        match=r"2097152 would be 4398046511104 chunks, more "
        r"than 1048576",
    ):
        plan_range(2**63 - 1, 2 * MiB, 1)  # refused before any chunk is listed


@pytest.mark.parametrize("bad", [0, 3, -4096, 1.5, True])
def test_bad_granularity_is_refused(bad):
    spec = kvmem.KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, page_size=1)
    with pytest.raises(ValueError, match="granularity must be a power of two"):
        plan_pool(spec, 4, "kvmem", bad, None)
    with pytest.raises(ValueError, match="target must be None or an int > 0"):
        plan_pool(spec, 4, "kvmem", 512, 0)
    with pytest.raises(ValueError, match="unknown KVPool layout"):
        plan_pool(spec, 4, "vllm", 512, None)


def test_chunk_target_argument_then_environment_then_default(monkeypatch):
    monkeypatch.delenv(CHUNK_ENV, raising=False)
    assert chunk_target() == CHUNK_BYTES == 2 * GiB
    monkeypatch.setenv(CHUNK_ENV, "1048576")
    assert chunk_target() == MiB and chunk_target(4096) == 4096
    monkeypatch.setenv(CHUNK_ENV, "0x200000")
    assert chunk_target() == 2 * MiB
    for bad in ("0", "-1", "2G", "x"):
        monkeypatch.setenv(CHUNK_ENV, bad)
        with pytest.raises(ValueError, match=rf"KVMEM_CHUNK_BYTES={bad!r}: must be a number"):
            chunk_target()
    for bad in (0, -1, 1.0, True):
        with pytest.raises(ValueError, match="chunk_bytes must be an int > 0"):
            chunk_target(bad)
