"""The adapter's staging gather/scatter (``kvmem_sglang.staging``, on kvmem's
pack/unpack) against sglang 0.5.23's own torch staging path, byte for byte, on CPU.

sglang's ``StagingBuffer`` refuses CPU devices, but its torch path
(``_gather_all_layers_torch`` / ``_scatter_staging_to_kv_torch``) runs on CPU tensors
given a ``StagingBuffer`` made with ``object.__new__`` and the attributes that path reads
(``buffer``, ``device``, ``device_module``, a gather stream).  torch's CPU stream stub
lacks the ``device`` and ``synchronize`` a device stream has; :class:`CpuStream` adds
them (CPU ops are complete when they return).  The GPU comparison against sglang's
Triton kernels is tests/gpu/test_gpu_sglang_staging.py.

Heterogeneous TP, as sglang's PD transfer does it: prefill rank ``r`` holds the KV heads
``[r * H_src, (r + 1) * H_src)`` of one global tensor (replicated ranks hold the same
heads); each writer rank gathers the head slice that ``compute_head_slice_params`` names
into its staging chunk; the decode rank's staging view is the writers' chunks in writer
order, scattered into its own pages.  Page lists differ on the two sides, are unsorted,
and the destination starts filled with a sentinel, so a byte written to an unlisted page,
head or layer shows.  Case ids: ``P<page_size>-<dtype>-P<prefill TP>D<decode TP>``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from sglang.srt.disaggregation.common.staging_buffer import (
    StagingBuffer,
    _gather_all_layers_torch,
    _scatter_staging_to_kv_torch,
    compute_head_slice_params,
)

from kvmem_sglang import staging

LAYERS, HEAD_DIM, NUM_PAGES = 3, 64, 13  # pages 0..12 per rank; page 0 is padding
SENTINEL = 0xA5
# sglang stores fp8 KV as uint8
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}
SRC_PAGES = [7, 2, 11, 5, 9]  # the prefill side's pages, in transfer order
DST_PAGES = [4, 12, 1, 8, 3]  # the decode side's pages, the same order


@dataclass(frozen=True)
class Tp:
    prefill: int
    decode: int
    total_heads: int
    dst_rank: int
    note: str = ""

    @property
    def id(self) -> str:
        return f"P{self.prefill}D{self.decode}{self.note}"

    @property
    def src_heads(self) -> int:  # heads per prefill rank
        return max(1, self.total_heads // self.prefill)

    @property
    def dst_heads(self) -> int:
        return max(1, self.total_heads // self.decode)


TPS = [
    Tp(4, 1, 8, 0),  # 4 writers, 2 heads each, into one 8-head rank
    Tp(4, 2, 8, 1),  # writers are prefill ranks 2 and 3
    Tp(4, 1, 2, 0, "-kv2"),  # 2 KV heads over 4 prefill ranks: replicated writers
    Tp(2, 2, 8, 1),  # equal TP: one writer, every head
    Tp(1, 2, 4, 1),  # head slice [2, 4) of the only prefill rank
    Tp(2, 4, 8, 3),  # head slice [2, 4) of prefill rank 1
]
CASES = [(ps, dt, tp) for ps in (1, 16) for dt in DTYPES for tp in TPS]
CASE_IDS = [f"P{ps}-{dt}-{tp.id}" for ps, dt, tp in CASES]


class CpuStream(torch.cpu.Stream):
    """torch's CPU stream stub with the two members a device stream has."""

    device = torch.device("cpu")

    def synchronize(self) -> None:  # CPU work is done when the call returns
        pass


def cpu_staging_buffer(nbytes: int) -> StagingBuffer:
    sb = object.__new__(StagingBuffer)
    sb.size_bytes = nbytes
    sb.device, sb.gpu_id = torch.device("cpu"), 0
    sb.device_module = torch.get_device_module(sb.device)
    sb.buffer = torch.full((nbytes,), SENTINEL, dtype=torch.uint8)
    sb.data_ptr = sb.buffer.data_ptr()
    sb._gather_stream = CpuStream()
    return sb


def random_values(shape, dtype, gen) -> torch.Tensor:
    """Random bytes as ``dtype``; NaNs of float types replaced by a finite value.

    sglang's torch gather copies a head slice (a strided source) through
    ``torch.gather``, which on CPU rewrites a bf16/fp16 NaN's payload to the canonical
    NaN (kvmem copies bytes); KV caches hold no NaNs, so the comparison uses none."""
    item = torch.empty(0, dtype=dtype).element_size()
    n = int(np.prod(shape)) * item
    t = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8).view(dtype).view(shape)
    if dtype.is_floating_point:
        t[t.isnan()] = 1.5
    return t


def sentinel_buffers(rows, heads, dtype) -> list[torch.Tensor]:
    return [
        torch.full(
            (rows, heads, HEAD_DIM * torch.empty(0, dtype=dtype).element_size()),
            SENTINEL,
            dtype=torch.uint8,
        ).view(dtype)
        for _ in range(LAYERS)
    ]


def as_bytes(bufs) -> list[torch.Tensor]:
    return [b.view(torch.uint8) for b in bufs]


