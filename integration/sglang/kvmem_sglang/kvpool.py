"""sglang's KV buffers as views of one :class:`kvmem.KVPool`, and what follows from it:
release/resume through kvmem, and transfer registrations of the pool's few regions.

sglang's layouts, per layer (``rows = size + page_size``: slot 0's page is padding)::

    MHATokenToKVPool.k_buffer[l] : [rows, head_num, head_dim]       store_dtype
    MHATokenToKVPool.v_buffer[l] : [rows, head_num, v_head_dim]     V right after K
    MLATokenToKVPool.kv_buffer[l]: [rows, 1, kv_lora_rank + qk_rope_head_dim]

Stock sglang puts an MHA layer's K and V in the two halves of one allocation, so that
paged kernels reach V from K's base by one block offset; kvmem's ``layout="sglang"``
keeps exactly that: ``v_buffer[l].data_ptr() == k_buffer[l].data_ptr() + num_pages *
page_size * head_num * head_dim * itemsize``.  Here each view is a kvmem page buffer
``[num_pages, page_size, H, D]`` flattened to sglang's ``[rows, H, D]``.

Pools are refused, with an :class:`AdapterError` naming the reason, where kvmem would
place them differently from what sglang's kernels expect: another pool class (quantized,
FP4, MXFP8, page-major, no-op, sharded), HND or vectorized_5d layouts, post-capture VA
backing, a custom CUDA memory pool, a dtype kvmem does not store.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

import kvmem
from kvmem_sglang import state
from kvmem_sglang.options import AdapterError, Options

logger = logging.getLogger("kvmem.sglang")


def live_pools() -> list[kvmem.KVPool]:
    """Every pool this process made for sglang that is still alive."""
    return state.PROCESS.pools.live()


def pool_of(kvcache) -> kvmem.KVPool | None:
    """The kvmem pool behind an sglang KV cache, or None when the cache is stock."""
    return state.POOL.get(kvcache)


def _spec(kind: str, *, layers, heads, head_dim, v_head_dim, page_size, dtype) -> kvmem.KVSpec:
    try:
        return kvmem.KVSpec(
            num_layers=layers,
            num_kv_heads=heads,
            head_dim=head_dim,
            v_head_dim=v_head_dim,
            page_size=page_size,
            dtype=dtype,
        )
    except ValueError as e:
        raise AdapterError(f"kvmem cannot place this {kind} KV cache: {e}") from None


def _make_pool(kind: str, kvcache, spec: kvmem.KVSpec, options: Options) -> kvmem.KVPool:
    rows = kvcache.size + kvcache.page_size
    num_pages = -(-rows // spec.page_size)
    device = torch.device(kvcache.device)
    t0 = time.perf_counter()
    try:
        pool = kvmem.KVPool(spec, num_pages, device, backend=options.backend, layout="sglang")
    except (ValueError, MemoryError, OSError) as e:
        raise AdapterError(
            f"kvmem could not create the {kind} KV pool "
            f"({spec.pool_bytes(num_pages)} bytes on {device}): {e}",
            "lower --mem-fraction-static or --max-total-tokens, or unset "
            "SGLANG_KVMEM to run this server on stock sglang",
        ) from e
    if pool.backend != "host":  # a fresh host mapping reads as zeros already
        for buf in pool.k_buffer + pool.v_buffer:
            buf.zero_()  # sglang's own buffers are torch.zeros
    elif options.prefault:
        # Back every page now, as sglang's torch.zeros buffers are backed when they are
        # made: left to first touch, the faults land in the first forward's writes and
        # in the first KV transfer into this pool (UCX's cma write faults the target's
        # pages inside the copy): docs/sglang.md, "PD transfer speed".
        pool.prefault()
    state.PROCESS.pools.add(pool, kind)
    regions = pool.regions()
    logger.info(
        "kvmem: %s KV pool of %d layers x %d pages x %d tokens, %.3f GiB on %s "
        "(backend %s, %d region(s), layout %s) in %.0f ms; released and resumed by kvmem "
        "on release/resume_memory_occupation(kv_cache)",
        kind,
        spec.num_layers,
        num_pages,
        spec.page_size,
        pool.nbytes / 2**30,
        device,
        pool.backend,
        len(regions),
        "K|V per layer" if spec.has_v else "K only",
        (time.perf_counter() - t0) * 1e3,
    )
    return pool


def _views(bufs: list[torch.Tensor], rows: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """kvmem page buffers ``[num_pages, page_size, H, D]`` as sglang's ``[rows, H, D]``,
    in sglang's store dtype (fp8 caches: kvmem stores uint8, sglang may name the fp8
    type; same itemsize)."""
    out = [b.flatten(0, 1)[:rows] for b in bufs]
    if out and out[0].dtype != dtype:
        out = [b.view(dtype) for b in out]
    return out


def check_mha(kvcache) -> None:
    """Refuse an MHA pool kvmem cannot place (before sglang creates anything)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    cls = type(kvcache).__name__
    if type(kvcache) is not MHATokenToKVPool:
        raise AdapterError(
            f"the KV pool class {cls} is not supported by kvmem (only "
            "MHATokenToKVPool and MLATokenToKVPool are)"
        )
    if kvcache.is_quantized_kv_cache:
        raise AdapterError(
            f"a quantized KV cache ({type(kvcache.quant_method).__name__}) is not placed by kvmem"
        )
    if getattr(kvcache, "post_capture_active", False):
        raise AdapterError(
            "post-capture KV backing is on; kvmem owns the KV memory itself",
            "turn post-capture backing off, or unset SGLANG_KVMEM",
        )
    if getattr(kvcache, "use_hnd", False) or kvcache.kv_cache_layout != "nhd":
        layout = "hnd" if getattr(kvcache, "use_hnd", False) else kvcache.kv_cache_layout
        raise AdapterError(f"the {layout!r} KV layout is not supported by kvmem (NHD only)")
    if getattr(kvcache, "enable_custom_mem_pool", False):
        raise AdapterError(
            "a custom CUDA memory pool is set for the KV cache; kvmem allocates it itself"
        )
    if kvcache.v_head_dim == 0:
        raise AdapterError("an MHA KV cache with v_head_dim 0 is not supported")


