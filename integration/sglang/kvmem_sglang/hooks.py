"""The hook functions the plugin registers (signatures are sglang's HookRegistry's:
AROUND ``hook(original, *args, **kwargs)``, AFTER ``hook(result, *args, **kwargs)``,
REPLACE ``hook(*args, **kwargs)``).  Each maps one sglang call onto kvmem; the work is in
:mod:`kvmem_sglang.kvpool`, :mod:`kvmem_sglang.allocator` and :mod:`kvmem_sglang.staging`."""

from __future__ import annotations

import logging

from kvmem_sglang import kvpool, staging, state, swa
from kvmem_sglang.options import AdapterError

logger = logging.getLogger("kvmem.sglang")


def _options():
    return state.PROCESS.options.active()


# -- KV pool ------------------------------------------------------------------------------


def mha_create_buffers(original, kvcache):
    kvpool.check_mha(kvcache)  # before sglang allocates anything
    return original(kvcache)


def mha_create_buffers_normal(kvcache):
    kvpool.create_mha_buffers(kvcache, _options())


def mla_create_buffers(kvcache):
    kvpool.create_mla_buffers(kvcache, _options())


# -- allocator ------------------------------------------------------------------------------


def build_allocator(original, configurator, *args, **kwargs):
    """Let sglang choose and build its allocator (so its own refusals and sizes hold),
    then put kvmem's in its place, or refuse what kvmem does not back."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

    from kvmem_sglang.allocator import KvmemTokenToKVPoolAllocator

    reused = kwargs.get("token_to_kv_pool_allocator")
    kvcache = kwargs.get("token_to_kv_pool")
    pool = kvpool.pool_of(kvcache)
    if reused is None and swa.is_swa_pool(kvcache):  # two kvmem pools, sglang's composite
        swa.check_pool(kvcache)
        return swa.adopt(
            original(configurator, *args, **kwargs), kvcache, True if _options().check else None
        )
    if reused is None and pool is None:  # refused before sglang builds anything
        raise AdapterError(
            f"the KV pool is a {type(kvcache).__name__}, which kvmem does not back (kvmem "
            "backs MHA and MLA pools and the hybrid SWA pool made of them; mamba/linear, "
            "quantized, DSA and sharded pools are refused)"
        )
    stock = original(configurator, *args, **kwargs)
    if reused is not None:  # a draft worker shares the target's allocator
        if not isinstance(stock, KvmemTokenToKVPoolAllocator):
            raise AdapterError(
                f"a draft worker reuses a {type(stock).__name__}, not kvmem's allocator"
            )
        return stock
    if type(stock) not in (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator):
        raise AdapterError(
            f"sglang chose the allocator {type(stock).__name__} for this "
            "configuration; kvmem replaces only the token and paged ones"
        )
    if stock.page_size != pool.spec.page_size:
        raise AdapterError(
            f"the allocator's page size {stock.page_size} differs from the "
            f"KV pool's {pool.spec.page_size} (decode context parallelism "
            "is not supported)"
        )
    # SGLANG_KVMEM_CHECK=1 checks every call on the host; else the allocator follows
    # sglang's SGLANG_DEBUG_MEMORY_POOL (checked) or defers checks to the device
    ours = KvmemTokenToKVPoolAllocator(
        stock.size,
        stock.page_size,
        stock.dtype,
        stock.device,
        kvcache,
        stock.need_sort,
        check=True if _options().check else None,
    )
    logger.info(
        "kvmem: allocator %s over %d pages of %d tokens (need_sort %s) in place of %s",
        type(ours).__name__,
        stock.size // stock.page_size,
        stock.page_size,
        stock.need_sort,
        type(stock).__name__,
    )
    return ours


# -- staging ------------------------------------------------------------------------------


def gather_all_layers_to_staging(*args, **kwargs):
    return staging.gather_all_layers_to_staging(*args, **kwargs)


def scatter_staging_to_kv(*args, **kwargs):
    return staging.scatter_staging_to_kv(*args, **kwargs)