def writers(tp: Tp) -> list[tuple[int, int, int, int]]:
    """(prefill rank, src_head_start, num_heads, dst_head_start) of each writer of the
    decode rank, in writer order (the order of their chunks in its staging view)."""
    out = []
    if tp.prefill > tp.decode:
        n = tp.prefill // tp.decode
        for w in range(n):
            rank = tp.dst_rank * n + w
            s, h, d, _ = compute_head_slice_params(
                tp.prefill, tp.decode, rank, tp.dst_rank, tp.total_heads
            )
            out.append((rank, s, h, d))
    else:
        replication = max(1, tp.decode // tp.total_heads)
        first_head = (tp.dst_rank // replication) * tp.dst_heads  # global head index
        rank = first_head // tp.src_heads
        s, h, d, _ = compute_head_slice_params(
            tp.prefill, tp.decode, rank, tp.dst_rank, tp.total_heads
        )
        out.append((rank, s, h, d))
    return out


def prefill_rank_buffers(global_k, global_v, tp: Tp, rank: int):
    """What prefill rank ``rank`` holds: its heads of every layer, contiguous."""
    replication = max(1, tp.prefill // tp.total_heads)
    h0 = (rank // replication) * tp.src_heads
    return (
        [k[:, h0 : h0 + tp.src_heads].contiguous() for k in global_k],
        [v[:, h0 : h0 + tp.src_heads].contiguous() for v in global_v],
    )


@pytest.mark.parametrize("page_size,dtype,tp", CASES, ids=CASE_IDS)
def test_gather_then_scatter_matches_sglang_byte_for_byte(page_size, dtype, tp):
    gen = torch.Generator().manual_seed(sum(map(ord, f"{page_size}{dtype}{tp.id}")))
    dt = DTYPES[dtype]
    rows = NUM_PAGES * page_size
    global_k = [random_values((rows, tp.total_heads, HEAD_DIM), dt, gen) for _ in range(LAYERS)]
    global_v = [random_values((rows, tp.total_heads, HEAD_DIM), dt, gen) for _ in range(LAYERS)]
    src_pages = np.array(SRC_PAGES, dtype=np.int64)

    # prefill: each writer gathers its head slice, sglang's torch path and kvmem's
    chunks = []
    for rank, src_head_start, num_heads, _ in writers(tp):
        ks, vs = prefill_rank_buffers(global_k, global_v, tp, rank)
        tokens = len(SRC_PAGES) * page_size
        want_len = 2 * LAYERS * tokens * num_heads * HEAD_DIM * ks[0].element_size()
        theirs, ours = cpu_staging_buffer(want_len + 64), cpu_staging_buffer(want_len + 64)
        n_theirs = _gather_all_layers_torch(
            ks, vs, src_pages, theirs, src_head_start, num_heads, page_size
        )
        n_ours = staging.gather_all_layers_to_staging(
            ks, vs, src_pages, ours, src_head_start, num_heads, page_size
        )
        assert n_ours == n_theirs == want_len
        assert torch.equal(ours.buffer, theirs.buffer), (
            f"gather of prefill rank {rank} (heads [{src_head_start}, "
            f"{src_head_start + num_heads})) differs from sglang's"
        )
        assert (ours.buffer[want_len:] == SENTINEL).all()  # nothing past the chunk
        chunks.append(ours.buffer[:want_len])
    view = torch.cat(chunks + [torch.full((32,), SENTINEL, dtype=torch.uint8)])

    # decode: scatter the writers' chunks into this rank's pages
    dst_ids = torch.tensor(DST_PAGES, dtype=torch.int64)
    theirs_k, theirs_v, ours_k, ours_v = (
        sentinel_buffers(rows, tp.dst_heads, dt) for _ in range(4)
    )
    args = (page_size, tp.prefill, tp.decode, tp.dst_rank, tp.total_heads)
    _scatter_staging_to_kv_torch(view.clone(), theirs_k, theirs_v, dst_ids, *args)
    staging.scatter_staging_to_kv(view.clone(), ours_k, ours_v, dst_ids, *args)
    for layer in range(LAYERS):
        for name, a, b in (("K", ours_k, theirs_k), ("V", ours_v, theirs_v)):
            assert torch.equal(a[layer].view(torch.uint8), b[layer].view(torch.uint8)), (
                f"scatter differs from sglang's in layer {layer} {name}"
            )

    # physically: the decode rank's heads of the listed tokens are the global tensor's,
    # every other byte is still the sentinel
    replication = max(1, tp.decode // tp.total_heads)
    g0 = (tp.dst_rank // replication) * tp.dst_heads

    def tokens_of(pages):
        return (torch.tensor(pages)[:, None] * page_size + torch.arange(page_size)).reshape(-1)

    src_tok, dst_tok = tokens_of(SRC_PAGES), tokens_of(DST_PAGES)
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[dst_tok] = False
    for layer in range(LAYERS):
        for got, glob in ((ours_k[layer], global_k[layer]), (ours_v[layer], global_v[layer])):
            want = glob[src_tok, g0 : g0 + tp.dst_heads]
            assert torch.equal(got[dst_tok].view(torch.uint8), want.view(torch.uint8))
            assert (got[untouched].view(torch.uint8) == SENTINEL).all()


def test_gather_refuses_a_staging_buffer_too_small():
    ks = [torch.zeros(16 * 4, 2, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2)]
    sb = cpu_staging_buffer(1000)
    with pytest.raises(ValueError, match="needs 32768 bytes, the staging buffer holds 1000"):
        staging.gather_all_layers_to_staging(ks, ks, np.array([1, 2]), sb, 0, 2, 16)
    assert (sb.buffer == SENTINEL).all()