def create_mha_buffers(kvcache, options: Options) -> None:
    """What ``MHATokenToKVPool._create_buffers_normal`` does, on a kvmem pool."""
    check_mha(kvcache)
    spec = _spec(
        "MHA",
        layers=kvcache.layer_num,
        heads=kvcache.head_num,
        head_dim=kvcache.head_dim,
        v_head_dim=kvcache.v_head_dim,
        page_size=kvcache.page_size,
        dtype=kvcache.store_dtype,
    )
    pool = _make_pool("MHA", kvcache, spec, options)
    rows = kvcache.size + kvcache.page_size
    kvcache.k_buffer = _views(pool.k_buffer, rows, kvcache.store_dtype)
    kvcache.v_buffer = _views(pool.v_buffer, rows, kvcache.store_dtype)
    state.POOL.set(kvcache, pool)


def create_mla_buffers(kvcache, options: Options) -> None:
    """What ``MLATokenToKVPool._create_buffers`` does, on a kvmem pool (K only:
    ``kv_cache_dim`` wide, one head)."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    if type(kvcache) is not MLATokenToKVPool:
        raise AdapterError(
            f"the KV pool class {type(kvcache).__name__} is not supported "
            "by kvmem (only MHATokenToKVPool and MLATokenToKVPool are)"
        )
    if getattr(kvcache, "custom_mem_pool", None):
        raise AdapterError(
            "a custom CUDA memory pool is set for the KV cache; kvmem allocates it itself"
        )
    spec = _spec(
        "MLA",
        layers=kvcache.layer_num,
        heads=1,
        head_dim=kvcache.kv_cache_dim,
        v_head_dim=0,
        page_size=kvcache.page_size,
        dtype=kvcache.store_dtype,
    )
    pool = _make_pool("MLA", kvcache, spec, options)
    kvcache.kv_buffer = _views(pool.k_buffer, kvcache.size + kvcache.page_size, kvcache.store_dtype)
    state.POOL.set(kvcache, pool)


# -- release / resume ------------------------------------------------------------------


def release_all() -> None:
    """Release every live pool of this process (``pool.release()``: waits for device
    work, returns the physical memory, keeps every address)."""
    for pool in live_pools():
        if pool.released:
            continue
        t0 = time.perf_counter()
        before = pool.resident_bytes()
        pool.release()
        logger.info(
            "kvmem: released the KV pool (%.3f GiB resident before, %.3f after) in %.1f ms",
            before / 2**30,
            pool.resident_bytes() / 2**30,
            (time.perf_counter() - t0) * 1e3,
        )


def resume_all(prefault: bool) -> None:
    """Resume every released pool of this process: same addresses, epoch + 1."""
    for pool in live_pools():
        if not pool.released:
            continue
        t0 = time.perf_counter()
        pool.resume(prefault=prefault)
        logger.info(
            "kvmem: resumed the KV pool (epoch %d, %.3f GiB resident) in %.1f ms",
            pool.epoch,
            pool.resident_bytes() / 2**30,
            (time.perf_counter() - t0) * 1e3,
        )


# -- transfer registrations --------------------------------------------------------------


def coalesce(ptrs, lens) -> tuple[list[int], list[int]]:
    """Replace each range that lies inside a live kvmem pool by the pool region (one
    physical chunk) that holds it, each region once, in the order first needed.

    A pool's chunk plan keeps every sglang per-layer buffer inside one chunk (a K|V block
    of ``layout="sglang"``, or an MLA layer's buffer), so each of sglang's
    ``kv_data_ptrs`` ranges lies inside one region, and so does every page run sglang
    addresses in it.  A range that overlaps a pool's regions without lying inside one
    is refused (:class:`AdapterError` naming it): NIXL refuses a descriptor across two
    registrations, so the transfers would fail later.  Ranges outside every pool stay as
    they are (sglang's aux and state buffers), duplicates dropped."""
    regions = sorted(
        (p0, p0 + n) for pool in live_pools() if not pool.released for p0, n in pool.regions()
    )
    starts = [a for a, _ in regions]
    out: dict[tuple[int, int], None] = {}
    for ptr, n in zip(ptrs, lens):
        if n == 0:
            continue
        end = ptr + n
        i = bisect.bisect_right(starts, ptr) - 1
        if i >= 0 and end <= regions[i][1]:
            out.setdefault(regions[i], None)
            continue
        hit = [(a, b) for a, b in regions if a < end and ptr < b]
        if hit:
            raise AdapterError(
                f"the KV range [{ptr:#x}, {end:#x}) is not inside one kvmem pool region: it "
                f"overlaps {len(hit)} ({', '.join(f'[{a:#x}, {b:#x})' for a, b in hit[:3])}); "
                "NIXL would refuse its transfers"
            )
        out.setdefault((ptr, end), None)
    return [a for a, _ in out], [b - a for a, b in out]
