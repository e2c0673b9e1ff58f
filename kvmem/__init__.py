"""kvmem: KV-cache memory for LLM serving.

Paged KV pools and an sglang-compatible page allocator, Triton kernels that pack a
request's scattered pages into one chunk (and back), pause/resume of the pool's physical
memory, and a prefill/decode-disaggregation lifecycle that frees every page exactly once.
``import kvmem`` never imports sglang.
"""

from kvmem.allocator import PageAllocator
from kvmem.errors import (
    ClosedPoolError,
    CudaDriverError,
    DoubleFreeError,
    KVMemError,
    OutOfPagesError,
    PoolMemoryError,
    ReleasedPoolError,
)
from kvmem.kernels.pack import pack_buffers, unpack_buffers
from kvmem.pool import KVPool, pack_pages, packed_nbytes, unpack_pages
from kvmem.spec import KVSpec

__all__ = [
    "KVSpec",
    "KVPool",
    "PageAllocator",
    "pack_pages",
    "unpack_pages",
    "packed_nbytes",
    "pack_buffers",
    "unpack_buffers",
    "KVMemError",
    "OutOfPagesError",
    "DoubleFreeError",
    "ReleasedPoolError",
    "ClosedPoolError",
    "PoolMemoryError",
    "CudaDriverError",
]
__version__ = "0.1.0"
