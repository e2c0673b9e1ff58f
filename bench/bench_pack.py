"""pack/unpack of one request's pages, against (a) per-layer ``index_select`` + ``cat``
(what a straightforward gather does) and (b) a plain ``copy_`` of the same number of
bytes into a preallocated buffer (the bandwidth ceiling), at page_size 1, 16 and 64, for
two models (:data:`MODELS`):

    gqa-bf16   32 layers x 8 KV heads x 128, K and V, bf16: 128 KiB a token
    mla-fp8    61 layers x 1 head x 576, K only (MLA's latent + rope), fp8 stored as
               uint8 (DeepSeek-V3's cache): 34.3 KiB a token, 576 bytes a row

Targets: CPU: pack and unpack >= 0.5x the plain-copy bandwidth at page_size >=
16, >= 3x faster than index_select at page_size 1.  GPU: >= 85% of device-to-device copy
bandwidth for chunks of 1 MiB and more (gqa-bf16).  mla-fp8 on the GPU >= 90%
of the copy at page_size >= 16; at page_size 1 each kernel program moves one 576-byte row
(no target: the figure is reported).  bench/gpu_summary.py prints each against its target.

Chunk sizes: ``KVMEM_BENCH_TOKENS`` (gqa-bf16) and ``KVMEM_BENCH_TOKENS_MLA`` (mla-fp8),
tokens per chunk, comma-separated; a page size runs the token counts that are whole
pages of it (:func:`cases`; 8 tokens is 1 MiB of gqa-bf16, page size 1 only).  Defaults:
CUDA gqa-bf16 8,128,1024,4096 (1 to 512 MiB), mla-fp8 1024,4096 (34 and 137 MiB); CPU
64,256,1024 (8 to 128 MiB) and 256,1024.  Every row carries ``op``, ``model``,
``page_size``, ``tokens`` and ``role`` (kvmem / baseline / ceiling) for bench/plot.py.

Pools are filled on their own device (:func:`make_case`): no host tensor of a pool's size
and no host-to-device copy (on the GPU the pools of one run add up to about 8 GiB)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

import kvmem
from bench.conftest import bench_device, pick, rounds, sync, warmups

DEV = bench_device()
PAGE_SIZES = (1, 16, 64)


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    heads: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype

    def spec(self, page_size: int) -> kvmem.KVSpec:
        return kvmem.KVSpec(
            num_layers=self.layers,
            num_kv_heads=self.heads,
            head_dim=self.head_dim,
            v_head_dim=self.v_head_dim,
            page_size=page_size,
            dtype=self.dtype,
        )


GQA = Model("gqa-bf16", pick(32, 2), 8, 128, 128, torch.bfloat16)  # smoke: 2 layers
MLA = Model("mla-fp8", pick(61, 2), 1, 576, 0, torch.float8_e4m3fn)
MODELS = (GQA, MLA)
_TOKENS = {  # (CUDA, CPU) defaults, per model
    GQA.name: ("KVMEM_BENCH_TOKENS", "8,128,1024,4096", "64,256,1024"),
    MLA.name: ("KVMEM_BENCH_TOKENS_MLA", "1024,4096", "256,1024"),
}
ROUNDS = rounds("KVMEM_BENCH_ROUNDS", 7)


def cases(tokens: list[int], page_sizes=PAGE_SIZES) -> list[tuple[int, int]]:
    """``(page_size, tokens)`` for each token count that is a whole number of pages of
    that page size (a chunk of whole pages; 8 tokens at page size 16 would be 0 pages).

    Raises:
        ValueError: a count that is not > 0, or a page size left without any count."""
    if not tokens or any(t <= 0 for t in tokens):
        raise ValueError(f"token counts must be > 0, got {tokens}")
    out = [(ps, t) for t in tokens for ps in page_sizes if t % ps == 0]
    empty = [ps for ps in page_sizes if not any(p == ps for p, _ in out)]
    if empty:
        raise ValueError(
            f"page size(s) {empty} get no chunk from token counts {tokens}: "
            "give at least one multiple of each"
        )
    return out


def _tokens(model: Model) -> list[int]:
    env, on_cuda, on_cpu = _TOKENS[model.name]
    default = on_cuda if DEV.type == "cuda" else on_cpu
    return pick([int(x) for x in os.environ.get(env, default).split(",")], [64])


CASES = [(m, ps, t) for m in MODELS for ps, t in cases(_tokens(m))]


def make_case(model: Model, ps: int, tokens: int, device: torch.device, seed: int = 0) -> dict:
    """A pool of four times the chunk's pages (plus page 0) filled with random bytes, the
    chunk's page ids (random, distinct, never page 0), an output chunk, a source of the
    same bytes for the plain copy, and the token rows of the pages for the baselines.
    Everything random is drawn on ``device`` (its own generator), in place."""
    spec = model.spec(ps)
    n = tokens // ps
    if n < 1 or n * ps != tokens:
        raise ValueError(f"{tokens} tokens are not whole pages of {ps}")
    pool = kvmem.KVPool(spec, num_pages=4 * n + 1, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    pool._mem.tensor.random_(0, 256, generator=gen)
    ids = torch.randperm(pool.num_pages - 1, generator=gen, device=device)[:n] + 1
    nbytes = kvmem.packed_nbytes(spec, n)
    out = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256, generator=gen)
    token_idx = (ids[:, None] * ps + torch.arange(ps, device=device)).reshape(-1)
    return dict(
        model=model,
        ps=ps,
        pool=pool,
        ids=ids,
        nbytes=nbytes,
        out=out,
        src=src,
        token_idx=token_idx,
        tokens=tokens,
    )


def _id(case) -> str:
    m, ps, t = case
    return f"{'' if m is GQA else 'mla-'}P{ps}-T{t}"


@pytest.fixture(scope="module", params=CASES, ids=_id)
def setup(request):
    made = make_case(*request.param, DEV)
    sync(DEV)()
    yield made
    del made  # one case's buffers at a time


def _add(report, setup, op: str, name: str, role: str, benchmark) -> None:
    m = setup["model"]
    what = "" if m is GQA else "fp8 MLA "  # gqa-bf16 keeps the groups' old names
    group = f"{op} {what}P{setup['ps']}, {setup['nbytes'] / 2**20:.4g} MiB chunk"
    report.add(
        group,
        name,
        benchmark,
        setup["nbytes"],
        figure="pack",
        op=op,
        model=m.name,
        page_size=setup["ps"],
        tokens=setup["tokens"],
        role=role,
    )


def _run(benchmark, fn, dev):
    done = sync(dev)

    def call():
        fn()
        done()

    call()  # warm-up (kernel compilation, page faults of fresh buffers)
    benchmark.pedantic(call, rounds=ROUNDS, iterations=1, warmup_rounds=warmups(1))


def _rows(setup, buf: torch.Tensor) -> torch.Tensor:
    """A layer buffer as token rows: ``[num_tokens, heads, head_dim]``."""
    m = setup["model"]
    return buf.view(-1, m.heads, buf.shape[-1])


def test_pack_kvmem(benchmark, setup, report):
    pool, ids, out = setup["pool"], setup["ids"], setup["out"]
    _run(benchmark, lambda: kvmem.pack_pages(pool, ids, out=out, check=False), DEV)
    _add(report, setup, "pack", "kvmem.pack_pages", "kvmem", benchmark)


def test_pack_index_select_cat(benchmark, setup, report):
    pool, tok = setup["pool"], setup["token_idx"]

    def gather():
        parts = [_rows(setup, b).index_select(0, tok) for b in pool.k_buffer + pool.v_buffer]
        return torch.cat(parts).view(-1).view(torch.uint8)

    assert torch.equal(gather(), kvmem.pack_pages(pool, setup["ids"]))
    _run(benchmark, gather, DEV)
    _add(report, setup, "pack", "per-layer index_select + cat", "baseline", benchmark)


def test_unpack_kvmem(benchmark, setup, report):
    pool, ids = setup["pool"], setup["ids"]
    buf = kvmem.pack_pages(pool, ids)
    _run(benchmark, lambda: kvmem.unpack_pages(buf, pool, ids, check=False), DEV)
    assert torch.equal(kvmem.pack_pages(pool, ids), buf)
    _add(report, setup, "unpack", "kvmem.unpack_pages", "kvmem", benchmark)


def test_unpack_index_copy(benchmark, setup, report):
    pool, tok, ids = setup["pool"], setup["token_idx"], setup["ids"]
    buf = kvmem.pack_pages(pool, ids)
    layers = pool.k_buffer + pool.v_buffer
    per_layer = buf.numel() // len(layers)
    pairs = []  # (the layer's token rows, its part of the chunk as rows of the same shape)
    for i, b in enumerate(layers):
        rows = _rows(setup, b)
        part = buf[i * per_layer : (i + 1) * per_layer].view(b.dtype).view(-1, *rows.shape[1:])
        pairs.append((rows, part))

    def scatter():
        for rows, part in pairs:
            rows.index_copy_(0, tok, part)

    _run(benchmark, scatter, DEV)
    _add(report, setup, "unpack", "per-layer index_copy_", "baseline", benchmark)


@pytest.mark.parametrize("direction", ["pack", "unpack"])
def test_plain_copy(benchmark, setup, report, direction):
    """The ceiling, in each direction's group: a copy_ of the chunk's bytes."""
    out, src = setup["out"], setup["src"]
    _run(benchmark, lambda: out.copy_(src), DEV)
    _add(report, setup, direction, "plain copy_ of the same bytes (ceiling)", "ceiling", benchmark)
