"""On a CUDA device (bench/gpu_check.sh): the adapter's staging gather/scatter
(``kvmem_sglang.staging``, on kvmem's Triton pack/unpack) against sglang 0.5.23's own
Triton staging kernels (``_gather_all_layers_triton`` / ``_scatter_staging_to_kv_triton``)
on a real ``StagingBuffer``: byte for byte, then bandwidth side by side.

Skipped, with one plain line, where sglang (or the adapter package) does not import: the
H200 image has no sglang.  The CPU counterpart, against sglang's torch path, is
tests/sglang/test_adapter_staging.py.

Bandwidth: GB/s = bytes of the staging chunk (10^9 bytes) / median seconds of one call,
each call ending in a device sync (sglang's gather synchronises its gather stream; the
scatter is followed by ``torch.cuda.synchronize()``), so both sides pay the same launch
and sync overhead.  Printed, and written to ``$KVMEM_GPU_OUT/sglang_staging.json`` when
``KVMEM_GPU_OUT`` names a directory.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

try:
    from sglang.srt.disaggregation.common.staging_buffer import (
        StagingBuffer,
        _gather_all_layers_triton,
        _scatter_staging_to_kv_triton,
        compute_head_slice_params,
    )
except Exception:  # noqa: BLE001 - any import failure means: not comparable here
    pytest.skip(
        "sglang is not importable on this host: staging comparison not run", allow_module_level=True
    )

_ADAPTER = Path(__file__).resolve().parents[2] / "integration" / "sglang"
try:
    from kvmem_sglang import staging
except ImportError:  # not installed: the repository's own copy
    sys.path.insert(0, str(_ADAPTER))
    try:
        from kvmem_sglang import staging
    except Exception:  # noqa: BLE001
        pytest.skip(
            "kvmem_sglang is not importable on this host: staging comparison not run",
            allow_module_level=True,
        )

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available: staging comparison not run", allow_module_level=True)

DEV = torch.device("cuda", 0)
SENTINEL = 0xA5
# sglang stores fp8 KV as uint8
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}

# (prefill TP, decode TP, total KV heads, decode rank): prefill TP above and below decode's
TPS = {
    "P4D1": (4, 1, 8, 0),
    "P4D2": (4, 2, 8, 1),
    "P2D2": (2, 2, 8, 1),
    "P1D2": (1, 2, 4, 1),
    "P2D4": (2, 4, 8, 3),
}
# Every page size, dtype, TP pair and head dim appears; not their product: each new shape
# compiles both sides' kernels, and gpu_check.sh has minutes, not hours.
CASES = [
    (1, "bf16", "P4D1", 128),
    (16, "bf16", "P4D2", 128),
    (16, "fp16", "P2D4", 128),
    (16, "fp8", "P1D2", 64),
    (64, "bf16", "P2D2", 128),
    (64, "fp16", "P4D1", 64),
    (1, "fp8", "P2D4", 64),
    (16, "fp8", "P4D1", 128),
    (64, "bf16", "P1D2", 128),
    (1, "fp16", "P2D2", 128),
    (16, "bf16", "P4D1", 64),
]
CASE_IDS = [f"P{ps}-D{hd}-{dt}-{tp}" for ps, dt, tp, hd in CASES]
LAYERS, NUM_PAGES = 4, 37  # odd page count; page 0 is padding


def staging_buffer(nbytes: int) -> StagingBuffer:
    sb = StagingBuffer(nbytes, "cuda", 0)
    sb.buffer.fill_(SENTINEL)
    return sb


def random_bytes(shape, dtype, gen) -> torch.Tensor:
    """Random bytes as ``dtype``, made on the device with the CUDA generator ``gen``
    (NaN payloads included: both sides copy bytes through integer views)."""
    item = torch.empty(0, dtype=dtype).element_size()
    n = int(np.prod(shape)) * item
    raw = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8, device=DEV)
    return raw.view(dtype).view(shape)


def sentinel_buffers(rows, heads, head_dim, dtype, layers) -> list[torch.Tensor]:
    item = torch.empty(0, dtype=dtype).element_size()
    return [
        torch.full((rows, heads, head_dim * item), SENTINEL, dtype=torch.uint8, device=DEV).view(
            dtype
        )
        for _ in range(layers)
    ]


def writers(prefill, decode, total, dst_rank):
    """(prefill rank, src_head_start, num_heads) of each writer of ``dst_rank``, in the
    order of their chunks in its staging view."""
    src_h, dst_h = max(1, total // prefill), max(1, total // decode)
    if prefill > decode:
        n = prefill // decode
        ranks = [dst_rank * n + w for w in range(n)]
    else:
        ranks = [(dst_rank // max(1, decode // total)) * dst_h // src_h]
    return [(r, *compute_head_slice_params(prefill, decode, r, dst_rank, total)[:2]) for r in ranks]


@pytest.mark.parametrize("page_size,dtype,tp,head_dim", CASES, ids=CASE_IDS)
def test_staging_matches_sglang_triton_byte_for_byte(page_size, dtype, tp, head_dim):
    prefill, decode, total, dst_rank = TPS[tp]
    seed = sum(map(ord, f"{page_size}{dtype}{tp}{head_dim}"))
    gen, dgen = torch.Generator().manual_seed(seed), torch.Generator(DEV).manual_seed(seed)
    dt = DTYPES[dtype]
    rows = NUM_PAGES * page_size
    src_h, dst_h = max(1, total // prefill), max(1, total // decode)
    perm = torch.randperm(NUM_PAGES - 1, generator=gen) + 1
    src_pages = perm[:11].numpy()  # unsorted, no padding page
    dst_ids = (torch.randperm(NUM_PAGES - 1, generator=gen) + 1)[:11].to(DEV)

    chunks = []
    for rank, src_head_start, num_heads in writers(prefill, decode, total, dst_rank):
        ks = [random_bytes((rows, src_h, head_dim), dt, dgen) for _ in range(LAYERS)]
        vs = [random_bytes((rows, src_h, head_dim), dt, dgen) for _ in range(LAYERS)]
        tokens = len(src_pages) * page_size
        nbytes = 2 * LAYERS * tokens * num_heads * head_dim * ks[0].element_size()
        theirs, ours = staging_buffer(nbytes + 4096), staging_buffer(nbytes + 4096)
        n_theirs = _gather_all_layers_triton(
            ks, vs, src_pages, theirs, src_head_start, num_heads, page_size
        )
        n_ours = staging.gather_all_layers_to_staging(
            ks, vs, src_pages, ours, src_head_start, num_heads, page_size
        )
        assert n_ours == n_theirs == nbytes
        assert torch.equal(ours.buffer, theirs.buffer), (
            f"gather of prefill rank {rank} differs from sglang's Triton kernel"
        )
        chunks.append(ours.buffer[:nbytes].clone())
    view = torch.cat(chunks)

    args = (page_size, prefill, decode, dst_rank, total)
    theirs_k = sentinel_buffers(rows, dst_h, head_dim, dt, LAYERS)
    theirs_v = sentinel_buffers(rows, dst_h, head_dim, dt, LAYERS)
    ours_k = sentinel_buffers(rows, dst_h, head_dim, dt, LAYERS)
    ours_v = sentinel_buffers(rows, dst_h, head_dim, dt, LAYERS)
    _scatter_staging_to_kv_triton(view, theirs_k, theirs_v, dst_ids, *args)
    staging.scatter_staging_to_kv(view, ours_k, ours_v, dst_ids, *args)
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        for name, a, b in (("K", ours_k, theirs_k), ("V", ours_v, theirs_v)):
            assert torch.equal(a[layer].view(torch.uint8), b[layer].view(torch.uint8)), (
                f"scatter differs from sglang's Triton kernel in layer {layer} {name}"
            )
    touched = torch.zeros(rows, dtype=torch.bool, device=DEV)
    touched[(dst_ids[:, None] * page_size + torch.arange(page_size, device=DEV)).reshape(-1)] = True
    for buf in ours_k + ours_v:  # unlisted pages untouched
        assert (buf[~touched].view(torch.uint8) == SENTINEL).all()


# -- bandwidth, side by side ---------------------------------------------------------------

BW_LAYERS, BW_HEADS, BW_DIM, BW_PS, BW_POOL_PAGES = 32, 8, 128, 16, 2049
BW_SIZES = (32, 256, 1024)  # pages per call: 32 MiB, 256 MiB, 1 GiB of staging chunk
BW_ITERS = 15


def _median_s(fn) -> float:
    fn()  # warm-up: compiles the kernels for these shapes
    times = []
    for _ in range(BW_ITERS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def test_staging_bandwidth_side_by_side():
    """Llama-8B-like KV (32 layers, 8 KV heads, head_dim 128, bf16, page_size 16);
    prefill TP 2 -> decode TP 1: each prefill rank gathers its 4 heads (kvmem vs
    sglang), the decode rank scatters two writers' chunks into its 8 heads."""
    gen, dgen = torch.Generator().manual_seed(7), torch.Generator(DEV).manual_seed(7)
    rows = BW_POOL_PAGES * BW_PS
    half = BW_HEADS // 2
    src_k = [random_bytes((rows, half, BW_DIM), torch.bfloat16, dgen) for _ in range(BW_LAYERS)]
    src_v = [random_bytes((rows, half, BW_DIM), torch.bfloat16, dgen) for _ in range(BW_LAYERS)]
    dst_k = sentinel_buffers(rows, BW_HEADS, BW_DIM, torch.bfloat16, BW_LAYERS)
    dst_v = sentinel_buffers(rows, BW_HEADS, BW_DIM, torch.bfloat16, BW_LAYERS)
    chunk_max = 2 * BW_LAYERS * max(BW_SIZES) * BW_PS * half * BW_DIM * 2
    sb = StagingBuffer(2 * chunk_max, "cuda", 0)
    results = []
    for n in BW_SIZES:
        pages = (torch.randperm(BW_POOL_PAGES - 1, generator=gen) + 1)[:n]
        src_np, dst_ids = pages.numpy(), pages.flip(0).contiguous().to(DEV)
        chunk = 2 * BW_LAYERS * n * BW_PS * half * BW_DIM * 2
        gather = {
            "kvmem": lambda: staging.gather_all_layers_to_staging(
                src_k, src_v, src_np, sb, 0, half, BW_PS
            ),
            "sglang": lambda: _gather_all_layers_triton(src_k, src_v, src_np, sb, 0, half, BW_PS),
        }
        view = sb.buffer[: 2 * chunk]

        def scatter(fn):
            def run():
                fn(view, dst_k, dst_v, dst_ids, BW_PS, 2, 1, 0, BW_HEADS)
                torch.cuda.synchronize()

            return run

        scatters = {
            "kvmem": scatter(staging.scatter_staging_to_kv),
            "sglang": scatter(_scatter_staging_to_kv_triton),
        }
        for op, fns, nbytes in (("gather", gather, chunk), ("scatter", scatters, 2 * chunk)):
            secs = {who: _median_s(fn) for who, fn in fns.items()}
            row = {
                "op": op,
                "pages": n,
                "bytes": nbytes,
                "kvmem_gbps": nbytes / secs["kvmem"] / 1e9,
                "sglang_gbps": nbytes / secs["sglang"] / 1e9,
            }
            row["kvmem_over_sglang"] = row["kvmem_gbps"] / row["sglang_gbps"]
            results.append(row)
            print(
                f"staging {op:7s} {n:5d} pages {nbytes / 2**20:8.1f} MiB: kvmem "
                f"{row['kvmem_gbps']:8.1f} GB/s, sglang {row['sglang_gbps']:8.1f} GB/s, "
                f"ratio {row['kvmem_over_sglang']:.2f}"
            )
    out_dir = os.environ.get("KVMEM_GPU_OUT")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        report = {
            "device": torch.cuda.get_device_name(DEV),
            "torch": torch.__version__,
            "shape": {
                "layers": BW_LAYERS,
                "kv_heads": BW_HEADS,
                "head_dim": BW_DIM,
                "page_size": BW_PS,
                "dtype": "bf16",
                "prefill_tp": 2,
                "decode_tp": 1,
            },
            "gbps": "10^9 bytes of staging chunk per second, median of "
            f"{BW_ITERS} synchronised calls",
            "results": results,
        }
        (Path(out_dir) / "sglang_staging.json").write_text(json.dumps(report, indent=2))
    assert all(r["kvmem_gbps"] > 0 and r["sglang_gbps"] > 0 for r in results)
