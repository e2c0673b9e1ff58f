"""KVSpec: the shape of a paged KV cache and every byte size derived from it.

Callers never re-compute a size: ask the spec.

Per layer (a *page* holds ``page_size`` consecutive tokens of one request)::

    k_buffer[l] : [num_pages, page_size, num_kv_heads, head_dim]    storage_dtype
    v_buffer[l] : [num_pages, page_size, num_kv_heads, v_head_dim]  storage_dtype

``v_head_dim`` defaults to ``head_dim``; ``v_head_dim=0`` means a K-only cache (MLA's
latent cache, where ``head_dim`` is e.g. 576 and ``num_kv_heads`` is 1).  fp8 caches are
stored as ``uint8`` (as sglang does): ``dtype`` keeps the fp8 type, ``storage_dtype`` is
``torch.uint8``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)
_PLAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8)
SUPPORTED_DTYPES = _PLAIN_DTYPES + _FP8_DTYPES


def _positive_int(name: str, value, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"KVSpec.{name} must be an int, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"KVSpec.{name} must be {bound}, got {value}")
    return value


@dataclass(frozen=True)
class KVSpec:
    """Model-side shape of a paged KV cache.

    Args:
        num_layers: attention layers holding KV.
        num_kv_heads: KV heads per layer (on this rank).
        head_dim: K head dim.
        page_size: tokens per page.
        dtype: float32, bfloat16, float16, an fp8 type (stored as uint8) or uint8.
        v_head_dim: V head dim; ``None`` = ``head_dim``; ``0`` = no V (K-only cache).

    Raises:
        ValueError: naming the field, for a zero/negative size or an unsupported dtype.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype = torch.bfloat16
    v_head_dim: int | None = None

    def __post_init__(self):
        _positive_int("num_layers", self.num_layers)
        _positive_int("num_kv_heads", self.num_kv_heads)
        _positive_int("head_dim", self.head_dim)
        _positive_int("page_size", self.page_size)
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        _positive_int("v_head_dim", self.v_head_dim, allow_zero=True)
        if self.dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
            raise ValueError(f"KVSpec.dtype {self.dtype} is not supported (supported: {names})")

    # --- element types -------------------------------------------------------------
    @property
    def storage_dtype(self) -> torch.dtype:
        """dtype of the buffers: ``uint8`` for fp8 caches, else ``dtype``."""
        return torch.uint8 if self.dtype in _FP8_DTYPES else self.dtype

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.storage_dtype).element_size()

    @property
    def v_dim(self) -> int:
        """``v_head_dim`` as an int (it is None only until construction sets it)."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def has_v(self) -> bool:
        return self.v_dim > 0

    # --- sizes of one token / one page, per layer -------------------------------------
    @property
    def k_token_bytes(self) -> int:
        """Bytes of one token's K in one layer: ``num_kv_heads * head_dim * itemsize``."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def v_token_bytes(self) -> int:
        return self.num_kv_heads * self.v_dim * self.itemsize

    @property
    def k_page_bytes(self) -> int:
        """Bytes of one page of K in one layer."""
        return self.page_size * self.k_token_bytes

    @property
    def v_page_bytes(self) -> int:
        return self.page_size * self.v_token_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers, K and V: what a page costs the pool."""
        return self.num_layers * (self.k_page_bytes + self.v_page_bytes)

    # --- sizes that depend on a page count ------------------------------------------
    def k_layer_bytes(self, num_pages: int) -> int:
        return num_pages * self.k_page_bytes

    def v_layer_bytes(self, num_pages: int) -> int:
        return num_pages * self.v_page_bytes

    def pool_bytes(self, num_pages: int) -> int:
        """Bytes of a pool of ``num_pages`` pages (the padding page 0 included)."""
        return num_pages * self.page_bytes

    def k_shape(self, num_pages: int) -> tuple[int, int, int, int]:
        return (num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def v_shape(self, num_pages: int) -> tuple[int, int, int, int]:
        return (num_pages, self.page_size, self.num_kv_heads, self.v_dim)
