"""sglang's hybrid sliding-window KV cache under the flag: ``SWAKVPool`` and its
``SWATokenToKVPoolAllocator`` on kvmem (glue only).

Names below are of the installed sglang 0.5.23, paths under ``sglang/srt/mem_cache/``.

* Pool.  ``SWAKVPool`` (``swa_memory_pool.py``) holds no buffer of its own: it builds two
  inner pools, ``full_kv_pool`` (the full-attention layers, ``size`` tokens) and
  ``swa_kv_pool`` (the sliding-window layers, ``size_swa`` tokens), each an
  ``MHATokenToKVPool`` unless a model names other classes.  The adapter's pool hooks
  make each inner MHA (or MLA) pool a kvmem pool as they make any other, so the hybrid
  cache is two kvmem pools, both released and resumed by ``kvpool.release_all`` /
  ``resume_all`` with every other pool of the process.
* Allocator.  ``SWATokenToKVPoolAllocator`` (``allocator/swa.py``) composes two of
  sglang's token (page size 1) or paged allocators, ``full_attn_allocator`` and
  ``swa_attn_allocator``, one per inner pool, and keeps the full-to-SWA slot mapping
  (``full_to_swa_index_mapping``, registered with the pool) itself.  :func:`adopt` puts a
  :class:`~kvmem_sglang.allocator.KvmemTokenToKVPoolAllocator` in place of each inner
  allocator, built with the inner one's own arguments over its own inner pool; sglang's
  composite keeps everything else: the mapping, which side to ask, the window's frees.
  The composite calls on each inner allocator only what the token and paged allocators
  share with kvmem's (``alloc``, ``alloc_extend``, ``alloc_decode``, ``free``,
  ``free_page_ids``, ``free_segment``, the free groups, ``available_size``, ``clear``,
  ``size`` and, above page size 1, ``debug_mode``).  Its ``resize`` writes the inner
  allocators' sizes without rebuilding them; sglang calls it only after post-capture KV
  sizing, which the pool hooks refuse.
* Transfer.  A PD server registers the full pool's buffers as its KV
  (``SWAKVPool.get_contiguous_buf_infos``) and the SWA pool's as state buffers
  (``get_state_buf_infos``, state type SWA): the prefill sends the full layers' pages as
  KV (kvmem's send path, like any KV) and the last window's SWA pages as state, which
  sglang's own state send carries.  Registration: NIXL's ``register_buffer_to_engine``
  registers the state buffers beside the KV, and the adapter's deregistration
  (``kvmem_sglang.nixl.deregister``) drops its ``state_descs`` with the rest; Mooncake's
  ``_registerable_regions`` lists them, so the adapter's regions and its
  deregistration (``kvmem_sglang.mooncake``) cover them.

Refused (:class:`~kvmem_sglang.options.AdapterError`, at start): an SWA pool whose inner
pools are not both kvmem's, the per-request SWA ring (``swa_req_ring_size``: SWA slots
owned by request slots, not by the SWA allocator), and any composite or inner allocator
class other than the ones above (``PureSWATokenToKVPoolAllocator``, NPU and platform
allocators, the unified hybrid allocator).
"""

from __future__ import annotations

import logging

from kvmem_sglang import kvpool
from kvmem_sglang.options import AdapterError

logger = logging.getLogger("kvmem.sglang")

# the inner allocators of SWATokenToKVPoolAllocator and the inner pools they serve
SIDES = (("full_attn_allocator", "full_kv_pool"), ("swa_attn_allocator", "swa_kv_pool"))


def is_swa_pool(kvcache) -> bool:
    """Whether ``kvcache`` is sglang's hybrid ``SWAKVPool`` (exactly that class)."""
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    return type(kvcache) is SWAKVPool


def check_pool(kvcache) -> None:
    """Refuse an ``SWAKVPool`` kvmem does not back whole (before sglang builds its
    allocator)."""
    if getattr(kvcache, "swa_req_ring_size", None) is not None:
        raise AdapterError(
            "the SWAKVPool keeps a per-request SWA ring (swa_req_ring_size "
            f"{kvcache.swa_req_ring_size}), whose slots kvmem's allocator does not hand out"
        )
    stock = [
        f"{name} ({type(getattr(kvcache, name, None)).__name__})"
        for _, name in SIDES
        if kvpool.pool_of(getattr(kvcache, name, None)) is None
    ]
    if stock:
        raise AdapterError(
            f"the SWAKVPool's inner pool(s) {', '.join(stock)} are not kvmem pools (kvmem "
            "backs an SWAKVPool whose full and SWA pools are both MHA or MLA pools)"
        )


def adopt(stock, kvcache, check: bool | None):
    """Put kvmem's allocator in place of each inner allocator of sglang's
    ``SWATokenToKVPoolAllocator`` ``stock`` (built over ``kvcache``); ``stock`` itself,
    every page free and its mapping clear."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    from kvmem_sglang.allocator import KvmemTokenToKVPoolAllocator

    if type(stock) is not SWATokenToKVPoolAllocator:
        raise AdapterError(
            f"sglang chose the allocator {type(stock).__name__} for this SWAKVPool; kvmem "
            "replaces the inner allocators of SWATokenToKVPoolAllocator only"
        )
    made, replaced = {}, []
    for attr, pool_name in SIDES:
        inner, inner_pool = getattr(stock, attr), getattr(kvcache, pool_name)
        if type(inner) not in (TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator):
            raise AdapterError(
                f"sglang chose {type(inner).__name__} as the SWA allocator's {attr}; kvmem "
                "replaces only the token and paged ones"
            )
        pool = kvpool.pool_of(inner_pool)
        if pool is None:  # check_pool ran first; a caller that skipped it is refused here
            raise AdapterError(f"the SWAKVPool's {pool_name} is not a kvmem pool")
        if inner.page_size != pool.spec.page_size:
            raise AdapterError(
                f"the SWA allocator's {attr} has page size {inner.page_size}, its pool "
                f"{pool.spec.page_size}"
            )
        made[attr] = KvmemTokenToKVPoolAllocator(
            inner.size,
            inner.page_size,
            inner.dtype,
            inner.device,
            inner_pool,
            inner.need_sort,
            check=check,
        )
        replaced.append(type(inner).__name__)
    for attr, ours in made.items():
        setattr(stock, attr, ours)
    stock.clear()  # sglang's own: both inner allocators and the mapping
    full, swa = made["full_attn_allocator"], made["swa_attn_allocator"]
    logger.info(
        "kvmem: allocator SWATokenToKVPoolAllocator (sglang's) over KvmemTokenToKVPoolAllocator "
        "for its full side (%d pages of %d tokens) and its SWA side (%d pages), in place of "
        "%s and %s",
        full.num_pages,
        full.page_size,
        swa.num_pages,
        *replaced,
    )
    return stock
