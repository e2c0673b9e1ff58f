"""pack/unpack of one request's pages of a 32-layer, 8-head, 128-dim bf16 model, against
(a) per-layer ``index_select`` + ``cat`` (what a straightforward gather does) and
(b) a plain ``copy_`` of the same number of bytes into a preallocated buffer (the
bandwidth ceiling), for page_size 1, 16 and 64.

Targets (issue 2): CPU: pack and unpack >= 0.5x the plain-copy bandwidth at page_size >= 16,
>= 3x faster than index_select at page_size 1.  GPU: >= 85% of device-to-device copy
bandwidth for chunks of 1 MiB and more.

Chunk sizes: ``KVMEM_BENCH_TOKENS``, tokens per chunk, comma-separated (CPU 64,256,1024 =
8, 32, 128 MiB; CUDA 8,128,1024,4096 = 1 to 512 MiB).  Every row carries ``op``,
``page_size``, ``tokens`` and ``role`` (kvmem / baseline / ceiling) for bench/plot.py."""

from __future__ import annotations

import os

import pytest
import torch

import kvmem
from bench.conftest import bench_device, pick, rounds, sync, warmups

DEV = bench_device()
LAYERS, HEADS, DIM = pick(32, 2), 8, 128  # smoke: 2 layers
# Tokens per chunk (32 KiB each at 32 layers): 1024 tokens is a 128 MiB chunk, well past
# any CPU cache and enough to run past launch overheads on a GPU.
_DEFAULT_TOKENS = "8,128,1024,4096" if DEV.type == "cuda" else "64,256,1024"
CHUNK_TOKENS = pick([int(x) for x in os.environ.get("KVMEM_BENCH_TOKENS",
                                                    _DEFAULT_TOKENS).split(",")], [64])
ROUNDS = rounds("KVMEM_BENCH_ROUNDS", 7)
CASES = [(ps, tokens) for tokens in CHUNK_TOKENS for ps in (1, 16, 64)]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"P{c[0]}-T{c[1]}")
def setup(request):
    ps, tokens = request.param
    spec = kvmem.KVSpec(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, page_size=ps,
                        dtype=torch.bfloat16)
    pool = kvmem.KVPool(spec, num_pages=4 * tokens // ps + 1, device=DEV)
    gen = torch.Generator().manual_seed(0)
    pool._mem.tensor.copy_(torch.randint(0, 256, (pool.nbytes,), dtype=torch.uint8,
                                         generator=gen).to(DEV))
    n = tokens // ps
    ids = (torch.randperm(pool.num_pages - 1, generator=gen)[:n] + 1).to(DEV)
    nbytes = kvmem.packed_nbytes(spec, n)
    out = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    src.copy_(out.random_(0, 256))
    token_idx = (ids[:, None] * ps + torch.arange(ps, device=DEV)).reshape(-1)
    yield dict(ps=ps, pool=pool, ids=ids, nbytes=nbytes, out=out, src=src, token_idx=token_idx,
               tokens=tokens)
    del pool, out, src  # one case's buffers at a time


def _add(report, setup, op: str, name: str, role: str, benchmark) -> None:
    group = f"{op} P{setup['ps']}, {setup['nbytes'] / 2**20:g} MiB chunk"
    report.add(group, name, benchmark, setup["nbytes"], figure="pack", op=op,
               page_size=setup["ps"], tokens=setup["tokens"], role=role)


def _run(benchmark, fn, dev):
    done = sync(dev)

    def call():
        fn()
        done()

    call()  # warm-up (kernel compilation, page faults of fresh buffers)
    benchmark.pedantic(call, rounds=ROUNDS, iterations=1, warmup_rounds=warmups(1))


def test_pack_kvmem(benchmark, setup, report):
    pool, ids, out = setup["pool"], setup["ids"], setup["out"]
    _run(benchmark, lambda: kvmem.pack_pages(pool, ids, out=out, check=False), DEV)
    _add(report, setup, "pack", "kvmem.pack_pages", "kvmem", benchmark)


def test_pack_index_select_cat(benchmark, setup, report):
    pool, tok = setup["pool"], setup["token_idx"]

    def gather():
        parts = [b.view(-1, HEADS, DIM).index_select(0, tok) for b in pool.k_buffer + pool.v_buffer]
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
    per_layer = buf.numel() // (2 * LAYERS)

    def scatter():
        for i, b in enumerate(pool.k_buffer + pool.v_buffer):
            part = buf[i * per_layer:(i + 1) * per_layer].view(torch.bfloat16).view(-1, HEADS, DIM)
            b.view(-1, HEADS, DIM).index_copy_(0, tok, part)

    _run(benchmark, scatter, DEV)
    _add(report, setup, "unpack", "per-layer index_copy_", "baseline", benchmark)


@pytest.mark.parametrize("direction", ["pack", "unpack"])
def test_plain_copy(benchmark, setup, report, direction):
    """The ceiling, in each direction's group: a copy_ of the chunk's bytes."""
    out, src = setup["out"], setup["src"]
    _run(benchmark, lambda: out.copy_(src), DEV)
    _add(report, setup, direction, "plain copy_ of the same bytes (ceiling)", "ceiling",
         benchmark)
